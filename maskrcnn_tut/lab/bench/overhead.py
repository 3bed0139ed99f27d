"""What the training loop adds over the bare model step (`python -m maskrcnn_tut.lab.bench overhead`).

In one process, on the same fixed batches already in memory (so data loading is not part of it),
three loops take turns, round after round, so drift of the machine hits them alike:

- `bare`: `model(images, targets)`, sum the loss dict, backward, optimizer step, zero_grad:
  the least any training loop must do;
- `engine.train_step`: the package's step (autocast, accumulation, the shared all-reduce of loss
  terms and flags, the non-finite guard, the forward timing);
- `train.py's loop`: the step plus what train.py does after each step (`engine.after_step`: the
  schedule, the metrics logger, the straggler check) and the SIGTERM check; the same function
  train.py calls, so a call its loop gains is measured here too.

Overhead is each loop's median step time minus the bare one's, with the rounds' spread. A loop
that slows down from round to round shows as a rising per-round median. All three loops train the same
model, so a slowdown they share is the model's, not a loop's: as the RPN learns, more proposals overlap
an object, the box sampler keeps more positives (up to a quarter of its 512 per image) and the mask
head, which runs on every positive, does more work. Each round's mask-head RoIs per step are counted to
show it.
"""
from __future__ import annotations

import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import distributed as du
from ...config import make_config
from ...data.loader import to_device
from ...engine import StepRecord, after_step
from ...monitor import MetricsLogger, StragglerCheck
from ..provenance import provenance
from ..rig import Rig, build_rig, synthetic_batches
from ..stored.result import BenchResult, python_call

LOOPS = ("bare", "engine.train_step", "train.py's loop")


@dataclass
class FixedBatchRig:
    """A `rig.Rig` stepping on one synthetic batch already in memory, either bare or through
    `engine.train_step` (timed against each other here and by `tools/overhead_ops.py`)."""

    rig: Rig
    images: list  # the batch on the device, as floats: what the bare step feeds the model
    targets: list

    def bare_step(self) -> None:
        """The least any training loop must do: forward, summed losses, backward, optimizer step."""
        losses = self.rig.model(self.images, self.targets)
        sum(losses.values()).backward()
        self.rig.optimizer.step()
        self.rig.optimizer.zero_grad(set_to_none=True)

    def train_step(self, stop_requested: bool = False) -> StepRecord:
        """The package's step on the same batch (moved and converted each step, as in training)."""
        return self.rig.step(stop_requested)


def fixed_batch_rig(preset: str | None = None, image_size: int | None = None, batch_size: int | None = None,
                    **overrides) -> FixedBatchRig:
    """The preset's rig (`rig.build_rig`, in one process) on `batch_size` synthetic square images
    of `image_size` px (default: the preset's min size)."""
    settings = make_config(preset, **{k: v for k, v in overrides.items() if v is not None},
                           **({"batch_size": batch_size} if batch_size else {}))
    du.init_distributed()  # this process's device: its GPU where there is one
    rig = build_rig(settings, batches=synthetic_batches(settings, image_size))
    images, targets = to_device(*next(rig.batches), rig.device)
    return FixedBatchRig(rig, images, targets)


def overhead(preset: str | None = None, image_size: int | None = None, batch_size: int | None = None,
             rounds: int = 4, steps: int = 4, warmup: int = 2, **overrides) -> BenchResult:
    """Median step time of each loop in `LOOPS` over `rounds` alternating rounds of `steps` steps."""
    fixed = fixed_batch_rig(preset, image_size, batch_size, **overrides)
    rig = fixed.rig
    cfg, device, model = rig.cfg, rig.device, rig.module
    size = image_size or cfg.min_size
    mask_rois: list[int] = []  # positives the mask head pooled, one entry per forward
    model.roi_heads.mask_roi_pool.register_forward_pre_hook(
        lambda _, args: mask_rois.append(sum(len(boxes) for boxes in args[1])))
    with tempfile.TemporaryDirectory() as out:
        logger = MetricsLogger(Path(out), 10**6, 0, cfg.global_batch, device, cfg.print_freq, progress=False)
        stragglers, stop = StragglerCheck(every=cfg.print_freq), threading.Event()

        def loop_step(name: str) -> None:
            if name == "bare":
                fixed.bare_step()
                return
            record = fixed.train_step(stop_requested=stop.is_set())
            if name == LOOPS[2]:
                after_step(rig.scheduler, [record], (logger, stragglers))

        for name in LOOPS:
            for _ in range(warmup):
                loop_step(name)
        per_round: dict[str, list[float]] = {name: [] for name in LOOPS}
        rois_per_round: dict[str, list[float]] = {name: [] for name in LOOPS}
        for _ in range(rounds):
            for name in LOOPS:
                times, mask_rois[:] = [], []
                for _ in range(steps):
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    started = time.perf_counter()
                    loop_step(name)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - started)
                per_round[name].append(statistics.median(times))
                rois_per_round[name].append(statistics.mean(mask_rois))
        logger.close()
    bare = statistics.median(per_round["bare"])
    rows = []
    for name in LOOPS:
        medians = per_round[name]
        step = statistics.median(medians)
        rows.append({"loop": name, "s/step": step, "min round": min(medians), "max round": max(medians),
                     "overhead s": step - bare, "overhead %": 100 * (step - bare) / bare,
                     "rounds": ", ".join(f"{m:.3f}" for m in medians),
                     "mask RoIs/step by round": ", ".join(f"{r:.0f}" for r in rois_per_round[name])})
    notes = [f"{cfg.preset} ({cfg.backbone}-FPN), {cfg.batch_size} synthetic {size} px images per step, already in "
             f"memory, on {device}; {rounds} alternating rounds of {steps} steps after {warmup} warm-up steps each; "
             "s/step is the median of the rounds' medians.",
             "A loop whose per-round medians rise round after round slows down over time; the three loops "
             "train one model in turns, so a rise they share, with the mask head's RoIs, is the model learning."]
    command = python_call("lab.bench.overhead", preset=preset, image_size=image_size, batch_size=batch_size,
                          rounds=rounds, steps=steps, warmup=warmup, **overrides)
    return BenchResult("overhead", "The training loop's overhead over the bare model step", rows,
                       ["loop", "s/step", "min round", "max round", "overhead s", "overhead %", "rounds",
                        "mask RoIs/step by round"], notes,
                       provenance(command))
