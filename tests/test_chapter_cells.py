"""The chapters' own arithmetic on simulated hosts: the cells that read the speed table (chapters
4 and 8) on a CPU, one GPU and eight GPUs, and chapter 9's even split of the same images.

Each test runs the chapter's stored cell source with stand-ins for what it calls (the table is a
real `bench.BenchResult` with the rows `bench.table` makes on that host), so a 1-GPU machine's
missing DDP row is exercised here, without a GPU.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from maskrcnn_tut.lab import book
from maskrcnn_tut.lab.bench import BenchResult

BOOK = Path(__file__).resolve().parent.parent / "book"


def cell_with(chapter: str, text: str) -> str:
    cells = [c.source for c in nbformat.read(BOOK / chapter, as_version=4).cells
             if c.cell_type == "code" and text in c.source]
    assert len(cells) == 1, f"{chapter}: {len(cells)} cells contain {text!r}"
    return cells[0]


def measured(setup: str, speedup: float, devices: int, threads: int | None = None) -> dict:
    return {"setup": setup, "threads/process": threads, "img/s": 5.0 * speedup, "total MiB": 1000.0 * devices,
            "speedup": speedup, "scaling efficiency": speedup / devices}


HOSTS = {
    "2-core CPU": [measured("Single (1 process x 1 thread)", 1.0, 1, 1),
                   measured("Single (1 process x 2 threads)", 1.3, 2, 2),
                   {"setup": "DP(2)", "note": "DataParallel needs >= 2 GPUs"},
                   measured("DDP(2) (2 processes x 1 thread)", 1.8, 2, 1),
                   measured("2 processes without gradient all-reduce", 1.9, 2, 1)],
    "1 GPU": [measured("Single GPU", 1.0, 1),
              {"setup": "DP", "note": "DataParallel needs >= 2 GPUs"},
              {"setup": "DDP", "note": "DDP needs >= 2 GPUs"}],
    "8 GPUs": [measured("Single GPU", 1.0, 1), measured("DP(8)", 5.0, 8), measured("DDP(8)", 7.2, 8)],
}


def run_cell(source: str, rows: list[dict]) -> dict:
    glued = {}
    speed = BenchResult("table", "speed", rows, list(rows[0]))
    speed.plot = lambda *a, **k: None
    stand_in_book = SimpleNamespace(glue=lambda name, value, fmt="": glued.__setitem__(name, format(value, fmt)),
                                    show_table=lambda *a, **k: None, beside_article=book.beside_article,
                                    plot_beside_article=lambda result: None,
                                    ARTICLE_SPEED_TABLE=book.ARTICLE_SPEED_TABLE)
    bench = SimpleNamespace(table=lambda **kwargs: speed)
    exec(source, {"speed": speed, "book": stand_in_book, "bench": bench})
    return glued


@pytest.mark.parametrize("host", HOSTS)
def test_chapter_4_speed_sentences(host):
    glued = run_cell(cell_with("04_dataparallel_vs_ddp.ipynb", 'speed.row("DDP")'), HOSTS[host])
    result, comparison = glued["ddp_result"], glued["ddp_comparison"]
    expected = {
        "2-core CPU": ("DDP(2) (2 processes x 1 thread) ran 1.80 times as fast as Single (1 process x 1 thread), "
                       "a scaling efficiency of 90 %.",
                       "For comparison, Single (1 process x 2 threads) reached 1.30 times the baseline."),
        "1 GPU": ("This machine measured only Single GPU: DDP needs at least two devices, so the table has no "
                  "DDP row (its note above says why).", ""),
        "8 GPUs": ("DDP(8) ran 7.20 times as fast as Single GPU, a scaling efficiency of 90 %.",
                   "For comparison, DP(8) reached 5.00 times the baseline."),
    }[host]
    assert (result, comparison) == expected
    assert "1.00 times the baseline" not in comparison


@pytest.mark.parametrize("processes", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("per_process", [1, 2, 4])
def test_chapter_9_splits_the_same_images_evenly(processes, per_process):
    source = cell_with("09_troubleshooting.ipynb", "proofs.imbalance_run")
    lines = [line for line in source.splitlines() if line.startswith(("uneven = ", "even = "))]
    assert len(lines) == 2
    namespace = {"processes": processes, "per_process": per_process}
    exec("\n".join(lines), namespace)
    uneven, even = namespace["uneven"], namespace["even"]
    assert len(even) == len(uneven) == processes
    assert sum(even) == sum(uneven) and max(even) - min(even) <= 1
