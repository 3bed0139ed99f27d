"""The training step and loop: AMP, gradient accumulation with `no_sync`, clipping, a non-finite guard.

`train` reads top to bottom like nanoGPT's loop. One optimizer step is `accum_steps` micro-steps;
DDP all-reduces gradients only on the last of them. After the backward passes every rank shares a
small tensor of its loss terms, times and a non-finite flag in one all-reduce, so logging,
straggler detection and the decision to stop on a NaN are the same on every rank and nobody is
left waiting in a collective.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from . import distributed as du
from .data.loader import to_device

log = logging.getLogger(__name__)

#: Fault injection for the tests only: "STEP:RANK[,STEP:RANK...]" makes that rank's loss NaN at
#: that optimizer step (before backward, like a real overflow), to prove the guard stops every rank.
INJECT_NAN_ENV = "MASKRCNN_TUT_INJECT_NAN"


def _inject_nan(step: int, rank: int) -> bool:
    return f"{step}:{rank}" in os.environ.get(INJECT_NAN_ENV, "").split(",")


class NonFiniteLossError(FloatingPointError):
    """Raised on every rank at once when any rank's loss is NaN or infinite."""


class UnusedParametersError(RuntimeError):
    """DDP found parameters that got no gradient; the message says which flag fixes it."""


@dataclass
class TrainState:
    """Where training is: what a checkpoint must restore to continue the same batch sequence."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    nonfinite_skipped: int = 0
    scaler_skipped: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def amp_dtype(cfg, device: torch.device) -> torch.dtype | None:
    """The autocast dtype `--amp`/`--amp-dtype` ask for on this device (None: full fp32)."""
    if not cfg.amp and cfg.amp_dtype is None:
        return None
    if cfg.amp_dtype is not None:
        return getattr(torch, cfg.amp_dtype)
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def autocast(cfg, device: torch.device):
    dtype = amp_dtype(cfg, device)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def make_scaler(cfg, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=amp_dtype(cfg, device) == torch.float16)


def lr_schedule(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine decay to 0 at `total_steps` (a multiplier of the lr)."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW or SGD; no weight decay on norm layers and biases."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr)


def batch_stream(loader, state: TrainState) -> Iterator:
    """Batches forever, epoch after epoch, starting at `state`'s position; keeps `state` current."""
    while True:
        loader.batch_sampler.set_epoch(state.epoch, skip=state.batch_in_epoch)
        for batch in loader:
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def _ddp_no_sync(model: nn.Module, last_micro_step: bool):
    """Skip DDP's gradient all-reduce on every micro-step but the last one."""
    if last_micro_step or not isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def _forward_backward(model, images, targets, cfg, device, scaler, accum_steps: int, sync: bool,
                      inject_nan: bool = False):
    try:  # DDP reports parameters without gradient in the next step's forward, or in backward
        with _ddp_no_sync(model, sync):
            with autocast(cfg, device):
                loss_dict = model(images, targets)
            if inject_nan:
                loss_dict = {name: value * float("nan") for name, value in loss_dict.items()}
            loss = sum(loss_dict.values())  # a dict of tensors: sum its values, not the dict
            scaler.scale(loss / accum_steps).backward()
    except RuntimeError as err:
        if "find_unused_parameters" in str(err) or "did not receive grad" in str(err):
            raise UnusedParametersError("DDP: some parameters got no gradient; rerun with "
                                        "--find-unused-parameters (slower) or make every "
                                        "parameter take part in the loss") from err
        raise
    return loss_dict


@dataclass
class StepRecord:
    """What one optimizer step measured, agreed across ranks."""

    step: int
    epoch: int
    lr: float
    loss: float
    terms: dict[str, float]
    data_time: float
    iter_time: float
    rank_compute_times: list[float] = field(default_factory=list)
    skipped: bool = False


