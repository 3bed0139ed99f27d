"""Where training memory goes: parameters, gradients, optimizer state and activations.

- `breakdown(cfg, image_size, batch_size)`: builds the config's Mask R-CNN, sizes its parameters,
  gradients and optimizer state exactly (one optimizer step on zero gradients creates the state),
  and counts the activations: one forward pass on a synthetic batch of square images runs under
  `torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for the
  backward pass; they are deduplicated by storage, parameters left out.
- `measure_growth(cfg, image_size, batch_size)`: the check. Real `engine.train_step`s on the same
  batch in a fresh one-thread process; how far memory rises above the loaded model: the CUDA
  allocator's peak (`torch.cuda.max_memory_allocated`) on a GPU, the peak resident set size
  (VmHWM) on a CPU, with glibc told to return freed tensors to the OS (`MALLOC_MMAP_THRESHOLD_`)
  so RSS follows the live tensors. A step's rise is gradients + optimizer state + activations,
  `MemoryBreakdown.growth_mb` (less when activations dominate: backward frees them while the
  gradients appear, so the two never peak together).
- `memory_table(preset, image_sizes, batch_sizes)`: the chapter 1 table and plot, "memory by image
  size and batch" (R50-FPN up to 1024x1024 by default) against a GPU's memory. Activations are
  measured at a few sizes and fitted per image as a + b x pixels, then scaled by the batch; rows
  beyond the measured sizes are marked as extrapolated. On a CPU the default measures only small
  sizes (a 1024 px R50 forward pass there takes minutes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from maskrcnn_tut.lab import processes

from .. import distributed as du
from ..config import Config, derive, make_config
from ..data.loader import to_device
from ..engine import autocast, autocast_dtype, build_optimizer
from ..hardware import peak_memory_mb
from ..model import build_model
from .bench.harness import environment
from .book_fonts import fit_titles
from .device_memory import current_memory_mb, releases_gpu_cache, reset_peak_memory
from .provenance import provenance
from .rig import Rig, build_rig, synthetic_batches
from .stored.result import BenchResult, python_call, register_plot
from .synthetic import synthetic_batch
from .wording import english, say, shown, term

MIB = 2**20
#: The GPU the article recommends (RTX 2080 Ti, 11 GB): the default line in `memory_table`'s plot.
ARTICLE_GPU_GB = 11.0
#: Keep tensors above 64 KiB out of glibc's heap so a CPU process's RSS follows its live tensors.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@dataclass
class MemoryBreakdown:
    """Bytes (MiB) of each part of a training step's memory for one image size and batch."""

    preset: str
    image_size: int
    batch_size: int
    device: str
    autocast: str
    parameters_mb: float
    gradients_mb: float
    optimizer_mb: float
    activations_mb: float
    saved_tensors: int

    @property
    def growth_mb(self) -> float:
        """What a training step adds on top of the loaded model: gradients, optimizer state, activations."""
        return self.gradients_mb + self.optimizer_mb + self.activations_mb

    @property
    def total_mb(self) -> float:
        return self.parameters_mb + self.growth_mb

    def row(self) -> dict:
        return {"image size": self.image_size, "batch": self.batch_size, "parameters MiB": round(self.parameters_mb),
                "gradients MiB": round(self.gradients_mb), "optimizer MiB": round(self.optimizer_mb),
                "activations MiB": round(self.activations_mb), "total MiB": round(self.total_mb)}


def _sized(cfg: Config, image_size: int, batch_size: int = 1) -> Config:
    """The settings at `batch_size` square `image_size` inputs (underived)."""
    return dataclasses.replace(cfg, min_size=image_size, max_size=image_size, batch_size=batch_size)


def _tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def _rig(settings: Config, device: torch.device | str) -> Rig:
    """The settings' rig on `device`, on synthetic batches of its size."""
    return build_rig(settings, device=device, batches=synthetic_batches(settings))


