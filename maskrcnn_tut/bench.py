"""Benchmarks: the article's speed table and the technique sweeps, measured on this machine.

API (each returns a `BenchResult`: `.rows`, `.notes`, `.provenance`, `.to_markdown()`, `.plot()`,
`.save(path)`; `BenchResult.load(path)` reads one back). The shell runs the same functions:
`python -m maskrcnn_tut.bench NAME [--out FILE] [--plot PNG]`.

- `table()`: rows Single, DP(N), DDP(N) for the N devices present: img/s, peak memory per device,
  total memory, speedup, scaling efficiency. On CPUs a device is a core: DDP(N) is N gloo
  processes x 1 thread, compared with one process x 1 thread (the fair baseline) and one process
  x N threads; DP is marked as needing >= 2 GPUs.
- `sweep_loader()`: num_workers x pin_memory x persistent_workers.
- `sweep_amp()`: autocast off / float16 / bfloat16.
- `sweep_cudnn()`: cudnn.benchmark off/on with fixed vs varying image sizes.
- `sweep_accum()`: accumulation steps against the same images in one batch (throughput, memory).
- `sweep_size()`: image size against memory and throughput.
- `sweep_channels_last()`: NCHW against NHWC.
- `gpu_suite(max_minutes=8)`: the table on every GPU, AMP, cudnn.benchmark and channels_last with
  R50-FPN at 800 px, bounded in time; writes `book/results/<hardware>-<date>.json`
  (`python -m maskrcnn_tut.bench --suite gpu --max-minutes 8`). `load_suite(path)` reads it.
- `measure(cfg, steps, warmup)`: the measurement underneath, in this process (callbacks get every
  `StepRecord`, e.g. `monitor.LiveDashboard`).

How it measures: the real Mask R-CNN of the preset (`cpu-tiny` on CPUs, `gpu-r50` on GPUs) trains
on shapes-dataset batches through `engine.train_step`, the step `train.py` runs. Warm-up steps are
excluded; img/s is images per step over the median step time of the slowest rank; peak memory is
the CUDA allocator's peak per GPU, or each process's peak resident memory on CPU. Every table row
and every sweep runs in fresh worker processes started by `distributed.launch`, each with its
thread count set (`torch.set_num_threads`, OMP_NUM_THREADS) and, on CPUs, bound to cores of its
own, so results do not depend on what the calling notebook did before. Results carry hardware
provenance (CPU, cores, GPUs, torch / CUDA / cuDNN / NCCL versions, date, command) and say when a
knob made no difference here, and why. Every public function also takes Config fields as keyword
overrides (`table(batch_size=8)`, `sweep_amp(min_size=96)`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from . import distributed as du
from .config import Config, ConfigError, make_config, validate
from .data.shapes import ensure_shapes_dataset

#: The benchmark's dataset: small so an epoch is a few steps (the loader sweep crosses epochs).
BENCH_SHAPES = {"n_train": 32, "n_val": 8, "seed": 0}
#: Images per process in the CPU speed table. A step's fixed costs (the all-reduce, which a one-core
#: gloo process cannot hide behind backward, and the wait for the slower rank) weigh less on more
#: images: DDP(2) measured 1.61-1.66x at the preset's 4 images, 1.74-1.87x at 8 on the 2-core
#: development machine. The GPU table keeps the preset's batch.
CPU_TABLE_BATCH = 8
#: A knob whose settings differ by less than this (relative img/s) made no measurable difference.
NO_DIFFERENCE = 0.05
GPU_SUITE_SIZE = 800


class BenchError(RuntimeError):
    """A benchmark that cannot run here; the message says why and what to run instead."""


# --------------------------------------------------------------------------- results


@dataclass
class BenchResult:
    """What one benchmark measured: rows (dicts), the columns to show, notes and provenance."""

    name: str
    title: str
    rows: list[dict]
    columns: list[str]
    notes: list[str] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)

    def to_markdown(self) -> str:
        from .book import markdown_table
        lines = [f"**{self.title}** ({self.provenance.get('hardware', '')})", "",
                 markdown_table(self.rows, self.columns)]
        lines += [""] + [f"- {note}" for note in self.notes] if self.notes else []
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def plot(self):
        """A bar chart of img/s and peak memory per row (per image size and batch for memory)."""
        return _PLOTS.get(self.name, _plot_sweep)(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict) -> BenchResult:
        return cls(**data)

    @classmethod
    def load(cls, path: Path | str) -> BenchResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _row_label(row: dict) -> str:
    return str(row.get("setup", row.get("setting", "")))


def _plot_sweep(result: BenchResult):
    import matplotlib.pyplot as plt
    measured = [row for row in result.rows if row.get("img/s") is not None]
    labels = [_row_label(row) for row in measured]
    fig, (ax_speed, ax_memory) = plt.subplots(1, 2, figsize=(11, 3.2 + 0.12 * len(labels)))
    ax_speed.barh(labels, [row["img/s"] for row in measured], color="tab:green")
    ax_speed.set(xlabel="images / s (median step)", title="Throughput")
    ax_memory.barh(labels, [row["peak MiB/device"] for row in measured], color="tab:purple")
    ax_memory.set(xlabel="MiB", title="Peak memory per device")
    for ax in (ax_speed, ax_memory):
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"{result.title} — {result.provenance.get('hardware', '')}")
    fig.tight_layout()
    return fig


def _plot_table(result: BenchResult):
    fig = _plot_sweep(result)
    ax_speed = fig.axes[0]
    measured = [row for row in result.rows if row.get("img/s") is not None]
    for y, row in enumerate(measured):
        ax_speed.annotate(f" {row['speedup']:.2f}x", (row["img/s"], y), va="center", fontsize=8)
    return fig


def _plot_memory(result: BenchResult):
    import matplotlib.pyplot as plt
    parts = ["parameters MiB", "gradients MiB", "optimizer MiB", "activations MiB"]
    labels = [f"{row['image size']} px x{row['batch']}" for row in result.rows]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.45 * len(labels)), 4))
    bottom = [0.0] * len(labels)
    for part in parts:
        values = [row[part] / 1024 for row in result.rows]
        ax.bar(labels, values, bottom=bottom, label=part.replace(" MiB", ""))
        bottom = [b + v for b, v in zip(bottom, values)]
    limit = result.provenance.get("gpu_memory_gb_compared")
    if limit:
        ax.axhline(limit, color="tab:red", linestyle="--", label=f"{limit:g} GB GPU")
    ax.set(ylabel="GiB", title=f"{result.title}\n{result.provenance.get('hardware', '')}")
    ax.tick_params(axis="x", rotation=60)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


_PLOTS: dict[str, Callable] = {"table": _plot_table, "memory": _plot_memory}


def provenance(command: str) -> dict[str, Any]:
    """Where and how a result was measured: hardware, software versions, date and command."""
    import torchvision

    from .book import hardware, hardware_label
    hw = hardware()
    cuda = torch.cuda.is_available()
    return {"hardware": hardware_label(), "cpu": hw["cpu"], "cores": hw["cores"], "ram_gb": hw["ram_gb"],
            "gpus": hw["gpus"], "gpu_count": len(hw["gpus"]), "gpu_memory_gb": hw["gpu_memory_gb"],
            "cpu_bf16": cpu_has_bf16(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda if cuda else None,
            "cudnn": torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command}


def _call(name: str, **kwargs) -> str:
    """The Python call that produced a result, for its provenance."""
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None)
    return f"maskrcnn_tut.{name}({shown})"


def cpu_has_bf16() -> bool | None:
    """Whether the CPU has bfloat16 instructions (AVX512-BF16 or AMX); None when unknown."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


