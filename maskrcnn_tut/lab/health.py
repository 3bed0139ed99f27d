"""The article's healthy ranges as plain-language advice on a run's metric rows and GPU samples.

`health_advice(rows, gpus)` reads rows with the keys of `metrics.jsonl` (`monitor.read_jsonl`) and,
where there are GPUs, a `gpus.GPUSampler`; each check says ok, fix (and what to do) or n/a.

Memory is judged by the run's own peak (`max_mem_mb`: on a GPU the caching allocator's
`max_memory_allocated`, on a CPU the process's peak resident memory) against the device. NVML's
"memory used" (what `nvidia-smi` shows) is only reported beside it: it adds the allocator's cache,
the CUDA context and every other process on the GPU, so a healthy run can sit at 95 % of it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .. import distributed as du
from ..hardware import device_memory_mb
from .gpus import GPUSampler, gpu_name

#: The article's healthy ranges (「モニタリングとベンチマーク分析」).
HEALTHY_GPU_UTIL = (70.0, 90.0)


MAX_MEMORY_FRACTION = 0.9


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


@dataclass
class HealthCheck:
    name: str
    ok: bool | None  # None: could not be measured here
    message: str


@dataclass
class HealthReport:
    """The article's three checks as plain-language advice; `ok` is False if any check failed."""

    checks: list[HealthCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok is not False for check in self.checks)

    def __str__(self) -> str:
        marks = {True: "ok  ", False: "FIX ", None: "n/a "}
        return "\n".join(f"{marks[c.ok]} {c.name}: {c.message}" for c in self.checks)

    def _repr_markdown_(self) -> str:
        marks = {True: "**ok**", False: "**fix**", None: "n/a"}
        return "\n".join(f"- {marks[c.ok]} {c.name}: {c.message}" for c in self.checks)


def health_advice(rows: list[dict], gpus: list[dict] | GPUSampler | None = None,
                  total_memory_mb: float | None = None) -> HealthReport:
    """Check metric rows (and GPU samples) against the article's healthy ranges.

    GPU utilization 70-90 %, data time below compute time, the run's peak memory below 90 % of the
    device (the smallest sampled GPU, else `total_memory_mb`, else this process's device).
    """
    if not rows:
        raise ValueError("health_advice needs at least one metric row (train a few steps first)")
    report = HealthReport()
    if isinstance(gpus, GPUSampler):
        unavailable = gpus.reason or "not measured (the sampler has no samples yet)"
        gpus = gpus.summary()
    else:
        unavailable = "not measured (no GPU samples given)"
    low, high = HEALTHY_GPU_UTIL
    if not gpus:
        report.checks.append(HealthCheck("GPU utilization", None, (
            f"{unavailable}. On GPUs, below {low:.0f} % the GPU sits idle between kernels; here the "
            "data-vs-compute check below tells whether the processor waits for data.")))
    for gpu in gpus or []:
        util = gpu["util_mean"]
        if util < low:
            advice = ("the GPU waits: usually for data (raise --workers, keep pin_memory on) or for the "
                      "CPU to launch small kernels (raise --batch-size, or launch fewer with --compile-backbone; "
                      "--amp shortens kernels, so it would leave the GPU idler still)")
        elif util > high:
            advice = ("no idle gaps; utilization counts time with any kernel running, so check SM activity "
                      "(DCGM) or a trace before calling it saturated; then more speed comes from less work per "
                      "image (--amp, --channels-last) or from more GPUs")
        else:
            advice = "few idle gaps between kernels"
        report.checks.append(HealthCheck(f"{gpu_name(gpu)} utilization", util >= low,
                                         f"{util:.0f} % of the time a kernel ran, on average (below {low:.0f} %: "
                                         f"the GPU sits idle between kernels): {advice}."))
    data, compute = _median(rows, "data_time"), statistics.median(r["iter_time"] - r["data_time"] for r in rows)
    if data < compute:
        message = (f"a step waits {data * 1000:.0f} ms for data and computes for {compute * 1000:.0f} ms "
                   f"({100 * data / max(compute, 1e-9):.0f} %): the loader keeps up.")
    else:
        message = (f"a step waits {data * 1000:.0f} ms for data but computes for only {compute * 1000:.0f} ms: "
                   "the processor starves. Raise --workers, keep --persistent-workers, use pin_memory on "
                   "GPUs, or store images smaller / pre-decoded.")
    report.checks.append(HealthCheck("data time < compute time", data < compute, message))
    peak = max(row["max_mem_mb"] for row in rows)
    total = total_memory_mb or (min(g["mem_total_mb"] for g in gpus) if gpus else None) \
        or device_memory_mb(du.info().device)
    used = peak / total if total else None
    kind = "the allocator's peak (max_memory_allocated)" if gpus else "peak"
    seen = f"{kind} {peak:.0f} of {total:.0f} MiB" if total else f"peak {peak:.0f} MiB"
    if gpus:
        fullest = max(gpus, key=lambda g: g["mem_used_max_mb"] / g["mem_total_mb"])
        seen += (f"; nvidia-smi showed {gpu_name(fullest)} at up to {fullest['mem_used_max_mb']:.0f} MiB, which also "
                 "counts the allocator's cache, the CUDA context and other processes: not a figure to judge by")
    name = f"peak memory < {100 * MAX_MEMORY_FRACTION:.0f} %"
    if used is None:
        report.checks.append(HealthCheck(name, None, f"{seen}; the device's total is unknown."))
    elif used < MAX_MEMORY_FRACTION:
        report.checks.append(HealthCheck(name, True, f"{seen} ({used:.0%} by the run's peak): room to spare."))
    else:
        report.checks.append(HealthCheck(name, False, (
            f"{seen} ({used:.0%} by the run's peak): the batch with the largest images may not fit. Lower "
            "--batch-size and add --accum-steps, enable --amp, or lower --max-size.")))
    return report
