"""The GPU suite: one bounded run of the speed table, AMP, cudnn.benchmark, channels_last and the fast path with
R50-FPN (gpu-r50) on a GPU machine, written to `book/results/<hardware>-<date>.json` after every part, so a run
cut short keeps what it measured (`python -m maskrcnn_tut.lab.bench --suite gpu --max-minutes 8`;
`load_suite(path)` reads it back).

The budget: every part first gets its minimum (a start-up per worker launch, a few seconds per setting),
then a share of what is left; the compiled fast-path rows come last and only with `COMPILED_LEFT_S` left
for their cold compiles. Each part is bounded by the launcher's timeout (`harness.launch_deadline`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ...errors import BenchError
from ..provenance import provenance
from ..stored.result import results_path
from .harness import launch_deadline
from .scaling import table
from .sweeps import sweep_amp, sweep_channels_last, sweep_cudnn, sweep_fast_path

#: Seconds a worker launch needs besides its measured steps: process start, CUDA init, model build.
STARTUP_S = 30
#: Seconds a setting needs at least: its warm-up steps (WARMUP_S) and three measured steps.
WARMUP_S = 4
SETTING_S = 8
#: The compiled fast-path rows run only with this much of the budget left (two cold R50-FPN compiles).
COMPILED_LEFT_S = 240


@dataclass(frozen=True)
class Part:
    """One measurement of the suite: its runner, how many worker launches and settings it has, and its
    weight in sharing the time beyond every part's minimum (0: it gets what is left, if enough)."""

    name: str
    runner: Callable
    launches: int
    settings: int
    weight: float
    kwargs: dict = field(default_factory=dict)

    @property
    def minimum_s(self) -> float:
        return STARTUP_S * self.launches + SETTING_S * self.settings

    def max_seconds(self, budget_s: float) -> float:
        """The measured steps' share of one setting (`measure(max_seconds=)`) in `budget_s`."""
        return max((budget_s - STARTUP_S * self.launches) / self.settings - WARMUP_S, 3.0)


def suite_parts(gpus: int, names: list[str] | None = None) -> list[Part]:
    """The suite's parts in running order (only those in `names`, when given); the table measures DP and DDP
    too on 2 or more GPUs."""
    table_rows = 3 if gpus >= 2 else 1
    parts = [Part("table", table, table_rows, table_rows, 0.3), Part("amp", sweep_amp, 1, 3, 0.2),
            Part("cudnn", sweep_cudnn, 1, 4, 0.25), Part("channels_last", sweep_channels_last, 1, 2, 0.1),
            Part("fast_path", sweep_fast_path, 3, 3, 0.15, {"compiled": False}),
            Part("fast_path_compiled", sweep_fast_path, 3, 3, 0.0, {"only_compiled": True})]
    unknown = set(names or ()) - {p.name for p in parts}
    if unknown:
        raise BenchError(f"--parts: no part named {', '.join(sorted(unknown))} (the parts: "
                         f"{', '.join(p.name for p in parts)})")
    return [p for p in parts if names is None or p.name in names]


def plan(max_minutes: float, gpus: int, names: list[str] | None = None) -> list[tuple[Part, float]]:
    """(part, budget in seconds) for each part in running order. The shared parts get their minimum
    plus a share of the spare time; the compiled rows get `COMPILED_LEFT_S` where the spare covers it.
    A part planned at 0 s still runs where the parts before it leave it enough time (`gpu_suite`)."""
    parts = suite_parts(gpus, names)
    shared = [p for p in parts if p.weight]
    total, fitted, used = 60 * max_minutes, [], 0.0
    for part in shared:  # the minima, in running order, while they fit
        if used + part.minimum_s <= total:
            fitted.append(part)
            used += part.minimum_s
    spare = total - used
    compiled = [p for p in parts if not p.weight]
    reserve = COMPILED_LEFT_S if len(fitted) == len(shared) and spare >= COMPILED_LEFT_S else 0.0
    weights = sum(p.weight for p in fitted) or 1.0
    budgets = {p.name: p.minimum_s + (spare - reserve) * p.weight / weights for p in fitted}
    budgets.update({p.name: reserve for p in compiled})
    return [(p, budgets.get(p.name, 0.0)) for p in parts]


