"""What the processes' communication costs, measured inside `processes.launch` groups.

One timer, `allreduce_seconds`, times every all-reduce here:

- `allreduce_bandwidth(sizes_mb)`: all-reduce time per message size and the bus bandwidth it
  reached (`projection.bus_bandwidth_gbps`, nccl-tests' definition); `preflight` runs it.
- `allreduce_timing(total_mb, bucket_mbs)`: a model's gradients all-reduced in buckets of each
  size, and compressed to fp16 in the run's buckets (what DDP's fp16 compression hook sends).
- `imbalance_run(batch_sizes)`: DDP steps where the ranks train different batch sizes: each
  rank's own forward time against the step every rank waits through (a straggler's cost).

Each is called as `processes.launch(communication.f, n, ...)` and returns rows on every rank.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from ... import distributed as du
from ...config import make_config
from ...monitor import StragglerCheck
from ..wording import Said, english
from .harness import bench_config, bench_dataset, measure
from .projection import bus_bandwidth_gbps


def collective_device() -> torch.device:
    """Where this process's collectives run: its GPU under nccl, host memory under gloo."""
    info = du.info()
    return info.device if info.backend == "nccl" else torch.device("cpu")


def allreduce_seconds(chunks: Sequence[torch.Tensor], repeats: int = 5) -> list[float]:
    """Seconds to all-reduce every chunk once, `repeats` times, after one round that warms the
    connections up; each round starts on every rank together (a barrier) and ends when the
    device has finished."""
    device = chunks[0].device
    times = []
    for _ in range(repeats + 1):
        du.barrier()
        start = time.perf_counter()
        for chunk in chunks:
            du.all_reduce_sum(chunk)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times[1:]


def allreduce_bandwidth(sizes_mb: tuple[float, ...] = (1.0, 16.0, 64.0), repeats: int = 5) -> list[dict]:
    """Run inside `processes.launch`: per message size, the median time of one all-reduce over
    every process, its range, and the bus bandwidth it reached."""
    info = du.info()
    rows = []
    for size in sizes_mb:
        tensor = torch.zeros(max(1, int(size * 2**20 / 4)), device=collective_device())
        times = allreduce_seconds([tensor], repeats)
        seconds = statistics.median(times)
        rows.append({"MB": size, "processes": info.world_size, "backend": info.backend, "ms": 1000 * seconds,
                     "ms min": 1000 * min(times), "ms max": 1000 * max(times),
                     "bus GB/s": bus_bandwidth_gbps(tensor.numel() * 4, info.world_size, seconds)})
    return rows


def allreduce_timing(total_mb: float, bucket_mbs: Sequence[float], repeats: int = 5,
                     compressed_bucket_mb: float | None = None) -> list[dict]:
    """Run inside `processes.launch`: median time to all-reduce `total_mb` of fp32 gradients in
    buckets of each size, and in `compressed_bucket_mb` buckets (default: the preset's
    bucket_cap_mb) after compressing them to fp16."""
    compressed_bucket_mb = compressed_bucket_mb or make_config().bucket_cap_mb
    gradients = torch.zeros(int(total_mb * 2**20 / 4), device=collective_device())
    rows = []
    for bucket in bucket_mbs:
        chunks = list(gradients.split(max(1, int(bucket * 2**20 / 4))))
        rows.append({"sent as": english("bench.sent_fp32", mb=bucket), "all-reduces": len(chunks),
                     "MB per process": total_mb, "ms": 1000 * statistics.median(allreduce_seconds(chunks, repeats))})
    chunks = list(gradients.half().split(max(1, int(compressed_bucket_mb * 2**20 / 2))))
    rows.append({"sent as": english("bench.sent_fp16", mb=compressed_bucket_mb), "all-reduces": len(chunks),
                 "MB per process": total_mb / 2, "ms": 1000 * statistics.median(allreduce_seconds(chunks, repeats))})
    return rows


def imbalance_run(batch_sizes: Sequence[Sequence[int]], steps: int = 6, warmup: int = 1) -> list[dict]:
    """Run inside `processes.launch`: for each entry of `batch_sizes`, DDP steps where rank r
    trains `entry[r]` images per step.

    Returns, per entry, each rank's median forward time per step (its own work, which no
    collective waits in: what `monitor.StragglerCheck` compares), the median step time (every rank
    waits for the slowest at the all-reduce), all step times, and the check's warnings.
    """
    info = du.info()
    results = []
    for per_rank in batch_sizes:
        check = StragglerCheck(every=warmup + steps)
        forward: list[list[float]] = []
        data = bench_dataset(info.world_size * max(per_rank))  # one dataset, enough for the largest batch
        cfg = bench_config(data_path=str(data), batch_size=per_rank[info.rank])
        measured = measure(cfg, steps=steps, warmup=warmup,
                           callbacks=[check, lambda record: forward.append(record.rank_forward_times)])
        results.append({"batch per rank": list(per_rank),
                        "forward s per rank": [statistics.median(times) for times in zip(*forward)],
                        "step s": statistics.median(measured.iter_times), "step s all": list(measured.iter_times),
                        "warnings": [Said("bench.straggler_warning", found, english=warning)
                                     for found, warning in zip(check.found, check.warnings)]})
    return results
