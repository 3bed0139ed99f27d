"""Steady-state speed: what a setting runs at once every input shape has been met, measured apart
from what meeting a shape costs, and settings compared so that noise cannot pass for a verdict.

Why: a batch whose padded input shape is new makes cuDNN build plans for every convolution (0.2 s a
step more in TF32, 0.65-0.83 s in fp16/bf16 on an H200, 2026-12-04), and a short benchmark on a
set of 16 shapes was mostly such steps. So here:

- Every step records its padded input shape (the backbone's input), the mask head's RoI count, its
  data wait, its time, and whether its shape was new to this setting (`ShapeWatch`, `StepClock`).
  On GPUs a step's time is the interval between CUDA events recorded as each step starts: the
  host does not wait for the device in between (train.py's reads, `Rig.step(read=...)`, stay as
  they are), and the events are read once a block ends.
- Warm-up lasts until no new shape has appeared for `quiet` steps (at most `max_warmup`).
- `summarize`: img/s over the steps without a new shape ("img/s steady"), beside img/s over all
  steps, what a new shape cost ("first-shape s", over warm-up and measured steps alike) and the
  setting's very first step, which also pays for what is done once per process or model.
- `interleave`: settings measured in blocks, in turn, in one process, each with its own model and
  loader from the same seed (so the same batches), for `rounds` rounds.
- `verdict`: "faster" or "slower" only when the bootstrap 95 % interval of the ratio of median
  steps lies outside the within-noise band (`NO_BAND`, the sweeps' 5 %) and every round agrees;
  "within noise" when the interval lies inside the band; else "inconclusive".
- `own_process`: a setting that can hang (cudnn.benchmark autotuning every RoI count) runs in a
  process of its own that writes one flushed JSON line per step, so a kill keeps what it measured.
"""
from __future__ import annotations

import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ... import distributed as du
from ...config import Config
from ...engine import advance_schedule
from ..rig import LONG_SCHEDULE, Rig, build_rig
from ..wording import FASTER, INCONCLUSIVE, SLOWER, WITHIN_NOISE
from .sweeps import NO_DIFFERENCE

#: Within this relative difference of speed two settings are the same (the sweeps' band).
NO_BAND = NO_DIFFERENCE
#: Warm-up ends after this many steps in a row without a new input shape.
QUIET_STEPS = 8
#: Bootstrap resamples of the ratio of medians (a fixed seed: the same lines give the same interval).
RESAMPLES = 2000


class ShapeWatch:
    """Forward pre-hooks on the backbone (its input: the padded batch) and the mask head (its input's
    first dimension: the RoI count); `take()` returns and clears what the last step saw."""

    def __init__(self, model: torch.nn.Module):
        self.shape: tuple[int, int] | None = None
        self.rois = 0
        self.seen: set[tuple[int, int]] = set()
        self.handles = [model.backbone.register_forward_pre_hook(self._backbone),
                        model.roi_heads.mask_head.register_forward_pre_hook(self._mask_head)]

    def _backbone(self, _module, args) -> None:
        self.shape = tuple(args[0].shape[-2:])

    def _mask_head(self, _module, args) -> None:
        self.rois += args[0].shape[0]

    def take(self) -> tuple[list[int] | None, int, bool]:
        """(padded shape, RoIs in the mask head, whether the shape is new to this watch) of the last step."""
        shape, rois = self.shape, self.rois
        new = shape is not None and shape not in self.seen
        self.seen.add(shape)
        self.shape, self.rois = None, 0
        return (list(shape) if shape else None), rois, new

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class StepClock:
    """Step times without making the host wait: CUDA events recorded as each step starts (read when
    `times()` is called), or the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def times(self) -> list[float]:
        """Seconds between consecutive marks (the last mark closes the last step); clears the marks."""
        marks, self.marks = self.marks, []
        if self.cuda:
            marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


class _Waits:
    """The batches of a rig, with the host's wait for each kept (the loader's share of a step)."""

    def __init__(self, batches: Iterator):
        self.batches, self.waits = batches, []

    def __iter__(self):
        return self

    def __next__(self):
        started = time.perf_counter()
        batch = next(self.batches)
        self.waits.append(time.perf_counter() - started)
        return batch


@dataclass
class Setting:
    """One setting under test: its rig, what it watches, and the lines it has measured."""

    label: str
    rig: Rig
    read_every: int
    watch: ShapeWatch = field(init=False)
    clock: StepClock = field(init=False)
    waits: _Waits = field(init=False)
    lines: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.watch, self.clock = ShapeWatch(self.rig.module), StepClock(self.rig.device)
        self.waits = _Waits(self.rig.batches)
        self.rig.batches = self.waits

    @property
    def images_per_step(self) -> int:
        return self.rig.cfg.global_batch

    def run(self, steps: int, phase: str, block: int, sink=None) -> list[dict]:
        """`steps` steps, their lines appended (and written to `sink` as each block ends)."""
        seen, waits = [], []
        self.clock.mark()
        for _ in range(steps):
            drawn = len(self.waits.waits)
            self.rig.step(read=(self.rig.state.step + 1) % self.read_every == 0)
            advance_schedule(self.rig.scheduler)
            self.clock.mark()
            seen.append(self.watch.take())
            waits.append(sum(self.waits.waits[drawn:]))  # every micro-batch of the step
        lines = []
        for wall, wait, (shape, rois, new) in zip(self.clock.times(), waits, seen):
            lines.append({"setting": self.label, "phase": phase, "block": block, "step": len(self.lines) + 1,
                          "wall s": round(wall, 6), "data s": round(wait, 6), "shape": shape, "rois": rois,
                          "new shape": new})
            self.lines.append(lines[-1])
        if sink is not None:
            sink(lines)
        return lines

    def warm_up(self, quiet: int = QUIET_STEPS, max_steps: int = 200, sink=None, deadline: float | None = None) -> int:
        """Steps until `quiet` in a row met no new shape (at most `max_steps`, and none begun after
        `deadline`, a `time.monotonic()` time); returns how many."""
        calm = taken = 0
        while calm < quiet and taken < max_steps and (deadline is None or time.monotonic() < deadline):
            chunk = min(quiet - calm, max_steps - taken)
            for line in self.run(chunk, "warm-up", 0, sink):
                calm = 0 if line["new shape"] else calm + 1
            taken += chunk
        return taken


def build_setting(label: str, cfg: Config, read_every: int | None = None) -> Setting:
    """A `Setting` of `cfg` (an underived Config) in this process; `read_every`: how often the host reads a
    step's loss (default: as train.py does, every step on a CPU, at its log lines on a GPU)."""
    settings = dataclasses.replace(cfg, skip_nonfinite=0)
    rig = build_rig(settings, total_steps=LONG_SCHEDULE)
    default = cfg.print_freq if rig.device.type == "cuda" else 1
    return Setting(label, rig, read_every or default)