def _activations(model, images, targets, cfg: Config, device: torch.device) -> tuple[float, int]:
    """MiB and count of the distinct storages autograd saves in one forward pass (parameters excluded)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    images, targets = to_device(images, targets, device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast(cfg, device):
        losses = model(images, targets)
    del losses  # frees the graph and with it every saved tensor
    return sum(saved.values()) / MIB, len(saved)


@releases_gpu_cache
def breakdown(cfg: Config, image_size: int, batch_size: int,
              device: torch.device | str | None = None) -> MemoryBreakdown:
    """Parameters, gradients, optimizer state and activations of one training step (see module doc)."""
    rig = _rig(_sized(cfg, image_size, batch_size), device if device is not None else du.info().device)
    cfg, device, model, optimizer = rig.cfg, rig.device, rig.module, rig.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the optimizer's state (AdamW: two moments per parameter)
    optimizer_mb = _tensor_mb(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))
    optimizer.zero_grad(set_to_none=True)
    activations_mb, count = _activations(model, *next(rig.batches), cfg, device)
    dtype = autocast_dtype(cfg)
    return MemoryBreakdown(preset=cfg.preset, image_size=image_size, batch_size=batch_size, device=str(device),
                           autocast=str(dtype).replace("torch.", "") if dtype else "off (fp32)",
                           parameters_mb=_tensor_mb(model.parameters()), gradients_mb=_tensor_mb(trainable),
                           optimizer_mb=optimizer_mb, activations_mb=activations_mb, saved_tensors=count)


def _train(settings: Config, steps: int, device: torch.device) -> tuple[float, float]:
    """Build the settings' rig, train `steps` steps on one synthetic batch; returns the memory in
    use once the model is loaded and the peak over the steps (MiB)."""
    rig = _rig(settings, device)
    loaded = current_memory_mb(rig.device)
    reset_peak_memory(rig.device)
    for _ in range(steps):
        rig.step()
    return loaded, peak_memory_mb(rig.device)


def growth_worker(cfg: Config, image_size: int, batch_size: int, steps: int) -> float:
    """Run inside `processes.launch`: MiB that `steps` training steps add above the loaded model.

    One thread, and a throwaway run first, so that per-thread buffers and the first touch of
    the library's code pages for the backward pass and the optimizer are not counted as growth.
    """
    torch.set_num_threads(1)
    device = du.info().device
    settings = _sized(dataclasses.replace(cfg, pin_memory=False), image_size, batch_size)
    _train(settings, 1, device)
    reset_peak_memory(device)  # hands the throwaway run's memory back
    loaded, peak = _train(settings, steps, device)
    return peak - loaded


def measure_growth(cfg: Config, image_size: int, batch_size: int, steps: int = 2) -> float:
    """The measured rise of memory during `steps` training steps, in a fresh process (see module doc).

    Two steps: the first creates the optimizer state, the second holds it together with the
    activations and gradients, as every later step does.
    """
    with environment(**MALLOC_ENV):
        return processes.launch(growth_worker, 1, cfg, image_size, batch_size, steps)


def memory_table(preset: str = "gpu-r50", image_sizes: tuple[int, ...] = (256, 512, 800, 1024),
                 batch_sizes: tuple[int, ...] = (1, 2, 4, 8), measure_sizes: tuple[int, ...] | None = None,
                 gpu_memory_gb: float = ARTICLE_GPU_GB, **overrides):
    """Memory by image size and batch for `preset` (module doc); returns a `BenchResult`.

    `measure_sizes`: sizes whose activations are counted (batch 1); the others are fitted as
    a + b x pixels per image. Default: every size on a GPU, 192 and 320 px on a CPU.
    """
    device = du.info().device
    if device.type != "cuda" and "amp" not in overrides:
        overrides["amp"] = False  # CPU autocast is no stand-in for a GPU's, and slow without bf16 hardware
    cfg = make_config(preset, **overrides)
    if measure_sizes is None:
        measure_sizes = tuple(image_sizes) if device.type == "cuda" else (192, 320)
    if len(measure_sizes) < 2:
        raise ValueError("memory_table needs at least two measure_sizes to fit activations per pixel")
    measured = {s: breakdown(cfg, s, 1, device) for s in measure_sizes}
    # least squares of activations per image = a + b * pixels over the measured sizes
    xs = [float(s * s) for s in measured]
    ys = [m.activations_mb for m in measured.values()]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    fixed = next(iter(measured.values()))
    rows = []
    for size in image_sizes:
        per_image = measured[size].activations_mb if size in measured else intercept + slope * size * size
        for batch in batch_sizes:
            row = dataclasses.replace(fixed, image_size=size, batch_size=batch, activations_mb=per_image * batch).row()
            row["fits"] = "yes" if row["total MiB"] < 0.9 * gpu_memory_gb * 1024 else "no"
            row["activations"] = "counted" if size in measured else "extrapolated"
            rows.append(row)
    notes = [english("memory.counted", preset=cfg.preset, backbone=cfg.backbone, autocast=fixed.autocast,
                     optimizer=cfg.optimizer, sizes=", ".join(f"{s} px" for s in measured), device=device.type),
             english("memory.fit", intercept=intercept, slope=slope * 1e6),
             english("memory.fits", gb=gpu_memory_gb)]
    if device.type != "cuda" and not cfg.amp:
        notes.append(english("memory.cpu_fp32"))
    result = BenchResult("memory", english("memory.title_table", backbone=cfg.backbone), rows,
                         ["image size", "batch", "parameters MiB", "gradients MiB", "optimizer MiB",
                          "activations MiB", "total MiB", "fits", "activations"], notes,
                         provenance(python_call("lab.memory.memory_table", preset=preset, image_sizes=image_sizes,
                                                batch_sizes=batch_sizes, measure_sizes=measure_sizes,
                                                gpu_memory_gb=gpu_memory_gb)))
    result.provenance["gpu_memory_gb_compared"] = gpu_memory_gb
    return result


def plot_memory_table(result: BenchResult):
    """`memory_table`'s plot: each row's parts stacked, against the GPU compared."""
    import matplotlib.pyplot as plt
    parts = ["parameters MiB", "gradients MiB", "optimizer MiB", "activations MiB"]
    labels = [f"{row['image size']} px x{row['batch']}" for row in result.rows]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.45 * len(labels)), 4))
    bottom = [0.0] * len(labels)
    for part in parts:
        values = [row[part] / 1024 for row in result.rows]
        # the legend's "activations", not the status column's (terms.json words that one 活性値の求め方)
        ax.bar(labels, values, bottom=bottom, label=say("memory.legend_activations") if part == "activations MiB"
               else term(part.replace(" MiB", "")))
        bottom = [b + v for b, v in zip(bottom, values)]
    limit = result.provenance.get("gpu_memory_gb_compared")
    if limit:
        ax.axhline(limit, color="tab:red", linestyle="--", label=f"{limit:g} GB GPU")
    ax.set(ylabel="GiB", title=f"{shown(result.title)}\n{shown(result.provenance.get('hardware', ''))}")
    ax.tick_params(axis="x", rotation=60)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fit_titles(fig)


register_plot("memory", plot_memory_table)


# --------------------------------------------------------------------------- bytes per parameter (chapter 1)

#: The recipes `bytes_per_parameter` derives and measures: (name, optimizer, autocast).
RECIPES = (("fp32, SGD + momentum", "sgd", False), ("fp32, AdamW", "adamw", False),
           ("AMP, SGD + momentum", "sgd", True), ("AMP, AdamW", "adamw", True))


def derived_bytes(optimizer: str, momentum: float = 0.9) -> dict[str, int]:
    """Bytes per parameter of a recipe's fixed memory, from first principles.

    Weights are fp32 (4 B), and gradients take the weights' dtype (4 B). SGD with momentum keeps
    one fp32 buffer per weight (4 B; none without momentum), AdamW two moments (8 B). Autocast
    changes none of these: the fp32 weights stay (the "master weights") and each op casts them to
    half precision on the fly; those copies (2 B per weight, until backward) are saved tensors, so
    they count as activations, and what autocast shrinks is the activations.
    """
    state = {"sgd": 4 if momentum else 0, "adamw": 8}[optimizer]
    return {"weights": 4, "gradients": 4, "optimizer state": state}


def _step_bytes(model, settings: Config, optimizers: tuple[str, ...], image_size: int, device: torch.device) -> dict:
    """One real forward and backward of `model` under the settings' autocast (batch 1), then one
    `step()` of a fresh optimizer of each kind in `optimizers` on those gradients: MiB of the
    weights and gradients, of each optimizer's state, and the gradients' dtype."""
    cfg = _derived(settings, device)
    model.zero_grad(set_to_none=True)
    images, targets = to_device(*synthetic_batch(image_size, 1), device)
    with autocast(cfg, device):
        losses = model(images, targets)
    sum(losses.values()).backward()  # no GradScaler: what a step holds does not depend on the scale
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters if p.grad is not None]
    measured = {"weights": _tensor_mb(parameters), "gradients": _tensor_mb(grads),
                "gradient dtype": str(grads[0].dtype).replace("torch.", "")}
    for kind in optimizers:
        optimizer = build_optimizer(model, _derived(dataclasses.replace(settings, optimizer=kind), device))
        optimizer.step()
        measured[kind] = _tensor_mb(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        del optimizer
    model.zero_grad(set_to_none=True)
    return measured


def _recipe(base: Config, amp: bool, image_size: int) -> Config:
    """The base settings at one recipe's autocast (its preset's dtype for the device) and size."""
    return _sized(dataclasses.replace(base, amp=amp, amp_dtype=None), image_size)


def _derived(settings: Config, device: torch.device) -> Config:
    """Settings derived for one process on `device`: the autocast a recipe's step runs under."""
    return derive(settings, 1, device)


