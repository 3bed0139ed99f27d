"""From a dataset to batches: transforms, collate, samplers and the DataLoader knobs of chapter 3.

Batches stay uint8 on the host (four times less to copy than float32); `to_device` converts them
to float on the device. Sampling is deterministic given (seed, epoch), and `ResumableBatches`
can skip the batches a resumed run has already seen, so a restart continues the same sequence.
`batch_stream` is how training reads batches: forever, epoch after epoch; `iterate` is how every
loader is read (training and evaluation): it counts in the main process the images that failed to
decode inside worker processes, and turns a worker's `DataError` into the same one line.
"""
from __future__ import annotations

import atexit
import bisect
import errno
import multiprocessing
import multiprocessing.util  # registers the exit hook that `_end_workers_at_exit` must run before
import os
import shutil
import signal
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    Subset,
    get_worker_info,
)
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
from torchvision.transforms import v2

from ..config import Config, Run
from ..errors import DataError, OutOfSharedMemory
from ..hardware import usable_cores
from ..preemption import STOP_SIGNALS
from .coco import LOAD_FAILED_KEY, CocoDetection, coco_paths
from .device_decode import decode_batch
from .packing import pack
from .shapes import default_cache_dir


def train_transforms() -> v2.Transform:
    """Augmentations that move boxes and masks with the pixels (tv_tensors do the bookkeeping)."""
    return v2.RandomHorizontalFlip(p=0.5)


def collate(batch):
    """Detection batches are lists: images differ in size and targets in instance count. A worker
    packs the batch into one block of shared memory here (`packing.pack`; the training process
    receives the batch itself), so a full /dev/shm raises and reaches the rank (`iterate`): in the
    queue's feeder thread it would only print and drop the batch, leaving the rank waiting forever."""
    columns = tuple(zip(*batch))
    return pack(columns) if get_worker_info() is not None else columns


def to_device(images, targets, device: torch.device, non_blocking: bool = False):
    """Move a batch to `device` and scale uint8 pixels to float in [0, 1] there."""
    images = [img.to(device, non_blocking=non_blocking).float().div_(255) for img in images]
    targets = [{k: (v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v)
                for k, v in t.items()} for t in targets]
    return images, targets


class GroupedBatchSampler(torch.utils.data.Sampler):
    """Batches of images whose aspect ratios fall in the same bin (less padding per batch).

    With group factor k the bin edges are 2^(j/k) for j = -k..k (log-spaced ratios from 1/2 to 2),
    as in torchvision's reference; leftovers of all bins are batched together at the end.
    """

    def __init__(self, sampler, aspect_ratios: list[float], batch_size: int, group_factor: int):
        self.sampler, self.batch_size = sampler, batch_size
        bins = sorted(2 ** (k / group_factor) for k in range(-group_factor, group_factor + 1))
        self.group_ids = [bisect.bisect_right(bins, r) for r in aspect_ratios]

    def __iter__(self):
        buckets: dict[int, list[int]] = {}
        for index in self.sampler:
            bucket = buckets.setdefault(self.group_ids[index], [])
            bucket.append(index)
            if len(bucket) == self.batch_size:
                yield bucket.copy()
                bucket.clear()
        # leftovers of all bins make the remaining full batches, so every rank yields len(self)
        leftovers = [i for bucket in buckets.values() for i in bucket]
        for start in range(0, len(leftovers) - self.batch_size + 1, self.batch_size):
            yield leftovers[start:start + self.batch_size]

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size


