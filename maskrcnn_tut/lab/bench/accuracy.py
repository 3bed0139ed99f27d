"""Time to accuracy: the main job with and without the fast path (`python -m maskrcnn_tut.lab.bench
time-to-accuracy`).

Speed in img/s can hide a price in accuracy or in compiling; what a user waits for is the time until the
model is good enough. Each variant runs `train.py` as the main job does (same preset, steps and
schedule, `torchrun` with the same process count), evaluating every `eval_every` steps, one after the
other on the same machine. Training seconds are summed from `metrics.jsonl` (each print window's
mean step time x its steps: evaluation left out, as it is the same for both); "img/s (wall)" is
the summary's `monitor.img_per_s_wall`, evaluations and checkpoint saves included. The print
windows that took over twice the median window are counted apart as compiling (with
`--compile-backbone` the first steps compile, and so does every new shape).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ...errors import BenchError
from ...monitor import read_jsonl
from ..provenance import provenance
from ..stored.result import BenchResult, python_call
from ..wording import english

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "train.py"
#: The fast path's flags; batches of one orientation each (group factor 0), or fixed shapes pad mixed
#: batches to a square and cost more pixels than they save.
FAST_PATH = ("--fixed-shapes", "--aspect-ratio-group-factor", "0", "--compile-backbone", "--channels-last")


def training_seconds(metrics: list[dict], print_freq: int) -> tuple[list[tuple[int, float]], float]:
    """Cumulative training seconds at each logged step, and the seconds of the windows that took
    more than twice the median window (compiling), from `metrics.jsonl` rows (mean iter_time over
    each window of `print_freq` steps; the last window may be shorter)."""
    cumulative, total, previous_step = [], 0.0, 0
    windows = []
    for row in metrics:
        steps = row["step"] - previous_step
        previous_step = row["step"]
        windows.append(row["iter_time"] * steps)
        total += windows[-1]
        cumulative.append((row["step"], total))
    typical = statistics.median(row["iter_time"] for row in metrics) * print_freq
    compiling = sum(w - typical for w in windows if w > 2 * typical)
    return cumulative, compiling


def time_to_accuracy(metric: str = "segm_AP50", target: float = 0.90, eval_every: int = 50, nprocs: int = 2,
                     variants: dict[str, tuple[str, ...]] | None = None, extra_flags: tuple[str, ...] = (),
                     print_freq: int = 10) -> BenchResult:
    """Run the main job once per variant (default: eager, then the fast path's three flags) and
    report the training seconds until `metric` first reached `target` at an evaluation."""
    if eval_every % print_freq:
        raise BenchError(f"--eval-every {eval_every} must be a multiple of the print frequency {print_freq}, "
                         "so that every evaluation falls at the end of a logged window")
    variants = variants or {"eager": (), english("bench.fast_path_variant", flags=" ".join(FAST_PATH)): FAST_PATH}
    first_eval, final, by_eval = (english(key, metric=metric, target=target)
                                  for key in ("bench.tta_first_eval", "bench.tta_final", "bench.tta_by_eval"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="time-to-accuracy-") as work:
        for name, flags in variants.items():
            out = Path(work) / f"run{len(rows)}"
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}", str(TRAIN_SCRIPT),
                   "--output-dir", str(out), "--eval-every", str(eval_every), "--print-freq", str(print_freq),
                   "--no-progress", *extra_flags, *flags]
            # a cache of its own: every run compiles cold, as the first run on a machine does
            env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(Path(work) / f"inductor{len(rows)}")}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise BenchError(f"the {name} run failed (exit {done.returncode}): "
                                 + (done.stderr.strip().splitlines() or ["no output"])[-1])
            metrics, evals = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "eval.jsonl")
            cumulative, compiling = training_seconds(metrics, print_freq)
            at_step = dict(cumulative)
            reached = next((e for e in evals if e[metric] >= target), None)
            summary = json.loads((out / "summary.json").read_text())
            rows.append({"variant": name, "steps": summary["steps"], "img/s (wall)": summary["img_per_s_wall"],
                         first_eval: reached["step"] if reached else None,
                         "training s to it": at_step.get(reached["step"]) if reached else None,
                         "of it compiling s": compiling,
                         "training s, all steps": cumulative[-1][1],
                         final: summary[metric],
                         by_eval: ", ".join(f"{e['step']}: {e[metric]:.3f}" for e in evals),
                         "curve": [(e["step"], at_step.get(e["step"]), e[metric]) for e in evals]})
    eager = rows[0]["training s to it"]
    for row in rows:
        reached = row["training s to it"]
        row["speed-up to target"] = eager / reached if eager and reached else None
    job = f"torchrun --nproc_per_node={nprocs} maskrcnn_tut/train.py" + (" " + " ".join(extra_flags) if extra_flags else "")
    notes = [english("bench.tta_job", job=job, every=eval_every), english("bench.tta_seconds", every=eval_every),
             english("bench.tta_compiling")]
    command = python_call("lab.bench.accuracy.time_to_accuracy", metric=metric, target=target, eval_every=eval_every,
                          nprocs=nprocs, extra_flags=extra_flags or None)
    columns = ["variant", "steps", "img/s (wall)", first_eval, "training s to it", "of it compiling s",
               "speed-up to target", "training s, all steps", final, by_eval]
    return BenchResult("time-to-accuracy", english("bench.tta_title", metric=metric, target=target),
                       rows, columns, notes,
                       provenance(command) | {"metric": metric, "target": target, "eval_every": eval_every})
