"""One optimizer step, and what sets it up: runtime flags, precision, optimizer, lr schedule.

`train_step` is the step `train.py`'s loop, the benchmark and the chapters' proofs all run: it
draws `accum_steps` micro-batches, runs forward and backward on each under autocast (DDP syncs
gradients only on the last, the others run in `no_sync`), then clips and steps the optimizer.
After the backward passes every rank shares a small tensor of its loss terms, its forward time,
its data time and a non-finite flag in one all-reduce, so logging, straggler detection and the
decision to stop on a NaN are the same on every rank and nobody is left waiting in a collective.
The step, optimizer, autocast and GradScaler take a `config.Run` (`config.derive`'s result).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from . import distributed as du
from .config import Config, Run
from .data.loader import to_device
from .errors import NonFiniteLossError, UnusedParametersError
from .hardware import keep_freed_memory

log = logging.getLogger(__name__)

_DTYPES = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class TrainState:
    """Where training is: what a checkpoint must restore to continue the same batch sequence."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    nonfinite_skipped: int = 0
    scaler_skipped: int = 0
    #: steps whose shared values are still on their way to the host (`train_step(read=False)`); not saved
    unread: list = field(default_factory=list, repr=False, compare=False)
    #: this rank was told to stop (a scheduler's signal, `preemption.StopRequest`): `train_step` sends it
    #: with the step's shared values, so every rank learns it at the same read step; not saved
    stop_requested: bool = field(default=False, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name not in ("unread", "stop_requested")}


def configure_runtime(cfg: Run, device: torch.device) -> None:
    """cuDNN and determinism flags (chapter 6), and TF32 matmuls on Ampere and later GPUs; a warning
    for bfloat16 on a GPU older than Ampere, which only emulates it; freed host memory kept for reuse
    (`hardware.keep_freed_memory`: a CPU step would otherwise fault its activations in afresh)."""
    keep_freed_memory()
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not cfg.deterministic
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
        if device.type == "cuda":
            log.warning("--deterministic on GPUs is best effort: CUDA ops without a deterministic kernel (the "
                        "classification loss's among them) only warn, and torchvision swaps roi_align for a "
                        "compiled pure-PyTorch version that costs a compile and memory")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if cfg.precision == "bfloat16" and torch.cuda.get_device_capability(device) < (8, 0):
            log.warning("--amp-dtype bfloat16 on %s (compute capability %d.%d): GPUs before Ampere have no "
                        "bfloat16 units, so torch emulates it, slower than fp32; use --amp-dtype float16",
                        torch.cuda.get_device_name(device), *torch.cuda.get_device_capability(device))


def autocast_dtype(cfg: Run) -> torch.dtype | None:
    """The autocast dtype of the run's precision (None: full fp32)."""
    return _DTYPES[cfg.precision]


def autocast(cfg: Run, device: torch.device):
    dtype = autocast_dtype(cfg)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def make_scaler(cfg: Run, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=autocast_dtype(cfg) == torch.float16)


#: Where "steps" decay drops the lr x0.1: torchvision's epochs 16 and 22 of 26, as fractions.
STEP_DECAY_AT = (16 / 26, 22 / 26)


def lr_schedule(warmup_steps: int, total_steps: int, decay: str = "cosine") -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine decay to 0 at `total_steps`, or x0.1 at each of
    `STEP_DECAY_AT` of `total_steps` (a multiplier of the lr)."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay == "steps":
            return 0.1 ** sum(step >= at * total_steps for at in STEP_DECAY_AT)
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config | Run, total_steps: int):
    """`lr_schedule` as a LambdaLR over `total_steps` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.warmup_steps, total_steps, cfg.lr_decay))


def advance_schedule(scheduler) -> None:
    """One schedule step per step of the loop, stepped or skipped (fp16 overflow, --skip-nonfinite):
    the lr stays a function of the step number, as in torchvision, and the run ends on the planned lr.
    So torch's warning about a first step the optimizer skipped ("before optimizer.step()") is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()


def after_step(scheduler, records: list[StepRecord],
               callbacks: Sequence[Callable[[StepRecord], None]]) -> StepRecord | None:
    """What train.py's loop does after every `train_step`, here so that the lab's benchmarks run the very
    same calls: one schedule step (`advance_schedule`), then every record the step returned to each
    callback in turn (the metrics logger, the straggler check). Returns the newest record (None: the
    step was not read), on which the loop decides about checkpoints, a stop and evaluation."""
    advance_schedule(scheduler)
    for record in records:
        for callback in callbacks:
            callback(record)
    return records[-1] if records else None


def build_optimizer(model: nn.Module, cfg: Run) -> torch.optim.Optimizer:
    """AdamW or SGD at the run's scaled lr; no weight decay on norm layers and biases. On GPUs the fused
    implementation: one kernel per step for all parameters, where the per-parameter loop launches
    hundreds (and, with a GradScaler, it skips an overflowed step without the host reading a flag)."""
    lr = cfg.scaled_lr
    fused = {"fused": True} if cfg.fused_optimizer else {}
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, **fused)
    return torch.optim.AdamW(groups, lr=lr, **fused)


