"""monitor: straggler warnings (unit, and 2 gloo processes with one slowed rank), the img/s
definitions, peak memory, and a training process that imports no plotting or widgets."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from maskrcnn_tut import distributed as du
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.engine import (
    StepRecord,
    TrainState,
    build_optimizer,
    make_scaler,
    train_step,
)
from maskrcnn_tut.hardware import peak_memory_mb
from maskrcnn_tut.lab import processes
from maskrcnn_tut.lab.device_memory import reset_peak_memory
from maskrcnn_tut.lab.proofs import TinyDetector, toy_batches
from maskrcnn_tut.lab.stored.across_builds import img_per_s_quartiles
from maskrcnn_tut.monitor import (
    StragglerCheck,
    img_per_s_mean,
    img_per_s_median,
    img_per_s_wall,
    metrics_row,
)


def record(step: int, rank_times: list[float], data_time: float = 0.01, iter_time: float = 0.5) -> StepRecord:
    return StepRecord(step=step, epoch=0, lr=0.1, loss=1.0 / step, terms={}, data_time=data_time,
                      iter_time=iter_time, rank_forward_times=rank_times)


def test_straggler_check_names_the_slow_rank(caplog):
    check = StragglerCheck(every=3, threshold=1.2)
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut"):
        for step in range(1, 7):
            check(record(step, [1.0, 1.0, 1.5, 1.05]))
    assert len(check.warnings) == 2  # at steps 3 and 6 only
    assert "rank 2" in check.warnings[0] and "steps 1-3" in check.warnings[0] and "1.46x" in check.warnings[0]
    assert "forward time" in check.warnings[0]
    assert "rank 2" in caplog.text


def test_straggler_check_stays_quiet_when_ranks_are_even_or_alone():
    check = StragglerCheck(every=2, threshold=1.2)
    for step in range(1, 5):
        check(record(step, [1.0, 1.1, 0.95]))
        check(record(step, [1.0]))  # a single process has no stragglers
    assert check.warnings == []
    with pytest.raises(ValueError, match="threshold > 1"):
        StragglerCheck(threshold=0.9)


def test_each_img_per_s_figure_has_one_definition():
    times = [0.5, 0.5, 0.5, 2.5]  # a slow step (an epoch start, a new shape)
    assert img_per_s_mean(4, times) == pytest.approx(4 * 4 / 4.0)  # every second counts
    assert img_per_s_median(4, times) == pytest.approx(8.0)  # the odd slow step does not
    low, high = img_per_s_quartiles(4, times)
    assert low < img_per_s_median(4, times) <= high
    assert img_per_s_wall(100, 20.0) == 5.0
    row = metrics_row([record(1, [0.4], iter_time=0.5), record(2, [0.4], iter_time=2.5)], 4, torch.device("cpu"))
    assert row["img_per_s"] == img_per_s_mean(4, [0.5, 2.5]) and row["iter_time"] == 1.5 and row["step"] == 2


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_peak_memory_can_be_reset_between_measurements():
    device = torch.device("cpu")
    big = np.ones(60 * 2**20 // 8)  # 60 MiB, touched
    del big
    before = peak_memory_mb(device)
    reset_peak_memory(device)
    assert peak_memory_mb(device) < before - 30


# --------------------------------------------------------------------------- a straggler among 2 gloo processes


class SlowForward(nn.Module):
    """A model whose forward first sleeps `seconds` (a rank on a slower or shared device)."""

    def __init__(self, model: nn.Module, seconds: float):
        super().__init__()
        self.model, self.seconds = model, seconds

    def forward(self, images, targets):
        time.sleep(self.seconds)
        return self.model(images, targets)


def straggler_steps(delays: dict[str, list[float]], steps: int = 6) -> dict:
    """Run inside `processes.launch`: DDP steps through `engine.train_step` with rank r's forward
    slowed by delays[name][r]; each setting's StragglerCheck warnings and forward times."""
    info = du.info()
    cfg = derive(make_config("cpu-tiny", optimizer="sgd", lr=1e-3, weight_decay=0.0), info.world_size, info.device)
    out = {}
    for name, per_rank in delays.items():
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(SlowForward(TinyDetector(), per_rank[info.rank]))
        optimizer, scaler = build_optimizer(model, cfg), make_scaler(cfg, info.device)
        batches, state = iter(toy_batches(steps, 2, seed=info.rank)), TrainState()
        check, forward = StragglerCheck(every=steps), []
        for _ in range(steps):
            record = train_step(model, optimizer, scaler, batches, cfg, state)[-1]
            check(record)
            forward.append(record.rank_forward_times)
        out[name] = {"warnings": check.warnings, "forward": forward}
    return out


@pytest.mark.system
def test_straggler_check_fires_under_ddp_on_the_slowed_rank():
    result = processes.launch(straggler_steps, 2, {"slowed": [0.02, 0.08], "even": [0.02, 0.02]}, backend="gloo")
    slowed, even = result["slowed"], result["even"]
    assert len(slowed["warnings"]) == 1 and "rank 1 needed" in slowed["warnings"][0], slowed
    assert all(times[1] > times[0] + 0.04 for times in slowed["forward"])  # the wait is not in rank 0's time
    assert even["warnings"] == [], even


def test_training_modules_do_not_import_plotting_or_widgets():
    code = ("import sys, maskrcnn_tut.monitor, maskrcnn_tut.train\n"
            "print(sorted(m for m in ('matplotlib', 'ipywidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
