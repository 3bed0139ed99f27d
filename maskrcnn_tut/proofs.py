"""Small exact experiments proving the training step does what the book claims.

A detection-shaped toy model (lists of images and target dicts in, a loss dict out) runs through
the real `engine.train_step`, so the checks exercise the same accumulation, `no_sync` and
all-reduce code that trains Mask R-CNN, at a size where float rounding is the only difference.
Chapter 7 and the tests call these; `ddp_accumulation_check` runs inside `distributed.launch`.
"""
from __future__ import annotations

import torch
from torch import nn

from . import distributed as du
from .config import make_config
from .data.loader import to_device
from .engine import TrainState, build_optimizer, make_scaler, train_step


class TinyDetector(nn.Module):
    """Takes `(images, targets)` like torchvision's detectors and returns a dict of two losses."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, images, targets):
        features = torch.relu(self.conv(torch.stack(images))).mean(dim=(2, 3))
        predictions = self.head(features)
        wanted = torch.stack([t["value"] for t in targets])
        return {"loss_value": nn.functional.mse_loss(predictions[:, 0], wanted[:, 0]),
                "loss_other": nn.functional.smooth_l1_loss(predictions[:, 1], wanted[:, 1])}


def toy_batches(count: int, batch_size: int, seed: int = 0) -> list[tuple[list, list]]:
    """`count` batches of `batch_size` random 8x8 uint8 images with random regression targets."""
    gen = torch.Generator().manual_seed(seed)
    return [([torch.randint(0, 256, (3, 8, 8), generator=gen, dtype=torch.uint8) for _ in range(batch_size)],
             [{"value": torch.randn(2, generator=gen)} for _ in range(batch_size)])
            for _ in range(count)]


def _merge(batches):
    return [img for b in batches for img in b[0]], [t for b in batches for t in b[1]]


def accumulated_gradients(model: nn.Module, batches, accum_steps: int) -> dict[str, torch.Tensor]:
    """Gradients left by one `engine.train_step` over `accum_steps` micro-batches."""
    cfg = make_config("cpu-tiny", accum_steps=accum_steps, optimizer="sgd", lr=1e-9, weight_decay=0.0)
    optimizer = build_optimizer(model, cfg)
    train_step(model, optimizer, make_scaler(cfg, torch.device("cpu")), iter(batches), cfg,
               torch.device("cpu"), TrainState(), [])
    return {name: p.grad.detach().clone() for name, p in du.unwrap(model).named_parameters()}


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def accumulation_check(accum_steps: int = 4, batch_size: int = 2, seed: int = 0) -> float:
    """Max |gradient difference| between K accumulated micro-batches of B and one batch of K*B."""
    batches = toy_batches(accum_steps, batch_size, seed)
    torch.manual_seed(seed)
    model = TinyDetector()
    reference = TinyDetector()
    reference.load_state_dict(model.state_dict())
    accumulated = accumulated_gradients(model, batches, accum_steps)
    large = accumulated_gradients(reference, [_merge(batches)], 1)
    return max_abs_difference(accumulated, large)


def ddp_accumulation_check(accum_steps: int = 4, batch_size: int = 2, seed: int = 0) -> dict:
    """Run inside `distributed.launch`: DDP + accumulation vs one process on the global batch.

    Returns (on every rank) the max gradient difference, how many all-reduces ran during the
    accumulated step, and how many run when every micro-step syncs (no `no_sync`).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    info = du.info()
    world = info.world_size
    all_batches = toy_batches(accum_steps * world, batch_size, seed)
    mine = all_batches[info.rank::world]  # each rank's micro-batches
    torch.manual_seed(seed)
    model = TinyDetector()
    reference = TinyDetector()
    reference.load_state_dict(model.state_dict())
    calls = {"allreduce": 0}

    def counting_allreduce(state, bucket):
        calls["allreduce"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, counting_allreduce)
    accumulated = accumulated_gradients(ddp, mine, accum_steps)
    with_no_sync = calls["allreduce"]
    # the same micro-steps with a sync on every one: what no_sync saves
    calls["allreduce"] = 0
    for images, targets in mine:
        sum(ddp(*to_device(images, targets, info.device)).values()).backward()
    every_step = calls["allreduce"]
    large = accumulated_gradients(reference, [_merge(all_batches)], 1)
    return {"max_abs_diff": max_abs_difference(accumulated, large),
            "allreduce_calls_accumulated": with_no_sync, "allreduce_calls_every_micro_step": every_step,
            "world_size": world, "accum_steps": accum_steps}
