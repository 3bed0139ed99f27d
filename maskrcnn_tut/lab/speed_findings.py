"""What the chapters' speed measurements found on this machine, as figures and verdicts.

Each function reads a result the lab measured (a `BenchResult`, a trace summary, two runs) and
returns the figures a chapter quotes with a verdict from `wording`; the chapter keeps only its
sentences. Nothing here measures, so every branch is tested with hand-made rows.

- `loader(sweep)`: DataLoader workers against none (chapter 3).
- `workers_alone(after, before)`: the workers' CPU per image, and the training process's, against earlier code (chapter 3).
- `own_work(summary)`: the DDP trace's ranks against one process alone (chapter 4).
- `against_first(result)`: every measured setting of a sweep against its first row (chapter 5).
- `cudnn(sweep)`: fixed against varying image sizes, and cudnn.benchmark on against off (chapter 6);
  `fastest(rows)`: the row ahead of all others, if one is.
- `accumulation(sweep)`: accumulated micro-batches against one large batch (chapter 7).
- `imbalance(imbalanced, balanced)`, `split_batches(...)`: uneven batches per process (chapter 9).
- `fast_path(result)`, `time_to_accuracy(result)`: the fast path's settings (chapter 11).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from . import wording
from .bench import NO_DIFFERENCE, versus
from .stored.across_builds import machine_busy, timing_row
from .wording import FASTER, NO_SPREAD, SLOWER, WITHIN_NOISE, Comparison

#: The loader sweep's verdict when workers gained more than the data share of a step allows.
TOO_LARGE = "too large"


def _measured(result) -> list[dict]:
    return [row for row in result.rows if row.get("img/s")]


# --------------------------------------------------------------------------- chapter 3


def loader(sweep) -> dict:
    """What the loader sweep says about worker processes here.

    `bound`: the share of a step that workers=0 spends waiting for its batch; `ceiling`: the most
    that workers can multiply img/s by, 1 / (1 - bound), when they hide all of that wait (a gain of
    bound / (1 - bound), not of bound: at a 40 % share, 1.67x). `best` / `worst`: the fastest and
    slowest setting with workers, at `ratio` / `worst ratio` of workers=0's img/s; `verdict` for the
    best one, from `wording` (without a spread, within `NO_DIFFERENCE` is within noise), or
    `TOO_LARGE` when its ratio exceeds `ceiling` by more than `NO_DIFFERENCE` (then something else,
    such as other work on the machine, moved the figures). Also what the chapter's answers read:
    `compute change` (the slowest setting's compute per step against workers=0's), `compute_slowed`
    (that growth beyond the spread), the epoch-start waits with and without persistent workers, and
    the compute trend up to the most workers (`trend`: SLOWER when compute grew beyond workers=0's
    spread, FASTER when it shrank)."""
    rows = _measured(sweep)
    base = next(row for row in rows if row["knobs"]["workers"] == 0)
    with_workers = [row for row in rows if row["knobs"]["workers"] > 0]
    best = max(with_workers, key=lambda row: row["img/s"])
    worst = min(with_workers, key=lambda row: row["img/s"])
    found = wording.compare(best, base)
    verdict = found.verdict
    if verdict == NO_SPREAD:
        verdict = wording.compare_figures(best["img/s"], base["img/s"], NO_DIFFERENCE).verdict
    bound = base["data ms"] / (base["data ms"] + base["compute ms"])
    ceiling = 1 / (1 - bound)
    if verdict == FASTER and found.ratio > ceiling + NO_DIFFERENCE:
        verdict = TOO_LARGE
    compute_change = worst["compute ms"] / base["compute ms"] - 1
    restart = {row["knobs"]["persistent_workers"]: row.get("epoch-start data ms") for row in rows
               if row["knobs"]["workers"] == 1}
    most = max(rows, key=lambda row: row["knobs"]["workers"])
    change = most["compute ms"] / base["compute ms"] - 1
    spread = (base["img/s hi"] - base["img/s lo"]) / base["img/s"] if base.get("img/s hi") else NO_DIFFERENCE
    trend = WITHIN_NOISE if abs(change) <= spread else SLOWER if change > 0 else FASTER
    return {"base": base, "best": best, "worst": worst, "ratio": found.ratio,
            "worst ratio": worst["img/s"] / base["img/s"], "bound": bound, "ceiling": ceiling, "verdict": verdict,
            "compute change": compute_change,
            "compute_slowed": (compute_change > NO_DIFFERENCE and verdict != TOO_LARGE
                               and versus(worst, base) == -1),
            "epoch start ms": (restart.get(False), restart.get(True)) if None not in (restart.get(False),
                                                                               restart.get(True)) else None,
            "most": most, "compute trend": change, "spread": spread, "trend": trend}


def workers_alone(after, before) -> dict:
    """Two `bench workers` results (repeats of the workers alone): the medians per image of the workers'
    CPU and the training process's (receiving), and `lighter`: which of them ("both", "workers", "main" or
    "neither") used less in every repeat after than in every repeat before (medians of a few noisy repeats
    can differ by chance)."""
    found, lower = {"repeats": len(after.rows)}, []
    for key, name in (("worker cpu ms/image", "workers"), ("main cpu ms/image", "main")):
        now, then = [row[key] for row in after.rows], [row[key] for row in before.rows]
        found[f"{name} after"], found[f"{name} before"] = statistics.median(now), statistics.median(then)
        lower += [name] if max(now) < min(then) else []
    found["lighter"] = "both" if len(lower) == 2 else lower[0] if lower else "neither"
    return found


def pooled_pairs(results, resamples: int = 4000) -> dict | None:
    """The (loop / bare step) ratios of every `bench pipeline` result that kept its pairs, pooled: runs of
    a few pairs each differ by more than their own spread says, and the pooled median with a bootstrap 95 %
    interval (a fixed seed: the same files give the same interval) is what they support together; in %."""
    kept = [result.rows[0]["pair ratios"] for result in results if result.rows[0].get("pair ratios")]
    pairs = [ratio for ratios in kept for ratio in ratios]
    if not pairs:
        return None
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(pairs, k=len(pairs))) for _ in range(resamples))
    return {"runs": len(kept), "pairs": len(pairs), "median %": 100 * (statistics.median(pairs) - 1),
            "lo %": 100 * (medians[int(0.025 * resamples)] - 1), "hi %": 100 * (medians[int(0.975 * resamples)] - 1)}


# --------------------------------------------------------------------------- chapter 4


def own_work(summary: dict) -> dict:
    """The ranks' own work under DDP against one process alone, from `traces.DDPTrace.summary()`:
    SLOWER when every DDP step's own work took longer than every lone one's, FASTER for the
    reverse (which only noise can do), WITHIN_NOISE when the ranges overlap; `slowdown` is the
    medians' ratio minus one, `transfer share` the all-reduce's share of a DDP step."""
    alone, shared = summary["own work alone"][0], summary["own work under DDP"][0]
    verdict = {True: SLOWER, False: FASTER, None: WITHIN_NOISE}[summary["slower_under_ddp"]]
    return {"verdict": verdict, "slowdown": shared / alone - 1,
            "transfer share": summary["transfer"][0] / summary["step under DDP"][0]}


def allreduce_cost(speed) -> Comparison | None:
    """DDP against the same processes without the all-reduce (None where the table has no such
    row); rows measured on a busy machine are within noise whatever their spread."""
    ddp, rows = speed.row("DDP"), _measured(speed)
    without = next((row for row in rows if "without gradient all-reduce" in row["setup"]), None)
    if ddp is None or without is None:
        return None
    found = wording.compare(ddp, without)
    return Comparison(found.ratio, WITHIN_NOISE) if machine_busy(speed) and found.verdict != NO_SPREAD else found


# --------------------------------------------------------------------------- chapter 6


def cudnn(sweep) -> dict:
    """The cuDNN sweep: the best `fixed` and `varying` setting counting every step, `comparison`
    (fixed against varying, at the median step, from `wording`), and on GPUs `benchmark`: for
    "fixed" and "varying", `cudnn.benchmark=True` against False at the median step (autotuning
    done; from the ranges) and over every step (autotuning included; within `NO_DIFFERENCE` is
    within noise). `benchmark` is None on a CPU, where the sweep has no such rows."""
    rows = _measured(sweep)
    kinds = {kind: [row for row in rows if row["knobs"]["shape"] == kind] for kind in ("fixed", "varying")}
    best = {kind: max(found, key=lambda row: row["img/s all steps"]) for kind, found in kinds.items()}
    benchmark = {}
    for kind, found in kinds.items():
        flags = {row["knobs"]["cudnn_benchmark"]: row for row in found}
        if True in flags and False in flags:
            on, off = flags[True], flags[False]
            median = wording.compare(on, off).verdict
            if median == NO_SPREAD:
                median = wording.compare_figures(on["img/s"], off["img/s"], NO_DIFFERENCE).verdict
            benchmark[kind] = (median, wording.compare_figures(on["img/s all steps"], off["img/s all steps"],
                                                               NO_DIFFERENCE).verdict)
    return {"fixed": best["fixed"], "varying": best["varying"],
            "comparison": wording.compare(best["fixed"], best["varying"]), "benchmark": benchmark or None}


def fastest(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """(the row faster than every other at the median step, i.e. whose img/s range lies above all the others',
    the row ahead of every other by more than `NO_DIFFERENCE` counting every step); None where no row is."""
    def ahead(row, apart) -> bool:
        return all(apart(row, other) for other in rows if other is not row)
    median = [row for row in rows if ahead(row, lambda a, b: wording.compare(a, b).verdict == FASTER)]
    every = [row for row in rows if ahead(row, lambda a, b: wording.compare_figures(
        a["img/s all steps"], b["img/s all steps"], NO_DIFFERENCE).verdict == FASTER)]
    return (median[0] if median else None), (every[0] if every else None)


# --------------------------------------------------------------------------- chapters 5 and 7


def against_first(result) -> list[tuple[dict, Comparison]]:
    """Every measured row after the first, compared with the first (fp32 in the precision sweep)."""
    first, *others = _measured(result)
    return [(row, wording.compare(row, first)) for row in others]


def accumulation(sweep) -> dict | None:
    """The accumulation sweep's K micro-batches of m against one batch of K*m and one of m; None
    when the sweep has no accumulated setting. `comparison`: accumulated against the large batch."""
    if sweep is None:
        return None
    rows = {(row["knobs"]["batch_size"], row["knobs"]["accum_steps"]): row for row in _measured(sweep)}
    k = max(accum for _, accum in rows)
    micro = min(batch for batch, _ in rows)
    if k == 1 or (micro, k) not in rows or (k * micro, 1) not in rows:
        return None
    accumulated, large = rows[(micro, k)], rows[(k * micro, 1)]
    return {"k": k, "micro": micro, "accumulated": accumulated, "large": large, "single": rows[(micro, 1)],
            "comparison": wording.compare(accumulated, large)}


# --------------------------------------------------------------------------- chapter 9


def split_batches(per_process: int, processes: int) -> tuple[list[int], list[int]]:
    """The same images per step split unevenly and evenly. Even: every process gets `per_process`
    (at least 2), exactly equal on any process count; uneven: the others get half of that and the
    last process the rest, so both splits hold the same total."""
    even = [max(2, per_process)] * processes
    low = even[0] // 2
    return [low] * (processes - 1) + [sum(even) - low * (processes - 1)], even


def imbalance(imbalanced: dict, balanced: dict) -> dict:
    """Two `proofs.imbalance_run` results: `cost` (the uneven step's time over the even one's, minus
    one), `expected` (the cost if a step grew with the busiest process's images), `forward ratio`
    (slowest over fastest forward), whether StragglerCheck warned in each run (`warned`, `balanced
    warned`) and `verdict`, the even split's speed against the uneven one's: FASTER (the imbalance
    cost speed beyond the spread), WITHIN_NOISE, SLOWER (the uneven split came out no slower, which
    only noise can do) or NO_SPREAD (a rough figure)."""
    cost = imbalanced["step s"] / balanced["step s"] - 1
    runs = [timing_row(run["step s all"]) if run.get("step s all") else None for run in (balanced, imbalanced)]
    verdict = wording.compare(*runs).verdict if all(runs) else NO_SPREAD
    if verdict == NO_SPREAD and cost <= 0:
        verdict = SLOWER  # the uneven split no slower, without a spread: only noise does that
    forward = imbalanced["forward s per rank"]
    return {"cost": cost, "expected": max(imbalanced["batch per rank"]) / max(balanced["batch per rank"]) - 1,
            "forward ratio": max(forward) / min(forward), "warned": bool(imbalanced["warnings"]),
            "balanced warned": bool(balanced["warnings"]), "verdict": verdict}


# --------------------------------------------------------------------------- chapter 11


def fast_path(result) -> dict:
    """The fastest measured setting of `bench.sweep_fast_path` against eager (its first row), with
    `comparison` from `wording` (without a spread, within `NO_DIFFERENCE` is within noise)."""
    eager = result.rows[0]
    best = max(_measured(result), key=lambda row: row["img/s"])
    found = wording.compare(best, eager)
    if found.verdict == NO_SPREAD:
        found = wording.compare_figures(best["img/s"], eager["img/s"], NO_DIFFERENCE)
    return {"eager": eager, "best": best, "ratio": found.ratio, "comparison": found}


@dataclass(frozen=True)
class Variant:
    """One time-to-accuracy run: the step it reached the target at (None: never), training and
    compiling seconds, and its time as a share of eager's with and without the compiling."""
    name: str
    step: int | None
    seconds: float | None
    compiling: float
    ratio: float | None
    ratio_without_compiling: float | None


def time_to_accuracy(result) -> dict:
    """`bench.time_to_accuracy`'s runs: `eager` and the other `variants` as `Variant`s, and
    `same_step` (every run reached the target at the same evaluation)."""
    key = f"first eval with {result.provenance['metric']} >= {result.provenance['target']}"
    eager_seconds = result.rows[0]["training s to it"] or None

    def variant(row: dict) -> Variant:
        seconds = row["training s to it"] or None
        compiling = row.get("of it compiling s") or 0.0
        ratio = seconds / eager_seconds if seconds and eager_seconds else None
        without = (seconds - compiling) / eager_seconds if ratio and compiling else None
        return Variant(row.get("variant", "eager"), row[key] if seconds else None, seconds, compiling, ratio, without)

    eager, *variants = [variant(row) for row in result.rows]
    return {"eager": eager, "variants": variants, "same_step": len({row[key] for row in result.rows}) == 1}
