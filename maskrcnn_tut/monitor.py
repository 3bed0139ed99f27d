"""What a run measures about itself while it trains: metrics, GPUs, stragglers, health.

Training-loop callbacks (each receives every `engine.StepRecord`, whose figures are already agreed
across ranks, so none of them runs a collective):

- `MetricsLogger`: every `print_freq` steps one window-averaged line of `metrics.jsonl`,
  TensorBoard scalars and the progress bar (rank 0 writes).
- `StragglerCheck(every=N, threshold=1.2)`: warns naming the slow rank when the slowest rank's
  median forward time over the last N steps exceeds `threshold` x the ranks' median.

Around them: `GPUSampler` (a thread reading, through NVML, the utilization and memory of the GPUs
this run uses, mapped from CUDA's numbering to NVML's; "not available" without an NVIDIA GPU),
`step_row` / `read_jsonl` (metric rows as in `metrics.jsonl`) and `health_advice(rows, gpus)`
(the article's healthy ranges as plain-language advice). The notebook views of the same figures
(plots, the live dashboard) are in `dashboard`.
"""
from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from . import distributed as du
from .hardware import device_memory_mb, peak_memory_mb
from .nvml import GpuUnavailable, NvmlReader, run_cuda_devices

log = logging.getLogger("maskrcnn_tut")

#: The article's healthy ranges (「モニタリングとベンチマーク分析」).
HEALTHY_GPU_UTIL = (70.0, 90.0)
MAX_MEMORY_FRACTION = 0.9


def read_jsonl(path: Path | str) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_row(record, global_batch: int, device: torch.device) -> dict:
    """One step's figures with the keys of `metrics.jsonl` (what the plots and advice read)."""
    return {"step": record.step, "loss": record.loss, "data_time": record.data_time,
            "iter_time": record.iter_time, "img_per_s": global_batch / record.iter_time,
            "max_mem_mb": peak_memory_mb(device)}


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


# --------------------------------------------------------------------------- GPUs through NVML


class GPUSampler:
    """A background thread that samples the run's GPUs' utilization % and memory every `interval_s`.

    `devices` are CUDA indices (default: `run_cuda_devices()`, the GPU of this process), so a run
    on GPU 0 of an 8-GPU machine is judged by GPU 0 alone. Without an NVIDIA GPU it does nothing
    and says so: `available` is False and `reason` (also `describe()`) explains why. `reader`
    replaces NVML (a callable returning one reading per GPU).

        with GPUSampler() as gpus:
            ...train...
        print(gpus.describe())
    """

    def __init__(self, interval_s: float = 1.0, reader: Callable[[], list[dict]] | None = None,
                 devices: Sequence[int] | None = None):
        self.interval_s = interval_s
        self.devices = None if devices is None else list(devices)
        self.samples: list[dict] = []
        self.reason = ""
        self._reader = reader
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return not self.reason

    def start(self) -> GPUSampler:
        try:
            if self._reader is None:
                self._reader = NvmlReader(run_cuda_devices() if self.devices is None else self.devices)
            self._sample()
        except GpuUnavailable as err:
            self.reason = str(err)
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        now = time.time()
        self.samples.extend({"time": now, **reading} for reading in self._reader())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if isinstance(self._reader, NvmlReader):
            self._reader.close()
            self._reader = None

    def __enter__(self) -> GPUSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def latest(self) -> list[dict]:
        """The newest reading of each GPU ([] when not available)."""
        newest: dict[int, dict] = {}
        for sample in self.samples:
            newest[sample["gpu"]] = sample
        return [newest[gpu] for gpu in sorted(newest)]

    def summary(self) -> list[dict]:
        """Per GPU: mean utilization %, peak memory used and total (MiB), sample count."""
        by_gpu: dict[int, list[dict]] = {}
        for sample in self.samples:
            by_gpu.setdefault(sample["gpu"], []).append(sample)
        return [{"gpu": gpu, "nvml_index": samples[0].get("nvml_index", gpu),
                 "util_mean": statistics.fmean(s["util"] for s in samples),
                 "mem_used_max_mb": max(s["mem_used_mb"] for s in samples),
                 "mem_total_mb": samples[0]["mem_total_mb"], "samples": len(samples)}
                for gpu, samples in sorted(by_gpu.items())]

    def describe(self) -> str:
        if not self.available:
            return f"GPU sampler: {self.reason}"
        return "; ".join(f"{_gpu_name(g)}: {g['util_mean']:.0f} % busy, {g['mem_used_max_mb']:.0f} of "
                         f"{g['mem_total_mb']:.0f} MiB at most ({g['samples']} samples)" for g in self.summary())