#: RPN/RoI sampling for `bytes_per_parameter`'s steps: lighter sampling changes no parameter, only time.
LIGHT_SAMPLING = dict(rpn_pre_nms_top_n=200, rpn_post_nms_top_n=100, rpn_batch_size_per_image=64,
                      box_batch_size_per_image=64)


@releases_gpu_cache
def bytes_per_parameter(preset: str = "gpu-r50", image_size: int = 96,
                        device: torch.device | str | None = None) -> BenchResult:
    """Each of `RECIPES` derived (`derived_bytes` x the model's real parameter count) beside what
    a real step of that recipe left in memory: the model's forward and backward at `image_size`
    (batch 1) without and with autocast (float16 on a GPU, bfloat16 on a CPU), then one `step()`
    of each optimizer on those gradients (`LIGHT_SAMPLING`: the steps take seconds on a CPU).

    Each row: the derived bytes per parameter (weights, gradients, optimizer state, their sum),
    derived and measured MiB of that fixed part, the measured bytes per parameter of each part,
    `as derived` (every part within 0.01 B per parameter of its derivation) and the gradients' dtype.
    """
    device = torch.device(device) if device is not None else du.info().device
    base = make_config(preset, **LIGHT_SAMPLING)
    model = _rig(_recipe(base, False, image_size), device).module
    count = sum(p.numel() for p in model.parameters())
    optimizers = tuple(dict.fromkeys(optimizer for _, optimizer, _ in RECIPES))
    steps = {amp: _step_bytes(model, _recipe(base, amp, image_size), optimizers, image_size, device)
             for amp in (False, True)}
    rows = []
    for name, optimizer, amp in RECIPES:
        cfg = _derived(_recipe(base, amp, image_size), device)
        derived = derived_bytes(optimizer, cfg.momentum)
        step = steps[amp]
        measured = {"weights": step["weights"], "gradients": step["gradients"], "optimizer state": step[optimizer]}
        per_param = {part: measured[part] * MIB / count for part in derived}
        rows.append({"recipe": name, **{f"{part} B": b for part, b in derived.items()},
                     "fixed B/param": sum(derived.values()), "derived MiB": sum(derived.values()) * count / MIB,
                     "measured MiB": sum(measured.values()),
                     **{f"measured {part} B": per_param[part] for part in derived},
                     "as derived": all(abs(per_param[p] - derived[p]) < 0.01 for p in derived),
                     "gradient dtype": step["gradient dtype"],
                     "autocast": str(autocast_dtype(cfg)).replace("torch.", "") if amp else "off"})
    notes = [english("memory.derived", preset=preset, backbone=base.backbone, count=count, device=device.type,
                     size=image_size), english("memory.amp_fixed")]
    columns = ["recipe", "weights B", "gradients B", "optimizer state B", "fixed B/param", "derived MiB",
               "measured MiB", "as derived", "gradient dtype", "autocast"]
    result = BenchResult("bytes_per_parameter", english("memory.title_bytes", backbone=base.backbone),
                         rows, columns, notes, provenance(python_call("lab.memory.bytes_per_parameter", preset=preset,
                                                                       image_size=image_size)))
    result.provenance["parameters"] = count
    return result


