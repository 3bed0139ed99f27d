"""Every failure a user can cause or fix, as one family of exceptions.

Each CLI (`train.py`, `python -m maskrcnn_tut.lab.bench`, `python -m maskrcnn_tut.data.check`) catches
`UserError` and nothing else: it prints `error: <message>` as one line and exits with the error's
`exit_code`. Anything that is not a `UserError` is a bug of the package and keeps its traceback.

Exit codes: 2 bad settings, data, checkpoint or benchmark; 3 non-finite loss; 4 another rank failed;
143 (128 + SIGTERM, what schedulers expect) stopped by SIGTERM after saving a checkpoint.
"""
from __future__ import annotations

import sys


def print_error(message: str) -> None:
    """`error: <message>` on stderr in one write: `print` writes the line and its newline apart, so
    two ranks failing at once on one terminal or log can run their lines together."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


class UserError(Exception):
    """A failure the user can act on; the message says what went wrong and what to do."""

    exit_code = 2
    #: False: every rank meets it alike (bad settings or data at set-up), so only rank 0 prints it.
    rank_specific = False


class ConfigError(UserError, ValueError):
    """A setting that cannot work; the message names the flag and what is allowed."""


class OutOfSharedMemory(ConfigError):
    """/dev/shm is too small for the DataLoader workers: each rank meets it on its own (its own workers,
    its own queues, at its own moment), so each rank says so, naming itself."""

    rank_specific = True


class OutputError(UserError):
    """An output folder or file that cannot be written (read-only, full, a file where a folder should be):
    each rank meets it with its own writes, so each says so, naming itself."""

    rank_specific = True


class DataError(UserError, ValueError):
    """The dataset leaves nothing to train on (bad json, no usable images, fewer than one batch)."""


class CheckpointError(UserError):
    """A checkpoint or weights file that cannot be used; the message names the file and why."""


class BenchError(UserError):
    """A benchmark that cannot run here, or whose worker failed; the message says why."""


class NonFiniteLossError(UserError, FloatingPointError):
    """Raised on every rank at once when any rank's loss is NaN or infinite (each names its own terms)."""

    exit_code = 3
    rank_specific = True


class UnusedParametersError(UserError):
    """DDP found parameters that got no gradient; the message says which flag fixes it."""


class WorkerError(UserError):
    """A process started by `processes.launch` failed; the message says which and why in one
    line, `details` holds the worker's traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details

    def _render_traceback_(self) -> list[str]:
        """What IPython shows in a notebook: the worker's own traceback, then the one line."""
        return [*self.details.rstrip().splitlines(), f"WorkerError: {self}"]


class PeerFailure(UserError):
    """Another rank died or stopped answering within --dist-timeout, so this one stops too."""

    exit_code = 4
    rank_specific = True


class Preempted(UserError):
    """SIGTERM or SIGUSR1 arrived (a scheduler's preemption or time-limit warning): the run saved a
    checkpoint after the current step on every rank and stopped; nonzero, so a scheduler restarts it."""

    exit_code = 143


class RendezvousError(UserError):
    """The ranks could not join one group within --dist-timeout: a taken port, nothing answering
    at MASTER_ADDR:MASTER_PORT, or a rank that never came; the message says which and what to do."""

    rank_specific = True
