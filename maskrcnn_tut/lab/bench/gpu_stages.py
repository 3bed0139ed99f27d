"""The GPU check's device run, one stage per call: what one lent GPU must answer, in steady state.

`tools/gpu_check.sh` runs each stage as its own bounded process
(`python -m maskrcnn_tut.lab.bench.gpu_stages STAGE --out DIR --seconds S`), and each stage writes
its files as it goes, so a stage stopped at its limit costs only itself. Without CUDA the same
stages run on the CPU at cpu-tiny's sizes (the rehearsal), writing the same files.

- `precision`: TF32, bf16 and fp16 (fp16 on GPUs only) interleaved in one process after a warm-up
  through the shapes (`steady`), with verdicts against TF32; then where a step's time goes: a
  profiler trace of a few steady steps of TF32 and bf16 (host wall, GPU busy, kernel launches and
  host syncs per step), the host work of one step counted (`host_work`), and the sync sites that
  CUDA's sync debug mode reports.
- `levers`: each lever against the preset's defaults, interleaved: images per GPU, torchvision's
  shapes (no grouping, no buckets), a host read every step, the per-parameter optimizer instead of
  the fused one, BatchNorm instead of GroupNorm, channels_last.
- `side_by_side`: torchvision's reference and the package on the same data (`bench.peer`).
- `cudnn_benchmark`: cudnn.benchmark on fixed shapes, and off, each in a process of its own
  (`steady.own_process`: a flushed line per step, so an autotuning hang keeps what it measured).
- `compiled`: the backbone and RPN head compiled (CUDA graphs on GPUs) on fixed shapes, in its own
  process; the compile is part of its first-shape cost, reported apart.

Files in DIR (at most 8 come back from the device): steps.jsonl (every step of every stage),
summary.json (rewritten after each stage: provenance and each stage's rows), trace_fp32.json.gz,
trace_bf16.json.gz, ref.log (the reference's output), nvml.csv (GPU utilization every 0.1 s), and
the shell's check.log and stages.txt. `results` turns summary.json into the file of `book/results/`
the chapters read (`results_file`).
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ... import distributed as du
from ...atomic import atomic_write
from ...engine import advance_schedule, train_step
from ..nvml import GPUSampler
from ..provenance import provenance
from ..stored.result import BenchResult, results_path
from . import steady
from .harness import bench_config
from .host_work import count_host_work, optimizer_counters
from .profile import CUDA_WAITS

STAGES = ("precision", "levers", "side_by_side", "cudnn_benchmark", "compiled")
#: Sizes of a stage on a GPU and in the CPU rehearsal.
PLAN = {"cuda": dict(preset="gpu-r50", quiet=8, max_warmup=80, block_steps=20, rounds=3, profile_steps=4,
                     own_steps=40, peer_steps=60),
        "cpu": dict(preset="cpu-tiny", quiet=2, max_warmup=6, block_steps=2, rounds=3, profile_steps=2,
                    own_steps=3, peer_steps=6)}
#: CUDA runtime calls that launch a kernel (the profiler's names).
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def plan() -> dict:
    return PLAN["cuda" if torch.cuda.is_available() else "cpu"]


def write_summary(out: Path, stage: str, result: dict) -> None:
    """summary.json with `stage`'s result set, written whole to a temporary file and renamed: a kill
    leaves the last complete version."""
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {
        "provenance": provenance("bash tools/gpu_check.sh"), "kind": "steady-state", "stages": {}}
    summary["stages"][stage] = result
    atomic_write(path, lambda f: json.dump(summary, f, indent=1, default=str), mode="w", durable=False)


@contextlib.contextmanager
def sampling(out: Path, stage: str):
    """NVML's utilization every 0.1 s into nvml.csv, tagged with the stage (a header only without a GPU)."""
    path = out / "nvml.csv"
    if not path.exists():
        path.write_text("time,stage,gpu,util,mem_used_mb\n")
    sampler = GPUSampler(interval_s=0.1).start()
    try:
        yield sampler
    finally:
        sampler.stop()
        with open(path, "a") as csv:
            for s in sampler.samples:
                csv.write(f"{s['time']:.2f},{stage},{s['gpu']},{s['util']:.0f},{s['mem_used_mb']:.0f}\n")


