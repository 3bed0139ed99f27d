"""COCO instance segmentation through pycocotools, hardened against the data real projects have.

`CocoDetection` reads any COCO-layout dataset: polygons and RLE become masks, `iscrowd` regions
are kept out of training targets, category ids are remapped to contiguous labels 1..K, and every
annotation or image that cannot be used is repaired or dropped *and counted* in a `DataReport`
(printed by `python -m maskrcnn_tut.data.check` and logged when training starts).
"""
from __future__ import annotations

import json
import logging
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from pycocotools import mask as mask_utils
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

log = logging.getLogger(__name__)


class DataError(ValueError):
    """The dataset leaves nothing to train on (bad json, no usable images): stop before heavy work."""


#: Every problem kind a dataset can have, and what the loader does about it.
PROBLEMS: dict[str, str] = {
    "missing_image": "image dropped",
    "unreadable_image": "image dropped",
    "truncated_image": "sample replaced by the next readable one when loaded",
    "converted_mode": "converted to 8-bit RGB",
    "exif_rotated": "pixels rotated upright (EXIF orientation applied)",
    "size_mismatch": "file's real size used; annotations outside it clamped",
    "duplicate_image_id": "later duplicate dropped",
    "duplicate_annotation_id": "annotation kept (ids are not used for training)",
    "unknown_category": "annotation dropped",
    "crowd": "kept out of training targets (COCOeval ignores its region)",
    "degenerate_box": "annotation dropped",
    "box_clamped": "box clamped to the image",
    "bad_polygon": "polygon part dropped (fewer than 3 points or odd coordinate count)",
    "bad_rle": "annotation dropped (RLE size differs from the image)",
    "empty_mask": "annotation dropped (mask has no pixels)",
    "no_annotations": "image dropped from training (kept for evaluation)",
}


@dataclass
class DataReport:
    """Counts and example ids of every problem found, in `PROBLEMS`' kinds."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list] = field(default_factory=lambda: defaultdict(list))

    def add(self, kind: str, example) -> None:
        assert kind in PROBLEMS, kind
        self.counts[kind] += 1
        if len(self.examples[kind]) < 5:
            self.examples[kind].append(example)

    def rows(self) -> list[tuple[str, int, str, str]]:
        return [(kind, self.counts[kind], ", ".join(map(str, self.examples[kind])), PROBLEMS[kind])
                for kind in PROBLEMS if self.counts[kind]]

    def summary(self) -> str:
        rows = self.rows()
        if not rows:
            return "no problems found"
        return "; ".join(f"{kind}: {count} ({action})" for kind, count, _, action in rows)


def load_coco_json(path: Path | str) -> dict:
    """Parse and shape-check a COCO json; a `DataError` names the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: annotation file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("images", "annotations", "categories")):
        raise DataError(f"{path}: not a COCO instances file (needs lists 'images', 'annotations', 'categories')")
    if not data["images"]:
        raise DataError(f"{path}: has no images")
    if not data["categories"]:
        raise DataError(f"{path}: has no categories")
    return data


def _probe_image(path: Path, report: DataReport, image_id: int) -> tuple[int, int] | None:
    """Open the header only (cheap): the upright size of a readable file, else None."""
    if not path.is_file():
        report.add("missing_image", image_id)
        return None
    try:
        with Image.open(path) as img:
            width, height = img.size
            if img.mode != "RGB":
                report.add("converted_mode", image_id)
            orientation = img.getexif().get(0x0112, 1)
            if orientation in (5, 6, 7, 8):
                width, height = height, width
            if orientation not in (None, 1):
                report.add("exif_rotated", image_id)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        report.add("unreadable_image", image_id)
        return None
    return width, height


def read_rgb(path: Path) -> Image.Image:
    """Decode fully, apply EXIF orientation, and convert any mode (L, P, RGBA, CMYK, I;16) to RGB."""
    with Image.open(path) as img:
        img.load()
        img = ImageOps.exif_transpose(img)
        if img.mode in ("I;16", "I;16B", "I;16L", "I"):
            array = np.asarray(img, dtype=np.float64)
            scale = 255.0 / max(float(array.max()), 1.0) if img.mode == "I" else 1 / 257
            img = Image.fromarray(np.clip(array * scale, 0, 255).astype(np.uint8))
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")
        return img.convert("RGB")


