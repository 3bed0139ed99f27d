"""nvml: the NVML reader and the sampler thread (no GPU, a fake reader, an 8-GPU host under
CUDA_VISIBLE_DEVICES, a MIG slice matched by PCI address), GPU health and NVLink by CUDA index."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from fake_gpus import FakeNvml, host

from maskrcnn_tut import distributed as du
from maskrcnn_tut.lab.health import health_advice
from maskrcnn_tut.lab.nvml import GPUSampler, exclusive_gpu_held, gpu_health, nvlink_links


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


@pytest.fixture
def eight_gpu_host(monkeypatch):
    """8 GPUs; this process sees NVML's 3 and 5 (CUDA_VISIBLE_DEVICES=3,5)."""
    return host(monkeypatch, FakeNvml(8), "3,5")


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


def test_a_pickled_sampler_keeps_its_readings_and_words_its_reason_in_the_readers_language(monkeypatch, eight_gpu_host):
    """The figure cache hands the Japanese edition the English edition's sampler."""
    import pickle

    from maskrcnn_tut.lab import wording
    unavailable = pickle.loads(pickle.dumps(sample_once(monkeypatch, torch.device("cpu"))))
    sampling = pickle.loads(pickle.dumps(sample_once(monkeypatch, torch.device("cuda", 1))))
    assert sampling.available and [g["nvml_index"] for g in sampling.summary()] == [5]  # CUDA 1 is NVML 5 here
    try:
        wording.set_language("ja")
        assert not unavailable.available and "cpu" in unavailable.reason and "this run" not in unavailable.reason
    finally:
        wording.set_language("en")
    assert unavailable.reason == "not available: this run uses no GPU (it runs on cpu)"


@pytest.fixture
def swapped_gpus(monkeypatch):
    """Two GPUs, NVML's 1 sick with 4 NVLink links; CUDA shows them in the other order
    (CUDA_VISIBLE_DEVICES=1,0), so CUDA's GPU 0 is NVML's 1."""
    return host(monkeypatch, FakeNvml(2, sick=frozenset({1}), nvlinks={1: 4}), "1,0")


def test_gpu_health_flags_ecc_errors_and_throttling_by_cuda_index(swapped_gpus):
    sick, healthy = gpu_health(swapped_gpus)
    assert (sick["gpu"], sick["nvml_index"]) == (0, 1) and (healthy["gpu"], healthy["nvml_index"]) == (1, 0)
    assert healthy["ok"] and healthy["finding"] == "healthy" and healthy["PCIe"] == "gen 4 x16"
    assert not sick["ok"] and "3 uncorrected ECC errors" in sick["finding"] and "0x40" in sick["finding"]
    assert "91 °C" in sick["finding"] and swapped_gpus.open == 0


class NoDriver(FakeNvml):
    def nvmlInit(self):
        raise RuntimeError("NVML Shared Library Not Found")


def test_gpu_health_without_nvidia_is_empty(swapped_gpus):
    assert gpu_health(NoDriver(2)) == []


def test_nvlink_links_by_cuda_index_and_nvml_shut_down_after(swapped_gpus):
    assert nvlink_links([0, 1], swapped_gpus) == [4, 0] and swapped_gpus.open == 0
    assert nvlink_links([0, 1], NoDriver(2)) is None


def test_a_kernel_holding_an_exclusive_gpu_stops_launch_in_one_line(monkeypatch):
    """GPU review C10: in EXCLUSIVE_PROCESS mode a worker's first CUDA call fails once the kernel holds
    the GPU; `launch` says so before it starts any worker, and health readings name the mode."""
    from maskrcnn_tut.errors import WorkerError
    from maskrcnn_tut.lab import processes

    nvml = host(monkeypatch, FakeNvml(gpus=2, exclusive=frozenset({1})), "1,0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # CUDA's 0 is NVML's 1 here
    assert exclusive_gpu_held() is None  # no context yet: the workers may take the GPU
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert exclusive_gpu_held() == 0 and nvml.open == 0
    health = {g["gpu"]: g for g in gpu_health(nvml)}
    assert health[0]["exclusive"] and "EXCLUSIVE_PROCESS" in health[0]["finding"] and not health[1]["exclusive"]
    with pytest.raises(WorkerError, match="GPU 0 is in EXCLUSIVE_PROCESS compute mode") as stop:
        processes.launch(print, 2)
    assert "\n" not in str(stop.value)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert exclusive_gpu_held() is None  # the kernel's GPU is in the default mode
