"""dashboard: the metric plots and the live view, outside and inside a notebook kernel."""
from __future__ import annotations

import pytest
import torch

from maskrcnn_tut.engine import StepRecord
from maskrcnn_tut.lab.dashboard import LiveDashboard, plot_metrics


def record(step: int, iter_time: float = 0.5) -> StepRecord:
    return StepRecord(step=step, epoch=0, lr=0.1, loss=1.0 / step, terms={}, data_time=0.01,
                      iter_time=iter_time, rank_forward_times=[0.4])


def rows(data_time: float, iter_time: float, memory_mb: float, n: int = 4) -> list[dict]:
    return [{"step": s, "data_time": data_time, "iter_time": iter_time, "img_per_s": 4 / iter_time,
             "max_mem_mb": memory_mb} for s in range(1, n + 1)]


def test_plot_metrics_draws_time_throughput_and_memory():
    import matplotlib.pyplot as plt
    fig = plot_metrics(rows(0.1, 0.5, 100.0), total_memory_mb=1000.0)
    assert [ax.get_ylabel() for ax in fig.axes] == ["seconds per step", "images / s", "MiB"]
    plt.close(fig)


def test_dashboard_outside_a_notebook_collects_rows():
    dashboard = LiveDashboard(global_batch=4, device=torch.device("cpu"), redraw_every=2)
    for step in range(1, 4):
        dashboard(record(step))
    dashboard.close()
    assert not dashboard.live and [r["img_per_s"] for r in dashboard.rows] == [8.0, 8.0, 8.0]


def test_watch_training_keeps_a_run_that_pickles(tmp_path):
    """What the figure cache keeps of chapter 8's run: records, rows and the stopped sampler."""
    import pickle

    import matplotlib.pyplot as plt

    from maskrcnn_tut.lab import bench
    from maskrcnn_tut.lab.dashboard import watch_training
    cfg = bench.bench_config("cpu-tiny", min_size=64, max_size=96, workers=0)
    watched = pickle.loads(pickle.dumps(watch_training(cfg, steps=2, warmup=1, interval_s=60)))
    assert [r.step for r in watched.records] == [row["step"] for row in watched.rows] == [2, 3]
    assert watched.gpus.describe()
    fig = watched.figure("Live training dashboard")
    assert fig.axes[1].get_ylabel() == "images / s"
    plt.close(fig)


@pytest.mark.system
def test_dashboard_in_a_notebook_leaves_one_static_figure(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    source = ("from maskrcnn_tut.engine import StepRecord\n"
              "from maskrcnn_tut.lab.dashboard import LiveDashboard\n"
              "dashboard = LiveDashboard(global_batch=4, total_steps=6, redraw_every=3)\n"
              "for step in range(1, 7):\n"
              "    dashboard(StepRecord(step, 0, 0.1, 1.0 / step, {}, 0.01, 0.5, [0.49]))\n"
              "print(dashboard.progress.value, dashboard.status.value)\n"
              "dashboard.close()\n"
              "fig = dashboard.figure()")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1  # the run's figure; the live view is down
    assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert "6 step 6: loss 0.167, 8.00 img/s" in "".join(o.get("text", "") for o in outputs)
