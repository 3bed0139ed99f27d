"""The device's memory as the lab's measurements read it: on a GPU the CUDA allocator's figures, on a
CPU this process's resident set (Linux's /proc).

- `current_memory_mb(device)`, `device_memory_mb(device)`: memory in use now; the device's total.
- `reset_peak_memory(device)`: start a new peak (the core's `hardware.peak_memory_mb` reads it).
- `releases_gpu_cache(measure)`: a measurement that hands its GPU memory back when it returns.
"""
from __future__ import annotations

import functools
import gc
from pathlib import Path

import torch

from ..hardware import proc_status_kib, ram_gb


def current_memory_mb(device: torch.device) -> float:
    """Memory in use now: CUDA tensors on the GPU, else this process's resident set size (MiB)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    rss = proc_status_kib("VmRSS")
    if rss is None:
        raise RuntimeError("current_memory_mb needs Linux's /proc/self/status on a CPU")
    return rss / 1024


def device_memory_mb(device: torch.device) -> float | None:
    """Memory of the device: the GPU's total, or the machine's physical RAM (MiB)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    total = ram_gb()
    return total * 1024 if total else None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's peak, or this process's resident high-water mark.

    On CPU, freed heap memory is first handed back to the OS (glibc `malloc_trim`) and Linux's
    VmHWM is reset through /proc/self/clear_refs; where either is missing the peak keeps counting
    from the process start.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def releases_gpu_cache(measure):
    """For measurements that run on the notebook's own GPU: once they return, their models and batches
    are gone and the caching allocator gives their memory back, so the processes a chapter starts
    next on that GPU have it (gigabytes at R50 and 1024 px, much of a hub's 24 GB card)."""
    @functools.wraps(measure)
    def measured(*args, **kwargs):
        try:
            return measure(*args, **kwargs)
        finally:
            if torch.cuda.is_initialized():
                gc.collect()
                torch.cuda.empty_cache()
    return measured
