"""What a run measures about itself: data vs compute time, img/s, peak memory, and where it goes.

`MetricsLogger` is a training-loop callback: every `print_freq` optimizer steps it averages the
window's `StepRecord`s and writes one line of `metrics.jsonl`, TensorBoard scalars and the
progress bar. Only rank 0 writes; the figures are already agreed across ranks by the step.
"""
from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
from tqdm.auto import tqdm


def peak_memory_mb(device: torch.device) -> float:
    """GPU allocator peak on CUDA, else this process's peak resident set size (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def read_jsonl(path: Path | str) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Window-averaged step metrics to `metrics.jsonl`, TensorBoard and a tqdm bar (rank 0 only)."""

    def __init__(self, output_dir: Path | None, total_steps: int, start_step: int, global_batch: int,
                 device: torch.device, print_freq: int, progress: bool, tensorboard: bool = True):
        self.output_dir, self.global_batch, self.device = output_dir, global_batch, device
        self.print_freq = print_freq
        self.window: list = []
        self.history: list[dict] = []
        self.metrics_file = open(output_dir / "metrics.jsonl", "a") if output_dir else None
        self.writer = None
        if output_dir and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=start_step + 1)
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
        n = len(self.window)
        last = self.window[-1]
        iter_time = sum(r.iter_time for r in self.window) / n
        data_time = sum(r.data_time for r in self.window) / n
        row = {"step": last.step, "epoch": last.epoch, "lr": last.lr,
               "loss": sum(r.loss for r in self.window) / n,
               **{k: sum(r.terms[k] for r in self.window) / n for k in last.terms},
               "data_time": data_time, "iter_time": iter_time,
               "img_per_s": self.global_batch / iter_time,
               "max_mem_mb": peak_memory_mb(self.device),
               "skipped_steps": sum(r.skipped for r in self.window)}
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
                             data=f"{100 * data_time / iter_time:.0f}%")

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
