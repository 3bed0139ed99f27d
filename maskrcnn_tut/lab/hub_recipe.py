"""A recipe card for a hub of 8 H100 or H200 GPUs (chapter 10): the command, what the `gpu-r50` preset then
sets, the memory and speed to expect per GPU, and the days for the schedule.

Every figure on the card says how it is known: derived here from the package's own settings (`config.derive`
for 8 processes on such a card), read from the committed H200 file (`book/results/`), quoted from a published
source (`PUBLISHED`), or a projection from those, marked as one. Nothing on it was measured on 8 GPUs.

- `card(gpus, card_gib)`: the card's rows, each {"item", "value", "how it is known"} in the book's language.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from .. import presets
from ..config import derive, make_config
from .wording import say

#: Published Mask R-CNN R50-FPN training figures the card quotes (none measured by the book).
PUBLISHED = {
    "source": "NVIDIA DeepLearningExamples, PyTorch/Segmentation/MaskRCNN/README.md (21.12 NGC container)",
    "hardware": "DGX A100 (8x A100 80GB)", "images per GPU": 12,
    "img/s 1 GPU": {"TF32": 23, "AMP": 24}, "img/s 8 GPUs": {"TF32": 193, "AMP": 209},
    "hours to train on 8": {"TF32": 2.15, "AMP": 1.85}, "box AP": 0.3765, "mask AP": 0.3408,
}
#: Detectron2's model zoo (MODEL_ZOO.md, normalization ablation, 8x V100): a GroupNorm R50-FPN step took 0.356 s
#: against FrozenBN's 0.261 s, 36 % slower (`presets.py` says the same).
GN_SLOWER = 0.356 / 0.261 - 1
#: MLPerf Training v3.0's fastest 8x H100 Mask R-CNN (also in chapter 11's `book.PUBLISHED_FAST_PATH`).
MLPERF = {"minutes": 19.18, "hardware": "8x H100", "source": "MLPerf Training v3.0, result 3.0-2064"}
#: The committed GPU file the card reads, and its row whose steady steps give the card's upper speed.
H200_FILE, H200_PART, H200_ROW = "1x-nvidia-h200-2026-12-04.json", "amp", "fp32 (no autocast)"
#: A step over this many times its row's median step met a new input shape (`gpu_files.SLOW_FACTOR`).
SLOW_FACTOR = 2.0
#: Images in COCO train2017, the dataset behind the usual Mask R-CNN schedules.
COCO_TRAIN_IMAGES = 118_287
#: NVIDIA's published AMP speed-up for its PyTorch Mask R-CNN against TF32 (DeepLearningExamples,
#: PyTorch/Segmentation/MaskRCNN: A100-80GB, 12 images per GPU, 1.04x on one GPU and 1.08x on eight);
#: chapter 5 quotes it, chapter 11 lists it in `PUBLISHED_FAST_PATH`. Not measured by the book.
PUBLISHED_AMP = {"low": 1.04, "high": 1.08, "baseline": "TF32", "hardware": "A100 (1 and 8 GPUs)",
                 "images per GPU": 12, "source": "NVIDIA DeepLearningExamples"}


def _row(item: str, value: str, known: str) -> dict:
    return {"item": item, "value": value, "how it is known": known}


def h200_steady(folder: Path | str) -> dict:
    """From the committed H200 file: the fp32 row's img/s over its steps that met no new shape (those under
    `SLOW_FACTOR` times the median step), how many they were, and the bf16 row's peak memory per image."""
    from .stored.result import load_suite
    _, parts, _ = load_suite(Path(folder) / H200_FILE)
    rows = {row["setting"]: row for row in parts[H200_PART].rows}
    row, bf16 = rows[H200_ROW], rows["bf16 autocast"]
    times = row["step s"]
    steady = [time for time in times if time <= SLOW_FACTOR * statistics.median(times)]
    return {"img/s": row["images/step"] / statistics.median(steady), "steps": len(steady), "of": len(times),
            "images": row["images/step"], "bf16 MiB per image": bf16["peak MiB/device"] / bf16["images/step"]}


