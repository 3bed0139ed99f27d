"""A notebook launcher: `launch(fn, n, ...)` runs `fn` in n fresh processes joined in one group.

What chapters and benchmarks use to start gloo (or nccl) groups from a Jupyter cell: workers are
spawned, their prints come back prefixed with their rank, a worker's exception comes back as one
`WorkerError` line, and one deadline bounds the whole call (a hung worker is named from its stack).
Training itself is started by torchrun; this is the lab's way to start small groups.
"""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .. import distributed as du
from ..distributed import barrier, init_distributed, shutdown
from ..errors import WorkerError
from ..hardware import gpu_count
from .nvml import exclusive_gpu_held

_STACKS = None  # a launch worker's stack-dump file (see _worker)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _QueueWriter:
    """File-like object that forwards a worker's prints, line by line, to the parent."""

    def __init__(self, messages, rank: int):
        self.messages, self.rank, self.buffer = messages, rank, ""

    def write(self, text: str) -> int:
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            self.messages.put(("line", self.rank, line))
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self.messages.put(("line", self.rank, self.buffer))
            self.buffer = ""

    def isatty(self) -> bool:
        return False


def _end_group(*_) -> None:
    """SIGTERM or the parent's death in a worker: end its whole process group (itself included)."""
    if os.getpid() != os.getpgrp():  # a forked child that inherited the handler: just die
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os.killpg(0, signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    _end_group()


def _worker(rank, nprocs, port, backend, timeout_s, fn, args, messages, parent, stack_file) -> None:
    # a process group of its own, which launch ends whole (DataLoader workers and other children
    # too), ended also when the launching process dies: Linux's parent-death signal, and a thread
    # watching the parent for a main thread busy inside C; on SIGUSR1 its stacks go to `stack_file`
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes
        signal.signal(signal.SIGTERM, _end_group)
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    global _STACKS
    _STACKS = open(stack_file, "w")  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent,), name="maskrcnn_tut-parent-watch", daemon=True).start()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stdout = sys.stderr = _QueueWriter(messages, rank)
    try:
        init_distributed(backend, timeout_s)
        barrier()  # every rank has joined: one that returns at once cannot break a peer's gloo connect
        result = fn(*args)
        try:  # pickled here: the queue pickles in a background thread, where a failure would be lost
            payload = pickle.dumps(result if rank == 0 else None)
        except Exception as err:
            raise TypeError(f"{getattr(fn, '__name__', fn)} returned a {type(result).__name__}, which cannot be sent back "
                            f"to the launching process ({err}); return plain data") from err
        messages.put(("result", rank, payload))
    except BaseException:  # report everything, SystemExit included, to the parent
        messages.put(("error", rank, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        # the report reaches the pipe before shutdown, which can block for good: torch 2.6's gloo joins its
        # threads (one stuck in a collective a failed peer left) holding the GIL, which the queue's feeder needs
        messages.close()
        messages.join_thread()
        shutdown()


def _hang_report(procs, unfinished: list[int], stack_files: list[Path], timeout_s: float) -> tuple[str, str]:
    """One line naming the worker(s) that hung, not those waiting for them in a collective (from the
    innermost frame outside torch and this module of each one's stack dump); the dumps."""
    for r in unfinished:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    dumps, hung, waiting = {}, [], []
    for r in unfinished:
        dumps[r] = stack_files[r].read_text(errors="replace") if stack_files[r].exists() else ""
        main = next((block for block in dumps[r].split("\n\n") if " in _worker" in block), dumps[r])
        frames = [line.strip()[5:].replace('"', "") for line in main.splitlines() if line.strip().startswith("File ")]
        own = [f for f in frames if "/torch/" not in f and __file__ not in f]
        (waiting if any("/torch/distributed/" in f for f in frames) else hung).append((r, own[0] if own else "?"))
    line = "; ".join([f"worker {r} hung at {where}" for r, where in hung or waiting]
                     + [f"worker {r} waited for it in a collective" for r, _ in waiting if hung])
    details = "\n\n".join(f"worker {r}:\n{dump}" for r, dump in dumps.items())
    return (f"launch timed out after {timeout_s:g} s (timeout_s): {line}; every worker was stopped "
            "(pass a larger timeout_s if the work needs longer)", details)


def _stop_groups(procs) -> None:
    """End every worker's process group (a finished worker's leftover children too): SIGTERM, up to
    2 s to exit, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        for p in procs:
            for kill in (os.killpg, os.kill) if p.is_alive() else (os.killpg,):
                with contextlib.suppress(OSError):  # no such group: gone, or not yet its own leader
                    kill(p.pid, sig)
        ends = time.monotonic() + wait
        for p in procs:
            p.join(timeout=max(0.0, ends - time.monotonic()))


@dataclass
class _Outcome:
    """What the launching process has heard from its workers so far."""

    result: Any = None  # rank 0's return value
    finished: set = field(default_factory=set)  # ranks that reported a result or an error
    error: str | None = None  # the one line of the WorkerError to raise
    details: str = ""  # its details: a worker's traceback, or every hung worker's stacks

    def take(self, kind: str, rank: int, payload) -> None:
        """A worker's report: its result, or its error (the last line of its traceback)."""
        if kind == "error":
            self.error, self.details = f"worker {rank} failed: {payload.strip().splitlines()[-1]}", payload
            self.finished.add(rank)
        elif kind == "result":
            self.finished.add(rank)
            if rank == 0:
                self.result = pickle.loads(payload)


def _show(prefix_output: bool, kind: str, rank: int, payload) -> None:
    """A line a worker printed, printed here (prefixed with its rank); other messages show nothing."""
    if kind == "line":
        print(f"[rank {rank}] {payload}" if prefix_output else payload, flush=True)


def _collect(procs, messages, outcome: _Outcome, deadline: float, show: Callable,
             hang_report: Callable[[list[int]], tuple[str, str]]) -> None:
    """Read the workers' messages into `outcome` until every worker has finished, or one failed,
    died without reporting, or the deadline passed (`hang_report` names who hung)."""
    nprocs = len(procs)
    while len(outcome.finished) < nprocs and outcome.error is None:
        left = deadline - time.monotonic()
        if left <= 0:
            outcome.error, outcome.details = hang_report([r for r in range(nprocs) if r not in outcome.finished])
            return
        try:
            kind, rank, payload = messages.get(timeout=min(0.2, left))
        except queue.Empty:  # nothing pending: a worker that has exited without reporting is dead
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in outcome.finished]
            if dead:
                outcome.error = (f"worker {dead[0]} died with exit code {procs[dead[0]].exitcode} without reporting "
                                 "(if it failed while starting: a script that calls launch needs "
                                 "`if __name__ == '__main__':`)")
            continue
        show(kind, rank, payload)
        outcome.take(kind, rank, payload)


def _wind_down(nprocs: int, started: list, messages, outcome: _Outcome, deadline: float, show: Callable) -> None:
    """Let finished workers exit (reading their last lines meanwhile), stop the others and every
    worker's process group, and drain the queue; a worker that died silently is named in the error
    first, as the cause of its peers' errors (e.g. "Connection reset by peer")."""
    grace = time.monotonic() + (5.0 if outcome.error is None and len(outcome.finished) == nprocs else 0.5)
    while time.monotonic() < min(grace, deadline + 1.0) and any(p.is_alive() for p in started):
        try:
            show(*messages.get(timeout=0.05))
        except queue.Empty:
            pass
    silent = [f"worker {r} died with exit code {p.exitcode} without reporting"
              for r, p in enumerate(started) if p.exitcode not in (None, 0) and r not in outcome.finished]
    if outcome.error is not None and silent and not outcome.error.startswith(silent[0]):
        outcome.error = "; ".join(silent) + "; then " + outcome.error
    _stop_groups(started)
    while True:  # drain, so the queue's feeder thread can exit
        try:
            show(*messages.get_nowait())
        except (queue.Empty, EOFError, OSError):
            break
    messages.close()


def launch(fn, nprocs: int, *args, backend: str | None = None, timeout_s: float = 1800.0,
           prefix_output: bool = True):
    """Run `fn(*args)` in `nprocs` fresh processes joined in one group; return rank 0's result.

    Works from a Jupyter cell: workers are spawned (not forked), their prints appear in the cell
    as `[rank r] ...`, and a worker's exception is raised here as a one-line `WorkerError` (its
    traceback in `.details`, shown by IPython) after every worker has been stopped. `fn` must be
    importable (defined in a module). `timeout_s` bounds the whole call (and each collective):
    past it every worker is stopped and the `WorkerError` names the rank that hung (stacks in
    `.details`). Workers are not daemons, so they may start DataLoader workers; each worker's whole
    process group is ended, and workers end themselves when the launching process dies.
    """
    import multiprocessing as mp
    import tempfile

    held = exclusive_gpu_held()
    if held is not None:
        raise WorkerError(f"GPU {held} is in EXCLUSIVE_PROCESS compute mode and this process already holds it, so "
                          "worker processes cannot start there: restart the kernel and run this cell before any "
                          "that uses the GPU in the kernel itself, or ask for the DEFAULT mode (nvidia-smi -c 0)")
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port, deadline = free_port(), time.monotonic() + timeout_s
    stacks = Path(tempfile.mkdtemp(prefix="maskrcnn_tut-launch-"))
    stack_files = [stacks / f"rank{r}.txt" for r in range(nprocs)]
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, backend, timeout_s, fn, args, messages,
                                                os.getpid(), str(stack_files[r]))) for r in range(nprocs)]
    show = functools.partial(_show, prefix_output)
    outcome, started = _Outcome(), []
    try:
        for p in procs:
            p.start()
            started.append(p)
        _collect(procs, messages, outcome, deadline, show,
                 lambda unfinished: _hang_report(procs, unfinished, stack_files, timeout_s))
    finally:
        _wind_down(nprocs, started, messages, outcome, deadline, show)
        shutil.rmtree(stacks, ignore_errors=True)
    if outcome.error is not None:
        raise WorkerError(outcome.error, outcome.details)
    return outcome.result


def process_report() -> list[dict] | None:
    """Run inside `processes.launch`: each rank's place in the group and one all-reduce, gathered."""
    info = du.info()
    total = du.all_reduce_sum(torch.tensor([info.rank + 1.0], device=info.device))
    mine = {"rank": info.rank, "local rank": info.local_rank, "world size": info.world_size,
            "backend": info.backend, "device": str(info.device), "CPU threads": torch.get_num_threads(),
            "process id": os.getpid(), "all-reduce of rank + 1": float(total)}
    return du.all_gather_objects(mine)


def demo_processes() -> tuple[int, str | None]:
    """(processes, backend) for the chapters' multi-process demos: one per GPU (nccl) with two or
    more GPUs, else two gloo processes (two GPU processes cannot share one GPU under nccl)."""
    gpus = gpu_count()
    return (gpus, None) if gpus >= 2 else (2, "gloo")
