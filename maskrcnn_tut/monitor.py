"""What a run measures about itself while it trains: metrics, GPUs, stragglers, health.

Training-loop callbacks (each receives every `engine.StepRecord`, whose figures are already agreed
across ranks, so none of them runs a collective):

- `MetricsLogger`: every `print_freq` steps one window-averaged line of `metrics.jsonl`,
  TensorBoard scalars (when the package is installed) and the progress bar (rank 0 writes).
- `StragglerCheck(every=N, threshold=1.2)`: warns naming the slow rank when the slowest rank's
  median forward time over the last N steps exceeds `threshold` x the ranks' median.

Images per second, from one clock (`StepRecord.iter_time`, host time around a step) but several
figures, each under its own name and defined here once: `img_per_s_mean` (all steps, slow ones
included: `metrics.jsonl`'s `img_per_s` over a print window), `img_per_s_median` and
`img_per_s_quartiles` (a benchmark's figure and its spread) and `img_per_s_wall` (a whole loop's
wall time, evaluations and checkpoint saves included: train.py's summary).

`metrics_row(records, ...)` is the row of `metrics.jsonl` for some steps (the logger's window, or
one step for a notebook's live view); `read_jsonl` reads the file back.
"""
from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from . import distributed as du
from .hardware import peak_memory_mb

log = logging.getLogger("maskrcnn_tut")


def read_jsonl(path: Path | str) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def img_per_s_mean(images_per_step: float, step_times: Sequence[float]) -> float:
    """Images per second over all the given steps, slow ones included: images over total seconds."""
    return images_per_step * len(step_times) / sum(step_times)


def img_per_s_median(images_per_step: float, step_times: Sequence[float]) -> float:
    """Images per step over the median step time: robust to the odd slow step (a new shape, an epoch start)."""
    return images_per_step / statistics.median(step_times)


def img_per_s_quartiles(images_per_step: float, step_times: Sequence[float]) -> tuple[float, float]:
    """(low, high): images per step over the 75th and over the 25th percentile step time, the
    spread of the middle half of the steps around `img_per_s_median`."""
    if len(step_times) < 2:
        return (img_per_s_median(images_per_step, step_times),) * 2
    q1, _, q3 = statistics.quantiles(step_times, n=4, method="inclusive")
    return images_per_step / q3, images_per_step / q1


def img_per_s_wall(images: float, wall_seconds: float) -> float:
    """Images over the wall-clock seconds of a whole training loop: everything the loop did in that
    time counts, mid-run evaluations and checkpoint saves included."""
    return images / max(wall_seconds, 1e-9)


def metrics_row(records: Sequence, global_batch: int, device: torch.device) -> dict:
    """The `metrics.jsonl` row of some steps' `StepRecord`s: the last step, the means of the loss,
    its terms and the times, `img_per_s_mean` of the global batch, and the peak memory so far."""
    n = len(records)
    last = records[-1]
    return {"step": last.step, "epoch": last.epoch, "lr": last.lr,
            "loss": sum(r.loss for r in records) / n,
            **{k: sum(r.terms[k] for r in records) / n for k in last.terms},
            "data_time": sum(r.data_time for r in records) / n, "iter_time": sum(r.iter_time for r in records) / n,
            "img_per_s": img_per_s_mean(global_batch, [r.iter_time for r in records]),
            "max_mem_mb": peak_memory_mb(device), "skipped_steps": sum(r.skipped for r in records)}


