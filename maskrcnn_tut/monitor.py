"""What a run measures about itself while it trains: metrics, GPUs, stragglers, health.

Training-loop callbacks (each receives every `engine.StepRecord`, whose figures are already agreed
across ranks, so none of them runs a collective):

- `MetricsLogger`: every `print_freq` steps one window-averaged line of `metrics.jsonl`,
  TensorBoard scalars (when the package is installed) and the progress bar (rank 0 writes).
- `StragglerCheck(every=N, threshold=1.2)`: warns naming the slow rank when the slowest rank's
  median forward time over the last N steps exceeds `threshold` x the ranks' median.

Images per second, from one clock (`StepRecord.iter_time`, host time around a step) but several
figures, each under its own name and defined here once: `img_per_s_mean` (all steps, slow ones
included: `metrics.jsonl`'s `img_per_s` over a print window), `img_per_s_median` (a benchmark's
figure; the lab's `stored.across_builds` adds its spread) and `img_per_s_wall` (a whole loop's
wall time, evaluations and checkpoint saves included: train.py's summary).

`metrics_row(records, ...)` is the row of `metrics.jsonl` for some steps (the logger's window, or
one step for a notebook's live view); `read_jsonl` reads the file back.
"""
from __future__ import annotations

import contextlib
import json
import logging
import statistics
import threading
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


class JsonlLog:
    """Rows appended to a JSON-lines file whole or not at all: a failed write (a full disk) is cut
    back to the last whole row and retried with the next row, so no row is lost if space returns;
    one warning when writing stops, one at `close` for rows never written. Training goes on."""

    def __init__(self, path: Path):
        self.path, self.pending = path, []

    def append(self, row: dict) -> None:
        self.pending.append(json.dumps(row) + "\n")
        try:
            with open(self.path, "ab", buffering=0) as f:
                size, data = f.tell(), memoryview("".join(self.pending).encode())
                try:
                    while data:
                        data = data[f.write(data):]
                except OSError:
                    with contextlib.suppress(OSError):  # no half row: a resume could not read it
                        f.truncate(size)
                    raise
        except OSError as err:
            if len(self.pending) == 1:
                log.warning("%s: cannot be written (%s): its rows wait and are written when they can be",
                            self.path, err.strerror or err)
            return
        self.pending.clear()

    def close(self) -> None:
        if self.pending:
            log.warning("%s: %d rows (steps %s to %s) could not be written", self.path, len(self.pending),
                        json.loads(self.pending[0]).get("step"), json.loads(self.pending[-1]).get("step"))


def _quiet_tensorboard_thread() -> None:
    """TensorBoard's writer thread stores a failed write (a full disk) for the main thread and then
    re-raises it, which prints a thread traceback; `MetricsLogger` reports it as one warning instead."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


def tensorboard_writer(folder: Path, purge_step: int):
    """A TensorBoard `SummaryWriter`, or None and one warning where the `tensorboard` package is not
    installed (hub images and `--no-deps` installs) or `folder` cannot be written (a full or
    read-only disk): metrics.jsonl carries every scalar anyway."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("the tensorboard package is not installed: metrics go to metrics.jsonl only "
                    "(pip install tensorboard for its charts)")
        return None
    _quiet_tensorboard_thread()
    try:
        return SummaryWriter(str(folder), purge_step=purge_step)
    except OSError as err:
        log.warning("%s: cannot be written (%s): metrics go to metrics.jsonl only", folder, err.strerror or err)
        return None


class MetricsLogger:
    """Window-averaged step metrics (`metrics_row`) to `metrics.jsonl`, TensorBoard and a tqdm bar
    (rank 0 only). A disk that fills up costs TensorBoard (one warning, metrics.jsonl goes on) and
    delays metrics.jsonl's rows (`JsonlLog`), never the run."""

    def __init__(self, output_dir: Path | None, total_steps: int, start_step: int, global_batch: int,
                 device: torch.device, print_freq: int, progress: bool, tensorboard: bool = True):
        self.output_dir, self.global_batch, self.device = output_dir, global_batch, device
        self.print_freq = print_freq
        self.window: list = []
        self.history: list[dict] = []
        self.metrics_log = JsonlLog(output_dir / "metrics.jsonl") if output_dir else None
        self.eval_log = JsonlLog(output_dir / "eval.jsonl") if output_dir else None
        self.writer = None
        if output_dir and tensorboard:
            self.writer = tensorboard_writer(output_dir / "tensorboard", purge_step=start_step + 1)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", disable=not progress,
                        dynamic_ncols=True)

    def _to_tensorboard(self, scalars: dict, step: int) -> None:
        """`scalars` as TensorBoard scalars at `step`; a failed write ends TensorBoard for the run with one warning."""
        if self.writer is None:
            return
        try:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
        except OSError as err:
            log.warning("%s: cannot be written (%s): metrics go to metrics.jsonl only from step %d on",
                        self.output_dir / "tensorboard", err.strerror or err, step)
            with contextlib.suppress(OSError):
                self.writer.close()
            self.writer = None

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
        if self.metrics_log:
            self.metrics_log.append(row)
        self._to_tensorboard({f"train/{k}": v for k, v in row.items() if k not in ("step", "epoch")}, row["step"])
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", img_s=f"{row['img_per_s']:.1f}",
                             data=f"{100 * row['data_time'] / row['iter_time']:.0f}%")

    def log_eval(self, step: int, metrics: dict) -> None:
        if self.eval_log:
            self.eval_log.append({"step": step, **metrics})
        self._to_tensorboard({f"eval/{k}": v for k, v in metrics.items()}, step)
        self.bar.write(f"step {step}: " + "  ".join(f"{k} {v:.3f}" for k, v in metrics.items()))

    def close(self) -> None:
        self.flush()
        self.bar.close()
        if self.metrics_log:
            self.metrics_log.close()
        if self.writer:
            with contextlib.suppress(OSError):  # its last scalars: metrics.jsonl has them
                self.writer.close()


# --------------------------------------------------------------------------- stragglers


#: The warning's only wording in English; the book's Japanese entry (`bench.straggler_warning`) fills the same fields.
STRAGGLER_WARNING = ("straggler: rank {slow} needed {ratio:.2f}x the median forward time over steps {first}-{last} "
                     "({slow_s:.3f} s vs {median_s:.3f} s per step); every other rank waits for it at each "
                     "all-reduce. Check its share of the data (the DistributedSampler, image sizes), its device "
                     "(other jobs, throttling) or CPU threads.")


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
        self.found: list[dict] = []  # each warning's figures, which the book words in its own language

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
            found = {"slow": slow, "ratio": ratio, "first": first, "last": record.step,
                     "slow_s": per_rank[slow], "median_s": middle}
            message = STRAGGLER_WARNING.format(**found)
            self.found.append(found)
            self.warnings.append(message)
            if du.info().is_main:
                log.warning(message)
