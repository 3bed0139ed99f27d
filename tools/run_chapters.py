"""Run a few chapters under one deadline, as tools/gpu_check.sh does on the GPU machine.

    python tools/run_chapters.py --out DIR --deadline-s 150 [--chapters 05,06]

Without --chapters it takes the day's chapter of `ROTATION` (one chapter fits a device run).
Each chapter gets an equal share of the time still left (a short one leaves more to the next), is
executed by nbclient with that deadline on every cell, and is written to DIR/<chapter>.ipynb whatever
happened: finished, cut at its deadline, failed or interrupted. Its kernel is then shut down, and the
kernel's process group and every process it left behind are killed (a `torchrun` that a cell started
runs in sessions of its own and would otherwise keep the GPU). Exit status 1 when a chapter failed, was
cut or did not start; --summary writes one `name|seconds|status` line per chapter.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import signal
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

BOOK = Path(__file__).resolve().parents[1] / "book"
#: The chapters that use a GPU where there is one, one per device run: on an H200 (2026-12-04) a chapter
#: measuring cold needed over 100 s, and the check leaves about two minutes after its tests and suite.
ROTATION = ["05_mixed_precision", "06_cudnn_flags", "04_dataparallel_vs_ddp", "08_monitoring_and_benchmarks",
            "07_gradient_accumulation", "11_beyond_the_article", "02_system_and_setup", "09_troubleshooting",
            "10_summary", "01_why_multiple_gpus", "03_dataloader_tuning"]
PR_SET_CHILD_SUBREAPER = 36


def chosen(names: str | None, today: datetime.date | None = None) -> list[Path]:
    """The notebooks named by number or name ("05,06"), else the day's chapter of `ROTATION`."""
    if not names:
        return [BOOK / f"{ROTATION[(today or datetime.date.today()).toordinal() % len(ROTATION)]}.ipynb"]
    found = []
    for name in names.split(","):
        matches = sorted(BOOK.glob(f"{name.strip()}*.ipynb"))
        if len(matches) != 1:
            raise SystemExit(f"--chapters: {name!r} names {len(matches)} chapters in {BOOK}")
        found.append(matches[0])
    return found


def adopt_orphans() -> None:
    """Become the reaper of orphaned descendants (Linux), so that what a killed kernel leaves behind
    is still found among this process's children."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(text[text.rindex(")") + 2:].split()[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_tree(pgid: int | None) -> list[int]:
    """SIGKILL the process group `pgid` and every descendant of this process (and their groups), then
    reap them; returns the pids that were still there."""
    victims = descendants(os.getpid())
    groups = {pgid} if pgid else set()
    for pid in victims:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups - {os.getpgrp()}:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    give_up = time.monotonic() + 5
    for pid in victims:  # the adopted ones are this process's children now: reap them
        try:
            while not os.waitpid(pid, os.WNOHANG)[0] and time.monotonic() < give_up:
                time.sleep(0.05)
        except ChildProcessError:
            pass
    return victims


def run_chapter(source: Path, target: Path, deadline_s: float) -> tuple[float, str]:
    """Execute `source` with every cell bounded by what is left of `deadline_s`; write the notebook
    to `target` whatever happens, then end its kernel and all it started. Prints a line and returns
    (seconds, status): "ok", "cut at ...", or "FAILED ..."."""
    nb = nbformat.read(source, as_version=4)
    end = time.monotonic() + deadline_s
    client = NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(source.parent)}},
                            timeout_func=lambda cell: max(1, int(end - time.monotonic())),
                            shutdown_kernel="immediate")
    started, done, pgid = time.monotonic(), [0], [None]
    client.on_notebook_start = lambda **_: pgid.__setitem__(0, getattr(client.km.provisioner, "pgid", None))
    client.on_cell_executed = lambda **_: done.__setitem__(0, done[0] + 1)
    cells = sum(cell.cell_type == "code" for cell in nb.cells)
    status = "FAILED: interrupted"
    try:
        client.execute()
        status = "ok"
    except CellTimeoutError:
        status = f"cut at its {deadline_s:.0f} s deadline after {done[0]} of {cells} code cells"
    except CellExecutionError as err:
        status = f"FAILED in code cell {done[0]} of {cells}: {(str(err).strip().splitlines() or [''])[-1][:300]}"
    except Exception as err:  # a kernel that died or would not start: still write what ran
        status = f"FAILED: {type(err).__name__}: {str(err)[:300]}"
    finally:
        nb.metadata["gpu_check"] = {"status": status, "seconds": round(time.monotonic() - started, 1)}
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target)
        if client.km is not None and client.km.has_kernel:
            client.km.shutdown_kernel(now=True)
        left = kill_tree(pgid[0])
        seconds = time.monotonic() - started
        print(f"{source.name}: {status} in {seconds:.0f} s" + (f"; killed {len(left)} process(es) it left" if left
                                                               else ""), flush=True)
    return seconds, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where each executed notebook is written")
    parser.add_argument("--deadline-s", type=float, required=True, help="seconds for all the chapters together")
    parser.add_argument("--chapters", help="comma-separated chapter numbers or names (default: the day's chapter)")
    parser.add_argument("--summary", type=Path, help="append `name|seconds|status` per chapter to this file")
    args = parser.parse_args(argv)
    end = time.monotonic() + args.deadline_s
    adopt_orphans()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` or a kill: save, then stop
    chapters, complete = chosen(args.chapters), True
    for i, source in enumerate(chapters):
        share = (end - time.monotonic()) / (len(chapters) - i)
        if share < 5:
            seconds, status = 0.0, f"FAILED: not run, the chapters' {args.deadline_s:.0f} s were used up"
            print(f"{source.name}: {status}", flush=True)
        else:
            seconds, status = run_chapter(source, args.out / source.name, share)
        complete &= status == "ok"
        if args.summary:
            with args.summary.open("a") as summary:
                summary.write(f"{source.stem}|{seconds:.0f}|{status}\n")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
