"""processes.launch under faults: a hung worker, a killed kernel, a killed worker's children.

Each test bounds itself (a SIGALRM in-process, or a subprocess it kills), so that without the fixes
it fails instead of hanging, and each kills whatever it recorded at the end. Processes are read
from /proc (psutil is not a dependency). The worker functions below are importable by the spawned
children because pytest puts tests/ on sys.path, which `spawn` hands down to them.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, subprocess_env

from maskrcnn_tut import distributed as du
from maskrcnn_tut.errors import WorkerError
from maskrcnn_tut.lab import processes

pytestmark = [pytest.mark.system, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

TESTS = Path(__file__).resolve().parent
SLEEPER = [PYTHON, "-c", "import time; time.sleep(600)"]


# --------------------------------------------------------------------------- /proc helpers

def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state, ppid, pgrp, ...); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")  # a zombie has ended


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _in_group(pgid: int) -> list[int]:
    return [pid for pid in _all_pids() if (f := _stat(pid)) and int(f[2]) == pgid and f[0] not in ("Z", "X")]


def _children(pid: int) -> list[int]:
    return [p for p in _all_pids() if (f := _stat(p)) and int(f[1]) == pid]


def _wait_gone(pids, seconds: float) -> list[int]:
    ends = time.monotonic() + seconds
    while time.monotonic() < ends and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_all(pids) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _wait_for_files(paths, seconds: float, proc=None) -> None:
    ends = time.monotonic() + seconds
    while not all(p.exists() and p.read_text().endswith("\n") for p in paths):
        assert time.monotonic() < ends, f"workers did not start within {seconds} s"
        assert proc is None or proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)


@contextlib.contextmanager
def _alarm(seconds: int):
    """Raise TimeoutError in the main thread after `seconds` (launch's cleanup then runs)."""
    def ring(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------- worker functions

def rank_one_sleeps() -> str:
    if du.info().rank == 1:
        time.sleep(1e6)  # hangs outside any collective, after rank 0 has returned
    return "rank 0 done"


def rank_one_sleeps_rank_zero_waits() -> None:
    if du.info().rank == 1:
        time.sleep(1e6)
    du.barrier()  # rank 0 waits for it in a collective


def result_then_a_shutdown_that_holds_the_gil() -> str:
    """Returns, then its shutdown blocks in C holding the GIL (as torch 2.6's gloo destructor did)."""
    import ctypes
    processes.shutdown = lambda: ctypes.PyDLL(None).sleep(600)  # a PyDLL call keeps the GIL
    return "reported"


def record_pids_then_sleep(folder: str) -> None:
    """Each rank starts a child, writes its own pid and the child's, then sleeps."""
    child = subprocess.Popen(SLEEPER)
    Path(folder, f"rank{du.info().rank}").write_text(f"{os.getpid()} {child.pid}\n")
    time.sleep(1e6)


def rank_zero_with_children_rank_one_killed(folder: str) -> None:
    """Rank 0 iterates a DataLoader with a worker process and starts a sleeping child; once it has
    written their pids, rank 1 is SIGKILLed."""
    rank, marker = du.info().rank, Path(folder, "rank0")
    if rank == 0:
        loader = torch.utils.data.DataLoader(list(range(64)), batch_size=1, num_workers=1)
        batches = iter(loader)
        next(batches)
        child = subprocess.Popen(SLEEPER)
        marker.with_suffix(".tmp").write_text(f"{os.getpid()} {child.pid} {batches._workers[0].pid}\n")
        marker.with_suffix(".tmp").rename(marker)
        time.sleep(1e6)
    while not marker.exists():
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- tests

def test_a_worker_hung_outside_a_collective_ends_launch_at_its_deadline():
    started = time.monotonic()
    with _alarm(60), pytest.raises(WorkerError) as caught:
        processes.launch(rank_one_sleeps, 2, timeout_s=12)
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message and "launch timed out after 12 s" in message, message
    assert "worker 1 hung at" in message and "rank_one_sleeps" in message and "worker 0" not in message, message
    assert "time.sleep" in caught.value.details or "rank_one_sleeps" in caught.value.details
    assert elapsed < 12 + 10, f"launch took {elapsed:.1f} s"
    assert __import__("multiprocessing").active_children() == []


def test_a_hang_names_the_hung_rank_not_the_one_waiting_for_it():
    with _alarm(60), pytest.raises(WorkerError) as caught:
        processes.launch(rank_one_sleeps_rank_zero_waits, 2, timeout_s=12)
    message = str(caught.value)
    assert "worker 1 hung at" in message and "worker 0 waited for it in a collective" in message, message


def test_a_result_reaches_launch_though_shutdown_then_blocks_holding_the_gil():
    started = time.monotonic()
    with _alarm(60):
        assert processes.launch(result_then_a_shutdown_that_holds_the_gil, 1, timeout_s=20) == "reported"
    assert time.monotonic() - started < 20, "launch waited for its deadline: the result stayed in the worker"
    assert __import__("multiprocessing").active_children() == []


def test_workers_and_their_children_end_when_the_launching_process_is_killed(tmp_path):
    script = ("import os, sys; sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]\n"
              "import test_notebook_launcher_faults as t\n"
              "from maskrcnn_tut.lab.processes import launch\n"
              "launch(t.record_pids_then_sleep, 2, sys.argv[2], timeout_s=120)\n")
    kernel = subprocess.Popen([PYTHON, "-c", script, str(TESTS), str(tmp_path)], env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    recorded: list[int] = []
    try:
        files = [tmp_path / "rank0", tmp_path / "rank1"]
        _wait_for_files(files, 60, kernel)
        recorded = [int(pid) for f in files for pid in f.read_text().split()]
        recorded += _children(kernel.pid)  # the workers again, and multiprocessing's resource tracker
        assert len(set(recorded)) >= 5, recorded  # 2 workers, their 2 children, the tracker
        os.kill(kernel.pid, signal.SIGKILL)  # what restarting a Jupyter kernel does
        kernel.wait()
        left = _wait_gone(set(recorded), 5)
        assert left == [], f"still running after the kernel died: {left}"
    finally:
        kernel.kill()
        _kill_all(recorded)


def test_a_killed_worker_takes_no_children_of_any_worker_with_it(tmp_path):
    recorded: list[int] = []
    try:
        with _alarm(60), pytest.raises(WorkerError, match="worker 1 died with exit code -9"):
            processes.launch(rank_zero_with_children_rank_one_killed, 2, str(tmp_path), timeout_s=120)
        recorded = [int(pid) for pid in (tmp_path / "rank0").read_text().split()]
        assert len(recorded) == 3  # rank 0, its sleeping child, its DataLoader worker
        left = _wait_gone(recorded, 2.0)
        assert left == [], f"still running after launch returned: {left}"
        assert _in_group(recorded[0]) == []  # nothing of rank 0's process group either
    finally:
        _kill_all(recorded)
