"""Segmentations as COCO writes them (polygons, compressed or uncompressed RLE), checked before
pycocotools reads them: its C code trusts its input, and a polygon with a point at 1e12 overflows
its integers (a segfault), one far outside the image allocates gigabytes, a bad RLE string overruns
its buffer. Everything unusable is counted in the report's `PROBLEMS` kinds
(`maskrcnn_tut.data.clean`), never handed to pycocotools.
"""
from __future__ import annotations

import math

from pycocotools import mask as mask_utils

#: How far outside the image a polygon point may lie, in image sizes (annotators' tools clip to
#: the image; a point beyond this is not an outline of something in the picture).
POLYGON_MARGIN = 1.0
#: The longest outline, in image perimeters (measured as pycocotools walks it, in Chebyshev
#: steps): its rasterizer allocates ~100 bytes per step, so this bounds one polygon to ~50 MB at
#: 640x480 whatever its point count. A real outline is rarely over a few perimeters.
POLYGON_MAX_PERIMETERS = 100
_NUMBERS = {int, float}


def polygon_problem(polygon, width: int, height: int) -> str | None:
    """None for a polygon pycocotools can rasterize safely and cheaply, else the problem kind."""
    if not isinstance(polygon, list) or len(polygon) < 6 or len(polygon) % 2:
        return "bad_polygon"
    if not set(map(type, polygon)) <= _NUMBERS:  # no bools, strings, lists, None
        return "bad_polygon"
    try:
        if not all(map(math.isfinite, polygon)):  # NaN, inf
            return "bad_polygon"
    except OverflowError:  # an int too large for a float
        return "absurd_polygon"
    xs, ys = polygon[0::2], polygon[1::2]
    margin_x, margin_y = POLYGON_MARGIN * width, POLYGON_MARGIN * height
    if (min(xs) < -margin_x or max(xs) > width + margin_x
            or min(ys) < -margin_y or max(ys) > height + margin_y):
        return "absurd_polygon"
    limit = POLYGON_MAX_PERIMETERS * 2 * (width + height)
    if len(xs) * (1 + 2 * POLYGON_MARGIN) * max(width, height) > limit:  # long enough to measure
        steps = sum(max(abs(xs[k] - xs[k - 1]), abs(ys[k] - ys[k - 1])) for k in range(len(xs)))
        if steps > limit:
            return "absurd_polygon"
    return None


def _compressed_rle_runs(counts: str) -> list[int]:
    """Run lengths of COCO's compressed RLE string (pycocotools' rleFrString, in Python so a bad
    string is caught here rather than overrunning the decoder's buffer)."""
    runs: list[int] = []
    position = 0
    while position < len(counts):
        value, shift, more = 0, 0, True
        while more:
            if position >= len(counts):
                raise ValueError("RLE string ends inside a number")
            char = ord(counts[position]) - 48
            if not 0 <= char < 64:
                raise ValueError(f"RLE string has an invalid character {counts[position]!r}")
            value |= (char & 0x1F) << shift
            more = bool(char & 0x20)
            position += 1
            shift += 5
            if not more and char & 0x10:
                value |= -1 << shift
        if len(runs) > 2:
            value += runs[-2]
        runs.append(value)
    return runs


def _rle_counts(seg: dict, width: int, height: int) -> bytes | None:
    """The compressed counts of an RLE dict whose size and run lengths fit the image, else None."""
    counts, size = seg.get("counts"), seg.get("size")
    if not isinstance(size, list) or size != [height, width]:
        return None
    if isinstance(counts, list):  # uncompressed RLE, as COCO writes crowd regions
        if not all(type(c) is int and c >= 0 for c in counts) or sum(counts) != width * height:
            return None
        return mask_utils.frPyObjects({"size": [height, width], "counts": counts}, height, width)["counts"]
    if isinstance(counts, bytes):
        counts = counts.decode("ascii", errors="replace")
    if not isinstance(counts, str):
        return None
    try:
        runs = _compressed_rle_runs(counts)
    except ValueError:
        return None
    if min(runs, default=0) < 0 or sum(runs) != width * height:
        return None
    return counts.encode("ascii")


def segmentation_rle(seg, width: int, height: int, report, ann_id) -> tuple[bytes, int] | None:
    """(compressed RLE counts, mask area) of any valid COCO encoding, or None (counted in
    `report`) when nothing usable remains."""
    if isinstance(seg, list) and seg:
        problems = [polygon_problem(p, width, height) for p in seg]
        for kind in dict.fromkeys(k for k in problems if k):
            report.add(kind, ann_id)
        polygons = [p for p, problem in zip(seg, problems) if problem is None]
        if not polygons:
            return None
        rles = mask_utils.frPyObjects(polygons, height, width)
        rle = rles[0] if len(rles) == 1 else mask_utils.merge(rles)
    elif isinstance(seg, dict) and "counts" in seg:
        counts = _rle_counts(seg, width, height)
        if counts is None:
            report.add("bad_rle", ann_id)
            return None
        rle = {"size": [height, width], "counts": counts}
    else:
        report.add("missing_segmentation", ann_id)
        return None
    return rle["counts"], int(mask_utils.area(rle))