class ResumableBatches(torch.utils.data.Sampler):
    """Wrap a batch sampler: fix the epoch, skip the first `skip` batches, and tag each index with a
    per-sample seed so augmentation depends only on (seed, epoch, index)."""

    def __init__(self, batch_sampler, seed: int):
        self.batch_sampler, self.seed = batch_sampler, seed
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip
        sampler = getattr(self.batch_sampler, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        elif isinstance(sampler, RandomSampler):  # DistributedSampler's order: the same images come first on any
            sampler.generator = torch.Generator().manual_seed(self.seed + epoch)  # process count (a resume's place)

    def __iter__(self) -> Iterator[list]:
        for number, batch in enumerate(self.batch_sampler):
            if number >= self.skip:
                yield [(i, hash((self.seed, self.epoch, i)) & 0x7FFF_FFFF) for i in batch]

    def __len__(self) -> int:
        return len(self.batch_sampler)


#: The job's signals: SLURM sends them to every process, torchrun to each rank's process group.
_JOB_SIGNALS = {*STOP_SIGNALS, signal.SIGINT}


@atexit.register
def _end_workers_at_exit() -> None:
    """At exit multiprocessing SIGTERMs daemonic children (loader workers) and waits; workers block
    SIGTERM (`iterate`), so SIGKILL them first (this atexit hook runs before multiprocessing's), with
    torch's SIGCHLD handler, which would report each as a failed worker, set aside."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in workers:
        child.kill()


def loader_kwargs(workers: int, pin_memory: bool, persistent_workers: bool, prefetch_factor: int) -> dict:
    """DataLoader keyword arguments, dropping the ones that are invalid with `workers=0`."""
    # A generator of its own: starting an iterator draws a seed, and from the global RNG that draw
    # would shift the stream RPN/RoI sampling uses whenever a resumed run starts mid-epoch.
    kwargs = dict(num_workers=workers, pin_memory=pin_memory, collate_fn=collate, generator=torch.Generator())
    if workers > 0:
        kwargs.update(persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)
    return kwargs


def worker_count(cfg: Run) -> int:
    """--workers, else 1 on CPUs (a worker's CPU comes out of the training threads', which use every core)
    and on GPUs one less than this process's share of the cores, at least 1, at most 4 (torchvision's -j 4)."""
    if cfg.workers is not None:
        return cfg.workers
    share = usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(4, share - 1)) if cfg.device.type == "cuda" else 1


def build_train_loader(dataset: CocoDetection, cfg: Run, rank: int, world_size: int,
                       device: torch.device | None = None) -> DataLoader:
    """The training DataLoader: DistributedSampler when distributed, optional aspect grouping;
    with `--decode-on-device` its JPEGs are decoded on `device` as the batches arrive (`iterate`)."""
    dataset.decode_device = device if cfg.decode_on_device else None
    if world_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=cfg.seed, drop_last=True)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(cfg.seed))
    if cfg.aspect_ratio_group_factor >= 0:
        batches = GroupedBatchSampler(sampler, dataset.aspect_ratios(), cfg.batch_size,
                                      max(cfg.aspect_ratio_group_factor, 1))
    else:
        batches = torch.utils.data.BatchSampler(sampler, cfg.batch_size, drop_last=True)
    if len(batches) == 0:
        raise DataError(f"{dataset.ann_file}: {len(dataset)} usable training images, fewer than one batch "
                        f"of --batch-size {cfg.batch_size} on {world_size} process(es) (needs "
                        f"{cfg.batch_size * world_size}): lower --batch-size or use fewer processes")
    return DataLoader(dataset, batch_sampler=ResumableBatches(batches, cfg.seed),
                      **loader_kwargs(worker_count(cfg), cfg.pin_memory, cfg.persistent_workers, cfg.prefetch_factor))


class EvalShard(Subset):
    """Every world_size-th image of a dataset, where an image that fails to decode is not replaced
    by the next one (that image would be scored twice) but comes as a placeholder carrying the
    failure (`CocoDetection.sample(substitute=False)`), which `evaluate.predict` leaves out."""

    def __init__(self, dataset: CocoDetection, rank: int, world_size: int):
        super().__init__(dataset, range(rank, len(dataset), world_size))

    def __getitem__(self, index):
        return self.dataset.sample(self.indices[index], substitute=False, with_masks=False)

    def __getitems__(self, indices: list[int]) -> list:
        return [self[i] for i in indices]


def build_eval_loader(dataset: CocoDetection, cfg: Run, rank: int, world_size: int) -> DataLoader:
    """Each rank evaluates every world_size-th image: no padding, so no duplicated predictions; as many
    workers as training, started for each evaluation (the GPUs wait for decoding otherwise)."""
    shard = EvalShard(dataset, rank, world_size)
    return DataLoader(shard, batch_size=cfg.batch_size, sampler=SequentialSampler(shard),
                      **loader_kwargs(worker_count(cfg), cfg.pin_memory, False, cfg.prefetch_factor))


def dataset_paths(cfg: Config | Run, split: str) -> tuple[Path, Path]:
    """(image folder, json) for `split` from --train-json/--val-json or the --data-path layout."""
    ann = cfg.train_json if split == "train" else cfg.val_json
    images = cfg.train_images if split == "train" else cfg.val_images
    if ann is not None:
        return Path(images) if images else Path(ann).parent, Path(ann)
    return coco_paths(cfg.data_path, split)


def records_cache_dir() -> Path:
    """Where large datasets' cleaned records are kept: `$MASKRCNN_TUT_CACHE/coco-records`."""
    return default_cache_dir() / "coco-records"


def build_dataset(cfg: Config | Run, split: str) -> CocoDetection:
    """One split as training and evaluation read it: cleaned for a model resizing to
    --min-size/--max-size (`extreme_aspect`), large datasets through the records cache."""
    train = split == "train"
    return CocoDetection(*dataset_paths(cfg, split), transforms=train_transforms() if train else None,
                         train=train, min_size=cfg.min_size, max_size=cfg.max_size, cache_dir=records_cache_dir())


def build_datasets(cfg: Config | Run) -> tuple[CocoDetection, CocoDetection]:
    """(train, val) by `build_dataset`."""
    return build_dataset(cfg, "train"), build_dataset(cfg, "val")


