"""What a training step spends its host time on, from `torch.profiler`: the part the fast path
cannot compile away (`what_remains`).

One eager `engine.train_step` on the bench's shapes batches runs under the profiler after a few
warm-up steps; its operators are grouped by the part of Mask R-CNN they belong to (torchvision's
modules are marked with `record_function` here: backbone + FPN, RPN, RoI heads, post-processing)
and the host synchronizations are counted: every `.item()`, `.tolist()` or data-dependent shape
(`nonzero`, NMS) makes the CPU wait for the device, which is what keeps a CUDA graph from
covering the RPN's proposal selection and the RoI heads.
"""
from __future__ import annotations

import dataclasses

from torch.profiler import ProfilerActivity, profile, record_function

from ... import distributed as du
from ..rig import build_rig
from .harness import bench_config

#: Operators that make the host wait for the device (a sync point inside a step).
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "torchvision::nms")  # .item() ends in the first
#: On CUDA every wait, those operators' and any other's (a `.cpu()` copy, an explicit synchronize), ends in
#: one of these runtime calls, so they alone count the waits there, each once.
CUDA_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
PARTS = {"backbone + FPN": "backbone", "RPN (anchors, proposals, NMS)": "rpn", "RoI heads (box + mask)": "roi_heads"}


def _mark_parts(model) -> list:
    """Wrap each part's forward in a `record_function` range named after it; returns the handles."""
    handles = []
    for label, attribute in PARTS.items():
        module = getattr(model, attribute)
        ranges: list = []

        def enter(_module, _args, label=label, ranges=ranges):
            ranges.append(record_function(label))
            ranges[-1].__enter__()

        def leave(_module, _args, _output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def sync_points(events, on_cuda: bool) -> dict[str, int]:
    """How often the host waited for the device, by the profiler event that shows the wait."""
    names = CUDA_WAITS if on_cuda else SYNC_OPS
    return {e.key: e.count for e in events if e.key in names}


def what_remains(preset: str | None = None, warmup: int = 2, **overrides) -> dict:
    """Profile one eager training step: host time per model part, the top operators, sync points."""
    du.init_distributed()  # this process's device: its GPU where there is one
    rig = build_rig(dataclasses.replace(bench_config(preset, **overrides), skip_nonfinite=warmup + 1))
    cfg, device, model = rig.cfg, rig.device, rig.module
    for _ in range(warmup):
        rig.step()
    handles = _mark_parts(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            rig.step()
    finally:
        for handle in handles:
            handle.remove()
    events = prof.key_averages()
    step_ms = max(e.cpu_time_total for e in events) / 1000
    parts = [{"part": label, "host ms": e.cpu_time_total / 1000, "calls": e.count}
             for label in PARTS for e in events if e.key == label]
    operators = sorted((e for e in events if e.key.startswith(("aten::", "torchvision::"))),
                       key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [{"operator": e.key, "calls": e.count, "self host ms": e.self_cpu_time_total / 1000} for e in operators[:10]]
    syncs = sync_points(events, on_cuda=device.type == "cuda")
    return {"step host ms": step_ms, "parts": parts, "top operators": top, "sync points": syncs,
            "operator calls": sum(e.count for e in operators), "preset": cfg.preset, "device": str(device)}
