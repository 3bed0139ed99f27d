"""COCO instance segmentation through pycocotools, hardened against the data real projects have.

`CocoDetection` reads any COCO-layout dataset: polygons and RLE become masks, `iscrowd` regions
are kept out of training targets, category ids are remapped to contiguous labels 1..K, and every
entry, annotation or image that cannot be used as it is gets repaired or dropped *and counted* in
a `DataReport` (printed by `python -m maskrcnn_tut.data.check` and logged when training starts).
Nothing is dropped silently and no mask is built from an encoding that disagrees with its image.
"""
from __future__ import annotations

import json
import logging
import math
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
    "malformed_entry": "entry dropped (not an object, or no usable id/file_name/image_id)",
    "duplicate_image_id": "exact repeats merged; an id shared by different files: those images "
                          "dropped with their annotations (nothing says which file they belong to)",
    "duplicate_annotation_id": "exact repeats dropped; different annotations kept (ids are not used)",
    "unknown_image": "annotation dropped (its image_id is not in images)",
    "missing_image": "image dropped (file not found)",
    "unreadable_image": "image dropped (not an image file Pillow can open)",
    "truncated_image": "image dropped (the file ends early or its pixel data is corrupt)",
    "converted_mode": "converted to 8-bit RGB (grayscale, palette, RGBA, CMYK, 16-bit, float)",
    "exif_rotated": "pixels turned upright by the EXIF orientation; annotations read as upright",
    "size_mismatch": "the file's real (upright) size used; boxes clamped to it, RLE of another size dropped",
    "unknown_category": "annotation dropped (category_id not in categories)",
    "degenerate_box": "annotation dropped (box missing, not finite, or of zero or sub-pixel size)",
    "box_outside": "annotation dropped (box entirely outside the image)",
    "box_clamped": "box clamped to the image",
    "bad_polygon": "polygon dropped (fewer than 3 points, odd coordinate count or not numbers); "
                   "annotation dropped when none is left",
    "bad_rle": "annotation dropped (RLE size or run lengths do not match the image)",
    "missing_segmentation": "annotation dropped (no polygon list or RLE)",
    "empty_mask": "annotation dropped (mask has no pixels)",
    "crowd": "kept out of training targets (COCOeval ignores its region)",
    "no_annotations": "image dropped from training (kept for evaluation)",
    "load_failed": "image failed to decode during training: sample replaced by the next image",
}


@dataclass
class DataReport:
    """Counts and example ids of every problem found, in `PROBLEMS`' kinds."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list] = field(default_factory=lambda: defaultdict(list))

    def add(self, kind: str, example) -> None:
        assert kind in PROBLEMS, kind
        self.counts[kind] += 1
        if len(self.examples[kind]) < 5 and example not in self.examples[kind]:
            self.examples[kind].append(example)

    def rows(self) -> list[tuple[str, int, str, str]]:
        """(kind, count, example ids, what training does) for every kind found."""
        return [(kind, self.counts[kind], ", ".join(map(str, self.examples[kind])), PROBLEMS[kind])
                for kind in PROBLEMS if self.counts[kind]]

    def summary(self) -> str:
        rows = self.rows()
        if not rows:
            return "no problems found"
        return "; ".join(f"{kind}: {count} ({action})" for kind, count, _, action in rows)


def _is_id(value) -> bool:
    """COCO ids are integers (some exporters write strings); anything else cannot index."""
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def load_coco_json(path: Path | str) -> dict:
    """Parse and shape-check a COCO json; a `DataError` names the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: annotation file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("images", "annotations", "categories")):
        raise DataError(f"{path}: not a COCO instances file (needs lists 'images', 'annotations', 'categories')")
    if not data["images"]:
        raise DataError(f"{path}: has no images")
    if not data["categories"]:
        raise DataError(f"{path}: has no categories")
    ids = [c.get("id") if isinstance(c, dict) else None for c in data["categories"]]
    for index, cat_id in enumerate(ids):
        if not _is_id(cat_id):
            raise DataError(f"{path}: categories[{index}] has no usable id")
        if ids.index(cat_id) != index:
            raise DataError(f"{path}: category id {cat_id!r} appears twice in categories")
    return data


#: The bytes a complete file of the format ends with: a cheap check for truncation at start-up.
_TRAILERS = {"PNG": b"IEND\xaeB`\x82", "JPEG": b"\xff\xd9"}


def _ends_cleanly(path: Path, image_format: str | None) -> bool:
    trailer = _TRAILERS.get(image_format)
    if trailer is None:
        return True  # no cheap check for this format (`verify_pixels` decodes it)
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 64))
        return trailer in f.read()