def _util(sampler: GPUSampler, spans: list[tuple[float, float]]) -> float | None:
    """Mean NVML utilization % over the time spans (None without samples)."""
    inside = [s["util"] for s in sampler.samples if any(a <= s["time"] <= b for a, b in spans)]
    return statistics.fmean(inside) if inside else None


def measured(settings: list[steady.Setting], base: str, out: Path, stage: str, deadline: float,
             sampler: GPUSampler | None = None) -> dict:
    """Warm each setting up (in half the time left at most, shared), interleave them for the plan's rounds
    (fewer when `deadline` comes first), and compare them with `base`; every step goes to steps.jsonl."""
    p = plan()
    sink = steady.jsonl_sink(out / "steps.jsonl", stage=stage)
    warm_until = time.monotonic() + (deadline - time.monotonic()) / 2  # the other half measures
    for i, setting in enumerate(settings):
        share = (warm_until - time.monotonic()) / (len(settings) - i)
        setting.warm_up(p["quiet"], p["max_warmup"], sink, time.monotonic() + share)
    spans: dict[str, list] = {s.label: [] for s in settings}

    def timed_sink(lines):
        sink(lines)
        spans[lines[0]["setting"]].append((time.time() - sum(line["wall s"] for line in lines), time.time()))

    rounds = steady.interleave(settings, p["rounds"], p["block_steps"], timed_sink, deadline)
    rows = steady.compare(settings, base)
    for row in rows:
        row["gpu util %"] = _util(sampler, spans[row["setting"]]) if sampler else None
    return {"rows": rows, "rounds": rounds, "block steps": p["block_steps"]}


def breakdown(setting: steady.Setting, out: Path, steps: int) -> dict:
    """Where a steady step's time goes: `steps` steps under the profiler (trace_<label>.json.gz), per
    step: host wall, GPU busy (the union of its kernels), idle, kernel launches, host syncs; and the
    host work of one step counted op by op (`host_work`)."""
    rig, cuda = setting.rig, setting.rig.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        setting.run(steps, "profiled", 0)
        wall = (time.perf_counter() - started) / steps
    trace = out / f"trace_{setting.label}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
    busy, reach = 0.0, 0.0
    for start, end in kernels:  # union of the kernels' intervals (us)
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    row = {"setting": setting.label, "steps": steps, "host wall ms": 1000 * wall,
           "gpu busy ms": busy / 1000 / steps if cuda else None,
           "launches/step": sum(e.name in LAUNCHES for e in events) / steps if cuda else None,
           "cuda waits/step": sum(e.name in CUDA_WAITS for e in events) / steps if cuda else None}
    if cuda:
        row["gpu idle ms"] = row["host wall ms"] - row["gpu busy ms"]
    def unread_step(batches):  # a step train.py does not read (between log lines on a GPU)
        train_step(rig.model, rig.optimizer, rig.scaler, batches, rig.cfg, rig.state, read=False)
    work = count_host_work(unread_step, [next(rig.batches)], optimizer_counters(rig.optimizer))
    advance_schedule(rig.scheduler)
    return {**row, **work.row()}


def sync_sites(setting: steady.Setting) -> dict:
    """One step under CUDA's sync debug mode: the Python lines that made the host wait, by count."""
    if setting.rig.device.type != "cuda":
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            setting.rig.step(read=False)  # what a step between log lines waits for
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites: dict[str, int] = {}
    for warning in caught:
        if "synchroniz" in str(warning.message):
            key = f"{Path(warning.filename).name}:{warning.lineno}"
            sites[key] = sites.get(key, 0) + 1
    return dict(sorted(sites.items(), key=lambda kv: -kv[1])[:10])


