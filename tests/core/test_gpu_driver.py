"""A machine with NVIDIA GPUs that torch cannot use (a driver older than torch's CUDA) stops with
one line naming the driver, torch's CUDA and what to do, instead of training on the CPU for days;
`--accelerator cpu` asks for the CPU on purpose. NVML and the /dev files are faked."""
from __future__ import annotations

import sys

import pytest
import torch
from fake_gpus import FakeNvml

from maskrcnn_tut import distributed as du
from maskrcnn_tut import hardware, train
from maskrcnn_tut.errors import ConfigError

DRIVER = "535.104.05"


class OldDriverNvml(FakeNvml):
    """Eight GPUs behind an R535 driver."""

    def nvmlSystemGetDriverVersion(self):
        return DRIVER


@pytest.fixture
def gpus_torch_cannot_use(monkeypatch, tmp_path) -> OldDriverNvml:
    """NVML sees 8 GPUs; torch's CUDA sees none; no /dev files beyond NVML's word."""
    nvml = OldDriverNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(hardware, "DEV", tmp_path)
    return nvml


def test_gpus_torch_cannot_use_stop_with_driver_cuda_and_remedy(gpus_torch_cannot_use):
    with pytest.raises(ConfigError) as caught:
        du.init_distributed(accelerator="auto")
    line = str(caught.value)
    assert "\n" not in line
    assert "8 NVIDIA GPU(s)" in line and DRIVER in line and torch.__version__ in line
    assert (torch.version.cuda or "CPU-only") in line
    assert "install a torch build for this driver" in line and "--accelerator cpu" in line
    assert gpus_torch_cannot_use.open == 0  # NVML shut down again
    assert du.info().device == torch.device("cpu") and not du.info().distributed


def test_device_cpu_trains_on_the_cpu_on_purpose(gpus_torch_cannot_use):
    try:
        assert du.init_distributed(accelerator="cpu").device == torch.device("cpu")
    finally:
        du.shutdown()


def test_gpus_hidden_by_cuda_visible_devices_are_no_reason_to_stop(gpus_torch_cannot_use, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert du.pick_device("auto") == torch.device("cpu")


def test_device_files_and_driver_file_answer_without_nvml(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
                       "(dvs-builder@U16)  Thu Jan 23 2025\nGCC version:  gcc version 12.3.0\n")
    monkeypatch.setattr(hardware, "DEV", tmp_path)
    monkeypatch.setattr(hardware, "DRIVER_VERSION_FILE", version)
    assert hardware.nvidia_gpus() == (2, "570.86.15")
    assert "2 NVIDIA GPU(s) (driver 570.86.15)" in hardware.gpus_torch_cannot_use()


def test_a_machine_without_nvidia_gpus_trains_on_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "DEV", tmp_path)
    assert du.pick_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="--accelerator cuda"):
        du.pick_device("cuda")


def test_train_py_prints_the_one_line_and_exits_2(gpus_torch_cannot_use, capsys, tmp_path):
    code = train.main(["--output-dir", str(tmp_path / "run"), "--max-steps", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and DRIVER in lines[0] and "--accelerator cpu" in lines[0]


def test_nccl_binds_the_process_group_to_this_processs_gpu(monkeypatch):
    """M1: `device_id` given to init_process_group for nccl (eager init, no device guess at barrier)."""
    joined = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(du, "round_store", lambda rank, world, timeout: "store")
    monkeypatch.setattr(du.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(du.dist, "init_process_group", lambda backend, **kwargs: joined.append((backend, kwargs)))
    try:
        info = du.init_distributed()
    finally:
        du.shutdown()
    assert info.device == torch.device("cuda", 1)
    assert joined[0][0] == "nccl" and joined[0][1]["device_id"] == torch.device("cuda", 1)


def test_gpu_processes_get_their_share_of_the_cores_too(monkeypatch):
    """S4: torch's default (a thread per host core) ignores the cgroup quota on GPU machines as well."""
    threads = []
    for name, value in dict(WORLD_SIZE="1", LOCAL_WORLD_SIZE="2", RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(du, "usable_cores", lambda: 8)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    try:
        assert du.init_distributed().device == torch.device("cuda", 0)
    finally:
        du.shutdown()
    assert threads == [4]
