"""COCO instance segmentation through pycocotools, hardened against the data real projects have.

`CocoDetection` reads any COCO-layout dataset: polygons and RLE become masks, `iscrowd` regions
are kept out of training targets, category ids are remapped to contiguous labels 1..K, and every
entry, annotation or image that cannot be used as it is gets repaired or dropped *and counted* in
a `DataReport` (printed by `python -m maskrcnn_tut.data.check` and logged when training starts).
The cleaning rules themselves live in `maskrcnn_tut.data.clean`; this module is the Dataset.

An image that fails to decode during training (it broke after the start-up scan) is replaced by
the next one and counted as `load_failed`. Inside a DataLoader worker the count cannot reach the
main process's `report`, so the sample carries it in `target[LOAD_FAILED_KEY]` and
`maskrcnn_tut.data.loader.batch_stream` counts it there (`record_load_failures`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from pycocotools import mask as mask_utils
from torch.utils.data import get_worker_info
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from ..errors import DataError
from .clean import category_labels, clean_coco, load_coco_json

log = logging.getLogger(__name__)

#: Target key of a sample loaded in a DataLoader worker after images failed to decode: a list of
#: (image id, reason) for the main process to count (`record_load_failures`) and strip.
LOAD_FAILED_KEY = "load_failed"


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
        data = load_coco_json(self.ann_file)
        self.categories, self.cat_to_label = category_labels(data["categories"])
        self.label_to_cat = {v: k for k, v in self.cat_to_label.items()}
        self.class_names = [str(c.get("name", c["id"])) for c in self.categories]
        self.images, self.targets, self.crowds, self.report = clean_coco(data, self.image_dir, train, verify_pixels)
        self._warned: set = set()  # image ids whose decode failure was logged (once per id)
        if not self.images:
            raise DataError(f"{self.ann_file}: no usable images{' for training' if train else ''} "
                            f"({self.report.summary()})")

    @property
    def num_classes(self) -> int:
        """Categories plus background, as Mask R-CNN counts them."""
        return len(self.categories) + 1

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

    def record_load_failures(self, failures: list[tuple]) -> None:
        """Count (image id, reason) decode failures in `report` as `load_failed`; log each image
        id's first failure only, so a file that stays broken does not flood the log every epoch."""
        for image_id, reason in failures:
            self.report.add("load_failed", image_id)
            if image_id not in self._warned:
                self._warned.add(image_id)
                log.warning("%s; using the next image instead (logged once per image)", reason)

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, None)
        failures = []
        for attempt in range(len(self)):
            candidate = (index + attempt) % len(self)
            try:
                image, target = self.load(candidate)
                break
            except Exception as err:  # whatever the decoder raises: never crash mid-epoch
                info = self.images[candidate]
                failures.append((info["id"], f"{self.image_dir / info['file_name']}: failed to decode ({err})"))
        else:
            raise DataError(f"{self.image_dir}: no image could be decoded")
        if self.transforms is not None:
            if seed is None:
                image, target = self.transforms(image, target)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    image, target = self.transforms(image, target)
        if failures:
            if get_worker_info() is None:  # the main process: its own report
                self.record_load_failures(failures)
            else:  # a worker's report is a copy nobody reads: the sample carries the failures
                target[LOAD_FAILED_KEY] = failures
        return image, target


def coco_paths(data_path: Path | str, split: str) -> tuple[Path, Path]:
    """(image folder, annotation json) of `split` in the COCO 2017 layout torchvision's reference reads."""
    root = Path(data_path)
    return root / f"{split}2017", root / "annotations" / f"instances_{split}2017.json"
