"""Where a figure came from, in words: this machine and its software as every results file records
them, and chapter 2's report of them.

- `hardware()` / `hardware_label()` / `recorded_hardware_label()`: CPU, usable cores, RAM, GPUs; a short
  name for plot titles, and the one a result records.
- `versions()`, `provenance(command)`: the software stack, and what every results file records
  (hardware, versions, date, command).
- `environment_report()`: chapter 2's table (interconnect included, read through `nvml`).

The facts underneath are the core's (`maskrcnn_tut.hardware`); the GPUs' readings are `nvml`'s, the
device's memory `device_memory`'s, and the chapters' sentences about this machine `machine_findings`'.

Labels and table values are in the book's language (`wording`); what a results file or the bench
cache records (`provenance`) keeps its one sentence, the CPU's label, as its catalog key and values
(`wording.english`), so both editions share one cache and one file format.
"""
from __future__ import annotations

import datetime
import platform
from pathlib import Path
from typing import Any

import torch

from ..hardware import (
    cgroup_cpu_limit,
    cpu_has_bf16,
    gpu_count,
    ram_gb,
    usable_cores,
)
from . import wording
from .nvml import nvlink_links


def _term(text: str) -> str:
    return wording.term(text)


def hardware() -> dict[str, Any]:
    """CPU model and usable cores, RAM and the visible GPUs (CUDA order)."""
    gpus = [torch.cuda.get_device_properties(i) for i in range(gpu_count())]
    return {"cpu": cpu_model(), "cores": usable_cores(), "ram_gb": ram_gb(),
            "gpus": [g.name for g in gpus], "gpu_memory_gb": [g.total_memory / 2**30 for g in gpus]}


def hardware_label() -> str:
    """A short name of this machine for plot titles, in the book's language."""
    return wording.shown(recorded_hardware_label())


def recorded_hardware_label() -> str:
    """The name a result records: '4x NVIDIA A100-SXM4-80GB', or '2-core AMD EPYC (no GPU)' kept as its
    catalog key and values (`wording.Said`), so each edition words it."""
    hw = hardware()
    if hw["gpus"]:
        return " + ".join(f"{hw['gpus'].count(n)}x {n}" for n in sorted(set(hw["gpus"])))
    return wording.english("provenance.label_cpu", cores=hw["cores"], cpu=hw["cpu"])


def cudnn_version() -> str:
    if not torch.backends.cudnn.is_available():
        return _term("not available")
    number = torch.backends.cudnn.version()  # major * 10000 + minor * 100 + patch (cuDNN 9)
    version = f"{number // 10000}.{number % 10000 // 100}.{number % 100}"
    return version if torch.cuda.is_available() else wording.say("provenance.cudnn_unused", version=version)


def versions() -> dict[str, str | None]:
    import torchvision
    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda if cuda else None, "cudnn": cudnn_version() if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}


def provenance(command: str) -> dict[str, Any]:
    """Where and how a result was measured: hardware, software versions, date and command (in English)."""
    hw = hardware()
    return {"hardware": recorded_hardware_label(), "cpu": hw["cpu"], "cores": hw["cores"], "ram_gb": hw["ram_gb"],
            "gpus": hw["gpus"], "gpu_count": len(hw["gpus"]), "gpu_memory_gb": hw["gpu_memory_gb"],
            "cpu_bf16": cpu_has_bf16(), **versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command}


def environment_report() -> list[dict[str, str]]:
    """Chapter 2's report: hardware, GPU interconnect and the versions of the software stack. The
    first column names each row in English (code reads rows by it; the book shows it translated),
    the second is in the book's language."""
    hw = hardware()
    quota = cgroup_cpu_limit()
    isa = torch.backends.cpu.get_cpu_capability()
    rows = [("CPU", wording.say("provenance.cpu_row", cpu=hw["cpu"], cores=hw["cores"], isa=isa) if quota is None else
             wording.say("provenance.cpu_row_quota", cpu=hw["cpu"], cores=hw["cores"], quota=quota, isa=isa)),
            ("RAM", f"{hw['ram_gb']:.1f} GB" if hw["ram_gb"] else _term("unknown")),
            ("GPUs", ", ".join(f"{n} ({m:.0f} GB)" for n, m in zip(hw["gpus"], hw["gpu_memory_gb"]))
             or _term("none visible"))]
    count = len(hw["gpus"])
    if count > 1:
        pairs = [(i, j) for i in range(count) for j in range(count) if i != j]
        peer = sum(torch.cuda.can_device_access_peer(i, j) for i, j in pairs)
        rows.append(("P2P access", wording.say("provenance.p2p", peer=peer, pairs=len(pairs))))
    if count:
        links = nvlink_links(range(count))
        rows.append(("NVLink", _term("unknown (NVML unavailable)") if links is None
                     else ", ".join(wording.say("provenance.nvlink", gpu=i, links=n) for i, n in enumerate(links))))
    v = versions()
    rows += [("Python", v["python"]),
             ("PyTorch / torchvision", f"{v['torch']} / {v['torchvision']}"),
             ("CUDA (the wheel's runtime)", torch.version.cuda or _term("CPU-only build")),
             ("cuDNN", cudnn_version()),
             ("NCCL", v["nccl"] or _term("not used (no GPU)")),
             ("distributed backends", ", ".join(b for b in ("gloo", "nccl", "mpi")
                                                if getattr(torch.distributed, f"is_{b}_available")()))]
    return [{"": name, "this machine": value} for name, value in rows]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
