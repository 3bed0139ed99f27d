"""A machine with NVIDIA GPUs, faked for tests: NVML (passed or installed as the `pynvml` module)
numbers every GPU in PCI order; torch.cuda shows the GPUs CUDA_VISIBLE_DEVICES names, renumbered
from 0, as the CUDA runtime does. `host(monkeypatch, gpus, visible)` installs both."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch


class FakeNvml:
    """`gpus` GPUs of `memory_gib` and compute `capability`. NVML GPU i is 10 x i % busy and uses i + 1 GiB of 80; the GPUs in `sick` have
    3 uncorrected ECC errors, 91 °C and thermal throttling; `nvlinks` maps a GPU to its active
    links (each GPU has 4); the GPUs in `exclusive` are in EXCLUSIVE_PROCESS compute mode."""

    NVML_NVLINK_MAX_LINKS = 6
    NVML_FEATURE_ENABLED = 1
    NVML_COMPUTEMODE_DEFAULT = 0
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3
    NVMLError = RuntimeError

    def __init__(self, gpus: int = 8, sick: frozenset[int] = frozenset(), nvlinks: dict[int, int] | None = None,
                 exclusive: frozenset[int] = frozenset(), memory_gib: int = 80, capability: tuple[int, int] = (9, 0)):
        self.memory_gib, self.capability = memory_gib, capability
        self.uuids = [f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(gpus)]
        self.sick, self.nvlinks, self.exclusive = sick, nvlinks or {}, exclusive
        self.open = 0  # nvmlInit minus nvmlShutdown calls

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

    def nvmlDeviceGetName(self, handle):
        return b"Fake GPU"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=10 * handle[1])

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=(handle[1] + 1) * 2**30, total=80 * 2**30)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= 4:
            raise self.NVMLError("no such link")
        return int(link < self.nvlinks.get(handle[1], 0))

    def nvmlDeviceGetComputeMode(self, handle):
        return 3 if handle[1] in self.exclusive else 0

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 91 if handle[1] in self.sick else 50

    def nvmlDeviceGetPowerUsage(self, handle):
        return 100_000

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 300_000

    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
        return 3 if handle[1] in self.sick else 0

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return 0x40 if handle[1] in self.sick else 0x1

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return 4

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        raise self.NVMLError("not supported")

    # torch.cuda's view, honouring CUDA_VISIBLE_DEVICES
    def visible(self) -> list[int]:
        return [int(i) for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",")]

    def device_count(self) -> int:
        return len(self.visible())

    def get_device_properties(self, index: int):
        number = self.visible()[index]
        return SimpleNamespace(name="Fake GPU", uuid=self.uuids[number][4:], pci_domain_id=0,
                               pci_bus_id=0x10 + number, pci_device_id=0, total_memory=self.memory_gib * 2**30,
                               major=self.capability[0], minor=self.capability[1])


def host(monkeypatch, nvml: FakeNvml, visible: str) -> FakeNvml:
    """Install `nvml` as pynvml and a CUDA that shows the GPUs `visible` names (CUDA_VISIBLE_DEVICES)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", nvml.device_count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", nvml.get_device_properties)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: nvml.capability)
    return nvml
