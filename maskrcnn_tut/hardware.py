"""Machine facts and memory readers: the ground floor every other module may import.

- `usable_cores()`: the cores this process may really use: its affinity mask, capped by a cgroup
  CPU quota (v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, v2 `cpu.max`), which `nproc` and
  `sched_getaffinity` do not see (a Kubernetes pod limited to 4 CPUs on a 64-core node).
- `hardware()` / `hardware_label()`: CPU, cores, RAM, GPUs; a short name for plot titles and results.
- `cpu_has_bf16()`, `versions()`, `environment_report()`: what the software stack and CPU can do.
- `reset_peak_memory`, `peak_memory_mb`, `current_memory_mb`, `device_memory_mb`: the CUDA
  allocator on GPUs, the process's resident memory on CPUs.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import re
import resource
from pathlib import Path
from typing import Any

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")


# --------------------------------------------------------------------------- CPU


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _own_cgroups() -> dict[str, str]:
    """{controller: path} of this process's cgroups ('' for the v2 unified hierarchy)."""
    groups = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                groups[controller] = path
    except (OSError, ValueError):
        pass
    return groups


def _ancestors(base: Path, path: str) -> list[Path]:
    """`base/path` and each of its parents up to `base` (a quota anywhere above applies too)."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs this process's cgroup quota allows (e.g. 1.5), or None when there is no quota."""
    groups = _own_cgroups()
    limits = []
    if "cpu" in groups:  # cgroup v1
        for base in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
            for folder in _ancestors(base, groups["cpu"]):
                try:
                    quota = int((folder / "cpu.cfs_quota_us").read_text())
                    period = int((folder / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                if quota > 0 and period > 0:
                    limits.append(quota / period)
    if "" in groups:  # cgroup v2
        for folder in _ancestors(root, groups[""]):
            try:
                quota, period = (folder / "cpu.max").read_text().split()
            except (OSError, ValueError):
                continue
            if quota != "max" and int(period) > 0:
                limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def usable_cores() -> int:
    """Cores of the affinity mask, capped by the cgroup CPU quota (rounded up, at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota - 1e-9)))
    return cores


def cpu_has_bf16() -> bool | None:
    """Whether the CPU has bfloat16 instructions (AVX512-BF16 or AMX); None when unknown."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def ram_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- the machine


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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


def _nvlink_links(index: int) -> int | None:
    """Active NVLink links of GPU `index` (None when NVML cannot tell)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        active = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                active += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                break
        return active
    except Exception:  # no NVML library, no driver, or a GPU without NVLink
        return None


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
        links = [_nvlink_links(i) for i in range(count)]
        rows.append(("NVLink", "unknown (NVML unavailable)" if None in links
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


# --------------------------------------------------------------------------- memory


def _proc_status_kib(field_name: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's peak, or this process's resident high-water mark.

    On CPU, freed heap memory is first handed back to the OS (glibc `malloc_trim`) and Linux's
    VmHWM is reset through /proc/self/clear_refs; where either is missing the peak keeps counting
    from the process start.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> float:
    """GPU allocator peak on CUDA, else this process's peak resident set size (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def current_memory_mb(device: torch.device) -> float:
    """Memory in use now: CUDA tensors on the GPU, else this process's resident set size (MiB)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    rss = _proc_status_kib("VmRSS")
    if rss is None:
        raise RuntimeError("current_memory_mb needs Linux's /proc/self/status on a CPU")
    return rss / 1024


def device_memory_mb(device: torch.device) -> float | None:
    """Memory of the device: the GPU's total, or the machine's physical RAM (MiB)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**20
    total = ram_gb()
    return total * 1024 if total else None