def _probe_image(path: Path, report: DataReport, image_id, verify_pixels: bool) -> tuple[int, int] | None:
    """The upright size of a usable image file, else None (counted).

    Reads the header, and decodes the pixels only when the file does not end like a complete PNG
    or JPEG (or when `verify_pixels`), so a start-up scan of COCO stays cheap.
    """
    if not path.is_file():
        report.add("missing_image", image_id)
        return None
    try:
        img = Image.open(path)
    except Exception:  # Pillow raises many types for files it cannot identify
        report.add("unreadable_image", image_id)
        return None
    with img:
        try:
            if verify_pixels or not _ends_cleanly(path, img.format):
                img.load()
        except Exception:  # truncated or corrupt pixel data, whatever the decoder raises
            report.add("truncated_image", image_id)
            return None
        width, height = img.size
        if img.mode != "RGB":
            report.add("converted_mode", image_id)
        try:
            orientation = img.getexif().get(0x0112, 1)
        except Exception:  # a broken EXIF block is ignored, as exif_transpose ignores it
            orientation = 1
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    if orientation not in (None, 1):
        report.add("exif_rotated", image_id)
    return width, height


def read_rgb(path: Path) -> Image.Image:
    """Decode fully, apply EXIF orientation, and convert any mode (L, P, RGBA, CMYK, I;16, F) to RGB."""
    with Image.open(path) as img:
        img.load()
        img = ImageOps.exif_transpose(img)
        if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
            array = np.asarray(img, dtype=np.float64)
            scale = 1 / 257 if img.mode.startswith("I;16") else 255.0 / max(float(array.max()), 1e-12)
            img = Image.fromarray(np.clip(array * scale, 0, 255).astype(np.uint8))
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")
        return img.convert("RGB")


def _valid_polygon(polygon) -> bool:
    return (isinstance(polygon, list) and len(polygon) >= 6 and len(polygon) % 2 == 0
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in polygon))


def _compressed_rle_runs(counts: str) -> list[int]:
    """Run lengths of COCO's compressed RLE string (pycocotools' rleFrString, in Python so a bad
    string is caught here rather than overrunning the decoder's buffer)."""
    runs: list[int] = []
    position = 0
    while position < len(counts):
        value, shift, more = 0, 0, True
        while more:
            if position >= len(counts):
                raise ValueError("RLE string ends inside a number")
            char = ord(counts[position]) - 48
            if not 0 <= char < 64:
                raise ValueError(f"RLE string has an invalid character {counts[position]!r}")
            value |= (char & 0x1F) << shift
            more = bool(char & 0x20)
            position += 1
            shift += 5
            if not more and char & 0x10:
                value |= -1 << shift
        if len(runs) > 2:
            value += runs[-2]
        runs.append(value)
    return runs


def _rle(seg: dict, width: int, height: int):
    """A pycocotools RLE for an RLE dict whose size and run lengths fit the image, else None."""
    counts = seg.get("counts")
    if list(seg.get("size") or []) != [height, width]:
        return None
    if isinstance(counts, list):
        valid = all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
        return mask_utils.frPyObjects(seg, height, width) if valid and sum(counts) == width * height else None
    if isinstance(counts, bytes):
        counts = counts.decode("ascii", errors="replace")
    if not isinstance(counts, str):
        return None
    try:
        runs = _compressed_rle_runs(counts)
    except ValueError:
        return None
    if min(runs, default=0) < 0 or sum(runs) != width * height:
        return None
    return {"size": [height, width], "counts": counts.encode("ascii")}


def _segmentation_rle(seg, width: int, height: int, report: DataReport, ann_id):
    """A pycocotools RLE of the annotation's mask, or None (counted) when nothing usable remains."""
    if isinstance(seg, list) and seg:
        polygons = [p for p in seg if _valid_polygon(p)]
        if len(polygons) != len(seg):
            report.add("bad_polygon", ann_id)
        if not polygons:
            return None
        return mask_utils.merge(mask_utils.frPyObjects(polygons, height, width))
    if isinstance(seg, dict) and "counts" in seg:
        rle = _rle(seg, width, height)
        if rle is None:
            report.add("bad_rle", ann_id)
        return rle
    report.add("missing_segmentation", ann_id)
    return None


def _xywh(bbox) -> tuple[float, float, float, float] | None:
    """A finite [x, y, w, h], else None."""
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox):
        return None
    return tuple(float(v) for v in bbox)


