"""Where one training step's time goes, in DDP: a `torch.profiler` trace of `engine.train_step`.

`ddp_trace()` runs `engine.train_step` in fresh CPU processes (`processes.launch`, gloo), each
bound to one core with one thread as in the speed table, at the table's batch
(`bench.CPU_TABLE_BATCH`): first one process alone (the table's baseline, the other core idle),
then 2 processes under DDP with the preset's buckets, then with 25 MB buckets, then with 25 MB
buckets and the same images as `NO_SYNC_ACCUM` accumulated micro-batches (`no_sync` on all but
the last). These are DDP's three ideas in order: gradient buckets, their all-reduce overlapping
backward, and no all-reduce in the micro-steps before the last. Each phase warms up, then profiles
`steps` whole `train_step`s. `step_phases` reads every profiled step of
every rank from the trace events: data wait, forward, backward, the gradient buckets' all-reduces
(gloo's own threads) and how much of them ran during backward, the wait for the other rank, the
optimizer. The two ranks share one clock, so a bucket's all-reduce is split into waiting for the
later rank and the transfer itself. `save_trace` writes both ranks into one Chrome-trace file (ui.perfetto.dev or chrome://tracing open it).
`bucket_sizes_mb` is torch's first bucket assignment; DDP rebuilds its buckets after the first
iteration in the order gradients arrived, so the count the trace measures is the one to quote.

The pictures of a trace are `trace_plots`'; the memory timeline of a step and the shape census live
in `maskrcnn_tut.lab.timeline`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import statistics
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from maskrcnn_tut.lab import processes

from .. import distributed as du
from ..config import Config, Run
from ..hardware import ddp_buffer_sync_keyword
from ..model import build_model
from . import bench, wording
from .bench import projection as predict
from .provenance import hardware
from .rig import Rig, build_rig

#: Bucket cap of the last phase: DDP's default, several buckets for this model, so overlap can show.
SMALL_BUCKET_MB = 25.0
#: Micro-batches per optimizer step of the no_sync phase (the same images per step as the others).
NO_SYNC_ACCUM = 2
PHASES = ("single", "ddp", "ddp_small_buckets", "ddp_no_sync")
#: Each phase's name in the tables: its catalog key.
PHASE_NAMES = {"single": "traces.run_single", "ddp": "traces.run_ddp", "ddp_small_buckets": "traces.run_ddp_small_buckets",
               "ddp_no_sync": "traces.run_ddp_no_sync"}
STEP, FORWARD, DATA = "train_step", "forward", "data: next batch"
#: The phase whose every event a trace keeps, as the Perfetto file (`save_trace`).
SAVED_PHASE = "ddp"
COMM_PREFIXES = ("gloo:", "nccl:")


class Labelled(nn.Module):
    """The model with its forward under a profiler label (inside DDP's own `DistributedDataParallel.forward`,
    which also holds the buffer broadcast); no state of its own: `.module` is the model."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        with record_function(FORWARD):
            return self.module(*args, **kwargs)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ library reports the missing GPU there on a CPU-only
    machine); Python's own errors in a launched worker travel through `sys.stderr`, which is not it."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _labelled_batches(stream):
    while True:
        with record_function(DATA):
            batch = next(stream)
        yield batch


def _profiled_steps(rig: Rig, steps: int, warmup: int, path: Path) -> None:
    """`warmup` steps, then `steps` profiled `train_step`s, exported as a Chrome trace to `path`."""
    rig.batches = _labelled_batches(rig.batches)
    for _ in range(warmup):
        rig.step()
    with _quiet_stderr(), warnings.catch_warnings():
        # torch 2.11 warns that a profile without acc_events keeps one cycle's events: the one it records
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)  # shapes: each bucket's size
        prof.start()
    for _ in range(steps):
        with record_function(STEP):
            rig.step()
    with _quiet_stderr():
        prof.stop()
        prof.export_chrome_trace(str(path))


def _labelled_ddp(model: nn.Module, cfg: Run, info: du.DistInfo) -> nn.Module:
    """`du.wrap_ddp` of the model with its forward under the profiler's label."""
    return du.wrap_ddp(Labelled(model), cfg, info)


