"""The measurement: train the preset's model on benchmark data through `engine.train_step` and time it.

`measure` runs in this process (or the group it joined); `launch_measure` runs it in fresh worker
processes started by `processes.launch`, each with its thread count set and, on CPUs, bound to
cores of its own (`pin_cores`), so results do not depend on what the calling notebook did before.
The config goes through `config.derive` exactly as in `train.py`: global batch, lr scaled to it,
pin_memory and precision.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torchvision.transforms import v2

from maskrcnn_tut.lab import processes

from ... import distributed as du
from ...config import Config, derive, make_config, validate
from ...data.loader import batch_stream, build_datasets, build_train_loader
from ...data.shapes import ensure_shapes_dataset
from ...engine import (
    TrainState,
    build_optimizer,
    build_scheduler,
    configure_runtime,
    make_scaler,
    train_step,
)
from ...errors import BenchError
from ...hardware import peak_memory_mb, reset_peak_memory, usable_cores
from ...model import build_model
from ..dataparallel import DetectionDataParallel, explain_unavailable

#: The benchmark's dataset: small so an epoch is a few steps (the loader sweep crosses epochs).
BENCH_SHAPES = {"n_train": 32, "n_val": 8, "seed": 0}
#: The benchmark data holds at least this many optimizer steps of images per process and epoch.
MIN_EPOCH_STEPS = 2
#: The lr schedule's length in the benchmark: a long run's, so the lr stays at its peak after warm-up.
SCHEDULE_STEPS = 10**6
SHAPES = ("natural", "fixed", "varying")
MEASURE_OPTIONS = ("steps", "warmup", "threads", "shape", "dataparallel", "sync_gradients", "max_seconds")


def bench_dataset(images_per_step: int = 1) -> Path:
    """The benchmark's shapes data, with at least `MIN_EPOCH_STEPS` steps of `images_per_step`
    images (all processes together) per epoch: 32 images, more for many processes or big batches."""
    n_train = max(BENCH_SHAPES["n_train"], 32 * math.ceil(MIN_EPOCH_STEPS * images_per_step / 32))
    return ensure_shapes_dataset(**{**BENCH_SHAPES, "n_train": n_train}, progress=False)


def bench_config(preset: str | None = None, data_path: str | None = None, *, batches_per_step: int = 1,
                 **overrides) -> Config:
    """The preset (by hardware when None) on the benchmark's shapes data, without progress bars; on
    CPUs with workers=0, so a process x thread setup uses exactly its cores.

    batches_per_step: how many `batch_size x accum_steps` batches one step of the benchmark draws in
    all (its process count, or the accumulation sweep's largest K), so the shapes data is big enough
    for every process to get whole batches. A `data_path` of your own is used as it is.
    """
    settings = {"progress": False, **({} if torch.cuda.is_available() else {"workers": 0}),
                **{k: v for k, v in overrides.items() if v is not None}}
    cfg = make_config(preset, data_path=str(data_path or "."), **settings)
    if data_path is None:
        images = cfg.batch_size * cfg.accum_steps * batches_per_step
        cfg = dataclasses.replace(cfg, data_path=str(bench_dataset(images)))
    validate(cfg)
    return cfg


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

    @property
    def img_per_s(self) -> float:
        """Images per second at the median step time (robust to the odd slow step)."""
        return self.images_per_step / statistics.median(self.iter_times)

    @property
    def img_per_s_all_steps(self) -> float:
        """Images per second over all measured steps, slow ones included (epoch starts, new shapes)."""
        return self.images_per_step * len(self.iter_times) / sum(self.iter_times)

    def row(self) -> dict:
        compute = [t - d for t, d in zip(self.iter_times, self.data_times)]
        starts = [self.data_times[i] for i in self.epoch_starts]
        return {"img/s": self.img_per_s, "img/s all steps": self.img_per_s_all_steps,
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
            callbacks: list[Callable] = ()) -> Measurement:
    """Train `warmup + steps` steps of the config's model in this process (or the group it joined)
    and time the last `steps` (with `max_seconds`, as many as the warm-up's pace fits, at least 3).

    shape: "natural" (the dataset's sizes), "fixed" (every image square at min_size: one input
    shape) or "varying" (multi-scale min sizes, `multiscale_sizes`). dataparallel: one process
    drives every GPU (True) or the first N (an int) through `DetectionDataParallel`, batch_size
    images per GPU. threads: torch's CPU threads for this process (left set afterwards).
    sync_gradients=False: processes of a group train without DDP (no gradient all-reduce), which
    isolates what the all-reduce costs. callbacks get every measured `StepRecord`.
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be natural, fixed or varying, got {shape!r}")
    info = du.info()
    device = info.device
    n_dp = _dataparallel_gpus(dataparallel)
    if threads:
        torch.set_num_threads(threads)
    # DataParallel: this one process draws the images of every GPU it drives
    cfg = derive(dataclasses.replace(cfg, batch_size=cfg.batch_size * n_dp, skip_nonfinite=warmup + steps),
                 info.world_size, device)
    configure_runtime(cfg, device)
    train_set, _ = build_datasets(cfg)
    loader = build_train_loader(train_set, cfg, info.rank, info.world_size)
    du.seed_everything(cfg.seed)
    model = build_model(cfg, train_set.num_classes)
    if shape == "varying":
        model.transform.min_size = multiscale_sizes(cfg.min_size)
        model.transform.max_size = round(cfg.max_size * 1.25)
    model = model.to(device)
    du.seed_everything(cfg.seed + info.rank)
    if n_dp > 1:
        model = DetectionDataParallel(model, device_ids=list(range(n_dp)))
    elif sync_gradients:
        model = du.wrap_ddp(model, cfg, info)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, SCHEDULE_STEPS)
    scaler = make_scaler(cfg, device)
    state = TrainState()
    batches = batch_stream(loader, state)
    if shape == "fixed":
        batches = _square_batches(batches, cfg.min_size)
    devices = [torch.device("cuda", i) for i in range(n_dp)] if n_dp > 1 else [device]
    model.train()
    term_names: list[str] = []
    warm_times = []
    for _ in range(warmup):
        warm_times.append(train_step(model, optimizer, scaler, batches, cfg, device, state, term_names).iter_time)
        scheduler.step()
    if max_seconds and warm_times:  # rank 0 plans the step count, so every rank stops at the same step
        steps = du.broadcast_object(min(steps, max(3, int(max_seconds / statistics.median(warm_times)))))
    for dev in devices:
        reset_peak_memory(dev)
    records = []
    for _ in range(steps):
        records.append(train_step(model, optimizer, scaler, batches, cfg, device, state, term_names))
        scheduler.step()
        for callback in callbacks:
            callback(records[-1])
    mine = {"iter": [r.iter_time for r in records], "peak": [peak_memory_mb(d) for d in devices]}
    ranks = du.all_gather_objects(mine)
    epochs = [r.epoch for r in records]
    return Measurement(
        processes=info.world_size, threads=torch.get_num_threads(), images_per_step=cfg.global_batch_size,
        iter_times=[max(times) for times in zip(*(r["iter"] for r in ranks))],
        data_times=[r.data_time for r in records],
        epoch_starts=[i for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]],
        peak_memory_mb=[peak for r in ranks for peak in r["peak"]],
        steps_per_epoch=len(loader.batch_sampler) // cfg.accum_steps, lr=cfg.lr, warmup_times=warm_times)


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


def measure_worker(cfg: Config, runs: list[dict]) -> list[Measurement]:
    """Run inside `processes.launch`: pin this process to its cores, then `measure(cfg with the
    run's overrides, **the run's options)` for each run in turn; rank 0's results are the group's."""
    pin_cores(runs[0].get("threads") or 1)
    results = []
    for run in runs:
        overrides = {k: v for k, v in run.items() if k not in MEASURE_OPTIONS}
        options = {k: v for k, v in run.items() if k in MEASURE_OPTIONS}
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


def launch_measure(cfg: Config, nprocs: int, runs: list[dict], threads: int | None = None) -> list[Measurement]:
    """`measure_worker` in `nprocs` fresh processes, each pinned to `threads` CPU threads (default:
    its share of the usable cores). A worker's failure is raised as a one-line `WorkerError`."""
    threads = threads or max(1, usable_cores() // nprocs)
    runs = [{"threads": threads, **run} for run in runs]
    with environment(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)):
        return processes.launch(measure_worker, nprocs, cfg, runs)
