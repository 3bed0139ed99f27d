"""Before a long distributed run from a hub (JupyterHub, a Kubernetes pod, a container): is the box
big enough, can the processes talk fast enough, is every GPU healthy, and what to do when a run hangs.

- `shm_report()`: the size of `/dev/shm`, which DataLoader workers (every batch they hand over)
  and NCCL (its shared-memory transport between GPUs of one machine) need; a container gets 64 MB unless
  told otherwise (Docker's default, and the container runtime's under Kubernetes).
- `NCCL_VARIABLES`, `nccl_environment()`: the NCCL and torch variables worth knowing, and which
  of them this process has set.
- `preflight(nprocs)`: those, an all-reduce across the processes (`bench.communication.
  allreduce_bandwidth`: time per message size and the bus bandwidth it reached) and each GPU's
  health (`nvml.gpu_health`), as rows of (check, ok, finding, what to do).
- `diagnose_hang(...)`: a hang reproduced on purpose (one rank stalls in a loop before a
  collective, the others wait in it) and each rank's Python stack read from outside: with
  `py-spy dump --pid PID` where py-spy is installed, else with `faulthandler` through a signal.
  `classify_stack(text)` says which rank stalls and which wait.

What the checks and the hang's summary say comes from `prose/preflight.json`, in the book's language.
"""
from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from maskrcnn_tut.lab import processes
from maskrcnn_tut.lab.wording import english, joined, say

from .. import distributed as du
from ..hardware import gpu_count
from .bench.communication import allreduce_bandwidth
from .nvml import gpu_health

#: Below this /dev/shm is too small for a few DataLoader workers per GPU and NCCL's buffers.
MIN_SHM_MB = 1024
#: Docker's default /dev/shm.
DOCKER_DEFAULT_SHM_MB = 64

