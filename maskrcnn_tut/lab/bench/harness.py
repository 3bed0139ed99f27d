"""The measurement: train the preset's model on benchmark data through `engine.train_step` and time it.

`measure` runs in this process (or the group it joined); `launch_measure` runs it in fresh worker
processes started by `processes.launch`, each with its thread count set and, on CPUs, bound to
cores of its own (`pin_cores`), so results do not depend on what the calling notebook did before.
The model, optimizer, schedule, scaler and batches come from `rig.build_rig`, assembled as
`train.py` assembles them (the config derived as train.py derives it: global batch, lr scaled to
it, pin_memory and precision; the loader given the device, so `--decode-on-device` is timed too).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torchvision.transforms import v2

from maskrcnn_tut.lab import processes

from ... import distributed as du
from ...config import Config
from ...engine import advance_schedule
from ...errors import BenchError
from ...hardware import peak_memory_mb, usable_cores
from ...monitor import img_per_s_mean, img_per_s_median, metrics_row
from ..dataparallel import DetectionDataParallel, explain_unavailable
from ..device_memory import reset_peak_memory
from ..rig import LONG_SCHEDULE, SHAPES_SIZES, build_rig, shapes_config, shapes_dataset
from ..stored.across_builds import timing_row

SHAPES = ("natural", "fixed", "varying")
MEASURE_OPTIONS = ("steps", "warmup", "threads", "shape", "dataparallel", "sync_gradients", "max_seconds", "deadline")
#: The benchmark's shapes dataset (`rig.SHAPES_SIZES`).
BENCH_SHAPES = SHAPES_SIZES["bench"]


def bench_dataset(images_per_step: int = 1) -> Path:
    """The benchmark's shapes data (`rig.shapes_dataset`) for steps of `images_per_step` images."""
    return shapes_dataset("bench", images_per_step)


def bench_config(preset: str | None = None, data_path: str | None = None, *, batches_per_step: int = 1,
                 **overrides) -> Config:
    """`rig.shapes_config` on the benchmark's shapes data; on CPUs with workers=0 (unless given),
    so that a process x thread setup uses exactly its cores."""
    cpu_workers = {} if torch.cuda.is_available() else {"workers": 0}
    return shapes_config(preset, data_path, sizes="bench", batches_per_step=batches_per_step,
                         **{**cpu_workers, **{k: v for k, v in overrides.items() if v is not None}})


def multiscale_sizes(size: int) -> tuple[int, ...]:
    """Shorter-side sizes from 0.75x to 1.25x of `size` in steps of 32 (multi-scale training)."""
    return tuple(range(32 * round(0.75 * size / 32), 32 * round(1.25 * size / 32) + 1, 32))


def _square_batches(batches: Iterator, size: int) -> Iterator:
    """The same batches resized to size x size (boxes and masks too): every step has one shape."""
    resize = v2.Resize((size, size), antialias=True)
    for images, targets in batches:
        pairs = [resize(image, target) for image, target in zip(images, targets)]
        yield tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


@dataclass
class Measurement:
    """Step times (slowest rank, measured steps only) and peak memory per device of one setup."""

    processes: int
    threads: int
    images_per_step: int
    iter_times: list[float]
    data_times: list[float]
    epoch_starts: list[int]
    peak_memory_mb: list[float]
    steps_per_epoch: int = 0
    lr: float = 0.0  # the derived peak lr (scaled to the global batch, as in train.py)
    warmup_times: list[float] = field(default_factory=list)  # not measured: first steps, compilation
    cut: bool = False  # stopped at its deadline, with fewer steps than planned

    @property
    def img_per_s(self) -> float:
        """`monitor.img_per_s_median` of the measured steps (robust to the odd slow step)."""
        return img_per_s_median(self.images_per_step, self.iter_times)

    @property
    def img_per_s_all_steps(self) -> float:
        """`monitor.img_per_s_mean` of the measured steps (epoch starts and new shapes included)."""
        return img_per_s_mean(self.images_per_step, self.iter_times)

    def row(self) -> dict:
        """The measurement as a result row: img/s with its spread (`cache.timing_row`), the data and
        compute time of the median step, memory, steps and warm-up."""
        compute = [t - d for t, d in zip(self.iter_times, self.data_times)]
        starts = [self.data_times[i] for i in self.epoch_starts]
        return {**timing_row(self.iter_times, self.images_per_step), "img/s all steps": self.img_per_s_all_steps,
                "data s": [round(t, 5) for t in self.data_times],  # which slow steps waited for their batch
                "data ms": round(1000 * statistics.median(self.data_times), 1),
                "compute ms": round(1000 * statistics.median(compute), 1),
                "epoch-start data ms": round(1000 * statistics.fmean(starts), 1) if starts else None,
                "peak MiB/device": round(max(self.peak_memory_mb)), "total MiB": round(sum(self.peak_memory_mb)),
                "steps": len(self.iter_times), "steps/epoch": self.steps_per_epoch,
                "warm-up s": round(sum(self.warmup_times), 1)}


