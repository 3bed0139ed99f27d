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
from ..provenance import provenance
from ..stored.result import BenchResult, python_call
from ..wording import english, say, shown
from .harness import bench_config, launch_measure

TABLE_COLUMNS = ["setup", "processes", "threads/process", "GPUs", "img/s", "peak MiB/device", "total MiB",
                 "speedup", "scaling efficiency", "note"]
#: Images per process in the CPU speed table: twice the preset's, because a step's fixed costs
#: (the last bucket's all-reduce and the wait for the slower rank) weigh less on more images, so
#: the table shows DDP's scaling rather than its fixed costs (docs/measurements.md has both
#: batches' figures). The GPU table keeps the preset's batch.
CPU_TABLE_BATCH = 8


def _ddp_unavailable(gpus: int) -> str:
    return english("bench.ddp_needs_gpus", gpus=gpus)


def _threads(one: str, many: str, threads: int, **values) -> str:
    """A setup's label, "thread" (catalog key `one`) or "threads" (`many`) by the count."""
    return english(many if threads > 1 else one, threads=threads, **values)


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
        print(say("bench.table_progress", setup=shown(setup), speed=row["img/s"], mb=row["peak MiB/device"]), flush=True)

    notes = [english("bench.table_setup", preset=cfg.preset, backbone=cfg.backbone, min_size=cfg.min_size,
                     batch=cfg.batch_size, unit="GPU" if gpus else "process", steps=steps, warmup=warmup)]
    if gpus:
        add("Single GPU", 1, None, 1, 1)
        if n >= 2:
            add(f"DP({n})", 1, None, n, n, {"dataparallel": n})
            add(f"DDP({n})", n, None, n, n)
        else:
            asked = english("bench.not_measured_nprocs", gpus=gpus)
            rows.append({"setup": "DP", "note": asked if gpus >= 2 else english("dataparallel.unavailable", gpus=gpus)})
            rows.append({"setup": "DDP", "note": asked if gpus >= 2 else _ddp_unavailable(gpus)})
            notes.append(english("bench.single_gpu_only_nprocs") if gpus >= 2 else
                         english("bench.single_gpu_only", gpus=gpus))
        notes.append(english("bench.table_gpu_memory"))
    else:
        per_process = max(1, cores // n)
        add(_threads("bench.single_thread", "bench.single_threads", per_process), 1, per_process, None, per_process,
            note=english("bench.baseline"))
        all_threads = min(n * per_process, cores)
        if all_threads > per_process:
            add(_threads("bench.single_thread", "bench.single_threads", all_threads), 1, all_threads, None,
                all_threads, note=english("bench.all_cores"))
        rows.append({"setup": f"DP({n})", "processes": 1, "note": english("dataparallel.needs_gpus", gpus=0)})
        if n >= 2:
            used = min(n * per_process, cores)
            add(_threads("bench.ddp_thread", "bench.ddp_threads", per_process, n=n), n, per_process, None, used)
            add(english("bench.without_allreduce", n=n), n, per_process, None, used,
                {"sync_gradients": False}, note=english("bench.ceiling"))
        else:
            rows.append({"setup": "DDP", "note": english("bench.ddp_needs_processes")})
        notes.append(english("bench.table_cpu"))
        if n >= 2:
            notes.append(english("bench.table_last_row"))
        if n * per_process > cores:
            notes.append(english("bench.table_shared_cores", n=n, cores=cores))
        if cfg.batch_size == CPU_TABLE_BATCH:
            notes.append(english("bench.table_batch", batch=CPU_TABLE_BATCH))
    baseline = rows[0]["img/s"]
    for row in rows:
        if row.get("img/s") is not None:
            row["speedup"] = row["img/s"] / baseline
            row["scaling efficiency"] = row["speedup"] / row.pop("units")
    notes.append(english("bench.table_speedup"))
    command = python_call("lab.bench.table", preset=preset, nprocs=nprocs, steps=steps, warmup=warmup,
                          data_path=data_path, max_seconds=max_seconds, **overrides)
    return BenchResult("table", english("bench.table_title"), rows,
                       [c for c in TABLE_COLUMNS if any(r.get(c) is not None for r in rows)], notes,
                       provenance(command))


def single_device_speed(preset: str | None = None, steps: int = 12, warmup: int = 3,
                        max_seconds: float | None = 20.0) -> BenchResult:
    """The preset's training speed on one device (one GPU, or one process using every usable CPU
    core), in a fresh process through `bench.launch_measure`: one row, "one device"."""
    cfg = bench_config(preset)
    measurement = launch_measure(cfg, 1, [{"steps": steps, "warmup": warmup, "max_seconds": max_seconds}])[0]
    row = {"setup": english("bench.one_device"), "preset": f"{cfg.preset} ({cfg.backbone}-FPN, {cfg.min_size} px)",
           **measurement.row()}
    return BenchResult("single_device_speed", english("bench.single_device_title"), [row],
                       ["setup", "preset", "img/s", "steps", "peak MiB/device"], [],
                       provenance(python_call("lab.bench.single_device_speed", preset=preset, steps=steps,
                                              warmup=warmup, max_seconds=max_seconds)))
