"""The speed table (`table`): one device, DataParallel and DDP on this machine, and how they scale.

On GPUs the rows are Single GPU, DP(N) and DDP(N) for the N GPUs present; with one GPU the DP and
DDP rows are there, unmeasured, with a note saying why (`BenchResult.row("DDP")` is then None).
On CPUs a device is a core: DDP(N) is N gloo processes, compared with one process with the threads
of one DDP process (the fair baseline), one process with all the cores, and the same N processes
without the gradient all-reduce (the ceiling DDP could reach).
"""
from __future__ import annotations

import torch

from ...errors import BenchError
from ...hardware import usable_cores
from ..dataparallel import explain_unavailable
from ..machine import provenance
from .harness import bench_config, launch_measure
from .results import BenchResult, python_call

TABLE_COLUMNS = ["setup", "processes", "threads/process", "GPUs", "img/s", "peak MiB/device", "total MiB",
                 "speedup", "scaling efficiency", "note"]
#: Images per process in the CPU speed table: twice the preset's, because a step's fixed costs
#: (the last bucket's all-reduce and the wait for the slower rank) weigh less on more images, so
#: the table shows DDP's scaling rather than its fixed costs (docs/measurements.md has both
#: batches' figures). The GPU table keeps the preset's batch.
CPU_TABLE_BATCH = 8


def _ddp_unavailable(gpus: int) -> str:
    return (f"DDP needs >= 2 GPUs; this machine has {gpus}. On N GPUs `torchrun --nproc_per_node=N` runs one "
            "process per GPU, each with its own batch, and all-reduces the gradients during backward.")


