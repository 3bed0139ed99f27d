"""A worker's batch in one block of shared memory: one copy, one file descriptor, not one shared-memory
file per tensor, each copied, sent through a socket and mapped again by the training process on the cores
its threads use. Masks are transposed from pycocotools' column-major layout in that copy; received, the
batch is views of the block with each tensor's type, metadata and layout (tests/core/test_data_packing.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torchvision import tv_tensors


class Slot(NamedTuple):
    """Where one tensor lies in its batch's block, and what it was (meta: BoundingBoxes' format, size)."""
    offset: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    kind: type
    meta: tuple


@dataclass
class PackedBatch:
    block: torch.Tensor  # uint8, in shared memory: the one storage the worker sends
    columns: tuple  # the collated batch with every tensor replaced by its Slot

    def __reduce__(self):  # received as the batch itself
        return _unpack, (self.block, self.columns)


def pack(columns: tuple) -> PackedBatch:
    """The collated batch (images, targets) with its samples' tensors, and their targets', in one shared block."""
    tensors: list[torch.Tensor] = []
    _map(columns, tensors.append, torch.Tensor)
    offsets = [0]
    for tensor in tensors:  # each tensor on a cache line of its own
        offsets.append(offsets[-1] + -(-tensor.numel() * tensor.element_size() // 64) * 64)
    block = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(offsets[-1]))  # never copied
    slots = {}
    for tensor, offset in zip(tensors, offsets):
        meta = (tensor.format, tensor.canvas_size) if isinstance(tensor, tv_tensors.BoundingBoxes) else ()
        layout = torch.contiguous_format if isinstance(tensor, tv_tensors.Mask) else torch.preserve_format
        stride = torch.empty_like(tensor, device="meta", memory_format=layout).stride()  # dense: its own
        slots[id(tensor)] = Slot(offset, tensor.dtype, tuple(tensor.shape), stride, type(tensor), meta)
        _view(block, slots[id(tensor)]).copy_(tensor)
    return PackedBatch(block, _map(columns, lambda tensor: slots[id(tensor)], torch.Tensor))


def _unpack(block: torch.Tensor, columns: tuple) -> tuple:
    def rebuild(slot: Slot) -> torch.Tensor:  # a view of the block, no copy
        data = _view(block, slot)
        if slot.kind is tv_tensors.BoundingBoxes:
            return tv_tensors.BoundingBoxes(data, format=slot.meta[0], canvas_size=slot.meta[1])
        return data if slot.kind is torch.Tensor else slot.kind(data)
    return _map(columns, rebuild, Slot)


def _view(block: torch.Tensor, slot: Slot) -> torch.Tensor:
    size = math.prod(slot.shape) * slot.dtype.itemsize
    return block[slot.offset:slot.offset + size].view(slot.dtype).as_strided(slot.shape, slot.stride)


def _map(columns: tuple, fn, kind: type) -> tuple:
    """`columns` with each `kind` found as a sample's item, or as a value of a dict item, replaced by fn(it)."""
    def one(value):
        return fn(value) if isinstance(value, kind) else value
    return tuple(tuple({k: one(v) for k, v in item.items()} if isinstance(item, dict) else one(item)
                       for item in column) for column in columns)
