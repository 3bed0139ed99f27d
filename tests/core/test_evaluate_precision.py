"""Evaluation runs in fp32 whatever the training precision (torchvision's reference does too):
under autocast torchvision would decode the boxes in the autocast dtype and round them."""
from __future__ import annotations

import torch
from torch import nn

from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.data.coco import CocoDetection, coco_paths
from maskrcnn_tut.data.loader import build_eval_loader
from maskrcnn_tut.evaluate import predict


class DtypeSpy(nn.Module):
    """A detector that finds nothing and records the dtype its matmuls compute in."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.dtypes = []

    def forward(self, images):
        self.dtypes.append(self.layer(torch.ones(1, 2)).dtype)
        return [{"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.long),
                 "masks": torch.zeros(0, 1, *image.shape[-2:])} for image in images]


def test_predictions_run_in_fp32_under_a_training_autocast(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "val"), train=False)
    loader = build_eval_loader(dataset, derive(make_config("cpu-tiny", workers=0, batch_size=8), 1, "cpu"), 0, 1)
    spy = DtypeSpy().eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a training loop's autocast around the evaluation
        results, ids = predict(spy, loader, torch.device("cpu"), dataset.label_to_cat)
    assert results == [] and len(ids) == len(dataset)
    assert spy.dtypes and set(spy.dtypes) == {torch.float32}
