"""Processes, devices and collectives: torchrun's environment, DDP with its knobs.

One process per device. `init_distributed` reads what torchrun (or `launch`) put in the
environment, picks nccl for GPUs and gloo for CPUs, pins one GPU per process from LOCAL_RANK and
gives each CPU process its share of the cores. It joins the process group through a key space of
its own for each torchrun restart round, so a restarted group never reads a dead round's addresses.
`run_cli` gives every command line (`train.py`, `predict`) the same exit codes, 4 when another rank failed.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .config import Config, Run
from .errors import ConfigError, OutputError, PeerFailure, RendezvousError, UserError, print_error
from .hardware import ddp_buffer_sync_keyword, gpus_torch_cannot_use, usable_cores
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


def info() -> DistInfo:
    """This process's place in the group (rank 0 of 1 before `init_distributed`)."""
    return _INFO


def env_world() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment variables."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return (int(os.environ.get("RANK", 0)), world, int(os.environ.get("LOCAL_RANK", 0)), local_world)


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """This process's device for `--accelerator` auto, cpu or cuda. A machine whose NVIDIA GPUs torch
    cannot use (a driver older than torch's CUDA) stops with a one-line `ConfigError` instead of
    training on the CPU for days, unless the CPU was asked for."""
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    reason = gpus_torch_cannot_use()
    if reason:
        raise ConfigError(reason)
    if requested == "cuda":
        raise ConfigError(f"--accelerator cuda: torch {torch.__version__} finds no NVIDIA GPU on this machine "
                          "(use --accelerator auto or cpu)")
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0, accelerator: str = "auto") -> DistInfo:
    """Join the process group described by the environment; a single process needs none.
    A rendezvous that cannot complete within `timeout_s` raises a one-line `RendezvousError`;
    `accelerator` is `--accelerator` (see `pick_device`)."""
    global _INFO
    rank, world_size, local_rank, local_world = env_world()
    device = pick_device(accelerator, local_rank)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # each process its share of the cores, GPU or not: torch's default of one thread per core of the
    # host ignores a cgroup quota (a pod with 8 CPUs on a 64-core node) and oversubscribes it
    torch.set_num_threads(max(1, usable_cores() // local_world))
    if world_size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        # nccl bound to this process's GPU at once: its errors surface here, not at the first
        # collective, and barrier() does not have to guess the device (and warn)
        bound = {"device_id": device} if backend == "nccl" else {}
        try:
            dist.init_process_group(backend, store=round_store(rank, world_size, timeout),
                                    rank=rank, world_size=world_size, timeout=timeout, **bound)
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
    raises those as a `RendezvousError`). With nccl a dead or hung peer usually never reaches
    Python: NCCL's watchdog aborts the process (SIGABRT) once --dist-timeout passes, and torchrun's
    failure summary names the signal instead of this one line."""
    text = str(err)
    if isinstance(err, RendezvousError) or any(sign in text for sign in PORT_TAKEN_SIGNS + NETWORK_SIGNS) or (
            not isinstance(err, dist.DistError) and not any(sign in text for sign in _PEER_FAILURE_SIGNS)):
        return None
    return PeerFailure(f"rank {info().rank}: another rank died or stopped answering within --dist-timeout, "
                       "so this one stops too (" + text.strip().splitlines()[0][:300] + ")")


def no_space(err: BaseException) -> OutputError | None:
    """`err` as one line when a full disk caused it (an OSError ENOSPC in its chain, or a compiler's output
    that says so: torch.compile's g++ writing into a full TMPDIR); else None."""
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            where = f"{err.filename}: {err.strerror}" if err.filename else str(err)
        else:
            where = next((line.strip().split("error: ")[-1] for line in str(err).splitlines()
                          if os.strerror(errno.ENOSPC) in line), None)
        if where:
            rank = f"rank {info().rank}: " if info().world_size > 1 else ""
            return OutputError(f"{rank}a disk is full ({where[:300]}); free space there. A run writes to its output "
                               f"folder, torch.compile and its compiler to TMPDIR (now {os.environ.get('TMPDIR', '/tmp')}; "
                               "compiled kernels: TORCHINDUCTOR_CACHE_DIR)")
        err = err.__cause__ or err.__context__
    return None


#: What Ctrl-C leaves, as train.py says it (`run_cli`'s `kept` for another command).
CHECKPOINTS_KEPT = "the checkpoints already written are kept (--resume auto continues from the last)"


def interrupted(rank: int | None = None, kept: str = CHECKPOINTS_KEPT) -> int:
    """For a CLI's `except KeyboardInterrupt` (Ctrl-C reaches every rank, and torchrun sends another):
    one line on rank 0's stderr, the same in torchrun's error file; a later Ctrl-C ends the process at
    once, without a traceback. Returns the exit code, 130 (128 + SIGINT)."""
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no second KeyboardInterrupt while saying so
    line = f"interrupted (Ctrl-C); {kept}"
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


def report(err: UserError, rank: int) -> None:
    """One line on stderr (on rank 0 only for the set-up errors every rank meets alike), and the
    same line in torchrun's error file, so its failure summary names the cause."""
    if rank == 0 or err.rank_specific:
        print_error(str(err))
    record_error_for_torchrun(err)


def run_cli(body: Callable[[], object], kept: str = CHECKPOINTS_KEPT) -> int:
    """A command line's exit-code contract (`errors.py`), for `train.py` and `predict` alike: logging
    to stderr (the other ranks' at WARNING only), then `body()`, then 0. A `UserError` ends as one line
    (`report`) and its exit code; Ctrl-C as `interrupted` (saying what is `kept`); a RuntimeError that means another rank died
    or hung (`peer_failure`) as one line and exit 4, a full disk (`no_space`) as one line and exit 2;
    any other error keeps its traceback. The process leaves its group (`shutdown`) in every case."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    rank = env_world()[0]
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        body()
    except UserError as err:
        report(err, rank)
        return err.exit_code
    except KeyboardInterrupt:
        return interrupted(rank, kept)
    except (RuntimeError, OSError) as err:
        failure = (peer_failure(err) if isinstance(err, RuntimeError) else None) or no_space(err)
        if failure is None:
            raise
        report(failure, rank)
        return failure.exit_code
    finally:
        shutdown()
    return 0


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


def wrap_ddp(model: nn.Module, cfg: Config | Run, dist_info: DistInfo) -> nn.Module:
    """DistributedDataParallel with the config's knobs; the model itself in a single process."""
    if not dist_info.distributed:
        return model
    device_ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
    ddp_class = nn.parallel.DistributedDataParallel
    buffer_sync = {ddp_buffer_sync_keyword(ddp_class): cfg.broadcast_buffers}
    ddp = ddp_class(
        model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view, static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters, **buffer_sync,
    )
    if cfg.grad_compression != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        ddp.register_comm_hook(None, hook[cfg.grad_compression])
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP/DP wrapper (what checkpoints and evaluation use)."""
    return model.module if hasattr(model, "module") else model