def precision(out: Path, deadline: float) -> dict:
    p = plan()
    cuda = torch.cuda.is_available()
    # the rehearsal on a CPU without bf16 instructions runs bf16 anyway (emulated, slow): the same files
    choices = [("fp32", {"amp": False}), ("bf16", {"amp": True, "amp_dtype": "bfloat16", "allow_emulated_bf16": not cuda})]
    choices += [("fp16", {"amp": True, "amp_dtype": "float16"})] if cuda else []
    settings = [steady.build_setting(label, bench_config(p["preset"], **knobs)) for label, knobs in choices]
    measure_until = time.monotonic() + 0.6 * (deadline - time.monotonic())  # the rest: the profile and the counts
    with sampling(out, "precision") as sampler:
        result = measured(settings, "fp32", out, "precision", measure_until, sampler)
    result["fp32 is TF32"] = cuda
    result["not run"] = [] if cuda else [{"setting": "fp16", "why": "fp16 autocast needs CUDA"}]
    write_summary(out, "precision", result)
    result["breakdown"] = [breakdown(s, out, p["profile_steps"]) for s in settings[:2]]
    write_summary(out, "precision", result)
    result["sync sites"] = sync_sites(settings[1])
    return result


#: Each lever as the settings it changes from the preset's defaults, with a step option ("read_every").
LEVERS = {
    "batch 2": {"batch_size": 2}, "batch 4": {"batch_size": 4}, "batch 16": {"batch_size": 16},
    "torchvision's shapes (no grouping, no buckets)": {"aspect_ratio_group_factor": -1, "pad_buckets": 0},
    "host read every step": {"read_every": 1},
    "per-parameter optimizer (not fused)": {"fused": False},
    "BatchNorm (not GroupNorm)": {"norm": "bn"},
    "channels_last": {"channels_last": True},
}


def _lever(label: str, preset: str, knobs: dict) -> steady.Setting:
    knobs = dict(knobs)
    read_every, fused = knobs.pop("read_every", None), knobs.pop("fused", True)
    setting = steady.build_setting(label, bench_config(preset, **knobs), read_every)
    if not fused:
        for group in setting.rig.optimizer.param_groups:
            group["fused"] = False  # read at each step(): the per-parameter (foreach) path
    return setting


def _changes_nothing(defaults: steady.Setting, knobs: dict) -> bool:
    """A lever the defaults already pull here (BatchNorm in cpu-tiny; no fused optimizer on a CPU)."""
    if "fused" in knobs:
        return not any(group.get("fused") for group in defaults.rig.optimizer.param_groups)
    if "read_every" in knobs:
        return knobs["read_every"] == defaults.read_every
    return all(getattr(defaults.rig.cfg, key) == value for key, value in knobs.items())


def levers(out: Path, deadline: float) -> dict:
    p = plan()
    defaults = steady.build_setting("defaults", bench_config(p["preset"]))
    settings, same = [defaults], []
    cfg = defaults.rig.cfg
    for label, knobs in LEVERS.items():
        if _changes_nothing(defaults, knobs):
            same.append(label)
        else:
            settings.append(_lever(label, p["preset"], knobs))
    with sampling(out, "levers") as sampler:
        result = measured(settings, "defaults", out, "levers", deadline, sampler)
    result["defaults"] = {k: getattr(cfg, k) for k in
                          ("batch_size", "precision", "norm", "aspect_ratio_group_factor", "pad_buckets")}
    result["same as the defaults here"] = same
    return result


