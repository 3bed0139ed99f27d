"""Processes, devices and collectives: torchrun's environment, DDP with its knobs, a notebook launcher.

One process per device. `init_distributed` reads what torchrun (or `launch`) put in the
environment, picks nccl for GPUs and gloo for CPUs, pins one GPU per process from LOCAL_RANK and
gives each CPU process its share of the cores. It joins the process group through a key space of
its own for each torchrun restart round, so a restarted group never reads a dead round's addresses.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import json
import os
import pickle
import queue
import random
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .errors import PeerFailure, RendezvousError, WorkerError, print_error
from .hardware import usable_cores
from .rendezvous import NETWORK_SIGNS, PORT_TAKEN_SIGNS, rendezvous_error, round_store


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
_STACKS = None  # a launch worker's stack-dump file (see _worker)


def info() -> DistInfo:
    """This process's place in the group (rank 0 of 1 before `init_distributed`)."""
    return _INFO


def env_world() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment variables."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return (int(os.environ.get("RANK", 0)), world, int(os.environ.get("LOCAL_RANK", 0)), local_world)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group described by the environment; a single process needs none.
    A rendezvous that cannot complete within `timeout_s` raises a one-line `RendezvousError`."""
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
        try:
            dist.init_process_group(backend, store=round_store(rank, world_size, timeout),
                                    rank=rank, world_size=world_size, timeout=timeout)
        except (dist.DistError, OSError) as err:  # TimeoutError is an OSError
            raise rendezvous_error(err, rank, world_size, timeout_s) from err
        # leave the group before the interpreter tears down: a process that exits while its store's
        # and gloo's threads still run (say after a peer died) aborts ("terminate called ...")
        atexit.register(shutdown)
    _INFO = DistInfo(rank, world_size, local_rank, local_world, backend if world_size > 1 else None, device)
    return _INFO


#: How gloo reports a rank that died or stopped answering mid-collective (plain RuntimeErrors).
_PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")


def peer_failure(err: BaseException) -> PeerFailure | None:
    """`err` as a `PeerFailure` when it means another rank died or hung; else None: a taken port, a
    socket that cannot listen or a name that does not resolve is no dead peer (`init_distributed`
    raises those as a `RendezvousError`)."""
    text = str(err)
    if isinstance(err, RendezvousError) or any(sign in text for sign in PORT_TAKEN_SIGNS + NETWORK_SIGNS) or (
            not isinstance(err, dist.DistError) and not any(sign in text for sign in _PEER_FAILURE_SIGNS)):
        return None
    return PeerFailure(f"rank {info().rank}: another rank died or stopped answering within --dist-timeout, "
                       "so this one stops too (" + text.strip().splitlines()[0][:300] + ")")


def interrupted(rank: int | None = None) -> int:
    """For a CLI's `except KeyboardInterrupt` (Ctrl-C reaches every rank, and torchrun sends another):
    one line on rank 0's stderr, the same in torchrun's error file; a later Ctrl-C ends the process at
    once, without a traceback. Returns the exit code, 130 (128 + SIGINT)."""
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no second KeyboardInterrupt while saying so
    line = "interrupted (Ctrl-C); the checkpoints already written are kept (--resume auto continues from the last)"
    if (env_world()[0] if rank is None else rank) == 0:
        print_error(line)
    record_error_for_torchrun(KeyboardInterrupt(line))
    if main_thread:
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    return 130


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


def _end_group(*_) -> None:
    """SIGTERM or the parent's death in a worker: end its whole process group (itself included)."""
    if os.getpid() != os.getpgrp():  # a forked child that inherited the handler: just die
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os.killpg(0, signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    _end_group()


def _worker(rank, nprocs, port, backend, timeout_s, fn, args, messages, parent, stack_file) -> None:
    # a process group of its own, which launch ends whole (DataLoader workers and other children
    # too), ended also when the launching process dies: Linux's parent-death signal, and a thread
    # watching the parent for a main thread busy inside C; on SIGUSR1 its stacks go to `stack_file`
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes
        signal.signal(signal.SIGTERM, _end_group)
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    global _STACKS
    _STACKS = open(stack_file, "w")  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent,), name="maskrcnn_tut-parent-watch", daemon=True).start()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stdout = sys.stderr = _QueueWriter(messages, rank)
    try:
        init_distributed(backend, timeout_s)
        barrier()  # every rank has joined: one that returns at once cannot break a peer's gloo connect
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


