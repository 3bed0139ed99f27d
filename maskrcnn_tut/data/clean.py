"""The cleaning rules for COCO data real projects have: what is repaired, what is dropped, and why.

`clean_coco` turns a parsed COCO json (`load_coco_json`) and its image folder into the images and
instances training can use. Every entry, annotation or image that cannot be used as it is gets
repaired or dropped *and counted* in a `DataReport`, in one of the `PROBLEMS` kinds; nothing is
dropped silently and no mask is built from an encoding that disagrees with its image.
`maskrcnn_tut.data.coco.CocoDetection` is the Dataset built on it.
"""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from pycocotools import mask as mask_utils

from ..errors import DataError

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


def category_labels(categories: list[dict]) -> tuple[list[dict], dict]:
    """(categories sorted by id, {category id: contiguous label 1..K}) of `load_coco_json`'s categories."""
    ordered = sorted(categories, key=lambda c: (isinstance(c["id"], str), c["id"]))
    return ordered, {c["id"]: i + 1 for i, c in enumerate(ordered)}


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


def probe_image(path: Path, report: DataReport, image_id, verify_pixels: bool) -> tuple[int, int] | None:
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
    if isinstance(counts, list):  # uncompressed RLE, as COCO writes crowd regions
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


def segmentation_rle(seg, width: int, height: int, report: DataReport, ann_id):
    """A pycocotools RLE of any valid COCO encoding (polygons, compressed or uncompressed RLE),
    or None (counted) when nothing usable remains."""
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


def clean_box(bbox, width: int, height: int, report: DataReport, ann_id) -> list[float] | None:
    """The box as XYXY inside the image, or None (counted) when it cannot be used."""
    xywh = _xywh(bbox)
    if xywh is None or xywh[2] <= 0 or xywh[3] <= 0:
        report.add("degenerate_box", ann_id)
        return None
    x, y, w, h = xywh
    if x >= width or y >= height or x + w <= 0 or y + h <= 0:
        report.add("box_outside", ann_id)
        return None
    box = [max(x, 0.0), max(y, 0.0), min(x + w, float(width)), min(y + h, float(height))]
    if box[2] - box[0] < 1 or box[3] - box[1] < 1:
        report.add("degenerate_box", ann_id)
        return None
    if box != [x, y, x + w, y + h]:
        report.add("box_clamped", ann_id)
    return box


def _unique_images(entries: list, report: DataReport) -> tuple[dict, set]:
    """({id: image entry} of the unambiguous images, every image id the json names)."""
    by_id = defaultdict(list)
    for index, img in enumerate(entries):
        if not isinstance(img, dict) or not _is_id(img.get("id")) or not isinstance(img.get("file_name"), str):
            report.add("malformed_entry", f"images[{index}]")
            continue
        by_id[img["id"]].append(img)
    unique = {}
    for image_id, same_id in by_id.items():
        if len(same_id) > 1:
            report.add("duplicate_image_id", image_id)
            if len({img["file_name"] for img in same_id}) > 1:
                continue
        unique[image_id] = same_id[0]
    return unique, set(by_id)


def _annotations_by_image(entries: list, image_ids: set, report: DataReport) -> dict[object, list[dict]]:
    by_image, first_with_id = defaultdict(list), {}
    for index, ann in enumerate(entries):
        if not isinstance(ann, dict) or not _is_id(ann.get("image_id")):
            report.add("malformed_entry", f"annotations[{index}]")
            continue
        ann_id = ann.get("id")
        if _is_id(ann_id):
            if ann_id in first_with_id:
                report.add("duplicate_annotation_id", ann_id)
                if ann == first_with_id[ann_id]:
                    continue
            else:
                first_with_id[ann_id] = ann
        if ann["image_id"] not in image_ids:
            report.add("unknown_image", ann_id)
            continue
        by_image[ann["image_id"]].append(ann)
    return by_image


def clean_annotations(anns: list[dict], width: int, height: int, cat_to_label: dict,
                      report: DataReport) -> tuple[list[dict], list[dict]]:
    """(usable instances, crowd regions) of one image, each a dict of XYXY `box`, `label` and `rle`."""
    usable, crowds = [], []
    for ann in anns:
        ann_id = ann.get("id")
        category = ann.get("category_id")
        if not _is_id(category) or category not in cat_to_label:
            report.add("unknown_category", ann_id)
            continue
        box = clean_box(ann.get("bbox"), width, height, report, ann_id)
        if box is None:
            continue
        rle = segmentation_rle(ann.get("segmentation"), width, height, report, ann_id)
        if rle is None:
            continue
        if mask_utils.area(rle) == 0:
            report.add("empty_mask", ann_id)
            continue
        instance = {"box": box, "label": cat_to_label[category], "rle": rle}
        if ann.get("iscrowd", 0):
            report.add("crowd", ann_id)
            crowds.append(instance)
        else:
            usable.append(instance)
    return usable, crowds


def clean_coco(data: dict, image_dir: Path | str, train: bool = True, verify_pixels: bool = False
               ) -> tuple[list[dict], list[list[dict]], list[list[dict]], DataReport]:
    """(images, targets, crowds, report) of a `load_coco_json` dict whose files are in `image_dir`.

    `images` are `{id, file_name, width, height}` with the files' real upright size; `targets[i]`
    and `crowds[i]` are image i's usable instances and crowd regions (`clean_annotations`), with
    labels from `category_labels`. `train=True` drops images with no usable instance (they teach
    nothing to a detector); evaluation keeps every readable image.
    """
    image_dir, report = Path(image_dir), DataReport()
    _, cat_to_label = category_labels(data["categories"])
    unique, image_ids = _unique_images(data["images"], report)
    anns_by_image = _annotations_by_image(data["annotations"], image_ids, report)
    images, targets, crowds = [], [], []
    for image_id, img in unique.items():
        size = probe_image(image_dir / img["file_name"], report, image_id, verify_pixels)
        if size is None:
            continue
        width, height = size
        if (img.get("width"), img.get("height")) != (width, height):
            report.add("size_mismatch", image_id)
        usable, crowd = clean_annotations(anns_by_image.get(image_id, []), width, height, cat_to_label, report)
        if not usable and train:
            report.add("no_annotations", image_id)
            continue
        images.append({"id": image_id, "file_name": img["file_name"], "width": width, "height": height})
        targets.append(usable)
        crowds.append(crowd)
    return images, targets, crowds, report
