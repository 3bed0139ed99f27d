"""Batches from the loader's workers, packed into one shared block, are the batches the model saw
before: the same tensors, values, types, dtypes, layout and metadata, image for image."""
from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info
from torchvision import tv_tensors

from maskrcnn_tut.data import coco, loader
from maskrcnn_tut.data.coco import CocoDetection, coco_paths
from maskrcnn_tut.data.loader import ResumableBatches, iterate, train_transforms
from maskrcnn_tut.data.packing import PackedBatch, pack


class ContiguousMasks(CocoDetection):
    """What the dataset did before packing: masks made contiguous in every process."""

    def load(self, index, with_masks=True):
        image, target = super().load(index, with_masks)
        if "masks" in target:
            target["masks"] = tv_tensors.Mask(target["masks"].contiguous())
        return image, target


def collate_before(batch):
    """The collate of before: every tensor moved to shared memory on its own."""
    columns = tuple(zip(*batch))
    if get_worker_info() is not None:
        for item in (item for column in columns for item in column):
            for value in item.values() if isinstance(item, dict) else [item]:
                if isinstance(value, torch.Tensor):
                    value.share_memory_()
    return columns


def batches(dataset, collate, workers: int) -> list:
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(dataset), 3, drop_last=False)
    resumable = ResumableBatches(sampler, seed=7)
    resumable.set_epoch(1)
    data = DataLoader(dataset, batch_sampler=resumable, num_workers=workers, collate_fn=collate,
                      multiprocessing_context=multiprocessing.get_context("fork") if workers else None)
    return list(iterate(data))


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor))
        if isinstance(a, tv_tensors.BoundingBoxes):
            assert (a.format, a.canvas_size) == (b.format, b.canvas_size)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_what_they_were_before_packing(shapes_root, workers):
    paths = coco_paths(shapes_root, "train")
    before = batches(ContiguousMasks(*paths, transforms=train_transforms()), collate_before, workers)
    after = batches(CocoDetection(*paths, transforms=train_transforms()), loader.collate, workers)
    assert len(after) == len(before) > 1
    flipped = 0
    for old, new in zip(before, after):
        assert_same(old, new)
        flipped += sum(bool((t["masks"].flip(-1) != t["masks"]).any()) for t in new[1] if len(t["masks"]))
    assert flipped  # the random flip ran on some masks, and still they match


def test_a_packed_batch_is_one_shared_block_of_views():
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[1.0, 2, 3, 4]]), format="XYXY", canvas_size=(5, 6))
    masks = torch.arange(2 * 5 * 6, dtype=torch.uint8).reshape(2, 6, 5).permute(0, 2, 1)  # column-major, as decoded
    columns = ((tv_tensors.Image(torch.ones(3, 5, 6, dtype=torch.uint8)),),
               ({"boxes": boxes, "labels": torch.tensor([3]), "masks": tv_tensors.Mask(masks), "image_id": 9},))
    packed = pack(columns)
    assert isinstance(packed, PackedBatch) and packed.block.is_shared()
    rebuild, args = packed.__reduce__()
    images, targets = rebuild(*args)  # what the training process receives
    storages = {t.untyped_storage().data_ptr() for t in [images[0], *(v for v in targets[0].values()
                                                                      if isinstance(v, torch.Tensor))]}
    assert storages == {packed.block.untyped_storage().data_ptr()}
    assert_same((images, targets), (columns[0], ({**columns[1][0], "masks": tv_tensors.Mask(masks.contiguous())},)))


def test_outside_a_worker_masks_are_contiguous_and_collate_does_not_pack(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "train"))
    assert coco.get_worker_info() is None
    masks = dataset[0][1]["masks"]
    assert masks.is_contiguous()
    assert not isinstance(loader.collate([dataset[0]]), PackedBatch)