def _gpu_name(gpu: dict) -> str:
    """'GPU 0', with nvidia-smi's number beside it where the two differ (CUDA_VISIBLE_DEVICES)."""
    number = gpu.get("nvml_index", gpu["gpu"])
    return f"GPU {gpu['gpu']}" + (f" (nvidia-smi GPU {number})" if number != gpu["gpu"] else "")


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


# --------------------------------------------------------------------------- health advice


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


@dataclass
class HealthCheck:
    name: str
    ok: bool | None  # None: could not be measured here
    message: str


@dataclass
class HealthReport:
    """The article's three checks as plain-language advice; `ok` is False if any check failed."""

    checks: list[HealthCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok is not False for check in self.checks)

    def __str__(self) -> str:
        marks = {True: "ok  ", False: "FIX ", None: "n/a "}
        return "\n".join(f"{marks[c.ok]} {c.name}: {c.message}" for c in self.checks)

    def _repr_markdown_(self) -> str:
        marks = {True: "**ok**", False: "**fix**", None: "n/a"}
        return "\n".join(f"- {marks[c.ok]} {c.name}: {c.message}" for c in self.checks)


def health_advice(rows: list[dict], gpus: list[dict] | GPUSampler | None = None,
                  total_memory_mb: float | None = None) -> HealthReport:
    """Check metric rows (and GPU samples) against the article's healthy ranges.

    GPU utilization 70-90 %, data time below compute time, peak memory below 90 % of the device
    (the GPU's memory from NVML, else `total_memory_mb`, else this machine's RAM).
    """
    if not rows:
        raise ValueError("health_advice needs at least one metric row (train a few steps first)")
    report = HealthReport()
    if isinstance(gpus, GPUSampler):
        unavailable = gpus.reason or "not measured (the sampler has no samples yet)"
        gpus = gpus.summary()
    else:
        unavailable = "not measured (no GPU samples given)"
    low, high = HEALTHY_GPU_UTIL
    if not gpus:
        report.checks.append(HealthCheck("GPU utilization", None, (
            f"{unavailable}. On GPUs, below {low:.0f} % the GPU sits idle between kernels; here the "
            "data-vs-compute check below tells whether the processor waits for data.")))
    for gpu in gpus or []:
        util = gpu["util_mean"]
        if util < low:
            advice = ("the GPU waits: usually for data (raise --workers, keep pin_memory on) or for the "
                      "CPU to launch small kernels (raise --batch-size, use --amp)")
        elif util > high:
            advice = ("no idle gaps; utilization counts time with any kernel running, so check SM activity "
                      "(DCGM) or a trace before calling it saturated; then more speed comes from less work per "
                      "image (--amp, --channels-last) or from more GPUs")
        else:
            advice = "few idle gaps between kernels"
        report.checks.append(HealthCheck(f"{_gpu_name(gpu)} utilization", util >= low,
                                         f"{util:.0f} % of the time a kernel ran, on average (below {low:.0f} %: "
                                         f"the GPU sits idle between kernels): {advice}."))
    data, compute = _median(rows, "data_time"), statistics.median(r["iter_time"] - r["data_time"] for r in rows)
    if data < compute:
        message = (f"a step waits {data * 1000:.0f} ms for data and computes for {compute * 1000:.0f} ms "
                   f"({100 * data / max(compute, 1e-9):.0f} %): the loader keeps up.")
    else:
        message = (f"a step waits {data * 1000:.0f} ms for data but computes for only {compute * 1000:.0f} ms: "
                   "the processor starves. Raise --workers, keep --persistent-workers, use pin_memory on "
                   "GPUs, or store images smaller / pre-decoded.")
    report.checks.append(HealthCheck("data time < compute time", data < compute, message))
    peak = max(row["max_mem_mb"] for row in rows)
    if gpus:
        fullest = max(gpus, key=lambda g: g["mem_used_max_mb"] / g["mem_total_mb"])
        used = fullest["mem_used_max_mb"] / fullest["mem_total_mb"]
        seen = f"{_gpu_name(fullest)} held up to {fullest['mem_used_max_mb']:.0f} of {fullest['mem_total_mb']:.0f} MiB"
    else:
        total = total_memory_mb or device_memory_mb(du.info().device)
        used = peak / total if total else None
        seen = f"peak {peak:.0f} of {total:.0f} MiB" if total else f"peak {peak:.0f} MiB"
    if used is None:
        report.checks.append(HealthCheck("memory < 90 %", None, f"{seen}; the device's total is unknown."))
    elif used < MAX_MEMORY_FRACTION:
        report.checks.append(HealthCheck("memory < 90 %", True, f"{seen} ({used:.0%}): room to spare."))
    else:
        report.checks.append(HealthCheck("memory < 90 %", False, (
            f"{seen} ({used:.0%}): a slightly larger image or batch will run out of memory. Lower "
            "--batch-size and add --accum-steps, enable --amp, or lower --max-size.")))
    return report

