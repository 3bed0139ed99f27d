"""No figure title extends past its figure, in either edition: the Japanese review drew nine of the book's
figures in Japanese and found four titles clipped (a Japanese title is wider than its English one at the
same size). Each figure here is drawn the way its chapter draws it, with the chapter's own title, and every
title and suptitle must lie inside the figure once drawn (`book_fonts.fit_titles` wraps those that would not).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest

from maskrcnn_tut.lab import book, dashboard, diagrams, wording
from maskrcnn_tut.lab.bench import projection
from maskrcnn_tut.lab.book_fonts import _titles, wrap_line
from maskrcnn_tut.lab.stored.result import BenchResult

matplotlib.use("Agg")
RESULTS = Path(__file__).resolve().parents[2] / "book" / "results" / "cpu"


def committed(pattern: str) -> BenchResult:
    return BenchResult.load(sorted(RESULTS.glob(pattern))[-1])


def speed_table() -> BenchResult:
    from test_labels_ja import speed_table as table
    return table()


FIGURES = {
    "fast-path sweep (ch11)": lambda: committed("*fast-path*.json").plot(),
    "data vs compute (ch03)": lambda: book.plot_data_vs_compute(
        speed_table(), "Data time vs compute time per step, by DataLoader setting"),
    "time to accuracy (ch11)": lambda: committed("*-time-to-accuracy-????-??-??.json").plot(),
    "DataParallel vs DDP (ch04)": lambda: diagrams.draw_dataparallel_vs_ddp(),
    "ring all-reduce (ch04)": lambda: diagrams.draw_ring_allreduce(4),
    "COCO days (ch01)": lambda: book.line_plot(
        [1, 2, 4, 8, 16], {wording.term("the article's single GPU (quoted)"): [9.0, 4.7, 2.4, 1.2, 0.6],
                           f"{wording.term('this machine')}: cpu-tiny": [90.0, 47, 24, 12, 6]},
        wording.say("ch01.days_plot_title", epochs=26, efficiency=0.94), wording.term("devices"),
        wording.term("days"), logx=True, logy=True),
    "gradient noise (ch01)": lambda: book.line_plot(
        [1, 2, 4, 8], {wording.term("measured (± 1 standard error)"): [1.0, 0.5, 0.26, 0.12],
                       wording.term("1/B from batch 1"): [1.0, 0.5, 0.25, 0.125]},
        wording.say("ch01.noise_plot_title", pool=32), wording.term("batch size (images)"),
        wording.term("relative gradient noise (variance / squared norm)"), logx=True, logy=True),
    "scaling on paper (ch08)": lambda: projection.plot_scaling(
        None, projection.predict(0.5, 40e6, counts=(1, 2, 4, 8), backward_share=0.6),
        "Scaling efficiency: measured here and on paper", published=None),
    "forward time per process (ch09)": lambda: book.line_plot(
        [0, 1], {f"{wording.term('batches')} [3, 1]": [0.9, 0.3], f"{wording.term('batches')} [2, 2]": [0.6, 0.6]},
        wording.term("Forward time per step of each DDP process"), wording.term("process (rank)"),
        wording.term("seconds per step (median)"), bars=True),
    "live dashboard (ch08)": lambda: dashboard.plot_metrics(
        [{"step": s, "data_time": 0.1, "iter_time": 0.5, "img_per_s": 8.0, "max_mem_mb": 100.0} for s in (1, 2, 3)],
        total_memory_mb=1000.0),
}


@pytest.fixture
def language():
    yield
    wording.set_language("en")


@pytest.mark.parametrize("lang", ["ja", "en"])
@pytest.mark.parametrize("name", FIGURES)
def test_every_title_lies_inside_its_figure(name, lang, language):
    import matplotlib.pyplot as plt
    with matplotlib.rc_context():
        book.set_language(lang)
        fig = FIGURES[name]()
        fig.canvas.draw()
        inside = fig.bbox
        outside = []
        for text in _titles(fig):
            box = text.get_window_extent()
            if box.x0 < inside.x0 or box.x1 > inside.x1 or box.y1 > inside.y1:
                outside.append((text.get_text(), [round(v) for v in box.extents], [round(v) for v in inside.extents]))
        plt.close(fig)
    assert not outside, outside


def test_a_long_title_is_wrapped_where_japanese_allows():
    """After a particle or punctuation where one is close, else between any two characters but not before
    closing or after opening punctuation, and not in an English word; an English line at its spaces."""
    fits = lambda text: len(text) <= 10  # noqa: E731
    assert wrap_line("画像サイズとバッチごとの学習メモリ（resnet50-FPN）", fits) == [
        "画像サイズと", "バッチごとの", "学習メモリ", "（resnet50-", "FPN）"]
    assert wrap_line("デバイスあたりのピークメモリ", fits) == ["デバイスあたりの", "ピークメモリ"]  # after a particle
    assert all(not line.startswith(("、", "。", "）")) for line in wrap_line("ある、とても長い。題名（括弧）です。", fits))
    assert wrap_line("The relative gradient noise by batch size", fits) == [
        "The", "relative", "gradient", "noise by", "batch size"]
    assert wrap_line("短い題名", fits) == ["短い題名"]
