"""The GPUs a run uses, read through NVML (nvidia-ml-py), numbered as CUDA numbers them.

NVML numbers every GPU of the machine, in PCI order, and ignores CUDA_VISIBLE_DEVICES and
CUDA_DEVICE_ORDER; PyTorch's `cuda:0` is the first GPU CUDA lets this process see. On a machine
with 8 GPUs and CUDA_VISIBLE_DEVICES=3,5, `cuda:0` is NVML's GPU 3. `nvml_indices` matches the
two by UUID (PCI address where the UUIDs differ, as for MIG slices), so `NvmlReader` reads the
run's own GPUs and names them both ways. `monitor.GPUSampler` samples them in a thread.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import distributed as du
from .hardware import gpu_count


class GpuUnavailable(RuntimeError):
    """NVML cannot read the run's GPUs here; the message says why."""


def run_cuda_devices() -> list[int]:
    """The CUDA indices of the GPUs this process trains on: `du.info().device` (its GPU after
    `init_distributed`), else the current CUDA device if CUDA is initialised, else none."""
    device = du.info().device
    if device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    if gpu_count() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def _uuid(text) -> str:
    """A GPU's UUID as both sides can compare it: NVML's 'GPU-<hex>' (bytes in old pynvml) and
    PyTorch's '<hex>' alike."""
    text = (text.decode() if isinstance(text, bytes) else str(text)).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def cuda_device_ids(index: int) -> tuple[str, tuple[int, int, int]]:
    """(UUID, (PCI domain, bus, device)) of CUDA device `index` as this process numbers it."""
    props = torch.cuda.get_device_properties(index)
    return _uuid(props.uuid), (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)


def nvml_indices(cuda_devices: Sequence[int], nvml, handles: list) -> list[int]:
    """NVML's index of each CUDA device. NVML numbers every GPU of the machine and ignores
    CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, so the two are matched by UUID (PCI address when
    the UUIDs differ, as for MIG slices)."""
    by_uuid, by_pci = {}, {}
    for number, handle in enumerate(handles):
        by_uuid[_uuid(nvml.nvmlDeviceGetUUID(handle))] = number
        pci = nvml.nvmlDeviceGetPciInfo(handle)
        by_pci[(pci.domain, pci.bus, pci.device)] = number
    found = []
    for index in cuda_devices:
        uuid, pci = cuda_device_ids(index)
        number = by_uuid.get(uuid, by_pci.get(pci))
        if number is None:
            raise GpuUnavailable(f"not available: CUDA device {index} (UUID {uuid}) is not among the "
                                 f"{len(handles)} GPUs NVML reports")
        found.append(number)
    return found


class NvmlReader:
    """Reads the utilization and memory of the given CUDA devices through nvidia-ml-py (`pynvml`).

    Each reading names the GPU by its CUDA index (`gpu`, as the run and PyTorch number it) and its
    NVML index (`nvml_index`, as nvidia-smi numbers it). `nvml` replaces the pynvml module (tests).
    """

    def __init__(self, cuda_devices: Sequence[int], nvml=None):
        if not cuda_devices:
            raise GpuUnavailable(f"not available: this run uses no GPU (it runs on {du.info().device.type})")
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as err:
                raise GpuUnavailable("not available: nvidia-ml-py is not installed") from err
        try:
            nvml.nvmlInit()
        except Exception as err:  # pynvml.NVMLError: no library, no driver, no permission
            raise GpuUnavailable(f"not available: no NVIDIA driver or GPU ({err})") from err
        self.nvml = nvml
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            if not handles:
                raise GpuUnavailable("not available: the NVIDIA driver reports no GPU")
            numbers = nvml_indices(cuda_devices, nvml, handles)
        except BaseException:
            nvml.nvmlShutdown()
            raise
        self.devices = [(cuda, number, handles[number]) for cuda, number in zip(cuda_devices, numbers)]

    def __call__(self) -> list[dict]:
        readings = []
        for cuda, number, handle in self.devices:
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            readings.append({"gpu": cuda, "nvml_index": number,
                             "util": float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                             "mem_used_mb": memory.used / 2**20, "mem_total_mb": memory.total / 2**20})
        return readings

    def close(self) -> None:
        self.nvml.nvmlShutdown()
