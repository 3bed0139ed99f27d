"""Preemption as schedulers deliver it, to a 2-process run with 2 DataLoader workers per process.

Kubernetes signals the pod's first process (torchrun), which sends SIGTERM on to each rank's process
group; SLURM signals every process of the job step (torchrun, ranks and loader workers) with SIGTERM,
or SIGUSR1 for `#SBATCH --signal=USR1@N`. A run is stopped again and again, each time another way,
and resumed with `--resume auto`: each stop keeps the step reached, says so in one line and shows no
traceback of the package; the run then finishes with each step logged once.
"""
import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, run_flags, run_train, subprocess_env, train_command

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.monitor import read_jsonl

pytestmark = pytest.mark.system

FAULTY_TRAIN = REPO / "tests" / "faulty_train.py"
TOTAL_STEPS = 8
PACKAGE_TRACEBACK = re.compile(r'File ".*maskrcnn_tut/')


def _parent(pid: int) -> int | None:
    """The parent of `pid`, or None once it has ended (a zombie counts as ended)."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return None
    return None if state == "Z" else int(ppid)


def _job(launcher: int) -> list[int]:
    """torchrun's pid, then its ranks', then their DataLoader workers' (what SLURM signals)."""
    parents = {int(p.name): _parent(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    job = [launcher]
    for pid in job:
        job.extend(child for child, parent in parents.items() if parent == pid)
    return job


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _steps_logged(out: Path) -> list[int]:
    return [row["step"] for row in read_jsonl(out / "metrics.jsonl")] if (out / "metrics.jsonl").exists() else []


def _wait_for(ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _flags(data: Path, out: Path) -> list[str]:
    return run_flags(data, out, "--workers", "2", "--max-steps", str(TOTAL_STEPS), "--checkpoint-every", "2",
                     "--resume", "auto")


def _run_until(flags: list[str], out: Path, log: Path, moment: str) -> tuple[subprocess.Popen, list[int]]:
    """Start (or resume) the run under torchrun; return it at `moment` ("training": a step of its
    own logged; "save" or "evaluation": within one), with the job's processes."""
    marker = out.parent / f"within-{moment}"
    pauses = {"save": ["--pause-in-save", str(marker)], "evaluation": ["--pause-in-eval", str(marker)]}.get(moment, [])
    logged = len(_steps_logged(out))
    marker.unlink(missing_ok=True)
    with open(log, "w") as sink:
        proc = subprocess.Popen(train_command(*flags, nproc=2, script=[str(FAULTY_TRAIN), *pauses, "--"]),
                                stdout=sink, stderr=subprocess.STDOUT, env=subprocess_env(), start_new_session=True)
    try:
        _wait_for(marker.exists if pauses else lambda: len(_steps_logged(out)) > logged)
        assert proc.poll() is None, log.read_text()[-3000:]
        job = _job(proc.pid)
        assert len(job) >= 7, job  # torchrun, 2 ranks, 2 loader workers each
    except BaseException:
        _kill(_job(proc.pid))
        raise
    return proc, job


def _stopped(proc: subprocess.Popen, job: list[int], log: Path) -> str:
    """Wait for every process of the job (ranks outlive a torchrun that died of SIGUSR1); its output."""
    try:
        _wait_for(lambda: all(_parent(pid) is None for pid in job[1:]) and proc.poll() is not None, timeout=120)
    finally:
        _kill([pid for pid in job if _parent(pid) is not None])
    output = log.read_text()
    assert not PACKAGE_TRACEBACK.search(output), output[-3000:]
    return output


def _stop_each_way_then_finish(ways: list[tuple[signal.Signals, str, str]], data: Path, tmp_path: Path) -> None:
    """Stop the run in each of `ways` (the signal, to whom, when), resuming it each time; then finish it."""
    out = tmp_path / "run"
    for number, (signum, whom, moment) in enumerate(ways):
        log = tmp_path / f"stop{number}.log"
        proc, job = _run_until(_flags(data, out), out, log, moment)
        for pid in reversed(job) if whom == "every process" else job[:1]:  # the loader workers first
            os.kill(pid, signum)
        output = _stopped(proc, job, log)
        stops = [line for line in output.splitlines() if line.startswith("error: stopped ")]
        steps = _steps_logged(out)
        cause = "because torchrun" if (signum, whom) == (signal.SIGUSR1, "torchrun") else f"by {signum.name}"
        if moment == "evaluation":
            assert stops == [f"error: stopped {cause} at the final evaluation: step {TOTAL_STEPS}, the last, is "
                             f"saved in {out / 'checkpoints'}; --resume auto scores it"], output[-3000:]
        else:
            assert len(stops) == 1 and stops[0].startswith(f"error: stopped {cause}"), output[-3000:]
            assert f"after step {steps[-1]}: checkpoint saved" in stops[0]
        assert ckpt.load(out / "checkpoints" / "last.pt")["state"]["step"] == steps[-1]  # the step reached
        if (signum, whom) == (signal.SIGTERM, "torchrun"):
            assert proc.returncode == 1  # torchrun's own code after SIGTERM; the ranks exited 143
    finished = run_train(*_flags(data, out), nproc=2, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert _steps_logged(out) == list(range(1, TOTAL_STEPS + 1))
    assert [row["step"] for row in read_jsonl(out / "eval.jsonl")] == [TOTAL_STEPS]


def test_slurm_signals_to_every_process_keep_the_step_reached(small_shapes, tmp_path):
    """SLURM signals torchrun, the ranks and the loader workers (sent here the workers first):
    torchrun dies of SIGUSR1 (`--signal=USR1@N`), the ranks save; SIGTERM (preemption, scancel)."""
    _stop_each_way_then_finish([(signal.SIGUSR1, "every process", "training"),
                                (signal.SIGTERM, "every process", "save")], small_shapes, tmp_path)


def test_kubernetes_and_launcher_signals_keep_the_step_reached(small_shapes, tmp_path):
    """Kubernetes signals the pod's first process, torchrun, which forwards SIGTERM; SIGUSR1 to torchrun
    alone ends it, and its ranks notice; SIGTERM in the final evaluation stops it at once."""
    _stop_each_way_then_finish([(signal.SIGTERM, "torchrun", "training"),
                                (signal.SIGUSR1, "torchrun", "training"),
                                (signal.SIGTERM, "torchrun", "evaluation")], small_shapes, tmp_path)
