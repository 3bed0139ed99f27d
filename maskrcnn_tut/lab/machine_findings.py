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

Each sentence is an entry of `prose/machine_findings.json`, in the book's language (`wording.say`).
"""
from __future__ import annotations

import inspect

import torchvision

from .wording import FASTER, SLOWER, say


def _count(one: str, many: str, n: int) -> str:
    """The entry `one` or `many` ("1 thread", "4 threads") of the catalog, by `n`."""
    return say(many if n > 1 else one, n=n)


#: The sizes a cudnn sweep ran, by kind, as the verdict names them.
SIZES = {"fixed": "machine_findings.sizes_fixed", "varying": "machine_findings.sizes_varying"}


def benchmark_verdict(found: dict, steps: int, bound: int) -> str:
    """Chapter 6's verdict on `cudnn.benchmark` from `speed_findings.cudnn(sweep)`: on GPUs, per
    kind of image sizes, on against off at the median step and over every step; on a CPU, what a
    GPU would measure instead (the sweep has no benchmark rows there)."""
    if found["benchmark"] is None:
        return say("machine_findings.benchmark_no_gpu", bound=bound)
    sentences = []
    for kind, (median, every) in found["benchmark"].items():
        sizes = say(SIZES[kind])
        if median != FASTER:
            sentences.append(say("machine_findings.benchmark_no_faster", sizes=sizes,
                             how=say("machine_findings.was_slower" if median == SLOWER else "machine_findings.was_no_faster")))
        elif every == FASTER:
            sentences.append(say("machine_findings.benchmark_paid", sizes=sizes, steps=steps))
        else:
            sentences.append(say("machine_findings.benchmark_not_repaid", sizes=sizes, steps=steps, bound=bound,
                             how=say("machine_findings.was_slower" if every == SLOWER else "machine_findings.was_no_faster")))
    return say("machine_findings.sep").join(sentences)


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
        gpus = _count("machine_findings.gpus_one", "machine_findings.gpus_many", len(hw["gpus"]))
        opening = say("machine_findings.opening_gpus", gpus=gpus)
    else:
        opening = say("machine_findings.opening_cpu",
                      threads=_count("machine_findings.threads_one", "machine_findings.threads_many", threads),
                      seen=say("machine_findings.cpu_repeated" if repeated else "machine_findings.cpu_not_repeated"))
    version = torchvision.__version__.split("+")[0]
    roi = say("machine_findings.roi_compiled" if compiled else "machine_findings.roi_atomic", version=version)
    return say("machine_findings.determinism", opening=opening, roi=roi)


def workers_and_cores(hw: dict, workers: int) -> str:
    """Chapter 3's answer: whether `workers` loader workers per training process take CPU time
    from training on this machine. On a CPU the training uses every core, so workers compete with
    it; on GPUs each process mostly waits for its GPU, and only too few cores make them compete."""
    cores, gpus = hw["cores"], len(hw["gpus"])
    if not gpus:
        share = min(1.0, workers / cores)
        return say("machine_findings.workers_cpu", cores=cores, workers=workers, share=share,
                   change=say("machine_findings.bars_grow" if share >= 0.25 else "machine_findings.bars_barely_change"))
    busy = gpus * (workers + 1)
    return say("machine_findings.workers_gpus_fit" if busy <= cores else "machine_findings.workers_gpus_short",
               cores=cores, workers=workers, busy=busy,
               processes=_count("machine_findings.processes_one", "machine_findings.processes_many", gpus))


def autocast_small_images(ratio: float, size: int, weight_copies_mib: float) -> str:
    """Chapter 1: autocast's activations at the smallest image size counted, as a share of fp32's;
    the half-precision weight copies explain a share above 100 % and only then."""
    return say("machine_findings.copies_outweigh" if ratio > 1 else "machine_findings.savings_outweigh",
               size=size, ratio=ratio, mib=weight_copies_mib)


def tf32(capability: tuple[int, int] | None) -> str:
    """Chapter 5: whether this machine's "fp32" rows are TF32; the book's tools keep TF32 on."""
    tools = say("machine_findings.tf32_tools")
    if capability and capability >= (8, 0):
        return say("machine_findings.tf32_on", tools=tools)
    if capability:
        return say("machine_findings.tf32_none")
    return say("machine_findings.tf32_cpu", tools=tools)


def first_run(ap50: float, losses: list[float]) -> dict:
    """Chapter 10: what a short run reached. `learned`: a sentence on its mask AP50; `trend`: the
    logged loss's last value against its first, "still falling" only when it fell."""
    learned = say("machine_findings.learned_nothing" if ap50 <= 0.0 else "machine_findings.learned_started"
                  if ap50 < 0.5 else "machine_findings.learned_most")
    fell = losses[-1] < losses[0]
    how = say("machine_findings.still_falling" if fell else "machine_findings.not_lower")
    trend = say("machine_findings.trend", how=how, last=losses[-1], first=losses[0])
    return {"learned": learned, "trend": trend, "fell": fell}