#: Each variable with the catalog keys of what it does and when to set it.
NCCL_VARIABLES = {
    "NCCL_DEBUG=INFO": ("preflight.does_NCCL_DEBUG", "preflight.when_NCCL_DEBUG"),
    "NCCL_SOCKET_IFNAME=eth0": ("preflight.does_NCCL_SOCKET_IFNAME", "preflight.when_NCCL_SOCKET_IFNAME"),
    "NCCL_IB_DISABLE=1": ("preflight.does_NCCL_IB_DISABLE", "preflight.when_NCCL_IB_DISABLE"),
    "NCCL_P2P_DISABLE=1": ("preflight.does_NCCL_P2P_DISABLE", "preflight.when_NCCL_P2P_DISABLE"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING=3": ("preflight.does_TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                          "preflight.when_TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    "TORCH_NCCL_BLOCKING_WAIT=1": ("preflight.does_TORCH_NCCL_BLOCKING_WAIT", "preflight.when_TORCH_NCCL_BLOCKING_WAIT"),
    "TORCH_NCCL_TRACE_BUFFER_SIZE=2000": ("preflight.does_TORCH_NCCL_TRACE_BUFFER_SIZE",
                                          "preflight.when_TORCH_NCCL_TRACE_BUFFER_SIZE"),
    "TORCH_NCCL_DESYNC_DEBUG=1": ("preflight.does_TORCH_NCCL_DESYNC_DEBUG", "preflight.when_TORCH_NCCL_DESYNC_DEBUG"),
    "TORCH_DISTRIBUTED_DEBUG=DETAIL": ("preflight.does_TORCH_DISTRIBUTED_DEBUG",
                                       "preflight.when_TORCH_DISTRIBUTED_DEBUG"),
}


# --------------------------------------------------------------------------- /dev/shm


def shm_report(path: str | Path = "/dev/shm") -> dict:
    """Total and free MiB of `path` and a verdict; `ok` is None when there is no such mount."""
    try:
        stats = os.statvfs(path)
    except OSError as err:
        return {"path": str(path), "ok": None, "total MiB": None, "free MiB": None,
                "finding": english("preflight.shm_missing", path=str(path), error=err.strerror), "fix": shm_fix()}
    total, free = stats.f_blocks * stats.f_frsize / 2**20, stats.f_bavail * stats.f_frsize / 2**20
    ok = total >= MIN_SHM_MB
    size = english("preflight.shm_size", path=str(path), total=total, free=free)
    finding = size if ok else joined(size, english("preflight.shm_too_small", docker=DOCKER_DEFAULT_SHM_MB))
    return {"path": str(path), "ok": ok, "total MiB": total, "free MiB": free, "finding": finding,
            "fix": "" if ok else shm_fix()}


def shm_fix() -> str:
    return english("preflight.shm_fix")


def shm_needed_mb(batch_mb: float, workers: int, prefetch_factor: int = 2, processes: int = 1) -> float:
    """Shared memory the loaders hold at once: each worker keeps `prefetch_factor` batches in flight,
    in every training process."""
    return batch_mb * max(workers, 0) * prefetch_factor * processes


def nccl_environment(environ: dict | None = None) -> list[dict]:
    """`NCCL_VARIABLES`, what each does and when to use it, and the value each has in this process
    (or `environ`), "" when unset."""
    environ = os.environ if environ is None else environ
    return [{"variable": variable, "what it does": say(does), "when": say(when),
             "set here": environ.get(variable.split("=")[0], "")} for variable, (does, when) in NCCL_VARIABLES.items()]


# --------------------------------------------------------------------------- the checks together


def preflight(nprocs: int | None = None, sizes_mb: tuple[float, ...] = (1.0, 16.0, 64.0),
              backend: str | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """(checks, bandwidth rows, GPU rows): /dev/shm, the NCCL variables set, an all-reduce across
    `nprocs` processes (default: one per GPU, else 2 gloo processes) and each GPU's health."""
    gpus = gpu_count()
    nprocs = nprocs or (gpus if gpus >= 2 else 2)
    backend = backend or (None if gpus >= 2 else "gloo")
    shm = shm_report()
    checks = [{"check": "/dev/shm", "ok": shm["ok"], "finding": shm["finding"], "what to do": shm["fix"]}]
    set_here = [row["variable"].split("=")[0] + "=" + row["set here"] for row in nccl_environment() if row["set here"]]
    # recorded in English (`english`), worded in the reader's language where shown: a build's Japanese chapter
    # reads back what its English chapter measured (stored.within_build)
    checks.append({"check": "NCCL / torch variables", "ok": True,
                   "finding": ", ".join(set_here) or english("preflight.none_set"),
                   "what to do": english("preflight.debug_first")})
    bandwidth = processes.launch(allreduce_bandwidth, nprocs, sizes_mb, backend=backend, timeout_s=120)
    top = max(bandwidth, key=lambda row: row["MB"])
    checks.append({"check": english("preflight.allreduce_check", processes=nprocs, backend=top["backend"]), "ok": True,
                   "finding": english("preflight.allreduce_finding", mb=top["MB"], ms=top["ms"],
                                      bandwidth=top["bus GB/s"]),
                   "what to do": english("preflight.allreduce_advice")})
    health = gpu_health()
    if health:
        bad = [row for row in health if not row["ok"]]
        checks.append({"check": english("preflight.gpus_check", gpus=len(health)), "ok": not bad,
                       "finding": "; ".join(f"GPU {r['gpu']}: {r['finding']}" for r in bad) or
                       english("preflight.all_healthy"), "what to do": "" if not bad else english("preflight.move_off")})
    else:
        checks.append({"check": "GPUs", "ok": None, "finding": english("preflight.no_gpu"), "what to do": ""})
    return checks, bandwidth, health


# --------------------------------------------------------------------------- a hang, diagnosed


def stalled_step(release: Path, limit_s: float) -> None:
    """The stalled rank's loop: waits for a file that only the diagnosis writes (a stand-in for a
    rank stuck reading data, or in an endless loop, while the others wait in the all-reduce)."""
    ends = time.monotonic() + limit_s
    while not release.exists() and time.monotonic() < ends:
        time.sleep(0.05)


def hang_demo(workdir: str, stall_rank: int = 1, limit_s: float = 60.0) -> dict:
    """Run inside `processes.launch`: every rank writes its PID, arms faulthandler on SIGUSR2
    (its stacks to `<workdir>/stack<rank>.txt`), then rank `stall_rank` loops in `stalled_step`
    while the others wait in an all-reduce; all finish once `<workdir>/release` exists."""
    info = du.info()
    folder = Path(workdir)
    stacks = open(folder / f"stack{info.rank}.txt", "w")  # noqa: SIM115 (open while the signal may come)
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    (folder / f"pid{info.rank}").write_text(str(os.getpid()))
    if info.rank == stall_rank:
        stalled_step(folder / "release", limit_s)
    total = du.all_reduce_sum(torch.ones(1))  # gloo, host memory: the demo needs no GPU
    faulthandler.unregister(signal.SIGUSR2)
    stacks.close()
    return {"all-reduce": float(total)}


def py_spy() -> str | None:
    """The py-spy next to this Python, else on PATH, else None."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stack(pid: int, stack_file: Path | None = None, tool: str | None = None) -> tuple[str, str]:
    """(tool, text): `py-spy dump --pid PID` where py-spy is installed (and `tool` is not
    "faulthandler"), else SIGUSR2 to a process whose faulthandler writes to `stack_file`."""
    spy = py_spy() if tool in (None, "py-spy") else None
    if spy:
        env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb"}
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30, env=env)
        if done.returncode == 0:
            return "py-spy", _ANSI.sub("", done.stdout)  # its colours, where it adds them anyway
    if stack_file is None:
        return "none", ""
    os.kill(pid, signal.SIGUSR2)
    for _ in range(40):
        time.sleep(0.05)
        if stack_file.exists() and stack_file.stat().st_size:
            break
    return "faulthandler", stack_file.read_text(errors="replace")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FRAME_PATTERNS = (re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)'),  # faulthandler
                   re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^:()]+):(?P<line>\d+)\)"))  # py-spy


def main_frames(text: str) -> list[tuple[str, str, int]]:
    """(function, file, line) of a dump's main thread (the one in `processes.launch`'s worker, or
    the first thread), innermost first; both py-spy's and faulthandler's formats."""
    blocks = [block for block in re.split(r"\n\s*\n|\n(?=(?:Current )?[Tt]hread )", text) if block.strip()]
    chosen = next((b for b in blocks if "_worker" in b), None) or next((b for b in blocks if "MainThread" in b), "")
    chosen = chosen or (blocks[0] if blocks else "")
    frames = []
    for line in chosen.splitlines():
        for pattern in _FRAME_PATTERNS:
            match = pattern.search(line)
            if match:
                frames.append((match["func"], match["file"], int(match["line"])))
                break
    return frames


def _in_torch(file: str, under: str = "") -> bool:
    """Whether a frame's file is torch's (py-spy shows paths relative to site-packages)."""
    return re.search(rf"(^|/)torch/{under}", file) is not None


def _stdlib(file: str) -> bool:
    return file.startswith(("<", "multiprocessing/", "threading.py", "concurrent/")) or (
        "/lib/python" in file and "site-packages" not in file)


def classify_stack(text: str) -> dict:
    """Whether a rank's stack waits in a collective (a frame in torch.distributed) or is stuck
    elsewhere, and where: the innermost frame outside torch, the standard library and `launch`."""
    frames = main_frames(_ANSI.sub("", text))
    waiting = any(_in_torch(file, "distributed/") for _, file, _ in frames)
    collective = next((func for func, file, _ in frames if _in_torch(file, "distributed/") and func not in
                       ("wrapper", "_fn", "inner")), None)
    own = [(func, file, line) for func, file, line in frames if not _in_torch(file) and not _stdlib(file)
           and not file.endswith("maskrcnn_tut/distributed.py")]
    where = own[0] if own else (frames[0] if frames else ("?", "?", 0))
    return {"waiting in a collective": waiting, "collective": collective, "function": where[0],
            "file": Path(where[1]).name, "line": where[2], "frames": len(frames)}


def diagnose_hang(nprocs: int = 2, stall_rank: int = 1, after_s: float = 2.0, tool: str | None = None,
                  backend: str = "gloo") -> dict:
    """Reproduce a hang and read every rank's stack from outside while it hangs: `hang_demo` in
    `nprocs` processes (one stalls), each rank dumped `after_s` seconds after all have started,
    then released so the group ends cleanly. Returns the tool used ("py-spy" or "faulthandler"),
    each rank's dump and `classify_stack` of it."""
    workdir = Path(tempfile.mkdtemp(prefix="maskrcnn_tut-hang-"))
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = processes.launch(hang_demo, nprocs, str(workdir), stall_rank, 60.0, backend=backend,
                                          timeout_s=90)
        except Exception as err:  # reported below, after the release
            outcome["error"] = err

    thread = threading.Thread(target=run, name="hang-demo", daemon=True)
    thread.start()
    try:
        ends = time.monotonic() + 60
        while not all((workdir / f"pid{r}").exists() for r in range(nprocs)):
            if time.monotonic() > ends or not thread.is_alive():
                raise RuntimeError(f"the hang demo's processes did not start: {outcome.get('error')}")
            time.sleep(0.05)
        time.sleep(after_s)
        ranks = []
        for rank in range(nprocs):
            pid = int((workdir / f"pid{rank}").read_text())
            used, text = dump_stack(pid, workdir / f"stack{rank}.txt", tool)
            ranks.append({"rank": rank, "pid": pid, "tool": used, "dump": text, **classify_stack(text)})
    finally:
        (workdir / "release").write_text("go")
        thread.join(timeout=120)
        shutil.rmtree(workdir, ignore_errors=True)
    if "error" in outcome:
        raise outcome["error"]
    return {"tool": ranks[0]["tool"], "ranks": ranks, "stall_rank": stall_rank, "result": outcome.get("result")}


def hang_summary(diagnosis: dict) -> list[str]:
    """One line per rank of `diagnose_hang`'s result: which one stalls (look there) and which wait."""
    lines = []
    for rank in diagnosis["ranks"]:
        if rank["waiting in a collective"]:
            lines.append(say("preflight.victim", rank=rank["rank"], collective=rank["collective"], function=rank["function"],
                              file=rank["file"]))
        else:
            lines.append(say("preflight.culprit", rank=rank["rank"], function=rank["function"], file=rank["file"]))
    return lines
