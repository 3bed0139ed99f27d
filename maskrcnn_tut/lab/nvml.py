"""The GPUs a run uses, read through NVML (nvidia-ml-py), numbered as CUDA numbers them.

NVML numbers every GPU of the machine, in PCI order, and ignores CUDA_VISIBLE_DEVICES and
CUDA_DEVICE_ORDER; PyTorch's `cuda:0` is the first GPU CUDA lets this process see. On a machine
with 8 GPUs and CUDA_VISIBLE_DEVICES=3,5, `cuda:0` is NVML's GPU 3. `nvml_indices` matches the
two by UUID (PCI address where the UUIDs differ, as for MIG slices), and every reader here numbers
GPUs by CUDA index (`gpu`), with NVML's beside it (`nvml_index`, as nvidia-smi numbers them).

NVML is opened once per use and shut down after it (`nvml_session`): by `NvmlReader` (the
utilization and memory of the run's GPUs, which `GPUSampler` samples in a thread), by
`gpu_health` (temperature, power, ECC errors, throttling and PCIe link of every GPU this process
can use) and by `nvlink_links` (active NVLink links per GPU).

What a reader sees (`describe`, why a sampler is unavailable, a GPU's health finding) is worded in
the book's language (`wording`, catalog `prose/nvml.json`).
"""
from __future__ import annotations

import contextlib
import statistics
import threading
import time
from typing import Callable, Sequence

import torch

from .. import distributed as du
from ..hardware import gpu_count
from . import wording


class GpuUnavailable(RuntimeError):
    """NVML cannot read the run's GPUs here; the message says why. `entry` and `values` word it
    again in the language of whoever shows it (a sampler kept by the figure cache)."""

    def __init__(self, entry: str, **values):
        self.entry, self.values = entry, {k: v if isinstance(v, (int, str)) else str(v) for k, v in values.items()}
        super().__init__(wording.say(entry, **self.values))


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
            raise GpuUnavailable("nvml.not_listed", index=index, uuid=uuid, count=len(handles))
        found.append(number)
    return found


@contextlib.contextmanager
def nvml_session(nvml=None):
    """NVML (the pynvml module, or `nvml` in its place: tests) initialised for the block and shut
    down after it; `GpuUnavailable` says why when it cannot start."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as err:
            raise GpuUnavailable("nvml.no_pynvml") from err
    try:
        nvml.nvmlInit()
    except Exception as err:  # pynvml.NVMLError: no library, no driver, no permission
        raise GpuUnavailable("nvml.no_driver", err=err) from err
    try:
        yield nvml
    finally:
        nvml.nvmlShutdown()


def cuda_handles(nvml, cuda_devices: Sequence[int]) -> list[tuple[int, int, object]]:
    """(CUDA index, NVML index, NVML handle) of each CUDA device, in an open `nvml_session`."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    if not handles:
        raise GpuUnavailable("nvml.no_gpu_reported")
    numbers = nvml_indices(cuda_devices, nvml, handles)
    return [(cuda, number, handles[number]) for cuda, number in zip(cuda_devices, numbers)]


class NvmlReader:
    """Reads the utilization and memory of the given CUDA devices; NVML stays open until `close()`.

    Each reading names the GPU by its CUDA index (`gpu`) and its NVML index (`nvml_index`).
    """

    def __init__(self, cuda_devices: Sequence[int], nvml=None):
        if not cuda_devices:
            raise GpuUnavailable("nvml.no_gpu_used", device=du.info().device.type)
        self._session = contextlib.ExitStack()
        self.nvml = self._session.enter_context(nvml_session(nvml))
        try:
            self.devices = cuda_handles(self.nvml, list(cuda_devices))
        except BaseException:
            self.close()
            raise

    def __call__(self) -> list[dict]:
        readings = []
        for cuda, number, handle in self.devices:
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            readings.append({"gpu": cuda, "nvml_index": number,
                             "util": float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                             "mem_used_mb": memory.used / 2**20, "mem_total_mb": memory.total / 2**20})
        return readings

    def close(self) -> None:
        self._session.close()


