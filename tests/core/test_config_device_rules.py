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


def test_bfloat16_on_a_gpu_before_ampere_warns(monkeypatch, caplog, backend_flags):
    """M9: torch emulates bf16 on V100/T4 (`is_bf16_supported` says yes), slower than fp32."""
    from maskrcnn_tut.config import derive
    from maskrcnn_tut.engine import configure_runtime

    capability = {"value": (7, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    cuda = torch.device("cuda", 0)
    bf16 = derive(make_config("cpu-tiny", amp=True, amp_dtype="bfloat16"), 1, cuda)
    configure_runtime(bf16, cuda)
    assert any("bfloat16" in r.getMessage() and "Tesla V100" in r.getMessage() for r in caplog.records)
    caplog.clear()
    configure_runtime(derive(make_config("cpu-tiny", amp=True, amp_dtype="float16"), 1, cuda), cuda)
    capability["value"] = (9, 0)
    configure_runtime(bf16, cuda)
    assert not caplog.records


def test_deterministic_on_a_gpu_says_it_is_best_effort(monkeypatch, caplog, backend_flags):
    """W3: on CUDA `--deterministic` only warns for ops without a deterministic kernel."""
    from maskrcnn_tut.config import derive
    from maskrcnn_tut.engine import configure_runtime

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, warn_only=False: None)
    cuda = torch.device("cuda", 0)
    configure_runtime(derive(make_config("cpu-tiny", deterministic=True), 1, cuda), cuda)
    assert any("best effort" in r.getMessage() for r in caplog.records)


def test_accelerator_cpu_picks_the_cpu_preset_and_compiles_for_the_cpu(monkeypatch):
    """On a GPU machine `--accelerator cpu` without a preset trains cpu-tiny, not gpu-r50 on the CPU,
    and --compile-backbone compiles for the CPU (no CUDA graphs of a model that stays there)."""
    from maskrcnn_tut import model as model_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make_config().preset == "gpu-r50"
    assert make_config(accelerator="cpu").preset == "cpu-tiny"
    assert make_config("gpu-r50", accelerator="cpu").preset == "gpu-r50"  # a preset named stays
    seen = []
    monkeypatch.setattr(model_module, "compile_backbone", lambda model, device_type: seen.append(device_type))
    model_module.build_model(make_config(accelerator="cpu", compile_backbone=True), 4)
    assert seen == ["cpu"]