def _hang_report(procs, unfinished: list[int], stack_files: list[Path], timeout_s: float) -> tuple[str, str]:
    """One line naming the worker(s) that hung, not those waiting for them in a collective (from the
    innermost frame outside torch and this module of each one's stack dump); the dumps."""
    for r in unfinished:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    dumps, hung, waiting = {}, [], []
    for r in unfinished:
        dumps[r] = stack_files[r].read_text(errors="replace") if stack_files[r].exists() else ""
        main = next((block for block in dumps[r].split("\n\n") if " in _worker" in block), dumps[r])
        frames = [line.strip()[5:].replace('"', "") for line in main.splitlines() if line.strip().startswith("File ")]
        own = [f for f in frames if "/torch/" not in f and __file__ not in f]
        (waiting if any("/torch/distributed/" in f for f in frames) else hung).append((r, own[0] if own else "?"))
    line = "; ".join([f"worker {r} hung at {where}" for r, where in hung or waiting]
                     + [f"worker {r} waited for it in a collective" for r, _ in waiting if hung])
    details = "\n\n".join(f"worker {r}:\n{dump}" for r, dump in dumps.items())
    return (f"launch timed out after {timeout_s:g} s (timeout_s): {line}; every worker was stopped "
            "(pass a larger timeout_s if the work needs longer)", details)


def _stop_groups(procs) -> None:
    """End every worker's process group (a finished worker's leftover children too): SIGTERM, up to
    2 s to exit, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        for p in procs:
            for kill in (os.killpg, os.kill) if p.is_alive() else (os.killpg,):
                with contextlib.suppress(OSError):  # no such group: gone, or not yet its own leader
                    kill(p.pid, sig)
        ends = time.monotonic() + wait
        for p in procs:
            p.join(timeout=max(0.0, ends - time.monotonic()))


def launch(fn, nprocs: int, *args, backend: str | None = None, timeout_s: float = 1800.0,
           prefix_output: bool = True):
    """Run `fn(*args)` in `nprocs` fresh processes joined in one group; return rank 0's result.

    Works from a Jupyter cell: workers are spawned (not forked), their prints appear in the cell
    as `[rank r] ...`, and a worker's exception is raised here as a one-line `WorkerError` (its
    traceback in `.details`, shown by IPython) after every worker has been stopped. `fn` must be
    importable (defined in a module). `timeout_s` bounds the whole call (and each collective):
    past it every worker is stopped and the `WorkerError` names the rank that hung (stacks in
    `.details`). Workers are not daemons, so they may start DataLoader workers; each worker's whole
    process group is ended, and workers end themselves when the launching process dies.
    """
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port, deadline = free_port(), time.monotonic() + timeout_s
    stacks = Path(tempfile.mkdtemp(prefix="maskrcnn_tut-launch-"))
    stack_files = [stacks / f"rank{r}.txt" for r in range(nprocs)]
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, backend, timeout_s, fn, args, messages,
                                                os.getpid(), str(stack_files[r]))) for r in range(nprocs)]

    def show(kind: str, rank: int, payload) -> None:
        if kind == "line":
            print(f"[rank {rank}] {payload}" if prefix_output else payload, flush=True)

    result, finished, error, details, started = None, set(), None, "", []
    try:
        for p in procs:
            p.start()
            started.append(p)
        while len(finished) < nprocs and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                error, details = _hang_report(procs, [r for r in range(nprocs) if r not in finished],
                                              stack_files, timeout_s)
                break
            try:
                kind, rank, payload = messages.get(timeout=min(0.2, left))
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
        while time.monotonic() < min(grace, deadline + 1.0) and any(p.is_alive() for p in started):
            try:
                show(*messages.get(timeout=0.05))
            except queue.Empty:
                pass
        # a worker that died silently is the cause of its peers' errors (e.g. "Connection reset by peer")
        silent = [f"worker {r} died with exit code {p.exitcode} without reporting"
                  for r, p in enumerate(started) if p.exitcode not in (None, 0) and r not in finished]
        if error is not None and silent and not error.startswith(silent[0]):
            error = "; ".join(silent) + "; then " + error
        _stop_groups(started)
        while True:  # drain, so the queue's feeder thread can exit
            try:
                show(*messages.get_nowait())
            except (queue.Empty, EOFError, OSError):
                break
        messages.close()
        shutil.rmtree(stacks, ignore_errors=True)
    if error is not None:
        raise WorkerError(error, details)
    return result
