"""`validate` refuses the combinations that crash on GPUs (and on gloo) before any heavy work."""
from __future__ import annotations

import pytest
import torch

from maskrcnn_tut.config import make_config, validate
from maskrcnn_tut.errors import ConfigError


def test_static_graph_with_accumulation_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="--static-graph.*--accum-steps 2") as caught:
        validate(make_config("cpu-tiny", static_graph=True, accum_steps=2), cuda_available=False)
    assert "\n" not in str(caught.value)
    validate(make_config("cpu-tiny", static_graph=True), cuda_available=False)
    validate(make_config("cpu-tiny", accum_steps=2), cuda_available=False)


def test_accelerator_cpu_counts_as_no_gpu_for_the_gpu_only_settings(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="--dist-backend nccl needs CUDA"):
        validate(make_config("cpu-tiny", accelerator="cpu", dist_backend="nccl"), cuda_available=True)
    validate(make_config("cpu-tiny", dist_backend="nccl"), cuda_available=True)
