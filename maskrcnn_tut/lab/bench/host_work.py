"""What the host does in one training step, counted on any machine: the aten ops it dispatches, the
ones that would launch a GPU kernel, and its host syncs (reads that make the host wait for the
device), each sync put down to the code that asked for it: torchvision's model or the package's step.

At two images per GPU an H200 waits on the host (2026-12-04: steps of 55-70 ms against an estimated
15-30 ms of GPU work), so these counts are what a faster step has to cut. They are counts, not
times: the same on a CPU as on a GPU, so a test on the CPU can fail when a change adds a sync.

How a CPU stands in for a GPU: a tensor is a host tensor when it came from the batches the loader gives
(`count_host_work` marks them), from a factory call without `device=` (`torch.empty(...)`,
`torch.tensor(...)`), or from `.cpu()`; what an op makes from host tensors alone is one too; every other
tensor is a device tensor, and `.to(a device)` of a host tensor is the loop's copy to the run's device
(`.to(other)`, a copy to where `other` is). A sync is a read of a device tensor: `.cpu()`, `.tolist()`,
`.numpy()`, `.item()` and `bool()`/`float()`/`int()` of it, and the ops whose output size depends on the
data (`nonzero`, boolean-mask indexing, `unique`, torchvision's `nms`). What a CPU cannot tell apart is
left to the GPU run's sync debug mode (`tools/gpu_check.sh`): `.to("cpu")` (on a CPU, a move to the
run's device; the package reads with `.cpu()`), and waits on CUDA events, which are no tensor calls.

`count_host_work(step, batches)` runs `step()` once under both counters and returns a `HostWork`.
"""
from __future__ import annotations

import collections
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

TORCH_DIR = str(Path(torch.__file__).parent) + "/"
HERE = __file__
#: Tensor methods that copy a device tensor's values to the host.
HOST_READS = {"cpu", "tolist", "numpy"}
#: Factory functions: a host tensor unless given a device.
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "empty_strided", "scalar_tensor"}
#: Ops whose output size (or a Python value) depends on the data: the host waits for the device.
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten._unique2", "aten.unique_dim", "aten.masked_select",
            "aten.equal", "aten.is_nonzero", "torchvision.nms"}
#: Ops with boolean-mask indices: a nonzero inside on a GPU.
MASK_INDEX_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}
#: Ops that allocate or describe memory without running a kernel.
NO_KERNEL = {"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.lift_fresh", "aten._to_copy",
             "aten.detach", "aten.alias", "aten.set_", "aten.resize_"}


def _origin() -> str:
    """Who asked: the innermost frame outside torch (and this module) as "torchvision", "maskrcnn_tut"
    (the package's own code) or "other"."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(TORCH_DIR) or frame.filename == HERE:
            continue
        for name in ("torchvision", "maskrcnn_tut"):
            if f"/{name}/" in frame.filename:
                return name
        return "other"
    return "other"


class HostSet:
    """The host tensors, by identity (a tensor's `==` compares values), forgotten when they are freed."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, tensor: torch.Tensor) -> None:
        self._refs[id(tensor)] = weakref.ref(tensor)

    def discard(self, tensor: torch.Tensor) -> None:
        self._refs.pop(id(tensor), None)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


@dataclass
class HostWork:
    """One step's host work: aten ops dispatched, those that would launch a GPU kernel, and host syncs by
    "origin: what" (e.g. "torchvision: aten.nonzero", "maskrcnn_tut: Tensor.cpu")."""

    ops: int = 0
    launches: int = 0
    syncs: collections.Counter = field(default_factory=collections.Counter)

    def syncs_from(self, origin: str) -> int:
        return sum(n for key, n in self.syncs.items() if key.startswith(origin + ":"))

    def row(self) -> dict:
        return {"aten ops": self.ops, "kernel launches": self.launches, "syncs": sum(self.syncs.values()),
                "syncs torchvision": self.syncs_from("torchvision"), "syncs package": self.syncs_from("maskrcnn_tut"),
                "sync sites": dict(self.syncs.most_common())}


class _Counting:
    """What both counters share: the counts they add to and the set of host tensors."""

    def __init__(self, work: HostWork, host: HostSet):
        super().__init__()
        self.work, self.host = work, host


class _HostTensors(_Counting, TorchFunctionMode):
    """Keeps the set of host tensors (module doc) and counts the reads of device tensors it sees."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = _tensors((args, kwargs))
        from_host = bool(inputs) and all(t in self.host for t in inputs)  # one device operand runs it there
        if name in HOST_READS and inputs and not from_host:
            self.work.syncs[f"{_origin()}: Tensor.{name}"] += 1
        result = func(*args, **kwargs)
        if name == "to":  # where a copy lands: another tensor's place, or a device (on a CPU, the run's)
            target = [a for a in (*args[1:], kwargs.get("device"), kwargs.get("other")) if a is not None]
            placed = [a in self.host for a in target if isinstance(a, torch.Tensor)]
            if placed or any(isinstance(a, (str, torch.device)) for a in target):
                from_host = bool(placed) and placed[0]
        made_on_host = (name in FACTORIES and kwargs.get("device") is None) or name in HOST_READS
        for tensor in _tensors(result):
            if from_host or made_on_host:
                self.host.add(tensor)
            else:
                self.host.discard(tensor)  # on a CPU, .to(the run's device) gives the tensor itself back
        return result


class _Dispatched(_Counting, TorchDispatchMode):
    """Counts the aten ops, the kernel launches among them and the data-dependent syncs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func._schema.name.split('::')[-1]}"
        inputs = _tensors((args, kwargs))
        on_device = not inputs or not all(t in self.host for t in inputs)
        self.work.ops += 1
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if on_device and not is_view and name not in NO_KERNEL and name not in SYNC_OPS:
            self.work.launches += 1
        masked = name in MASK_INDEX_OPS and any(t.dtype == torch.bool for t in _tensors(args[1:2]))
        if (name in SYNC_OPS or masked) and on_device:
            self.work.syncs[f"{_origin()}: {name}{' (boolean mask)' if masked else ''}"] += 1
        return func(*args, **kwargs)


def host_batches(batches: Iterable, host: HostSet) -> Iterator:
    """`batches` with every tensor marked as a host tensor, as a DataLoader's batches are."""
    for batch in batches:
        for tensor in _tensors(batch):
            host.add(tensor)
        yield batch


def optimizer_counters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's step counters: 0-d tensors that live on the host unless the optimizer is fused."""
    return [value for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor) and value.ndim == 0 and value.device.type == "cpu"]


def count_host_work(step: Callable[[Iterator], object], batches: Iterable,
                    host_tensors: Iterable[torch.Tensor] = ()) -> HostWork:
    """Run `step(marked_batches)` once under both counters (module doc) and return what it did;
    `host_tensors`: tensors made before the count that live on the host on a GPU machine too (e.g.
    `optimizer_counters`)."""
    work, host = HostWork(), HostSet()
    for tensor in host_tensors:
        host.add(tensor)
    with _HostTensors(work, host), _Dispatched(work, host):
        step(host_batches(batches, host))
    return work