def describe_plan(max_minutes: float, gpus: int, names: list[str] | None = None) -> str:
    """The plan in one line, as `gpu_suite` prints it before it starts."""
    def one(part: Part, budget: float) -> str:
        if budget:
            return f"{part.name} {budget:.0f} s"
        return f"{part.name} if {COMPILED_LEFT_S if not part.weight else part.minimum_s:.0f} s are left"
    return f"{max_minutes:g} minutes on {gpus} GPU(s): " + ", ".join(one(*item) for item in plan(max_minutes, gpus,
                                                                                                    names))


def gpu_suite(max_minutes: float = 8.0, results_dir: Path | str = "book/results", steps: int = 20,
              warmup: int = 5, parts: list[str] | None = None) -> Path:
    """One bounded run on a GPU machine: the table on every GPU, AMP fp32/fp16/bf16, cudnn.benchmark,
    channels_last and the fast path's levers, R50-FPN (gpu-r50) at 800 px; writes `<results_dir>/<hardware>-<date>.json`
    after every part. A part that fails or runs past its time is recorded with its error, and the others
    still run; each part may use the time the parts after it do not need. `parts` runs only those, and a
    file of the same machine and day keeps its other parts (a second run measures what the first missed)."""
    if not torch.cuda.is_available():
        raise BenchError("--suite gpu needs CUDA GPUs and this machine has none; on a CPU run "
                         "`python -m maskrcnn_tut.lab.bench table` (and the sweeps) instead")
    deadline = time.monotonic() + 60 * max_minutes
    budgets = plan(max_minutes, torch.cuda.device_count(), parts)
    print(f"suite: {describe_plan(max_minutes, torch.cuda.device_count(), parts)}", flush=True)
    prov = provenance(f"python -m maskrcnn_tut.lab.bench --suite gpu --max-minutes {max_minutes:g}"
                      + (f" --parts {','.join(parts)}" if parts else ""))
    prov.update(skipped_for_time=[], seconds={})
    path = results_path(results_dir, prov)
    path.parent.mkdir(parents=True, exist_ok=True)
    results = _earlier_parts(path, prov, [part.name for part, _ in budgets]) if parts else {}
    for i, (part, budget) in enumerate(budgets):
        # the time this part may use: what is left, less the minima of the planned parts after it
        room = deadline - time.monotonic() - sum(p.minimum_s for p, b in budgets[i + 1:] if b and p.weight)
        if room < (part.minimum_s if part.weight else COMPILED_LEFT_S):
            prov["skipped_for_time"].append(part.name)
            write_suite(path, prov, results)
            continue
        started = time.monotonic()
        try:
            with launch_deadline(room):
                result = part.runner("gpu-r50", steps=steps, warmup=warmup,
                                     max_seconds=part.max_seconds(min(budget or room, room)),
                                     **part.kwargs)
            results[part.name] = result.to_dict()
        except Exception as err:  # keep what the other parts measured; record what failed
            results[part.name] = {"error": f"{type(err).__name__}: {err}"}
        prov["seconds"][part.name] = round(time.monotonic() - started, 1)
        print(f"suite: {part.name} in {prov['seconds'][part.name]:.0f} s (planned {budget:.0f} s)"
              + (f": {results[part.name]['error']}" if "error" in results[part.name] else ""), flush=True)
        write_suite(path, prov, results)
    return path


def _earlier_parts(path: Path, prov: dict, rerun: list[str]) -> dict[str, dict]:
    """The results of the parts not in `rerun` from the day's earlier file, if any; `prov` takes over its
    seconds and skipped parts, and lists its commands under "earlier_commands"."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    before = earlier["provenance"]
    prov["earlier_commands"] = before.get("earlier_commands", []) + [f"{before['date']}: {before['command']}"]
    prov["seconds"] = {k: v for k, v in before["seconds"].items() if k not in rerun}
    prov["skipped_for_time"] = [k for k in before["skipped_for_time"] if k not in rerun]
    return {k: v for k, v in earlier["results"].items() if k not in rerun}


def write_suite(path: Path, prov: dict, results: dict) -> None:
    """Write the suite's file whole (through a temporary file), so a reader never sees half of it."""
    partial = path.with_suffix(".json.part")
    partial.write_text(json.dumps({"provenance": prov, "results": results}, indent=2) + "\n")
    partial.replace(path)