class GPUSampler:
    """A background thread that samples the run's GPUs' utilization % and memory every `interval_s`.

    `devices` are CUDA indices (default: `run_cuda_devices()`, the GPU of this process), so a run
    on GPU 0 of an 8-GPU machine is judged by GPU 0 alone. Without an NVIDIA GPU it does nothing
    and says so: `available` is False and `reason` (also `describe()`) explains why. `reader`
    replaces NVML (a callable returning one reading per GPU).

        with GPUSampler() as gpus:
            ...train...
        print(gpus.describe())
    """

    def __init__(self, interval_s: float = 1.0, reader: Callable[[], list[dict]] | None = None,
                 devices: Sequence[int] | None = None):
        self.interval_s = interval_s
        self.devices = None if devices is None else list(devices)
        self.samples: list[dict] = []
        self.unavailable: GpuUnavailable | None = None
        self._reader = reader
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.unavailable is None

    @property
    def reason(self) -> str:
        """Why it samples nothing, in the book's language ("" when it samples)."""
        return "" if self.unavailable is None else wording.say(self.unavailable.entry, **self.unavailable.values)

    def start(self) -> GPUSampler:
        try:
            if self._reader is None:
                self._reader = NvmlReader(run_cuda_devices() if self.devices is None else self.devices)
            self._sample()
        except GpuUnavailable as err:
            self.unavailable = err
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        now = time.time()
        self.samples.extend({"time": now, **reading} for reading in self._reader())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if isinstance(self._reader, NvmlReader):
            self._reader.close()
            self._reader = None

    def __getstate__(self) -> dict:
        """What pickles (the figure cache keeps a stopped sampler): the readings and why there are none."""
        why = self.unavailable and (self.unavailable.entry, self.unavailable.values)
        return {"interval_s": self.interval_s, "devices": self.devices, "samples": self.samples, "why": why}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["interval_s"], devices=state["devices"])
        self.samples = state["samples"]
        if state["why"]:
            entry, values = state["why"]
            self.unavailable = GpuUnavailable(entry, **values)

    def __enter__(self) -> GPUSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def latest(self) -> list[dict]:
        """The newest reading of each GPU ([] when not available)."""
        newest: dict[int, dict] = {}
        for sample in self.samples:
            newest[sample["gpu"]] = sample
        return [newest[gpu] for gpu in sorted(newest)]

    def summary(self) -> list[dict]:
        """Per GPU: mean utilization %, peak memory used and total (MiB), sample count."""
        by_gpu: dict[int, list[dict]] = {}
        for sample in self.samples:
            by_gpu.setdefault(sample["gpu"], []).append(sample)
        return [{"gpu": gpu, "nvml_index": samples[0].get("nvml_index", gpu),
                 "util_mean": statistics.fmean(s["util"] for s in samples),
                 "mem_used_max_mb": max(s["mem_used_mb"] for s in samples),
                 "mem_total_mb": samples[0]["mem_total_mb"], "samples": len(samples)}
                for gpu, samples in sorted(by_gpu.items())]

    def describe(self) -> str:
        if not self.available:
            return wording.say("nvml.sampler", reason=self.reason)
        return "; ".join(wording.say("nvml.busy", name=gpu_name(g), util=g["util_mean"], used=g["mem_used_max_mb"],
                              total=g["mem_total_mb"], samples=g["samples"]) for g in self.summary())


def gpu_name(gpu: dict) -> str:
    """'GPU 0', with nvidia-smi's number beside it where the two differ (CUDA_VISIBLE_DEVICES)."""
    number = gpu.get("nvml_index", gpu["gpu"])
    return f"GPU {gpu['gpu']}" if number == gpu["gpu"] else wording.say("nvml.smi_name", gpu=gpu["gpu"], number=number)


def _nvml_value(call, *args, default=None):
    try:
        return call(*args)
    except Exception:  # not supported on this GPU, or no permission
        return default


