"""Benchmarks: the article's speed table and the technique sweeps, measured on this machine.

API (each returns a `BenchResult` of `lab.stored.result`: `.rows`, `.row(prefix)`, `.notes`, `.provenance`,
`.to_markdown()`, `.plot()`, `.save(path)`; `BenchResult.load(path)` reads one back). The shell
runs the same functions: `python -m maskrcnn_tut.lab.bench NAME [--out FILE] [--plot PNG]`.

- `table()`: rows Single, DP(N), DDP(N) for the N devices present: img/s, peak memory per device,
  total memory, speedup, scaling efficiency. On CPUs a device is a core: DDP(N) is N gloo
  processes x 1 thread, compared with one process x 1 thread (the fair baseline) and one process
  x N threads; DP is marked as needing >= 2 GPUs, and on one GPU so is DDP (`result.row("DDP")`
  is then None).
- `sweep_loader()`, `sweep_amp()`, `sweep_cudnn()`, `sweep_accum()`, `sweep_size()`,
  `sweep_channels_last()`, `sweep_fast_path()`: one technique each (`SWEEPS` by command name).
- `overhead()`: what train.py's loop adds over the bare model step, in alternating rounds on one model.
- `pipeline()`: the whole loop with the DataLoader's workers on real files against the bare step on the
  same batches and weights, with the CPU the training process and the workers use (`worker_cost()`:
  the workers alone, per image, and where an image's time goes).
- `time_to_accuracy()`: the main job with and without the fast path, training seconds to a target AP.
- `gpu_suite(max_minutes=8)`: the table on every GPU, AMP, cudnn.benchmark, channels_last and the fast
  path with R50-FPN at 800 px, bounded in time; writes `book/results/<hardware>-<date>.json`
  (`python -m maskrcnn_tut.lab.bench --suite gpu --max-minutes 8`). `load_suite(path)` reads it;
  `show_gpu_results(folder, parts)` shows the committed files as chapters 5, 6 and 8 do, each labelled with
  what kind of figures it holds and worded by `gpu_files` (nothing ranks the settings of a file whose rows
  do not leave their new-shape steps out: `gpu_files.gpu_file_is_steady`).
- `measure(cfg, steps, warmup)`: the measurement underneath, in this process (callbacks get every
  `StepRecord`, e.g. `dashboard.LiveDashboard`); `bench_config(...)` the config it measures.

How it measures: the real Mask R-CNN of the preset (`cpu-tiny` on CPUs, `gpu-r50` on GPUs) trains
on shapes-dataset batches through `engine.train_step`, the step `train.py` runs, with the settings
`config.derive` resolves for train.py (global batch, scaled lr, pin_memory, precision). Warm-up
steps are excluded; img/s is images per step over the median step time of the slowest rank; peak
memory is the CUDA allocator's peak per GPU, or each process's peak resident memory on CPU. Every
table row and every sweep runs in fresh worker processes started by `processes.launch`, each with
its thread count set (`torch.set_num_threads`, OMP_NUM_THREADS) and, on CPUs, bound to cores of its
own, so results do not depend on what the calling notebook did before. Results carry hardware
provenance (`provenance.provenance`: CPU, cores, GPUs, torch / CUDA / cuDNN / NCCL versions, date,
command) and say when a knob made no difference here, and why. Every public function also takes
Config fields as keyword overrides (`table(batch_size=8)`, `sweep_amp(min_size=96)`).

Modules: `harness` (the measurement and its worker processes), `scaling` (the speed table,
`table`), `sweeps`, `gpu` (the GPU suite), `gpu_files` (its committed files, labelled and worded for
the chapters), `cli` (the shell), `overhead`, `pipeline` (the loop with its loader), `accuracy` (time
to accuracy), `profile` (what a step's host time goes to),
`projection` (the article's table taken apart, scaling on paper, `scaling_curve`, days for COCO),
`coco_scale` (start-up time and memory at COCO scale), `peer` (the package beside torchvision's detection
reference, same data and machine, both in steady state). A result records its sentences as their
catalog keys and values (`wording.english`), which the book words in its own language (`wording.shown`).
`single_device_speed()` is one
device's speed (chapter 1). What a benchmark returns and the caches that keep it are in `lab/stored/`
(`result`, `across_builds.cached`, `within_build.once`).
"""
from ..wording import above, interval, versus
from . import gpu_files, projection
from .accuracy import time_to_accuracy
from .cli import build_parser, main
from .gpu import gpu_suite
from .gpu_files import show_gpu_results
from .harness import (
    BENCH_SHAPES,
    Measurement,
    bench_config,
    bench_dataset,
    cpu_repeated_losses,
    environment,
    launch_measure,
    measure,
    measure_worker,
    multiscale_sizes,
    pin_cores,
    repeated_losses,
    step_rows,
    training_losses,
)
from .overhead import overhead
from .pipeline import pipeline, worker_cost, workers_alone
from .projection import scaling_curve
from .scaling import CPU_TABLE_BATCH, TABLE_COLUMNS, single_device_speed, table
from .sweeps import (
    NO_DIFFERENCE,
    SWEEP_COLUMNS,
    SWEEPS,
    knob_note,
    sweep_accum,
    sweep_amp,
    sweep_channels_last,
    sweep_cudnn,
    sweep_fast_path,
    sweep_loader,
    sweep_size,
)

__all__ = [
    "BENCH_SHAPES", "CPU_TABLE_BATCH", "NO_DIFFERENCE", "SWEEPS", "SWEEP_COLUMNS", "TABLE_COLUMNS",
    "Measurement", "bench_config", "bench_dataset", "build_parser", "environment", "gpu_suite", "knob_note",
    "launch_measure", "main", "measure", "measure_worker", "multiscale_sizes",
    "overhead", "pipeline", "worker_cost", "workers_alone",
    "pin_cores", "show_gpu_results", "sweep_accum", "sweep_amp", "sweep_channels_last", "sweep_cudnn",
    "sweep_fast_path", "sweep_loader", "sweep_size", "table",
    "above", "gpu_files", "interval", "projection", "scaling_curve",
    "versus",
    "time_to_accuracy", "single_device_speed", "cpu_repeated_losses", "repeated_losses", "step_rows", "training_losses",
]
