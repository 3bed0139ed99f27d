"""The whole loop with the DataLoader's workers running, against the bare model step on the same
batches (`python -m maskrcnn_tut.lab.bench pipeline`).

`overhead` feeds batches already in memory, so it cannot see what the loader's workers cost: on a
machine with few cores their decoding, masks and transforms run on the cores the training threads
use, and every step pays for that CPU time even when the loader is never waited for. Here one model
trains in alternating rounds on real files:

- `train.py's loop`: batches from the DataLoader (its workers reading the image files),
  `engine.train_step`, the schedule, the metrics logger and the straggler check, as train.py calls them;
- `bare`: forward, summed losses, backward, optimizer step (and the lr schedule's step) on the very
  batches that round's loop drew, already converted and in memory, with the workers idle.

Per step it records the wall time and the training process's CPU seconds (all its threads), and per
loop round the workers' CPU seconds (`/proc/<pid>/stat`). `worker_cost` measures the workers alone:
one epoch of the loader with no model, their CPU seconds per image, and where one image's time goes
(decode, masks, transforms, and the copy into shared memory that sends it), timed piece by piece in
this process; masks are what loading with them costs over loading without. Each figure comes with
the dataset's own make-up (instances per image): a cut shows only against the same data.
"""
from __future__ import annotations

import copy
import itertools
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from ... import distributed as du
from ...config import derive, make_config
from ...data.device_decode import apply_transforms
from ...data.loader import batch_stream, build_dataset, build_train_loader, end_workers, to_device, worker_count
from ...data.packing import pack
from ...engine import TrainState, after_step
from ...monitor import MetricsLogger, StragglerCheck
from ..provenance import provenance
from ..rig import build_rig, shapes_config
from ..stored.result import BenchResult, python_call
from ..wording import english

LOOPS = ("train.py's loop, workers running", "bare step, same batches")


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux's /proc), or None where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def workers_cpu_seconds(loader) -> float | None:
    """CPU seconds the loader's current worker processes have used (None with no workers or no /proc)."""
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None) or []
    seconds = [process_cpu_seconds(worker.pid) for worker in workers]
    return sum(seconds) if seconds and None not in seconds else None


def _settings(preset, data_path, workers, batch_size, **overrides):
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if data_path is None:  # the lab's shapes data, written as real PNG files and a COCO json
        return shapes_config(preset, workers=workers, batch_size=batch_size, **overrides)
    return make_config(preset, data_path=str(data_path), progress=False,
                       **{k: v for k, v in dict(workers=workers, batch_size=batch_size, **overrides).items()
                          if v is not None})


