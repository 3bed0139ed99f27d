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

from . import wording
from .wording import FASTER, SLOWER


def _say(entry: str, **values) -> str:
    return wording.say(f"machine_findings.{entry}", **values)


def _count(entry: str, n: int) -> str:
    """`entry_one` or `entry_many` ("1 thread", "4 threads") of the catalog, by `n`."""
    return _say(f"{entry}_{'many' if n > 1 else 'one'}", n=n)


def benchmark_verdict(found: dict, steps: int, bound: int) -> str:
    """Chapter 6's verdict on `cudnn.benchmark` from `speed_findings.cudnn(sweep)`: on GPUs, per
    kind of image sizes, on against off at the median step and over every step; on a CPU, what a
    GPU would measure instead (the sweep has no benchmark rows there)."""
    if found["benchmark"] is None:
        return _say("benchmark_no_gpu", bound=bound)
    sentences = []
    for kind, (median, every) in found["benchmark"].items():
        sizes = _say(f"sizes_{kind}")
        if median != FASTER:
            sentences.append(_say("benchmark_no_faster", sizes=sizes,
                                  how=_say("was_slower" if median == SLOWER else "was_no_faster")))
        elif every == FASTER:
            sentences.append(_say("benchmark_paid", sizes=sizes, steps=steps))
        else:
            sentences.append(_say("benchmark_not_repaid", sizes=sizes, steps=steps, bound=bound,
                                  how=_say("was_slower" if every == SLOWER else "was_no_faster")))
    return _say("sep").join(sentences)


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
        opening = _say("opening_gpus", gpus=_count("gpus", len(hw["gpus"])))
    else:
        opening = _say("opening_cpu", threads=_count("threads", threads),
                       seen=_say("cpu_repeated" if repeated else "cpu_not_repeated"))
    version = torchvision.__version__.split("+")[0]
    return _say("determinism", opening=opening, roi=_say("roi_compiled" if compiled else "roi_atomic", version=version))


def workers_and_cores(hw: dict, workers: int) -> str:
    """Chapter 3's answer: whether `workers` loader workers per training process take CPU time
    from training on this machine. On a CPU the training uses every core, so workers compete with
    it; on GPUs each process mostly waits for its GPU, and only too few cores make them compete."""
    cores, gpus = hw["cores"], len(hw["gpus"])
    if not gpus:
        share = min(1.0, workers / cores)
        return _say("workers_cpu", cores=cores, workers=workers, share=share,
                    change=_say("bars_grow" if share >= 0.25 else "bars_barely_change"))
    busy = gpus * (workers + 1)
    return _say("workers_gpus_fit" if busy <= cores else "workers_gpus_short", cores=cores, workers=workers,
                busy=busy, processes=_count("processes", gpus))


def autocast_small_images(ratio: float, size: int, weight_copies_mib: float) -> str:
    """Chapter 1: autocast's activations at the smallest image size counted, as a share of fp32's;
    the half-precision weight copies explain a share above 100 % and only then."""
    return _say("copies_outweigh" if ratio > 1 else "savings_outweigh", size=size, ratio=ratio,
                mib=weight_copies_mib)


def tf32(capability: tuple[int, int] | None) -> str:
    """Chapter 5: whether this machine's "fp32" rows are TF32; the book's tools keep TF32 on."""
    tools = _say("tf32_tools")
    if capability and capability >= (8, 0):
        return _say("tf32_on", tools=tools)
    if capability:
        return _say("tf32_none")
    return _say("tf32_cpu", tools=tools)


def first_run(ap50: float, losses: list[float]) -> dict:
    """Chapter 10: what a short run reached. `learned`: a sentence on its mask AP50; `trend`: the
    logged loss's last value against its first, "still falling" only when it fell."""
    learned = _say("learned_nothing" if ap50 <= 0.0 else "learned_started" if ap50 < 0.5 else "learned_most")
    fell = losses[-1] < losses[0]
    trend = _say("trend", how=_say("still_falling" if fell else "not_lower"), last=losses[-1], first=losses[0])
    return {"learned": learned, "trend": trend, "fell": fell}