def _dataparallel_gpus(dataparallel: bool | int) -> int:
    """GPUs `measure(dataparallel=...)` drives: 1 without DataParallel, every visible one for True."""
    if not dataparallel:
        return 1
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = visible if dataparallel is True else int(dataparallel)
    if n < 2 or n > visible:
        raise BenchError(explain_unavailable(visible) if visible < 2 else
                         f"DataParallel over {n} GPUs: this machine has {visible}")
    return n


def measure(cfg: Config, steps: int = 20, warmup: int = 3, *, threads: int | None = None, shape: str = "natural",
            dataparallel: bool | int = False, sync_gradients: bool = True, max_seconds: float | None = None,
            deadline: float | None = None, callbacks: list[Callable] = ()) -> Measurement:
    """Train `warmup + steps` steps of the config's model in this process (or the group it joined)
    and time the last `steps` (with `max_seconds`, as many as the warm-up's pace fits, at least 3).

    shape: "natural" (the dataset's sizes), "fixed" (every image square at min_size: one input
    shape) or "varying" (multi-scale min sizes, `multiscale_sizes`). dataparallel: one process
    drives every GPU (True) or the first N (an int) through `DetectionDataParallel`, batch_size
    images per GPU. threads: torch's CPU threads for this process (left set afterwards).
    sync_gradients=False: processes of a group train without DDP (no gradient all-reduce), which
    isolates what the all-reduce costs. callbacks get every measured `StepRecord`. deadline (a
    `time.monotonic()` time, one process only): the warm-up stops at half the time left and the measured
    steps at the deadline, after one step at least (`Measurement.cut`), for settings whose steps can take
    far longer than the warm-up's pace says (every new image shape autotuned with cudnn.benchmark).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be natural, fixed or varying, got {shape!r}")
    n_dp = _dataparallel_gpus(dataparallel)
    if threads:
        torch.set_num_threads(threads)
    # DataParallel: this one process draws the images of every GPU it drives. A measurement never
    # stops on a non-finite loss (skip_nonfinite covers every step): it times steps, not training
    settings = dataclasses.replace(cfg, batch_size=cfg.batch_size * n_dp, skip_nonfinite=warmup + steps)

    def dataparallel_wrap(model, _cfg, _info):
        return DetectionDataParallel(model, device_ids=list(range(n_dp)))

    wrap = dataparallel_wrap if n_dp > 1 else du.wrap_ddp if sync_gradients else None
    rig = build_rig(settings, wrap=wrap, total_steps=LONG_SCHEDULE)
    cfg, device, info = rig.cfg, rig.device, du.info()
    if shape == "varying":
        rig.module.transform.min_size = multiscale_sizes(cfg.min_size)
        rig.module.transform.max_size = round(cfg.max_size * 1.25)
    if shape == "fixed":
        rig.batches = _square_batches(rig.batches, cfg.min_size)
    devices = [torch.device("cuda", i) for i in range(n_dp)] if n_dp > 1 else [device]
    if deadline is not None and info.world_size > 1:
        raise ValueError("measure(deadline=) needs one process: ranks would stop at different steps")
    warm_until = None if deadline is None else time.monotonic() + (deadline - time.monotonic()) / 2
    warm_times, cut = [], False
    for _ in range(warmup):
        warm_times.append(rig.step().iter_time)
        advance_schedule(rig.scheduler)
        if warm_until is not None and time.monotonic() > warm_until:
            cut = True
            break
    if max_seconds and warm_times:  # rank 0 plans the step count, so every rank stops at the same step
        steps = du.broadcast_object(min(steps, max(3, int(max_seconds / statistics.median(warm_times)))))
    for dev in devices:
        reset_peak_memory(dev)
    records = []
    for _ in range(steps):
        records.append(rig.step())
        advance_schedule(rig.scheduler)
        for callback in callbacks:
            callback(records[-1])
        if deadline is not None and time.monotonic() > deadline and len(records) < steps:
            cut = True
            break
    mine = {"iter": [r.iter_time for r in records], "peak": [peak_memory_mb(d) for d in devices]}
    ranks = du.all_gather_objects(mine)
    epochs = [r.epoch for r in records]
    return Measurement(
        processes=info.world_size, threads=torch.get_num_threads(), images_per_step=cfg.global_batch,
        iter_times=[max(times) for times in zip(*(r["iter"] for r in ranks))],
        data_times=[r.data_time for r in records],
        epoch_starts=[i for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]],
        peak_memory_mb=[peak for r in ranks for peak in r["peak"]],
        steps_per_epoch=len(rig.loader.batch_sampler) // cfg.accum_steps, lr=cfg.scaled_lr, warmup_times=warm_times,
        cut=cut)


def training_losses(cfg: Config, steps: int = 10, warmup: int = 2) -> list[float]:
    """The loss of each measured step of `measure(cfg, steps, warmup)`: two runs compared step by step
    (precisions, or the same run twice for determinism) start from the same weights and batches."""
    losses = []
    measure(cfg, steps=steps, warmup=warmup, callbacks=[lambda record: losses.append(record.loss)])
    return losses


def repeated_losses(cfg: Config, steps: int = 3, warmup: int = 1, times: int = 2) -> list[list[float]]:
    """`training_losses` of the same run `times` times in this process: equal lists say the run
    repeats bit for bit (one call, so the figure cache keeps the pair, not one run handed out twice)."""
    return [training_losses(cfg, steps, warmup) for _ in range(times)]


def cpu_repeated_losses(cfg: Config, steps: int = 3, warmup: int = 1) -> list[list[float]]:
    """`repeated_losses` on the CPU whatever this machine has (chapter 6 asks whether a CPU run repeats, and
    prints the same line on any machine): in this process without CUDA, else in one fresh process that
    sees no GPU (`CUDA_VISIBLE_DEVICES` empty while it starts)."""
    if not torch.cuda.is_available():
        return repeated_losses(cfg, steps, warmup)
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        return processes.launch(repeated_losses, 1, cfg, steps, warmup, backend="gloo")
    finally:
        if hidden is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden


def step_rows(cfg: Config, steps: int = 6, warmup: int = 1, max_seconds: float | None = None) -> list[dict]:
    """The metrics row (`monitor.metrics_row`: data and compute time, img/s, memory) of each measured
    step of `measure(cfg, steps, warmup, max_seconds=...)`, for `dashboard.plot_metrics`."""
    rows = []
    measure(cfg, steps=steps, warmup=warmup, max_seconds=max_seconds,
            callbacks=[lambda record: rows.append(metrics_row([record], cfg.batch_size, du.info().device))])
    return rows


def pin_cores(threads: int) -> list[int] | None:
    """Bind this process to its own `threads` cores (rank r gets the r-th slice of the usable
    cores), so processes of one setup never share a core; None where that is not possible."""
    info = du.info()
    if info.device.type == "cuda" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))[:usable_cores()]
    mine = cores[info.local_rank * threads:(info.local_rank + 1) * threads]
    if len(cores) < info.local_world_size * threads or len(mine) < threads:
        return None
    os.sched_setaffinity(0, mine)
    return mine


def measure_worker(cfg: Config, runs: list[dict], until: float | None = None) -> list[Measurement]:
    """Run inside `processes.launch`: pin this process to its cores, then `measure(cfg with the
    run's overrides, **the run's options)` for each run in turn; rank 0's results are the group's.
    until (a `time.monotonic()` time; `launch_measure` gives it to one process only): each run gets an equal share of the time left
    as its `deadline`, so one slow setting cannot cost the others theirs."""
    pin_cores(runs[0].get("threads") or 1)
    results = []
    for i, run in enumerate(runs):
        overrides = {k: v for k, v in run.items() if k not in MEASURE_OPTIONS}
        options = {k: v for k, v in run.items() if k in MEASURE_OPTIONS}
        if until is not None:
            options["deadline"] = time.monotonic() + (until - time.monotonic()) / (len(runs) - i)
        results.append(measure(dataclasses.replace(cfg, **overrides), **options))
    return results


@contextlib.contextmanager
def environment(**variables: str):
    """Set environment variables for the worker processes started inside the block."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