def trace_worker(cfg: Config, steps: int, warmup: int, folder: str) -> None:
    """Run inside `processes.launch`: alone (1 process), the "single" phase; in 2 processes the two
    DDP phases of the module doc. Each rank's trace of each phase goes to `folder/{phase}.{rank}.json`."""
    info = du.info()
    bench.pin_cores(1)
    torch.set_num_threads(1)
    for phase in PHASES[:1] if info.world_size == 1 else PHASES[1:]:
        settings = cfg
        if phase != "ddp":
            settings = dataclasses.replace(settings, bucket_cap_mb=SMALL_BUCKET_MB)
        if phase == "ddp_no_sync":
            settings = dataclasses.replace(settings, batch_size=max(1, cfg.batch_size // NO_SYNC_ACCUM),
                                           accum_steps=NO_SYNC_ACCUM)
        # the single process reads what rank 0 of the pair reads: the same images per step
        rig = build_rig(settings, wrap=_labelled_ddp, reads_as=(info.rank, 2))
        _profiled_steps(rig, steps, warmup, Path(folder) / f"{phase}.{info.rank}.json")
        du.barrier()


def bucket_sizes_mb(model: nn.Module, cap_mb: float) -> list[float]:
    """The gradient buckets (MiB) DDP forms at `bucket_cap_mb`, from torch's own assignment (parameters
    in reverse order, as the first backward produces them; a bucket closes after the parameter that
    reaches the cap, so a bucket holds about the cap, a little more or less)."""
    import torch.distributed as dist
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    buckets = dist._compute_bucket_assignment_by_size(params, [int(cap_mb * 2**20)], [False] * len(params))[0]
    return [sum(params[i].numel() * params[i].element_size() for i in bucket) / 2**20 for bucket in buckets]


def gradient_report(presets: tuple[str, ...] = ("cpu-tiny", "gpu-r50"), ranks: tuple[int, ...] = (2, 8)) -> list[dict]:
    """Per preset (its model built here, on the CPU, with the shapes dataset's 4 classes): gradient MiB,
    DDP's buckets at the preset's cap, and what a ring all-reduce sends per rank, 2(N-1)/N of it."""
    from ..config import make_config
    rows = []
    for preset in presets:
        cfg = make_config(preset)
        model = build_model(cfg, 4)
        mb, buckets = predict.gradient_bytes(model) / 2**20, bucket_sizes_mb(model, cfg.bucket_cap_mb)
        row = {"preset": preset, "model": f"{cfg.backbone}-FPN",
               "parameters (M)": sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6,
               "gradients MiB": mb, "bucket cap MB": cfg.bucket_cap_mb, "buckets": len(buckets)}
        row.update({f"sent per rank, N={n} (MiB)": predict.ring_allreduce_bytes(mb, n) for n in ranks})
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- reading a trace


def _intervals(events, test) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if test(e))


