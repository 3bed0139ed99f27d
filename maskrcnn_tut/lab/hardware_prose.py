"""The book's sentences that depend on this machine, written from what the chapter measured.

A chapter passes the facts it has (its `book.hardware_summary()`, a census of shapes, a run's
figures); each function returns the sentence that is true of them. So no chapter types a claim
about cores, GPUs, bf16 or a library version that it did not check, and every branch, the GPU
ones included, is tested on simulated 1- and 8-GPU hosts.

- `benchmark_verdict(found, steps, bound)`: what the cuDNN sweep says about `cudnn.benchmark` (ch. 6).
- `determinism(hw, repeated, threads)`, `roi_align_compiles_when_deterministic()`: what
  `--deterministic` does on this machine's device (ch. 6).
- `workers_and_cores(hw, workers)`: whether loader workers take CPU time from training (ch. 3).
- `autocast_small_images(ratio, size, weight_copies_mib)`: autocast's activations at small images (ch. 1).
- `tf32(capability)`: whether this GPU's "fp32" is TF32, and that the book's tools keep it on (ch. 5).
- `first_run(ap50, losses)`: what a short run of train.py reached (ch. 10).
"""
from __future__ import annotations

import inspect

import torchvision

from .wording import FASTER, SLOWER


def benchmark_verdict(found: dict, steps: int, bound: int) -> str:
    """Chapter 6's verdict on `cudnn.benchmark` from `speed_findings.cudnn(sweep)`: on GPUs, per
    kind of image sizes, on against off at the median step and over every step; on a CPU, what a
    GPU would measure instead (the sweep has no benchmark rows there)."""
    if found["benchmark"] is None:
        return ("This machine has no GPU, so the sweep could not time `cudnn.benchmark`; on a GPU the same cell times "
                "it off and on. What decides it there: each new input shape is autotuned once and then read from "
                f"cuDNN's cache. With fixed sizes the backbone meets a few shapes and the mask head at most {bound} "
                "(the bound above), so autotuning is a one-time cost that a long run amortises; with varying sizes "
                "the backbone keeps meeting new shapes for much longer.")
    sentences = []
    for kind, (median, every) in found["benchmark"].items():
        if median != FASTER:
            sentences.append(f"With {kind} sizes autotuning found no faster kernels: the median step with "
                             f"`cudnn.benchmark=True` was {'slower' if median == SLOWER else 'no faster'}.")
        elif every == FASTER:
            sentences.append(f"With {kind} sizes `cudnn.benchmark=True` was faster even counting the steps that "
                             f"autotuned: it paid for itself within {steps} steps.")
        else:
            sentences.append(f"With {kind} sizes `cudnn.benchmark=True` made the median step faster but, counting "
                             f"every step, was {'slower' if every == SLOWER else 'no faster'}: in {steps} steps the "
                             "autotuning of new shapes cost more than it saved. That cost is paid once per shape "
                             f"(at most {bound} in the mask head), so a longer run (`bench.sweep_cudnn(steps=...)`) "
                             "is the fair test.")
    return " ".join(sentences)


def roi_align_compiles_when_deterministic() -> bool:
    """Whether the installed torchvision swaps RoIAlign for its compiled pure-PyTorch version,
    whose backward is deterministic, when deterministic algorithms are on (torchvision >= 0.19)."""
    module = inspect.getmodule(torchvision.ops.roi_align)
    return hasattr(module, "_roi_align") and "are_deterministic_algorithms_enabled" in inspect.getsource(module)


def determinism(hw: dict, repeated: bool, threads: int, compiled_roi_align: bool | None = None) -> str:
    """What chapter 6's check found on this device, then what `--deterministic` does on a GPU (this
    one, or one the reader may have): cuDNN and cuBLAS settings, RoIAlign's compiled kernel where
    torchvision has it (`compiled_roi_align`, default: the installed one), warnings for the rest."""
    compiled = roi_align_compiles_when_deterministic() if compiled_roi_align is None else compiled_roi_align
    if hw["gpus"]:
        opening = (f"On this machine's {len(hw['gpus'])} GPU{'s' * (len(hw['gpus']) > 1)} the flag matters: ")
    else:
        seen = ("gave identical losses, so here the seed alone made a run repeat and `--deterministic` adds nothing "
                "you could see in a loss" if repeated else
                "did not repeat, so even here the seed alone is not enough: use `--deterministic`")
        opening = (f"Two CPU runs with the same seed, at {threads} thread{'s' * (threads > 1)}, {seen} (another "
                   "thread count can change the order of a sum). No GPU here; on one the flag matters: ")
    roi = (f"with deterministic algorithms on, torchvision {torchvision.__version__.split('+')[0]} runs RoIAlign "
           "through a compiled pure-PyTorch kernel whose backward is deterministic (it costs a `torch.compile` at "
           "the first steps and some memory), and the CUDA ops that still have no deterministic kernel, such as "
           "the classification loss's NLL loss, only warn (`warn_only`), so runs repeat except in the ops those "
           "warnings name." if compiled else
           f"torchvision {torchvision.__version__.split('+')[0]} has no deterministic CUDA kernel for RoIAlign's "
           "backward (it adds with atomics), so `--deterministic` only warns there (`warn_only`) and runs can still "
           "differ in the last bits.")
    return (opening + "`cudnn.benchmark` may pick different algorithms in different runs and several CUDA kernels "
            "add with atomics in whatever order threads arrive, so the same seed can give different last bits, "
            "which training then amplifies. `--deterministic` turns on cuDNN's deterministic algorithms and "
            "`CUBLAS_WORKSPACE_CONFIG` for convolutions and matmuls; " + roi)


