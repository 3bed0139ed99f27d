"""COCO instance segmentation through pycocotools, hardened against the data real projects have.

`CocoDetection` reads any COCO-layout dataset: polygons and RLE become masks, `iscrowd` regions
are kept out of training targets, category ids are remapped to contiguous labels 1..K, and every
entry, annotation or image that cannot be used as it is gets repaired or dropped *and counted* in
a `DataReport` (printed by `python -m maskrcnn_tut.data.check` and logged when training starts).
The cleaning rules themselves live in `maskrcnn_tut.data.clean`, and the json is read a piece at a
time (`maskrcnn_tut.data.cocojson`: never whole in memory); this module is the Dataset.

Cleaned images are kept as pickled records in one flat buffer (`maskrcnn_tut.data.records`), so
a COCO-sized dataset costs a few hundred MB once, shared by forked DataLoader workers; a large
dataset's cleaned buffer is cached on disk (`cache_dir`) so the ranks of a run, and later runs,
open its 118k image files once, not once per rank per run.

An image that fails to decode during training (it broke after the start-up scan) is replaced by
the next one and counted as `load_failed`; during evaluation (`substitute=False`) it is left out
of the score instead and counted the same way. Inside a DataLoader worker the count cannot reach
the main process's `report`, so the sample carries it in `target[LOAD_FAILED_KEY]` and
`maskrcnn_tut.data.loader.iterate` counts it there (`record_load_failures`). A vanished image
folder, or a run of `MAX_FAILURES_IN_A_ROW` images that all fail, stops with one `DataError`.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from pycocotools import mask as mask_utils
from torch.utils.data import get_worker_info
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from ..errors import DataError
from .clean import DataReport, category_labels, clean_coco, resize_fails
from .cocojson import read_coco
from .device_decode import Encoded, apply_transforms, read_encoded
from .records import Records, cached_records

log = logging.getLogger(__name__)

#: Target key of a sample loaded in a DataLoader worker after images failed to decode: a list of
#: (image id, reason) for the main process to count (`record_load_failures`) and strip.
LOAD_FAILED_KEY = "load_failed"
#: Target key of an evaluation placeholder: the image could not be decoded and is not scored.
UNREADABLE_KEY = "unreadable"
#: Consecutive images that fail to decode before the storage is taken for gone (one DataError).
MAX_FAILURES_IN_A_ROW = 16
#: Distinct images whose decode failure is logged; later ones are counted only.
LOGGED_FAILURES = 5


def read_rgb(path: Path) -> Image.Image:
    """Decode fully, apply EXIF orientation, and convert any mode (L, P, RGBA, CMYK, I;16, F) to RGB
    (in place: an upright RGB image is not copied, as exif_transpose and convert would each do)."""
    with Image.open(path) as img:
        img.load()
        ImageOps.exif_transpose(img, in_place=True)
        if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
            array = np.asarray(img, dtype=np.float64)
            scale = 1 / 257 if img.mode.startswith("I;16") else 255.0 / max(float(array.max()), 1e-12)
            img = Image.fromarray(np.clip(array * scale, 0, 255).astype(np.uint8))
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")
        return img if img.mode == "RGB" else img.convert("RGB")


class _View(Sequence):
    """A read-only list view of `records` through `convert` (for `images`, `targets`, `crowds`)."""

    def __init__(self, records: Records, convert):
        self.records, self.convert = records, convert

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.convert(self.records[index])


def _image_info(record) -> dict:
    image_id, file_name, width, height, _, _, source_id = record
    info = {"id": image_id, "file_name": file_name, "width": width, "height": height}
    if source_id != image_id:
        info["source_id"] = source_id
    return info


def _instances(entries, width: int, height: int) -> list[dict]:
    return [{"box": [x0, y0, x1, y1], "label": label, "rle": {"size": [height, width], "counts": counts},
             "area": area} for x0, y0, x1, y1, label, counts, area in entries]


def _targets(record) -> list[dict]:
    return _instances(record[4], record[2], record[3])


def _crowds(record) -> list[dict]:
    return _instances(record[5], record[2], record[3])


class CocoDetection(torch.utils.data.Dataset):
    """Images and Mask R-CNN targets from a COCO json and its image folder.

    `train=True` drops images with no usable annotation (they teach nothing to a detector);
    evaluation keeps every readable image. With `min_size`/`max_size` (the model's resize),
    images the resize cannot handle are dropped too (`extreme_aspect`). Items are
    `(image, target)`: a uint8 `tv_tensors.Image` and a dict of `boxes` (XYXY), `masks`, `labels`
    (contiguous 1..K) and `image_id` (an int: the json's, or the image's position when the json
    uses string ids; `images[i]["source_id"]` keeps the json's). `dataset[(index, seed)]` runs the
    random transforms from that seed, so augmentation is a function of the sample, not of which
    worker loaded it. `cache_dir` keeps the cleaned records of a large dataset on disk
    (`maskrcnn_tut.data.records.cached_records`).
    """

    def __init__(self, image_dir: Path | str, ann_file: Path | str, transforms=None, train: bool = True,
                 verify_pixels: bool = False, min_size: int | None = None, max_size: int | None = None,
                 cache_dir: Path | str | None = None):
        self.image_dir, self.ann_file = Path(image_dir), Path(ann_file)
        self.transforms, self.train = transforms, train
        settings = {"train": train, "verify_pixels": verify_pixels}
        records, header = cached_records(cache_dir, self.ann_file, self.image_dir, settings, self._clean(settings))
        self.categories = header["categories"]
        _, self.cat_to_label = category_labels(self.categories)
        self.label_to_cat = {v: k for k, v in self.cat_to_label.items()}
        self.class_names = [str(c.get("name", c["id"])) for c in self.categories]
        self.report: DataReport = copy.deepcopy(header["report"])
        widths, heights, counts = header["widths"], header["heights"], header["instances"]
        fails = resize_fails(widths, heights, min_size, max_size)
        for position in np.flatnonzero(fails):
            self.report.add("extreme_aspect", records[int(position)][6])
        keep = ~fails
        self.records = records.subset(keep)
        self.widths, self.heights = widths[keep], heights[keep]
        self.num_instances = int(counts[keep].sum())
        self.images = _View(self.records, _image_info)
        self.targets = _View(self.records, _targets)
        self.crowds = _View(self.records, _crowds)
        #: set by `build_train_loader` for `--decode-on-device`: workers hand JPEGs over undecoded
        self.decode_device: torch.device | None = None
        self._warned: set = set()  # image ids whose decode failure was logged
        self._muted = False  # True once LOGGED_FAILURES images were logged
        if not len(self.records):
            raise DataError(f"{self.ann_file}: no usable images{' for training' if train else ''} "
                            f"({self.report.summary()})")

    def _clean(self, settings: dict):
        def build() -> tuple[Records, dict]:
            index = read_coco(self.ann_file)  # a piece at a time: never the whole json at once
            categories, _ = category_labels(index.categories)
            records, report, sizes = clean_coco(index, self.image_dir, **settings)
            del index
            return records, {"report": report, "categories": categories, "widths": sizes[:, 0],
                             "heights": sizes[:, 1], "instances": sizes[:, 2]}
        return build

    def first(self, count: int, transforms=None) -> "CocoDetection":
        """The first `count` images as a dataset of their own, with `transforms` (the overfit check
        trains on them, augmented, and evaluates on the same images, unaugmented)."""
        subset = copy.copy(self)
        keep = np.arange(len(self.records)) < count
        subset.records = self.records.subset(keep)
        subset.widths, subset.heights = self.widths[keep], self.heights[keep]
        subset.num_instances = sum(len(target) for target in _View(subset.records, _targets))
        subset.images, subset.targets = _View(subset.records, _image_info), _View(subset.records, _targets)
        subset.crowds, subset.transforms = _View(subset.records, _crowds), transforms
        subset.report, subset._warned = copy.deepcopy(self.report), set()
        return subset

    @property
    def num_classes(self) -> int:
        """Categories plus background, as Mask R-CNN counts them."""
        return len(self.categories) + 1

    def ground_truth(self) -> dict:
        """The cleaned annotations as a COCO dict (what evaluation scores against): exactly the
        instances training sees, plus crowd regions for COCOeval to ignore."""
        images, annotations = [], []
        for record in self.records:
            image_id, file_name, width, height, instances, crowds, _ = record
            images.append({"id": image_id, "width": width, "height": height, "file_name": file_name})
            for entries, crowd in ((instances, 0), (crowds, 1)):
                for x0, y0, x1, y1, label, counts, area in entries:
                    annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                        "category_id": self.label_to_cat[label], "iscrowd": crowd,
                                        "bbox": [x0, y0, x1 - x0, y1 - y0], "area": float(area),
                                        "segmentation": {"size": [height, width], "counts": counts.decode("ascii")}})
        return {"images": images, "annotations": annotations, "categories": self.categories}

    def __len__(self) -> int:
        return len(self.records)

    def aspect_ratios(self) -> list[float]:
        return (self.widths / self.heights).tolist()

    def load(self, index: int, with_masks: bool = True):
        """Decode image `index` (or, with `decode_device` set, read a JPEG's bytes) and build its
        target (no transforms); evaluation, which scores against the json, needs no masks (`with_masks`)."""
        image_id, file_name, width, height, instances, _, _ = self.records[index]
        image = read_encoded(self.image_dir / file_name, width, height) if self.decode_device else None
        if image is None:
            pil_image = read_rgb(self.image_dir / file_name)
            if pil_image.size != (width, height):
                raise OSError(f"{file_name}: size changed since the start-up scan")
            image = tv_tensors.Image(F.pil_to_tensor(pil_image))
        boxes = torch.tensor([inst[:4] for inst in instances], dtype=torch.float32).reshape(-1, 4)
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
            "labels": torch.tensor([inst[4] for inst in instances], dtype=torch.int64),
            "image_id": image_id,
        }
        if with_masks:
            rles = [{"size": [height, width], "counts": inst[5]} for inst in instances]
            # pycocotools decodes column-major (H, W, N): a worker's `packing.pack` transposes it, this process here
            masks = (torch.from_numpy(mask_utils.decode(rles)).permute(2, 0, 1) if instances
                     else torch.zeros((0, height, width), dtype=torch.uint8))
            target["masks"] = tv_tensors.Mask(masks if get_worker_info() else masks.contiguous())
        return image, target

    def record_load_failures(self, failures: list[tuple], consequence: str = "using the next image instead") -> None:
        """Count (image id, reason) decode failures in `report` as `load_failed`; log the first
        failure of the first `LOGGED_FAILURES` images only, then one line saying the rest are
        counted (the count is in the run's summary), so broken files never flood the log."""
        for image_id, reason in failures:
            self.report.add("load_failed", image_id)
            if image_id in self._warned or self._muted:
                continue
            self._warned.add(image_id)
            log.warning("%s; %s (logged once per image)", reason, consequence)
            if len(self._warned) >= LOGGED_FAILURES:
                self._muted = True
                log.warning("%d images failed to decode: further failures are counted as load_failed, "
                            "not logged", LOGGED_FAILURES)

    def record_device_failure(self, target: dict, err: Exception) -> None:
        """Count an image that `--decode-on-device` could decode neither on the device nor on the CPU."""
        self.record_load_failures([(target["image_id"], f"image {target['image_id']}: failed to decode on the "
                                                        f"device and on the CPU ({err})")], "dropped from its batch")

    def _failed(self, index: int, err: Exception) -> tuple:
        """(image id, reason) of a decode failure; a `DataError` when the image folder is gone."""
        if not self.image_dir.is_dir():
            raise DataError(f"{self.image_dir}: the image folder vanished during the run "
                            f"(while reading {self.records[index][1]})")
        image_id, file_name = self.records[index][:2]
        return image_id, f"{self.image_dir / file_name}: failed to decode ({err})"

    def sample(self, index: int, seed: int | None = None, substitute: bool = True, with_masks: bool = True):
        """Item `index`, transformed from `seed`. An image that fails to decode is replaced by the
        next one that decodes (`substitute`, for training), or (for evaluation, where every image
        is scored once) returned as a 1-pixel placeholder whose target carries the failure."""
        failures = []
        for attempt in range(min(len(self), MAX_FAILURES_IN_A_ROW) if substitute else 1):
            candidate = (index + attempt) % len(self)
            try:
                image, target = self.load(candidate, with_masks)
                break
            except DataError:
                raise
            except Exception as err:  # whatever the decoder raises: never crash mid-epoch
                failures.append(self._failed(candidate, err))
        else:
            if not substitute:
                placeholder = {"image_id": self.records[index][0], UNREADABLE_KEY: True, LOAD_FAILED_KEY: failures}
                return torch.zeros((3, 1, 1), dtype=torch.uint8), placeholder
            raise DataError(f"{self.image_dir}: {len(failures)} images in a row failed to decode "
                            f"(first: {failures[0][1]}): is the storage gone?")
        if isinstance(image, Encoded):
            image.seed = seed  # transformed in the main process, after decoding (`decode_batch`)
        elif self.transforms is not None:
            image, target = apply_transforms(self.transforms, image, target, seed)
        if failures:
            if get_worker_info() is None:  # the main process: its own report
                self.record_load_failures(failures)
            else:  # a worker's report is a copy nobody reads: the sample carries the failures
                target[LOAD_FAILED_KEY] = failures
        return image, target

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, None)
        return self.sample(index, seed)


def coco_paths(data_path: Path | str, split: str) -> tuple[Path, Path]:
    """(image folder, annotation json) of `split` in the COCO 2017 layout torchvision's reference reads."""
    root = Path(data_path)
    return root / f"{split}2017", root / "annotations" / f"instances_{split}2017.json"