def _overlap(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def _numel(event: dict) -> int:
    """The elements of an all-reduce's flattened bucket, from the profiler's recorded input shapes."""
    dims = event.get("args", {}).get("Input Dims") or [[[0]]]
    return sum(int(torch.tensor(shape).prod()) for shape in dims[0]) if dims[0] else 0


def step_phases(events: list[dict]) -> list[dict]:
    """Per profiled step of one rank's trace events (Chrome "X" events, microseconds): the
    milliseconds of each part of the step, the spans (µs) of its backward passes (one per
    micro-step: the autograd work after each forward) and of its gradient all-reduces, and how many
    all-reduces each backward launched."""
    events = [e for e in events if e.get("ph") == "X"]
    steps = _intervals(events, lambda e: e["name"] == STEP)
    main = next(e["tid"] for e in events if e["name"] == STEP)
    rows = []
    for start, end in steps:
        inside = [e for e in events if start <= e["ts"] < end]
        on_main = [e for e in inside if e["tid"] == main]
        autograd = _intervals(on_main, lambda e: e["name"].startswith("autograd::engine::evaluate_function"))
        forwards = _intervals(on_main, lambda e: e["name"] == FORWARD)
        ends = [a for a, _ in forwards[1:]] + [end]
        backwards = [(spans[0][0], max(b for _, b in spans)) for f, nxt in zip(forwards, ends)
                     if (spans := [(a, b) for a, b in autograd if f[1] <= a < nxt])]
        b_start, b_end = backwards[-1]  # the backward whose buckets are all-reduced
        launched = sorted((e["ts"], _numel(e)) for e in on_main if e["name"] == "c10d::allreduce_"
                          and any(a <= e["ts"] <= b for a, b in backwards))  # buckets launch from backward
        per_backward = [sum(a <= t <= b for t, _ in launched) for a, b in backwards]
        n_grad = sum(per_backward)
        # gloo runs each collective on a thread of its own, in the order they were launched
        grad = _intervals(inside, lambda e: e["tid"] != main and e["name"].startswith(COMM_PREFIXES)
                          and "all_reduce" in e["name"])[:n_grad]
        ms = lambda us: us / 1000  # noqa: E731
        rows.append({
            "step ms": ms(end - start),
            "data ms": ms(sum(b - a for a, b in _intervals(on_main, lambda e: e["name"] == DATA))),
            "forward ms": ms(sum(b - a for a, b in _intervals(on_main, lambda e: e["name"] == FORWARD))),
            "backward ms": ms(sum(b - a for a, b in backwards)),
            "optimizer ms": ms(sum(b - a for a, b in _intervals(on_main, lambda e: e["name"].startswith("Optimizer.step")))),
            "buffer broadcasts": sum(1 for e in on_main if e["name"] == "c10d::broadcast_"),
            "gradient all-reduces": len(grad),
            "all-reduce ms": ms(sum(b - a for a, b in grad)),
            "all-reduce during backward ms": ms(_overlap(grad, b_start, b_end)),
            "all-reduces per backward": per_backward, "backward spans": backwards,
            "bucket launches": [t for t, _ in launched], "bucket MiB": [4 * n / 2**20 for _, n in launched],
            "grad spans": grad, "backward span": (b_start, b_end), "step span": (start, end),
        })
        row = rows[-1]
        row["own work ms"] = row["data ms"] + row["forward ms"] + row["backward ms"] + row["optimizer ms"]
        row["waiting ms"] = row["step ms"] - row["own work ms"]  # for gradients, for the peer, buffer broadcasts
        row["backward share"] = row["backward ms"] / row["step ms"]
    return rows


@dataclass
class DDPTrace:
    """What `ddp_trace` measured: per phase, per rank, per step (see `step_phases`)."""

    steps: dict[str, list[list[dict]]]  # phase -> [rank][step] -> row
    bucket_cap_mb: float
    batch_size: int
    events: dict[str, list[list[dict]]] = field(repr=False, default_factory=dict)  # phase -> [rank] -> `drawn` events
    hardware: str = ""
    # SAVED_PHASE's every event as the gzipped Chrome-trace file `save_trace` writes: encoded once, and
    # small to keep (the figure cache read ~15 MB of event dicts back in a second)
    saved_file: bytes = field(repr=False, default=b"")

    def rows(self, phase: str) -> list[dict]:
        return [row for rank in self.steps[phase] for row in rank]

    def bucket_mb(self, phase: str) -> list[float]:
        """The gradient buckets DDP all-reduced in rank 0's last profiled step (MiB of fp32, measured)."""
        return self.steps[phase][0][-1]["bucket MiB"]

    def spread(self, phase: str, key: str) -> tuple[float, float, float]:
        """(median, min, max) of `key` over every profiled step of every rank of `phase`."""
        values = [row[key] for row in self.rows(phase)]
        return statistics.median(values), min(values), max(values)

    def transfer_and_wait(self, phase: str = "ddp") -> list[tuple[float, float]]:
        """Per rank and step, (transfer ms, wait ms) of the last gradient bucket: the ranks share a clock,
        so the transfer runs from the later rank's start to the end; the earlier rank waits before it."""
        out = []
        for k in range(len(self.steps[phase][0])):
            last = [rank[k]["grad spans"][-1] for rank in self.steps[phase]]
            begins = max(a for a, _ in last)
            out += [((end - begins) / 1000, (begins - start) / 1000) for start, end in last]
        return out

    def summary(self) -> dict:
        """The step's budget, as (median, min, max) over ranks and steps: each rank's own work alone and
        under DDP (data, forward, backward, optimizer), the last bucket's transfer and the wait for the
        other rank before it, the step; `slower_under_ddp` is None when the ranges overlap (within noise)."""
        pairs = self.transfer_and_wait()
        spread = lambda values: (statistics.median(values), min(values), max(values))  # noqa: E731
        alone, shared = self.spread("single", "own work ms"), self.spread("ddp", "own work ms")
        return {"own work alone": alone, "own work under DDP": shared,
                "slower_under_ddp": True if shared[1] > alone[2] else False if shared[2] < alone[1] else None,
                "transfer": spread([t for t, _ in pairs]), "wait for the other rank": spread([w for _, w in pairs]),
                "step alone": self.spread("single", "step ms"), "step under DDP": self.spread("ddp", "step ms"),
                "all-reduces per step": self.rows("ddp")[0]["gradient all-reduces"],
                "all-reduces per step, small buckets": self.rows("ddp_small_buckets")[0]["gradient all-reduces"],
                "during backward, small buckets": self.spread("ddp_small_buckets", "all-reduce during backward ms"),
                "during backward": self.spread("ddp", "all-reduce during backward ms"),
                "buffer broadcasts per step": self.spread("ddp", "buffer broadcasts")[0],
                "backward share alone": self.spread("single", "backward share"),
                "all-reduces per backward, no_sync": self.rows("ddp_no_sync")[0]["all-reduces per backward"],
                "step under DDP, no_sync": self.spread("ddp_no_sync", "step ms")}

    def table(self) -> list[dict]:
        """One row per phase: medians with min-max over ranks and steps."""
        keys = ["step ms", "data ms", "forward ms", "backward ms", "optimizer ms", "waiting ms", "all-reduce ms",
                "all-reduce during backward ms"]
        table = []
        for phase in PHASES:
            name = wording.say(PHASE_NAMES[phase], preset_mb=self.bucket_cap_mb, small_mb=SMALL_BUCKET_MB,
                               micro=NO_SYNC_ACCUM)
            row = {"run": name, "all-reduces": self.rows(phase)[0]["gradient all-reduces"]}
            for key in keys:
                median, low, high = self.spread(phase, key)
                row[key] = f"{median:.0f} ({low:.0f}-{high:.0f})" if high > 0 else "0"
            table.append(row)
        return table


def ddp_trace(preset: str = "cpu-tiny", steps: int = 2, warmup: int = 1, batch_size: int | None = None,
              **overrides) -> DDPTrace:
    """Profile the phases of the module doc in 2 fresh CPU processes (GPUs hidden from them, so the
    trace is labelled with the CPU, whatever GPUs this machine has)."""
    batch_size = batch_size or bench.CPU_TABLE_BATCH
    cfg = bench.bench_config(preset, batches_per_step=2, batch_size=batch_size, workers=0, **overrides)
    with tempfile.TemporaryDirectory() as folder, \
            bench.environment(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
        processes.launch(trace_worker, 1, cfg, steps, warmup, folder, backend="gloo")
        processes.launch(trace_worker, 2, cfg, steps, warmup, folder, backend="gloo")
        events = {phase: [json.loads(path.read_text())["traceEvents"]
                          for path in sorted(Path(folder).glob(f"{phase}.*.json"))] for phase in PHASES}
    return DDPTrace(steps={phase: [step_phases(ev) for ev in events[phase]] for phase in PHASES},
                    bucket_cap_mb=cfg.bucket_cap_mb, batch_size=batch_size,
                    events={phase: [[e for e in ev if drawn(e)] for ev in ranks] for phase, ranks in events.items()},
                    hardware=cpu_label(2), saved_file=chrome_trace(events[SAVED_PHASE]))


def drawn(event: dict) -> bool:
    """Whether `trace_plots.plot_steps` draws the event: the step, its data and forward spans, the
    optimizer step, the buffer broadcasts."""
    name = event.get("name", "")
    return name in (STEP, DATA, FORWARD) or name.startswith("Optimizer.step") or name.endswith(":broadcast")


def buffer_sync_words(broadcasts_per_step: float) -> str:
    """The sentence on DDP's buffer sync, naming the keyword this torch takes (`forward_sync_buffers`
    from torch 2.13, `broadcast_buffers` before: `hardware.ddp_buffer_sync_keyword`)."""
    keyword = ddp_buffer_sync_keyword(nn.parallel.DistributedDataParallel)
    other = "broadcast_buffers" if keyword == "forward_sync_buffers" else "forward_sync_buffers"
    age = wording.say("traces.older_name" if keyword == "forward_sync_buffers" else "traces.newer_name")
    return wording.say("traces.buffer_sync", broadcasts=broadcasts_per_step, version=torch.__version__,
                       keyword=keyword, other=other, age=age)


def cpu_label(processes: int) -> str:
    """What a CPU-only trace ran on: this machine's CPU, never its GPUs (M4)."""
    return wording.english("traces.cpu_label", processes=processes, cpu=hardware()["cpu"])  # shown in the reader's language


def chrome_trace(ranks: list[list[dict]]) -> bytes:
    """Each rank's events in one gzipped Chrome-trace file (one process row per rank)."""
    merged = []
    for rank, events in enumerate(ranks):
        pids = {e.get("pid") for e in events}
        merged += [{**e, "pid": f"rank {rank}"} if e.get("pid") in pids else e for e in events]
    # encoded whole, then compressed: json.dump's many small writes through gzip took seconds
    return gzip.compress(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}).encode(), compresslevel=6)


def save_trace(trace: DDPTrace, path: Path | str) -> Path:
    """Both ranks' every event of the `SAVED_PHASE` run, for ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(trace.saved_file)
    return path
