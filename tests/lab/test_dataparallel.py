"""DetectionDataParallel's scatter and gather, on CPU (the GPU path needs >= 2 GPUs)."""
from __future__ import annotations

import pytest
import torch

from maskrcnn_tut.lab.dataparallel import (
    DataParallelUnavailable,
    DetectionDataParallel,
    explain_unavailable,
    gather_detections,
    gather_losses,
    move_to,
    parallel_forward,
    split_batch,
)


def _batch(n: int):
    images = [torch.full((3, 4 + i, 5), float(i)) for i in range(n)]  # differently sized, like detection
    targets = [{"labels": torch.tensor([i]), "boxes": torch.zeros(1, 4)} for i in range(n)]
    return images, targets


def test_split_keeps_order_and_pairs_targets_with_images():
    images, targets = _batch(5)
    chunks = split_batch(images, targets, 2)
    assert [len(chunk_images) for chunk_images, _ in chunks] == [3, 2]
    for chunk_images, chunk_targets in chunks:
        for image, target in zip(chunk_images, chunk_targets):
            assert image[0, 0, 0].item() == target["labels"].item()
    assert [int(img[0, 0, 0]) for chunk, _ in chunks for img in chunk] == list(range(5))


def test_split_uses_fewer_devices_than_given_when_images_are_fewer():
    images, targets = _batch(2)
    assert [len(c) for c, _ in split_batch(images, targets, 4)] == [1, 1]
    assert [len(c) for c, _ in split_batch(images, None, 1)] == [2]
    assert all(t is None for _, t in split_batch(images, None, 2))


def test_split_rejects_mismatched_targets():
    images, targets = _batch(3)
    with pytest.raises(ValueError, match="3 images but 2 targets"):
        split_batch(images, targets[:2], 2)


def test_gathered_loss_is_the_image_weighted_mean_and_backpropagates():
    weight = torch.tensor(1.0, requires_grad=True)
    # chunk 1 holds 3 images, chunk 2 holds 2: the whole batch's mean loss weights them 3:2
    first = {"loss_a": weight * 1.0, "loss_b": weight * 2.0}
    second = {"loss_a": weight * 3.0, "loss_b": weight * 4.0}
    gathered = gather_losses([first, second], [3, 2], torch.device("cpu"))
    assert gathered["loss_a"].item() == pytest.approx((3 * 1.0 + 2 * 3.0) / 5)
    assert gathered["loss_b"].item() == pytest.approx((3 * 2.0 + 2 * 4.0) / 5)
    sum(gathered.values()).backward()
    assert weight.grad.item() == pytest.approx((3 * 3.0 + 2 * 7.0) / 5)


def test_gathered_detections_are_concatenated_in_input_order():
    outputs = [[{"scores": torch.tensor([0.0])}, {"scores": torch.tensor([1.0])}], [{"scores": torch.tensor([2.0])}]]
    gathered = gather_detections(outputs, torch.device("cpu"))
    assert [d["scores"].item() for d in gathered] == [0.0, 1.0, 2.0]


def test_move_to_reaches_nested_tensors():
    moved = move_to(([torch.ones(1)], {"a": torch.ones(1), "b": 3}), torch.device("cpu"))
    assert isinstance(moved, tuple) and moved[1]["b"] == 3 and moved[0][0].device.type == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine can run DataParallel")
def test_fewer_than_two_gpus_explains_plainly():
    gpus = torch.cuda.device_count()
    with pytest.raises(DataParallelUnavailable, match=rf"needs >= 2 GPUs; this machine has {gpus}\."):
        DetectionDataParallel(torch.nn.Linear(1, 1))
    assert "DDP" in explain_unavailable(gpus) and "1.88x" in explain_unavailable(gpus)


class _AutocastProbe(torch.nn.Module):
    """Reports the autocast state its forward runs under."""

    def forward(self, x):
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled()


def test_replicas_run_under_the_callers_autocast_dtype():
    """torch's parallel_apply re-enters autocast without the dtype (bf16 became fp16); ours keeps it."""
    replicas, devices = [_AutocastProbe(), _AutocastProbe()], [torch.device("cpu")] * 2
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        seen = parallel_forward(replicas, [(torch.ones(1),), (torch.ones(1),)], devices)
    assert seen == [(True, torch.bfloat16, False)] * 2
    assert parallel_forward(replicas, [(torch.ones(1),)] * 2, devices)[0][0] is False


def test_torch_scatter_chunks_each_image_along_its_channels_and_each_target_by_instance():
    """Old finding 16: nn.DataParallel's own scatter cuts every image tensor along dim 0 (its 3
    channels) and every target's boxes by instance; no device gets whole images."""
    from maskrcnn_tut.lab.dataparallel import torch_scatter
    images = [torch.zeros(3, 10 + i, 12) for i in range(4)]
    targets = [{"boxes": torch.zeros(2 + i, 4), "labels": torch.zeros(2 + i, dtype=torch.int64)} for i in range(4)]
    first, second = torch_scatter(images, targets, 2)
    assert first["images"] == second["images"] == 4  # every device gets a piece of every image
    assert first["image shapes"].startswith("2x10x12") and second["image shapes"].startswith("1x10x12")
    assert first["boxes per target"] == [1, 2, 2, 3] and second["boxes per target"] == [1, 1, 2, 2]
    assert len(torch_scatter(images, targets, 4)) == 2  # a target with 2 boxes splits 2 ways: only 2 devices