#: The monotonic times set by `launch_deadline` blocks, innermost last.
_DEADLINES: list[float] = []
#: The share of a one-process launch's time kept for a last step that runs over its setting's deadline.
DEADLINE_MARGIN = 0.25


@contextlib.contextmanager
def launch_deadline(seconds: float):
    """Inside the block, every `launch_measure` ends within `seconds` from now (the launcher's
    timeout stops its workers), so a caller bounds a whole table or sweep without new arguments."""
    _DEADLINES.append(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINES.pop()


def launch_measure(cfg: Config, nprocs: int, runs: list[dict], threads: int | None = None) -> list[Measurement]:
    """`measure_worker` in `nprocs` fresh processes, each pinned to `threads` CPU threads (default:
    its share of the usable cores). A worker's failure is raised as a one-line `WorkerError`."""
    threads = threads or max(1, usable_cores() // nprocs)
    runs = [{"threads": threads, **run} for run in runs]
    timeout, until = {}, None
    if _DEADLINES:
        timeout["timeout_s"] = _DEADLINES[-1] - time.monotonic()
        if timeout["timeout_s"] <= 0:
            raise BenchError("no time left for this measurement (its launch_deadline has passed)")
        # one process shares the time among its settings, keeping a margin for a step that runs over
        until = _DEADLINES[-1] - DEADLINE_MARGIN * timeout["timeout_s"] if nprocs == 1 else None
    with environment(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)):
        return processes.launch(measure_worker, nprocs, cfg, runs, until, **timeout)
