"""One sweep per technique: each measures its settings in fresh worker processes and says, in its
notes, how much each knob changed throughput or memory here, and why when it did not.

- `sweep_loader()`: num_workers x pin_memory x persistent_workers.
- `sweep_amp()`: autocast off / float16 / bfloat16.
- `sweep_cudnn()`: cudnn.benchmark off/on with fixed vs varying image sizes.
- `sweep_accum()`: accumulation steps against the same images in one batch (throughput, memory).
- `sweep_size()`: image size against memory and throughput.
- `sweep_channels_last()`: NCHW against NHWC.
- `sweep_fast_path()`: beyond the article, a row per lever: fixed-shape batches, the compiled
  backbone (CUDA graphs on GPUs), channels_last, and all together, against eager.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...config import Config
from ...hardware import cpu_has_bf16, usable_cores
from ..provenance import provenance
from ..stored.result import BenchResult, python_call
from ..wording import english, say, shown, versus
from .harness import bench_config, launch_measure, multiscale_sizes

SWEEP_COLUMNS = ["setting", "img/s", "img/s all steps", "data ms", "compute ms", "peak MiB/device", "steps", "note"]
#: A knob whose settings differ by less than this (relative img/s) made no measurable difference.
NO_DIFFERENCE = 0.05


def _sweep(name: str, title: str, cfg: Config, settings: list[tuple[str, dict]], command: str,
           steps: int, warmup: int, max_seconds: float | None, skipped: list[tuple[str, str]] = (),
           process_per_setting: bool = False) -> BenchResult:
    """Measure each (label, knobs) setting in turn in one fresh worker process (or, where peak memory
    is the point, a fresh process per setting, so no setting inherits another's high-water mark);
    `skipped` rows say why a setting was not run. Each row keeps its `knobs` for `knob_note`."""
    runs = [{**knobs, "steps": knobs.get("steps", steps), "warmup": warmup, "max_seconds": max_seconds}
            for _, knobs in settings]
    if process_per_setting:
        measurements = [launch_measure(cfg, 1, [run])[0] for run in runs]
    else:
        measurements = launch_measure(cfg, 1, runs) if runs else []
    rows = []
    for (label, knobs), measurement in zip(settings, measurements):
        note = english("bench.cut_short", steps=len(measurement.iter_times)) if measurement.cut else ""
        rows.append({"setting": label, **measurement.row(), "note": note, "knobs": knobs})
        print(say("bench.sweep_progress", name=name, setting=shown(label), speed=rows[-1]["img/s"],
                  mb=rows[-1]["peak MiB/device"]), flush=True)
    rows += [{"setting": label, "note": why} for label, why in skipped]
    return BenchResult(name, title, rows, SWEEP_COLUMNS, [], provenance(command))


def knob_note(rows: list[dict], knob: str, why_flat: str, key: str = "img/s", moves_with: tuple[str, ...] = ()) -> str:
    """How much `knob` changed `key` between rows that differ in nothing else (but the step count and
    the knobs that `moves_with` it); says why when it did not. A setting is named best only as the book
    ranks (chapter 3): its whole range of a speed `key` (the row's IQR, "img/s lo"-"img/s hi") lies above
    every other setting's of its group; otherwise the note says the ranges overlap, or that `key` has no
    spread to rank by. Memory (a `key` in MiB) is not timed, so its medians rank."""
    ignored = {knob, "steps", *moves_with}
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get(key) is not None and knob in row.get("knobs", {}):
            others = tuple(sorted((k, str(v)) for k, v in row["knobs"].items() if k not in ignored))
            groups.setdefault(others, []).append(row)
    spreads = [(max(r[key] for r in group) / min(r[key] for r in group) - 1, group)
               for group in groups.values() if len({str(r["knobs"][knob]) for r in group}) > 1]
    if not spreads:
        return english("bench.knob_fewer", knob=knob)
    spread, group = max(spreads, key=lambda item: item[0])
    if spread < NO_DIFFERENCE:
        return english("bench.knob_flat", knob=knob, key=key, spread=spread, why=why_flat)
    timed = key.startswith("img/s")
    best = max(group, key=lambda r: r[key]) if timed else min(group, key=lambda r: r[key])
    if timed:
        apart = [versus(best, row, key) for row in group if row is not best]
        if None in apart:
            return english("bench.knob_no_spread", knob=knob, key=key, spread=spread)
        if any(verdict != 1 for verdict in apart):
            return english("bench.knob_overlap", knob=knob, key=key, spread=spread)
    return english("bench.knob_moved", knob=knob, key=key, spread=spread, best=best["setting"])


def sweep_loader(preset: str | None = None, workers: tuple[int, ...] = (0, 1, 2), steps: int = 16,
                 warmup: int = 2, data_path: str | None = None, max_seconds: float | None = None,
                 **overrides) -> BenchResult:
    """num_workers x pin_memory x persistent_workers (epochs of a few steps, so restarts show)."""
    cfg = bench_config(preset, data_path, **overrides)
    cuda = torch.cuda.is_available()
    settings = []
    for n in workers:
        for pin in ((False, True) if cuda else (False,)):
            for persistent in ((False, True) if n > 0 else (False,)):
                label = f"workers={n}, pin_memory={pin}" + (f", persistent={persistent}" if n > 0 else "")
                settings.append((label, {"workers": n, "pin_memory": pin, "persistent_workers": persistent}))
    result = _sweep("loader", english("bench.loader_title"), cfg, settings,
                    python_call("lab.bench.sweep_loader", preset=preset, workers=workers, steps=steps, warmup=warmup,
                                data_path=data_path, max_seconds=max_seconds, **overrides), steps, warmup, max_seconds)
    rows = result.rows
    data_share = max(r["data ms"] / (r["data ms"] + r["compute ms"]) for r in rows)
    result.notes = [
        english("bench.loader_times", steps=rows[0]["steps/epoch"]),
        knob_note(rows, "workers", english("bench.loader_flat", share=data_share)),
        knob_note(rows, "persistent_workers", english("bench.persistent_flat"), key="img/s all steps"),
    ]
    if cuda:
        result.notes.append(knob_note(rows, "pin_memory", english("bench.pin_flat")))
    else:
        result.notes.append(english("bench.pin_cpu"))
    if usable_cores() <= 2:
        result.notes.append(english("bench.few_cores", cores=usable_cores()))
    return result


def sweep_amp(preset: str | None = None, steps: int = 16, warmup: int = 3, data_path: str | None = None,
              max_seconds: float | None = None, force_bf16: bool = False, **overrides) -> BenchResult:
    """Autocast off / float16 / bfloat16: img/s and peak memory (float16 needs CUDA)."""
    cfg = bench_config(preset, data_path, **overrides)
    cuda = torch.cuda.is_available()
    settings = [("fp32 (no autocast)", {"amp": False, "amp_dtype": None})]
    skipped = []
    if cuda:
        settings.append(("fp16 autocast + GradScaler", {"amp": True, "amp_dtype": "float16"}))
    else:
        skipped.append(("fp16 autocast + GradScaler", english("bench.fp16_cpu")))
    if cuda or cpu_has_bf16() is not False or force_bf16:
        settings.append(("bf16 autocast", {"amp": True, "amp_dtype": "bfloat16"}))
    else:
        skipped.append(("bf16 autocast", english("bench.bf16_cpu")))
    result = _sweep("amp", english("bench.amp_title"), cfg, settings,
                    python_call("lab.bench.sweep_amp", preset=preset, steps=steps, warmup=warmup, data_path=data_path,
                                max_seconds=max_seconds, force_bf16=force_bf16 or None, **overrides),
                    steps, warmup, max_seconds, skipped)
    result.notes.append(knob_note(result.rows, "amp_dtype", english("bench.amp_flat"), moves_with=("amp",)))
    if not cuda:
        result.notes.append(english("bench.amp_cpu_memory"))
    return result


def sweep_cudnn(preset: str | None = None, steps: int = 16, warmup: int = 3, data_path: str | None = None,
                max_seconds: float | None = None, **overrides) -> BenchResult:
    """cudnn.benchmark off/on with fixed (square) vs varying (multi-scale) image sizes."""
    cfg = bench_config(preset, data_path, **overrides)
    cuda = torch.cuda.is_available()
    settings = [(english("bench.cudnn_setting", sizes=f"{shape} sizes", flag=flag) if cuda else f"{shape} sizes",
                 {"shape": shape, "cudnn_benchmark": flag})
                for shape in ("fixed", "varying") for flag in ((False, True) if cuda else (False,))]
    result = _sweep("cudnn", english("bench.cudnn_title"), cfg, settings,
                    python_call("lab.bench.sweep_cudnn", preset=preset, steps=steps, warmup=warmup, data_path=data_path,
                                max_seconds=max_seconds, **overrides), steps, warmup, max_seconds)
    sizes = ", ".join(map(str, multiscale_sizes(cfg.min_size)))
    result.notes = [english("bench.cudnn_sizes", size=cfg.min_size, sizes=sizes)]
    if cuda:
        result.notes.append(knob_note(result.rows, "cudnn_benchmark", english("bench.cudnn_flat"),
                                      key="img/s all steps"))
    else:
        result.notes.append(english("bench.cudnn_cpu"))
    result.notes.append(knob_note(result.rows, "shape", english("bench.shape_flat"), key="img/s all steps"))
    return result


def sweep_accum(preset: str | None = None, accum_steps: tuple[int, ...] = (1, 2, 4), steps: int = 12,
                warmup: int = 2, data_path: str | None = None, max_seconds: float | None = None,
                **overrides) -> BenchResult:
    """K micro-batches per optimizer step against one batch of the same K x B images."""
    cfg = bench_config(preset, data_path, batches_per_step=max(accum_steps), **overrides)
    b = cfg.batch_size
    settings = []
    for k in accum_steps:
        settings.append((english("bench.accum_setting", batch=b, k=k, images=b * k),
                         {"accum_steps": k, "batch_size": b, "steps": max(4, steps // k)}))
        if k > 1:
            settings.append((english("bench.accum_setting", batch=b * k, k=1, images=b * k),
                             {"accum_steps": 1, "batch_size": b * k, "steps": max(4, steps // k)}))
    result = _sweep("accum", english("bench.accum_title"), cfg, settings,
                    python_call("lab.bench.sweep_accum", preset=preset, accum_steps=accum_steps, steps=steps, warmup=warmup,
                                data_path=data_path, max_seconds=max_seconds, **overrides), steps, warmup, max_seconds,
                    process_per_setting=True)
    by_knobs = {(r["knobs"]["batch_size"], r["knobs"]["accum_steps"]): r for r in result.rows}
    result.notes = [english("bench.accum_holds")]
    for k in (k for k in accum_steps if k > 1):
        acc, one = by_knobs[(b, k)], by_knobs[(b * k, 1)]
        result.notes.append(english(
            "bench.accum_peak", images=b * k, k=k, batch=b, accumulated=acc["peak MiB/device"],
            large=one["peak MiB/device"], less=1 - acc["peak MiB/device"] / one["peak MiB/device"],
            ratio=acc["img/s"] / one["img/s"]))
    return result


def sweep_size(preset: str | None = None, sizes: tuple[int, ...] | None = None, steps: int = 10, warmup: int = 2,
               data_path: str | None = None, max_seconds: float | None = None, **overrides) -> BenchResult:
    """Image size (square inputs) against img/s and peak memory."""
    cfg = bench_config(preset, data_path, **overrides)
    sizes = sizes or ((512, 640, 800, 1024) if torch.cuda.is_available() else (96, 128, 192, 256))
    settings = [(f"{s} px", {"min_size": s, "max_size": s, "shape": "fixed"}) for s in sizes]
    result = _sweep("size", english("bench.size_title"), cfg, settings,
                    python_call("lab.bench.sweep_size", preset=preset, sizes=sizes, steps=steps, warmup=warmup,
                                data_path=data_path, max_seconds=max_seconds, **overrides), steps, warmup, max_seconds,
                    process_per_setting=True)
    result.notes = [english("bench.size_square"),
                    knob_note(result.rows, "min_size", "", key="peak MiB/device", moves_with=("max_size",)),
                    knob_note(result.rows, "min_size", "", moves_with=("max_size",))]
    return result


def sweep_channels_last(preset: str | None = None, steps: int = 16, warmup: int = 3,
                        data_path: str | None = None, max_seconds: float | None = None, **overrides) -> BenchResult:
    """The backbone in NCHW (default) against NHWC (channels_last)."""
    cfg = bench_config(preset, data_path, **overrides)
    settings = [(f"channels_last={flag}", {"channels_last": flag}) for flag in (False, True)]
    result = _sweep("channels_last", english("bench.channels_last_title"), cfg, settings,
                    python_call("lab.bench.sweep_channels_last", preset=preset, steps=steps, warmup=warmup,
                                data_path=data_path, max_seconds=max_seconds, **overrides), steps, warmup, max_seconds)
    why = english("bench.channels_last_gpu" if torch.cuda.is_available() else "bench.channels_last_cpu")
    result.notes.append(knob_note(result.rows, "channels_last", why))
    return result


FAST_PATH_COLUMNS = ["setting", "img/s", "img/s all steps", "warm-up s", "compute ms", "peak MiB/device", "steps", "note"]


def sweep_fast_path(preset: str | None = None, steps: int = 12, warmup: int = 3, data_path: str | None = None,
                    max_seconds: float | None = None, compiled: bool = True, only_compiled: bool = False,
                    **overrides) -> BenchResult:
    """Beyond the article: each lever of the fast path alone, then all together, against eager.

    Each setting runs in a fresh process, so every compilation is counted in its own row's
    'warm-up s' (the warm-up steps, where torch.compile compiles each new shape), apart from the
    measured steps' img/s. `compiled=False` leaves out the compiled rows (compiling costs tens of
    seconds per shape on a CPU); `only_compiled=True` keeps just eager and the compiled rows (the GPU
    suite measures those last, when minutes are left for cold compiles).
    """
    if only_compiled and not compiled:
        raise ValueError("only_compiled=True needs compiled=True")
    cfg = bench_config(preset, data_path, **overrides)
    cuda = torch.cuda.is_available()
    fixed = {"fixed_shapes": True, "aspect_ratio_group_factor": 0}  # batches of one orientation: one shape each
    settings = [("eager", {}), ("fixed shapes", fixed),
                ("channels_last", {"channels_last": True}),
                ("fixed shapes + compiled backbone", {**fixed, "compile_backbone": True}),
                ("all: fixed shapes + compiled backbone + channels_last",
                 {**fixed, "compile_backbone": True, "channels_last": True})]
    if not compiled:
        settings = [(label, knobs) for label, knobs in settings if not knobs.get("compile_backbone")]
    if only_compiled:
        settings = [(label, knobs) for label, knobs in settings if not knobs or knobs.get("compile_backbone")]
    skipped = [("JPEG decode on the device (--decode-on-device)", english("bench.decode_skipped"))]
    result = _sweep("fast_path", english("bench.fast_path_title"), cfg, settings,
                    python_call("lab.bench.sweep_fast_path", preset=preset, steps=steps, warmup=warmup,
                                data_path=data_path, max_seconds=max_seconds, compiled=None if compiled else False,
                                only_compiled=only_compiled or None, **overrides),
                    steps, warmup, max_seconds, skipped, process_per_setting=True)
    result.columns = FAST_PATH_COLUMNS
    eager = result.rows[0]["img/s"]
    for row in result.rows:
        if row.get("img/s"):
            row["note"] = english("bench.x_eager", ratio=row["img/s"] / eager)
    result.notes = [english("bench.fast_path_gpu" if cuda else "bench.fast_path_cpu"),
                    english("bench.fast_path_median")]
    if not cuda:
        result.notes.append(english("bench.fast_path_launches"))
    return result


SWEEPS: dict[str, Callable[..., BenchResult]] = {
    "loader": sweep_loader, "amp": sweep_amp, "cudnn": sweep_cudnn, "accum": sweep_accum,
    "size": sweep_size, "channels-last": sweep_channels_last, "fast-path": sweep_fast_path,
}
