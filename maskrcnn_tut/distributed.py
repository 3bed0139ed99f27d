"""Processes, devices and collectives: torchrun's environment, DDP with its knobs, a notebook launcher.

One process per device. `init_distributed` reads what torchrun (or `launch`) put in the
environment, picks nccl for GPUs and gloo for CPUs, pins one GPU per process from LOCAL_RANK and
gives each CPU process its share of the cores. It joins the process group through a key space of
its own for each torchrun restart round, so a restarted group never reads a dead round's addresses.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import queue
import random
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .errors import PeerFailure, WorkerError
from .hardware import usable_cores


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_INFO = DistInfo()


def info() -> DistInfo:
    """This process's place in the group (rank 0 of 1 before `init_distributed`)."""
    return _INFO


def env_world() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment variables."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return (int(os.environ.get("RANK", 0)), world, int(os.environ.get("LOCAL_RANK", 0)), local_world)


def _round_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, prefixed by torchrun's restart count (see findings on gloo restarts)."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(addr, port, world_size=None if agent_store else world_size,
                          is_master=rank == 0 and not agent_store, timeout=timeout,
                          wait_for_workers=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"maskrcnn_tut/round{restart}/", store)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group described by the environment; a single process needs none."""
    global _INFO
    rank, world_size, local_rank, local_world = env_world()
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, usable_cores() // local_world))
    if world_size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=_round_store(rank, world_size, timeout),
                                rank=rank, world_size=world_size, timeout=timeout)
    _INFO = DistInfo(rank, world_size, local_rank, local_world, backend if world_size > 1 else None, device)
    return _INFO


#: How gloo reports a rank that died or stopped answering mid-collective (plain RuntimeErrors).
_PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")


def peer_failure(err: BaseException) -> PeerFailure | None:
    """`err` as a `PeerFailure` when it means another rank died or hung; else None."""
    text = str(err)
    if not isinstance(err, dist.DistError) and not any(sign in text for sign in _PEER_FAILURE_SIGNS):
        return None
    return PeerFailure(f"rank {info().rank}: another rank died or stopped answering within --dist-timeout, "
                       "so this one stops too (" + text.strip().splitlines()[0][:300] + ")")


def record_error_for_torchrun(err: BaseException) -> None:
    """Write `err` as one line into torchrun's error file (`TORCHELASTIC_ERROR_FILE`), in the
    format of torch.distributed.elastic's `ErrorHandler`, so that torchrun's failure summary names
    the cause (instead of `error_file: <N/A>`) without the package's traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"{type(err).__name__}: {err}"
    payload = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(payload))


def shutdown() -> None:
    global _INFO
    if dist.is_initialized():
        dist.destroy_process_group()
    _INFO = DistInfo()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (a no-op in one process)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and all GPUs) alike."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def wrap_ddp(model: nn.Module, cfg, dist_info: DistInfo) -> nn.Module:
    """DistributedDataParallel with the config's knobs; the model itself in a single process."""
    if not dist_info.distributed:
        return model
    device_ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view, static_graph=cfg.static_graph,
        forward_sync_buffers=cfg.broadcast_buffers, find_unused_parameters=cfg.find_unused_parameters,
    )
    if cfg.grad_compression != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        ddp.register_comm_hook(None, hook[cfg.grad_compression])
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP/DP wrapper (what checkpoints and evaluation use)."""
    return model.module if hasattr(model, "module") else model


# --------------------------------------------------------------------------- notebook launcher


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _QueueWriter:
    """File-like object that forwards a worker's prints, line by line, to the parent."""

    def __init__(self, messages, rank: int):
        self.messages, self.rank, self.buffer = messages, rank, ""

    def write(self, text: str) -> int:
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            self.messages.put(("line", self.rank, line))
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self.messages.put(("line", self.rank, self.buffer))
            self.buffer = ""

    def isatty(self) -> bool:
        return False


def _worker(rank: int, nprocs: int, port: int, backend, timeout_s, fn, args, messages) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stdout = sys.stderr = _QueueWriter(messages, rank)
    try:
        init_distributed(backend, timeout_s)
        result = fn(*args)
        try:  # pickled here: the queue pickles in a background thread, where a failure would be lost
            payload = pickle.dumps(result if rank == 0 else None)
        except Exception as err:
            raise TypeError(f"{getattr(fn, '__name__', fn)} returned a {type(result).__name__}, which cannot be sent back "
                            f"to the launching process ({err}); return plain data") from err
        messages.put(("result", rank, payload))
    except BaseException:  # report everything, SystemExit included, to the parent
        messages.put(("error", rank, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        shutdown()


def launch(fn, nprocs: int, *args, backend: str | None = None, timeout_s: float = 300.0,
           prefix_output: bool = True):
    """Run `fn(*args)` in `nprocs` fresh processes joined in one group; return rank 0's result.

    Works from a Jupyter cell: workers are spawned (not forked), their prints appear in the cell
    as `[rank r] ...`, and a worker's exception is raised here as a one-line `WorkerError` (its
    traceback in `.details`, shown by IPython) after every worker has been stopped. `fn` must be importable (defined in a module).
    Workers are not daemons, so they may start DataLoader worker processes of their own.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, backend, timeout_s, fn, args, messages))
             for r in range(nprocs)]

    def show(kind: str, rank: int, payload) -> None:
        if kind == "line":
            print(f"[rank {rank}] {payload}" if prefix_output else payload, flush=True)

    result, finished, error, details, started = None, set(), None, "", []
    try:
        for p in procs:
            p.start()
            started.append(p)
        while len(finished) < nprocs and error is None:
            try:
                kind, rank, payload = messages.get(timeout=0.2)
            except queue.Empty:  # nothing pending: a worker that has exited without reporting is dead
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in finished]
                if dead:
                    error = (f"worker {dead[0]} died with exit code {procs[dead[0]].exitcode} without reporting "
                             "(if it failed while starting: a script that calls launch needs `if __name__ == '__main__':`)")
                continue
            show(kind, rank, payload)
            if kind == "error":
                error, details = f"worker {rank} failed: {payload.strip().splitlines()[-1]}", payload
                finished.add(rank)
            elif kind == "result":
                finished.add(rank)
                if rank == 0:
                    result = pickle.loads(payload)
    finally:
        # let finished workers exit (reading their last lines meanwhile); stop the others now
        grace = time.monotonic() + (5.0 if error is None and len(finished) == nprocs else 0.5)
        while time.monotonic() < grace and any(p.is_alive() for p in started):
            try:
                show(*messages.get(timeout=0.05))
            except queue.Empty:
                pass
        # a worker that died silently is the cause of its peers' errors (e.g. "Connection reset by peer")
        silent = [f"worker {r} died with exit code {p.exitcode} without reporting"
                  for r, p in enumerate(started) if p.exitcode not in (None, 0) and r not in finished]
        if error is not None and silent and not error.startswith(silent[0]):
            error = "; ".join(silent) + "; then " + error
        for p in started:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
            p.join()
        while True:  # drain, so the queue's feeder thread can exit
            try:
                show(*messages.get_nowait())
            except (queue.Empty, EOFError, OSError):
                break
        messages.close()
    if error is not None:
        raise WorkerError(error, details)
    return result
