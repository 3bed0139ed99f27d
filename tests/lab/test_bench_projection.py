"""bench.predict: the article's table taken apart, ring all-reduce arithmetic, the predicted bounds,
and the measured scaling curve's points (stand-in measurements for an 8-GPU host)."""
from __future__ import annotations

import pytest

from maskrcnn_tut.lab import book
from maskrcnn_tut.lab.bench import projection
from maskrcnn_tut.lab.stored.result import BenchResult


def test_the_article_table_taken_apart():
    a = projection.article_arithmetic(book.ARTICLE_SPEED_TABLE, book.COCO_TRAIN_IMAGES)
    assert [round(100 * e) for e in a["efficiencies"]] == [94, 94]  # 9.8/(2x5.2), 19.5/(4x5.2)
    assert [round(g, 1) for g in a["GB per device"]] == [10.8, 10.2, 10.1]  # 20.5/2, 40.2/4
    assert round(100 * a["card share"]) == 98 and a["card share"] > projection.ARTICLE_MEMORY_RULE
    days = a["schedule days"]
    assert round(days["the 1x schedule"]) == 3 and round(days["torchvision's reference recipe"]) == 7
    assert a["confounded"] is True and a["device counts"] == [2, 4]
    assert a["rows"][1]["speedup from img/s"] == pytest.approx(1.88, abs=0.01)


def test_ring_allreduce_moves_2_n_minus_1_over_n():
    assert projection.ring_allreduce_bytes(100.0, 1) == 0
    assert projection.ring_allreduce_bytes(100.0, 2) == 100.0
    assert projection.ring_allreduce_bytes(100.0, 4) == 150.0
    assert projection.ring_allreduce_bytes(100.0, 64) == pytest.approx(196.875)
    assert projection.bus_bandwidth_gbps(1e9, 2, 0.1) == pytest.approx(10.0)
    assert projection.link_gbps(8, 300, 25) == 300 and projection.link_gbps(16, 300, 25) == 25


def test_the_predicted_bounds():
    rows = projection.predict(0.1, 200e6, counts=(1, 2, 8, 64), links={"slow": (1.0, 1.0)}, backward_share=0.5)
    by_n = {row["devices"]: row for row in rows}
    assert by_n[1]["speedup overlapped"] == by_n[1]["speedup not overlapped"] == 1
    # N=2 over 1 GB/s: 200 MB in 0.2 s; 0.05 s of it hides behind backward
    assert by_n[2]["all-reduce ms"] == pytest.approx(200.0)
    assert by_n[2]["speedup not overlapped"] == pytest.approx(2 * 0.1 / 0.3)
    assert by_n[2]["speedup overlapped"] == pytest.approx(2 * 0.1 / 0.25)
    for row in rows:
        assert row["speedup not overlapped"] <= row["speedup overlapped"] <= row["devices"]
    fast = projection.predict(0.1, 1e6, counts=(8,), links={"fast": (300.0, 50.0)}, backward_share=0.6)[0]
    assert fast["speedup overlapped"] == 8  # hidden completely


def _row(setup, img_s, speedup, devices):
    return {"setup": setup, "img/s": img_s, "speedup": speedup, "scaling efficiency": speedup / devices,
            "img/s lo": 0.9 * img_s, "img/s hi": 1.1 * img_s, "images/step": 2 * devices,
            "speedup lo": 0.8 * speedup, "speedup hi": 1.2 * speedup}


def test_the_measured_curve_fills_the_powers_of_two_between(monkeypatch):
    asked = []

    def fake_cached(fn, *args, **kwargs):
        asked.append((fn.__name__, args))
        if fn is projection.table:
            rows = [_row("Single GPU", 10.0, 1.0, 1), {"setup": "DP(8)", "img/s": 50.0, "speedup": 5.0,
                    "scaling efficiency": 5 / 8}, _row("DDP(8)", 70.0, 7.0, 8)]
            return BenchResult("table", "t", rows, [], [], {"hardware": "8x GPU"})
        n = args[0]
        return BenchResult("ddp_point", "p", [_row(f"DDP({n})", 9.5 * n, 0.95 * n, n)], [], [], {})

    monkeypatch.setattr(projection, "cached", fake_cached)
    curve = projection.scaling_curve(steps=16, warmup=3)
    assert [row["devices"] for row in curve.rows] == [1, 2, 4, 8]
    assert asked == [("table", ()), ("ddp_point", (2,)), ("ddp_point", (4,))]
    four = curve.rows[2]
    assert four["speedup"] == pytest.approx(3.8) and four["speedup lo"] == pytest.approx(0.9 * 38 / 11)
    assert curve.provenance["baseline step s"] == pytest.approx(0.2)


def test_a_cpu_curve_is_the_table_alone(monkeypatch):
    rows = [_row("Single (1 process x 1 thread)", 4.0, 1.0, 1), _row("Single (1 process x 2 threads)", 5.0, 1.25, 2),
            {"setup": "DP(2)", "note": "needs GPUs"}, _row("DDP(2) (2 processes x 1 thread)", 7.4, 1.85, 2)]
    monkeypatch.setattr(projection, "cached", lambda fn, *a, **k: BenchResult("table", "t", rows, [], [], {}))
    curve = projection.scaling_curve()
    assert [(row["devices"], row["setup"][:6]) for row in curve.rows] == [(1, "Single"), (2, "DDP(2)")]


def test_the_plot_draws_everything(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    rows = [_row("Single", 4.0, 1.0, 1), _row("DDP(2)", 7.4, 1.85, 2)]
    curve = BenchResult("scaling", "s", [dict(r, devices=d) for r, d in zip(rows, (1, 2))], [], [], {"hardware": "cpu"})
    paper = projection.predict(0.4, 178e6, backward_share=0.6)
    fig = projection.plot_scaling(curve, paper, "title", book.ARTICLE_SPEED_TABLE)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert any("measured here" in label for label in labels) and any("NVIDIA" in label for label in labels)
    assert sum("on paper" in label for label in labels) == len(projection.LINKS)
    assert fig.axes[0].get_ylabel().startswith("scaling efficiency")


def test_model_gradient_bytes_of_gpu_r50_on_a_cpu_without_bf16(monkeypatch):
    """Chapter 8 counts R50-FPN's gradient bytes on any CPU: the preset's --amp is not validated for a count
    (it stopped chapter 8 on an AVX2 CPU, which has no bf16 instructions)."""
    from maskrcnn_tut import config
    from maskrcnn_tut.lab.bench import projection
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: False)
    assert projection.model_gradient_bytes("gpu-r50", num_classes=91) == 4 * 44_457_585