def _health(nvml, handle) -> dict:
    """One GPU's health readings and what is off about them (`gpu_health`)."""
    name = _nvml_value(nvml.nvmlDeviceGetName, handle, default="?")
    name = name.decode() if isinstance(name, bytes) else name
    memory = _nvml_value(nvml.nvmlDeviceGetMemoryInfo, handle)
    temp = _nvml_value(nvml.nvmlDeviceGetTemperature, handle, 0)
    power = _nvml_value(nvml.nvmlDeviceGetPowerUsage, handle)
    limit = _nvml_value(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    ecc = _nvml_value(nvml.nvmlDeviceGetTotalEccErrors, handle, 1, 0)  # uncorrected, volatile
    throttle = _nvml_value(getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                           or nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle, default=0)
    gen, width = (_nvml_value(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
                  _nvml_value(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle))
    max_gen, max_width = (_nvml_value(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                          _nvml_value(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle))
    exclusive = _nvml_value(nvml.nvmlDeviceGetComputeMode, handle) == 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    problems = []
    if exclusive:
        problems.append(wording.say("nvml.exclusive"))
    if ecc:
        problems.append(wording.say("nvml.ecc", ecc=ecc))
    # idle (0x1) and applications-clocks setting (0x2) are normal; the rest slows the GPU
    if throttle and throttle & ~0x3:
        problems.append(wording.say("nvml.throttle", mask=throttle))
    if temp is not None and temp >= 85:
        problems.append(f"{temp} °C")
    if width and max_width and width < max_width and gen and max_gen and gen < max_gen:
        problems.append(wording.say("nvml.pcie", gen=gen, width=width, max_gen=max_gen, max_width=max_width))
    return {"name": name, "temperature C": temp,
            "power W": power / 1000 if power is not None else None,
            "power limit W": limit / 1000 if limit is not None else None,
            "memory used MiB": memory.used / 2**20 if memory else None,
            "memory MiB": memory.total / 2**20 if memory else None,
            "uncorrected ECC": ecc, "PCIe": f"gen {gen} x{width}" if gen else None, "exclusive": exclusive,
            "ok": not problems, "finding": "; ".join(problems) or wording.say("nvml.healthy")}


def gpu_health(nvml=None, cuda_devices: Sequence[int] | None = None) -> list[dict]:
    """Each GPU this process can use (default: every one CUDA shows), by CUDA index (`gpu`) and
    NVML's (`nvml_index`): temperature, power, memory, uncorrected ECC errors, throttling, PCIe
    link; `ok` False with the reason when something is off. [] without an NVIDIA GPU or driver."""
    cuda_devices = list(range(gpu_count())) if cuda_devices is None else list(cuda_devices)
    if not cuda_devices:
        return []
    try:
        with nvml_session(nvml) as session:
            return [{"gpu": cuda, "nvml_index": number, **_health(session, handle)}
                    for cuda, number, handle in cuda_handles(session, cuda_devices)]
    except GpuUnavailable:
        return []


def exclusive_gpu_held(nvml=None) -> int | None:
    """The CUDA index of this process's GPU when the process holds a CUDA context on it and it is in
    EXCLUSIVE_PROCESS compute mode (any other process's first CUDA call there then fails), else None."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    current = torch.cuda.current_device()
    held = [gpu["gpu"] for gpu in gpu_health(nvml, [current]) if gpu["exclusive"]]
    return held[0] if held else None


def nvlink_links(cuda_devices: Sequence[int], nvml=None) -> list[int] | None:
    """Active NVLink links of each CUDA device (0 for a GPU without NVLink); None when NVML
    cannot tell (no library, no driver, a GPU it does not list)."""
    try:
        with nvml_session(nvml) as session:
            counts = []
            for _, _, handle in cuda_handles(session, list(cuda_devices)):
                active = 0
                for link in range(session.NVML_NVLINK_MAX_LINKS):
                    try:
                        active += session.nvmlDeviceGetNvLinkState(handle, link) == session.NVML_FEATURE_ENABLED
                    except session.NVMLError:  # no such link on this GPU
                        break
                counts.append(active)
            return counts
    except GpuUnavailable:
        return None
