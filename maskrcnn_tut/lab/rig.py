"""The lab's one training set-up: what every measurement trains, assembled as `train.py` assembles it.

`train.py` writes its set-up out, line by line, because chapter 10 reads it top to bottom. The
lab's measurements (the bench harness, the overhead bench, the profile, memory, timelines,
traces, proofs and the article's code) all build theirs here instead, in train.py's order:

    derive -> configure_runtime -> dataset -> train loader (given the device, so that
    --decode-on-device decodes there) -> seed -> build_model -> seed + rank -> optimizer ->
    scheduler -> scaler -> TrainState -> DDP when distributed -> batch stream

so there is one copy to keep in step with train.py, and `tests/test_rig.py` checks that the two
agree on what depends on the order: the initial weights, the first batch, the loader's device,
the precision and the scaler.

- `build_rig(settings, ...)`: a `Rig` for this process (its place in the group, or a device).
- `shapes_config(preset, sizes=...)`: the preset on the lab's shapes dataset (`SHAPES_SIZES`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from .. import distributed as du
from ..config import Config, Run, derive, make_config, validate
from ..data.loader import batch_stream, build_dataset, build_train_loader
from ..data.shapes import ensure_shapes_dataset
from ..engine import (
    StepRecord,
    TrainState,
    build_optimizer,
    build_scheduler,
    configure_runtime,
    make_scaler,
    train_step,
)
from ..model import build_model
from .synthetic import synthetic_batch

#: Named sizes of the shapes dataset the lab trains on: the book's chapters (a few epochs of short
#: runs, written in seconds), and the benchmarks' (small, so that the loader sweep crosses epochs).
SHAPES_SIZES = {"book": {"n_train": 128, "n_val": 32, "seed": 0},
                "bench": {"n_train": 32, "n_val": 8, "seed": 0}}
#: The shapes data holds at least this many optimizer steps of images per process and epoch.
MIN_EPOCH_STEPS = 2
#: A measurement's lr schedule: a long run's, so that after warm-up the lr stays at its peak and
#: every measured step trains as the middle of a real run does.
LONG_SCHEDULE = 10**6
#: Classes of `synthetic_batch`'s targets (three shapes and the background).
SYNTHETIC_CLASSES = 4


def shapes_dataset(sizes: str = "bench", images_per_step: int = 1) -> Path:
    """The shapes data of `SHAPES_SIZES[sizes]`, with at least `MIN_EPOCH_STEPS` steps of
    `images_per_step` images (all processes together) per epoch: more images for big steps."""
    spec = SHAPES_SIZES[sizes]
    n_train = max(spec["n_train"], 32 * math.ceil(MIN_EPOCH_STEPS * images_per_step / 32))
    return ensure_shapes_dataset(**{**spec, "n_train": n_train}, progress=False)


def shapes_config(preset: str | None = None, data_path: str | None = None, *, sizes: str = "bench",
                  batches_per_step: int = 1, **overrides) -> Config:
    """The preset (by hardware when None) on the lab's shapes data of `sizes`, without progress
    bars, validated. batches_per_step: how many `batch_size x accum_steps` batches one step draws
    in all (its process count, or an accumulation sweep's largest K), so that the data is big
    enough for every process to get whole batches. A `data_path` of your own is used as it is."""
    cfg = make_config(preset, data_path=str(data_path or "."),
                      **{"progress": False, **{k: v for k, v in overrides.items() if v is not None}})
    if data_path is None:
        images = cfg.batch_size * cfg.accum_steps * batches_per_step
        cfg = dataclasses.replace(cfg, data_path=str(shapes_dataset(sizes, images)))
    validate(cfg)
    return cfg


def synthetic_batches(settings: Config, image_size: int | None = None) -> Iterator:
    """One `synthetic_batch` of `batch_size` square images (default: min_size px), forever: a
    measurement that must not depend on a dataset or a loader."""
    return itertools.repeat(synthetic_batch(image_size or settings.min_size, settings.batch_size))


@dataclass
class Rig:
    """What one process trains: the derived config, model, optimizer, schedule, scaler, state and
    the batches `step` draws (a DataLoader's stream, or batches given)."""

    cfg: Run
    device: torch.device
    model: nn.Module  # wrapped (DDP when distributed) where the builder wrapped it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    state: TrainState
    batches: Iterator
    train_set: object | None = None  # the CocoDetection the loader reads (None for batches given)
    loader: torch.utils.data.DataLoader | None = None

    @property
    def module(self) -> nn.Module:
        """The model inside any DDP/DataParallel wrapper."""
        return du.unwrap(self.model)

    def step(self, stop_requested: bool = False, read: bool = True) -> StepRecord | None:
        """One `engine.train_step` on the next batches, `stop_requested` as this rank's stop request
        (`TrainState.stop_requested`); the schedule is the caller's to step, as train.py steps it after
        each step (`engine.after_step`). Its record, or None for a step not read (`read=False`, as
        train.py runs GPU steps between log lines)."""
        self.state.stop_requested = stop_requested
        records = train_step(self.model, self.optimizer, self.scaler, self.batches, self.cfg, self.state, read=read)
        return records[-1] if records else None


def build_rig(settings: Config, *, device: torch.device | str | None = None, batches: Iterable | None = None,
              model: nn.Module | None = None, total_steps: int = LONG_SCHEDULE,
              wrap: Callable[[nn.Module, Run, du.DistInfo], nn.Module] | None = du.wrap_ddp,
              reads_as: tuple[int, int] | None = None) -> Rig:
    """A `Rig` for this process, built in train.py's order (module doc) from `settings`, an
    underived Config (derived here, once).

    device: this process's device from `du.info()` (its GPU after `init_distributed`) unless
    given; rank and world size are always the group's. batches: the config's dataset through
    train.py's loader unless given (e.g. `synthetic_batches(settings)`). model: a model of your
    own (the proofs' toy detector) instead of the config's Mask R-CNN, already on its device.
    wrap: how the model is wrapped after the optimizer is built, as train.py wraps it
    (`du.wrap_ddp`: DDP when distributed); None leaves it as it is (no gradient all-reduce).
    reads_as: the (rank, world size) whose share of the data the loader reads (default: this
    process's), so that one process can read what rank 0 of a pair reads.
    """
    info = du.info()
    if device is not None:
        info = dataclasses.replace(info, device=torch.device(device))
    cfg = derive(settings, info.world_size, info.device)
    configure_runtime(cfg, info.device)
    train_set = loader = None
    if batches is None:
        train_set = build_dataset(cfg, "train")
        loader = build_train_loader(train_set, cfg, *(reads_as or (info.rank, info.world_size)), info.device)
    du.seed_everything(cfg.seed)  # the same initial weights on every rank
    if model is None:
        model = build_model(cfg, train_set.num_classes if train_set is not None else SYNTHETIC_CLASSES)
        model = model.to(info.device)
    du.seed_everything(cfg.seed + info.rank)  # per-rank randomness (RPN/RoI sampling)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    scaler = make_scaler(cfg, info.device)
    state = TrainState()
    if wrap is not None:
        model = wrap(model, cfg, info)
    model.train()
    stream = batch_stream(loader, state) if loader is not None else iter(batches)
    return Rig(cfg, info.device, model, optimizer, scheduler, scaler, state, stream, train_set, loader)
