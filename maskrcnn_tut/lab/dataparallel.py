"""DataParallel for torchvision detection models, whose inputs are lists of images and target dicts.

`nn.DataParallel` scatters tensors along their first dimension; a detection batch is a *list* of
differently sized images plus a list of target dicts, which its scatter does not split into
matching per-GPU halves (torchvision issue #1659). `DetectionDataParallel` does what DataParallel
does, with lists: every step it splits the batch into one contiguous chunk per GPU, replicates
the model onto those GPUs, runs the replicas in parallel threads and gathers their outputs on
the first GPU: in training the loss dicts (each term averaged over the chunks, weighted by their
image counts, so it equals the loss of the whole batch), in evaluation the detections
(concatenated in input order).

One process drives every GPU, copies the weights to each of them every step and gathers on GPU
0; that is why DDP (one process per GPU) scales better. On fewer than 2 GPUs it cannot run:
constructing it raises `DataParallelUnavailable` with `explain_unavailable`'s plain explanation.

    model = DetectionDataParallel(build_model(cfg, num_classes))  # every visible GPU
    losses = model(images, targets)                               # same call as the bare model
"""
from __future__ import annotations

import contextlib
import threading
from unittest import mock

import torch
from torch import nn
from torch.nn.parallel import replicate, scatter_gather

from . import wording


class DataParallelUnavailable(RuntimeError):
    """DataParallel needs at least two GPUs; the message says what this machine has."""


def explain_unavailable(n_gpus: int) -> str:
    """Why DataParallel cannot run on a machine with `n_gpus` GPUs, and what it would do on more, in
    the book's language."""
    return wording.say("dataparallel.unavailable", gpus=n_gpus)


class _ChunkOnCpu:
    """`scatter_gather.Scatter` without the copies: each tensor's chunks stay on the CPU."""

    @staticmethod
    def apply(target_gpus, chunk_sizes, dim, tensor):
        return tensor.chunk(len(target_gpus), dim)


def torch_scatter(images: list, targets: list, n_devices: int) -> list[dict]:
    """What `nn.DataParallel` hands each GPU for `model(images, targets)`: torch's own
    `scatter_gather.scatter` run on the CPU (its copy to each GPU replaced by keeping the chunk), so
    it can be shown without GPUs. Per device: each image's shape and each target's box count."""
    with mock.patch.object(scatter_gather, "Scatter", _ChunkOnCpu):
        per_device = scatter_gather.scatter((images, targets), list(range(n_devices)))
    return [{"device": device, "images": len(chunk_images),
             "image shapes": ", ".join("x".join(map(str, image.shape)) for image in chunk_images),
             "boxes per target": [len(target["boxes"]) for target in chunk_targets]}
            for device, (chunk_images, chunk_targets) in enumerate(per_device)]


def split_batch(images: list, targets: list | None, n_chunks: int) -> list[tuple[list, list | None]]:
    """Contiguous chunks of the batch whose sizes differ by at most one (fewer when images < n)."""
    if n_chunks < 1:
        raise ValueError(f"n_chunks must be at least 1, got {n_chunks}")
    if targets is not None and len(targets) != len(images):
        raise ValueError(f"{len(images)} images but {len(targets)} targets: one target dict per image")
    n_chunks = min(n_chunks, len(images))
    base, extra = divmod(len(images), n_chunks)
    chunks, start = [], 0
    for index in range(n_chunks):
        stop = start + base + (1 if index < extra else 0)
        chunks.append((list(images[start:stop]), None if targets is None else list(targets[start:stop])))
        start = stop
    return chunks


def move_to(obj, device: torch.device):
    """`obj` with every tensor inside (lists, tuples, dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {key: move_to(value, device) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to(value, device) for value in obj)
    return obj


def gather_losses(loss_dicts: list[dict], chunk_sizes: list[int], device: torch.device) -> dict:
    """Each loss term averaged over the chunks, weighted by their image counts, on `device`."""
    total = sum(chunk_sizes)
    return {name: sum(losses[name].to(device) * (size / total) for losses, size in zip(loss_dicts, chunk_sizes))
            for name in loss_dicts[0]}


def gather_detections(outputs: list[list[dict]], device: torch.device) -> list[dict]:
    """The chunks' detection lists concatenated in input order, on `device`."""
    return [move_to(detections, device) for chunk in outputs for detections in chunk]


def parallel_forward(replicas: list[nn.Module], inputs: list[tuple], devices: list[torch.device]) -> list:
    """Each replica on its inputs in a thread of its own, under the caller's autocast *and dtype*.

    torch's `parallel_apply` re-enters autocast in its threads with `enabled` only, so bfloat16
    autocast silently became float16 there; this keeps the dtype (and grad mode) of the caller.
    """
    device_type = devices[0].type
    enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    grad_enabled = torch.is_grad_enabled()
    results: list = [None] * len(replicas)
    errors: list[BaseException] = []

    def work(index: int) -> None:
        device = devices[index]
        try:
            with torch.set_grad_enabled(grad_enabled), \
                    (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()), \
                    torch.autocast(device_type, dtype=dtype, enabled=enabled):
                results[index] = replicas[index](*inputs[index])
        except BaseException as err:  # re-raised in the calling thread below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


class DetectionDataParallel(nn.Module):
    """`nn.DataParallel` for models called as `model(images, targets)` with lists (see module doc)."""

    def __init__(self, module: nn.Module, device_ids: list[int] | None = None):
        super().__init__()
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device_ids = list(range(n_gpus)) if device_ids is None else list(device_ids)
        if n_gpus < 2 or len(device_ids) < 2:
            raise DataParallelUnavailable(explain_unavailable(n_gpus))
        self.devices = [torch.device("cuda", index) for index in device_ids]
        self.module = module.to(self.devices[0])

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        chunks = split_batch(images, targets, len(self.devices))
        devices = self.devices[:len(chunks)]
        inputs = [move_to(chunk if targets is not None else (chunk[0],), device)
                  for chunk, device in zip(chunks, devices)]
        replicas = replicate(self.module, devices, not torch.is_grad_enabled())
        outputs = parallel_forward(replicas, inputs, devices)
        if self.training:
            return gather_losses(outputs, [len(chunk[0]) for chunk in chunks], self.devices[0])
        return gather_detections(outputs, self.devices[0])
