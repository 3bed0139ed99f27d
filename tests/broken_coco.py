"""A COCO dataset with every problem kind `maskrcnn_tut.data.clean` handles, for the fault tests.

`write_broken_coco(root)` writes `annotations/instances_{train,val}2017.json` and the image folders
and returns, next to the root, the problem counts the train split must report: each problem is
planted by one call that also records what the loader should count for it, so the expectations
come from how the data was built, not from typed-in figures.
"""
from __future__ import annotations

import copy
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils

from maskrcnn_tut.data.shapes import CATEGORIES, render_image

UNKNOWN_CATEGORY = 99
EXIF_REFERENCE = "exif_rotated_upright.png"


@dataclass
class BrokenCoco:
    root: Path
    expected: Counter  # problem kind -> count in the train split
    usable_train_images: int


def _rle(mask: np.ndarray) -> dict:
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"size": rle["size"], "counts": rle["counts"].decode("ascii")}


def _instances(shapes: list[dict]) -> list[dict]:
    """Valid annotations (no ids yet) of the visible part of each rendered shape, as compressed RLE:
    not what COCO writes for instances, but a valid encoding other exporters use, so the loader
    must keep reading it (the shapes dataset covers polygons)."""
    instances = []
    for shape in shapes:
        mask = shape["mask"]
        if mask.sum() < 16:
            continue
        ys, xs = np.nonzero(mask)
        bbox = [float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1), float(ys.max() - ys.min() + 1)]
        instances.append({"category_id": shape["category_id"], "bbox": bbox, "segmentation": _rle(mask),
                          "area": int(mask.sum()), "iscrowd": 0})
    return instances


class _Split:
    """One split being written: image files, json entries and the counts the loader must report."""

    def __init__(self, root: Path, split: str, seed: int):
        self.root, self.split = root, split
        self.image_dir = root / f"{split}2017"
        self.image_dir.mkdir(parents=True, exist_ok=True)
        self.rng = np.random.default_rng(seed)
        self.images: list = []
        self.annotations: list = []
        self.expected: Counter = Counter()
        self.usable = 0

    def render(self) -> tuple[Image.Image, list[dict]]:
        image, shapes = render_image(self.rng)
        return image, _instances(shapes)

    def add_image(self, file_name: str, size: tuple[int, int], annotations: list[dict], *,
                  usable: bool, expect: tuple[str, ...] = (), json_size: tuple[int, int] | None = None) -> dict:
        entry = {"id": len(self.images) + 1000, "file_name": file_name,
                 "width": (json_size or size)[0], "height": (json_size or size)[1]}
        self.images.append(entry)
        for ann in annotations:
            self.add_annotation(entry["id"], ann)
        self.usable += usable
        self.expected.update(expect)
        return entry

    def add_annotation(self, image_id, ann: dict, expect: tuple[str, ...] = (), ann_id=None) -> dict:
        ann = {"id": ann_id if ann_id is not None else len(self.annotations) + 1, "image_id": image_id, **ann}
        self.annotations.append(ann)
        self.expected.update(expect)
        return ann

    def save(self, image: Image.Image, file_name: str, **kwargs) -> str:
        image.save(self.image_dir / file_name, **kwargs)
        return file_name

    def good_image(self, name: str) -> dict:
        image, instances = self.render()
        return self.add_image(self.save(image, f"{name}.png"), image.size, instances, usable=True)

    def write(self) -> None:
        path = self.root / "annotations" / f"instances_{self.split}2017.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"images": self.images, "annotations": self.annotations,
                                    "categories": CATEGORIES}))


