"""monitor and dashboard: GPU sampler (no GPU, a fake NVML, an 8-GPU host under CUDA_VISIBLE_DEVICES),
straggler warnings (unit and 2 gloo processes with one slowed rank), plots, dashboard, health advice."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

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
from maskrcnn_tut.hardware import peak_memory_mb, reset_peak_memory
from maskrcnn_tut.lab import processes
from maskrcnn_tut.lab.dashboard import LiveDashboard, plot_metrics
from maskrcnn_tut.lab.gpus import GPUSampler
from maskrcnn_tut.lab.health import health_advice
from maskrcnn_tut.lab.proofs import TinyDetector, toy_batches
from maskrcnn_tut.monitor import (
    StragglerCheck,
    img_per_s_mean,
    img_per_s_median,
    img_per_s_quartiles,
    img_per_s_wall,
    metrics_row,
)


def record(step: int, rank_times: list[float], data_time: float = 0.01, iter_time: float = 0.5) -> StepRecord:
    return StepRecord(step=step, epoch=0, lr=0.1, loss=1.0 / step, terms={}, data_time=data_time,
                      iter_time=iter_time, rank_forward_times=rank_times)


def rows(data_time: float, iter_time: float, memory_mb: float, n: int = 4) -> list[dict]:
    return [{"step": s, "data_time": data_time, "iter_time": iter_time, "img_per_s": 4 / iter_time,
             "max_mem_mb": memory_mb} for s in range(1, n + 1)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_sampler_says_not_available_without_a_gpu():
    with GPUSampler(interval_s=0.01) as gpus:
        time.sleep(0.05)
    assert not gpus.available and gpus.reason.startswith("not available")
    assert gpus.samples == [] and gpus.summary() == [] and gpus.latest() == []
    assert "not available" in gpus.describe()
    check = health_advice(rows(0.01, 0.5, 100.0), gpus).checks[0]
    assert check.ok is None and "not available" in check.message


def test_gpu_sampler_thread_collects_and_summarises_readings():
    readings = iter(range(1000))

    def fake_nvml() -> list[dict]:
        value = float(next(readings))
        return [{"gpu": 0, "util": value, "mem_used_mb": 10 * value, "mem_total_mb": 1000.0},
                {"gpu": 1, "util": 50.0, "mem_used_mb": 5.0, "mem_total_mb": 1000.0}]

    with GPUSampler(interval_s=0.005, reader=fake_nvml) as gpus:
        time.sleep(0.1)
    first, second = gpus.summary()
    n = first["samples"]
    assert n >= 3 and second["samples"] == n
    assert first["util_mean"] == pytest.approx((n - 1) / 2) and first["mem_used_max_mb"] == 10 * (n - 1)
    assert second["util_mean"] == 50.0 and [g["gpu"] for g in gpus.latest()] == [0, 1]


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


def test_plot_metrics_draws_time_throughput_and_memory():
    import matplotlib.pyplot as plt
    fig = plot_metrics(rows(0.1, 0.5, 100.0), total_memory_mb=1000.0)
    assert [ax.get_ylabel() for ax in fig.axes] == ["seconds per step", "images / s", "MiB"]
    plt.close(fig)


def test_each_img_per_s_figure_has_one_definition():
    times = [0.5, 0.5, 0.5, 2.5]  # a slow step (an epoch start, a new shape)
    assert img_per_s_mean(4, times) == pytest.approx(4 * 4 / 4.0)  # every second counts
    assert img_per_s_median(4, times) == pytest.approx(8.0)  # the odd slow step does not
    low, high = img_per_s_quartiles(4, times)
    assert low < img_per_s_median(4, times) <= high
    assert img_per_s_wall(100, 20.0) == 5.0
    row = metrics_row([record(1, [0.4], iter_time=0.5), record(2, [0.4], iter_time=2.5)], 4, torch.device("cpu"))
    assert row["img_per_s"] == img_per_s_mean(4, [0.5, 2.5]) and row["iter_time"] == 1.5 and row["step"] == 2


def test_dashboard_outside_a_notebook_collects_rows():
    dashboard = LiveDashboard(global_batch=4, device=torch.device("cpu"), redraw_every=2)
    for step in range(1, 4):
        dashboard(record(step, [0.4], iter_time=0.5))
    dashboard.close()
    assert not dashboard.live and [r["img_per_s"] for r in dashboard.rows] == [8.0, 8.0, 8.0]


@pytest.mark.system
def test_dashboard_in_a_notebook_leaves_one_static_figure(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    source = ("from maskrcnn_tut.engine import StepRecord\n"
              "from maskrcnn_tut.lab.dashboard import LiveDashboard\n"
              "dashboard = LiveDashboard(global_batch=4, total_steps=6, redraw_every=3)\n"
              "for step in range(1, 7):\n"
              "    dashboard(StepRecord(step, 0, 0.1, 1.0 / step, {}, 0.01, 0.5, [0.49]))\n"
              "dashboard.close()\n"
              "print(dashboard.progress.value, dashboard.status.value)")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert "6 step 6: loss 0.167, 8.00 img/s" in "".join(o.get("text", "") for o in outputs)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_peak_memory_can_be_reset_between_measurements():
    device = torch.device("cpu")
    big = np.ones(60 * 2**20 // 8)  # 60 MiB, touched
    del big
    before = peak_memory_mb(device)
    reset_peak_memory(device)
    assert peak_memory_mb(device) < before - 30


# --------------------------------------------------------------------------- the run's GPUs on a many-GPU host


class FakeHost:
    """An 8-GPU machine as NVML and CUDA see it. NVML (passed as the `pynvml` module) numbers all
    eight GPUs in PCI order; CUDA shows the GPUs CUDA_VISIBLE_DEVICES names, renumbered from 0.
    NVML GPU i is i x 10 % busy."""

    def __init__(self, gpus: int = 8):
        self.uuids = [f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(gpus)]
        self.open = 0

    # pynvml
    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetUUID(self, handle):
        return self.uuids[handle[1]]

    def nvmlDeviceGetPciInfo(self, handle):
        return SimpleNamespace(domain=0, bus=0x10 + handle[1], device=0)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=10 * handle[1])

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=(handle[1] + 1) * 2**30, total=80 * 2**30)

    # torch.cuda, honouring CUDA_VISIBLE_DEVICES as the CUDA runtime does
    def visible(self) -> list[int]:
        import os
        return [int(i) for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",")]

    def device_count(self) -> int:
        return len(self.visible())

    def get_device_properties(self, index: int):
        host = self.visible()[index]
        return SimpleNamespace(name="Fake GPU", uuid=self.uuids[host][4:], pci_domain_id=0, pci_bus_id=0x10 + host,
                               pci_device_id=0, total_memory=80 * 2**30)


@pytest.fixture
def eight_gpu_host(monkeypatch):
    host = FakeHost()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setitem(sys.modules, "pynvml", host)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", host.device_count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", host.get_device_properties)
    return host


def sample_once(monkeypatch, device: torch.device, **kwargs) -> GPUSampler:
    monkeypatch.setattr(du, "_INFO", du.DistInfo(device=device))
    with GPUSampler(interval_s=60, **kwargs) as gpus:
        pass
    return gpus


def test_gpu_sampler_reads_only_the_runs_gpu_under_cuda_visible_devices(monkeypatch, eight_gpu_host):
    gpus = sample_once(monkeypatch, torch.device("cuda", 0))
    assert gpus.available, gpus.reason
    assert [(g["gpu"], g["nvml_index"], g["util_mean"]) for g in gpus.summary()] == [(0, 3, 30.0)]
    assert gpus.describe().startswith("GPU 0 (nvidia-smi GPU 3): 30 % busy, 4096 of 81920 MiB")
    advice = health_advice(rows(0.05, 0.5, 100.0), gpus)
    utilization = [c for c in advice.checks if "utilization" in c.name]
    assert [c.name for c in utilization] == ["GPU 0 (nvidia-smi GPU 3) utilization"]  # not seven idle GPUs
    assert eight_gpu_host.open == 0  # NVML shut down again
    # the second process of a 2-GPU run watches the second visible GPU, NVML's 5
    second = sample_once(monkeypatch, torch.device("cuda", 1))
    assert [(g["gpu"], g["nvml_index"]) for g in second.summary()] == [(1, 5)]
    both = sample_once(monkeypatch, torch.device("cpu"), devices=[0, 1])
    assert [(g["gpu"], g["nvml_index"]) for g in both.summary()] == [(0, 3), (1, 5)]


def test_gpu_sampler_matches_by_pci_address_and_refuses_an_unknown_gpu(monkeypatch, eight_gpu_host):
    props = eight_gpu_host.get_device_properties
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(**{**vars(props(i)), "uuid": f"MIG-{i}"}))  # MIG: its own UUID
    assert [g["nvml_index"] for g in sample_once(monkeypatch, torch.device("cuda", 1)).summary()] == [5]
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(**{**vars(props(i)), "uuid": "unknown", "pci_bus_id": 99}))
    gpus = sample_once(monkeypatch, torch.device("cuda", 0))
    assert not gpus.available and "CUDA device 0" in gpus.reason and eight_gpu_host.open == 0


def test_gpu_sampler_on_a_cpu_run_says_it_uses_no_gpu(monkeypatch, eight_gpu_host):
    gpus = sample_once(monkeypatch, torch.device("cpu"))
    assert not gpus.available and gpus.reason == "not available: this run uses no GPU (it runs on cpu)"


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
        batches, state, terms = iter(toy_batches(steps, 2, seed=info.rank)), TrainState(), []
        check, forward = StragglerCheck(every=steps), []
        for _ in range(steps):
            record = train_step(model, optimizer, scaler, batches, cfg, info.device, state, terms)
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
