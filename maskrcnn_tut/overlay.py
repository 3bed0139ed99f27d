"""Detections drawn over their image (masks, boxes, class names, scores) with torchvision's
drawing utilities and PIL: what `python -m maskrcnn_tut.predict` writes beside its results JSON."""
from __future__ import annotations

import colorsys
from collections.abc import Iterable
from pathlib import Path

import torch
from PIL import Image
from torchvision.utils import draw_bounding_boxes

from .atomic import atomic_write
from .evaluate import binary_masks

#: JPEG quality of the overlays (PNG inputs keep PNG: lossless in, lossless out).
JPEG_QUALITY = 90


def class_colors(num_classes: int) -> list[tuple[int, int, int]]:
    """One bright colour per label, spread over the hue circle (label 0 unused)."""
    return [tuple(int(255 * c) for c in colorsys.hsv_to_rgb((k * 0.618) % 1.0, 0.85, 1.0))
            for k in range(max(num_classes, 1))]


def draw(image: torch.Tensor, output: dict, class_names: list[str], threshold: float,
         mask_threshold: float = 0.5) -> torch.Tensor:
    """`image` (uint8 CHW) with the detections of `output` scoring at least `threshold`."""
    keep = output["scores"] >= threshold
    boxes, labels, scores = output["boxes"][keep].cpu(), output["labels"][keep].cpu(), output["scores"][keep].cpu()
    if not len(boxes):
        return image
    colors = class_colors(len(class_names) + 1)
    box_colors = [colors[int(label)] for label in labels]
    if "masks" in output:
        shown = {key: value[keep] if key in ("masks", "boxes") else value for key, value in output.items()}
        image = paint_masks(image, binary_masks(shown, mask_threshold), box_colors)
    names = [class_names[int(label) - 1] if 0 < int(label) <= len(class_names) else str(int(label))
             for label in labels]
    text = [f"{name} {float(score):.2f}" for name, score in zip(names, scores)]
    return draw_bounding_boxes(image, boxes, labels=text, colors=box_colors, width=2)


def paint_masks(image: torch.Tensor, masks: Iterable[torch.Tensor], colors: list[tuple[int, int, int]],
                alpha: float = 0.45) -> torch.Tensor:
    """torchvision's `draw_segmentation_masks` (each mask in its colour, overlaps black, blended by
    `alpha`) for bool masks that come one at a time, so that they are never all held at full size."""
    painted = image.clone()
    covered, overlap = (torch.zeros(image.shape[-2:], dtype=torch.bool) for _ in range(2))
    for mask, color in zip(masks, colors):
        painted[:, mask] = torch.tensor(color, dtype=image.dtype)[:, None]
        overlap |= covered & mask
        covered |= mask
    painted[:, overlap] = 0
    return (image * (1 - alpha) + painted * alpha).to(image.dtype)


def save(image: torch.Tensor, path: Path) -> None:
    """Write a uint8 CHW image as PNG or JPEG by `path`'s suffix, whole (`atomic.atomic_write`, without
    fsync: an overlay is drawn again by rerunning), so an interrupted run leaves no half-written overlay."""
    path.parent.mkdir(parents=True, exist_ok=True)
    picture = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
    options = {"format": "PNG"} if path.suffix.lower() == ".png" else {"format": "JPEG", "quality": JPEG_QUALITY}
    atomic_write(path, lambda f: picture.save(f, **options), durable=False)
