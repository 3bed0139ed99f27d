"""The experiments the chapters run and assert: exact proofs of what the training step does.

A detection-shaped toy model (lists of images and target dicts in, a loss dict out) runs through
the real `engine.train_step`, so the proofs exercise the same accumulation, `no_sync` and
all-reduce code that trains Mask R-CNN, at a size where float rounding is the only difference:
on GPUs they run in plain fp32 (no TF32) with deterministic cuDNN (`exact_fp32`), so the chapters'
1e-6 bounds hold there as on the CPU.

- `accumulation_check`: K accumulated micro-batches of B give the gradient of one batch of K*B (ch. 7).
- `ddp_accumulation_check`: the same under DDP, and one all-reduce per optimizer step with `no_sync`.
- `gradient_noise`: how far one batch's gradient is from the average, by batch size (ch. 1).
- `first_batches`: the first batch of each epoch, with and without `set_epoch` (ch. 3).

Chapter 9's straggler and all-reduce measurements are in `bench.communication`.

The functions named "run inside `processes.launch`" are called as `processes.launch(proofs.f, n, ...)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import torch
from torch import nn

from .. import distributed as du
from ..config import Config, derive, make_config
from ..data.loader import build_dataset, build_train_loader, collate, to_device
from .rig import build_rig


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


def model_device(model: nn.Module) -> torch.device:
    """The device of a model's parameters (inside any DDP/DP wrapper)."""
    return next(du.unwrap(model).parameters()).device


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """Plain fp32 matmuls and convolutions, cuDNN deterministic and not autotuned, for the duration:
    TF32 (on by default for cuDNN, and `configure_runtime` turns it on for matmuls) rounds to about
    1e-3 and cuDNN may pick another algorithm for a batch of 2 than for one of 16. Flags restored after."""
    flags = (torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"), \
        (torch.backends.cudnn, "deterministic"), (torch.backends.cudnn, "benchmark")
    saved = [getattr(owner, name) for owner, name in flags]
    for (owner, name), exact in zip(flags, (False, False, True, False)):
        setattr(owner, name, exact)
    try:
        yield
    finally:
        for (owner, name), value in zip(flags, saved):
            setattr(owner, name, value)


def accumulated_gradients(model: nn.Module, batches, accum_steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients left by one `engine.train_step` over `accum_steps` micro-batches, on the model's
    device (the lab's rig around the model, seeded with `seed` as a run with that --seed is), in exact fp32."""
    settings = make_config("cpu-tiny", accum_steps=accum_steps, optimizer="sgd", lr=1e-9, weight_decay=0.0, seed=seed)
    rig = build_rig(settings, device=model_device(model), batches=batches, model=model, wrap=None)
    with exact_fp32():
        rig.step()
    return {name: p.grad.detach().clone() for name, p in du.unwrap(model).named_parameters()}


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k].to(a[k].device)).abs().max()) for k in a)


def accumulation_check(accum_steps: int = 4, batch_size: int = 2, seed: int = 0) -> float:
    """Max |gradient difference| between K accumulated micro-batches of B and one batch of K*B."""
    batches = toy_batches(accum_steps, batch_size, seed)
    du.seed_everything(seed)
    model = TinyDetector()
    reference = TinyDetector()
    reference.load_state_dict(model.state_dict())
    accumulated = accumulated_gradients(model, batches, accum_steps)
    large = accumulated_gradients(reference, [_merge(batches)], 1)
    return max_abs_difference(accumulated, large)