def table(preset: str | None = None, nprocs: int | None = None, steps: int = 16, warmup: int = 3,
          data_path: str | None = None, max_seconds: float | None = None, **overrides) -> BenchResult:
    """The article's speed table for this machine (rows: module docstring); `overrides` are Config
    fields (e.g. batch_size=2, min_size=96). On CPUs the batch defaults to `CPU_TABLE_BATCH`.

    nprocs: N (default: the GPUs present, else the usable cores). On CPUs N may exceed the cores
    (the processes then share them); on GPUs it may not exceed the GPUs.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cores = usable_cores()
    n = nprocs or gpus or cores
    if n < 1:
        raise BenchError(f"nprocs must be at least 1, got {nprocs}")
    if gpus and n > gpus:
        raise BenchError(f"nprocs={n}: this machine has {gpus} GPU(s), and the table runs one process per GPU")
    if not gpus and overrides.get("batch_size") is None:
        overrides["batch_size"] = CPU_TABLE_BATCH
    cfg = bench_config(preset, data_path, batches_per_step=n, **overrides)
    run = {"steps": steps, "warmup": warmup, "max_seconds": max_seconds}
    rows: list[dict] = []

    def add(setup: str, nprocs_: int, threads: int | None, n_gpus: int | None, units: int,
            extra: dict | None = None, note: str = "") -> None:
        measurement = launch_measure(cfg, nprocs_, [dict(run, **(extra or {}))], threads)[0]
        row = {"setup": setup, "processes": nprocs_, "threads/process": measurement.threads if not gpus else None,
               "GPUs": n_gpus, **measurement.row(), "units": units, "note": note}
        rows.append(row)
        print(f"table: {setup}: {row['img/s']:.2f} img/s, peak {row['peak MiB/device']:.0f} MiB per device", flush=True)

    notes = [f"{cfg.preset} preset ({cfg.backbone}-FPN, {cfg.min_size} px, batch {cfg.batch_size} per "
             f"{'GPU' if gpus else 'process'}) on shapes batches through engine.train_step, with the lr scaled to "
             f"each row's global batch as train.py does (config.derive); img/s at the median of {steps} measured "
             f"steps after {warmup} warm-up steps (slowest rank)."]
    if gpus:
        add("Single GPU", 1, None, 1, 1)
        if n >= 2:
            add(f"DP({n})", 1, None, n, n, {"dataparallel": n})
            add(f"DDP({n})", n, None, n, n)
        else:
            asked = f"not measured: nprocs=1 ({gpus} GPUs here)"
            rows.append({"setup": "DP", "note": asked if gpus >= 2 else explain_unavailable(gpus)})
            rows.append({"setup": "DDP", "note": asked if gpus >= 2 else _ddp_unavailable(gpus)})
            notes.append("Only the single-GPU row was measured: " + (
                "nprocs=1." if gpus >= 2 else f"DP and DDP need >= 2 GPUs and this machine has {gpus}; their "
                "rows say what each would do."))
        notes.append("Memory is the CUDA allocator's peak per GPU (nvidia-smi shows more: the CUDA "
                     "context and the allocator's cache).")
    else:
        per_process = max(1, cores // n)
        s = "s" * (per_process > 1)
        add(f"Single (1 process x {per_process} thread{s})", 1, per_process, None, per_process,
            note="baseline: the threads of one DDP process")
        all_threads = min(n * per_process, cores)
        if all_threads > per_process:
            add(f"Single (1 process x {all_threads} threads)", 1, all_threads, None, all_threads,
                note="all cores in one process")
        rows.append({"setup": f"DP({n})", "processes": 1, "note": explain_unavailable(0).split(". On")[0]})
        if n >= 2:
            used = min(n * per_process, cores)
            add(f"DDP({n}) ({n} processes x {per_process} thread{s})", n, per_process, None, used)
            add(f"{n} processes without gradient all-reduce", n, per_process, None, used,
                {"sync_gradients": False}, note="the ceiling DDP could reach here: same cores and data, no all-reduce")
        else:
            rows.append({"setup": "DDP", "note": "DDP needs >= 2 processes; this machine has 1 usable core "
                         "(nprocs=2 runs two processes on it)"})
        notes.append("On a CPU a device is a core: DDP runs gloo processes, each bound to its own cores "
                     "(sched_setaffinity) with that many threads; the fair baseline is one process with the "
                     "threads of one DDP process. Memory is each process's peak resident memory (model, "
                     "framework and batches).")
        if n >= 2:
            notes.append("The last row trains the same processes without DDP: the gap to it is what the gradient "
                         "all-reduce costs; its own gap to N x the baseline is the processes' own work, slower when "
                         "every core computes (shared caches, memory bandwidth or clocks), and the wait for the "
                         "slower process at each step.")
        if n * per_process > cores:
            notes.append(f"{n} processes share {cores} usable cores, so they take turns on them: these rows show "
                         "what DDP costs, not how it scales (scaling efficiency counts the cores used).")
        if cfg.batch_size == CPU_TABLE_BATCH:
            notes.append(f"Batch {CPU_TABLE_BATCH} per process: a step's fixed costs (the last gradient "
                         "bucket's all-reduce and the wait for the slower rank) "
                         "are spread over more images "
                         "(`--batch-size 4` shows the preset's batch; chapter 9 measures the effect).")
    baseline = rows[0]["img/s"]
    for row in rows:
        if row.get("img/s") is not None:
            row["speedup"] = row["img/s"] / baseline
            row["scaling efficiency"] = row["speedup"] / row.pop("units")
    notes.append("speedup: img/s over the first row's; scaling efficiency: speedup / devices (cores or GPUs) used.")
    command = python_call("bench.table", preset=preset, nprocs=nprocs, steps=steps, warmup=warmup,
                          data_path=data_path, max_seconds=max_seconds, **overrides)
    return BenchResult("table", "Speed table: one device, DataParallel and DDP", rows,
                       [c for c in TABLE_COLUMNS if any(r.get(c) is not None for r in rows)], notes,
                       provenance(command))


def single_device_speed(preset: str | None = None, steps: int = 12, warmup: int = 3,
                        max_seconds: float | None = 20.0) -> BenchResult:
    """The preset's training speed on one device (one GPU, or one process using every usable CPU
    core), in a fresh process through `bench.launch_measure`: one row, "one device"."""
    cfg = bench_config(preset)
    measurement = launch_measure(cfg, 1, [{"steps": steps, "warmup": warmup, "max_seconds": max_seconds}])[0]
    row = {"setup": "one device", "preset": f"{cfg.preset} ({cfg.backbone}-FPN, {cfg.min_size} px)",
           **measurement.row()}
    return BenchResult("single_device_speed", "Training speed on one device", [row],
                       ["setup", "preset", "img/s", "steps", "peak MiB/device"], [],
                       provenance(python_call("bench.single_device_speed", preset=preset, steps=steps,
                                              warmup=warmup, max_seconds=max_seconds)))