def ddp_no_sync(model: nn.Module, last_micro_step: bool):
    """Skip DDP's gradient all-reduce on every micro-step but the last one."""
    if last_micro_step or not isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def _now(device: torch.device):
    """A point in time on the device's own clock: a CUDA event recorded on the current stream (the
    host does not wait for the device), else the host clock."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(start, stop) -> float:
    """Seconds between two `_now` points; for CUDA events the host waits for `stop` alone."""
    if isinstance(stop, float):
        return stop - start
    stop.synchronize()
    return start.elapsed_time(stop) / 1000


def _timed_module(model: nn.Module) -> nn.Module:
    """Where the forward is timed: inside DDP (so its buffer broadcast before the forward is not
    counted); on a DataParallel wrapper itself, whose replicas run in threads of their own."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _forward(model, images, targets, device) -> tuple[dict, tuple]:
    """The loss dict, and the (start, stop) of the model's own forward on this rank (`_seconds`).

    Timed by hooks on the module inside DDP, so neither DDP's buffer broadcast before it nor any
    wait for another rank is counted: what is left differs between ranks only by their own work
    (images, sizes, device speed), which is what reveals a straggler. On GPUs the marks are CUDA
    events, read once the step's work is queued: no device-wide synchronization per forward.
    """
    marks = {}

    def mark(name):
        def hook(*_):
            marks[name] = _now(device)
        return hook

    timed = _timed_module(model)
    handles = [timed.register_forward_pre_hook(mark("start")), timed.register_forward_hook(mark("stop"))]
    called = time.perf_counter()
    try:
        loss_dict = model(images, targets)
    finally:
        for handle in handles:
            handle.remove()
    if "start" not in marks or "stop" not in marks:  # the hooks did not run: the host's view
        return loss_dict, (called, time.perf_counter())
    return loss_dict, (marks["start"], marks["stop"])


def forward_backward(model, images, targets, cfg: Run, device, scaler, accum_steps: int, sync: bool):
    try:  # DDP reports parameters without gradient in the next step's forward, or in backward
        with ddp_no_sync(model, sync):
            with autocast(cfg, device):
                loss_dict, forward_span = _forward(model, images, targets, device)
            loss = sum(loss_dict.values())  # a dict of tensors: sum its values, not the dict
            scaler.scale(loss / accum_steps).backward()
    except RuntimeError as err:
        if "find_unused_parameters" in str(err) or "did not receive grad" in str(err):
            raise UnusedParametersError("DDP: some parameters got no gradient; rerun with "
                                        "--find-unused-parameters (slower) or make every "
                                        "parameter take part in the loss") from None
        raise
    return loss_dict, forward_span


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
    rank_forward_times: list[float] = field(default_factory=list)  # each rank's own forward seconds
    skipped: bool = False
    stop_requested: bool = False  # some rank was asked to stop (preemption): every rank knows after this step


def zero_grads(model, optimizer) -> None:
    """DDP's `gradient_as_bucket_view` gradients alias its buckets only while they are kept: set to None,
    each backward allocates them anew and the reducer copies them in, the copy the option saves."""
    optimizer.zero_grad(set_to_none=not getattr(model, "gradient_as_bucket_view", False))


@dataclass
class _Unread:
    """A step's shared values on their way to the host (a copy queued behind the step's work), and
    what the host knew of it when it was queued."""

    names: list[str]
    values: torch.Tensor
    step: int
    epoch: int
    lr: float
    iter_time: float
    scale_fell: torch.Tensor | None = None  # fp16: GradScaler skipped the step


def _to_host(shared: torch.Tensor) -> torch.Tensor:
    """A host copy of `shared` that the host does not wait for: on GPUs into pinned memory, queued
    behind the step's work (reading it later waits for that work alone)."""
    host = torch.empty(shared.shape, dtype=shared.dtype, pin_memory=shared.is_cuda)
    return host.copy_(shared, non_blocking=True)


def _read(unread: _Unread, forward_times: bool) -> StepRecord:
    """The record of a step whose values are on the host now."""
    values, n = unread.values, len(unread.names)
    world = values.shape[0]
    mean_terms = (values[:, :n].sum(0) / world).tolist()
    return StepRecord(step=unread.step, epoch=unread.epoch, lr=unread.lr, loss=sum(mean_terms),
                      terms=dict(zip(unread.names, mean_terms)), data_time=float(values[:, n + 2].max()),
                      iter_time=unread.iter_time,
                      rank_forward_times=values[:, n + 1].tolist() if forward_times else [],
                      stop_requested=bool(values[:, n + 3].any()))


def _bad_ranks(unread: _Unread) -> list[int]:
    n = len(unread.names)
    return [r for r in range(unread.values.shape[0]) if unread.values[r, n] > 0]


