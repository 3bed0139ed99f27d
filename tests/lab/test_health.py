"""health: the article's healthy ranges as advice on metric rows and GPU summaries."""
from __future__ import annotations

import pytest

from maskrcnn_tut.lab.health import health_advice


def rows(data_time: float, iter_time: float, memory_mb: float, n: int = 4) -> list[dict]:
    return [{"step": s, "data_time": data_time, "iter_time": iter_time, "img_per_s": 4 / iter_time,
             "max_mem_mb": memory_mb} for s in range(1, n + 1)]


def test_health_advice_flags_starved_steps_full_memory_and_idle_gpus():
    healthy = health_advice(rows(0.05, 0.5, 100.0), total_memory_mb=1000.0)
    assert healthy.ok and [c.ok for c in healthy.checks] == [None, True, True]
    starved = health_advice(rows(0.4, 0.5, 950.0), total_memory_mb=1000.0)
    assert not starved.ok and [c.ok for c in starved.checks] == [None, False, False]
    assert "--workers" in starved.checks[1].message and "--batch-size" in starved.checks[2].message
    gpus = [{"gpu": 0, "util_mean": 40.0, "mem_used_max_mb": 500.0, "mem_total_mb": 1000.0},
            {"gpu": 1, "util_mean": 80.0, "mem_used_max_mb": 950.0, "mem_total_mb": 1000.0}]
    report = health_advice(rows(0.05, 0.5, 100.0), gpus)
    assert [c.ok for c in report.checks] == [False, True, True, False]
    assert "waits" in report.checks[0].message and "FIX" in str(report)
    with pytest.raises(ValueError, match="at least one metric row"):
        health_advice([])