def ddp_accumulation_check(accum_steps: int = 4, batch_size: int = 2, seed: int = 0) -> dict:
    """Run inside `processes.launch`: DDP + accumulation vs one process on the global batch.

    The models live on this process's device (`du.info().device`: its GPU where there is one),
    where `engine.train_step` also puts the batches. Returns (on every rank) the max gradient
    difference, how many all-reduces ran during the accumulated step, and how many run when every
    micro-step syncs (no `no_sync`).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    info = du.info()
    world = info.world_size
    all_batches = toy_batches(accum_steps * world, batch_size, seed)
    mine = all_batches[info.rank::world]  # each rank's micro-batches
    du.seed_everything(seed)
    model = TinyDetector().to(info.device)
    reference = TinyDetector().to(info.device)
    reference.load_state_dict(model.state_dict())
    calls = {"allreduce": 0}

    def counting_allreduce(state, bucket):
        calls["allreduce"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    device_ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
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


# --------------------------------------------------------------------------- chapter 1


def gradient_noise(cfg: Config, batch_sizes: Sequence[int], images_per_size: int, seed: int = 0) -> list[dict]:
    """How far one batch's gradient is from the average gradient, for each batch size, with its spread.

    A pool of `images_per_size` (N) training images is drawn at random, the same pool for every
    batch size. For batch size B it is split into k = N // B disjoint batches and each one's
    gradient g_b is taken (one `engine.train_step` at a vanishing learning rate, from the same
    weights). The noise is the batches' sample variance around their own mean, relative to the
    mean's squared norm:

        noise(B) = sum_b |g_b - mean|^2 / (k - 1) / |mean|^2

    The k - 1 matters. The k batches are the whole pool, so their mean is the pool's gradient, not
    the dataset's; dividing by k (the plain mean squared distance) gives an estimate whose
    expectation is S^2/B x (N - B)/N (S^2: the per-image gradient variance), a finite-population
    bias that grows with B (half at B = N/2), so noise falls faster than 1/B. Dividing by k - 1 is
    that finite-population correction: the variance's expectation is then S^2/B exactly (images
    drawn at random without replacement, a batch's gradient the mean of its images'), so it falls
    as 1/B where images are independent.

    Each row: batch size, batches (k), the noise, and its jackknife standard error over the k
    batches (`noise SE`; None when k < 3). Needs k >= 2 for every batch size.
    """
    rig = build_rig(dataclasses.replace(cfg, seed=seed), device="cpu")
    train_set, model = rig.train_set, rig.module
    if images_per_size > len(train_set):
        raise ValueError(f"gradient_noise: a pool of {images_per_size} images, but the dataset has {len(train_set)}")
    too_large = [b for b in batch_sizes if images_per_size // b < 2]
    if too_large:
        raise ValueError(f"gradient_noise: batch size(s) {too_large} leave fewer than two batches in a pool of "
                         f"{images_per_size} images; use images_per_size >= {2 * max(too_large)}")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed)).tolist()
    size = sum(p.numel() for p in model.parameters())
    rows = []
    for batch_size in batch_sizes:
        k = images_per_size // batch_size
        grads = torch.empty(k, size, dtype=torch.bfloat16)  # k gradients, in half the bytes of fp32
        for b in range(k):
            model.load_state_dict(start)
            batch = collate([train_set[i] for i in order[b * batch_size:(b + 1) * batch_size]])
            grads[b] = torch.cat([g.flatten() for g in accumulated_gradients(model, [batch], 1,
                                                                              seed + b * batch_size).values()])
        noise, error = _noise_from_gram(_gram(grads))
        rows.append({"batch size": batch_size, "batches": k, "relative gradient noise": noise, "noise SE": error})
        del grads
    model.load_state_dict(start)
    return rows


def _gram(stacked: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """G G^T for k stacked gradients: float32 products of a slice of columns at a time, summed in float64."""
    gram = torch.zeros(stacked.shape[0], stacked.shape[0], dtype=torch.float64)
    for begin in range(0, stacked.shape[1], chunk):
        part = stacked[:, begin:begin + chunk].float()
        gram += (part @ part.T).double()
    return gram


def batch_variance(gram: torch.Tensor) -> tuple[float, float]:
    """(variance, |mean|^2) of k batch gradients from their Gram matrix G G^T: the sample
    variance sum_b |g_b - mean|^2 / (k - 1) (the finite-population-corrected estimate of
    `gradient_noise`) and the squared norm of their mean."""
    k = gram.shape[0]
    total = float(gram.sum())  # |sum of g_b|^2
    return (float(gram.trace()) - total / k) / (k - 1), total / k ** 2


def _noise_from_gram(gram: torch.Tensor) -> tuple[float, float | None]:
    """(noise, jackknife standard error) of `gradient_noise` from the batches' Gram matrix."""
    def estimate(keep: torch.Tensor) -> float:
        variance, mean_norm = batch_variance(gram[keep][:, keep])
        return variance / mean_norm

    k = gram.shape[0]
    everything = torch.ones(k, dtype=torch.bool)
    noise = estimate(everything)
    if k < 3:
        return noise, None
    leave_one_out = []
    for j in range(k):
        keep = everything.clone()
        keep[j] = False
        leave_one_out.append(estimate(keep))
    mean = sum(leave_one_out) / k
    return noise, ((k - 1) / k * sum((v - mean) ** 2 for v in leave_one_out)) ** 0.5


# --------------------------------------------------------------------------- chapter 3


def first_batches(cfg: Config, set_epoch: bool, epochs: int = 2, rank: int = 0, world_size: int = 2) -> list[list[int]]:
    """The image ids of the first batch rank `rank` of `world_size` reads in each epoch from the
    package's training loader (`build_train_loader`: a `DistributedSampler` when world_size > 1),
    in a loop that calls `sampler.set_epoch(epoch)` before each epoch, or (set_epoch=False) the
    article's loop that never does. No process group is needed: the sampler takes rank and size."""
    run = derive(cfg, world_size, "cpu")
    loader = build_train_loader(build_dataset(run, "train"), run, rank, world_size)
    sampler = loader.batch_sampler.batch_sampler.sampler  # ResumableBatches -> batch sampler -> DistributedSampler
    firsts = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        _, targets = next(iter(loader))
        firsts.append([int(t["image_id"]) for t in targets])
    return firsts
