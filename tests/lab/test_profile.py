"""bench.profile: the host waits it counts are the ones the device's profiler shows (GPU review M5)."""
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from maskrcnn_tut.lab.bench.profile import sync_points


def test_cpu_waits_are_counted_from_the_operators_that_wait():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        values = torch.arange(6.0)
        values.sum().item()
        values.nonzero()
    assert sync_points(prof.key_averages(), on_cuda=False) == {"aten::_local_scalar_dense": 1, "aten::nonzero": 1}


def test_cuda_waits_are_counted_once_each_from_the_runtime_calls():
    """On CUDA `.item()` shows as an operator and, inside it, as the runtime's stream synchronize; a
    `.cpu()` copy shows only as the latter: counting the runtime calls counts every wait once."""
    events = [SimpleNamespace(key=key, count=count) for key, count in
              [("aten::_local_scalar_dense", 2), ("cudaStreamSynchronize", 5), ("cudaMemcpyAsync", 9),
               ("cudaDeviceSynchronize", 1), ("aten::nonzero", 3)]]
    assert sync_points(events, on_cuda=True) == {"cudaStreamSynchronize": 5, "cudaDeviceSynchronize": 1}
    assert sync_points(events, on_cuda=False) == {"aten::_local_scalar_dense": 2, "aten::nonzero": 3}
