"""stored.across_builds: one measurement per hardware, code and arguments, read back by every later call, with
the spread of each row's step times; the verdict helpers that let prose say "within noise"."""
from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from maskrcnn_tut.lab import bench
from maskrcnn_tut.lab.bench import harness
from maskrcnn_tut.lab.bench.harness import Measurement
from maskrcnn_tut.lab.stored import across_builds
from maskrcnn_tut.lab.stored.result import BenchResult


def fake_measurement(times: list[float], images: int = 4) -> Measurement:
    return Measurement(processes=1, threads=1, images_per_step=images, iter_times=times,
                       data_times=[0.0] * len(times), epoch_starts=[], peak_memory_mb=[100.0])


CALLS = {"n": 0}


def fake_table(steps: int = 5, warmup: int = 1, **overrides) -> BenchResult:
    """Two measured rows and an unmeasured one, as bench.table makes them, through launch_measure."""
    CALLS["n"] += 1
    base, ddp = harness.launch_measure(None, 1, [{"times": [1.0, 1.1, 0.9, 1.2, 1.0]}]), \
        harness.launch_measure(None, 2, [{"times": [0.6, 0.55, 0.5, 0.7, 0.62]}])
    rows = [{"setup": "Single", **base[0].row()}, {"setup": "DP(2)", "note": "needs GPUs"},
            {"setup": "DDP(2)", **ddp[0].row()}]
    for row in rows:
        if "img/s" in row:
            row["speedup"] = row["img/s"] / rows[0]["img/s"]
    return BenchResult("table", "fake", rows, ["setup", "img/s", "speedup", "note"], [], {"hardware": "test"})


@pytest.fixture
def fake_launch(monkeypatch):
    monkeypatch.setattr(harness, "launch_measure", lambda cfg, n, runs, threads=None: [
        fake_measurement(run["times"]) for run in runs])
    CALLS["n"] = 0


def test_measured_once_then_read_back_with_the_same_rows(tmp_path, fake_launch):
    first = across_builds.cached(fake_table, steps=5, directory=tmp_path)
    assert CALLS["n"] == 1 and first.provenance["cache"]["hit"] is False
    again = across_builds.cached(fake_table, directory=tmp_path)  # steps=5 is the default: the same key
    assert CALLS["n"] == 1 and again.provenance["cache"]["hit"] is True
    assert again.rows == json.loads(json.dumps(first.rows))
    assert "measured now" in across_builds.describe_cache(first) and "read from the cache" in across_builds.describe_cache(again)
    across_builds.cached(fake_table, steps=6, directory=tmp_path)  # other arguments: measured again
    assert CALLS["n"] == 2
    across_builds.cached(fake_table, steps=5, directory=tmp_path, refresh=True)
    assert CALLS["n"] == 3


def test_a_change_in_the_code_or_the_hardware_measures_again(tmp_path, fake_launch, monkeypatch):
    across_builds.cached(fake_table, directory=tmp_path)
    monkeypatch.setattr(across_builds, "code_hash", lambda *sources: "edited")
    across_builds.cached(fake_table, directory=tmp_path)
    assert CALLS["n"] == 2
    real = across_builds.provenance
    monkeypatch.setattr(across_builds, "provenance", lambda command: {**real(command), "gpus": ["NVIDIA H100"]})
    across_builds.cached(fake_table, directory=tmp_path)
    assert CALLS["n"] == 3
    monkeypatch.setenv("MASKRCNN_TUT_BENCH_REFRESH", "1")
    across_builds.cached(fake_table, directory=tmp_path)
    assert CALLS["n"] == 4


