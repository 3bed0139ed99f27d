"""COCO evaluation: perfect predictions score 1.0, degraded ones less, shards never overlap."""
import torch

from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.data.coco import CocoDetection, coco_paths
from maskrcnn_tut.data.loader import build_eval_loader
from maskrcnn_tut.evaluate import coco_from_dict, coco_metrics, to_coco_results


def _perfect_outputs(dataset):
    outputs, ids = [], []
    for index in range(len(dataset)):
        _, target = dataset.load(index)
        n = len(target["labels"])
        outputs.append({"boxes": target["boxes"].as_subclass(torch.Tensor), "scores": torch.ones(n),
                        "labels": target["labels"], "masks": target["masks"][:, None].float()})
        ids.append(target["image_id"])
    return outputs, ids


def test_perfect_predictions_score_one_and_degraded_ones_less(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "val"), train=False)
    gt = coco_from_dict(dataset.ground_truth())
    outputs, ids = _perfect_outputs(dataset)
    perfect = coco_metrics(gt, to_coco_results(outputs, ids, dataset.label_to_cat), ids)
    assert all(abs(v - 1.0) < 1e-9 for v in perfect.values()), perfect

    for out in outputs:  # shift every box and mask by 4 pixels
        out["boxes"] = out["boxes"] + 4
        out["masks"] = torch.roll(out["masks"], shifts=(4, 4), dims=(2, 3))
    shifted = coco_metrics(gt, to_coco_results(outputs, ids, dataset.label_to_cat), ids)
    assert shifted["bbox_AP"] < 0.9 and shifted["segm_AP"] < 0.9
    assert shifted["bbox_AP50"] > shifted["bbox_AP75"]


def test_no_predictions_score_zero(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "val"), train=False)
    assert set(coco_metrics(coco_from_dict(dataset.ground_truth()), []).values()) == {0.0}


def test_eval_shards_cover_every_image_once(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "val"), train=False)
    cfg = derive(make_config("cpu-tiny", workers=0, batch_size=3), 1, "cpu")
    seen = []
    for rank in range(3):
        for _, targets in build_eval_loader(dataset, cfg, rank, 3):
            seen.extend(t["image_id"] for t in targets)
    assert sorted(seen) == sorted(img["id"] for img in dataset.images)
