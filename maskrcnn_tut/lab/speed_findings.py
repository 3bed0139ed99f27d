"""What the chapters' speed measurements found on this machine, as figures and verdicts.

Each function reads a result the lab measured (a `BenchResult`, a trace summary, two runs) and
returns the figures a chapter quotes with a verdict from `wording`; the chapter keeps only its
sentences. Nothing here measures, so every branch is tested with hand-made rows.

- `loader(sweep)`: DataLoader workers against none (chapter 3).
- `ddp_speedup(speed)`, `own_work(summary)`, `ddp_gap(speed, summary)`: the speed table and the
  DDP trace (chapter 4).
- `against_first(result)`: every measured setting of a sweep against its first row (chapter 5).
- `accumulation(sweep)`: accumulated micro-batches against one large batch (chapter 7).
- `imbalance(imbalanced, balanced)`, `split_batches(...)`: uneven batches per process (chapter 9).
- `fast_path(result)`, `time_to_accuracy(result)`: the fast path's settings (chapter 11).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import wording
from .bench import NO_DIFFERENCE, machine_busy, timing_row, versus
from .wording import FASTER, NO_SPREAD, SLOWER, WITHIN_NOISE, Comparison

#: The loader sweep's verdict when workers gained more than the data share of a step allows.
TOO_LARGE = "too large"


def _measured(result) -> list[dict]:
    return [row for row in result.rows if row.get("img/s")]


# --------------------------------------------------------------------------- chapter 3


def loader(sweep) -> dict:
    """What the loader sweep says about worker processes here.

    `bound`: the share of a step that workers=0 spends waiting for its batch, the most any number
    of workers can save. `best` / `worst`: the fastest and slowest setting with workers, at
    `ratio` / `worst ratio` of workers=0's img/s; `verdict` for the best one, from `wording`
    (without a spread, within `NO_DIFFERENCE` is within noise), or `TOO_LARGE` when it is faster by
    more than `bound` allows (then something else, such as other work on the machine, moved the
    figures). Also what the chapter's answers read: `compute change` (the slowest setting's compute
    per step against workers=0's), `compute_slowed` (that growth beyond the spread), the
    epoch-start waits with and without persistent workers, and the compute trend up to the most
    workers (`trend`: SLOWER when compute grew beyond workers=0's spread, FASTER when it shrank)."""
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
    if verdict == FASTER and found.ratio - 1 > bound + NO_DIFFERENCE:
        verdict = TOO_LARGE
    compute_change = worst["compute ms"] / base["compute ms"] - 1
    restart = {row["knobs"]["persistent_workers"]: row.get("epoch-start data ms") for row in rows
               if row["knobs"]["workers"] == 1}
    most = max(rows, key=lambda row: row["knobs"]["workers"])
    change = most["compute ms"] / base["compute ms"] - 1
    spread = (base["img/s hi"] - base["img/s lo"]) / base["img/s"] if base.get("img/s hi") else NO_DIFFERENCE
    trend = WITHIN_NOISE if abs(change) <= spread else SLOWER if change > 0 else FASTER
    return {"base": base, "best": best, "worst": worst, "ratio": found.ratio,
            "worst ratio": worst["img/s"] / base["img/s"], "bound": bound, "verdict": verdict,
            "compute change": compute_change,
            "compute_slowed": (compute_change > NO_DIFFERENCE and verdict != TOO_LARGE
                               and versus(worst, base) == -1),
            "epoch start ms": (restart.get(False), restart.get(True)) if None not in (restart.get(False),
                                                                               restart.get(True)) else None,
            "most": most, "compute trend": change, "spread": spread, "trend": trend}


# --------------------------------------------------------------------------- chapter 4


def ddp_speedup(speed) -> dict:
    """The speed table's baseline, its DDP row (None with one device) and the row to set beside
    DDP: on CPUs one process with more threads, on GPUs DataParallel (None where neither ran)."""
    rows = _measured(speed)
    base = rows[0]
    more_threads = [row for row in rows if (row.get("threads/process") or 0) > (base.get("threads/process") or 0)]
    other = max(more_threads, key=lambda row: row["threads/process"]) if more_threads else speed.row("DP(")
    return {"base": base, "ddp": speed.row("DDP"), "other": other}


def own_work(summary: dict) -> dict:
    """The ranks' own work under DDP against one process alone, from `traces.DDPTrace.summary()`:
    SLOWER when every DDP step's own work took longer than every lone one's, FASTER for the
    reverse (which only noise can do), WITHIN_NOISE when the ranges overlap; `slowdown` is the
    medians' ratio minus one, `transfer share` the all-reduce's share of a DDP step."""
    alone, shared = summary["own work alone"][0], summary["own work under DDP"][0]
    verdict = {True: SLOWER, False: FASTER, None: WITHIN_NOISE}[summary["slower_under_ddp"]]
    return {"verdict": verdict, "slowdown": shared / alone - 1,
            "transfer share": summary["transfer"][0] / summary["step under DDP"][0]}


def ddp_gap(speed, summary: dict) -> dict | None:
    """DDP against N times one device (None without a DDP row): `devices`, `ideal` (the speedup's
    range against N: FASTER above it, which only noise can do, WITHIN_NOISE when it contains N,
    SLOWER a real gap), `no_faster_without_allreduce` (the row without the all-reduce did not beat
    DDP beyond the spread) and the own-work verdict of `own_work`."""
    ddp = speed.row("DDP")
    if ddp is None:
        return None
    devices = round(ddp["speedup"] / ddp["scaling efficiency"])
    without = next((row for row in _measured(speed) if "without gradient all-reduce" in row["setup"]), None)
    return {"devices": devices, "ideal": wording.compare_to(ddp, float(devices)).verdict,
            "no_faster_without_allreduce": versus(ddp, without) in (0, 1), "own work": own_work(summary)["verdict"]}


def allreduce_cost(speed) -> Comparison | None:
    """DDP against the same processes without the all-reduce (None where the table has no such
    row); rows measured on a busy machine are within noise whatever their spread."""
    ddp, rows = speed.row("DDP"), _measured(speed)
    without = next((row for row in rows if "without gradient all-reduce" in row["setup"]), None)
    if ddp is None or without is None:
        return None
    found = wording.compare(ddp, without)
    return Comparison(found.ratio, WITHIN_NOISE) if machine_busy(speed) and found.verdict != NO_SPREAD else found


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
    """The same images per step split unevenly (the last process gets three halves of a batch, the
    others half) and evenly (differing by at most one image)."""
    uneven = [max(1, per_process // 2)] * (processes - 1) + [3 * per_process // 2]
    total = sum(uneven)
    return uneven, [total // processes + (rank < total % processes) for rank in range(processes)]


def imbalance(imbalanced: dict, balanced: dict) -> dict:
    """Two `proofs.imbalance_run` results: `cost` (the uneven step's time over the even one's, minus
    one), `expected` (the cost if a step grew with the busiest process's images), `forward ratio`
    (slowest over fastest forward) and `verdict`, the even split's speed against the uneven one's:
    FASTER (the imbalance cost speed beyond the spread), WITHIN_NOISE, SLOWER (the uneven split
    came out no slower, which only noise can do) or NO_SPREAD (a rough figure)."""
    cost = imbalanced["step s"] / balanced["step s"] - 1
    runs = [timing_row(run["step s all"]) if run.get("step s all") else None for run in (balanced, imbalanced)]
    verdict = wording.compare(*runs).verdict if all(runs) else NO_SPREAD
    if verdict == NO_SPREAD and cost <= 0:
        verdict = SLOWER  # the uneven split no slower, without a spread: only noise does that
    forward = imbalanced["forward s per rank"]
    return {"cost": cost, "expected": max(imbalanced["batch per rank"]) / max(balanced["batch per rank"]) - 1,
            "forward ratio": max(forward) / min(forward), "warned": bool(imbalanced["warnings"]), "verdict": verdict}


# --------------------------------------------------------------------------- chapter 11


def fast_path(result) -> dict:
    """The fastest measured setting of `bench.sweep_fast_path` against eager (its first row)."""
    eager = result.rows[0]
    best = max(_measured(result), key=lambda row: row["img/s"])
    return {"eager": eager, "best": best, "ratio": best["img/s"] / eager["img/s"]}


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
