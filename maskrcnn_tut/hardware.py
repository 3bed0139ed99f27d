"""Machine facts and memory readers: the ground floor every other module may import.

- `usable_cores()`: the cores this process may really use: its affinity mask, capped by a cgroup
  CPU quota (v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, v2 `cpu.max`), which `nproc` and
  `sched_getaffinity` do not see (a Kubernetes pod limited to 4 CPUs on a 64-core node).
- `ram_gb()`, `gpu_count()`, `cuda_card()`, `cpu_has_bf16()`: what the machine has; `default_amp_dtype`, what its GPU computes in.
- `nvidia_gpus()`, `gpus_torch_cannot_use()`: the NVIDIA GPUs the machine has, whether torch can
  use them or not (a torch built for a newer CUDA than the driver's sees none).
- `peak_memory_mb`: the CUDA allocator's peak on GPUs, the process's resident peak on CPUs.
- `ddp_buffer_sync_keyword`, `ddp_syncs_buffers`, `set_recompile_limit`: the torch versions the
  package supports differ here, found by feature detection (not by version numbers) in this one place.
"""
from __future__ import annotations

import ctypes
import inspect
import math
import os
import re
import resource
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")


# --------------------------------------------------------------------------- CPU


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


def ram_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- the machine


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_has_bf16() -> bool | None:
    """Whether the CPU has bfloat16 instructions (AVX-512 BF16 or AMX), as torch detects them, else as
    /proc/cpuinfo lists them; None when unknown. Without them bf16 autocast is emulated: on a 2-core AVX2
    EPYC one R50-FPN step at 800 px took over 12 times its fp32 time."""
    cpu = getattr(torch._C, "_cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(checks):
        return any(check() for check in checks if check)
    try:
        return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", Path("/proc/cpuinfo").read_text()))
    except OSError:
        return None


def cuda_card() -> tuple[float, tuple[int, int]] | None:
    """(memory GiB, compute capability) of the smallest visible CUDA GPU, the one a setting must fit;
    None without CUDA."""
    if not gpu_count():
        return None
    cards = [torch.cuda.get_device_properties(i) for i in range(gpu_count())]
    small = min(cards, key=lambda card: card.total_memory)
    return small.total_memory / 2**30, (small.major, small.minor)


def default_amp_dtype(device: torch.device) -> str:
    """--amp's dtype when --amp-dtype is not given: bfloat16, but float16 on GPUs before compute capability
    8.0, which have no bfloat16 units (torch emulates it there, slower than fp32). A run derived for CUDA
    on a machine without it (a test, a plan) gets bfloat16, as on today's GPUs."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
        return "float16"
    return "bfloat16"


#: Where the driver's device files and version are (module constants, so tests can point elsewhere).
DEV = Path("/dev")
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


def _nvml_gpus() -> tuple[int, str | None] | None:
    """(GPUs, driver version) as NVML sees them; None where NVML cannot say."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no pynvml, no driver library, no GPU: each raises its own kind
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
        except Exception:
            driver = None
        return count, driver.decode() if isinstance(driver, bytes) else driver
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def nvidia_gpus() -> tuple[int, str | None]:
    """(NVIDIA GPUs this machine has, driver version or None): NVML when it answers, else the
    /dev/nvidiaN device files and the kernel module's version file, which need no library at all."""
    seen = _nvml_gpus()
    if seen is not None and seen[0] > 0:
        return seen
    try:
        count = sum(1 for entry in DEV.iterdir() if re.fullmatch(r"nvidia\d+", entry.name))
        version = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", DRIVER_VERSION_FILE.read_text() if count else "")
    except OSError:
        return 0, None
    return count, version.group(1) if version else None


def gpus_hidden_on_purpose() -> bool:
    """CUDA_VISIBLE_DEVICES set to nothing (or -1): the user asked CUDA for no GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.split(",")[0].strip() in ("", "-1")


def gpus_torch_cannot_use() -> str | None:
    """One line naming the driver, torch's CUDA and what to do when this machine has NVIDIA GPUs
    that torch cannot use (a silent CPU run instead would take days); None when there is nothing to say."""
    if torch.cuda.is_available() or gpus_hidden_on_purpose():
        return None
    count, driver = nvidia_gpus()
    if count == 0:
        return None
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    return (f"this machine has {count} NVIDIA GPU(s) (driver {driver or 'version unknown'}) but torch "
            f"{torch.__version__} ({build}) cannot use them: install a torch build for this driver "
            "(nvidia-smi shows the newest CUDA it supports; e.g. pip install torch --index-url "
            "https://download.pytorch.org/whl/cu126), or pass --accelerator cpu to train on the CPU on purpose")


# --------------------------------------------------------------------------- memory


#: glibc's mallopt parameters (malloc.h): the free space kept at the heap's top, and how many mappings it may make.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for the next step instead of handing it back to the kernel.

    By default each tensor above glibc's mmap threshold (32 MB at most) is a mapping of its own, unmapped
    when freed, so a CPU step's large activations are faulted in as fresh zeroed pages every step: about
    two million minor faults and several seconds of system CPU per R50-FPN step at 800 px
    (docs/measurements.md). With mappings and trimming off, the heap keeps its pages and the next step
    reuses them; the process's resident memory stays near its peak instead of falling between steps.
    A process whose environment sets glibc's tunables (`MALLOC_*_`, `GLIBC_TUNABLES`) keeps them.
    Returns whether the setting took (False off glibc)."""
    if "GLIBC_TUNABLES" in os.environ or any(name.startswith("MALLOC_") for name in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def proc_status_kib(field_name: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_mb(device: torch.device) -> float:
    """GPU allocator peak on CUDA, else this process's peak resident set size (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# --------------------------------------------------------------------------- torch versions


def ddp_buffer_sync_keyword(ddp_class: type) -> str:
    """DDP's keyword for syncing buffers before each forward: `forward_sync_buffers` from torch 2.13
    (which deprecates the old one), `broadcast_buffers` in the older torch that hub images still carry."""
    parameters = inspect.signature(ddp_class.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"


def ddp_syncs_buffers(ddp) -> bool:
    """Whether a DDP model syncs its buffers before each forward, read under either torch's name."""
    return ddp.forward_sync_buffers if hasattr(ddp, "forward_sync_buffers") else ddp.broadcast_buffers


def set_recompile_limit(limit: int) -> None:
    """How often torch.compile may recompile one piece of code before it falls back to eager:
    `recompile_limit` from torch 2.7, `cache_size_limit` (the same limit's old name) in torch 2.6."""
    import torch._dynamo
    config = torch._dynamo.config
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", limit)
