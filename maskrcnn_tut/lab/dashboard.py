"""Notebook views of a run's figures: `plot_metrics` and the live ipywidgets dashboard.

- `plot_metrics(rows)`: data vs compute time per step, throughput and peak memory (rows as in
  `metrics.jsonl`: `monitor.metrics_row`).
- `LiveDashboard(global_batch)`: a training callback that shows progress, img/s, data share, memory
  and GPU use while training runs in a notebook; `figure()` draws the run for the rendered page.
- `watch_training(cfg)`: a `bench.measure` run under a `LiveDashboard` and a `GPUSampler`, kept as a
  picklable `WatchedRun`, so the figure cache can hand the Japanese edition the English one's run.

matplotlib and ipywidgets are imported only when a figure or widget is made, and `train.py` and
`monitor` never import this module: training on a server needs neither. Titles, labels and the
status line are in the book's language (`wording`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from .. import distributed as du
from ..config import Config
from ..engine import StepRecord
from ..monitor import metrics_row
from .bench import measure
from .book_fonts import fit_titles
from .device_memory import device_memory_mb, releases_gpu_cache
from .health import MAX_MEMORY_FRACTION
from .nvml import GPUSampler
from .provenance import hardware_label
from .wording import say, term


def plot_metrics(rows: list[dict], title: str = "Training step", total_memory_mb: float | None = None):
    """Three panels from metric rows: data vs compute time per step, img/s, peak memory."""
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in rows]
    data = [row["data_time"] for row in rows]
    compute = [row["iter_time"] - row["data_time"] for row in rows]
    fig, (ax_time, ax_speed, ax_memory) = plt.subplots(1, 3, figsize=(12, 3.4))
    ax_time.bar(steps, compute, label=term("compute"), color="tab:blue")
    ax_time.bar(steps, data, bottom=compute, label=term("data (waiting for the loader)"), color="tab:orange")
    ax_time.set(title=term("Where a step's time goes"), xlabel=term("step"), ylabel=term("seconds per step"))
    ax_time.legend(fontsize=8)
    ax_speed.plot(steps, [row["img_per_s"] for row in rows], marker=".", color="tab:green")
    if rows:
        median = statistics.median(row["img_per_s"] for row in rows)
        ax_speed.axhline(median, color="gray", linestyle="--", label=say("dashboard.median", median=median))
        ax_speed.legend(fontsize=8)
    ax_speed.set(title=term("Throughput"), xlabel=term("step"), ylabel=term("images / s"), ylim=(0, None))
    ax_memory.plot(steps, [row["max_mem_mb"] for row in rows], marker=".", color="tab:purple", label=term("peak"))
    if total_memory_mb:
        ax_memory.axhline(MAX_MEMORY_FRACTION * total_memory_mb, color="tab:red", linestyle="--",
                          label=say("dashboard.share_of", share=MAX_MEMORY_FRACTION, total=total_memory_mb))
    ax_memory.set(title=term("Peak memory"), xlabel=term("step"), ylabel="MiB", ylim=(0, None))
    ax_memory.legend(fontsize=8)
    for ax in (ax_time, ax_speed, ax_memory):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{term(title)} — {hardware_label()}")
    return fit_titles(fig)


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class LiveDashboard:
    """Training callback that shows progress, img/s, data share, memory and GPU use while training
    runs in a notebook, and redraws `plot_metrics` every `redraw_every` steps.

    The numbers live in ipywidgets and the figure in a display output that each redraw replaces.
    `close()` takes the live view down after training, and `figure()` draws the whole run: the
    executed notebook (and the rendered page) keeps that one static picture. Outside a notebook it
    only collects `rows`.
    """

    def __init__(self, global_batch: int, total_steps: int | None = None, device: torch.device | None = None,
                 redraw_every: int = 10, gpus: GPUSampler | None = None, title: str = "Training step"):
        self.global_batch, self.redraw_every, self.gpus, self.title = global_batch, redraw_every, gpus, title
        self.device = device or du.info().device
        self.rows: list[dict] = []
        self.live = _in_notebook()
        if self.live:
            import ipywidgets as widgets
            from IPython.display import HTML, display
            self.progress = widgets.IntProgress(value=0, min=0, max=total_steps or 1, description=term("steps"))
            self.status = widgets.HTML(term("waiting for the first step"))
            self.view_handle = display(widgets.VBox([self.progress, self.status]), display_id=True)
            self.figure_handle = display(HTML(f"<i>{say('dashboard.figure_after', step=redraw_every)}</i>"),
                                         display_id=True)

    def __call__(self, record) -> None:
        self.rows.append(metrics_row([record], self.global_batch, self.device))
        if self.live:
            self._update_status()
            if record.step % self.redraw_every == 0:
                self.redraw()

    def _update_status(self) -> None:
        row = self.rows[-1]
        self.progress.value = min(row["step"], self.progress.max)
        text = say("dashboard.status", step=row["step"], loss=row["loss"], speed=row["img_per_s"],
                   data=100 * row["data_time"] / row["iter_time"], memory=row["max_mem_mb"])
        if self.gpus is not None and self.gpus.available:
            text += "; " + ", ".join(f"GPU {g['gpu']} {g['util']:.0f} %" for g in self.gpus.latest())
        self.status.value = text

    def total_memory_mb(self) -> float | None:
        return device_memory_mb(self.device) if self.device.type == "cuda" else None

    def figure(self):
        return plot_metrics(self.rows, self.title, self.total_memory_mb())

    def redraw(self) -> None:
        import matplotlib.pyplot as plt
        fig = self.figure()
        self.figure_handle.update(fig)
        plt.close(fig)

    def close(self) -> None:
        """Take the live view (widgets and the last redraw) down, in a notebook; `figure()` draws the run."""
        if self.live:
            from IPython.display import HTML
            for handle in (self.view_handle, self.figure_handle):
                handle.update(HTML(""))
            self.progress.close()
            self.status.close()


@dataclass
class WatchedRun:
    """A run `watch_training` watched: its step records, their metric rows (`monitor.metrics_row`),
    its GPU sampler (stopped, with its readings) and the GPU memory the rows are judged against."""

    records: list[StepRecord]
    rows: list[dict]
    gpus: GPUSampler
    total_memory_mb: float | None

    def figure(self, title: str = "Training step"):
        return plot_metrics(self.rows, title, self.total_memory_mb)


@releases_gpu_cache
def watch_training(cfg: Config, steps: int = 16, warmup: int = 2, redraw_every: int = 8,
                   interval_s: float = 0.5) -> WatchedRun:
    """Train `warmup + steps` steps of `cfg` through `bench.measure` (the same `engine.train_step` as
    train.py), with a `LiveDashboard` in the notebook and a `GPUSampler` reading the GPUs every
    `interval_s`; the run comes back as a `WatchedRun`, whose `figure()` draws it."""
    records: list[StepRecord] = []
    with GPUSampler(interval_s=interval_s) as gpus:
        dashboard = LiveDashboard(cfg.batch_size, total_steps=warmup + steps, gpus=gpus, redraw_every=redraw_every,
                                  title="Live training dashboard")
        measure(cfg, steps=steps, warmup=warmup, callbacks=[dashboard, records.append])
        dashboard.close()
    return WatchedRun(records, dashboard.rows, gpus, dashboard.total_memory_mb())