def _nonfinite(step: int, bad_ranks: list[int], rank: int, terms: dict[str, float] | None) -> NonFiniteLossError:
    """The error for a non-finite loss; `terms`, this rank's loss terms where the host still has them."""
    had = f"; this rank ({rank}) had {', '.join(f'{k}={v:.4g}' for k, v in terms.items())}" if terms else ""
    return NonFiniteLossError(f"non-finite loss at step {step} on rank(s) {bad_ranks}{had}. Lower --lr, add "
                              "--clip-grad-norm, check the data, or allow skips with --skip-nonfinite N")


def _optimizer_step(model, optimizer, scaler, cfg: Run) -> torch.Tensor | None:
    """Clip and step; for fp16, whether GradScaler skipped the step (an overflow: its scale fell), as a
    device tensor the host reads with the step's other values (None without a GradScaler)."""
    if cfg.clip_grad_norm is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
    before = scaler._scale.clone() if scaler.is_enabled() else None  # its scale on the device (get_scale() reads it)
    scaler.step(optimizer)
    scaler.update()
    return None if before is None else scaler._scale < before


def train_step(model, optimizer, scaler, batches: Iterator, cfg: Run, state: TrainState, *,
               read: bool = True) -> list[StepRecord]:
    """One optimizer step: `accum_steps` forward/backward micro-steps, then clip and step.

    Returns the records of the steps whose values the host read with this one: this step's alone,
    or with `read=False` none: the step's shared values stay on their way to the host, and the
    host does not wait for the device (no sync in this function); a later read step returns them
    all, oldest first. Such an unread step is stepped without the non-finite check, which its read
    step makes for it (so a loop reads before each checkpoint); fp16's GradScaler still skips an
    overflowed step itself. --skip-nonfinite decides before the optimizer step, so with it every
    step is read.
    Raises `NonFiniteLossError` on every rank when any rank's loss is not finite (unless
    `--skip-nonfinite` still allows skipping it). `state.stop_requested` (this rank was told to stop)
    travels in the shared all-reduce, so every rank learns it at the same read step.
    """
    start = time.perf_counter()
    info = du.info()
    device = cfg.device
    accum = cfg.accum_steps
    read = read or cfg.skip_nonfinite > 0
    data_time = 0.0
    forward_spans = []
    totals: dict[str, torch.Tensor] = {}
    zero_grads(model, optimizer)
    for micro in range(accum):
        t_data = time.perf_counter()
        images, targets = next(batches)
        images, targets = to_device(images, targets, device, non_blocking=cfg.pin_memory)
        data_time += time.perf_counter() - t_data
        loss_dict, span = forward_backward(model, images, targets, cfg, device, scaler, accum, micro == accum - 1)
        forward_spans.append(span)
        for name, value in loss_dict.items():
            totals[name] = totals.get(name, 0.0) + value.detach().float() / accum
    names = sorted(totals)
    # one small all-reduce: each rank fills its own row with its terms, a NaN flag and its times
    n = len(names)
    shared = torch.zeros(info.world_size, n + 4, device=device)
    local = torch.stack([totals[name] for name in names])
    shared[info.rank, :n] = torch.nan_to_num(local, nan=0.0, posinf=0.0, neginf=0.0)
    shared[info.rank, n] = (~torch.isfinite(local)).any().float()
    if read:  # reading the forward's end waits for the device; every backward is queued by now
        shared[info.rank, n + 1] = sum(_seconds(*span) for span in forward_spans)
    shared[info.rank, n + 2] = data_time
    shared[info.rank, n + 3] = float(state.stop_requested)
    du.all_reduce_sum(shared)
    lr = optimizer.param_groups[0]["lr"]
    if not read:
        scale_fell = _optimizer_step(model, optimizer, scaler, cfg)
        state.step += 1
        state.unread.append(_Unread(names, _to_host(shared), state.step, state.epoch, lr,
                                    time.perf_counter() - start, scale_fell))
        return []
    now = _Unread(names, shared.cpu(), state.step + 1, state.epoch, lr, 0.0)  # waits for the step's work
    earlier, state.unread = state.unread, []
    for unread in earlier:  # their copies were queued before this one: on the host by now
        if _bad_ranks(unread):
            raise _nonfinite(unread.step, _bad_ranks(unread), info.rank, None)
    records = [_read(unread, False) for unread in earlier]
    state.scaler_skipped += sum(bool(unread.scale_fell) for unread in earlier if unread.scale_fell is not None)
    bad_ranks = _bad_ranks(now)
    if bad_ranks:
        if state.nonfinite_skipped >= cfg.skip_nonfinite:
            raise _nonfinite(now.step, bad_ranks, info.rank, {name: float(totals[name]) for name in names})
        state.nonfinite_skipped += 1
        zero_grads(model, optimizer)
        if info.is_main:
            log.warning("non-finite loss at step %d on rank(s) %s: step skipped (%d of --skip-nonfinite %d)",
                        now.step, bad_ranks, state.nonfinite_skipped, cfg.skip_nonfinite)
    else:
        scale_fell = _optimizer_step(model, optimizer, scaler, cfg)
        state.scaler_skipped += scale_fell is not None and bool(scale_fell)
    state.step += 1
    now.iter_time = time.perf_counter() - start
    return records + [dataclasses.replace(_read(now, True), skipped=bool(bad_ranks))]