def tensorboard_writer(folder: Path, purge_step: int):
    """A TensorBoard `SummaryWriter`, or None and one warning where the `tensorboard` package is not
    installed (hub images and `--no-deps` installs): metrics.jsonl carries every scalar anyway."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("the tensorboard package is not installed: metrics go to metrics.jsonl only "
                    "(pip install tensorboard for its charts)")
        return None
    return SummaryWriter(str(folder), purge_step=purge_step)


class MetricsLogger:
    """Window-averaged step metrics (`metrics_row`) to `metrics.jsonl`, TensorBoard and a tqdm bar (rank 0 only)."""

    def __init__(self, output_dir: Path | None, total_steps: int, start_step: int, global_batch: int,
                 device: torch.device, print_freq: int, progress: bool, tensorboard: bool = True):
        self.output_dir, self.global_batch, self.device = output_dir, global_batch, device
        self.print_freq = print_freq
        self.window: list = []
        self.history: list[dict] = []
        self.metrics_file = open(output_dir / "metrics.jsonl", "a") if output_dir else None
        self.writer = None
        if output_dir and tensorboard:
            self.writer = tensorboard_writer(output_dir / "tensorboard", purge_step=start_step + 1)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", disable=not progress,
                        dynamic_ncols=True)

    def __call__(self, record) -> None:
        self.window.append(record)
        self.bar.update(1)
        if record.step % self.print_freq == 0:
            self.flush()

    def flush(self) -> None:
        if not self.window:
            return
        row = metrics_row(self.window, self.global_batch, self.device)
        self.window.clear()
        self.history.append(row)
        if self.metrics_file:
            self.metrics_file.write(json.dumps(row) + "\n")
            self.metrics_file.flush()
        if self.writer:
            for key, value in row.items():
                if key not in ("step", "epoch"):
                    self.writer.add_scalar(f"train/{key}", value, row["step"])
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", img_s=f"{row['img_per_s']:.1f}",
                             data=f"{100 * row['data_time'] / row['iter_time']:.0f}%")

    def log_eval(self, step: int, metrics: dict) -> None:
        if self.output_dir:
            with open(self.output_dir / "eval.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer:
            for key, value in metrics.items():
                self.writer.add_scalar(f"eval/{key}", value, step)
        self.bar.write(f"step {step}: " + "  ".join(f"{k} {v:.3f}" for k, v in metrics.items()))

    def close(self) -> None:
        self.flush()
        self.bar.close()
        if self.metrics_file:
            self.metrics_file.close()
        if self.writer:
            self.writer.close()


# --------------------------------------------------------------------------- stragglers


class StragglerCheck:
    """Training callback: every `every` steps, warn naming the rank whose median forward time over
    those steps exceeds `threshold` x the median over ranks. Logs on rank 0; `warnings` keeps them.

    It reads `StepRecord.rank_forward_times`: each rank's own synchronized forward seconds, in
    which no collective waits, so a slow rank stands out (a whole step's time would not: under DDP
    every rank waits for the slowest at the all-reduce, so their step times come out equal).
    """

    def __init__(self, every: int = 50, threshold: float = 1.2):
        if every < 1 or threshold <= 1:
            raise ValueError(f"StragglerCheck needs every >= 1 and threshold > 1, got {every}, {threshold}")
        self.every, self.threshold = every, threshold
        self.window: list[list[float]] = []
        self.warnings: list[str] = []

    def __call__(self, record) -> None:
        if len(record.rank_forward_times) < 2:
            return  # one process: nobody to wait for
        self.window.append(record.rank_forward_times)
        if record.step % self.every:
            return
        per_rank = [statistics.median(times) for times in zip(*self.window)]
        first = record.step - len(self.window) + 1
        self.window.clear()
        middle = statistics.median(per_rank)
        slow = max(range(len(per_rank)), key=per_rank.__getitem__)
        ratio = per_rank[slow] / middle if middle > 0 else 1.0
        if ratio > self.threshold:
            message = (f"straggler: rank {slow} needed {ratio:.2f}x the median forward time over steps "
                       f"{first}-{record.step} ({per_rank[slow]:.3f} s vs {middle:.3f} s per step); every "
                       "other rank waits for it at each all-reduce. Check its share of the data (the "
                       "DistributedSampler, image sizes), its device (other jobs, throttling) or CPU threads.")
            self.warnings.append(message)
            if du.info().is_main:
                log.warning(message)
