"""health: the article's healthy ranges as advice on metric rows and GPU summaries, on a CPU and on
simulated 1- and 8-GPU hosts (N5: memory judged by the run's allocator peak, never by NVML's used)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fake_gpus import FakeNvml, host

from maskrcnn_tut import distributed as du
from maskrcnn_tut.lab.health import health_advice
from maskrcnn_tut.lab.nvml import GPUSampler


def rows(data_time: float, iter_time: float, memory_mb: float, n: int = 4) -> list[dict]:
    return [{"step": s, "data_time": data_time, "iter_time": iter_time, "img_per_s": 4 / iter_time,
             "max_mem_mb": memory_mb} for s in range(1, n + 1)]


def test_health_advice_flags_starved_steps_full_memory_and_idle_gpus():
    healthy = health_advice(rows(0.02, 0.5, 100.0), total_memory_mb=1000.0)
    assert healthy.ok and [c.ok for c in healthy.checks] == [None, True, True]
    starved = health_advice(rows(0.4, 0.5, 950.0), total_memory_mb=1000.0)
    assert not starved.ok and [c.ok for c in starved.checks] == [None, False, False]
    assert "--workers" in starved.checks[1].message and "--batch-size" in starved.checks[2].message
    gpus = [{"gpu": 0, "util_mean": 40.0, "mem_used_max_mb": 500.0, "mem_total_mb": 1000.0},
            {"gpu": 1, "util_mean": 80.0, "mem_used_max_mb": 950.0, "mem_total_mb": 1000.0}]
    report = health_advice(rows(0.05, 0.5, 100.0), gpus)
    assert [c.ok for c in report.checks] == [False, True, True, True]
    assert "waits" in report.checks[0].message and "FIX" in str(report)
    with pytest.raises(ValueError, match="at least one metric row"):
        health_advice([])


def test_a_loader_that_makes_steps_wait_is_not_said_to_keep_up():
    """M2 (book-review-3): the article's criterion (data time below compute time) passed a step that waited
    90 ms for its batch and computed 100 ms, idle 47 % of the time; the check judges the share of a step spent
    waiting, the one definition chapter 8 prints beside it, and gives chapter 3's ceiling."""
    waiting = health_advice(rows(0.09, 0.19, 100.0), total_memory_mb=1000.0).checks[1]
    assert waiting.ok is False and "waits 47 % of its time" in waiting.message and "1.90x" in waiting.message
    assert "--workers" in waiting.message and waiting.name == "data wait <= 10 % of a step"
    quick = health_advice(rows(0.002, 0.102, 100.0), total_memory_mb=1000.0).checks[1]
    assert quick.ok is True and "waits 2 % of its time" in quick.message and "keeps up" in quick.message


class FullNvml(FakeNvml):
    """NVML shows every GPU 95 % used (a warm allocator cache, or another user's process)."""

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=76 * 2**30, total=80 * 2**30)


@pytest.mark.parametrize("gpus, visible", [(1, "0"), (8, "0,1,2,3,4,5,6,7")])
def test_memory_is_judged_by_the_allocator_peak_not_nvml_used(monkeypatch, gpus, visible):
    host(monkeypatch, FullNvml(gpus), visible)
    monkeypatch.setattr(du, "_INFO", du.DistInfo(device=torch.device("cuda", 0)))
    with GPUSampler(interval_s=60) as sampler:
        pass
    assert sampler.available, sampler.reason
    card_mb = 80 * 1024
    warm = health_advice(rows(0.05, 0.5, 0.5 * card_mb), sampler).checks[-1]
    assert warm.ok is True and "max_memory_allocated" in warm.message and "77824" in warm.message
    full = health_advice(rows(0.05, 0.5, 0.95 * card_mb), sampler).checks[-1]
    assert full.ok is False and "--batch-size" in full.message


def test_launch_bound_gpus_are_not_told_to_use_amp(monkeypatch):
    idle = [{"gpu": 0, "util_mean": 30.0, "mem_used_max_mb": 500.0, "mem_total_mb": 1000.0}]
    advice = health_advice(rows(0.05, 0.5, 100.0), idle).checks[0].message
    assert "use --amp" not in advice and "--batch-size" in advice
