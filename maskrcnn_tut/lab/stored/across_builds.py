"""Results kept across builds: measure each benchmark once, keep it, and keep its spread.

    speed = across_builds.cached(bench.table, steps=16, warmup=3)

The first call runs the benchmark and writes its `BenchResult` to
`$MASKRCNN_TUT_CACHE/bench/<name>-<key>.json` (`cache_dir()`); every later call with the same key
(chapter 8 after chapter 4, a rebuild of the book, the same call from a shell) reads that file back,
so two chapters can never quote two different measurements of one figure. The key is:

- the hardware, as `provenance.provenance` names it (label, CPU model, GPUs) and the torch version;
- the code that measures: a hash of the sources that decide the measurement (`CODE_SOURCES`: the
  bench harness, `engine.py`, `model.py`, `config.py`, the process launcher, the data loader) and of
  the cached function's own module (`code_hash()`), so an edit there measures again;
- the function and its arguments with the defaults filled in (`cached(table)` and
  `cached(table, steps=16)` are one key).

Each measured row carries its spread from the measurement itself (`timing_row`, which
`harness.Measurement.row` uses): the step times (`"step s"`) and their interquartile range as
img/s (`"img/s lo"`, `"img/s hi"`: `img_per_s_quartiles`). A cached result's rows with a
speedup also get the speedup's range against the first row (`"speedup lo"`, `"speedup hi"`:
this row's low over the baseline's high, and its high over the baseline's low). `interval(row)`,
`versus(a, b)` and `spread_text(row)` read them, so prose can say "within noise" when two
intervals overlap. The share of the machine's cores that *other*
processes kept busy meanwhile is kept too (`provenance["cache"]["other load"]`; `machine_busy`):
on a shared machine rows measured one after another meet different loads, which no row's own
spread shows.

Concurrent callers (two chapters built at once) wait on a lock file and the second reads what the
first measured. `refresh=True` (or `MASKRCNN_TUT_BENCH_REFRESH=1`) measures again and overwrites.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import inspect
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

from ...atomic import atomic_write
from ...data.shapes import default_cache_dir
from ...monitor import img_per_s_median
from ..provenance import provenance
from ..wording import MESSAGES, interval, language, say
from .result import BenchResult, add_spread

#: Bump when the cached file's layout changes: older files are then measured again.
CACHE_VERSION = 1
#: The sources that decide what a benchmark measures (paths relative to `maskrcnn_tut/`): the
#: harness, the training step, the model, the config, the processes and the batches. The cached
#: function's own module is hashed too. Other modules (plots, other sweeps) can change freely.
CODE_SOURCES = ("lab/bench/harness.py", "lab/stored/result.py", "lab/stored/across_builds.py", "engine.py",
                "model.py", "config.py", "distributed.py", "rendezvous.py", "lab/dataparallel.py", "data/loader.py",
                "data/coco.py", "data/shapes.py")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """`$MASKRCNN_TUT_CACHE/bench` (default `~/.cache/maskrcnn_tut/bench`)."""
    return default_cache_dir() / "bench"


def code_hash(sources: tuple[str, ...] = CODE_SOURCES, root: Path = PACKAGE_ROOT) -> str:
    """A short sha256 of the measuring code: every `.py` file under `sources`, by path and content."""
    digest = hashlib.sha256()
    for source in sources:
        path = root / source
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            if file.exists() and "__pycache__" not in file.parts:
                digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def call_arguments(fn: Callable, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, defaults filled in (extra `**overrides` by their own names)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = {}
    for name, value in bound.arguments.items():
        parameter = bound.signature.parameters[name]
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            arguments[name] = list(value)
        else:
            arguments[name] = value
    return {name: arguments[name] for name in sorted(arguments)}


def cache_key(fn: Callable, args: tuple = (), kwargs: dict | None = None) -> dict:
    """What a cached result depends on: hardware, torch, the measuring code, function, arguments."""
    prov = provenance("")
    own = Path(inspect.getsourcefile(fn) or "").resolve()
    sources = CODE_SOURCES + ((str(own.relative_to(PACKAGE_ROOT)),) if own.is_relative_to(PACKAGE_ROOT) else ())
    return {"version": CACHE_VERSION, "hardware": prov["hardware"], "cpu": prov["cpu"], "gpus": prov["gpus"],
            "cpu_bf16": prov["cpu_bf16"], "torch": prov["torch"], "code": code_hash(sources),
            "function": f"{fn.__module__}.{fn.__qualname__}",
            "arguments": {k: repr(v) for k, v in call_arguments(fn, args, kwargs or {}).items()}}


def cache_file(key: dict, directory: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = key["function"].rsplit(".", 1)[-1]
    return Path(directory or cache_dir()) / f"{name}-{digest}.json"


# --------------------------------------------------------------------------- the spread


def timing_row(times: list[float], images_per_step: float = 1.0) -> dict:
    """img/s (`monitor.img_per_s_median`) with its spread from raw step times, for `versus` /
    `spread_text` (e.g. two runs of the same images per step: the faster has the higher img/s)."""
    low, high = img_per_s_quartiles(images_per_step, list(times))
    return {"img/s": img_per_s_median(images_per_step, list(times)), "img/s lo": low, "img/s hi": high,
            "step s": [round(t, 5) for t in times], "images/step": images_per_step}


def spread_text(row: dict, key: str = "speedup", fmt: str = ".2f", unit: str = "x") -> str:
    """'1.85x (IQR 1.71-1.98x)', the value with the interquartile range of its steps (in the book's
    language), or just the value without a spread."""
    span = interval(row, key)
    unit = MESSAGES[language()]["x"] if unit == "x" else unit  # 倍 in Japanese
    value = format(row[key], fmt) + unit
    return value if span is None else say("bench.spread", value=value, low=format(span[0], fmt),
                                          high=format(span[1], fmt) + unit)


# --------------------------------------------------------------------------- other work on the machine

#: Other processes using more than this share of all cores while a figure is measured make its
#: rows (measured one after another) incomparable: `machine_busy` says so.
BUSY_SHARE = 0.2


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its waited-for
    children) so far; None without Linux's /proc/stat."""
    import resource
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return (sum(fields[:8]) - idle) / ticks, own


