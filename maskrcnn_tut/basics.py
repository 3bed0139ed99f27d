"""The measurements and arithmetic behind chapters 1-3 (why several GPUs, the setup, the DataLoader),
beside `proofs.gradient_noise` and `memory.bytes_per_parameter`, which those chapters also run.

- `single_device_speed()`: this machine's training speed on one device (a GPU, or the whole CPU),
  a `BenchResult` so `bench.cache.cached` keeps it and its spread (ch. 1).
- `coco_days_table(speeds, images)`: days to train COCO's schedules at each speed: the article's
  own 5.2 img/s beside this machine's (ch. 1).
- `stack_today()`: the article's software stack, what replaces it today, and this machine's
  versions from `hardware.environment_report()` (ch. 2).
- `first_batches(cfg, set_epoch)`: what the package's training loader gives rank r at the start of
  each epoch, with and without `DistributedSampler.set_epoch` (ch. 3).
- `loader_verdict(sweep)`: what `bench.sweep_loader` says about worker processes on this machine,
  with the bound workers cannot beat (ch. 3).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Sequence

from . import bench
from .bench.cache import versus
from .bench.results import BenchResult, python_call
from .config import Config
from .data.loader import build_datasets, build_train_loader
from .hardware import environment_report, provenance

SECONDS_PER_DAY = 86_400
#: The environment report's row naming the CUDA runtime the wheel bundles.
CUDA_ROW = "CUDA (the wheel's runtime)"
#: COCO schedules in epochs: Detectron2's 1x (90k iterations of 16 images, about 12 epochs over
#: train2017) and torchvision's reference recipe (26 epochs), both from an ImageNet backbone.
COCO_SCHEDULES = {"12 epochs (1x, Detectron2)": 12, "26 epochs (torchvision reference)": 26}


# --------------------------------------------------------------------------- chapter 1


def single_device_speed(preset: str | None = None, steps: int = 12, warmup: int = 3,
                        max_seconds: float | None = 20.0) -> BenchResult:
    """The preset's training speed on one device (one GPU, or one process using every usable CPU
    core), in a fresh process through `bench.launch_measure`: one row, "one device"."""
    cfg = bench.bench_config(preset)
    measurement = bench.launch_measure(cfg, 1, [{"steps": steps, "warmup": warmup, "max_seconds": max_seconds}])[0]
    row = {"setup": "one device", "preset": f"{cfg.preset} ({cfg.backbone}-FPN, {cfg.min_size} px)",
           **measurement.row()}
    return BenchResult("single_device_speed", "Training speed on one device", [row],
                       ["setup", "preset", "img/s", "steps", "peak MiB/device"], [],
                       provenance(python_call("basics.single_device_speed", preset=preset, steps=steps,
                                              warmup=warmup, max_seconds=max_seconds)))


def coco_days(img_per_s: float, epochs: float, images: int) -> float:
    """Days one device needs for `epochs` passes over `images` at `img_per_s`."""
    return images * epochs / img_per_s / SECONDS_PER_DAY


def coco_days_table(speeds: Sequence[dict], images: int, schedules: dict[str, float] | None = None) -> list[dict]:
    """For each speed (a dict with "source" and "img/s", optionally "img/s lo"/"img/s hi"), the days
    each schedule takes on one device; with a spread, "days range" gives the longest schedule's
    days at the high and low img/s."""
    schedules = schedules or COCO_SCHEDULES
    rows = []
    for speed in speeds:
        row = {"source": speed["source"], "img/s": speed["img/s"]}
        row.update({f"{name}, days": coco_days(speed["img/s"], epochs, images) for name, epochs in schedules.items()})
        if speed.get("img/s lo") and speed.get("img/s hi"):
            longest = max(schedules.values())
            row["days range"] = (f"{coco_days(speed['img/s hi'], longest, images):.3g}-"
                                 f"{coco_days(speed['img/s lo'], longest, images):.3g}")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- chapter 2


def stack_today(report: list[dict] | None = None) -> list[dict]:
    """The article's software stack (「必要なソフトウェア Stack」 and its launch command), what this
    book uses instead, and what this machine has (`hardware.environment_report()`)."""
    have = {row[""]: row["this machine"] for row in (report or environment_report())}
    torchrun = shutil.which("torchrun") or (str(Path(sys.executable).with_name("torchrun"))
                                            if Path(sys.executable).with_name("torchrun").exists() else None)
    try:
        import cv2  # noqa: F401  (only to say whether it is there)
        opencv = "installed (unused)"
    except ImportError:
        opencv = "not installed"
    return [
        {"the article": "PyTorch 1.6 or later", "today": "PyTorch 2.x, pinned by requirements.txt (chapter 2's check)",
         "this machine": have.get("PyTorch / torchvision", "")},
        {"the article": "CUDA 10.2 or later", "today": "the CUDA runtime inside the PyTorch wheel, and a recent "
         "NVIDIA driver; no CUDA toolkit to install",
         "this machine": f"CUDA {have.get(CUDA_ROW, '')}; GPUs: {have.get('GPUs', '')}"},
        {"the article": "NCCL (implied by `backend='nccl'`)", "today": "in the wheel; gloo for CPU processes",
         "this machine": f"NCCL {have.get('NCCL', '')}; backends {have.get('distributed backends', '')}"},
        {"the article": "`python -m torch.distributed.launch --nproc_per_node=4 train_script.py`",
         "today": "`torchrun --nproc_per_node=4 maskrcnn_tut/train.py`: `launch` is deprecated, runs torchrun's "
         "code and passes `--local-rank` to the script unless `--use-env` (chapter 4)",
         "this machine": f"torchrun: `{torchrun}`" if torchrun else "no torchrun on PATH: use "
         "`python -m torch.distributed.run`"},
        {"the article": "OpenCV for image transforms", "today": "not needed: torchvision.transforms.v2 moves "
         "boxes and masks with the pixels", "this machine": f"OpenCV {opencv}"},
        {"the article": "numpy / pillow", "today": "installed with torchvision", "this machine":
         f"numpy {_version('numpy')}, pillow {_version('pillow')}; Python {have.get('Python', '')}"},
    ]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------- chapter 3


def first_batches(cfg: Config, set_epoch: bool, epochs: int = 2, rank: int = 0, world_size: int = 2) -> list[list[int]]:
    """The image ids of the first batch rank `rank` of `world_size` reads in each epoch from the
    package's training loader (`build_train_loader`: a `DistributedSampler` when world_size > 1),
    in a loop that calls `sampler.set_epoch(epoch)` before each epoch, or (set_epoch=False) the
    article's loop that never does. No process group is needed: the sampler takes rank and size."""
    train_set, _ = build_datasets(cfg)
    loader = build_train_loader(train_set, cfg, rank, world_size)
    sampler = loader.batch_sampler.batch_sampler.sampler  # ResumableBatches -> batch sampler -> DistributedSampler
    firsts = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        _, targets = next(iter(loader))
        firsts.append([int(t["image_id"]) for t in targets])
    return firsts


