"""Files written whole: a reader, or a run that was killed mid-write, finds the previous version or
the new one, never half of one.

`atomic_write(path, write)` lets `write` fill a temporary file beside `path` (same folder, so the same
file system) and renames it over `path`, which is atomic on POSIX. `durable=True` (checkpoints, a
run's outputs) also fsyncs the file before the rename and the folder after it, so the new version
survives a power cut too; caches that can be measured again skip the two fsyncs. The temporary file
is named `.<name>.tmp-<pid>`, so a clean-up can tell a killed writer's leftovers from a live one's
(`checkpoint.remove_stale_temporaries`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any, Callable


def fsync_dir(path: Path) -> None:
    """Make a rename in the folder `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """Where `atomic_write` writes `path` before renaming it into place."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: Path | str, write: Callable[[IO[Any]], object], *, mode: str = "wb",
                 durable: bool = True) -> None:
    """Call `write(f)` on a temporary file opened with `mode`, then rename it over `path`.

    Whatever fails (`write`, the disk, the rename) leaves `path` as it was and no temporary file,
    and the error goes to the caller unchanged.
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, mode) as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