def other_load(before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float) -> float | None:
    """The share of all cores that processes other than this one (and its children) kept busy."""
    if before is None or after is None or wall_s <= 0:
        return None
    foreign = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, foreign / (wall_s * (os.cpu_count() or 1)))


def machine_busy(result: BenchResult) -> str:
    """A sentence when other work kept this machine busy while `result` was measured, else ""."""
    share = result.provenance.get("cache", {}).get("other load")
    if share is None or share <= BUSY_SHARE:
        return ""
    return say("bench.machine_busy", share=share)


# --------------------------------------------------------------------------- the cache


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(path: Path, key: dict) -> BenchResult | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    return BenchResult.from_dict(data["result"])


def cached(fn: Callable[..., BenchResult], *args, refresh: bool = False, directory: Path | str | None = None,
           **kwargs) -> BenchResult:
    """`fn(*args, **kwargs)` measured once per hardware, code and arguments, then read from the cache
    (module docstring). The result's `provenance["cache"]` says whether it was measured now or read,
    from which file, and when it was measured."""
    key = cache_key(fn, args, kwargs)
    path = cache_file(key, Path(directory) if directory else None)
    refresh = refresh or os.environ.get("MASKRCNN_TUT_BENCH_REFRESH", "") not in ("", "0")
    with _locked(path):
        result = None if refresh else _load(path, key)
        if result is not None:
            result.provenance["cache"] = {**result.provenance.get("cache", {}), "hit": True, "file": str(path)}
            return result
        started, before = time.monotonic(), _cpu_seconds()
        result = fn(*args, **kwargs)
        load = other_load(before, _cpu_seconds(), time.monotonic() - started)
        spread = add_spread(result)
        measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        result.provenance["cache"] = {"hit": False, "file": str(path), "measured": measured, "spread": spread,
                                      "code": key["code"], "other load": None if load is None else round(load, 3)}
        text = json.dumps({"key": key, "result": result.to_dict()}, indent=1) + "\n"
        atomic_write(path, lambda f: f.write(text), mode="w", durable=False)
        return result


def describe_cache(result: BenchResult) -> str:
    """One line saying where a cached figure came from: measured now, or read from which file."""
    info = result.provenance.get("cache")
    if not info:
        return say("bench.not_cached")
    when = info.get("measured", "")[:16].replace("T", " ")
    return say("bench.cache_hit" if info.get("hit") else "bench.cache_new", when=when, file=info["file"])


def img_per_s_quartiles(images_per_step: float, step_times: Sequence[float]) -> tuple[float, float]:
    """(low, high): images per step over the 75th and over the 25th percentile step time, the
    spread of the middle half of the steps around `img_per_s_median`."""
    if len(step_times) < 2:
        return (img_per_s_median(images_per_step, step_times),) * 2
    q1, _, q3 = statistics.quantiles(step_times, n=4, method="inclusive")
    return images_per_step / q3, images_per_step / q1
