"""The embedded default dataset: synthetic squares, circles and triangles written as real COCO.

The images and `instances_{split}2017.json` files land in the same layout as COCO itself, so the
shapes go through exactly the loader (`maskrcnn_tut.data.coco`) that a user's own data goes
through. Unoccluded shapes are annotated with polygons, partly hidden ones with RLE masks of their
visible pixels, so both COCO segmentation encodings are exercised.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from pycocotools import mask as mask_utils
from tqdm.auto import tqdm

CATEGORIES = [
    {"id": 1, "name": "square", "supercategory": "shape"},
    {"id": 2, "name": "circle", "supercategory": "shape"},
    {"id": 3, "name": "triangle", "supercategory": "shape"},
]
SIDES = (112, 128, 144, 160)
FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    """`$MASKRCNN_TUT_CACHE`, else `~/.cache/maskrcnn_tut`."""
    return Path(os.environ.get("MASKRCNN_TUT_CACHE", Path.home() / ".cache" / "maskrcnn_tut"))


def shapes_root(n_train: int, n_val: int, seed: int, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"shapes-v{FORMAT_VERSION}-seed{seed}-{n_train}x{n_val}"


def _shape_polygon(kind: int, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    corners = {1: 4, 2: 48, 3: 3}[kind]
    return [(cx + r * math.cos(angle + 2 * math.pi * k / corners),
             cy + r * math.sin(angle + 2 * math.pi * k / corners)) for k in range(corners)]


def _polygon_mask(points: list[tuple[float, float]], width: int, height: int) -> np.ndarray:
    canvas = Image.new("L", (width, height), 0)
    ImageDraw.Draw(canvas).polygon(points, fill=1)
    return np.asarray(canvas, dtype=bool)


def render_image(rng: np.random.Generator) -> tuple[Image.Image, list[dict]]:
    """One image and its instances: dicts with `category_id`, `polygon` and visible `mask`."""
    width, height = int(rng.choice(SIDES)), int(rng.choice(SIDES))
    background = rng.integers(0, 256, size=3)
    ramp = np.linspace(-30, 30, height)[:, None, None] * rng.choice([-1, 1])
    noise = rng.normal(0, 8, size=(height, width, 3))
    pixels = np.clip(background[None, None, :] + ramp + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    shapes: list[dict] = []
    for _ in range(int(rng.integers(1, 4))):
        for _attempt in range(10):  # place it so that it hides at most half of any earlier shape
            kind = int(rng.integers(1, 4))
            r = float(rng.uniform(0.12, 0.28) * min(width, height))
            cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
            polygon = _shape_polygon(kind, cx, cy, r, float(rng.uniform(0, 2 * math.pi)))
            full = _polygon_mask(polygon, width, height)
            if all((s["mask"] & ~full).sum() >= 0.5 * s["mask"].sum() for s in shapes):
                break
        else:
            continue
        color = rng.integers(0, 256, size=3)
        while np.abs(color - background).sum() < 150:  # keep shapes visible against the background
            color = rng.integers(0, 256, size=3)
        draw.polygon(polygon, fill=tuple(int(c) for c in color))
        for earlier in shapes:
            earlier["mask"] &= ~full
        shapes.append({"category_id": kind, "polygon": polygon, "mask": full})
    return image, shapes


def _annotation(shape: dict, image_id: int, ann_id: int) -> dict | None:
    mask = shape["mask"]
    area = int(mask.sum())
    if area < 16:
        return None
    ys, xs = np.nonzero(mask)
    bbox = [float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1), float(ys.max() - ys.min() + 1)]
    full = _polygon_mask(shape["polygon"], mask.shape[1], mask.shape[0])
    if (full == mask).all():
        segmentation = [[round(v, 2) for point in shape["polygon"] for v in point]]
    else:
        rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
        segmentation = {"size": rle["size"], "counts": rle["counts"].decode("ascii")}
    return {"id": ann_id, "image_id": image_id, "category_id": shape["category_id"],
            "segmentation": segmentation, "area": area, "bbox": bbox, "iscrowd": 0}


def write_split(root: Path, split: str, count: int, seed: int, progress: bool = True) -> Path:
    """Write `count` images to `root/{split}2017/` and their COCO json; returns the json path."""
    image_dir = root / f"{split}2017"
    image_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    split_offset = {"train": 0, "val": 1}.get(split, 2)
    for index in tqdm(range(count), desc=f"shapes {split}", disable=not progress, leave=False):
        image_id = index + 1
        rng = np.random.default_rng([seed, split_offset, index])
        image, shapes = render_image(rng)
        file_name = f"{image_id:06d}.png"
        image.save(image_dir / file_name, compress_level=1)
        images.append({"id": image_id, "file_name": file_name, "width": image.width, "height": image.height})
        for shape in shapes:
            ann = _annotation(shape, image_id, len(annotations) + 1)
            if ann is not None:
                annotations.append(ann)
    ann_path = root / "annotations" / f"instances_{split}2017.json"
    ann_path.parent.mkdir(parents=True, exist_ok=True)
    ann_path.write_text(json.dumps({"info": {"description": f"maskrcnn_tut synthetic shapes, seed {seed}"},
                                    "images": images, "annotations": annotations,
                                    "categories": CATEGORIES}))
    return ann_path


def ensure_shapes_dataset(n_train: int = 2000, n_val: int = 200, seed: int = 0,
                          root: Path | str | None = None, progress: bool = True) -> Path:
    """Generate the shapes dataset once (deterministic by seed) and return its COCO root.

    Written to a temporary folder and renamed into place, so concurrent callers and interrupted
    runs never see a half-written dataset.
    """
    final = Path(root) if root is not None else shapes_root(n_train, n_val, seed)
    if (final / "annotations" / "instances_val2017.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    write_split(staging, "train", n_train, seed, progress)
    write_split(staging, "val", n_val, seed, progress)
    if final.exists() and not any(final.iterdir()):
        final.rmdir()
    try:
        os.rename(staging, final)
    except OSError:  # another process finished first, or the folder holds something else
        shutil.rmtree(staging, ignore_errors=True)
        if not (final / "annotations" / "instances_val2017.json").exists():
            raise
    return final
