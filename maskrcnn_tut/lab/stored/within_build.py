"""Figures kept within one build of the book: each figure is measured once, so the Japanese
chapters show what the English chapters measured in the same build instead of measuring it again.

    trace = within_build.once(traces.ddp_trace, steps=2, warmup=1)

`jupyter-book build` (this module is a Sphinx extension in `_config.yml`) and a pytest run
(tests/conftest.py) start a *session*: `MASKRCNN_TUT_FIGURES` names a folder that every chapter's
kernel inherits. In a session, the first `once(fn, ...)` with given arguments runs `fn` and keeps its
result (pickled), or the error it raised, and what it wrote to stdout and stderr. The same call in
the other edition writes those lines again and returns the kept result (raises the kept error).
Outside a session (a reader running one chapter) `once` just calls `fn`.
So what `fn` returns must not depend on the book's language: English data that the cells word in the
reader's language when they show it, as the `lab` functions return it.

`work_dir(name)` is a folder both editions share within a session (a training run's output
directory), and a fresh temporary folder outside one.

Unlike `across_builds.cached`, which keeps benchmarks across builds, nothing here outlives its session: the
next build measures again. A session's folder is removed when it ends, and folders older than a day
(a build that was killed) when the next one starts.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ...atomic import atomic_write
from ...data.shapes import default_cache_dir
from .across_builds import call_arguments

#: The environment variable naming the session's folder; chapters' kernels inherit it.
SESSION_ENV = "MASKRCNN_TUT_FIGURES"
#: A session folder left older than this (seconds) by a killed build is removed by the next session.
STALE_AFTER_S = 24 * 3600
_temporary: list[tempfile.TemporaryDirectory] = []  # work_dir's folders outside a session, removed at exit


def session_dir() -> Path | None:
    """The current session's folder, or None outside a session."""
    folder = os.environ.get(SESSION_ENV)
    return Path(folder) if folder else None


def start_session() -> Path:
    """Start a session for this process and the kernels it starts (unless one is already running)."""
    running = session_dir()
    if running is not None and running.is_dir():
        return running
    root = default_cache_dir() / "figures"
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():
        if old.is_dir() and time.time() - old.stat().st_mtime > STALE_AFTER_S:
            shutil.rmtree(old, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root))
    os.environ[SESSION_ENV] = str(folder)
    return folder


def end_session(folder: Path | None) -> None:
    """Remove a session's folder (what `start_session` returned) and forget it."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        if os.environ.get(SESSION_ENV) == str(folder):
            del os.environ[SESSION_ENV]


def stable_repr(value: Any) -> str:
    """A text naming `value` the same way in every kernel (functions by their import path); a
    TypeError for values whose repr holds a memory address, which would key nothing."""
    if callable(value) and hasattr(value, "__qualname__") and hasattr(value, "__module__"):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(stable_repr(v) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{stable_repr(k)}: {stable_repr(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    if " at 0x" in text:
        raise TypeError(f"within_build.once: {text[:80]} has no stable repr to key the figure cache by")
    return text


def figure_key(fn: Callable, args: tuple, kwargs: dict) -> str:
    """The file name a call's result is kept under: its function and its arguments, defaults filled in."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    if fn.__module__ == "__main__" or "<" in fn.__qualname__:
        raise TypeError(f"within_build.once needs a function importable from the package, not {name}")
    arguments = {k: stable_repr(v) for k, v in call_arguments(fn, args, kwargs).items()}
    digest = hashlib.sha256(json.dumps([name, arguments], sort_keys=True).encode()).hexdigest()[:16]
    return f"{fn.__qualname__}-{digest}.pickle"


class _Tee(io.TextIOBase):
    """Writes through to `out` and notes each write, in order, in `kept` as (stream name, text)."""

    def __init__(self, out, name: str, kept: list):
        self.out, self.name, self.kept = out, name, kept

    def write(self, text: str) -> int:
        self.kept.append((self.name, text))
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def once(fn: Callable, *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)`, run once per session; a repeat writes what the first call wrote (stdout
    and stderr, in order) and returns its result, or raises its error again (a run that chapter 9
    stops on a non-finite loss), as the module docstring says."""
    folder = session_dir()
    if folder is None:
        return fn(*args, **kwargs)
    path = folder / figure_key(fn, args, kwargs)
    if path.exists():
        written, result, error = pickle.loads(path.read_bytes())
        for name, text in written:
            getattr(sys, name).write(text)
        sys.stdout.flush()
        sys.stderr.flush()
        if error is not None:
            raise error
        return result
    written: list[tuple[str, str]] = []
    try:
        with contextlib.redirect_stdout(_Tee(sys.stdout, "stdout", written)), \
                contextlib.redirect_stderr(_Tee(sys.stderr, "stderr", written)):
            result = fn(*args, **kwargs)
    except Exception as err:
        _keep(path, written, None, err)
        raise
    _keep(path, written, result, None)
    return result


def _keep(path: Path, written: list, result: Any, error: Exception | None) -> None:
    """Pickle a call's lines and outcome to `path` for its repeat. An error that does not pickle back
    (an error class whose arguments do not rebuild it) is not kept: the repeat runs the call again."""
    try:
        kept = pickle.dumps((written, result, error))
        if error is not None:
            pickle.loads(kept)
    except (pickle.PicklingError, TypeError, AttributeError):
        if error is None:
            raise
        return
    atomic_write(path, lambda f: f.write(kept), durable=False)


def work_dir(name: str) -> Path:
    """A folder for a chapter's files: shared by both editions within a session (so a run kept by
    `once` still has its files), a fresh temporary folder, removed at exit, outside one."""
    folder = session_dir()
    if folder is None:
        temporary = tempfile.TemporaryDirectory(prefix=f"maskrcnn-tut-{name}-")
        _temporary.append(temporary)
        return Path(temporary.name)
    path = folder / "work" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def setup(app):
    """Sphinx extension: one session for the whole build, removed when the build finishes (unless
    the build runs inside a session someone else started)."""
    inherited = session_dir()
    folder = start_session()
    if inherited is None:
        app.connect("build-finished", lambda app, exception: end_session(folder))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
