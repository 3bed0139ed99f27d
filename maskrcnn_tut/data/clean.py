"""The cleaning rules for COCO data real projects have: what is repaired, what is dropped, and why.

`clean_coco` turns a COCO json, as `maskrcnn_tut.data.cocojson.read_coco` reads it (a piece at a
time), and its image folder into the images and instances training can use. Every entry, annotation
or image that cannot be used as it is gets repaired or dropped *and counted* in a `DataReport`, in
one of the `PROBLEMS` kinds; nothing is dropped silently and no mask is built from an encoding that
disagrees with its image.
`maskrcnn_tut.data.coco.CocoDetection` is the Dataset built on it.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import pickle
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import DataError
from ..hardware import usable_cores
from .probe import confined_path, probe_image
from .records import Records
from .segmentation import segmentation_rle

#: Every problem kind a dataset can have, and what the loader does about it.
PROBLEMS: dict[str, str] = {
    "malformed_entry": "entry dropped (not an object, or no usable id/file_name/image_id)",
    "duplicate_image_id": "exact repeats merged; an id shared by different files: those images "
                          "dropped with their annotations (nothing says which file they belong to)",
    "duplicate_annotation_id": "exact repeats dropped; different annotations kept (ids are not used)",
    "unknown_image": "annotation dropped (its image_id is not in images)",
    "bad_file_name": "image dropped, never opened (file_name absolute, leading out of the image folder "
                     "with '..', or too long for the filesystem)",
    "missing_image": "image dropped (file not found)",
    "not_a_file": "image dropped, never read (a folder, pipe, socket or device, not a regular file)",
    "unreadable_image": "image dropped (not an image file Pillow can open)",
    "too_many_pixels": f"image dropped, never decoded (over {2 * Image.MAX_IMAGE_PIXELS:,} pixels, twice "
                       "Pillow's PIL.Image.MAX_IMAGE_PIXELS: a decompression bomb, or too large to train on)",
    "truncated_image": "image dropped (the file ends early or its pixel data is corrupt)",
    "converted_mode": "converted to 8-bit RGB (grayscale, palette, RGBA, CMYK, 16-bit, float)",
    "exif_rotated": "pixels turned upright by the EXIF orientation; annotations read as upright",
    "size_mismatch": "the file's real (upright) size used; boxes clamped to it, RLE of another size dropped",
    "extreme_aspect": "image dropped (sides over 50:1, or the shorter side under 2 px once resized to "
                      "--min-size/--max-size: torchvision's resize fails on it)",
    "unknown_category": "annotation dropped (category_id not in categories)",
    "degenerate_box": "annotation dropped (box missing, not finite, or of zero or sub-pixel size)",
    "box_outside": "annotation dropped (box entirely outside the image)",
    "box_clamped": "box clamped to the image",
    "bad_polygon": "polygon dropped (fewer than 3 points, odd coordinate count or not numbers); "
                   "annotation dropped when none is left",
    "absurd_polygon": "polygon dropped (a point over one image size outside the image, or an outline "
                      "over 100 image perimeters: pycocotools would crash or take gigabytes); "
                      "annotation dropped when none is left",
    "bad_rle": "annotation dropped (RLE size or run lengths missing, malformed or not the image's)",
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

    def merge(self, other: "DataReport") -> None:
        """Add `other`'s counts and examples (as if its problems were found after this one's)."""
        for kind, count in other.counts.items():
            self.counts[kind] += count
            for example in other.examples[kind]:
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


def is_id(value) -> bool:
    """COCO ids are integers (some exporters write strings); anything else cannot index."""
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def refuse_special_file(path: Path) -> None:
    """A folder, pipe or device named as an annotation file is one line (reading a pipe would wait forever)."""
    if path.exists() and not path.is_file():
        raise DataError(f"{path}: not a regular file (a folder, pipe or device), so not an annotation file")


def load_coco_json(path: Path | str) -> dict:
    """Parse a COCO json whole and `check_coco` it; a `DataError` names the file and what is wrong
    (`maskrcnn_tut.data.cocojson.read_coco` reads a large one without holding it whole)."""
    path = Path(path)
    refuse_special_file(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: annotation file not found") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, or an int of 4300+ digits
        raise DataError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:  # Python's parser stops at the recursion limit (1000 levels by default)
        raise DataError(f"{path}: lists or objects nested deeper than Python's JSON parser allows; a COCO file "
                        "nests a few levels, so this one is damaged or not COCO") from None
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror})") from None
    return check_coco(path, data)


def check_coco(path: Path, data, lists: tuple = (list,)) -> dict:
    """`data` when it has the shape of a COCO instances file (`lists`: what may stand for a list)."""
    if not isinstance(data, dict) or not all(isinstance(data.get(k), lists) for k in ("images", "annotations", "categories")):
        raise DataError(f"{path}: not a COCO instances file (needs lists 'images', 'annotations', 'categories')")
    if not len(data["images"]):
        raise DataError(f"{path}: has no images")
    if not data["categories"]:
        raise DataError(f"{path}: has no categories")
    ids = [c.get("id") if isinstance(c, dict) else None for c in data["categories"]]
    for index, cat_id in enumerate(ids):
        if not is_id(cat_id):
            raise DataError(f"{path}: categories[{index}] has no usable id")
        if ids.index(cat_id) != index:
            raise DataError(f"{path}: category id {cat_id!r} appears twice in categories")
    return data


def category_labels(categories: list[dict]) -> tuple[list[dict], dict]:
    """(categories sorted by id, {category id: contiguous label 1..K}) of `load_coco_json`'s categories."""
    ordered = sorted(categories, key=lambda c: (isinstance(c["id"], str), c["id"]))
    return ordered, {c["id"]: i + 1 for i, c in enumerate(ordered)}