def _plant_file_problems(split: _Split) -> None:
    image, instances = split.render()
    split.add_image("missing.png", image.size, instances, usable=False, expect=("missing_image",))
    (split.image_dir / "garbage.png").write_bytes(b"this is not an image")
    split.add_image("garbage.png", image.size, instances, usable=False, expect=("unreadable_image",))
    split.save(image, "truncated.png")
    data = (split.image_dir / "truncated.png").read_bytes()
    (split.image_dir / "truncated.png").write_bytes(data[: len(data) // 2])
    split.add_image("truncated.png", image.size, instances, usable=False, expect=("truncated_image",))
    (split.image_dir / "folder.png").mkdir()  # a pipe is planted by the test of the scan (copytree refuses one)
    split.add_image("folder.png", image.size, instances, usable=False, expect=("not_a_file",))
    # 1 bit per pixel: a 24 KB file of 200 megapixels
    split.save(Image.new("1", (20_000, 10_000)), "bomb.png")
    split.add_image("bomb.png", image.size, instances, usable=False, expect=("too_many_pixels",))

    for mode in ("L", "RGBA", "P"):
        image, instances = split.render()
        split.add_image(split.save(image.convert(mode), f"mode_{mode}.png"), image.size, instances,
                        usable=True, expect=("converted_mode",))
    image, instances = split.render()
    split.add_image(split.save(image.convert("CMYK"), "mode_cmyk.jpg", quality=95), image.size, instances,
                    usable=True, expect=("converted_mode",))
    image, instances = split.render()
    sixteen = Image.fromarray(np.asarray(image.convert("L"), dtype=np.uint16) * 257)
    split.add_image(split.save(sixteen, "mode_16bit.png"), image.size, instances,
                    usable=True, expect=("converted_mode",))

    # stored on its side with EXIF orientation 6 ("rotate 90 degrees clockwise to view"); the json
    # and the annotations describe the upright picture
    image, instances = split.render()
    exif = Image.Exif()
    exif[0x0112] = 6
    split.add_image(split.save(image.transpose(Image.Transpose.ROTATE_90), "exif_rotated.jpg", exif=exif,
                               quality=95), image.size, instances, usable=True, expect=("exif_rotated",))
    image.save(split.root / EXIF_REFERENCE)  # the upright picture, outside the json, to compare with

    image, instances = split.render()
    split.add_image(split.save(image, "size_mismatch.png"), image.size, instances, usable=True,
                    expect=("size_mismatch",), json_size=(image.width + 10, image.height - 10))

    # names that lead out of the image folder, to a usable picture there: must never be read
    outside = split.root / EXIF_REFERENCE
    image, instances = split.render()
    for name in (str(outside.resolve()), f"../{EXIF_REFERENCE}", f"sub/../../{EXIF_REFERENCE}"):
        split.add_image(name, image.size, instances, usable=False, expect=("bad_file_name",))
    split.add_image("x" * 300 + ".png", image.size, instances, usable=False, expect=("bad_file_name",))

    # a strip a few pixels thick: torchvision's resize cannot make a batch of it
    for size in ((600, 2), (3, 400)):
        strip = Image.new("RGB", size, (200, 30, 30))
        box = [0.0, 0.0, float(size[0]), float(size[1])]
        polygon = [0.0, 0.0, box[2], 0.0, box[2], box[3], 0.0, box[3]]
        split.add_image(split.save(strip, f"strip_{size[0]}x{size[1]}.png"), size,
                        [{"category_id": 1, "bbox": box, "segmentation": [polygon], "area": size[0] * size[1],
                          "iscrowd": 0}], usable=False, expect=("extreme_aspect",))


def _plant_entry_problems(split: _Split) -> None:
    repeated = split.good_image("repeated")
    split.images.append(dict(repeated))  # an exact repeat: merged
    split.expected["duplicate_image_id"] += 1
    image, instances = split.render()
    shared = split.add_image(split.save(image, "shared_id_a.png"), image.size, instances, usable=False)
    image, instances = split.render()
    split.images.append({**shared, "file_name": split.save(image, "shared_id_b.png")})  # same id, other file
    split.expected["duplicate_image_id"] += 1

    split.images.append({"id": 1, "width": 10, "height": 10})  # no file_name
    split.annotations.append("not an annotation")
    split.expected["malformed_entry"] += 2
    split.add_annotation(10**6, _instances(render_image(split.rng)[1])[0], expect=("unknown_image",))

    image, _ = split.render()
    split.add_image(split.save(image, "no_annotations.png"), image.size, [], usable=False,
                    expect=("no_annotations",))


def _plant_annotation_problems(split: _Split) -> None:
    """One image that stays usable thanks to its good instances, carrying every bad annotation."""
    image, instances = split.render()
    entry = split.add_image(split.save(image, "bad_annotations.png"), image.size, instances, usable=True)
    width, height = image.size
    good = instances[0]
    image_id = entry["id"]
    zeros = np.zeros((height, width), dtype=np.uint8)
    some = zeros.copy()
    some[2:12, 3:15] = 1
    add = split.add_annotation
    add(image_id, {**good, "category_id": UNKNOWN_CATEGORY}, ("unknown_category",))
    add(image_id, {**good, "bbox": [5.0, 5.0, 0.0, 10.0]}, ("degenerate_box",))
    add(image_id, {**good, "bbox": [5.0, 5.0, float("nan"), 10.0]}, ("degenerate_box",))
    add(image_id, {**good, "bbox": [width + 5.0, 5.0, 10.0, 10.0]}, ("box_outside",))
    add(image_id, {**good, "bbox": [-5.0, 2.0, 20.0, 10.0], "segmentation": _rle(some)}, ("box_clamped",))
    polygon = [3.0, 2.0, 15.0, 2.0, 15.0, 12.0, 3.0, 12.0]
    add(image_id, {**good, "segmentation": [polygon, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]}, ("bad_polygon",))
    add(image_id, {**good, "segmentation": [[1.0, 2.0, 3.0, 4.0]]}, ("bad_polygon",))
    add(image_id, {**good, "segmentation": _rle(np.zeros((height + 1, width), dtype=np.uint8))}, ("bad_rle",))
    add(image_id, {**good, "segmentation": {"size": [height, width], "counts": [5, 10]}}, ("bad_rle",))
    add(image_id, {**good, "segmentation": {"size": 5, "counts": "abc"}}, ("bad_rle",))  # size not a list
    add(image_id, {**good, "segmentation": {"size": f"{height} {width}", "counts": "abc"}}, ("bad_rle",))
    add(image_id, {**good, "bbox": [10**400, 2.0, 5.0, 5.0]}, ("degenerate_box",))  # too big for a float
    # points far outside the image, and an outline that zigzags across it thousands of times: cheap
    # here, but of the kind that makes pycocotools segfault or take gigabytes (tests/core/test_data_clean.py)
    far = [3.0, 2.0, 15.0, 2.0, 15.0, 3.0 * height, 3.0, 12.0]
    zigzag = [v for k in range(2000) for v in (0.5 + (k % 2) * (width - 1), 1.0 + k % 7)]
    add(image_id, {**good, "segmentation": [far]}, ("absurd_polygon",))
    add(image_id, {**good, "segmentation": [[-(10**30), 2.0, 15.0, 2.0, 15.0, 12.0]]}, ("absurd_polygon",))
    add(image_id, {**good, "segmentation": [zigzag]}, ("absurd_polygon",))
    add(image_id, {**good, "segmentation": [polygon, far]}, ("absurd_polygon",))  # kept: one polygon left
    no_segmentation = {k: v for k, v in good.items() if k != "segmentation"}
    add(image_id, no_segmentation, ("missing_segmentation",))
    add(image_id, {**good, "segmentation": _rle(zeros)}, ("empty_mask",))
    add(image_id, {**good, "iscrowd": 1}, ("crowd",))
    first = add(image_id, good)
    add(image_id, {**good, "segmentation": _rle(some), "bbox": [3.0, 2.0, 12.0, 10.0]},
        ("duplicate_annotation_id",), ann_id=first["id"])  # same id, another instance: kept
    split.annotations.append(copy.deepcopy(first))  # an exact repeat: dropped
    split.expected["duplicate_annotation_id"] += 1

    image, instances = split.render()  # an image whose only annotation is unusable
    split.add_image(split.save(image, "only_bad_annotations.png"), image.size,
                    [{**instances[0], "category_id": UNKNOWN_CATEGORY}], usable=False,
                    expect=("unknown_category", "no_annotations"))


def write_broken_coco(root: Path, good_images: int = 6, val_images: int = 2, seed: int = 0) -> BrokenCoco:
    """Write the dataset under `root`; returns what the train split's `DataReport` must count."""
    root = Path(root)
    train = _Split(root, "train", seed)
    for index in range(good_images):
        train.good_image(f"good_{index}")
    _plant_file_problems(train)
    _plant_entry_problems(train)
    _plant_annotation_problems(train)
    train.write()
    val = _Split(root, "val", seed + 1)
    for index in range(val_images):
        val.good_image(f"good_{index}")
    val.write()
    return BrokenCoco(root, train.expected, train.usable)
