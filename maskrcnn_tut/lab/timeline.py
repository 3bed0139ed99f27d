"""Where one training step's memory goes over time, and which input shapes its layers meet.

- `memory_timeline(cfg, batch_size, accum_steps, amp_dtype)`: one real `engine.train_step` of the
  config's Mask R-CNN on the CPU, on `synthetic.synthetic_batch` images, with autograd's saved-tensor
  hooks (what `memory.breakdown` counts) and per-parameter gradient hooks installed: the MiB that
  autograd holds for backward at every moment (each storage counted once, parameters left out;
  released when backward has used its last reference), the MiB of gradients, and the constant
  parameters and optimizer state. The peak and the part of the model it fell in come with it.
  With K micro-batches the saved tensors rise and fall K times while the gradients stay.
- `cuda_memory_timeline(cfg, batch_size, path)`: on a GPU, the allocator's own record of the step
  (`torch.cuda.memory._record_memory_history`), saved as a snapshot for pytorch.org/memory_viz.
- `plot_memory_timelines(timelines)`: the timelines side by side, stacked, with each peak marked.
- `batch_shapes(cfg)`: the padded batch shapes the backbone meets over one epoch (or a number of
  batches) of the config's loader: the model's own transform only, no training.
- `shape_census(cfg, steps)`: the distinct input shapes the backbone and the mask head meet over
  real training steps (forward pre-hooks): cudnn.benchmark autotunes once per new shape (ch. 6).
- `mask_head_bound(cfg)`: the most shapes the mask head can ever meet, so autotuning's bound.

Plot labels, default timeline labels and `accumulation_plan`'s sentence are in the book's language
(`wording`); the part a peak falls in stays an English name (`peak[3] == "backward"`), shown translated.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchvision.models.detection import MaskRCNN

from ..config import Config
from .bench.harness import multiscale_sizes
from .book_fonts import fit_titles
from .memory import breakdown
from .rig import build_rig, synthetic_batches
from .wording import say, term

MIB = 2**20
#: Parts of torchvision's Mask R-CNN, in forward order, that name where the saved tensors come from.
PARTS = (("transform", "transform"), ("backbone.body", "backbone"), ("backbone.fpn", "FPN"), ("rpn", "RPN"),
         ("roi_heads.box_head", "box head"), ("roi_heads.box_predictor", "box head"),
         ("roi_heads.mask_head", "mask head"), ("roi_heads.mask_predictor", "mask head"))


@dataclass
class MemoryTimeline:
    """One step's memory over time (MiB); `points`: (ms since the step began, saved, gradients, part)."""

    label: str
    batch_size: int
    accum_steps: int
    precision: str
    parameters_mb: float
    optimizer_mb: float
    points: list[tuple[float, float, float, str]] = field(default_factory=list)

    def total(self, point) -> float:
        return self.parameters_mb + self.optimizer_mb + point[1] + point[2]

    @property
    def peak(self) -> tuple[float, float, float, str]:
        return max(self.points, key=self.total)

    @property
    def peak_mb(self) -> float:
        return self.total(self.peak)

    @property
    def peak_saved_mb(self) -> float:
        return max(p[1] for p in self.points)

    def row(self) -> dict:
        t, saved, grads, part = self.peak
        return {"step": self.label, "peak MiB": round(self.peak_mb), "saved for backward at the peak MiB": round(saved),
                "gradients at the peak MiB": round(grads), "largest saved MiB": round(self.peak_saved_mb),
                "parameters MiB": round(self.parameters_mb), "optimizer state MiB": round(self.optimizer_mb),
                "peak falls in": part}


class StepMemory:
    """What autograd holds for backward and the gradients made so far while one step runs: each change
    appends a point (ms, saved MiB, gradient MiB, part) to `timeline`. Its methods are the hooks that
    `memory_timeline` installs; storages of `parameters` (data pointers) are not counted as saved."""

    def __init__(self, timeline: MemoryTimeline, parameters: set[int]) -> None:
        self.timeline, self.parameters = timeline, parameters
        self.saved = self.grads = 0  # bytes
        self.part = "start"  # the part of the model (PARTS) or of the step running now
        self.packs: dict[int, int] = {}  # storage -> references saved for backward
        self.unpacks: dict[int, int] = {}  # storage -> references backward has used
        self.sizes: dict[int, int] = {}
        self.with_grad: set[int] = set()
        self.start = time.perf_counter()

    def record(self) -> None:
        self.timeline.points.append((1000 * (time.perf_counter() - self.start), self.saved / MIB, self.grads / MIB,
                                     self.part))

    def pack(self, tensor):
        """Saved-tensor hook: a storage counts once, from its first reference."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.parameters:
            return tensor
        if self.packs.get(key, 0) == self.unpacks.get(key, 0):  # not held yet (or released again)
            self.sizes[key] = storage.nbytes()
            self.saved += storage.nbytes()
            self.record()
        self.packs[key] = self.packs.get(key, 0) + 1
        return key, tensor

    def unpack(self, packed):
        """Saved-tensor hook: a storage is released when backward has used its last reference."""
        if not isinstance(packed, tuple):
            return packed
        key, tensor = packed
        self.unpacks[key] = self.unpacks.get(key, 0) + 1
        if self.unpacks[key] == self.packs[key]:
            self.saved -= self.sizes[key]
            self.part = "backward"
            self.record()
        return tensor

    def gradient_made(self, param) -> None:
        """Post-accumulate-grad hook: a parameter's gradient counts once, when first made."""
        if id(param) not in self.with_grad:
            self.with_grad.add(id(param))
            self.grads += param.numel() * param.element_size()
            self.part = "backward"
            self.record()

    def enter(self, name: str, *_) -> None:
        """Forward pre-hook (with the part's name bound): the step is now in part `name`."""
        self.part = name

    def micro_batches(self, batches):
        """`batches`, marking where each micro-batch starts."""
        for micro in itertools.count():
            # what backward did not use (branches that do not reach the loss) is freed with the graph
            self.saved, self.packs, self.unpacks = 0, {}, {}
            self.part = "data" if micro == 0 else "next micro-batch"
            self.record()
            yield next(batches)


