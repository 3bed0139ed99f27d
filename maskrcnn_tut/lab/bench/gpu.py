"""The GPU suite: one bounded run of the speed table, AMP, cudnn.benchmark, channels_last and the fast path with
R50-FPN (gpu-r50) on a GPU machine, written to `book/results/<hardware>-<date>.json`
(`python -m maskrcnn_tut.lab.bench --suite gpu --max-minutes 8`; `load_suite(path)` reads it back)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ...errors import BenchError
from ..machine import provenance
from .results import results_path
from .scaling import table
from .sweeps import sweep_amp, sweep_channels_last, sweep_cudnn, sweep_fast_path

#: (name, share of the time budget, settings measured) of the GPU suite, in running order.
GPU_SUITE_PARTS = [("table", 0.3, 3), ("amp", 0.15, 3), ("cudnn", 0.2, 4), ("channels_last", 0.1, 2),
                   ("fast_path", 0.25, 5)]
#: Seconds a part needs besides its measured steps: process start, CUDA init, model build, warm-up.
STARTUP_S = 30
RUNNERS = {"table": table, "amp": sweep_amp, "cudnn": sweep_cudnn, "channels_last": sweep_channels_last,
           "fast_path": sweep_fast_path}


def gpu_suite(max_minutes: float = 8.0, results_dir: Path | str = "book/results", steps: int = 20,
              warmup: int = 5) -> Path:
    """One bounded run on a GPU machine: the table on every GPU, AMP fp32/fp16/bf16, cudnn.benchmark,
    channels_last and the fast path's levers, R50-FPN (gpu-r50) at 800 px; writes `<results_dir>/<hardware>-<date>.json`.
    A part that fails is recorded with its error, and the others still run."""
    if not torch.cuda.is_available():
        raise BenchError("--suite gpu needs CUDA GPUs and this machine has none; on a CPU run "
                         "`python -m maskrcnn_tut.lab.bench table` (and the sweeps) instead")
    deadline = time.monotonic() + 60 * max_minutes
    results, skipped = {}, []
    for name, share, n_settings in GPU_SUITE_PARTS:
        budget = min(share * 60 * max_minutes, deadline - time.monotonic())
        if budget < 2 * STARTUP_S:
            skipped.append(name)
            continue
        per_setting = max((budget - STARTUP_S * (3 if name == "table" else 1)) / n_settings, 5.0)
        try:
            results[name] = RUNNERS[name]("gpu-r50", steps=steps, warmup=warmup, max_seconds=per_setting).to_dict()
        except Exception as err:  # keep what the other parts measured; record what failed
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    prov = provenance(f"python -m maskrcnn_tut.lab.bench --suite gpu --max-minutes {max_minutes:g}")
    prov["skipped_for_time"] = skipped
    path = results_path(results_dir, prov)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"provenance": prov, "results": results}, indent=2) + "\n")
    return path