def workers_and_cores(hw: dict, workers: int) -> str:
    """Chapter 3's answer: whether `workers` loader workers per training process take CPU time
    from training on this machine. On a CPU the training uses every core, so workers compete with
    it; on GPUs each process mostly waits for its GPU, and only too few cores make them compete."""
    cores, gpus = hw["cores"], len(hw["gpus"])
    if not gpus:
        share = min(1.0, workers / cores)
        return (f"Here training runs on all {cores} usable cores, so {workers} workers take CPU time from it whenever "
                "they decode: expect the compute bars to " + ("grow" if share >= 0.25 else "barely change")
                + f" (the workers can keep up to {share:.0%} of the cores busy), and more workers prefetch more "
                "batches at once.")
    busy = gpus * (workers + 1)
    if busy <= cores:
        return (f"Here {gpus} training process{'es' * (gpus > 1)} (one per GPU) with {workers} workers each need "
                f"{busy} cores and this machine has {cores}: the workers need not take CPU time from the processes "
                "that launch the GPU's kernels, so expect the compute bars to stay as they are and the data bars to "
                "shrink.")
    return (f"Here {gpus} training process{'es' * (gpus > 1)} (one per GPU) with {workers} workers each would keep "
            f"{busy} processes busy on {cores} cores: the workers compete with the processes that launch the GPU's "
            "kernels, so expect the compute bars to grow; give each process fewer workers.")


def autocast_small_images(ratio: float, size: int, weight_copies_mib: float) -> str:
    """Chapter 1: autocast's activations at the smallest image size counted, as a share of fp32's;
    the half-precision weight copies explain a share above 100 % and only then."""
    if ratio > 1:
        return (f"while at {size} px they are {ratio:.0%}: there the half-precision weight copies "
                f"({weight_copies_mib:.0f} MiB at 2 bytes per parameter) outweigh what the smaller activations save.")
    return (f"and at {size} px {ratio:.0%}: even there what the smaller activations save outweighs the "
            f"half-precision weight copies ({weight_copies_mib:.0f} MiB at 2 bytes per parameter).")


def tf32(capability: tuple[int, int] | None) -> str:
    """Chapter 5: whether this machine's "fp32" rows are TF32; the book's tools keep TF32 on."""
    tools = ("The book's tools keep TF32 on: `engine.configure_runtime` turns both flags on for every CUDA run and "
             "no flag turns them off, so a true fp32 baseline needs your own script that sets "
             "`torch.backends.cudnn.allow_tf32 = False` and `torch.backends.cuda.matmul.allow_tf32 = False` after "
             "`configure_runtime`.")
    if capability and capability >= (8, 0):
        return "This GPU has TF32 tensor cores and the flags are on: the \"fp32\" rows below are TF32. " + tools
    if capability:
        return "This GPU predates Ampere: it has no TF32, so the flags change nothing and \"fp32\" is fp32."
    return ("No GPU: the TF32 flags mean nothing to a CPU, and `configure_runtime` leaves them as PyTorch sets them, "
            "so \"fp32\" below is fp32. On an Ampere or later GPU the same cell shows them on, and the fp32 rows are "
            "TF32. " + tools)


def first_run(ap50: float, losses: list[float]) -> dict:
    """Chapter 10: what a short run reached. `learned`: a sentence on its mask AP50; `trend`: the
    logged loss's last value against its first, "still falling" only when it fell."""
    if ap50 <= 0.0:
        learned = "The masks it predicts do not yet match any object: the model has not learned to segment yet"
    elif ap50 < 0.5:
        learned = "That is a model that has started to learn"
    else:
        learned = "The model already segments most shapes"
    fell = losses[-1] < losses[0]
    trend = (f"the loss {'still falling' if fell else 'no lower than where it began'} (last logged {losses[-1]:.2f}, "
             f"against {losses[0]:.2f} at the first log)")
    return {"learned": learned, "trend": trend, "fell": fell}
