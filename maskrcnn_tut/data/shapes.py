"""The embedded default dataset: synthetic squares, circles and triangles written as real COCO.

The images and `instances_{split}2017.json` files land in the same layout as COCO itself, so the
shapes go through exactly the loader (`maskrcnn_tut.data.coco`) that a user's own data goes
through, and any COCO tool (pycocotools, torchvision's `CocoDetection` and detection reference)
reads them. As in COCO's own files, every instance (`iscrowd: 0`) is annotated with polygons: a
partly hidden shape with the polygons of its visible region, computed exactly with shapely (the
shape minus the shapes drawn after it, cut into hole-free pieces where one lies inside it).
Shapes are painted with pycocotools' polygon rasterization, so the pixels of each shape are the
mask its annotation decodes to (up to where hidden regions meet: IoU >= 0.9 per instance, 0.99
typically; `tests/test_shapes_coco.py`).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils
from shapely.geometry import LineString, Polygon
from shapely.ops import split
from tqdm.auto import tqdm

from ..errors import ConfigError

CATEGORIES = [
    {"id": 1, "name": "square", "supercategory": "shape"},
    {"id": 2, "name": "circle", "supercategory": "shape"},
    {"id": 3, "name": "triangle", "supercategory": "shape"},
]
SIDES = (112, 128, 144, 160)
#: Part of the cache folder's name: bump it whenever what is written changes, so old data is not reused.
#: 2: polygons for every instance (1 wrote partly hidden shapes as compressed RLE), pycocotools painting.
FORMAT_VERSION = 2
#: Instances whose visible region has fewer pixels are not annotated (a sliver teaches nothing).
MIN_AREA = 16


def default_cache_dir() -> Path:
    """`$MASKRCNN_TUT_CACHE`, else `~/.cache/maskrcnn_tut`."""
    return Path(os.environ.get("MASKRCNN_TUT_CACHE", Path.home() / ".cache" / "maskrcnn_tut"))


def shapes_root(n_train: int, n_val: int, seed: int, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"shapes-v{FORMAT_VERSION}-seed{seed}-{n_train}x{n_val}"


def _shape_polygon(kind: int, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Corners rounded as the json writes them, so the painted shape is the one annotated."""
    corners = {1: 4, 2: 48, 3: 3}[kind]
    return [(round(cx + r * math.cos(angle + 2 * math.pi * k / corners), 2),
             round(cy + r * math.sin(angle + 2 * math.pi * k / corners), 2)) for k in range(corners)]


def _polygon_mask(points: list[tuple[float, float]], width: int, height: int) -> np.ndarray:
    """The pixels pycocotools (so every COCO tool) decodes the polygon to."""
    rle = mask_utils.frPyObjects([[v for point in points for v in point]], height, width)
    return mask_utils.decode(rle)[..., 0].astype(bool)


def render_image(rng: np.random.Generator) -> tuple[Image.Image, list[dict]]:
    """One image and its instances: dicts with `category_id`, `polygon`, the visible `mask` and
    the `visible` region (a shapely geometry: the polygon minus the shapes drawn after it)."""
    width, height = int(rng.choice(SIDES)), int(rng.choice(SIDES))
    background = rng.integers(0, 256, size=3)
    ramp = np.linspace(-30, 30, height)[:, None, None] * rng.choice([-1, 1])
    noise = rng.normal(0, 8, size=(height, width, 3))
    pixels = np.clip(background[None, None, :] + ramp + noise, 0, 255).astype(np.uint8)
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
        pixels[full] = color.astype(np.uint8)
        region = Polygon(polygon)
        for earlier in shapes:
            earlier["mask"] &= ~full
            earlier["visible"] = earlier["visible"].difference(region)
        shapes.append({"category_id": kind, "polygon": polygon, "mask": full, "visible": region})
    return Image.fromarray(pixels), shapes


def _hole_free(polygon: Polygon) -> list[Polygon]:
    """`polygon` cut into pieces without holes (a COCO polygon has none; the pieces' union is it).

    Each cut is a vertical line through a hole, on a pixel edge where the hole allows, so no pixel
    centre lies on the seam between two pieces."""
    todo, pieces = [polygon], []
    while todo:
        piece = todo.pop()
        if not piece.interiors:
            pieces.append(piece)
            continue
        hole = Polygon(piece.interiors[0])
        _, y0, _, y1 = piece.bounds
        x = hole.representative_point().x  # strictly inside the hole
        cut = LineString([(round(x), y0 - 1), (round(x), y1 + 1)])
        if cut.intersection(hole).length == 0:  # the pixel edge misses this hole
            cut = LineString([(x, y0 - 1), (x, y1 + 1)])
        cut_pieces = [g for g in split(piece, cut).geoms if isinstance(g, Polygon)]
        if len(cut_pieces) < 2:
            raise RuntimeError(f"could not cut a hole out of {piece.wkt}")
        todo.extend(cut_pieces)
    return pieces


def coco_polygons(region) -> list[list[float]]:
    """A shapely (multi)polygon as a COCO polygon list: [[x1, y1, x2, y2, ...], ...], one flat,
    open ring per hole-free piece, coordinates to 2 decimals."""
    parts = [g for g in getattr(region, "geoms", [region]) if isinstance(g, Polygon) and not g.is_empty]
    polygons = []
    for piece in (p for part in parts for p in _hole_free(part)):
        ring = [(round(x, 2), round(y, 2)) for x, y in piece.exterior.coords[:-1]]
        if len(set(ring)) >= 3:
            polygons.append([v for point in ring for v in point])
    return polygons


def _annotation(shape: dict, image_id: int, ann_id: int) -> dict | None:
    height, width = shape["mask"].shape
    if int(shape["mask"].sum()) < MIN_AREA:
        return None
    segmentation = coco_polygons(shape["visible"])
    if not segmentation:
        return None
    rle = mask_utils.merge(mask_utils.frPyObjects(segmentation, height, width))
    area = int(mask_utils.area(rle))
    if area == 0:
        return None
    bbox = [float(v) for v in mask_utils.toBbox(rle)]  # as COCO: area and box of the decoded mask
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
    runs never see a half-written dataset. A folder that cannot be written (read-only, full) is
    one `ConfigError` naming it and `MASKRCNN_TUT_CACHE`.
    """
    final = Path(root) if root is not None else shapes_root(n_train, n_val, seed)
    if (final / "annotations" / "instances_val2017.json").exists():
        return final
    staging = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        write_split(staging, "train", n_train, seed, progress)
        write_split(staging, "val", n_val, seed, progress)
        if final.exists() and not any(final.iterdir()):
            final.rmdir()
        os.rename(staging, final)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        if (final / "annotations" / "instances_val2017.json").exists():
            return final  # another process finished first
        raise ConfigError(f"{final.parent}: cannot write the shapes dataset there ({err.strerror or err}); set "
                          "MASKRCNN_TUT_CACHE to a writable folder, or train on your own data with "
                          "--data-path") from None
    return final
