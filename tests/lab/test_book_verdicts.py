"""The verdicts and hardware-conditioned sentences of chapters 1, 3, 5, 6, 10 and 11, from hand-made
figures and simulated 1- and 8-GPU hosts: each branch a chapter can print."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from fake_gpus import FakeNvml, host

from maskrcnn_tut.config import make_config
from maskrcnn_tut.lab import article, book, machine_findings, provenance, speed_findings, timeline
from maskrcnn_tut.lab.stored.result import BenchResult
from maskrcnn_tut.lab.wording import FASTER, SLOWER, WITHIN_NOISE

REPO = Path(__file__).resolve().parents[2]


def _loader_row(workers: int, img_s: float, data_ms: float, compute_ms: float) -> dict:
    return {"setting": f"workers={workers}", "img/s": img_s, "data ms": data_ms, "compute ms": compute_ms,
            "knobs": {"workers": workers, "persistent_workers": False}}


@pytest.mark.parametrize("share, ratio", [(0.4, 1.6), (0.5, 1.9), (0.25, 1.32)])
def test_workers_can_gain_up_to_share_over_one_minus_share(share, ratio):
    # a data-bound step: hiding all of its data time multiplies img/s by 1 / (1 - share), so a real
    # gain above share itself (the first edition's bound) is no sign of a busy machine
    rows = [_loader_row(0, 10.0, 100 * share, 100 * (1 - share)), _loader_row(2, 10.0 * ratio, 1.0, 100 * (1 - share))]
    found = speed_findings.loader(BenchResult("loader", "t", rows, []))
    assert found["ceiling"] == pytest.approx(1 / (1 - share))
    assert found["verdict"] == FASTER


def test_a_gain_beyond_the_ceiling_is_too_large():
    rows = [_loader_row(0, 10.0, 40.0, 60.0), _loader_row(2, 18.0, 1.0, 60.0)]
    assert speed_findings.loader(BenchResult("loader", "t", rows, []))["verdict"] == speed_findings.TOO_LARGE


# --------------------------------------------------------------------------- chapter 6: cudnn.benchmark


def test_the_mask_head_meets_a_bounded_number_of_shapes():
    # at most batch x RoIs per image x 0.25 positives: the first edition said it "never stops autotuning"
    assert timeline.mask_head_bound(make_config("cpu-tiny")) == 4 * 64 // 4
    assert timeline.mask_head_bound(make_config("gpu-r50")) == 2 * 512 // 4


def _cudnn_row(shape: str, benchmark: bool | None, median: float, every: float) -> dict:
    name = f"{shape} sizes" + ("" if benchmark is None else f", cudnn.benchmark={benchmark}")
    return {"setting": name, "img/s": median, "img/s lo": median * 0.98, "img/s hi": median * 1.02,
            "img/s all steps": every, "knobs": {"shape": shape, "cudnn_benchmark": bool(benchmark)}}


def test_cudnn_sweep_on_a_cpu_has_no_benchmark_verdict():
    found = speed_findings.cudnn(BenchResult("cudnn", "t", [_cudnn_row("fixed", None, 10.0, 9.0),
                                                            _cudnn_row("varying", None, 8.0, 7.0)], []))
    assert found["benchmark"] is None and found["comparison"].verdict == FASTER
    said = machine_findings.benchmark_verdict(found, steps=8, bound=64)
    assert "no GPU" in said and "at most 64" in said and "one-time cost" in said and "never" not in said


def test_cudnn_benchmark_verdicts_on_a_gpu():
    rows = [_cudnn_row("fixed", False, 10.0, 9.8), _cudnn_row("fixed", True, 12.0, 9.0),  # paid per step, not yet
            _cudnn_row("varying", False, 8.0, 7.8), _cudnn_row("varying", True, 8.0, 6.0)]  # no faster kernels
    found = speed_findings.cudnn(BenchResult("cudnn", "t", rows, []))
    assert found["benchmark"] == {"fixed": (FASTER, SLOWER), "varying": (WITHIN_NOISE, SLOWER)}
    said = machine_findings.benchmark_verdict(found, steps=8, bound=256)
    assert "in 8 steps the autotuning of new shapes cost more than it saved" in said and "at most 256" in said
    assert "With varying sizes autotuning found no faster kernels" in said
    paid = speed_findings.cudnn(BenchResult("cudnn", "t", [_cudnn_row("fixed", False, 10.0, 9.0),
                                                           _cudnn_row("fixed", True, 12.0, 11.0),
                                                           _cudnn_row("varying", False, 8.0, 7.0)], []))
    assert machine_findings.benchmark_verdict(paid, steps=30, bound=256).endswith("paid for itself within 30 steps.")


# --------------------------------------------------------------------------- hosts: CPU, 1 GPU, 8 GPUs


@pytest.fixture(params=[0, 1, 8], ids=["CPU", "1 GPU", "8 GPUs"])
def gpus(request, monkeypatch) -> int:
    """This test's machine: no GPU (the real CPU), or 1 or 8 simulated GPUs."""
    if request.param:
        host(monkeypatch, FakeNvml(request.param), ",".join(map(str, range(request.param))))
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return request.param


