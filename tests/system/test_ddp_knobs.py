"""wrap_ddp passes the config's DDP knobs through, and an unused parameter gives a clear error.

Two gloo processes started by `processes.launch` (the worker functions are importable by the
spawned children because pytest puts tests/ on sys.path).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from maskrcnn_tut import distributed as du
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.engine import TrainState, build_optimizer, make_scaler, train_step
from maskrcnn_tut.errors import UnusedParametersError
from maskrcnn_tut.hardware import ddp_syncs_buffers
from maskrcnn_tut.lab import processes
from maskrcnn_tut.lab.proofs import TinyDetector, toy_batches

pytestmark = pytest.mark.system

DEFAULTS: dict = {}
CHANGED = dict(bucket_cap_mb=1.5, gradient_as_bucket_view=False, static_graph=True, broadcast_buffers=False,
               find_unused_parameters=True)


class DetectorWithUnusedLayer(TinyDetector):
    """TinyDetector plus a layer its forward never calls: its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(2, 2)


def ddp_attributes(settings: list[dict]) -> list[dict]:
    """What DDP holds after `wrap_ddp` for each settings dict (plus the comm hook, if one is set)."""
    seen = []
    for overrides in settings:
        ddp = du.wrap_ddp(TinyDetector(), make_config("cpu-tiny", **overrides), du.info())
        seen.append({"bucket_cap_mb": ddp.bucket_bytes_cap / 2**20,
                     "gradient_as_bucket_view": ddp.gradient_as_bucket_view, "static_graph": ddp.static_graph,
                     "broadcast_buffers": ddp_syncs_buffers(ddp),
                     "find_unused_parameters": ddp.find_unused_parameters,
                     "comm_hooks": [hook.__name__ for hook, _ in ddp._comm_hooks]})
    return seen


def train_with_unused_layer(find_unused_parameters: bool) -> str:
    """Three engine steps of a DDP model with an unused layer: 'trained' or the error's message."""
    cfg = derive(make_config("cpu-tiny", find_unused_parameters=find_unused_parameters, optimizer="sgd", lr=0.01),
                 du.info().world_size, "cpu")
    torch.manual_seed(0)
    model = du.wrap_ddp(DetectorWithUnusedLayer(), cfg, du.info())
    optimizer = build_optimizer(model, cfg)
    device = torch.device("cpu")
    batches, state = iter(toy_batches(3, 2, seed=du.info().rank)), TrainState()
    try:
        for _ in range(3):
            train_step(model, optimizer, make_scaler(cfg, device), batches, cfg, state)
    except UnusedParametersError as err:
        return f"UnusedParametersError: {err}"
    return "trained"


def unused_layer_both_ways() -> list[str]:
    return [train_with_unused_layer(False), train_with_unused_layer(True)]


def test_config_knobs_reach_ddp():
    default, changed, compressed = processes.launch(
        ddp_attributes, 2, [DEFAULTS, CHANGED, {"grad_compression": "fp16"}])
    cfg = make_config("cpu-tiny")
    assert default == {"bucket_cap_mb": cfg.bucket_cap_mb, "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
                       "static_graph": cfg.static_graph, "broadcast_buffers": cfg.broadcast_buffers,
                       "find_unused_parameters": cfg.find_unused_parameters, "comm_hooks": []}
    assert changed == {**CHANGED, "comm_hooks": []}
    # config.validate refuses compression without CUDA; wrap_ddp itself registers the hook
    assert compressed["comm_hooks"] == ["fp16_compress_hook"]


def test_unused_parameter_gives_the_flag_to_use():
    without_flag, with_flag = processes.launch(unused_layer_both_ways, 2)
    assert without_flag.startswith("UnusedParametersError") and "--find-unused-parameters" in without_flag
    assert with_flag == "trained"