# --------------------------------------------------------------------------- the measurement


@dataclass
class Measurement:
    """Step times (slowest rank, measured steps only) and peak memory per device of one setup."""

    processes: int
    threads: int
    devices: list[str]
    images_per_step: int
    iter_times: list[float]
    data_times: list[float]
    epoch_starts: list[int]
    peak_memory_mb: list[float]

    @property
    def img_per_s(self) -> float:
        """Images per second at the median step time (robust to the odd slow step)."""
        return self.images_per_step / statistics.median(self.iter_times)

    @property
    def img_per_s_all_steps(self) -> float:
        """Images per second over all measured steps, slow ones included (epoch starts, new shapes)."""
        return self.images_per_step * len(self.iter_times) / sum(self.iter_times)

    def row(self) -> dict:
        compute = [t - d for t, d in zip(self.iter_times, self.data_times)]
        starts = [self.data_times[i] for i in self.epoch_starts]
        return {"img/s": self.img_per_s, "img/s all steps": self.img_per_s_all_steps,
                "data ms": round(1000 * statistics.median(self.data_times), 1),
                "compute ms": round(1000 * statistics.median(compute), 1),
                "epoch-start data ms": round(1000 * statistics.fmean(starts), 1) if starts else None,
                "peak MiB/device": round(max(self.peak_memory_mb)), "total MiB": round(sum(self.peak_memory_mb)),
                "steps": len(self.iter_times)}


def bench_config(preset: str | None = None, data_path: str | None = None, **overrides) -> Config:
    """The preset (by hardware when None) on the benchmark's shapes data, without progress bars; on
    CPUs with workers=0, so a process x thread setup uses exactly its cores."""
    if data_path is None:
        data_path = str(ensure_shapes_dataset(**BENCH_SHAPES, progress=False))
    settings = {"progress": False, **({} if torch.cuda.is_available() else {"workers": 0}),
                **{k: v for k, v in overrides.items() if v is not None}}
    cfg = make_config(preset, data_path=str(data_path), **settings)
    validate(cfg)
    return cfg


