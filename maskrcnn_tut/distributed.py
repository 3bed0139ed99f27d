"""Processes, devices and collectives: torchrun's environment, DDP with its knobs, a notebook launcher.

One process per device. `init_distributed` reads what torchrun (or `launch`) put in the
environment, picks nccl for GPUs and gloo for CPUs, pins one GPU per process from LOCAL_RANK and
gives each CPU process its share of the cores. It joins the process group through a key space of
its own for each torchrun restart round, so a restarted group never reads a dead round's addresses.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import pickle
import queue
import random
import re
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

from .errors import PeerFailure, RendezvousError, WorkerError
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
_STACKS = None  # a launch worker's stack-dump file (see _follow_parent)


def info() -> DistInfo:
    """This process's place in the group (rank 0 of 1 before `init_distributed`)."""
    return _INFO


def env_world() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment variables."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return (int(os.environ.get("RANK", 0)), world, int(os.environ.get("LOCAL_RANK", 0)), local_world)


def _call_within(call, seconds: float):
    """`call()` in a daemon thread, waited for at most `seconds` (else TimeoutError; the thread is
    left behind): TCPStore's client handshake waits forever on a port that never answers."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err
    thread = threading.Thread(target=run, name="maskrcnn_tut-rendezvous", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive() or "error" in box:
        raise box.get("error") or TimeoutError(f"no answer within {seconds:g} s")
    return box["result"]


def _reach(addr: str, port: int, ends: float) -> None:
    """Wait (until `ends`, else ConnectionError) for something to accept TCP connections at the
    store's address: TCPStore's own connect retries run past its timeout."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, ends - time.monotonic()))):
                return
        except OSError as err:
            if time.monotonic() >= ends:
                raise ConnectionError(f"nothing accepted a connection ({err})") from err
            time.sleep(0.2)


def _round_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, prefixed by torchrun's restart count (see findings on gloo restarts);
    joining it is bounded by `timeout` (plus 2 s), which TCPStore alone does not do."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_master, ends = rank == 0 and not agent_store, time.monotonic() + timeout.total_seconds()
    if not is_master:
        _reach(addr, port, ends)
    store = _call_within(lambda: dist.TCPStore(addr, port, world_size=None if agent_store else world_size,
                                               is_master=is_master, timeout=timeout, wait_for_workers=False),
                         max(0.0, ends - time.monotonic()) + 2)
    return dist.PrefixStore(f"maskrcnn_tut/round{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


#: A taken port, and network faults that are no peer's death even mid-run (DistNetworkError texts).
_PORT_TAKEN_SIGNS = ("EADDRINUSE", "ddress already in use")
_NETWORK_SIGNS = ("failed to listen", "gai error", "Name or service not known")
_UNREACHABLE_SIGNS = ("trying to connect", "Network is unreachable", "No route to host")  # while joining


def _rendezvous_error(err: BaseException, rank: int, world_size: int, timeout_s: float | None) -> RendezvousError:
    """One line for a failure to join the group: a taken port, no answer, a rank that never came."""
    text, addr = str(err).strip(), os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = (re.findall(r"port: (\d+)", text) or [os.environ.get("MASTER_PORT", "?")])[0]
    where, first = f"{addr}:{port} (MASTER_ADDR:MASTER_PORT)", (text.splitlines() or [type(err).__name__])[0][:300]
    within = f" within --dist-timeout {timeout_s:g} s" if timeout_s else ""
    pick = "pick a free one with --master-port N (torchrun) or MASTER_PORT=N"
    if any(sign in text for sign in _PORT_TAKEN_SIGNS):
        why = f"port {port} is already in use on this machine (another run or program), so rank 0 cannot serve there"
    elif isinstance(err, TimeoutError):
        why = f"{where} accepts connections but did not answer as rank 0's store{within} (another program listening there?)"
    elif isinstance(err, ConnectionError) or any(sign in text for sign in _NETWORK_SIGNS + _UNREACHABLE_SIGNS):
        return RendezvousError(f"rank {rank}: could not reach rank 0's store at {where}{within}: is rank 0 running, "
                               f"and are address and port right? ({first})")
    elif "wait timeout" in text or "Timed out" in text:
        return RendezvousError(f"rank {rank}: not all {world_size} ranks joined at {where}{within} (did one fail "
                               "to start, or is WORLD_SIZE wrong?)")
    else:
        return RendezvousError(f"rank {rank}: joining the process group at {where} failed: {first}")
    return RendezvousError(f"rank {rank}: {why}; {pick}")


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
            dist.init_process_group(backend, store=_round_store(rank, world_size, timeout),
                                    rank=rank, world_size=world_size, timeout=timeout)
        except (dist.DistError, OSError) as err:  # TimeoutError is an OSError
            raise _rendezvous_error(err, rank, world_size, timeout_s) from err
    _INFO = DistInfo(rank, world_size, local_rank, local_world, backend if world_size > 1 else None, device)
    return _INFO


#: How gloo reports a rank that died or stopped answering mid-collective (plain RuntimeErrors).
_PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")


def peer_failure(err: BaseException) -> PeerFailure | None:
    """`err` as a `PeerFailure` when it means another rank died or hung; else None (a taken port or
    an unresolvable address is no dead peer: see `network_failure`)."""
    text = str(err)
    if isinstance(err, RendezvousError) or network_failure(err) is not None or (
            not isinstance(err, dist.DistError) and not any(sign in text for sign in _PEER_FAILURE_SIGNS)):
        return None
    return PeerFailure(f"rank {info().rank}: another rank died or stopped answering within --dist-timeout, "
                       "so this one stops too (" + text.strip().splitlines()[0][:300] + ")")


def network_failure(err: BaseException) -> RendezvousError | None:
    """`err` as a one-line `RendezvousError` when it is a taken port, a socket that cannot listen or
    a host name that does not resolve (no other rank's death); else None."""
    if not any(sign in str(err) for sign in _PORT_TAKEN_SIGNS + _NETWORK_SIGNS):
        return None
    return _rendezvous_error(err, info().rank, info().world_size, None)


def interrupted(rank: int | None = None) -> int:
    """For a CLI's `except KeyboardInterrupt` (Ctrl-C reaches every rank at once): one line on rank 0's
    stderr, the same in torchrun's error file, a second Ctrl-C ends the process at once; returns 130."""
    with contextlib.suppress(ValueError):  # only the main thread may set handlers
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    line = "interrupted (Ctrl-C); the checkpoints already written are kept (--resume auto continues from the last)"
    if (env_world()[0] if rank is None else rank) == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    record_error_for_torchrun(KeyboardInterrupt(line))
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
    `.details`). Each worker's whole process group is ended (its DataLoader workers too), and
    workers end themselves when the launching process dies (a killed kernel leaves nothing).
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