class CocoDetection(torch.utils.data.Dataset):
    """Images and Mask R-CNN targets from a COCO json and its image folder.

    `train=True` drops images with no usable annotation (they teach nothing to a detector);
    evaluation keeps every readable image. Items are `(image, target)`: a uint8 `tv_tensors.Image`
    and a dict of `boxes` (XYXY), `masks`, `labels` (contiguous 1..K) and `image_id`.
    `dataset[(index, seed)]` runs the random transforms from that seed, so augmentation is a
    function of the sample, not of which worker loaded it.
    """

    def __init__(self, image_dir: Path | str, ann_file: Path | str, transforms=None, train: bool = True,
                 verify_pixels: bool = False):
        self.image_dir, self.ann_file = Path(image_dir), Path(ann_file)
        self.transforms, self.train = transforms, train
        self.report = DataReport()
        data = load_coco_json(self.ann_file)
        self.categories = sorted(data["categories"], key=lambda c: (isinstance(c["id"], str), c["id"]))
        self.cat_to_label = {c["id"]: i + 1 for i, c in enumerate(self.categories)}
        self.label_to_cat = {v: k for k, v in self.cat_to_label.items()}
        self.class_names = [str(c.get("name", c["id"])) for c in self.categories]
        self.images, self.targets, self.crowds = self._clean(data, verify_pixels)
        if not self.images:
            raise DataError(f"{self.ann_file}: no usable images{' for training' if train else ''} "
                            f"({self.report.summary()})")

    @property
    def num_classes(self) -> int:
        """Categories plus background, as Mask R-CNN counts them."""
        return len(self.categories) + 1

    def _unique_images(self, entries: list) -> tuple[dict, set]:
        """({id: image entry} of the unambiguous images, every image id the json names)."""
        by_id = defaultdict(list)
        for index, img in enumerate(entries):
            if not isinstance(img, dict) or not _is_id(img.get("id")) or not isinstance(img.get("file_name"), str):
                self.report.add("malformed_entry", f"images[{index}]")
                continue
            by_id[img["id"]].append(img)
        unique = {}
        for image_id, same_id in by_id.items():
            if len(same_id) > 1:
                self.report.add("duplicate_image_id", image_id)
                if len({img["file_name"] for img in same_id}) > 1:
                    continue
            unique[image_id] = same_id[0]
        return unique, set(by_id)

    def _annotations_by_image(self, entries: list, image_ids: set) -> dict[object, list[dict]]:
        by_image, first_with_id = defaultdict(list), {}
        for index, ann in enumerate(entries):
            if not isinstance(ann, dict) or not _is_id(ann.get("image_id")):
                self.report.add("malformed_entry", f"annotations[{index}]")
                continue
            ann_id = ann.get("id")
            if _is_id(ann_id):
                if ann_id in first_with_id:
                    self.report.add("duplicate_annotation_id", ann_id)
                    if ann == first_with_id[ann_id]:
                        continue
                else:
                    first_with_id[ann_id] = ann
            if ann["image_id"] not in image_ids:
                self.report.add("unknown_image", ann_id)
                continue
            by_image[ann["image_id"]].append(ann)
        return by_image

    def _clean(self, data: dict, verify_pixels: bool):
        unique, image_ids = self._unique_images(data["images"])
        anns_by_image = self._annotations_by_image(data["annotations"], image_ids)
        images, targets, crowds = [], [], []
        for image_id, img in unique.items():
            size = _probe_image(self.image_dir / img["file_name"], self.report, image_id, verify_pixels)
            if size is None:
                continue
            width, height = size
            if (img.get("width"), img.get("height")) != (width, height):
                self.report.add("size_mismatch", image_id)
            usable, crowd = self._clean_annotations(anns_by_image.get(image_id, []), width, height)
            if not usable and self.train:
                self.report.add("no_annotations", image_id)
                continue
            images.append({"id": image_id, "file_name": img["file_name"], "width": width, "height": height})
            targets.append(usable)
            crowds.append(crowd)
        return images, targets, crowds

    def _clean_box(self, bbox, width: int, height: int, ann_id) -> list[float] | None:
        """The box as XYXY inside the image, or None (counted) when it cannot be used."""
        xywh = _xywh(bbox)
        if xywh is None or xywh[2] <= 0 or xywh[3] <= 0:
            self.report.add("degenerate_box", ann_id)
            return None
        x, y, w, h = xywh
        if x >= width or y >= height or x + w <= 0 or y + h <= 0:
            self.report.add("box_outside", ann_id)
            return None
        box = [max(x, 0.0), max(y, 0.0), min(x + w, float(width)), min(y + h, float(height))]
        if box[2] - box[0] < 1 or box[3] - box[1] < 1:
            self.report.add("degenerate_box", ann_id)
            return None
        if box != [x, y, x + w, y + h]:
            self.report.add("box_clamped", ann_id)
        return box

    def _clean_annotations(self, anns: list[dict], width: int, height: int) -> tuple[list[dict], list[dict]]:
        """(usable instances, crowd regions), each a dict of XYXY `box`, `label` and `rle`."""
        usable, crowds = [], []
        for ann in anns:
            ann_id = ann.get("id")
            category = ann.get("category_id")
            if not _is_id(category) or category not in self.cat_to_label:
                self.report.add("unknown_category", ann_id)
                continue
            box = self._clean_box(ann.get("bbox"), width, height, ann_id)
            if box is None:
                continue
            rle = _segmentation_rle(ann.get("segmentation"), width, height, self.report, ann_id)
            if rle is None:
                continue
            if mask_utils.area(rle) == 0:
                self.report.add("empty_mask", ann_id)
                continue
            instance = {"box": box, "label": self.cat_to_label[category], "rle": rle}
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
            except Exception as err:  # whatever the decoder raises: never crash mid-epoch
                self.report.add("load_failed", self.images[candidate]["id"])
                warnings.warn(f"{self.image_dir / self.images[candidate]['file_name']}: failed to decode "
                              f"({err}); using the next image instead")
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
