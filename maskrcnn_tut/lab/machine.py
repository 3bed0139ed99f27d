"""This machine in words, for results and chapter 2: what it is, its software, where a figure came from.

- `hardware()` / `hardware_label()`: CPU, usable cores, RAM, GPUs; a short name for plot titles.
- `versions()`, `provenance(command)`: the software stack, and what every results file records
  (hardware, versions, date, command).
- `environment_report()`: chapter 2's table (interconnect included, read through `gpus`).
"""
from __future__ import annotations

import datetime
import platform
from typing import Any

import torch

from ..hardware import (
    cgroup_cpu_limit,
    cpu_has_bf16,
    cpu_model,
    gpu_count,
    ram_gb,
    usable_cores,
)
from .gpus import nvlink_links


def hardware() -> dict[str, Any]:
    """CPU model and usable cores, RAM and the visible GPUs (CUDA order)."""
    gpus = [torch.cuda.get_device_properties(i) for i in range(gpu_count())]
    return {"cpu": cpu_model(), "cores": usable_cores(), "ram_gb": ram_gb(),
            "gpus": [g.name for g in gpus], "gpu_memory_gb": [g.total_memory / 2**30 for g in gpus]}


def hardware_label() -> str:
    """A short name of this machine for plot titles: '4x NVIDIA A100-SXM4-80GB' or '2-core AMD EPYC (no GPU)'."""
    hw = hardware()
    if hw["gpus"]:
        return " + ".join(f"{hw['gpus'].count(n)}x {n}" for n in sorted(set(hw["gpus"])))
    return f"{hw['cores']}-core {hw['cpu']} (no GPU)"


def cudnn_version() -> str:
    if not torch.backends.cudnn.is_available():
        return "not available"
    number = torch.backends.cudnn.version()  # major * 10000 + minor * 100 + patch (cuDNN 9)
    usable = "" if torch.cuda.is_available() else " (in the wheel; unused without a GPU)"
    return f"{number // 10000}.{number % 10000 // 100}.{number % 100}{usable}"


def versions() -> dict[str, str | None]:
    import torchvision
    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda if cuda else None, "cudnn": cudnn_version() if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}


def provenance(command: str) -> dict[str, Any]:
    """Where and how a result was measured: hardware, software versions, date and command."""
    hw = hardware()
    return {"hardware": hardware_label(), "cpu": hw["cpu"], "cores": hw["cores"], "ram_gb": hw["ram_gb"],
            "gpus": hw["gpus"], "gpu_count": len(hw["gpus"]), "gpu_memory_gb": hw["gpu_memory_gb"],
            "cpu_bf16": cpu_has_bf16(), **versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command}


def environment_report() -> list[dict[str, str]]:
    """Chapter 2's report: hardware, GPU interconnect and the versions of the software stack."""
    hw = hardware()
    quota = cgroup_cpu_limit()
    rows = [("CPU", f"{hw['cpu']}; {hw['cores']} usable cores"
                    + (f" (cgroup quota {quota:g} CPUs)" if quota is not None else "")
                    + f"; vector ISA {torch.backends.cpu.get_cpu_capability()}"),
            ("RAM", f"{hw['ram_gb']:.1f} GB" if hw["ram_gb"] else "unknown"),
            ("GPUs", ", ".join(f"{n} ({m:.0f} GB)" for n, m in zip(hw["gpus"], hw["gpu_memory_gb"]))
             or "none visible")]
    count = len(hw["gpus"])
    if count > 1:
        pairs = [(i, j) for i in range(count) for j in range(count) if i != j]
        peer = sum(torch.cuda.can_device_access_peer(i, j) for i, j in pairs)
        rows.append(("P2P access", f"{peer} of {len(pairs)} GPU pairs can read each other's memory directly"))
    if count:
        links = nvlink_links(range(count))
        rows.append(("NVLink", "unknown (NVML unavailable)" if links is None
                     else ", ".join(f"GPU{i}: {n} active links" for i, n in enumerate(links))))
    v = versions()
    rows += [("Python", v["python"]),
             ("PyTorch / torchvision", f"{v['torch']} / {v['torchvision']}"),
             ("CUDA (the wheel's runtime)", torch.version.cuda or "CPU-only build"),
             ("cuDNN", cudnn_version()),
             ("NCCL", v["nccl"] or "not used (no GPU)"),
             ("distributed backends", ", ".join(b for b in ("gloo", "nccl", "mpi")
                                                if getattr(torch.distributed, f"is_{b}_available")()))]
    return [{"": name, "this machine": value} for name, value in rows]