def jsonl_sink(path: Path | str, **tags):
    """A sink that appends lines (with `tags`) to `path` and flushes them at once."""
    def write(lines: list[dict]) -> None:
        with open(path, "a") as out:
            for line in lines:
                out.write(json.dumps({**tags, **line}) + "\n")
            out.flush()
    return write


def interleave(settings: list[Setting], rounds: int = 3, block_steps: int = 20, sink=None,
               deadline: float | None = None) -> int:
    """Measure the (warmed-up) settings in blocks of `block_steps`, in turn, for `rounds` rounds;
    returns the rounds completed before `deadline` (a `time.monotonic()` time)."""
    for round_ in range(1, rounds + 1):
        for setting in settings:
            setting.run(block_steps, "measure", round_, sink)
        if deadline is not None and time.monotonic() > deadline:
            return round_
    return rounds


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(lines: list[dict], images_per_step: float) -> dict:
    """One setting's figures from its lines: img/s over the measured steps without a new shape, beside
    img/s over all measured steps and the first-shape cost (warm-up included), with counts and spread."""
    measured = [line for line in lines if line["phase"] == "measure"]
    steady = [line["wall s"] for line in measured if not line["new shape"]]
    later = lines[1:]  # the setting's first step also pays for everything done once (allocator, kernels' loading)
    new = [line["wall s"] for line in later if line["new shape"]]
    repeated = [line["wall s"] for line in later if not line["new shape"]]
    row = {"steps": len(measured), "steady steps": len(steady), "new-shape steps": len(measured) - len(steady),
           "warm-up steps": len(lines) - len(measured), "shapes": len({tuple(line["shape"] or ()) for line in lines}),
           "img/s steady": None, "img/s lo": None, "img/s hi": None, "img/s all steps": None,
           "first step s": lines[0]["wall s"] if lines else None, "first-shape s": None,
           "first-shape steps": len(new),
           "data ms": None, "step ms": None}
    if measured:
        row["img/s all steps"] = images_per_step * len(measured) / sum(line["wall s"] for line in measured)
        row["data ms"] = 1000 * statistics.median(line["data s"] for line in measured)
    if steady:
        middle = statistics.median(steady)
        row["img/s steady"], row["step ms"] = images_per_step / middle, 1000 * middle
        if len(steady) >= 4:
            q1, _, q3 = statistics.quantiles(steady, n=4)
            row["img/s lo"], row["img/s hi"] = images_per_step / q3, images_per_step / q1
    if new and repeated:
        row["first-shape s"] = statistics.median(new) - statistics.median(repeated)
    return row


