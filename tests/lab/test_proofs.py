"""proofs: the chapter experiments run their models and inputs on one device.

Chapter 7's DDP check once built its model on the CPU while `engine.train_step` moved the batches
to the worker's device (`cuda:rank` wherever CUDA exists), so it failed on every GPU machine. Without
a GPU the placement is checked on PyTorch's "meta" device, which, like a GPU, is not the CPU.
"""
from __future__ import annotations

import pytest
import torch

from maskrcnn_tut import distributed as du
from maskrcnn_tut.lab import processes, proofs, rig

META = torch.device("meta")


def test_accumulated_gradients_train_on_the_models_device(monkeypatch):
    seen = {}

    def spy_train_step(model, optimizer, scaler, batches, cfg, state, read):
        seen.update(device=cfg.device, params={p.device for p in model.parameters()}, precision=cfg.precision)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        return [None]

    monkeypatch.setattr(rig, "train_step", spy_train_step)
    model = proofs.TinyDetector().to(META)
    grads = proofs.accumulated_gradients(model, proofs.toy_batches(1, 2), 1)
    assert seen == {"device": META, "params": {META}, "precision": "float32"}
    assert {g.device for g in grads.values()} == {META}


class Placed(Exception):
    """Raised by the DDP stand-in once it has seen where the model lives."""


def test_ddp_accumulation_check_puts_the_model_on_the_workers_device(monkeypatch):
    seen = {}

    def spy_ddp(module, device_ids=None, **kwargs):
        seen.update(device=proofs.model_device(module), device_ids=device_ids)
        raise Placed

    monkeypatch.setattr(du, "_INFO", du.DistInfo(rank=0, world_size=2, device=META))
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", spy_ddp)
    with pytest.raises(Placed):
        proofs.ddp_accumulation_check()
    assert seen == {"device": META, "device_ids": None}


def test_accumulation_check_is_exact_on_the_cpu():
    assert proofs.accumulation_check(accum_steps=2, batch_size=2) < 1e-6


def test_demo_processes_need_two_gpus_for_nccl(monkeypatch):
    monkeypatch.setattr(processes, "gpu_count", lambda: 1)
    assert processes.demo_processes() == (2, "gloo")
    monkeypatch.setattr(processes, "gpu_count", lambda: 8)
    assert processes.demo_processes() == (8, None)
