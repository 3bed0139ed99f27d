"""Cleaned COCO data stored the way Detectron2 stores it: pickled records in one flat byte buffer.

A list of a million small dicts costs ~1 KB of Python objects per instance, and every DataLoader
worker forked from the process slowly copies all of it: reading an object writes its reference
count, and the write copies the page. `Records` keeps each image's cleaned record pickled in one
numpy byte buffer with an offsets array: two objects, whatever the dataset size, which forked
workers share untouched. A record is unpickled when its image is loaded.

`cached_records` keeps the cleaned buffer of a large dataset (>= `CACHE_MIN_IMAGES` images) in a
file, keyed by the json and the image folder (path, size, modification times) and the cleaning
settings: the first process to need it cleans (opening every image file once) under a file lock,
and every other rank, and every later run, memory-maps the result instead of opening 118k files
again. The mapping is shared page cache: N ranks and their workers hold one copy.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import pickle
import struct
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..atomic import atomic_write

#: Part of the cache key: bump it whenever what a record holds or how it is cleaned changes.
CACHE_VERSION = 1
#: Smaller datasets clean in a second or two: not worth a file in the cache (COCO val2017, 5k images, is).
CACHE_MIN_IMAGES = 4_000
_MAGIC = b"MRCNREC1"
_ALIGN = 4096


class Records(Sequence):
    """Read-only sequence of pickled objects in one uint8 buffer; item i is bytes
    `offsets[index[i]]:offsets[index[i] + 1]` (`index` selects and orders records without copying)."""

    def __init__(self, buffer: np.ndarray, offsets: np.ndarray, index: np.ndarray | None = None,
                 source: tuple[str, int] | None = None):
        self.buffer, self.offsets = buffer, offsets
        self.index = np.arange(len(offsets) - 1, dtype=np.int64) if index is None else index
        self._source = source  # (file, buffer offset) when memory-mapped: pickled by reference

    @classmethod
    def from_bytes(cls, items: list[bytes]) -> "Records":
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in items], out=offsets[1:])
        buffer = np.frombuffer(b"".join(items), dtype=np.uint8) if items else np.zeros(0, np.uint8)
        return cls(buffer, offsets)

    def __len__(self) -> int:
        return len(self.index)

    def raw(self, i: int) -> memoryview:
        j = int(self.index[i])
        return memoryview(self.buffer)[int(self.offsets[j]):int(self.offsets[j + 1])]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return pickle.loads(self.raw(i))

    def subset(self, keep: np.ndarray) -> "Records":
        """The records at positions `keep` (indices or a boolean mask), sharing the buffer."""
        return Records(self.buffer, self.offsets, self.index[keep], self._source)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes + self.offsets.nbytes + self.index.nbytes)

    def __getstate__(self):
        state = dict(self.__dict__)
        if self._source is not None:  # a spawned worker maps the file again instead of a copy
            state["buffer"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.buffer is None:
            path, start = self._source
            self.buffer = _map(Path(path), start, int(self.offsets[-1]))


def _map(path: Path, start: int, size: int) -> np.ndarray:
    if size == 0:
        return np.zeros(0, np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(size,))


def write_records(path: Path, records: Records, header: dict) -> None:
    """`records` and a picklable `header` in one file, written whole (`atomic.atomic_write`; a cache,
    so without fsync: `read_records` refuses a file that is not complete)."""
    head = pickle.dumps({**header, "offsets": records.offsets, "index": records.index},
                        protocol=pickle.HIGHEST_PROTOCOL)
    start = -(-(len(_MAGIC) + 8 + len(head)) // _ALIGN) * _ALIGN

    def write(f) -> None:
        f.write(_MAGIC + struct.pack("<Q", len(head)) + head)
        f.write(b"\0" * (start - f.tell()))
        f.write(memoryview(records.buffer))

    atomic_write(path, write, durable=False)


def read_records(path: Path) -> tuple[Records, dict] | None:
    """(records memory-mapped from `path`, header), or None when the file is not a complete cache."""
    try:
        with open(path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                return None
            (length,) = struct.unpack("<Q", f.read(8))
            header = pickle.loads(f.read(length))
            size = os.fstat(f.fileno()).st_size
        start = -(-(len(_MAGIC) + 8 + length) // _ALIGN) * _ALIGN
        offsets = header.pop("offsets")
        if size != start + int(offsets[-1]) or header.get("version") != CACHE_VERSION:
            return None
        return Records(_map(path, start, int(offsets[-1])), offsets, header.pop("index"), (str(path), start)), header
    except (OSError, EOFError, pickle.UnpicklingError, struct.error, KeyError, ValueError):
        return None


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def cache_path(cache_dir: Path, ann_file: Path, image_dir: Path, settings: dict) -> Path:
    """The cache file of this json, image folder (a file added, removed or renamed in it changes
    its modification time) and cleaning settings."""
    key = [CACHE_VERSION, _stat_key(ann_file), _stat_key(image_dir), sorted(settings.items())]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    where = hashlib.sha256(repr([str(ann_file.resolve()), str(image_dir.resolve())]).encode()).hexdigest()[:8]
    return Path(cache_dir) / f"{ann_file.stem}-{where}-{digest}.records"


def cached_records(cache_dir: Path | None, ann_file: Path, image_dir: Path, settings: dict,
                   build: Callable[[], tuple[Records, dict]]) -> tuple[Records, dict]:
    """`build()`'s (records, header), through the cache file when `cache_dir` is set and the
    result has >= `CACHE_MIN_IMAGES` records. Processes that start together (the ranks of one
    machine) wait on a file lock while the first one builds, then map its file."""
    if cache_dir is None:
        return build()
    try:
        path = cache_path(Path(cache_dir), ann_file, image_dir, settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    except OSError:  # no folder or json to key it by, or a read-only cache: clean in place
        return build()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = read_records(path)
        if cached is not None:
            return cached
        records, header = build()
        _release_freed_memory()
        if len(records) < CACHE_MIN_IMAGES:
            return records, header
        try:
            write_records(path, records, {**header, "version": CACHE_VERSION})
        except OSError:  # a full or read-only disk: this run goes on without the cache
            return records, header
        _prune(path)
        cached = read_records(path)
        return cached if cached is not None else (records, header)


def _release_freed_memory() -> None:
    """Hand the heap the parsed json left free back to the system (glibc keeps it otherwise, and
    forked DataLoader workers would inherit it)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _prune(kept: Path) -> None:
    """Remove earlier caches of the same json and folder (an older version of either)."""
    for old in kept.parent.glob(kept.name.rsplit("-", 1)[0] + "-*.records"):
        if old != kept and old.stat().st_mtime < kept.stat().st_mtime:
            old.unlink(missing_ok=True)
            old.with_name(old.name + ".lock").unlink(missing_ok=True)