def train_step(model, optimizer, scaler, batches: Iterator, cfg, device, state: TrainState,
               term_names: list[str]) -> StepRecord:
    """One optimizer step: `accum_steps` forward/backward micro-steps, then clip and step.

    Returns the step's record; raises `NonFiniteLossError` on every rank when any rank's loss is
    not finite (unless `--skip-nonfinite` still allows skipping it).
    """
    start = time.perf_counter()
    info = du.info()
    accum = cfg.accum_steps
    data_time = 0.0
    totals: dict[str, torch.Tensor] = {}
    optimizer.zero_grad(set_to_none=True)
    for micro in range(accum):
        t_data = time.perf_counter()
        images, targets = next(batches)
        images, targets = to_device(images, targets, device, non_blocking=bool(cfg.pin_memory))
        data_time += time.perf_counter() - t_data
        loss_dict = _forward_backward(model, images, targets, cfg, device, scaler, accum, micro == accum - 1,
                                      inject_nan=_inject_nan(state.step + 1, info.rank))
        for name, value in loss_dict.items():
            totals[name] = totals.get(name, 0.0) + value.detach().float() / accum
    if not term_names:
        term_names.extend(sorted(totals))
    compute_time = time.perf_counter() - start - data_time
    # one small all-reduce: each rank fills its own row with its terms, a NaN flag and its times
    n = len(term_names)
    shared = torch.zeros(info.world_size, n + 3, device=device)
    local = torch.stack([totals[name] for name in term_names])
    shared[info.rank, :n] = torch.nan_to_num(local, nan=0.0, posinf=0.0, neginf=0.0)
    shared[info.rank, n] = (~torch.isfinite(local)).any().float()
    shared[info.rank, n + 1] = compute_time
    shared[info.rank, n + 2] = data_time
    du.all_reduce_sum(shared)
    shared = shared.cpu()
    bad_ranks = [r for r in range(info.world_size) if shared[r, n] > 0]
    if bad_ranks:
        mine = {name: float(totals[name]) for name in term_names}
        if state.nonfinite_skipped >= cfg.skip_nonfinite:
            raise NonFiniteLossError(
                f"non-finite loss at step {state.step + 1} on rank(s) {bad_ranks}; this rank ({info.rank}) "
                f"had {', '.join(f'{k}={v:.4g}' for k, v in mine.items())}. Lower --lr, add "
                f"--clip-grad-norm, check the data, or allow skips with --skip-nonfinite N")
        state.nonfinite_skipped += 1
        optimizer.zero_grad(set_to_none=True)
        if info.is_main:
            log.warning("non-finite loss at step %d on rank(s) %s: step skipped (%d of --skip-nonfinite %d)",
                        state.step + 1, bad_ranks, state.nonfinite_skipped, cfg.skip_nonfinite)
    else:
        if cfg.clip_grad_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        scale_before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(optimizer)
        scaler.update()
        if scale_before is not None and scaler.get_scale() < scale_before:
            state.scaler_skipped += 1  # fp16 overflow: GradScaler skipped this step by design
    state.step += 1
    mean_terms = (shared[:, :n].sum(0) / info.world_size).tolist()
    terms = dict(zip(term_names, mean_terms))
    return StepRecord(step=state.step, epoch=state.epoch, lr=optimizer.param_groups[0]["lr"],
                      loss=sum(mean_terms), terms=terms, data_time=float(shared[:, n + 2].max()),
                      iter_time=time.perf_counter() - start,
                      rank_compute_times=shared[:, n + 1].tolist(), skipped=bool(bad_ranks))


def train(model, optimizer, scheduler, scaler, loader, cfg, device, state: TrainState, total_steps: int,
          callbacks: list[Callable] = ()) -> TrainState:
    """Optimizer steps until `total_steps`; each callback gets every `StepRecord` (logging,
    evaluation and checkpoints hook in there)."""
    model.train()
    batches = batch_stream(loader, state)
    term_names: list[str] = []
    while state.step < total_steps:
        record = train_step(model, optimizer, scaler, batches, cfg, device, state, term_names)
        scheduler.step()
        for callback in callbacks:
            callback(record)
    return state
