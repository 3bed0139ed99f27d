"""The article's healthy ranges as plain-language advice on a run's metric rows and GPU samples.

`health_advice(rows, gpus)` reads rows with the keys of `metrics.jsonl` (`monitor.read_jsonl`) and,
where there are GPUs, a `nvml.GPUSampler`; each check says ok, fix (and what to do) or n/a.

Memory is judged by the run's own peak (`max_mem_mb`: on a GPU the caching allocator's
`max_memory_allocated`, on a CPU the process's peak resident memory) against the device. NVML's
"memory used" (what `nvidia-smi` shows) is only reported beside it: it adds the allocator's cache,
the CUDA context and every other process on the GPU, so a healthy run can sit at 95 % of it.

The advice is worded from `prose/health.json` in the book's language (`wording.say`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .. import distributed as du
from . import wording
from .device_memory import device_memory_mb
from .nvml import GPUSampler, gpu_name
from .wording import say

#: The article's healthy ranges (「モニタリングとベンチマーク分析」).
HEALTHY_GPU_UTIL = (70.0, 90.0)


MAX_MEMORY_FRACTION = 0.9

#: The share of a step spent waiting for its batch above which the loader is said not to keep up. The
#: article's criterion, data time below compute time, passes a step that idles for up to half its time;
#: any wait is time the processor does nothing, and a loader that kept up could make such a step up to
#: 1 / (1 - share) times as fast (chapter 3's ceiling): above a tenth, more than 1.11x.
DATA_WAIT_LIMIT = 0.10


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
        marks = {True: "ok", False: "FIX", None: "n/a"}
        named = wording.MESSAGES[wording.language()]["named"]  # "name: text", in Japanese with a full-width colon
        return "\n".join(f"{wording.term(marks[c.ok]):<4} " + named.format(name=c.name, text=c.message)
                         for c in self.checks)

    def _repr_markdown_(self) -> str:
        marks = {True: f"**{wording.term('ok')}**", False: f"**{wording.term('fix')}**", None: wording.term("n/a")}
        named = wording.MESSAGES[wording.language()]["named"]
        return "\n".join(f"- {marks[c.ok]} " + named.format(name=c.name, text=c.message) for c in self.checks)


def health_advice(rows: list[dict], gpus: list[dict] | GPUSampler | None = None,
                  total_memory_mb: float | None = None) -> HealthReport:
    """Check metric rows (and GPU samples) against the article's healthy ranges.

    GPU utilization 70-90 %, the share of a step spent waiting for data (data / (data + compute), the
    median over the rows) at most `DATA_WAIT_LIMIT` (the article asked only that data time stay below
    compute time), the run's peak memory below 90 % of the device (the smallest sampled GPU, else
    `total_memory_mb`, else this process's device).
    """
    if not rows:
        raise ValueError("health_advice needs at least one metric row (train a few steps first)")
    report = HealthReport()
    if isinstance(gpus, GPUSampler):
        unavailable = gpus.reason or say("health.no_samples_yet")
        gpus = gpus.summary()
    else:
        unavailable = say("health.no_samples_given")
    low, high = HEALTHY_GPU_UTIL
    if not gpus:
        report.checks.append(HealthCheck(wording.term("GPU utilization"), None,
                                         say("health.gpu_unmeasured", unavailable=unavailable, low=low)))
    for gpu in gpus or []:
        util = gpu["util_mean"]
        advice = say("health.gpu_waits" if util < low else "health.gpu_busy" if util > high else "health.gpu_few_gaps")
        report.checks.append(HealthCheck(say("health.gpu_name", gpu=gpu_name(gpu)), util >= low,
                                         say("health.gpu_util", util=util, low=low, advice=advice)))
    data, compute = _median(rows, "data_time"), statistics.median(r["iter_time"] - r["data_time"] for r in rows)
    share = statistics.median(r["data_time"] / r["iter_time"] if r["iter_time"] > 0 else 0.0 for r in rows)
    keeps_up = share <= DATA_WAIT_LIMIT
    message = say("health.data_keeps_up" if keeps_up else "health.data_starves", data=data * 1000,
                  compute=compute * 1000, share=100 * share, limit=100 * DATA_WAIT_LIMIT,
                  ceiling=1 / max(1 - share, 1e-9))
    report.checks.append(HealthCheck(say("health.data_name", limit=100 * DATA_WAIT_LIMIT), keeps_up, message))
    peak = max(row["max_mem_mb"] for row in rows)
    total = total_memory_mb or (min(g["mem_total_mb"] for g in gpus) if gpus else None) \
        or device_memory_mb(du.info().device)
    used = peak / total if total else None
    kind = say("health.allocator_peak" if gpus else "health.peak")
    seen = say("health.seen", kind=kind, peak=peak, total=total) if total else say("health.seen_no_total", peak=peak)
    if gpus:
        fullest = max(gpus, key=lambda g: g["mem_used_max_mb"] / g["mem_total_mb"])
        seen += say("health.nvidia_smi", gpu=gpu_name(fullest), mib=fullest["mem_used_max_mb"])
    name = say("health.memory_name", share=100 * MAX_MEMORY_FRACTION)
    if used is None:
        report.checks.append(HealthCheck(name, None, say("health.memory_total_unknown", seen=seen)))
    else:
        fits = used < MAX_MEMORY_FRACTION
        report.checks.append(HealthCheck(name, fits, say("health.memory_room" if fits else "health.memory_full", seen=seen,
                                                          used=used)))
    return report