def steps_per_epoch(loader: DataLoader, accum_steps: int) -> int:
    return max(len(loader.batch_sampler) // accum_steps, 1)


def _worker_message(err: DataError) -> str:
    """The one-line message of a `DataError` a DataLoader worker raised (the DataLoader re-raises
    it with the worker's traceback in the message)."""
    text = str(err)
    if not text.startswith("Caught DataError"):
        return text
    marker = "DataError: "
    last = text.rstrip().splitlines()[-1]
    return last.split(marker, 1)[1] if marker in last else last


def _out_of_shared_memory() -> OutOfSharedMemory:
    usage = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    space = f" ({usage.free / 2**20:.1f} of {usage.total / 2**20:.1f} MiB free)" if usage else ""
    rank = f"rank {torch.distributed.get_rank()}: " if torch.distributed.is_initialized() else ""
    return OutOfSharedMemory(f"{rank}DataLoader workers ran out of shared memory, /dev/shm{space}: use --workers 0, or "
                             "give the job a bigger /dev/shm (docker --shm-size, a Kubernetes emptyDir with medium: Memory)")


def _is_out_of_shared_memory(err: Exception) -> bool:
    """A full /dev/shm as the loader meets it: a worker's block that cannot be allocated (torch's
    RuntimeError), or a queue's lock (a POSIX semaphore in /dev/shm) that cannot be made, in this
    process (OSError ENOSPC) or re-raised from a worker (its message only)."""
    if isinstance(err, RuntimeError):
        return "shared memory" in str(err)
    return isinstance(err, OSError) and (err.errno == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(err))


def iterate(loader: DataLoader) -> Iterator:
    """The loader's batches, with the decode failures that samples carry (`LOAD_FAILED_KEY`)
    stripped from the targets and counted in the dataset's `report` here, in the main process (a
    worker's copy of the report is never read), and a worker's `DataError` or a full /dev/shm as one
    line. The workers start with the job's signals blocked and keep them so: their rank handles
    them (finishes the step, saves), and they end with it (torch's watchdog) or with their loader;
    torch's own handler would end a worker on SIGTERM and fail its rank mid-step. A loader of other
    samples (predict's image files, which say their own failures) gets the same workers and lines."""
    dataset = loader.dataset
    while isinstance(dataset, Subset):  # an evaluation shard: its dataset keeps the report
        dataset = dataset.dataset
    counted, decode_device = hasattr(dataset, "record_load_failures"), getattr(dataset, "decode_device", None)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_SIGNALS)  # inherited by the workers forked here
    try:
        batches = iter(loader)  # makes the workers' queues: their locks live in /dev/shm
    except OSError as err:
        if not _is_out_of_shared_memory(err):
            raise
        _disarm_half_made_iterator(err)
        raise _out_of_shared_memory() from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    try:
        for batch in batches:
            for target in batch[1] if counted else ():
                failures = target.pop(LOAD_FAILED_KEY, None)
                if failures:
                    dataset.record_load_failures(failures)
            if decode_device is not None:
                batch = decode_batch(*batch, dataset.transforms, decode_device, dataset.record_device_failure)
            yield batch
    except DataError as err:
        _end_workers(loader, batches)
        raise DataError(_worker_message(err)) from None
    except (RuntimeError, OSError) as err:
        _end_workers(loader, batches)
        if not _is_out_of_shared_memory(err):
            raise
        raise _out_of_shared_memory() from None


def _disarm_half_made_iterator(err: BaseException) -> None:
    """End the workers of a DataLoader iterator whose `__init__` failed (a queue's lock that /dev/shm had
    no room for), and mark it shut down: its `__del__` would otherwise print a traceback of its own
    (`AttributeError: ... no attribute '_shutdown'`) when the error's frames are collected."""
    tb = err.__traceback__
    while tb is not None:
        made = tb.tb_frame.f_locals.get("self")
        if isinstance(made, _MultiProcessingDataLoaderIter) and not hasattr(made, "_shutdown"):
            for worker in getattr(made, "_workers", []):
                worker.kill()
                worker.join()
            made._shutdown = True
        tb = tb.tb_next


def end_workers(loader: DataLoader) -> None:
    """End a loader's persistent workers now, not when a garbage collection finds the loader: for a
    caller that leaves a stream mid-epoch and goes on in the same process (a notebook's benchmark)."""
    _end_workers(loader, getattr(loader, "_iterator", None))


def _end_workers(loader: DataLoader, batches) -> None:
    """End a failed iterator's workers now. The error's traceback holds the iterator in a reference
    cycle (and the loader keeps persistent workers' iterator), so they would live on until a garbage
    collection: in a notebook, beside the next processes it starts. torch's own shutdown, as
    PyTorch Lightning calls it; absent with `workers=0`."""
    if hasattr(batches, "_shutdown_workers"):
        batches._shutdown_workers()
    if getattr(loader, "_iterator", None) is batches:
        loader._iterator = None


def batch_stream(loader: DataLoader, state) -> Iterator:
    """Batches through `iterate`, epoch after epoch, from the position of `state` (a `TrainState`:
    `epoch`, `batch_in_epoch`), which it keeps current."""
    while True:
        loader.batch_sampler.set_epoch(state.epoch, skip=state.batch_in_epoch)
        for batch in iterate(loader):
            state.batch_in_epoch += 1
            if batch[0]:  # empty only when every image failed to decode on the device (counted)
                yield batch
        state.epoch += 1
        state.batch_in_epoch = 0