def card(folder: Path | str, gpus: int = 8, card_gib: float = 80.0) -> list[dict]:
    """The card's rows for `gpus` GPUs of `card_gib` GiB (an H100 has 80, an H200 141; both fit the same
    images per GPU), worded in the book's language."""
    cfg = make_config("gpu-r50", accelerator="cpu", batch_size=presets.images_per_gpu(card_gib))
    run = derive(cfg, gpus, torch.device("cuda", 0))
    h200 = h200_steady(folder)
    low, high = PUBLISHED["img/s 1 GPU"]["TF32"], h200["img/s"]
    days = {epochs: (COCO_TRAIN_IMAGES * epochs / (high * gpus) / 86400, COCO_TRAIN_IMAGES * epochs / (low * gpus) / 86400)
            for epochs in (26, run.epochs)}
    memory = h200["bf16 MiB per image"] * run.batch_size / 1024
    amp, published = PUBLISHED_AMP, PUBLISHED
    return [
        _row(say("hub_recipe.command"), say("hub_recipe.command_value", gpus=gpus), say("hub_recipe.command_known")),
        _row(say("hub_recipe.batch"), say("hub_recipe.batch_value", images=run.batch_size, total=run.global_batch,
                                    lr=run.scaled_lr, base=cfg.lr), say("hub_recipe.derived", gpus=gpus, card=card_gib)),
        _row(say("hub_recipe.precision"), say("hub_recipe.precision_value"),
            say("hub_recipe.precision_known", low=amp["low"], high=amp["high"], baseline=amp["baseline"])),
        _row(say("hub_recipe.shapes"), say("hub_recipe.shapes_value", factor=run.aspect_ratio_group_factor,
                                     buckets=run.pad_buckets), say("hub_recipe.preset_known")),
        _row(say("hub_recipe.schedule"), say("hub_recipe.schedule_value", epochs=run.epochs), say("hub_recipe.preset_known")),
        _row(say("hub_recipe.workers"), say("hub_recipe.workers_value"), say("hub_recipe.workers_known")),
        _row(say("hub_recipe.memory"), say("hub_recipe.memory_value", gib=memory),
            say("hub_recipe.memory_known", mib=h200["bf16 MiB per image"] * h200["images"], images=h200["images"],
                file=H200_FILE, per_gpu=run.batch_size)),
        _row(say("hub_recipe.speed"), say("hub_recipe.speed_value", low=low, high=high),
            say("hub_recipe.speed_known", source=PUBLISHED["source"], hardware=PUBLISHED["hardware"],
                images=PUBLISHED["images per GPU"], tf32=low, amp=PUBLISHED["img/s 1 GPU"]["AMP"],
                all_tf32=PUBLISHED["img/s 8 GPUs"]["TF32"], all_amp=PUBLISHED["img/s 8 GPUs"]["AMP"],
                steady=high, steps=h200["steps"], of=h200["of"], h200_images=h200["images"], file=H200_FILE,
                gn=GN_SLOWER)),
        *[_row(say("hub_recipe.days", epochs=epochs),
              say("hub_recipe.days_value", low=lo, high=hi, low_h=24 * lo, high_h=24 * hi),
              say("hub_recipe.days_known", epochs=epochs, images=COCO_TRAIN_IMAGES, gpus=gpus,
                  scaling=published["img/s 8 GPUs"]["TF32"] / published["img/s 1 GPU"]["TF32"]))
          for epochs, (lo, hi) in days.items()],
        _row(say("hub_recipe.published"), say("hub_recipe.published_value", hardware=PUBLISHED["hardware"],
                                        tf32=PUBLISHED["hours to train on 8"]["TF32"],
                                        amp=PUBLISHED["hours to train on 8"]["AMP"], box=PUBLISHED["box AP"],
                                        mask=PUBLISHED["mask AP"], minutes=MLPERF["minutes"],
                                        mlperf_hardware=MLPERF["hardware"]),
            say("hub_recipe.published_known", source=PUBLISHED["source"], mlperf=MLPERF["source"])),
    ]