def _optimizer_state_mb(optimizer, trainable: list) -> float:
    """Create the optimizer's state with one step on zero gradients (AdamW: two moments); its MiB."""
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t)) / MIB


def memory_timeline(cfg: Config, batch_size: int, accum_steps: int = 1, amp_dtype: str | None = None,
                    image_size: int | None = None, label: str = "") -> MemoryTimeline:
    """The timeline of one optimizer step (module doc), in this process, on the CPU (`StepMemory`)."""
    size = image_size or cfg.min_size
    settings = dataclasses.replace(cfg, batch_size=batch_size, accum_steps=accum_steps, amp=amp_dtype is not None,
                                   amp_dtype=amp_dtype, min_size=size, max_size=size, pin_memory=False)
    rig = build_rig(settings, device="cpu", batches=synthetic_batches(settings))
    cfg, model, optimizer = rig.cfg, rig.module, rig.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer_mb = _optimizer_state_mb(optimizer, trainable)
    timeline = MemoryTimeline(label or say("timeline.label", batch=batch_size, accum=accum_steps, precision=cfg.precision),
                              batch_size, accum_steps, cfg.precision,
                              sum(p.numel() * p.element_size() for p in model.parameters()) / MIB, optimizer_mb)
    memory = StepMemory(timeline, {p.untyped_storage().data_ptr() for p in model.parameters()})
    modules = dict(model.named_modules())
    handles = [modules[path].register_forward_pre_hook(functools.partial(memory.enter, name))
               for path, name in PARTS if path in modules]
    handles += [p.register_post_accumulate_grad_hook(memory.gradient_made) for p in trainable]
    rig.batches = memory.micro_batches(rig.batches)
    optimizer.zero_grad(set_to_none=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(memory.pack, memory.unpack):
            rig.step()
    finally:
        for handle in handles:
            handle.remove()
    memory.part, memory.saved = "optimizer step", 0
    memory.record()
    return timeline


def plot_memory_timelines(timelines: list[MemoryTimeline], title: str, hardware: str):
    """Stacked areas (parameters, optimizer state, gradients, saved for backward) of each timeline."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(timelines), figsize=(4.2 * len(timelines), 3.6), sharey=True, squeeze=False)
    for ax, timeline in zip(axes[0], timelines):
        ts = [p[0] for p in timeline.points]
        layers = [[timeline.parameters_mb] * len(ts), [timeline.optimizer_mb] * len(ts), [p[2] for p in timeline.points],
                  [p[1] for p in timeline.points]]
        ax.stackplot(ts, *layers, step="post", labels=[term(name) for name in ("parameters", "optimizer state",
                                                                                  "gradients", "saved for backward")],
                     colors=["#bdbdbd", "#9e9ac8", "#fd8d3c", "#6baed6"])
        peak = timeline.peak
        ax.axhline(timeline.peak_mb, color="black", lw=0.8, ls="--")
        ax.annotate(say("timeline.peak", mb=timeline.peak_mb, part=term(peak[3])), (peak[0], timeline.peak_mb), fontsize=7,
                    xytext=(0.5, 0.97), textcoords="axes fraction", ha="center", va="top",
                    arrowprops=dict(arrowstyle="->", lw=0.7))
        ax.set(title=term(timeline.label), xlabel=term("ms into the step"))
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(term("MiB held"))
    axes[0, 0].legend(fontsize=7, loc="center left")
    fig.suptitle(f"{term(title)}\n{hardware}", fontsize=9)
    return fit_titles(fig)


def cuda_memory_timeline(cfg: Config, batch_size: int, path: Path | str,
                         steps: int = 2) -> tuple[list[tuple[float, float]], str]:
    """On a GPU: a warm-up step, then `steps - 1` training steps on a synthetic batch with the allocator's
    history on, saved as a snapshot to `path` (drag it into pytorch.org/memory_viz). Returns the
    allocated MiB after each allocator event as (x, MiB), and what x is ("ms" where the snapshot
    times its events, else "allocator event")."""
    settings = dataclasses.replace(cfg, batch_size=batch_size)
    rig = build_rig(settings, device=torch.device("cuda", torch.cuda.current_device()),
                    batches=synthetic_batches(settings))
    device = rig.device
    rig.step()  # optimizer state, cuDNN plans
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        for _ in range(steps - 1):
            rig.step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(pickle.dumps(snapshot))
    events = [e for e in snapshot["device_traces"][device.index] if e["action"] in ("alloc", "free_completed")]
    timed = bool(events) and all("time_us" in e for e in events)
    points, held = [], base
    for k, e in enumerate(events):
        held += e["size"] if e["action"] == "alloc" else -e["size"]
        points.append((e["time_us"] / 1000 if timed else float(k), held / MIB))
    origin = points[0][0] if points else 0.0
    return [(x - origin, mb) for x, mb in points], "ms" if timed else "allocator event"


def batch_shapes(cfg: Config, multiscale: bool = False, batches: int | None = None) -> dict:
    """The config's loader (one epoch, or `batches` batches epoch after epoch) through the model's
    own transform: resize, then pad the batch to its largest image rounded up to 32 (or, with
    --fixed-shapes, to the fixed shape of its orientation); no training. Returns how many batches,
    how many distinct (height, width) the backbone would meet, and those shapes, sorted."""
    rig = build_rig(dataclasses.replace(cfg, workers=0), device="cpu")
    transform = rig.module.transform
    if multiscale:
        transform.min_size = multiscale_sizes(rig.cfg.min_size)
    shapes = []
    with torch.no_grad():
        for _ in range(batches or len(rig.loader)):
            images, targets = next(rig.batches)
            batch, _ = transform([image.float() / 255 for image in images], [dict(t) for t in targets])
            shapes.append(tuple(batch.tensors.shape[-2:]))
    return {"batches": len(shapes), "distinct": len(set(shapes)), "shapes": sorted(set(shapes))}


def shape_census(cfg: Config, steps: int = 12, **overrides) -> dict:
    """Real training steps (one process, on the CPU) of the config's model on its data, with
    forward pre-hooks on the backbone and the mask head: their input shapes, step by step."""
    rig = build_rig(dataclasses.replace(cfg, workers=0, **overrides), device="cpu")
    model = rig.module
    seen: dict[str, list[tuple]] = {"backbone": [], "mask head": []}
    hooks = [model.backbone.register_forward_pre_hook(lambda _, args: seen["backbone"].append(tuple(args[0].shape))),
             model.roi_heads.mask_head.register_forward_pre_hook(
                 lambda _, args: seen["mask head"].append(tuple(args[0].shape)))]
    try:
        for _ in range(steps):
            rig.step()
    finally:
        for hook in hooks:
            hook.remove()
    return {part: {"shapes": shapes, "distinct": len(set(shapes)), "steps": steps,
                   "distinct by step": [len(set(shapes[:i + 1])) for i in range(len(shapes))]}
            for part, shapes in seen.items()}


#: The share of the RoIs sampled per image that may be positive (torchvision's default, which the
#: package's model keeps): only positive RoIs reach the mask head.
POSITIVE_FRACTION = inspect.signature(MaskRCNN.__init__).parameters["box_positive_fraction"].default


def mask_head_bound(cfg: Config) -> int:
    """The most positive RoIs one step can give the mask head (batch x RoIs sampled per image x
    the positive fraction), hence the most distinct input shapes it can ever meet."""
    return int(cfg.batch_size * cfg.box_batch_size_per_image * POSITIVE_FRACTION)


def accumulation_plan(cfg: Config, gpu_memory_gb: float, accum_steps: tuple[int, ...] = (1, 4),
                      headroom: float = 0.8) -> tuple[tuple[int, ...], str]:
    """The accumulation factors whose large-batch twin (K x batch_size images in one batch) should fit
    in `headroom` of a `gpu_memory_gb` card: `memory.breakdown` counts one image's activations on this
    GPU, the batch scales them. Returns the factors kept and a sentence on any dropped."""
    one = breakdown(cfg, cfg.min_size, 1, torch.device("cuda", torch.cuda.current_device()))
    card = headroom * gpu_memory_gb * 1024

    def need(k: int) -> float:
        return one.parameters_mb + one.gradients_mb + one.optimizer_mb + k * cfg.batch_size * one.activations_mb

    kept = tuple(k for k in accum_steps if k == 1 or need(k) < card)
    dropped = [k for k in accum_steps if k not in kept]
    if not dropped:
        return kept, ""
    return kept, say("timeline.left_out", images=say("timeline.or").join(str(k * cfg.batch_size) for k in dropped),
                     size=cfg.min_size, gb=need(max(dropped)) / 1024, headroom=headroom, card=gpu_memory_gb)