def multiscale_sizes(size: int) -> tuple[int, ...]:
    """Shorter-side sizes from 0.75x to 1.25x of `size` in steps of 32 (multi-scale training)."""
    return tuple(range(32 * round(0.75 * size / 32), 32 * round(1.25 * size / 32) + 1, 32))


def _square_batches(batches: Iterator, size: int) -> Iterator:
    """The same batches resized to size x size (boxes and masks too): every step has one shape."""
    from torchvision.transforms import v2
    resize = v2.Resize((size, size), antialias=True)
    for images, targets in batches:
        pairs = [resize(image, target) for image, target in zip(images, targets)]
        yield tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def measure(cfg: Config, steps: int = 20, warmup: int = 3, *, threads: int | None = None, shape: str = "natural",
            dataparallel: bool = False, sync_gradients: bool = True, max_seconds: float | None = None,
            callbacks: list[Callable] = ()) -> Measurement:
    """Train `warmup + steps` steps of the config's model in this process (or the group it joined)
    and time the last `steps` (with `max_seconds`, as many as the warm-up's pace fits, at least 3).

    shape: "natural" (the dataset's sizes), "fixed" (every image square at min_size: one input
    shape) or "varying" (multi-scale min sizes, `multiscale_sizes`). dataparallel: one process
    drives every GPU through `DetectionDataParallel`, batch_size images per GPU. threads: torch's
    CPU threads for this process (left set afterwards). sync_gradients=False: processes of a group
    train without DDP (no gradient all-reduce), which isolates what the all-reduce costs.
    """
    from .data.loader import build_datasets, build_train_loader
    from .dataparallel import DetectionDataParallel
    from .engine import TrainState, batch_stream, build_optimizer, lr_schedule, make_scaler, train_step
    from .model import build_model
    from .monitor import peak_memory_mb, reset_peak_memory
    from .train import configure_runtime

    if shape not in ("natural", "fixed", "varying"):
        raise ValueError(f"shape must be natural, fixed or varying, got {shape!r}")
    info = du.info()
    device = info.device
    if threads:
        torch.set_num_threads(threads)
    n_dp = torch.cuda.device_count() if dataparallel else 1
    cfg = dataclasses.replace(cfg, skip_nonfinite=warmup + steps, pin_memory=(
        device.type == "cuda" if cfg.pin_memory is None else cfg.pin_memory))
    configure_runtime(cfg, device)
    train_set, _ = build_datasets(cfg)
    loader = build_train_loader(train_set, dataclasses.replace(cfg, batch_size=cfg.batch_size * n_dp),
                                info.rank, info.world_size)
    du.seed_everything(cfg.seed)
    model = build_model(cfg, train_set.num_classes)
    if shape == "varying":
        model.transform.min_size = multiscale_sizes(cfg.min_size)
        model.transform.max_size = round(cfg.max_size * 1.25)
    model = model.to(device)
    du.seed_everything(cfg.seed + info.rank)
    if dataparallel:
        model = DetectionDataParallel(model)
    elif sync_gradients:
        model = du.wrap_ddp(model, cfg, info)
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.warmup_steps, 10**6))
    scaler = make_scaler(cfg, device)
    state = TrainState()
    batches = batch_stream(loader, state)
    if shape == "fixed":
        batches = _square_batches(batches, cfg.min_size)
    devices = [torch.device("cuda", i) for i in range(n_dp)] if dataparallel else [device]
    model.train()
    term_names: list[str] = []
    warm_times = []
    for _ in range(warmup):
        warm_times.append(train_step(model, optimizer, scaler, batches, cfg, device, state, term_names).iter_time)
        scheduler.step()
    if max_seconds and warm_times:  # rank 0 plans the step count, so every rank stops at the same step
        steps = du.broadcast_object(min(steps, max(3, int(max_seconds / statistics.median(warm_times)))))
    for dev in devices:
        reset_peak_memory(dev)
    records = []
    for _ in range(steps):
        records.append(train_step(model, optimizer, scaler, batches, cfg, device, state, term_names))
        scheduler.step()
        for callback in callbacks:
            callback(records[-1])
    mine = {"iter": [r.iter_time for r in records], "peak": [peak_memory_mb(d) for d in devices]}
    ranks = du.all_gather_objects(mine)
    epochs = [r.epoch for r in records]
    return Measurement(
        processes=info.world_size, threads=torch.get_num_threads(),
        devices=[str(d) for d in devices] if dataparallel else [str(device)] * info.world_size,
        images_per_step=cfg.batch_size * cfg.accum_steps * info.world_size * n_dp,
        iter_times=[max(times) for times in zip(*(r["iter"] for r in ranks))],
        data_times=[r.data_time for r in records],
        epoch_starts=[i for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]],
        peak_memory_mb=[peak for r in ranks for peak in r["peak"]])


