"""A run's output folder: one run at a time, and an earlier run set aside whole, never mixed or lost.

- `claim(out, info)`: rank 0 takes an exclusive lock on `out/.lock` and writes who holds it; a
  second run on the same folder stops with one line naming the holder. Every rank learns the
  outcome, so no rank trains alone. The lock lasts while the run does (`releasing`, around
  `train.run`): a notebook that runs again in the same folder, or a run after it, finds it free.
- `check_layout(out)`: the folder's entries have the kinds a run writes (`checkpoints` a folder,
  `metrics.jsonl` a file, ...), else one line before any work.
- `set_aside_earlier_run(out)`: a fresh run (no `--resume`) in a used folder moves every file of
  the earlier run into `out/earlier-<date-time>/` instead of deleting or overwriting them.
- `drop_replayed_rows(out, step)`: a resumed run replays the steps after its checkpoint; their
  rows are removed from `metrics.jsonl` / `eval.jsonl` so the log holds each step once.
"""
from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import socket
import time
from pathlib import Path

from . import distributed as du
from .errors import ConfigError

#: What a run writes into its output folder, and whether each is a folder.
RUN_ENTRIES = {"config.json": False, "metrics.jsonl": False, "eval.jsonl": False, "summary.json": False,
               "checkpoints": True, "tensorboard": True}
LOG_FILES = ("metrics.jsonl", "eval.jsonl")
LOCK_NAME = ".lock"

log = logging.getLogger(__name__)
_held = []  # open lock files of this process (a lock lasts as long as its file stays open)


def _lock(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / LOCK_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(f"--output-dir {out} is in use by another run ({holder}); wait for it to finish "
                          "or give another --output-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held.append(handle)


def claim(out: Path, info: du.DistInfo) -> None:
    """Lock `out` for this run (rank 0) and check its layout; every rank raises the same error."""
    problem = None
    if info.is_main:
        try:
            _lock(out)
            check_layout(out)
        except ConfigError as err:
            problem = str(err)
    problem = du.broadcast_object(problem)
    if problem:
        raise ConfigError(problem)


def releasing(run):
    """`run`, releasing the locks it took (`claim`) when it returns or fails."""
    @functools.wraps(run)
    def released(*args, **kwargs):
        before = len(_held)
        try:
            return run(*args, **kwargs)
        finally:
            while len(_held) > before:
                _held.pop().close()
    return released


def check_layout(out: Path) -> None:
    for name, is_dir in RUN_ENTRIES.items():
        path = out / name
        if path.exists() and path.is_dir() != is_dir:
            raise ConfigError(f"--output-dir {out}: {name} is a {'file' if is_dir else 'folder'}, where a run keeps "
                              f"its {'folder' if is_dir else 'file'} of that name; move it away or choose another "
                              "--output-dir")


def set_aside_earlier_run(out: Path) -> Path | None:
    """Move an earlier run's files into `out/earlier-<date-time>/`; None when there were none."""
    present = [name for name in RUN_ENTRIES if (out / name).exists()]
    if not present:
        return None
    aside = out / f"earlier-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while aside.exists():
        aside, suffix = out / f"earlier-{time.strftime('%Y%m%d-%H%M%S')}-{suffix}", suffix + 1
    aside.mkdir()
    for name in present:
        os.replace(out / name, aside / name)
    return aside


def _row(line: str) -> dict | None:
    """A log line's row, or None for a line that is not a whole JSON object (a write cut short)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def drop_replayed_rows(out: Path, step: int) -> int:
    """Remove rows after `step` from the run's JSON-lines logs, and lines that are no whole row (cut
    short by a full disk or a kill; one warning); returns how many rows after `step` were removed."""
    removed = 0
    for name in LOG_FILES:
        path = out / name
        if not path.is_file():
            continue
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        rows = [(line, _row(line)) for line in lines]
        broken = [number for number, (_, row) in enumerate(rows, 1) if row is None]
        if broken:
            log.warning("%s: dropped %d line(s) that are no whole JSON row (line %s; a write cut short by a "
                        "full disk or a kill)", path, len(broken), ", ".join(map(str, broken[:5])))
        kept = [line for line, row in rows if row is not None and row.get("step", 0) <= step]
        removed += len(lines) - len(broken) - len(kept)
        if len(kept) != len(lines):
            path.write_text("".join(line + "\n" for line in kept))
    return removed