#: Beyond this ratio of its sides an image is not a photo of objects but a strip of pixels.
MAX_ASPECT_RATIO = 50
#: The shorter side, once resized for the model, must keep at least this many pixels.
MIN_RESIZED_SIDE = 2


def resize_fails(widths, heights, min_size: int | None, max_size: int | None) -> np.ndarray:
    """Per image, True when torchvision's `GeneralizedRCNNTransform` cannot use it: sides over
    `MAX_ASPECT_RATIO`:1, or (with sizes given) a shorter side under `MIN_RESIZED_SIDE` px after
    its resize (scale = min(min_size / short side, max_size / long side); under 1 px it crashes)."""
    widths, heights = np.asarray(widths, dtype=np.float64), np.asarray(heights, dtype=np.float64)
    short, long = np.minimum(widths, heights), np.maximum(widths, heights)
    fails = long > MAX_ASPECT_RATIO * short
    if min_size and max_size:
        scale = np.minimum(min_size / short, max_size / long)
        fails |= short * scale < MIN_RESIZED_SIDE
    return fails


def _number(value) -> float | None:
    """A finite JSON number as a float, else None (no bools, strings, NaN, inf or huge ints)."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is int:
        try:
            return float(value)
        except OverflowError:
            return None
    return None


def clean_box(bbox, width: int, height: int, report: DataReport, ann_id) -> list[float] | None:
    """The box as XYXY inside the image, or None (counted) when it cannot be used."""
    xywh = [_number(v) for v in bbox] if isinstance(bbox, (list, tuple)) and len(bbox) == 4 else None
    if xywh is None or None in xywh or xywh[2] <= 0 or xywh[3] <= 0:
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


def clean_annotations(anns: list[dict], width: int, height: int, cat_to_label: dict,
                      report: DataReport) -> tuple[list[tuple], list[tuple]]:
    """(usable instances, crowd regions) of one image, each an `INSTANCE` tuple."""
    usable, crowds = [], []
    for ann in anns:
        ann_id = ann.get("id")
        category = ann.get("category_id")
        if not is_id(category) or category not in cat_to_label:
            report.add("unknown_category", ann_id)
            continue
        box = clean_box(ann.get("bbox"), width, height, report, ann_id)
        if box is None:
            continue
        found = segmentation_rle(ann.get("segmentation"), width, height, report, ann_id)
        if found is None:
            continue
        counts, area = found
        if area == 0:
            report.add("empty_mask", ann_id)
            continue
        instance = (*box, cat_to_label[category], counts, area)
        if ann.get("iscrowd", 0):
            report.add("crowd", ann_id)
            crowds.append(instance)
        else:
            usable.append(instance)
    return usable, crowds


#: A cleaned image: `(id, file_name, width, height, instances, crowds, source_id)`; `id` is the
#: json's integer id (or, when any id in the json is a string, the image's 1-based position, as
#: pycocotools needs ints), `source_id` the json's own. Instances and crowds are `INSTANCE`s.
RECORD = ("id", "file_name", "width", "height", "instances", "crowds", "source_id")
#: A cleaned instance: XYXY box inside the image, contiguous label, compressed RLE, mask area.
INSTANCE = ("x0", "y0", "x1", "y1", "label", "counts", "area")


#: Datasets with more images are cleaned by forked processes, one per usable core.
PARALLEL_MIN_IMAGES = 5_000
_JOB: dict = {}  # what forked cleaners read (inherited, not pickled): set by clean_coco


def _clean_images(start: int, stop: int) -> tuple[list[bytes], list[tuple], DataReport]:
    """Pickled records, sizes and report of the unique images at positions start..stop."""
    job, report, items, sizes = _JOB, DataReport(), [], []
    for position in range(start, stop):
        image_id, file_name, json_width, json_height = job["images"][position]
        path = confined_path(job["image_dir"], file_name)
        if path is None:
            report.add("bad_file_name", image_id)
            continue
        size = probe_image(path, report, image_id, job["verify_pixels"])
        if size is None:
            continue
        width, height = size
        if (json_width, json_height) != (width, height):
            report.add("size_mismatch", image_id)
        usable, crowd = clean_annotations(job["anns"].of_image(position), width, height, job["labels"], report)
        if not usable and job["train"]:
            report.add("no_annotations", image_id)
            continue
        eval_id = image_id if job["int_ids"] else position + 1
        record = (eval_id, file_name, width, height, usable, crowd, image_id)
        items.append(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
        sizes.append((width, height, len(usable)))
    return items, sizes, report


def clean_coco(index, image_dir: Path | str, train: bool = True, verify_pixels: bool = False,
               processes: int | None = None) -> tuple[Records, DataReport, np.ndarray]:
    """(records, report, sizes) of a COCO json's `cocojson.CocoIndex` whose files are in `image_dir`.

    One `RECORD` per usable image, with the file's real upright size, its usable instances and
    crowd regions (`clean_annotations`), labels from `category_labels`. `train=True` drops images
    with no usable instance (they teach nothing to a detector); evaluation keeps every readable
    image. Records are pickled in one buffer (`Records`): no per-instance Python objects stay.
    `sizes[i]` is record i's (width, height, number of instances). Large datasets are cleaned by
    `processes` forked processes (default: one per usable core), with the same result.
    """
    report = DataReport()
    report.merge(index.report)  # the entry problems found reading the json
    _, cat_to_label = category_labels(index.categories)
    _JOB.update(images=index.images, anns=index.annotations, image_dir=Path(image_dir), labels=cat_to_label,
                train=train, verify_pixels=verify_pixels, int_ids=all(type(img[0]) is int for img in index.images))
    n = len(index.images)
    if processes is None:
        processes = usable_cores() if n >= PARALLEL_MIN_IMAGES else 1
    bounds = np.linspace(0, n, max(1, min(processes, n)) + 1).astype(int)
    chunks = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    try:
        if len(chunks) > 1:
            with ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("fork")) as pool:
                parts = list(pool.map(_clean_images, *zip(*chunks)))
        else:
            parts = [_clean_images(*chunk) for chunk in chunks]
    except BrokenProcessPool:
        raise DataError(f"{image_dir}: a process cleaning the dataset died (killed for lack of memory?); "
                        f"retry with fewer processes per machine") from None
    finally:
        _JOB.clear()
        index.annotations.close()
    items, sizes = [], []
    for chunk_items, chunk_sizes, chunk_report in parts:
        items += chunk_items
        sizes += chunk_sizes
        report.merge(chunk_report)
    return Records.from_bytes(items), report, np.array(sizes, dtype=np.int64).reshape(-1, 3)