def test_the_deterministic_sentence_follows_the_device_and_torchvision(gpus):
    hw = provenance.hardware()
    assert len(hw["gpus"]) == gpus
    assert machine_findings.roi_align_compiles_when_deterministic()  # torchvision 0.29's roi_align under the flag
    said = machine_findings.determinism(hw, repeated=True, threads=2)
    # torchvision >= 0.19 swaps RoIAlign for a compiled kernel with a deterministic backward
    assert "compiled pure-PyTorch kernel whose backward is deterministic" in said and "NLL loss" in said
    assert "adds with atomics), so" not in said
    assert ("this machine's" in said) == bool(gpus) and ("No GPU here" in said) == (not gpus)
    assert ("8 GPUs" in said) == (gpus == 8)
    older = machine_findings.determinism(hw, repeated=True, threads=2, compiled_roi_align=False)
    assert "no deterministic CUDA kernel for RoIAlign's backward" in older


def test_a_cpu_run_that_did_not_repeat_is_said_so(gpus):
    if gpus:
        pytest.skip("the repeat check is a CPU sentence")
    said = machine_findings.determinism(provenance.hardware(), repeated=False, threads=4)
    assert "did not repeat" in said and "at 4 threads" in said


@pytest.mark.parametrize("cores", [2, 16, 64])
def test_workers_take_cpu_time_from_training_only_where_cores_are_short(gpus, cores, monkeypatch):
    monkeypatch.setattr(provenance, "usable_cores", lambda: cores)
    said = machine_findings.workers_and_cores(provenance.hardware(), workers=4)
    grows = "expect the compute bars to grow" in said
    # on a CPU training uses every core; on GPUs each process needs a core beside its 4 workers
    expected = {0: cores <= 16, 1: cores < 5, 8: cores < 40}[gpus]
    assert grows == expected, said
    assert f"on {cores} cores" in said or f"has {cores}" in said or f"all {cores} usable cores" in said


# --------------------------------------------------------------------------- chapters 1, 5 and 10


def test_half_precision_weight_copies_explain_only_a_share_above_one():
    assert "outweigh what the smaller activations save" in machine_findings.autocast_small_images(1.2, 192, 84)
    below = machine_findings.autocast_small_images(0.8, 192, 84)
    assert "80%" in below and "outweigh what the smaller" not in below


@pytest.mark.parametrize("capability, tf32, tools", [(None, False, True), ((7, 0), False, False),
                                                     ((9, 0), True, True)])
def test_tf32_sentence(capability, tf32, tools):
    said = machine_findings.tf32(capability)
    assert ('the "fp32" rows below are TF32' in said) == tf32
    assert ("The book's tools keep TF32 on" in said) == tools


@pytest.mark.parametrize("ap50, losses, learned, fell", [(0.0, [3.0, 2.5], "has not learned", True),
                                                        (0.3, [3.0, 2.5], "started to learn", True),
                                                        (0.8, [2.0, 2.1], "segments most shapes", False)])
def test_a_short_run_is_judged_by_what_it_reached(ap50, losses, learned, fell):
    found = machine_findings.first_run(ap50, losses)
    assert learned in found["learned"] and found["fell"] == fell
    assert ("still falling" in found["trend"]) == fell


# --------------------------------------------------------------------------- chapters 0, 2 and 11


def test_gpu_r50_is_not_called_the_reference_recipe_where_it_differs():
    rows = {row["setting"]: row for row in article.reference_recipe()}
    for same in ("images per GPU", "lr for 16 images", "momentum", "warm-up", "lr decay", "aspect-ratio grouping"):
        assert rows[same]["same"], rows[same]  # images per GPU: on this GPU-less machine; a card of 40 GB takes 8
    for differs in ("backbone at the start", "normalization", "epochs", "weight decay", "AMP"):
        assert not rows[differs]["same"], rows[differs]
    assert rows["lr for 16 images"]["gpu-r50"] == pytest.approx(0.02)  # linear scaling for SGD
    chapters = {path.name: " ".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
                for path in (REPO / "book").glob("*.ipynb")}
    equated = {name for name, text in chapters.items()
               if re.search(r"(:|\bis)\s+torchvision's\s+reference\s+recipe", text)}
    assert equated == set()  # "after" it, "beside" it: chapter 2 lists where they differ


def test_the_fast_path_verdict_is_plain_words():
    fast = BenchResult("fast_path", "t", [{"setting": "eager", "img/s": 10.0, "img/s lo": 9.5, "img/s hi": 10.5},
                                          {"setting": "fixed shapes", "img/s": 12.0, "img/s lo": 11.5,
                                           "img/s hi": 12.5}], [])
    found = speed_findings.fast_path(fast)
    assert found["comparison"].words("eager") == "faster than eager" and found["ratio"] == pytest.approx(1.2)
    rough = BenchResult("fast_path", "t", [{"setting": "eager", "img/s": 10.0}, {"setting": "cl", "img/s": 10.2}], [])
    assert speed_findings.fast_path(rough)["comparison"].verdict == WITHIN_NOISE
    assert all(row["source"] and row["conditions"] for row in book.PUBLISHED_FAST_PATH)


def test_too_noisy_is_said_once_where_within_noise_is_explained():
    # the verdicts read "faster than X" / "within noise of X"; only chapter 3 says what that means
    repo = Path(__file__).resolve().parents[2]
    sources = [*repo.joinpath("maskrcnn_tut").rglob("*.py"), *repo.joinpath("book").glob("*.ipynb")]
    found = [path.name for path in sources for _ in range(path.read_text().lower().count("too noisy"))]
    assert found == ["03_dataloader_tuning.ipynb"]