def verdict(base: list[dict], other: list[dict], images: tuple[float, float] = (1, 1), band: float = NO_BAND,
            resamples: int = RESAMPLES) -> dict:
    """`other` against `base` (each a setting's lines, with `images` per step each) over their measured
    steps without a new shape: the speed ratio (img/s of other over base at their median steps; > 1 is
    faster), its bootstrap 95 % interval, each round's ratio, and the verdict (module doc)."""
    def steady(lines, block=None, per_step=1.0):  # seconds per image
        return [line["wall s"] / per_step for line in lines if line["phase"] == "measure"
                and not line["new shape"] and (block is None or line["block"] == block)]
    a, b = steady(base, per_step=images[0]), steady(other, per_step=images[1])
    if not a or not b:
        return {"ratio": None, "lo": None, "hi": None, "rounds": [], "verdict": INCONCLUSIVE}
    ratio = statistics.median(a) / statistics.median(b)
    draw = random.Random(0)
    ratios = sorted(statistics.median(draw.choices(a, k=len(a))) / statistics.median(draw.choices(b, k=len(b)))
                    for _ in range(resamples))
    lo, hi = ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]
    blocks = sorted({line["block"] for line in base if line["phase"] == "measure"})
    rounds = [statistics.median(steady(base, k, images[0])) / statistics.median(steady(other, k, images[1]))
              for k in blocks if steady(base, k) and steady(other, k)]
    if lo > 1 + band and rounds and all(r > 1 for r in rounds):
        found = FASTER
    elif hi < 1 - band and rounds and all(r < 1 for r in rounds):
        found = SLOWER
    elif 1 - band <= lo and hi <= 1 + band:
        found = WITHIN_NOISE
    else:
        found = INCONCLUSIVE
    return {"ratio": ratio, "lo": lo, "hi": hi, "rounds": rounds, "verdict": found}


def compare(settings: list[Setting], base: str) -> list[dict]:
    """Every setting's `summarize` row, with its `verdict` against the setting labelled `base`."""
    first = next(s for s in settings if s.label == base)
    rows = []
    for setting in settings:
        row = {"setting": setting.label, "images/step": setting.images_per_step,
               **summarize(setting.lines, setting.images_per_step)}
        if setting.label != base:
            found = verdict(first.lines, setting.lines, (first.images_per_step, setting.images_per_step))
            row.update({"vs": base, "ratio": found["ratio"], "ratio lo": found["lo"], "ratio hi": found["hi"],
                        "round ratios": found["rounds"], "verdict": found["verdict"]})
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- a setting in its own process


def own_process(overrides: dict, steps: int, out: Path | str, timeout_s: float, label: str,
                preset: str | None = None, quiet: int = QUIET_STEPS) -> dict:
    """Warm up and measure one setting (`bench_config(preset, **overrides)`) in a fresh process that
    writes each step as a flushed line to `out`; kill it after `timeout_s`. Returns its `summarize`
    row from whatever lines it wrote, with "finished" (False when it was killed or failed)."""
    command = [sys.executable, "-m", "maskrcnn_tut.lab.bench.steady", "--out", str(out), "--label", label,
               "--steps", str(steps), "--quiet", str(quiet), "--overrides", json.dumps(overrides)]
    if preset:
        command += ["--preset", preset]
    try:
        finished = subprocess.run(command, timeout=timeout_s, capture_output=True, text=True).returncode == 0
    except subprocess.TimeoutExpired:
        finished = False
    lines = [json.loads(line) for line in Path(out).read_text().splitlines()] if Path(out).exists() else []
    lines = [line for line in lines if line.get("setting") == label]
    images = lines[0]["images/step"] if lines else 0
    return {"setting": label, "finished": finished, **summarize(lines, images)}


def main(argv: list[str] | None = None) -> None:
    """The child of `own_process`."""
    import argparse

    from .harness import bench_config
    parser = argparse.ArgumentParser(description="one setting, steady state, a flushed line per step")
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quiet", type=int, default=QUIET_STEPS)
    parser.add_argument("--preset")
    parser.add_argument("--overrides", default="{}")
    args = parser.parse_args(argv)
    du.init_distributed()
    setting = build_setting(args.label, bench_config(args.preset, **json.loads(args.overrides)))
    sink = jsonl_sink(args.out, **{"images/step": setting.images_per_step})
    setting.read_every = 1  # each step's line is written as it ends: a killed run keeps them all
    calm = taken = 0
    while calm < args.quiet and taken < 25 * args.quiet:  # a step a block: each line flushed as its step ends
        calm = 0 if setting.run(1, "warm-up", 0, sink)[0]["new shape"] else calm + 1
        taken += 1
    for _ in range(args.steps):
        setting.run(1, "measure", 1, sink)


if __name__ == "__main__":
    main()
