"""COCO box and mask AP with pycocotools, over predictions gathered from every rank.

Each rank predicts its own shard of the validation images (no sampler padding, so no duplicate
predictions); rank 0 gathers the COCO-format results and runs `COCOeval` for `bbox` and `segm`,
while the others wait for its metrics in a gloo group with a long timeout of its own.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import logging
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torchvision.models.detection.roi_heads import expand_boxes, expand_masks, paste_mask_in_image
from tqdm.auto import tqdm

from . import distributed as du
from .data.coco import UNREADABLE_KEY
from .data.loader import iterate, to_device

METRICS = ("AP", "AP50", "AP75")
log = logging.getLogger(__name__)


def binary_masks(output: dict, threshold: float = 0.5) -> Iterator[torch.Tensor]:
    """Each detection's mask of `output` as a bool image-sized CPU tensor, one at a time: torchvision's
    pasted masks thresholded, or, where `output` holds the model's 28x28 masks and its "image_size"
    (`predict`'s post-processing), each pasted as torchvision pastes it, when it is needed."""
    if "image_size" not in output:
        yield from (output["masks"][:, 0] > threshold).cpu()
        return
    height, width = output["image_size"]
    for mask, box in zip(output["masks"], output["boxes"]):
        padded, scale = expand_masks(mask[None], padding=1)
        yield (paste_mask_in_image(padded[0, 0], expand_boxes(box[None], scale).long()[0], height, width)
               > threshold).cpu()


def to_coco_results(outputs: list[dict], image_ids: list[int], label_to_cat: dict[int, int],
                    mask_threshold: float = 0.5) -> list[dict]:
    """Model outputs (XYXY boxes, soft masks, contiguous labels) as COCO result dicts, masks as RLE
    (encoded one at a time: a full-size mask per detection is held only while it is encoded)."""
    results = []
    for output, image_id in zip(outputs, image_ids):
        boxes = output["boxes"].float().cpu()
        scores = output["scores"].float().cpu().tolist()
        labels = output["labels"].cpu().tolist()
        masks = binary_masks(output, mask_threshold) if "masks" in output else None
        xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()
        for box, score, label in zip(xywh, scores, labels):
            result = {"image_id": int(image_id), "category_id": label_to_cat[int(label)],
                      "bbox": [round(v, 2) for v in box], "score": round(float(score), 5)}
            if masks is not None:
                rle = mask_utils.encode(np.asfortranarray(next(masks).numpy().astype(np.uint8)))
                rle["counts"] = rle["counts"].decode("ascii")
                result["segmentation"] = rle
            results.append(result)
    return results


def coco_metrics(coco_gt: COCO, results: list[dict], image_ids: list[int] | None = None,
                 iou_types=("bbox", "segm")) -> dict[str, float]:
    """`{bbox_AP, bbox_AP50, bbox_AP75, segm_AP, ...}` as fractions 0-1 (0 when nothing predicted)."""
    metrics = {}
    for iou_type in iou_types:
        if not results:
            metrics.update({f"{iou_type}_{m}": 0.0 for m in METRICS})
            continue
        with contextlib.redirect_stdout(io.StringIO()):  # COCOeval prints a lot
            coco_dt = coco_gt.loadRes(results)
            evaluator = COCOeval(coco_gt, coco_dt, iou_type)
            if image_ids is not None:
                evaluator.params.imgIds = sorted(image_ids)
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        for name, value in zip(METRICS, evaluator.stats[:3]):
            metrics[f"{iou_type}_{name}"] = max(float(value), 0.0)
    return metrics


def prediction_stats(results: list[dict], image_ids: list[int]) -> dict[str, float]:
    """How much the model predicted: detections per image, the share of images with none, and the
    median and top score (what tells "AP 0" from a model that predicts nothing at all)."""
    scores = np.array([r["score"] for r in results], dtype=np.float64)
    with_detections = len({r["image_id"] for r in results})
    return {"detections_per_image": len(results) / max(len(image_ids), 1),
            "images_without_detections": (len(image_ids) - with_detections) / max(len(image_ids), 1),
            "score_median": float(np.median(scores)) if len(scores) else 0.0,
            "score_max": float(scores.max()) if len(scores) else 0.0}


def coco_from_dict(dataset: dict) -> COCO:
    """A pycocotools COCO index over an in-memory COCO dict (e.g. `CocoDetection.ground_truth()`)."""
    coco = COCO()
    coco.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def pack_results(results: list[dict]) -> dict:
    """COCO results as a few flat arrays (cheap to pickle and send: 5k images' 500k detections
    are ~1 s to gather, not the tens of seconds and GBs of as many Python dicts)."""
    n = len(results)
    counts = [r["segmentation"]["counts"].encode("ascii") if "segmentation" in r else b"" for r in results]
    return {"image_id": np.array([r["image_id"] for r in results], dtype=np.int64),
            "category_id": np.array([r["category_id"] for r in results], dtype=np.int64),
            "bbox": np.array([r["bbox"] for r in results], dtype=np.float64).reshape(n, 4),
            "score": np.array([r["score"] for r in results], dtype=np.float64),
            "size": np.array([r["segmentation"]["size"] if "segmentation" in r else (0, 0) for r in results],
                             dtype=np.int64).reshape(n, 2),
            "offsets": np.cumsum([0] + [len(c) for c in counts]), "counts": b"".join(counts)}


def unpack_results(packed: dict) -> list[dict]:
    """`pack_results`' input back, dict for dict."""
    results, offsets, counts = [], packed["offsets"].tolist(), packed["counts"]
    for k, (image_id, category, bbox, score, size) in enumerate(zip(
            packed["image_id"].tolist(), packed["category_id"].tolist(), packed["bbox"].tolist(),
            packed["score"].tolist(), packed["size"].tolist())):
        result = {"image_id": image_id, "category_id": category, "bbox": bbox, "score": score}
        if size[0]:
            result["segmentation"] = {"size": size, "counts": counts[offsets[k]:offsets[k + 1]].decode("ascii")}
        results.append(result)
    return results


#: How long the other ranks wait for rank 0's COCO scoring: far beyond --dist-timeout, as scoring
#: a large validation set alone can take an hour (a rank that dies still ends the job through torchrun).
SCORING_WAIT = datetime.timedelta(hours=2)
_scoring_groups: dict = {}


def wait_for_score(metrics: dict[str, float] | None) -> dict[str, float] | None:
    """Rank 0's metrics on every rank. The others wait in a gloo group of their own with its own long
    timeout: waiting in the next step's all-reduce instead, NCCL's watchdog would end the whole job
    once scoring took longer than --dist-timeout."""
    if not dist.is_initialized():
        return metrics
    world = dist.group.WORLD
    if world not in _scoring_groups:  # every rank evaluates together, so every rank creates it here
        _scoring_groups.clear()
        _scoring_groups[world] = dist.new_group(backend="gloo", timeout=SCORING_WAIT)
    box = [metrics]
    dist.broadcast_object_list(box, src=0, group=_scoring_groups[world])
    return box[0]


def gather_results(results: list[dict], image_ids: list[int]) -> tuple[list[dict], list[int]] | None:
    """Every rank's (results, image ids), concatenated in rank order, on rank 0; None elsewhere."""
    gathered = du.all_gather_objects((pack_results(results), np.asarray(image_ids, dtype=np.int64)))
    if not du.info().is_main:
        return None
    return ([r for packed, _ in gathered for r in unpack_results(packed)],
            [i for _, ids in gathered for i in ids.tolist()])


@torch.inference_mode()
def predict(model, loader, device, label_to_cat, progress=False):
    """COCO results for every image `loader` yields (this rank's shard), and the ids scored.

    The model runs in fp32 whatever precision it trained in, autocast off, as torchvision's
    reference evaluates: under fp16 autocast torchvision decodes the boxes in fp16 (steps of 0.5 px
    from 512 px on), which biases AP75 and mask AP. Images that failed to decode are counted in the
    dataset's report (`load_failed`, through `data.loader.iterate`) and left out of the ids, so the
    score covers the images it saw."""
    results, image_ids = [], []
    for images, targets in tqdm(iterate(loader), desc="evaluate", total=len(loader), disable=not progress,
                                leave=False):
        readable = [k for k, t in enumerate(targets) if not t.get(UNREADABLE_KEY)]
        if not readable:
            continue
        images, _ = to_device([images[k] for k in readable], [], device)
        ids = [targets[k]["image_id"] for k in readable]
        with torch.autocast(device.type, enabled=False):
            outputs = model(images)
        results.extend(to_coco_results(outputs, ids, label_to_cat))
        image_ids.extend(ids)
    return results, image_ids


def evaluate(model, loader, coco_gt: COCO | None, device, label_to_cat, progress: bool = False) -> dict[str, float]:
    """Predict on every rank's shard (in fp32, `predict`), gather on rank 0 and score there; every
    rank returns the metrics, once rank 0 has them (`wait_for_score`)."""
    module = du.unwrap(model)
    was_training = module.training
    module.eval()
    try:
        results, image_ids = predict(module, loader, device, label_to_cat, progress)
    finally:
        module.train(was_training)
    gathered = gather_results(results, image_ids)
    return wait_for_score(None if gathered is None else score(coco_gt, *gathered))


def score(coco_gt: COCO, all_results: list[dict], all_ids: list[int]) -> dict[str, float]:
    """COCO box and mask AP of every rank's gathered results (rank 0 alone runs this)."""
    if len(all_ids) != len(set(all_ids)):
        raise RuntimeError("evaluation saw an image twice: the eval shards overlap")
    stats = prediction_stats(all_results, all_ids)
    if not all_results:
        log.warning("the model predicted nothing on %d images (no detection scored above the model's score "
                    "threshold): its AP of 0 says the model has not learned yet, not that evaluation is broken; "
                    "train longer, or prove the pipeline with --overfit 8", len(all_ids))
    return coco_metrics(coco_gt, all_results, all_ids) | stats