def pin_cores(threads: int) -> list[int] | None:
    """Bind this process to its own `threads` cores (rank r gets the r-th slice of the usable
    cores), so processes of one setup never share a core; None where that is not possible."""
    info = du.info()
    if info.device.type == "cuda" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[info.local_rank * threads:(info.local_rank + 1) * threads]
    if len(cores) < info.local_world_size * threads or len(mine) < threads:
        return None
    os.sched_setaffinity(0, mine)
    return mine


def measure_worker(cfg: Config, runs: list[dict]) -> list[Measurement]:
    """Run inside `distributed.launch`: pin this process to its cores, then `measure(cfg with the
    run's overrides, **the run's options)` for each run in turn; rank 0's results are the group's."""
    options = {"steps", "warmup", "threads", "shape", "dataparallel", "sync_gradients", "max_seconds"}
    pin_cores(runs[0].get("threads") or 1)
    results = []
    for run in runs:
        overrides = {k: v for k, v in run.items() if k not in options}
        results.append(measure(dataclasses.replace(cfg, **overrides), **{k: v for k, v in run.items() if k in options}))
    return results


@contextlib.contextmanager
def _environment(**variables: str):
    """Set environment variables for the worker processes started inside the block."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _launch_measure(cfg: Config, nprocs: int, runs: list[dict], threads: int | None = None) -> list[Measurement]:
    """`measure_worker` in `nprocs` fresh processes, each pinned to `threads` CPU threads."""
    threads = threads or max(1, du.cpu_cores() // nprocs)
    for run in runs:
        run.setdefault("threads", threads)
    with _environment(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)):
        return du.launch(measure_worker, nprocs, cfg, runs)


# --------------------------------------------------------------------------- the speed table


TABLE_COLUMNS = ["setup", "processes", "threads/process", "GPUs", "img/s", "peak MiB/device", "total MiB",
                 "speedup", "scaling efficiency", "note"]


def table(preset: str | None = None, nprocs: int | None = None, steps: int = 16, warmup: int = 3,
          data_path: str | None = None, max_seconds: float | None = None, **overrides) -> BenchResult:
    """The article's speed table for this machine (rows: module docstring); `overrides` are Config
    fields (e.g. batch_size=2, min_size=96). On CPUs the batch defaults to `CPU_TABLE_BATCH`."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and overrides.get("batch_size") is None:
        overrides["batch_size"] = CPU_TABLE_BATCH
    cfg = bench_config(preset, data_path, **overrides)
    run = {"steps": steps, "warmup": warmup, "max_seconds": max_seconds}
    rows: list[dict] = []

    def add(setup: str, nprocs_: int, threads: int | None, n_gpus: int | None, units: int,
            extra: dict | None = None, note: str = "") -> None:
        measurement = _launch_measure(cfg, nprocs_, [dict(run, **(extra or {}))], threads)[0]
        row = {"setup": setup, "processes": nprocs_, "threads/process": measurement.threads if not gpus else None,
               "GPUs": n_gpus, **measurement.row(), "units": units, "note": note}
        rows.append(row)
        print(f"table: {setup}: {row['img/s']:.2f} img/s, peak {row['peak MiB/device']:.0f} MiB per device", flush=True)

    notes = [f"{cfg.preset} preset ({cfg.backbone}-FPN, {cfg.min_size} px, batch {cfg.batch_size} per "
             f"{'GPU' if gpus else 'process'}) on shapes batches through engine.train_step; img/s at the "
             f"median of {steps} measured steps after {warmup} warm-up steps (slowest rank)."]
    if gpus:
        n = nprocs or gpus
        add("Single GPU", 1, None, 1, 1)
        if n >= 2:
            add(f"DP({n})", 1, None, n, n, {"dataparallel": True})
            add(f"DDP({n})", n, None, n, n)
        else:
            from .dataparallel import explain_unavailable
            rows.append({"setup": "DP / DDP", "note": explain_unavailable(gpus)})
        notes.append("Memory is the CUDA allocator's peak per GPU (nvidia-smi shows more: the CUDA "
                     "context and the allocator's cache).")
    else:
        from .dataparallel import explain_unavailable
        cores = du.cpu_cores()
        n = nprocs or cores
        per_process = max(1, cores // n)
        add(f"Single (1 process x {per_process} thread{'s' * (per_process > 1)})", 1, per_process, None,
            per_process, note="baseline: the threads of one DDP process")
        if n * per_process > per_process:
            add(f"Single (1 process x {n * per_process} threads)", 1, n * per_process, None, n * per_process,
                note="all cores in one process")
        rows.append({"setup": f"DP({n})", "processes": 1, "note": explain_unavailable(0).split(". On")[0]})
        add(f"DDP({n}) ({n} processes x {per_process} thread{'s' * (per_process > 1)})", n, per_process, None,
            n * per_process)
        add(f"{n} processes without gradient all-reduce", n, per_process, None, n * per_process,
            {"sync_gradients": False}, note="the ceiling DDP could reach here: same cores and data, no all-reduce")
        notes.append("On a CPU a device is a core: DDP runs gloo processes, each bound to its own cores "
                     "(sched_setaffinity) with that many threads; the fair baseline is one process with the "
                     "threads of one DDP process. Memory is each process's peak resident memory (model, "
                     "framework and batches).")
        notes.append("The last row trains the same processes without DDP: the gap to it is what the gradient "
                     "all-reduce costs; its own gap to N x the baseline is the hardware's (cores sharing cache "
                     "and memory bandwidth) and the wait for the slower process at each step.")
        if cfg.batch_size == CPU_TABLE_BATCH:
            notes.append(f"Batch {CPU_TABLE_BATCH} per process: a step's fixed costs (the all-reduce, which a "
                         "one-core process cannot hide behind backward, and the wait for the slower rank) are "
                         "spread over more images "
                         "(`--batch-size 4` shows the preset's batch; chapter 9 measures the effect).")
    baseline = rows[0]["img/s"]
    for row in rows:
        if row.get("img/s") is not None:
            row["speedup"] = row["img/s"] / baseline
            row["scaling efficiency"] = row["speedup"] / row.pop("units")
    notes.append("speedup: img/s over the first row's; scaling efficiency: speedup / devices (cores or GPUs) used.")
    command = _call("bench.table", preset=preset, nprocs=nprocs, steps=steps, warmup=warmup, data_path=data_path,
                    max_seconds=max_seconds, **overrides)
    return BenchResult("table", "Speed table: one device, DataParallel and DDP", rows,
                       [c for c in TABLE_COLUMNS if any(r.get(c) is not None for r in rows)], notes,
                       provenance(command))


# --------------------------------------------------------------------------- sweeps


SWEEP_COLUMNS = ["setting", "img/s", "img/s all steps", "data ms", "compute ms", "peak MiB/device", "steps", "note"]


def _sweep(name: str, title: str, cfg: Config, settings: list[tuple[str, dict]], command: str,
           steps: int, warmup: int, max_seconds: float | None, skipped: list[tuple[str, str]] = (),
           process_per_setting: bool = False) -> BenchResult:
    """Measure each (label, knobs) setting in turn in one fresh worker process (or, where peak memory
    is the point, a fresh process per setting, so no setting inherits another's high-water mark);
    `skipped` rows say why a setting was not run. Each row keeps its `knobs` for `_knob_note`."""
    runs = [{**knobs, "steps": knobs.get("steps", steps), "warmup": warmup, "max_seconds": max_seconds}
            for _, knobs in settings]
    if process_per_setting:
        measurements = [_launch_measure(cfg, 1, [run])[0] for run in runs]
    else:
        measurements = _launch_measure(cfg, 1, runs) if runs else []
    rows = []
    for (label, knobs), measurement in zip(settings, measurements):
        rows.append({"setting": label, **measurement.row(), "note": "", "knobs": knobs})
        print(f"{name}: {label}: {rows[-1]['img/s']:.2f} img/s, peak {rows[-1]['peak MiB/device']:.0f} MiB", flush=True)
    rows += [{"setting": label, "note": why} for label, why in skipped]
    return BenchResult(name, title, rows, SWEEP_COLUMNS, [], provenance(command))


def _knob_note(rows: list[dict], knob: str, why_flat: str, key: str = "img/s", moves_with: tuple[str, ...] = ()) -> str:
    """How much `knob` changed `key` between rows that differ in nothing else (but the step count and
    the knobs that `moves_with` it); says why when it did not."""
    ignored = {knob, "steps", *moves_with}
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get(key) is not None and knob in row.get("knobs", {}):
            others = tuple(sorted((k, str(v)) for k, v in row["knobs"].items() if k not in ignored))
            groups.setdefault(others, []).append(row)
    spreads = [(max(r[key] for r in group) / min(r[key] for r in group) - 1, group)
               for group in groups.values() if len({str(r["knobs"][knob]) for r in group}) > 1]
    if not spreads:
        return f"{knob}: fewer than two settings measured here."
    spread, group = max(spreads, key=lambda item: item[0])
    if spread < NO_DIFFERENCE:
        return f"{knob} made no measurable difference to {key} here (at most {spread:.1%} apart): {why_flat}"
    best = max(group, key=lambda r: r[key]) if key.startswith("img/s") else min(group, key=lambda r: r[key])
    return f"{knob}: up to {spread:.0%} difference in {key} with the other knobs fixed; best of those: {best['setting']}."


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
    result = _sweep("loader", "DataLoader: num_workers x pin_memory x persistent_workers", cfg, settings,
                    _call("bench.sweep_loader", preset=preset, workers=workers, steps=steps, warmup=warmup,
                          data_path=data_path, max_seconds=max_seconds, **overrides), steps, warmup, max_seconds)
    rows = result.rows
    data_share = max(r["data ms"] / (r["data ms"] + r["compute ms"]) for r in rows)
    result.notes = [
        "data ms: median time a step waits for its batch; epoch-start data ms: the first batch of each "
        f"epoch (an epoch is {BENCH_SHAPES['n_train'] // cfg.batch_size} steps here), where non-persistent "
        "workers are started again; 'img/s all steps' includes those waits.",
        _knob_note(rows, "workers", f"loading takes at most {data_share:.0%} of a step in any setting, so the "
                   "loader is not the bottleneck on this small, cheap-to-decode data."),
        _knob_note(rows, "persistent_workers", "starting workers again costs little next to an epoch's "
                   "steps here.", key="img/s all steps"),
    ]
    if cuda:
        result.notes.append(_knob_note(rows, "pin_memory", "host-to-GPU copies of these small batches are "
                                       "fast either way."))
    else:
        result.notes.append("pin_memory was not measured: there is no GPU. Pinned (page-locked) memory only "
                            "speeds host-to-GPU copies (with non_blocking=True); without CUDA PyTorch ignores it.")
    if du.cpu_cores() <= 2:
        result.notes.append(f"With {du.cpu_cores()} cores, worker processes compete with the training threads "
                            "for the same cores; on a GPU machine the cores only feed the GPUs and gain more.")
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
        skipped.append(("fp16 autocast + GradScaler", "needs CUDA: float16 training with GradScaler is a GPU "
                        "technique (tensor cores); CPUs use bfloat16"))
    if cuda or cpu_has_bf16() is not False or force_bf16:
        settings.append(("bf16 autocast", {"amp": True, "amp_dtype": "bfloat16"}))
    else:
        skipped.append(("bf16 autocast", "not measured: this CPU has no bfloat16 instructions (avx512_bf16 or "
                        "AMX), so bf16 is emulated and many times slower than fp32 (force_bf16=True measures it)"))
    result = _sweep("amp", "Mixed precision: fp32 / fp16 / bf16", cfg, settings,
                    _call("bench.sweep_amp", preset=preset, steps=steps, warmup=warmup, data_path=data_path,
                          max_seconds=max_seconds, force_bf16=force_bf16 or None, **overrides),
                    steps, warmup, max_seconds, skipped)
    result.notes.append(_knob_note(result.rows, "amp_dtype", "this model's step is not limited by the "
                                   "precision of its math on this hardware."))
    if not cuda:
        result.notes.append("Memory: a CPU process's peak resident memory includes the framework and the model; "
                            "the activations autocast shrinks are a smaller share of it than on a GPU.")
    return result


def sweep_cudnn(preset: str | None = None, steps: int = 16, warmup: int = 3, data_path: str | None = None,
                max_seconds: float | None = None, **overrides) -> BenchResult:
    """cudnn.benchmark off/on with fixed (square) vs varying (multi-scale) image sizes."""
    cfg = bench_config(preset, data_path, **overrides)
    cuda = torch.cuda.is_available()
    settings = [(f"{shape} sizes" + (f", cudnn.benchmark={flag}" if cuda else ""),
                 {"shape": shape, "cudnn_benchmark": flag})
                for shape in ("fixed", "varying") for flag in ((False, True) if cuda else (False,))]
    result = _sweep("cudnn", "cudnn.benchmark with fixed and varying image sizes", cfg, settings,
                    _call("bench.sweep_cudnn", preset=preset, steps=steps, warmup=warmup, data_path=data_path,
                          max_seconds=max_seconds, **overrides), steps, warmup, max_seconds)
    sizes = ", ".join(map(str, multiscale_sizes(cfg.min_size)))
    result.notes = [f"fixed: every image resized to {cfg.min_size}x{cfg.min_size} (one input shape); varying: "
                    f"multi-scale training, the shorter side drawn from {sizes} px per image with natural "
                    "aspect ratios (new padded shapes on many steps). 'img/s all steps' includes the steps "
                    "that met a new shape."]
    if cuda:
        result.notes.append(_knob_note(result.rows, "cudnn_benchmark", "autotuning finds no faster kernels "
                                       "for these shapes.", key="img/s all steps"))
    else:
        result.notes.append("cudnn.benchmark was not measured: a CPU has no cuDNN, so the flag does nothing. "
                            "CPU convolutions run through oneDNN, which builds and caches a primitive for each "
                            "input shape: the CPU's counterpart of the per-shape cost of cuDNN autotuning, "
                            "measured here as fixed against varying sizes (varying sizes also change the work "
                            "per image, about equal on average).")
    result.notes.append(_knob_note(result.rows, "shape", "per-shape setup is small next to a step at these "
                                   "sizes.", key="img/s all steps"))
    return result


def sweep_accum(preset: str | None = None, accum_steps: tuple[int, ...] = (1, 2, 4), steps: int = 12,
                warmup: int = 2, data_path: str | None = None, max_seconds: float | None = None,
                **overrides) -> BenchResult:
    """K micro-batches per optimizer step against one batch of the same K x B images."""
    cfg = bench_config(preset, data_path, **overrides)
    b = cfg.batch_size
    settings = []
    for k in accum_steps:
        settings.append((f"batch {b} x accum {k} ({b * k} images/step)",
                         {"accum_steps": k, "batch_size": b, "steps": max(4, steps // k)}))
        if k > 1:
            settings.append((f"batch {b * k} x accum 1 ({b * k} images/step)",
                             {"accum_steps": 1, "batch_size": b * k, "steps": max(4, steps // k)}))
    result = _sweep("accum", "Gradient accumulation: throughput and memory", cfg, settings,
                    _call("bench.sweep_accum", preset=preset, accum_steps=accum_steps, steps=steps, warmup=warmup,
                          data_path=data_path, max_seconds=max_seconds, **overrides), steps, warmup, max_seconds,
                    process_per_setting=True)
    by_knobs = {(r["knobs"]["batch_size"], r["knobs"]["accum_steps"]): r for r in result.rows}
    result.notes = ["Accumulation holds one micro-batch's activations whatever K is; the same images in one "
                    "batch hold all of theirs at once. Each setting ran in a fresh process."]
    for k in (k for k in accum_steps if k > 1):
        acc, one = by_knobs[(b, k)], by_knobs[(b * k, 1)]
        result.notes.append(
            f"{b * k} images per step: {k} micro-batches of {b} peaked at {acc['peak MiB/device']} MiB against "
            f"{one['peak MiB/device']} MiB in one batch ({1 - acc['peak MiB/device'] / one['peak MiB/device']:.0%} "
            f"less), at {acc['img/s'] / one['img/s']:.2f}x its img/s.")
    return result


def sweep_size(preset: str | None = None, sizes: tuple[int, ...] | None = None, steps: int = 10, warmup: int = 2,
               data_path: str | None = None, max_seconds: float | None = None, **overrides) -> BenchResult:
    """Image size (square inputs) against img/s and peak memory."""
    cfg = bench_config(preset, data_path, **overrides)
    sizes = sizes or ((512, 640, 800, 1024) if torch.cuda.is_available() else (96, 128, 192, 256))
    settings = [(f"{s} px", {"min_size": s, "max_size": s, "shape": "fixed"}) for s in sizes]
    result = _sweep("size", "Image size against memory and throughput", cfg, settings,
                    _call("bench.sweep_size", preset=preset, sizes=sizes, steps=steps, warmup=warmup,
                          data_path=data_path, max_seconds=max_seconds, **overrides), steps, warmup, max_seconds,
                    process_per_setting=True)
    result.notes = ["Every image resized to size x size: pixels, compute and activation memory grow with the "
                    "square of the size (memory.memory_table breaks the memory down).",
                    _knob_note(result.rows, "min_size", "", key="peak MiB/device", moves_with=("max_size",)),
                    _knob_note(result.rows, "min_size", "", moves_with=("max_size",))]
    return result


def sweep_channels_last(preset: str | None = None, steps: int = 16, warmup: int = 3,
                        data_path: str | None = None, max_seconds: float | None = None, **overrides) -> BenchResult:
    """The backbone in NCHW (default) against NHWC (channels_last)."""
    cfg = bench_config(preset, data_path, **overrides)
    settings = [(f"channels_last={flag}", {"channels_last": flag}) for flag in (False, True)]
    result = _sweep("channels_last", "Memory format: NCHW vs channels_last", cfg, settings,
                    _call("bench.sweep_channels_last", preset=preset, steps=steps, warmup=warmup, data_path=data_path,
                          max_seconds=max_seconds, **overrides), steps, warmup, max_seconds)
    why = ("the convolutions are not what limits this step." if torch.cuda.is_available() else
           "on a CPU oneDNN reorders tensors into its own blocked layout either way.")
    result.notes.append(_knob_note(result.rows, "channels_last", why))
    return result


SWEEPS: dict[str, Callable[..., BenchResult]] = {
    "loader": sweep_loader, "amp": sweep_amp, "cudnn": sweep_cudnn, "accum": sweep_accum,
    "size": sweep_size, "channels-last": sweep_channels_last,
}


# --------------------------------------------------------------------------- the GPU suite


def results_path(results_dir: Path | str, prov: dict) -> Path:
    """`<results_dir>/<hardware>-<date>.json`, the hardware label made file-name safe."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", prov["hardware"]).strip("-").lower()
    return Path(results_dir) / f"{slug}-{prov['date'][:10]}.json"


#: (name, share of the time budget, settings measured) of the GPU suite, in running order.
GPU_SUITE_PARTS = [("table", 0.4, 3), ("amp", 0.2, 3), ("cudnn", 0.25, 4), ("channels_last", 0.15, 2)]
#: Seconds a part needs besides its measured steps: process start, CUDA init, model build, warm-up.
STARTUP_S = 30


def gpu_suite(max_minutes: float = 8.0, results_dir: Path | str = "book/results", steps: int = 20,
              warmup: int = 5) -> Path:
    """One bounded run on a GPU machine: the table on every GPU, AMP fp32/fp16/bf16, cudnn.benchmark
    and channels_last, R50-FPN (gpu-r50) at 800 px; writes `<results_dir>/<hardware>-<date>.json`."""
    if not torch.cuda.is_available():
        raise BenchError("--suite gpu needs CUDA GPUs and this machine has none; on a CPU run "
                         "`python -m maskrcnn_tut.bench table` (and the sweeps) instead")
    runners = {"table": table, "amp": sweep_amp, "cudnn": sweep_cudnn, "channels_last": sweep_channels_last}
    deadline = time.monotonic() + 60 * max_minutes
    results, skipped = {}, []
    for name, share, n_settings in GPU_SUITE_PARTS:
        budget = min(share * 60 * max_minutes, deadline - time.monotonic())
        if budget < 2 * STARTUP_S:
            skipped.append(name)
            continue
        per_setting = max((budget - STARTUP_S * (3 if name == "table" else 1)) / n_settings, 5.0)
        try:
            results[name] = runners[name]("gpu-r50", steps=steps, warmup=warmup, max_seconds=per_setting).to_dict()
        except Exception as err:  # keep what the other parts measured; record what failed
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    prov = provenance(f"python -m maskrcnn_tut.bench --suite gpu --max-minutes {max_minutes:g}")
    prov["skipped_for_time"] = skipped
    path = results_path(results_dir, prov)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"provenance": prov, "results": results}, indent=2) + "\n")
    return path


def load_suite(path: Path | str) -> tuple[dict, dict[str, BenchResult]]:
    """A `gpu_suite` file: (provenance, {name: BenchResult}) of the parts that ran."""
    data = json.loads(Path(path).read_text())
    return data["provenance"], {name: BenchResult.from_dict(result) for name, result in data["results"].items()
                                if "error" not in result}


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m maskrcnn_tut.bench",
        description="Measure the article's speed table and the technique sweeps on this machine.")
    parser.add_argument("--suite", choices=["gpu"], help="one bounded run of everything on a GPU machine")
    parser.add_argument("--max-minutes", type=float, default=8.0, help="time budget of --suite gpu")
    parser.add_argument("--results-dir", default="book/results", help="where --suite gpu writes its JSON")
    commands = parser.add_subparsers(dest="command", metavar="NAME")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", help="cpu-tiny or gpu-r50 (default: by hardware)")
    common.add_argument("--data-path", help="COCO root (default: the benchmark's shapes data)")
    common.add_argument("--steps", type=int, help="measured steps (after warm-up)")
    common.add_argument("--warmup", type=int, help="warm-up steps, not measured")
    common.add_argument("--batch-size", type=int, help="images per process (per GPU) and step")
    common.add_argument("--min-size", type=int, help="shorter image side in pixels")
    common.add_argument("--max-size", type=int, help="longer image side cap in pixels")
    common.add_argument("--out", help="write the result as JSON to this file")
    common.add_argument("--plot", help="save the result's plot to this image file")
    table_cmd = commands.add_parser("table", parents=[common], help="Single / DP(N) / DDP(N) speed table")
    table_cmd.add_argument("--nprocs", type=int, help="N (default: GPUs present, else CPU cores)")
    for name, sweep in SWEEPS.items():
        commands.add_parser(name, parents=[common], help=sweep.__doc__.splitlines()[0])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    command = "python -m maskrcnn_tut.bench " + shlex.join(argv)
    try:
        if args.suite == "gpu":
            path = gpu_suite(args.max_minutes, args.results_dir)
            print(f"wrote {path}")
            return 0
        if args.command is None:
            build_parser().print_help()
            return 2
        names = ("preset", "data_path", "steps", "warmup", "batch_size", "min_size", "max_size", "nprocs")
        options = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
        result = (table if args.command == "table" else SWEEPS[args.command])(**options)
    except (BenchError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result.provenance["command"] = command
    print(result.to_markdown())
    if args.out:
        print(f"wrote {result.save(args.out)}")
    if args.plot:
        result.plot().savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