def test_code_hash_follows_the_sources(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.py").write_text("x = 1\n")
    (tmp_path / "engine.py").write_text("y = 1\n")
    sources = ("bench", "engine.py", "missing.py")
    before = across_builds.code_hash(sources, tmp_path)
    assert across_builds.code_hash(sources, tmp_path) == before
    (tmp_path / "engine.py").write_text("y = 2\n")
    assert across_builds.code_hash(sources, tmp_path) != before
    assert len(across_builds.code_hash()) == 16


def test_rows_keep_their_spread_and_the_speedup_range(tmp_path, fake_launch):
    result = across_builds.cached(fake_table, directory=tmp_path)
    single, _, ddp = result.rows
    assert single["step s"] == [1.0, 1.1, 0.9, 1.2, 1.0] and single["images/step"] == 4
    q1, _, q3 = statistics.quantiles(single["step s"], n=4, method="inclusive")
    assert bench.interval(single) == pytest.approx((4 / q3, 4 / q1))
    assert single["img/s lo"] <= single["img/s"] <= single["img/s hi"]
    assert bench.interval(single, "speedup") == (1.0, 1.0)
    lo, hi = bench.interval(ddp, "speedup")
    assert lo == pytest.approx(ddp["img/s lo"] / single["img/s hi"]) and lo < ddp["speedup"] < hi
    assert "img/s IQR" in result.columns and result.provenance["cache"]["spread"] is True


def test_rows_without_step_times_get_no_spread():
    result = BenchResult("table", "made by hand", [{"setup": "Single", "img/s": 2.0, "speedup": 1.0},
                                                   {"setup": "DDP(2)", "img/s": 3.0, "speedup": 1.5}],
                         ["setup", "img/s", "speedup"], [], {})
    assert across_builds.add_spread(result) is False and result.columns == ["setup", "img/s", "speedup"]
    assert bench.interval(result.rows[0]) is None and bench.versus(result.rows[0], result.rows[1]) is None


def test_a_measurement_row_carries_its_spread_without_a_cache():
    row = fake_measurement([1.0, 1.1, 0.9, 1.2, 1.0]).row()
    assert row["img/s"] == pytest.approx(4 / 1.0) and row["img/s lo"] < row["img/s"] <= row["img/s hi"]
    assert row == {**row, **across_builds.timing_row([1.0, 1.1, 0.9, 1.2, 1.0], 4)}


def test_versus_and_above_say_too_noisy_when_ranges_overlap():
    a = {"img/s": 2.0, "img/s lo": 1.8, "img/s hi": 2.2, "speedup": 1.9, "speedup lo": 1.7, "speedup hi": 2.1}
    b = {"img/s": 1.0, "img/s lo": 0.9, "img/s hi": 1.1}
    c = {"img/s": 2.1, "img/s lo": 2.0, "img/s hi": 2.3}
    assert bench.versus(a, b) == 1 and bench.versus(b, a) == -1 and bench.versus(a, c) == 0
    assert bench.above(a, 1.0) == 1 and bench.above(a, 2.0) == 0 and bench.above(a, 2.5) == -1
    assert across_builds.spread_text(a) == "1.90x (IQR 1.70-2.10x)"
    assert across_builds.spread_text({"speedup": 1.5}) == "1.50x"


@pytest.mark.system
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run of the real table")
def test_the_real_table_cached_matches_its_measurements(tmp_path):
    first = across_builds.cached(bench.table, nprocs=1, steps=2, warmup=1, min_size=64, max_size=96, batch_size=2,
                                 directory=tmp_path)
    assert first.provenance["cache"]["spread"] is True
    measured = [row for row in first.rows if row.get("img/s")]
    assert measured and all(len(row["step s"]) == 2 and row["img/s lo"] <= row["img/s hi"] for row in measured)
    again = across_builds.cached(bench.table, nprocs=1, steps=2, warmup=1, min_size=64, max_size=96, batch_size=2,
                                 directory=tmp_path)
    assert again.provenance["cache"]["hit"] and again.rows[0]["img/s"] == first.rows[0]["img/s"]


def test_other_work_on_the_machine_is_measured_and_named():
    assert across_builds.other_load((100.0, 10.0), (120.0, 20.0), wall_s=10.0) == pytest.approx(10.0 / (10 * os.cpu_count()))
    assert across_builds.other_load(None, (1.0, 1.0), 1.0) is None
    assert across_builds.other_load((0.0, 0.0), (1.0, 5.0), 1.0) == 0.0  # never negative
    quiet = BenchResult("t", "t", [], [], [], {"cache": {"other load": 0.05}})
    busy = BenchResult("t", "t", [], [], [], {"cache": {"other load": 0.6}})
    assert across_builds.machine_busy(quiet) == "" and across_builds.machine_busy(BenchResult("t", "t", [], [], [], {})) == ""
    assert "60% of this machine's cores busy" in across_builds.machine_busy(busy)
    assert "as within noise" in across_builds.machine_busy(busy)
    assert across_builds._cpu_seconds() is None or all(v >= 0 for v in across_builds._cpu_seconds())


def test_a_cached_result_says_how_busy_the_machine_was(tmp_path, fake_launch):
    result = across_builds.cached(fake_table, directory=tmp_path)
    share = result.provenance["cache"]["other load"]
    assert share is None or 0.0 <= share