def side_by_side(out: Path, deadline: float) -> dict:
    """torchvision's reference, then the package, on the bench's data (`bench.peer`, each run with half the
    time); the reference's output into ref.log, every step into steps.jsonl."""
    from . import peer
    p, cuda = plan(), torch.cuda.is_available()
    try:
        peer.find_peer()
    except FileNotFoundError as err:
        return {"not run": str(err)}
    with tempfile.TemporaryDirectory() as runs:
        result = peer.side_by_side(steps=p["peer_steps"], warmup_quiet=p["quiet"], sizes=None if cuda else (128, 192),
                                   timeout_s=max(30.0, (deadline - time.monotonic()) / 2), log_dir=runs)
        shutil.copyfile(Path(runs) / "reference.out", out / "ref.log")
    sink = steady.jsonl_sink(out / "steps.jsonl", stage="side_by_side")
    for row in result["rows"]:
        sink(row.pop("lines"))
        row["images/step"] = result["images/step"]
    result["rows"][1].update({"vs": "reference", "ratio": result["ratio package/reference"], "ratio lo": result["ratio lo"],
                              "ratio hi": result["ratio hi"], "round ratios": [], "verdict": result["verdict"]})
    return result


def _own(out: Path, deadline: float, settings: dict[str, dict]) -> dict:
    """Each setting in its own process, each with its share of the time left."""
    p, rows = plan(), []
    for i, (label, knobs) in enumerate(settings.items()):
        share = (deadline - time.monotonic()) / (len(settings) - i)
        rows.append(steady.own_process(knobs, p["own_steps"], out / "steps.jsonl", share, label, p["preset"],
                                       p["quiet"]))
    return {"rows": rows}


def cudnn_benchmark(out: Path, deadline: float) -> dict:
    fixed = {"fixed_shapes": True}
    return _own(out, deadline, {"cudnn.benchmark on, fixed shapes": {**fixed, "cudnn_benchmark": True},
                                "cudnn.benchmark off, fixed shapes": fixed})


def compiled(out: Path, deadline: float) -> dict:
    return _own(out, deadline, {"compiled backbone + RPN head, fixed shapes": {"fixed_shapes": True,
                                                                              "compile_backbone": True}})


#: The results file's parts: (the stage they come from, the title of their table).
PARTS = {"amp": ("precision", "Precisions in steady state"),
         "levers": ("levers", "Levers against the preset's defaults, steady state"),
         "side_by_side": ("side_by_side", "torchvision's reference beside the package, steady state"),
         "cudnn": ("cudnn_benchmark", "cudnn.benchmark on fixed shapes, each in its own process"),
         "compiled": ("compiled", "Compiled backbone and RPN head, in its own process")}
COLUMNS = ["setting", "images/step", "img/s steady", "img/s all steps", "steady steps", "new-shape steps",
           "first-shape s", "ratio", "verdict", "gpu util %"]


def results_file(out: Path, results_dir: Path | str = "book/results") -> Path:
    """The device run's summary.json as a results file the book reads (`bench.gpu_files`):
    `<results_dir>/<hardware>-<date>-steady.json`, one part per stage that measured rows."""
    summary = json.loads((out / "summary.json").read_text())
    prov = summary["provenance"]
    results = {part: BenchResult(part, title, summary["stages"][stage]["rows"], COLUMNS, [], prov).to_dict()
               for part, (stage, title) in PARTS.items() if summary["stages"].get(stage, {}).get("rows")}
    path = results_path(results_dir, prov)
    path = path.with_name(path.stem + "-steady.json")
    path.write_text(json.dumps({"provenance": prov, "results": results}, indent=1, default=str) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one stage of the GPU check's device run, or `results` to write "
                                                 "its summary as a file of book/results/")
    parser.add_argument("stage", choices=(*STAGES, "results"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=600.0, help="this stage's time (it stops measuring sooner)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "results":
        print(results_file(args.out))
        return
    started = time.monotonic()
    deadline = started + 0.8 * args.seconds  # the margin: the last block, writing the files
    du.init_distributed()
    result = globals()[args.stage](args.out, deadline)
    result["seconds"] = round(time.monotonic() - started, 1)
    write_summary(args.out, args.stage, result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, default=str)[:2000])
    for row in result.get("rows", []):
        print(json.dumps(row, default=str))


if __name__ == "__main__":
    main()