def _clean_segmentation(seg, width: int, height: int, report: DataReport, ann_id):
    """Return a pycocotools-ready RLE for the annotation, or None when nothing usable remains."""
    if isinstance(seg, list):
        polygons = [p for p in seg if isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0]
        if len(polygons) != len(seg):
            report.add("bad_polygon", ann_id)
        if not polygons:
            return None
        return mask_utils.merge(mask_utils.frPyObjects(polygons, height, width))
    if isinstance(seg, dict) and "counts" in seg and "size" in seg:
        if list(seg["size"]) != [height, width]:
            report.add("bad_rle", ann_id)
            return None
        if isinstance(seg["counts"], list):
            return mask_utils.frPyObjects(seg, height, width)
        return {"size": seg["size"], "counts": seg["counts"].encode() if isinstance(seg["counts"], str) else seg["counts"]}
    report.add("bad_polygon", ann_id)
    return None


class CocoDetection(torch.utils.data.Dataset):
    """Images and Mask R-CNN targets from a COCO json and its image folder.

    `train=True` drops images with no usable annotation (they teach nothing to a detector);
    evaluation keeps every readable image. Items are `(image, target)`: a uint8 `tv_tensors.Image`
    and a dict of `boxes` (XYXY), `masks`, `labels` (contiguous 1..K) and `image_id`.
    `dataset[(index, seed)]` runs the random transforms from that seed, so augmentation is a
    function of the sample, not of which worker loaded it.
    """

    def __init__(self, image_dir: Path | str, ann_file: Path | str, transforms=None, train: bool = True):
        self.image_dir, self.ann_file = Path(image_dir), Path(ann_file)
        self.transforms, self.train = transforms, train
        self.report = DataReport()
        data = load_coco_json(self.ann_file)
        self.categories = sorted(data["categories"], key=lambda c: c["id"])
        self.cat_to_label = {c["id"]: i + 1 for i, c in enumerate(self.categories)}
        self.label_to_cat = {v: k for k, v in self.cat_to_label.items()}
        self.class_names = [c["name"] for c in self.categories]
        self.images, self.targets, self.crowds = self._clean(data)
        if not self.images:
            raise DataError(f"{self.ann_file}: no usable images ({self.report.summary()})")

    @property
    def num_classes(self) -> int:
        """Categories plus background, as Mask R-CNN counts them."""
        return len(self.categories) + 1

    def _clean(self, data: dict):
        report, seen_images, seen_anns = self.report, {}, set()
        for img in data["images"]:
            if img.get("id") in seen_images:
                report.add("duplicate_image_id", img.get("id"))
                continue
            seen_images[img.get("id")] = img
        anns_by_image = defaultdict(list)
        for ann in data["annotations"]:
            if ann.get("id") in seen_anns:
                report.add("duplicate_annotation_id", ann.get("id"))
            seen_anns.add(ann.get("id"))
            anns_by_image[ann.get("image_id")].append(ann)
        images, targets, crowds = [], [], []
        for image_id, img in seen_images.items():
            size = _probe_image(self.image_dir / str(img.get("file_name", "")), report, image_id)
            if size is None:
                continue
            width, height = size
            if (img.get("width"), img.get("height")) != (width, height):
                report.add("size_mismatch", image_id)
            usable, crowd = self._clean_annotations(anns_by_image.get(image_id, []), width, height)
            if not usable and self.train:
                report.add("no_annotations", image_id)
                continue
            images.append({"id": image_id, "file_name": img["file_name"], "width": width, "height": height})
            targets.append(usable)
            crowds.append(crowd)
        return images, targets, crowds

    def _clean_annotations(self, anns: list[dict], width: int, height: int) -> tuple[list[dict], list[dict]]:
        """(usable instances, crowd regions), each a dict of XYXY `box`, `label` and `rle`."""
        usable, crowds = [], []
        for ann in anns:
            ann_id = ann.get("id")
            if ann.get("category_id") not in self.cat_to_label:
                self.report.add("unknown_category", ann_id)
                continue
            try:
                x, y, w, h = (float(v) for v in ann["bbox"])
            except (KeyError, TypeError, ValueError):
                self.report.add("degenerate_box", ann_id)
                continue
            x0, y0, x1, y1 = max(x, 0.0), max(y, 0.0), min(x + w, width), min(y + h, height)
            if w <= 0 or h <= 0 or x1 - x0 < 1 or y1 - y0 < 1:
                self.report.add("degenerate_box", ann_id)
                continue
            if (x0, y0, x1, y1) != (x, y, x + w, y + h):
                self.report.add("box_clamped", ann_id)
            rle = _clean_segmentation(ann.get("segmentation"), width, height, self.report, ann_id)
            if rle is None:
                continue
            if mask_utils.area(rle) == 0:
                self.report.add("empty_mask", ann_id)
                continue
            instance = {"box": [x0, y0, x1, y1], "label": self.cat_to_label[ann["category_id"]], "rle": rle}
            if ann.get("iscrowd", 0):
                self.report.add("crowd", ann_id)
                crowds.append(instance)
            else:
                usable.append(instance)
        return usable, crowds

    def ground_truth(self) -> dict:
        """The cleaned annotations as a COCO dict (what evaluation scores against): exactly the
        instances training sees, plus crowd regions for COCOeval to ignore."""
        images, annotations = [], []
        for info, anns, crowds in zip(self.images, self.targets, self.crowds):
            images.append({"id": info["id"], "width": info["width"], "height": info["height"],
                           "file_name": info["file_name"]})
            for ann, crowd in [(a, 0) for a in anns] + [(c, 1) for c in crowds]:
                x0, y0, x1, y1 = ann["box"]
                rle = dict(ann["rle"])
                rle["counts"] = rle["counts"].decode("ascii") if isinstance(rle["counts"], bytes) else rle["counts"]
                annotations.append({"id": len(annotations) + 1, "image_id": info["id"],
                                    "category_id": self.label_to_cat[ann["label"]], "iscrowd": crowd,
                                    "bbox": [x0, y0, x1 - x0, y1 - y0], "segmentation": rle,
                                    "area": float(mask_utils.area(ann["rle"]))})
        return {"images": images, "annotations": annotations, "categories": self.categories}

    def __len__(self) -> int:
        return len(self.images)

    def aspect_ratios(self) -> list[float]:
        return [img["width"] / img["height"] for img in self.images]

    def load(self, index: int):
        """Decode image `index` and build its target (no transforms)."""
        info, anns = self.images[index], self.targets[index]
        image = read_rgb(self.image_dir / info["file_name"])
        if image.size != (info["width"], info["height"]):
            raise OSError(f"{info['file_name']}: size changed since the start-up scan")
        height, width = info["height"], info["width"]
        if anns:
            masks = torch.from_numpy(mask_utils.decode([a["rle"] for a in anns])).permute(2, 0, 1).contiguous()
            boxes = torch.tensor([a["box"] for a in anns], dtype=torch.float32)
        else:
            masks = torch.zeros((0, height, width), dtype=torch.uint8)
            boxes = torch.zeros((0, 4), dtype=torch.float32)
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
            "masks": tv_tensors.Mask(masks),
            "labels": torch.tensor([a["label"] for a in anns], dtype=torch.int64),
            "image_id": info["id"],
        }
        return tv_tensors.Image(F.pil_to_tensor(image)), target

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, None)
        for attempt in range(len(self)):
            candidate = (index + attempt) % len(self)
            try:
                image, target = self.load(candidate)
                break
            except (OSError, SyntaxError, ValueError) as err:
                self.report.add("truncated_image", self.images[candidate]["id"])
                warnings.warn(f"skipping unreadable image {self.images[candidate]['file_name']}: {err}")
        else:
            raise DataError(f"{self.image_dir}: no image could be decoded")
        if self.transforms is not None:
            if seed is None:
                image, target = self.transforms(image, target)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    image, target = self.transforms(image, target)
        return image, target


def coco_paths(data_path: Path | str, split: str) -> tuple[Path, Path]:
    """(image folder, annotation json) of `split` in the COCO 2017 layout torchvision's reference reads."""
    root = Path(data_path)
    return root / f"{split}2017", root / "annotations" / f"instances_{split}2017.json"
