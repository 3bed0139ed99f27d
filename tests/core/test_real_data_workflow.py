"""The real-photo workflow's guards: an evaluation says how much the model predicted (so "AP 0"
is never mistaken for a broken evaluation), and the overfit check trains and scores one set of
images."""
import logging

import pytest
import torch
from conftest import run_flags, run_train
from torch import nn

from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.data.coco import CocoDetection, coco_paths
from maskrcnn_tut.data.loader import build_eval_loader
from maskrcnn_tut.evaluate import coco_from_dict, evaluate, prediction_stats


class PredictsNothing(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, images):
        return [{"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64),
                 "masks": torch.zeros(0, 1, *image.shape[-2:])} for image in images]


def test_an_empty_prediction_is_reported_plainly(shapes_root, caplog):
    val = CocoDetection(*coco_paths(shapes_root, "val"), train=False)
    loader = build_eval_loader(val, derive(make_config("cpu-tiny", workers=0), 1, "cpu"), 0, 1)
    with caplog.at_level(logging.WARNING):
        metrics = evaluate(PredictsNothing(), loader, coco_from_dict(val.ground_truth()), torch.device("cpu"),
                           val.label_to_cat)
    assert metrics["bbox_AP"] == 0 and metrics["detections_per_image"] == 0
    assert metrics["images_without_detections"] == 1.0
    assert f"the model predicted nothing on {len(val)} images" in caplog.text


def test_prediction_stats_count_detections_and_scores():
    results = [{"image_id": 1, "score": 0.9}, {"image_id": 1, "score": 0.1}, {"image_id": 2, "score": 0.5}]
    stats = prediction_stats(results, [1, 2, 3, 4])
    assert stats == {"detections_per_image": 0.75, "images_without_detections": 0.5, "score_median": 0.5,
                     "score_max": 0.9}


@pytest.mark.system
def test_the_overfit_check_trains_and_scores_the_same_images(shapes_root, tmp_path):
    result = run_train(*run_flags(shapes_root, tmp_path / "run", "--overfit", "4", "--max-steps", "2"), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    train_line, val_line = [line for line in result.stderr.splitlines() if " data " in line][:2]
    assert "instances_train2017.json: 4 images" in train_line and "instances_train2017.json: 4 images" in val_line
    assert "images that failed to decode: 0 train, 0 val" in result.stdout
