"""A COCO annotations json read a piece at a time, so that the process cleaning it never holds it whole.

`json.load` of COCO train2017's 450 MB file holds the text and then ~3 GB of Python objects (a float
of a polygon costs 32 bytes against its 6 characters). `read_coco` walks the top-level object itself
and hands each element of `images` and `annotations` to Python's own parser
(`json.JSONDecoder.raw_decode`, the C scanner `json.load` uses: every value reads exactly as it did),
one at a time, from a few MB of decoded text. An image is kept as a small tuple, an annotation as its
image id and where it lies in the file (a byte span): the process that cleans its image parses it
again from there (`Annotations.of_image`). The other keys (`categories`, `info`, ...) are read whole.

What cleaning needs of the whole file, and only that, is decided once every element is seen
(`CocoIndex.build`): repeated image ids, repeated annotation ids, annotations of unknown images, with
the same counts and examples in the same order as when the file was parsed whole. A file the stream
cannot read (not JSON, not an object at the top) is read whole once more by `load_coco_json`, for the
same error message as before, with its line and column.
"""
from __future__ import annotations

import codecs
import json
import os
import re
from array import array
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from .clean import DataReport, check_coco, is_id, load_coco_json, refuse_special_file

#: Bytes read from the file at a time (the text decoded from them is all the stream holds).
CHUNK = 4 << 20
_SPACE = re.compile(r"[ \t\n\r]*")
#: A value followed by one of these may not be whole yet: "12." or "1e-" may go on in the next chunk.
_NUMBER_GOES_ON = set("0123456789.eE+-")
_DECODER = json.JSONDecoder()


class _Invalid(Exception):
    """Not JSON the stream reads: the file is read whole, for `json`'s own message."""


class _Text:
    """A file's text, decoded a chunk at a time: `text[pos]` is the next character, at byte `offset` of the file."""

    def __init__(self, f, chunk: int):
        self.f, self.chunk, self.decoder = f, chunk, codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos, self.offset, self.eof = "", 0, 0, False

    def _more(self, size: int) -> None:
        data = self.f.read(size)
        self.eof = not data
        self.text = self.text[self.pos:] + self.decoder.decode(data, final=self.eof)
        self.pos = 0

    def _move(self, end: int) -> None:
        ascii_only = self.text.isascii()  # O(1): then characters are bytes
        self.offset += end - self.pos if ascii_only else len(self.text[self.pos:end].encode())
        self.pos = end

    def peek(self) -> str:
        """The next character that is not white space, not consumed ('' at the end of the file)."""
        while True:
            self._move(_SPACE.match(self.text, self.pos).end())
            if self.pos < len(self.text) or self.eof:
                return self.text[self.pos:self.pos + 1]
            self._more(self.chunk)

    def take(self, allowed: str) -> str:
        char = self.peek()
        if not char or char not in allowed:
            raise _Invalid
        self._move(self.pos + 1)
        return char

    def value(self) -> tuple[object, int, int]:
        """(the next value, the file bytes it spans), read on until it is whole."""
        self.peek()
        size = self.chunk
        while True:
            try:
                found, end = _DECODER.raw_decode(self.text, self.pos)
                if self.eof or (end < len(self.text) and self.text[end] not in _NUMBER_GOES_ON):
                    break
            except json.JSONDecodeError:
                if self.eof:
                    raise _Invalid from None
            self._more(size)
            size *= 2  # a value over many chunks is read in as many doublings, not parsed once per chunk
        start = self.offset
        self._move(end)
        return found, start, self.offset


class _Images:
    """The elements of `images`: (id, file_name, json width, json height) of each well-formed entry."""

    def __init__(self):
        self.entries, self.malformed, self.count = [], [], 0

    def add(self, index: int, img, start: int = 0, end: int = 0) -> None:
        self.count += 1
        if not isinstance(img, dict) or not is_id(img.get("id")) or not isinstance(img.get("file_name"), str):
            self.malformed.append(index)
            return
        self.entries.append((img["id"], img["file_name"], img.get("width"), img.get("height")))

    def __len__(self) -> int:
        return self.count


