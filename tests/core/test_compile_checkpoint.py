"""`--compile-backbone` compiles in place: a compiled model's state dict keeps the plain keys, so its
checkpoints load into an uncompiled model (`--test-only`, `--weights`, a resume without the flag);
with CUDA graphs every model call starts one CUDA-graph step shared by the backbone and RPN head."""
from __future__ import annotations

import torch
from compiled import compilations

from maskrcnn_tut import model as model_module
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.model import build_model, compile_backbone


def _model():
    torch.manual_seed(0)
    return build_model(derive(make_config("cpu-tiny", min_size=96, max_size=128), 1, "cpu"), 4).eval()


def test_a_compiled_models_state_dict_loads_into_an_uncompiled_one():
    compiled = _model()
    compile_backbone(compiled, "cpu", backend="eager")
    before = compilations()
    with torch.inference_mode():
        compiled([torch.rand(3, 96, 128)])
    assert compilations() > before  # it did run compiled
    state = compiled.state_dict()
    assert not [key for key in state if "_orig_mod" in key]
    plain = build_model(derive(make_config("cpu-tiny", min_size=96, max_size=128), 1, "cpu"), 4)
    assert plain.load_state_dict(state, strict=True)
    assert state.keys() == _model().state_dict().keys()


def test_cuda_graphs_begin_one_step_per_model_call(monkeypatch):
    steps = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append("step"))
    model = _model()
    compile_backbone(model, "cuda", backend="inductor")  # compiles lazily: nothing runs on CUDA here
    hooks = list(model._forward_pre_hooks.values())
    assert hooks == [model_module._begin_cuda_graph_step]
    hooks[0](model, ())
    assert steps == ["step"]
    eager_graphs = _model()
    compile_backbone(eager_graphs, "cpu", backend="inductor")
    assert not eager_graphs._forward_pre_hooks  # no CUDA graphs, nothing to mark