def loader_verdict(sweep: BenchResult) -> dict:
    """What a `bench.sweep_loader` result says about worker processes here.

    `bound`: the share of a step that workers=0 spends waiting for its batch, which is the most
    any number of workers can save. `best` / `worst`: the fastest and slowest setting with
    workers, as `ratio` / `worst ratio` of workers=0's img/s, and `verdict` for the best one:
    "faster", "slower" or "too noisy to tell" (img/s IQRs from `bench.cache` overlap; without a
    spread, within `bench.NO_DIFFERENCE`), or "more than the loader could save" when it is faster
    by more than `bound` allows (then something else, such as other work on the machine, moved
    the figures). `compute change`: how the slowest setting's median compute time per step
    compares with workers=0's (workers taking CPU time from the training).
    """
    rows = [row for row in sweep.rows if row.get("img/s")]
    base = next(row for row in rows if row["knobs"]["workers"] == 0)
    with_workers = [row for row in rows if row["knobs"]["workers"] > 0]
    best = max(with_workers, key=lambda row: row["img/s"])
    worst = min(with_workers, key=lambda row: row["img/s"])
    ratio = best["img/s"] / base["img/s"]
    order = versus(best, base)
    if order is None:
        order = 0 if abs(ratio - 1) < bench.NO_DIFFERENCE else (1 if ratio > 1 else -1)
    bound = base["data ms"] / (base["data ms"] + base["compute ms"])
    verdict = {1: "faster", -1: "slower", 0: "too noisy to tell"}[order]
    if verdict == "faster" and ratio - 1 > bound + bench.NO_DIFFERENCE:
        verdict = "more than the loader could save"
    return {"base": base, "best": best, "worst": worst, "ratio": ratio, "worst ratio": worst["img/s"] / base["img/s"],
            "bound": bound, "verdict": verdict, "compute change": worst["compute ms"] / base["compute ms"] - 1}