class Annotations:
    """The elements of `annotations`, kept as their image ids and byte spans in `path` (or, `path`
    None, as the parsed objects); exact repeats of an id are dropped as they come, as before."""

    def __init__(self, path: Path | None, stat: tuple[int, int] | None = None):
        self.path, self.count, self.malformed, self.repeated_ids = path, 0, [], []
        self.image_ids, self.ids, self.objects = [], [], []
        self.starts, self.ends = array("q"), array("q")  # 8 bytes a span end, not an int object
        self._first: dict = {}  # annotation id -> its first annotation's index
        self._stat = stat  # (size, modification time) of the file as it was read
        self._file: tuple[int, int] | None = None  # (pid, fd) that reads the spans

    def add(self, index: int, ann, start: int = 0, end: int = 0) -> None:
        self.count += 1
        if not isinstance(ann, dict) or not is_id(ann.get("image_id")):
            self.malformed.append(index)
            return
        ann_id = ann.get("id")
        if is_id(ann_id):
            if ann_id in self._first:
                self.repeated_ids.append(ann_id)
                if ann == self.get(self._first[ann_id]):
                    return
            else:
                self._first[ann_id] = len(self.image_ids)
        self.image_ids.append(ann["image_id"])
        self.ids.append(ann_id)
        if self.path is None:
            self.objects.append(ann)
        else:
            self.starts.append(start)
            self.ends.append(end)

    def __len__(self) -> int:
        return self.count

    def group(self, owner: np.ndarray, images: int) -> None:
        """Keep annotation k for image `owner[k]` (-1: none), in file order; drop what only reading needed."""
        self.order = np.argsort(owner, kind="stable")
        self.bounds = np.searchsorted(owner[self.order], np.arange(images + 1))
        self.starts, self.ends = np.frombuffer(self.starts, np.int64), np.frombuffer(self.ends, np.int64)
        self.image_ids, self.ids, self._first = [], [], {}
        self.close()  # whoever cleans opens the file again, and finds it as it was read

    def _read(self, start: int, end: int) -> bytes:
        if self._file is None or self._file[0] != os.getpid():  # a forked cleaner opens its own
            fd = os.open(self.path, os.O_RDONLY)
            if _stat(fd) != self._stat:
                os.close(fd)
                raise DataError(f"{self.path}: changed while it was being read; start again")
            self._file = (os.getpid(), fd)
        return os.pread(self._file[1], end - start, start)

    def close(self) -> None:
        if self._file is not None and self._file[0] == os.getpid():
            os.close(self._file[1])
        self._file = None

    def get(self, k: int) -> dict:
        return self.objects[k] if self.path is None else json.loads(self._read(self.starts[k], self.ends[k]))

    def of_image(self, position: int) -> list[dict]:
        """The annotations of unique image `position`, parsed, in file order (read in one piece
        when they lie together, as exporters write them)."""
        ks = self.order[self.bounds[position]:self.bounds[position + 1]]
        if self.path is None or not len(ks):
            return [self.get(k) for k in ks]
        starts, ends = self.starts[ks], self.ends[ks]
        low, high = int(starts.min()), int(ends.max())
        if high - low > 2 * int((ends - starts).sum()) + 65536:
            return [self.get(k) for k in ks]
        block = self._read(low, high)
        return [json.loads(block[s - low:e - low]) for s, e in zip(starts.tolist(), ends.tolist())]


def _stat(file) -> tuple[int, int]:
    st = os.stat(file)
    return st.st_size, st.st_mtime_ns


def _walk(text: _Text, path: Path, stat: tuple[int, int]) -> dict:
    """The top-level object; `images` and `annotations`, when lists, as `_Images` and `Annotations`
    fed element by element (a key given twice keeps its last value, as `json.load` does)."""
    sinks = {"images": _Images, "annotations": lambda: Annotations(path, stat)}
    top: dict = {}
    text.take("{")
    if text.peek() == "}":
        text.take("}")
    else:
        while True:
            key = text.value()[0]
            if not isinstance(key, str):
                raise _Invalid
            text.take(":")
            if key in sinks and text.peek() == "[":
                text.take("[")
                sink = top[key] = sinks[key]()
                if text.peek() == "]":
                    text.take("]")
                else:
                    index = 0
                    while True:
                        sink.add(index, *text.value())
                        index += 1
                        if text.take(",]") == "]":
                            break
            else:
                top[key] = text.value()[0]
            if text.take(",}") == "}":
                break
    if text.peek():
        raise _Invalid  # more after the object: the whole read says where
    return top


@dataclass
class CocoIndex:
    """What cleaning needs of a COCO json: its categories, the unique images (id, file_name, json
    width, json height), their annotations (`annotations.of_image(position)`) and the entry problems."""

    categories: list
    images: list[tuple]
    annotations: Annotations
    report: DataReport

    @classmethod
    def build(cls, data: dict, path: Path | None = None) -> "CocoIndex":
        """From `check_coco`'s dict, its lists streamed (`_walk`) or parsed whole (`load_coco_json`)."""
        images, annotations = data["images"], data["annotations"]
        if isinstance(images, list):
            images = _Images()
            for index, img in enumerate(data["images"]):
                images.add(index, img)
        if isinstance(annotations, list):
            annotations = Annotations(None)
            for index, ann in enumerate(data["annotations"]):
                annotations.add(index, ann)
        report = DataReport()
        for index in images.malformed:
            report.add("malformed_entry", f"images[{index}]")
        by_id = defaultdict(list)
        for entry in images.entries:
            by_id[entry[0]].append(entry)
        unique = {}
        for image_id, same_id in by_id.items():
            if len(same_id) > 1:
                report.add("duplicate_image_id", image_id)
                if len({entry[1] for entry in same_id}) > 1:
                    continue  # an id shared by different files: nothing says which its annotations are of
            unique[image_id] = same_id[0]
        for index in annotations.malformed:
            report.add("malformed_entry", f"annotations[{index}]")
        for ann_id in annotations.repeated_ids:
            report.add("duplicate_annotation_id", ann_id)
        position = {image_id: p for p, image_id in enumerate(unique)}
        owner = np.full(len(annotations.image_ids), -1, dtype=np.int64)
        for k, image_id in enumerate(annotations.image_ids):
            if image_id not in by_id:
                report.add("unknown_image", annotations.ids[k])
            else:
                owner[k] = position.get(image_id, -1)
        annotations.group(owner, len(unique))
        return cls(data["categories"], list(unique.values()), annotations, report)


def read_coco(path: Path | str, chunk: int = CHUNK) -> CocoIndex:
    """`CocoIndex` of a COCO json, read a chunk at a time; checked as `load_coco_json` checks it."""
    path = Path(path)
    refuse_special_file(path)
    try:
        with open(path, "rb") as f:
            data = _walk(_Text(f, chunk), path, _stat(f.fileno()))
    except (_Invalid, ValueError, OSError, RecursionError):  # ValueError: bad UTF-8 or JSON, an int of 4300+ digits
        return CocoIndex.build(load_coco_json(path))
    return CocoIndex.build(check_coco(path, data, (list, _Images, Annotations)), path)
