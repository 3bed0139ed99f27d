"""monitor: GPU sampler without a GPU, straggler warnings, plots, dashboard, health advice, memory."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from maskrcnn_tut.engine import StepRecord
from maskrcnn_tut.monitor import (GPUSampler, LiveDashboard, StragglerCheck, health_advice, peak_memory_mb,
                                  plot_metrics, reset_peak_memory)


def record(step: int, rank_times: list[float], data_time: float = 0.01, iter_time: float = 0.5) -> StepRecord:
    return StepRecord(step=step, epoch=0, lr=0.1, loss=1.0 / step, terms={}, data_time=data_time,
                      iter_time=iter_time, rank_compute_times=rank_times)


def rows(data_time: float, iter_time: float, memory_mb: float, n: int = 4) -> list[dict]:
    return [{"step": s, "data_time": data_time, "iter_time": iter_time, "img_per_s": 4 / iter_time,
             "max_mem_mb": memory_mb} for s in range(1, n + 1)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_sampler_says_not_available_without_a_gpu():
    with GPUSampler(interval_s=0.01) as gpus:
        time.sleep(0.05)
    assert not gpus.available and gpus.reason.startswith("not available")
    assert gpus.samples == [] and gpus.summary() == [] and gpus.latest() == []
    assert "not available" in gpus.describe()
    check = health_advice(rows(0.01, 0.5, 100.0), gpus).checks[0]
    assert check.ok is None and "not available" in check.message


def test_gpu_sampler_thread_collects_and_summarises_readings():
    readings = iter(range(1000))

    def fake_nvml() -> list[dict]:
        value = float(next(readings))
        return [{"gpu": 0, "util": value, "mem_used_mb": 10 * value, "mem_total_mb": 1000.0},
                {"gpu": 1, "util": 50.0, "mem_used_mb": 5.0, "mem_total_mb": 1000.0}]

    with GPUSampler(interval_s=0.005, reader=fake_nvml) as gpus:
        time.sleep(0.1)
    first, second = gpus.summary()
    n = first["samples"]
    assert n >= 3 and second["samples"] == n
    assert first["util_mean"] == pytest.approx((n - 1) / 2) and first["mem_used_max_mb"] == 10 * (n - 1)
    assert second["util_mean"] == 50.0 and [g["gpu"] for g in gpus.latest()] == [0, 1]


def test_straggler_check_names_the_slow_rank(caplog):
    check = StragglerCheck(every=3, threshold=1.2)
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut"):
        for step in range(1, 7):
            check(record(step, [1.0, 1.0, 1.5, 1.05]))
    assert len(check.warnings) == 2  # at steps 3 and 6 only
    assert "rank 2" in check.warnings[0] and "steps 1-3" in check.warnings[0] and "1.46x" in check.warnings[0]
    assert "rank 2" in caplog.text


def test_straggler_check_stays_quiet_when_ranks_are_even_or_alone():
    check = StragglerCheck(every=2, threshold=1.2)
    for step in range(1, 5):
        check(record(step, [1.0, 1.1, 0.95]))
        check(record(step, [1.0]))  # a single process has no stragglers
    assert check.warnings == []
    with pytest.raises(ValueError, match="threshold > 1"):
        StragglerCheck(threshold=0.9)


def test_health_advice_flags_starved_steps_full_memory_and_idle_gpus():
    healthy = health_advice(rows(0.05, 0.5, 100.0), total_memory_mb=1000.0)
    assert healthy.ok and [c.ok for c in healthy.checks] == [None, True, True]
    starved = health_advice(rows(0.4, 0.5, 950.0), total_memory_mb=1000.0)
    assert not starved.ok and [c.ok for c in starved.checks] == [None, False, False]
    assert "--workers" in starved.checks[1].message and "--batch-size" in starved.checks[2].message
    gpus = [{"gpu": 0, "util_mean": 40.0, "mem_used_max_mb": 500.0, "mem_total_mb": 1000.0},
            {"gpu": 1, "util_mean": 80.0, "mem_used_max_mb": 950.0, "mem_total_mb": 1000.0}]
    report = health_advice(rows(0.05, 0.5, 100.0), gpus)
    assert [c.ok for c in report.checks] == [False, True, True, False]
    assert "waits" in report.checks[0].message and "FIX" in str(report)
    with pytest.raises(ValueError, match="at least one metric row"):
        health_advice([])


def test_plot_metrics_draws_time_throughput_and_memory():
    import matplotlib.pyplot as plt
    fig = plot_metrics(rows(0.1, 0.5, 100.0), total_memory_mb=1000.0)
    assert [ax.get_ylabel() for ax in fig.axes] == ["seconds per step", "images / s", "MiB"]
    plt.close(fig)


def test_dashboard_outside_a_notebook_collects_rows():
    dashboard = LiveDashboard(global_batch=4, device=torch.device("cpu"), redraw_every=2)
    for step in range(1, 4):
        dashboard(record(step, [0.4], iter_time=0.5))
    dashboard.close()
    assert not dashboard.live and [r["img_per_s"] for r in dashboard.rows] == [8.0, 8.0, 8.0]


def test_dashboard_in_a_notebook_leaves_one_static_figure(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    source = ("from maskrcnn_tut.engine import StepRecord\n"
              "from maskrcnn_tut.monitor import LiveDashboard\n"
              "dashboard = LiveDashboard(global_batch=4, total_steps=6, redraw_every=3)\n"
              "for step in range(1, 7):\n"
              "    dashboard(StepRecord(step, 0, 0.1, 1.0 / step, {}, 0.01, 0.5, [0.49]))\n"
              "dashboard.close()\n"
              "print(dashboard.progress.value, dashboard.status.value)")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert "6 step 6: loss 0.167, 8.00 img/s" in "".join(o.get("text", "") for o in outputs)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_peak_memory_can_be_reset_between_measurements():
    device = torch.device("cpu")
    big = np.ones(60 * 2**20 // 8)  # 60 MiB, touched
    del big
    before = peak_memory_mb(device)
    reset_peak_memory(device)
    assert peak_memory_mb(device) < before - 30
