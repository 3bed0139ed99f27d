"""Stopping when a scheduler says so: SIGTERM, SIGUSR1 (`#SBATCH --signal=USR1@N`), or a dead launcher.

SLURM signals every process of a job step; Kubernetes signals torchrun, which sends SIGTERM on to each
rank's process group (the rank and its DataLoader workers, which leave it to their rank). torchrun
forwards only its `--signals-to-handle` (SIGTERM, SIGINT, SIGHUP, SIGQUIT): SIGUSR1 ends it at once
and leaves its ranks running, so a rank that torchrun started also stops when its launcher is gone.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

from . import distributed as du
from .errors import Preempted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_POLL_S = 1.0
#: The process that started this one, read at import so that a launcher dying during set-up counts.
LAUNCHER = os.getppid()


class _StopNow(BaseException):
    """Raised by a signal within `at_once`: past any `except Exception` (a decoder's) to `at_once`."""


class StopRequest:
    """While open (in the main thread), a stop signal or the launcher's end sets `cause` instead of
    ending the process: the loop finishes the step on every rank, saves it and stops; within
    `at_once` (nothing left to save) it raises `Preempted` there and then."""

    def __init__(self):
        self.cause: str | None = None  # why this rank was asked to stop, e.g. "by SIGTERM"
        self._at_once, self._closed, self._previous = False, threading.Event(), {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
            if "TORCHELASTIC_RUN_ID" in os.environ:
                threading.Thread(target=self._watch_launcher, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum, frame) -> None:
        self.cause = self.cause or f"by {signal.Signals(signum).name}"
        if self._at_once:
            raise _StopNow

    def _watch_launcher(self) -> None:
        """Once the launcher is gone, ask to stop through the main thread's signal handler."""
        while not self._closed.wait(LAUNCHER_POLL_S):
            if os.getppid() != LAUNCHER:
                self.cause = self.cause or f"because torchrun (pid {LAUNCHER}) ended"
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def agreed_cause(self) -> str | None:
        """The cause of the first rank asked to stop, or None (a collective: every rank calls it)."""
        return next((cause for cause in du.all_gather_objects(self.cause) if cause), None)

    @contextlib.contextmanager
    def at_once(self, situation: str):
        """Within, a stop signal raises `Preempted("stopped <cause> <situation>")` at once."""
        self._at_once = True
        try:
            yield
        except _StopNow:
            raise Preempted(f"stopped {self.cause} {situation}") from None
        finally:
            self._at_once = False