@releases_gpu_cache
def autocast_activations(preset: str = "gpu-r50", image_sizes: tuple[int, ...] = (192, 320),
                         extrapolate_to: tuple[int, ...] = (), device: torch.device | str | None = None) -> list[dict]:
    """Activations (the tensors autograd saves, `breakdown`'s count) of one forward pass at each
    size, batch 1, in fp32 and under autocast (float16 on a GPU, bfloat16 on a CPU), one model;
    then rows for `extrapolate_to` sizes, each fitted as a + b x pixels through the first and last
    counted size (as `memory_table` extrapolates), marked "extrapolated".

    Autocast saves half-size activations but also its half-precision copy of each weight it casts
    (2 B per parameter): at small images the copies can outweigh the savings.
    """
    device = torch.device(device) if device is not None else du.info().device
    base = make_config(preset)
    model = _rig(_recipe(base, False, image_sizes[0]), device).module
    rows = []
    for size in image_sizes:
        model.transform.min_size, model.transform.max_size = (size,), size  # resize to this size, as _sized
        fp32, amp = (_activations(model, *synthetic_batch(size, 1), _derived(_recipe(base, on, size), device),
                                  device)[0] for on in (False, True))
        rows.append({"image size": size, "fp32 MiB": fp32, "autocast MiB": amp, "activations": term("counted")})
    first, last = rows[0], rows[-1]
    for size in extrapolate_to:
        row = {"image size": size, "activations": term("extrapolated")}
        for key in ("fp32 MiB", "autocast MiB"):
            slope = (last[key] - first[key]) / (last["image size"] ** 2 - first["image size"] ** 2)
            row[key] = first[key] + slope * (size ** 2 - first["image size"] ** 2)
        rows.append(row)
    for row in rows:
        row["autocast / fp32"] = row["autocast MiB"] / row["fp32 MiB"]
    return rows


def fixed_bytes(preset: str) -> dict:
    """A preset's parameter count and the fixed part (weights, gradients, optimizer state) that its
    own optimizer implies in fp32 (`derived_bytes`), without building an optimizer or a batch."""
    cfg = make_config(preset)
    count = sum(p.numel() for p in build_model(cfg, num_classes=4).parameters())
    per_parameter = sum(derived_bytes(cfg.optimizer, cfg.momentum).values())
    return {"preset": preset, "backbone": cfg.backbone, "optimizer": cfg.optimizer, "parameters": count,
            "bytes per parameter": per_parameter, "MiB": count * per_parameter / MIB}