def worker_cost(preset: str | None = None, data_path: str | None = None, workers: int | None = None,
                batch_size: int | None = None, images: int = 400, **overrides) -> dict:
    """The workers' cost per image with no model running: their CPU seconds per image over `images`
    images through the training loader (epoch after epoch) and the training process's, receiving
    them; then one epoch's decode, masks, transforms and pack timed piece by piece in this process
    (seconds per image; here masks are also transposed, which a worker's pack does instead)."""
    cfg = _settings(preset, data_path, workers, batch_size, **overrides)
    run = derive(cfg, 1, du.init_distributed().device)
    dataset = build_dataset(run, "train")
    loader = build_train_loader(dataset, run, 0, 1)
    batches = batch_stream(loader, TrainState())
    first = workers_cpu_seconds(next(batches) and loader)  # the workers' start-up is not an image's cost
    drawn, cpu, main = 0, None, time.process_time()
    for images_, _ in itertools.islice(batches, max(1, images // run.batch_size)):
        drawn += len(images_)
        cpu = workers_cpu_seconds(loader)
    main = time.process_time() - main
    batches.close()
    end_workers(loader)
    cpu = None if cpu is None or first is None else cpu - first
    pieces = {"decode": 0.0, "masks": 0.0, "transforms": 0.0, "pack": 0.0}
    count = len(dataset)
    for index in range(count):
        started = time.perf_counter()
        dataset.load(index, with_masks=False)
        decoded = time.perf_counter()
        image, target = dataset.load(index)
        loaded = time.perf_counter()
        sample = apply_transforms(dataset.transforms, image, target, index) if dataset.transforms else (image, target)
        transformed = time.perf_counter()
        pack(tuple(zip(sample)))
        pieces["decode"] += decoded - started
        pieces["masks"] += max(0.0, loaded - decoded - (decoded - started))
        pieces["transforms"] += transformed - loaded
        pieces["pack"] += time.perf_counter() - transformed
    return {"worker cpu s/image": None if cpu is None else cpu / drawn, "main cpu s/image": main / drawn, "images": drawn,
            **{f"{name} s/image": seconds / count for name, seconds in pieces.items()}}


def _timed(step, device) -> tuple[float, float]:
    """Wall and process-CPU seconds of `step()`, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


class PairedLoops:
    """One model trained in turns by train.py's loop (batches from the loader's workers) and by the bare
    step (the very batches that loop drew, already in memory). Keeps each loop's step times, process
    CPU seconds and losses, the workers' CPU seconds per step and each round's first-pair loss gap."""

    def __init__(self, rig, logger: MetricsLogger) -> None:
        self.rig, self.logger = rig, logger
        self.stragglers, self.stop = StragglerCheck(every=rig.cfg.print_freq), threading.Event()
        self.stream = rig.batches
        self.drawn: list = []  # the batches the loop drew (through `rig.batches`) since it was last cleared
        self.losses = {name: [] for name in LOOPS}  # each step's loss: a pair's two must agree (the same work)
        self.wall = {name: [] for name in LOOPS}
        self.cpu = {name: [] for name in LOOPS}
        self.worker_cpu: list[float] = []
        self.gaps: list[float] = []

    def rewind(self, position: TrainState) -> None:
        """Draw again from `position`: the same batches, through the same workers."""
        self.stream.close()
        self.rig.state.__dict__.update(copy.copy(position).__dict__)
        self.stream = batch_stream(self.rig.loader, self.rig.state)
        self.rig.batches = (self.drawn.append(batch) or batch for batch in self.stream)

    def loop_step(self) -> None:
        """One step as train.py's loop takes it: the step, then `engine.after_step` as train.py calls it."""
        rig = self.rig
        record = rig.step(stop_requested=self.stop.is_set())
        self.losses[LOOPS[0]].append(record.loss)
        after_step(rig.scheduler, [record], (self.logger, self.stragglers))

    def bare_step(self, batch) -> None:
        """Forward, summed losses, backward, optimizer step and the schedule's step: nothing else."""
        rig = self.rig
        loss = sum(rig.model(*batch).values())
        loss.backward()
        rig.optimizer.step()
        rig.optimizer.zero_grad(set_to_none=True)
        rig.scheduler.step()  # the loop's lr, step for step
        self.losses[LOOPS[1]].append(float(loss.detach()))

    def warm_up(self, steps: int) -> None:
        """`steps` loop steps, then bare steps on the batches they drew."""
        self.rewind(self.rig.state)
        for _ in range(steps):
            self.loop_step()
        for batch in self.drawn[-steps:]:
            self.bare_step(to_device(*batch, self.rig.device))

    def round(self, number: int, steps: int) -> None:
        """`steps` untimed loop steps, then the same steps timed in each loop from the same start."""
        rig = self.rig
        start, position = _snapshot(rig.model, rig.optimizer, rig.scheduler), copy.copy(rig.state)
        self.drawn.clear()
        for _ in range(steps):  # untimed: the kernels meet this round's new image shapes here
            self.loop_step()
        seen = _image_ids(self.drawn)
        # augmentation is a function of (seed, epoch, index): the timed loop draws these very batches
        ready = [to_device(*batch, rig.device) for batch in self.drawn]
        # every other round runs the bare steps first, so neither side always meets a machine the
        # other has just warmed (caches, the allocator, the clock)
        if number % 2 == 0:
            self.timed_loop(start, position, steps, seen)
            self.timed_bare(start, ready)
        else:
            self.timed_bare(start, ready)
            self.timed_loop(start, position, steps, seen)
        # a round's first pair starts from the same weights and random state: the same loss, exactly
        # as far as float rounding goes (later pairs drift apart by the rounding of multi-threaded
        # kernels, which can change which RoIs get sampled, not how much work a step is)
        first_loop, first_bare = self.losses[LOOPS[0]][-steps], self.losses[LOOPS[1]][0]
        self.gaps.append(abs(first_loop - first_bare) / max(abs(first_bare), 1e-12))

    def timed_loop(self, start: tuple, position: TrainState, steps: int, seen: list) -> None:
        """The loop's `steps` steps timed from `start`, the loader rewound to `position`."""
        rig = self.rig
        _restore(rig.model, rig.optimizer, rig.scheduler, start)
        self.rewind(position)
        self.drawn.clear()
        before = workers_cpu_seconds(rig.loader)
        for _ in range(steps):
            seconds, process = _timed(self.loop_step, rig.device)
            self.wall[LOOPS[0]].append(seconds)
            self.cpu[LOOPS[0]].append(process)
        after = workers_cpu_seconds(rig.loader)
        if before is not None and after is not None:
            self.worker_cpu.append((after - before) / steps)
        assert _image_ids(self.drawn) == seen, "the rewound loader drew other batches"

    def timed_bare(self, start: tuple, ready: list) -> None:
        """The bare step timed on each batch of `ready` from `start`."""
        rig = self.rig
        _restore(rig.model, rig.optimizer, rig.scheduler, start)
        del self.losses[LOOPS[1]][:]
        for batch in ready:
            seconds, process = _timed(lambda: self.bare_step(batch), rig.device)
            self.wall[LOOPS[1]].append(seconds)
            self.cpu[LOOPS[1]].append(process)


def _image_ids(batches: list) -> list[list]:
    return [[t["image_id"] for t in batch[1]] for batch in batches]


def pipeline(preset: str | None = None, data_path: str | None = None, workers: int | None = None,
             batch_size: int | None = None, rounds: int = 3, steps: int = 4, warmup: int = 2,
             **overrides) -> BenchResult:
    """Step time, training-process CPU and worker CPU of each loop in `LOOPS` over `rounds` rounds
    of `steps` steps. Each round first runs its steps untimed (new image shapes set up kernels the
    first time they are met), then rewinds weights, optimizer, schedule, random state and the
    loader's position and runs them timed, then rewinds the model again and runs them bare on the
    batches the loop drew: both timed passes do the same model work, step for step, so a pair's
    ratio is what the loop and its workers cost (`PairedLoops`)."""
    cfg = _settings(preset, data_path, workers, batch_size, **overrides)
    du.init_distributed()
    rig = build_rig(cfg)
    with tempfile.TemporaryDirectory() as out:
        logger = MetricsLogger(Path(out), 10**6, 0, rig.cfg.global_batch, rig.device, rig.cfg.print_freq,
                               progress=False)
        loops = PairedLoops(rig, logger)
        loops.warm_up(warmup)
        for number in range(rounds):
            loops.round(number, steps)
        logger.close()
    loops.stream.close()
    end_workers(rig.loader)  # before the workers alone are timed, and not left beside a notebook's next processes
    cost = worker_cost(preset, data_path, workers, batch_size, **overrides)
    ratios = [a / b for a, b in zip(loops.wall[LOOPS[0]], loops.wall[LOOPS[1]])]
    notes = [english("bench.pipeline_setup", preset=rig.cfg.preset, backbone=rig.cfg.backbone,
                     min_size=rig.cfg.min_size, max_size=rig.cfg.max_size,
                     images=rig.cfg.batch_size * rig.cfg.accum_steps, data=cfg.data_path, workers=worker_count(rig.cfg),
                     threads=torch.get_num_threads(), device=str(rig.device), rounds=rounds, steps=steps,
                     warmup=warmup),
             english("bench.pipeline_ratio", pairs=len(ratios)), english("bench.pipeline_order"),
             english("bench.pipeline_workers"),
             english("bench.pipeline_alone", images=cost["images"],
                     **{piece: f"{1000 * cost[f'{piece} s/image']:.2f}" for piece in ("decode", "masks", "transforms",
                                                                                      "pack")})]
    command = python_call("lab.bench.pipeline", preset=preset, data_path=data_path, workers=workers,
                          batch_size=batch_size, rounds=rounds, steps=steps, warmup=warmup, **overrides)
    return BenchResult("pipeline", english("bench.pipeline_title"), _pipeline_rows(loops, ratios, cost),
                       ["loop", "s/step", "min s", "max s", "vs bare %", "vs bare % lo", "vs bare % hi",
                        "process CPU s/step", "worker CPU s/step", "worker CPU ms/image", "loss gap"], notes,
                       provenance(command))


def _pipeline_rows(loops: PairedLoops, ratios: list[float], cost: dict) -> list[dict]:
    """One row per loop (median, fastest and slowest step; CPU seconds), the pairs' ratio on the loop's row."""
    lo, mid, hi = _quartiles(ratios)
    rows = []
    for name in LOOPS:
        wall, worker_cpu = loops.wall[name], loops.worker_cpu
        rows.append({"loop": name, "s/step": statistics.median(wall), "min s": min(wall), "max s": max(wall),
                     "process CPU s/step": statistics.median(loops.cpu[name]),
                     "worker CPU s/step": statistics.median(worker_cpu) if worker_cpu and name == LOOPS[0] else None})
    rows[0].update({"pairs": len(ratios), "pair ratios": [round(r, 4) for r in ratios],  # runs pool them
                    "loss gap": max(loops.gaps), "vs bare %": 100 * (mid - 1),
                    "vs bare % lo": 100 * (lo - 1), "vs bare % hi": 100 * (hi - 1),
                    "worker CPU ms/image": None if cost["worker cpu s/image"] is None
                    else 1000 * cost["worker cpu s/image"]})
    return rows


def _snapshot(model, optimizer, scheduler) -> tuple:
    """What a step depends on besides its batch: weights, optimizer and schedule state, random state."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), scheduler.state_dict(),
            torch.get_rng_state(), cuda)


def _restore(model, optimizer, scheduler, snapshot: tuple) -> None:
    weights, optim, schedule, rng, cuda = snapshot
    model.load_state_dict(weights)
    optimizer.load_state_dict(optim)
    scheduler.load_state_dict(schedule)
    torch.set_rng_state(rng)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def workers_alone(preset: str | None = None, data_path: str | None = None, workers: int | None = None,
                  batch_size: int | None = None, repeats: int = 3, images: int = 400, **overrides) -> BenchResult:
    """`worker_cost` `repeats` times, one row each (ms per image), for a figure with its spread."""
    rows = []
    for repeat in range(1, repeats + 1):
        cost = worker_cost(preset, data_path, workers, batch_size, images, **overrides)
        rows.append({"repeat": repeat, **{key.replace(" s/image", " ms/image"): None if value is None else 1000 * value
                                          for key, value in cost.items() if key != "images"}, "images": cost["images"]})
    command = python_call("lab.bench.workers_alone", preset=preset, data_path=data_path, workers=workers,
                          batch_size=batch_size, repeats=repeats, images=images, **overrides)
    notes = [english("bench.workers_alone_note", images=images)]
    return BenchResult("workers-alone", english("bench.workers_alone_title"), rows, list(rows[0]), notes,
                       provenance(command))
