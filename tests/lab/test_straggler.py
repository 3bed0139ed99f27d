"""Chapter 9's straggler demo and chapter 7's no_sync check, on this host and on simulated 1- and 8-GPU
hosts: the balanced run is exactly balanced (N2), the prose says what StragglerCheck did in each run,
the answer predicts what the check computes against the median of 2 ranks (N6), and the no_sync check
says where its processes ran (L4)."""
from __future__ import annotations

import pytest
from fake_gpus import FakeNvml, host

from maskrcnn_tut.lab import book, provenance, scale_findings, speed_findings
from maskrcnn_tut.lab.processes import demo_processes
from maskrcnn_tut.monitor import StragglerCheck


@pytest.mark.parametrize("processes, per_process", [(2, 4), (4, 2), (8, 2), (8, 1), (3, 5)])
def test_the_even_split_is_exactly_even_and_holds_the_same_images(processes, per_process):
    uneven, even = speed_findings.split_batches(per_process, processes)
    assert len(set(even)) == 1 and sum(even) == sum(uneven) and len(uneven) == processes
    assert uneven[-1] > uneven[0]


def run(batches, warnings=()):
    return {"batch per rank": batches, "forward s per rank": [0.1 * b for b in batches], "step s": 1.0,
            "warnings": list(warnings)}


def words_on(monkeypatch, gpus: int, balanced_warns: bool) -> tuple[str, list[int]]:
    host(monkeypatch, FakeNvml(8), ",".join(map(str, range(gpus))))
    processes, _ = demo_processes()
    uneven, even = speed_findings.split_batches(book.book_config().batch_size, processes)
    balanced = run(even, ["straggler: rank 0"] if balanced_warns else [])
    found = speed_findings.imbalance(run(uneven, ["straggler: rank 7"]), balanced)
    gpu_count = len(provenance.hardware()["gpus"])
    return scale_findings.straggler_words(found, balanced, StragglerCheck().threshold, processes, gpu_count), even


def test_eight_gpus_get_equal_batches_and_quiet_is_said_only_when_measured(monkeypatch):
    quiet, even = words_on(monkeypatch, 8, balanced_warns=False)
    assert even == [8] * 8  # gpu-r50's images per GPU on the fake hosts' 80 GB cards
    assert "with equal batches (8, 8, 8, 8, 8, 8, 8, 8 images) it stayed quiet" in quiet
    warned, _ = words_on(monkeypatch, 8, balanced_warns=True)
    assert "stayed quiet" not in warned and "warned in the balanced run" in warned
    assert "one GPU" not in warned and "median is their mean" not in warned


def test_one_gpu_says_the_two_processes_share_it(monkeypatch):
    said, even = words_on(monkeypatch, 1, balanced_warns=False)
    assert len(even) == 2 and "one GPU" in said and "median is their mean" in said


def test_the_answer_uses_the_median_of_two_ranks():
    """5 images against 4 on 2 ranks: 1.25x the other, but 5 / 4.5 = 1.11x the median: quiet."""
    two = scale_findings.straggler_answer(4, 1.2, 2)
    assert two["ratio"] == pytest.approx(5 / 4.5) and not two["warns"] and two["needed"] == pytest.approx(1.5)
    eight = scale_findings.straggler_answer(2, 1.2, 8)
    assert eight["ratio"] == pytest.approx(1.5) and eight["warns"] and eight["needed"] == 1.2


@pytest.mark.parametrize("gpus, said", [(0, "CPU cores"), (1, "one GPU"), (8, "a GPU of its own")])
def test_the_no_sync_check_says_where_it_ran(monkeypatch, gpus, said):
    """L4: on GPU hosts the check's toy models live on the GPUs (gloo with CUDA tensors), not on the CPU."""
    if gpus:
        host(monkeypatch, FakeNvml(8), ",".join(map(str, range(gpus))))
    words = scale_findings.no_sync_check_words(len(provenance.hardware()["gpus"]))
    assert said in words and ("CPU cores" in words) == (gpus == 0)
