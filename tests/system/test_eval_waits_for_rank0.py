"""Every rank gets rank 0's COCO metrics and waits for them in a gloo group of its own, with a
long timeout, not in the next step's all-reduce, where NCCL's watchdog would end a job whose
scoring outlasts --dist-timeout. Two gloo processes started by `processes.launch`."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from maskrcnn_tut import distributed as du
from maskrcnn_tut import evaluate as ev
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.data.coco import CocoDetection, coco_paths
from maskrcnn_tut.data.loader import build_eval_loader
from maskrcnn_tut.lab import processes

pytestmark = pytest.mark.system


class OneBoxPerImage(nn.Module):
    def forward(self, images):
        return [{"boxes": torch.tensor([[4.0, 4, 40, 40]]), "scores": torch.tensor([0.9]),
                 "labels": torch.tensor([1]), "masks": torch.ones(1, 1, *image.shape[-2:])} for image in images]


def evaluate_on_every_rank(root: str) -> list:
    """Run inside `processes.launch`: each rank's metrics, and the groups it waited in."""
    info = du.info()
    dataset = CocoDetection(*coco_paths(root, "val"), train=False)
    loader = build_eval_loader(dataset, derive(make_config("cpu-tiny", workers=0, batch_size=4), info.world_size,
                                               "cpu"), info.rank, info.world_size)
    coco_gt = ev.coco_from_dict(dataset.ground_truth()) if info.is_main else None
    waited_in = []
    broadcast = ev.dist.broadcast_object_list

    def recording_broadcast(objects, src=0, group=None, **kwargs):
        waited_in.append("world" if group in (None, ev.dist.group.WORLD) else "own group")
        return broadcast(objects, src=src, group=group, **kwargs)

    ev.dist.broadcast_object_list = recording_broadcast
    try:
        metrics = ev.evaluate(OneBoxPerImage(), loader, coco_gt, torch.device("cpu"), dataset.label_to_cat)
    finally:
        ev.dist.broadcast_object_list = broadcast
    return du.all_gather_objects((metrics, waited_in))


def test_every_rank_gets_rank0s_metrics_after_waiting_in_its_own_group(shapes_root):
    (rank0, waited0), (rank1, waited1) = processes.launch(evaluate_on_every_rank, 2, str(shapes_root))
    assert rank0 and rank0 == rank1 and "bbox_AP" in rank0
    assert waited0 == waited1 == ["own group"]


def test_one_process_scores_without_a_group():
    assert ev.wait_for_score({"bbox_AP": 0.5}) == {"bbox_AP": 0.5}
