"""What a committed GPU results file (`book/results/*.json`, written by `gpu_suite`) can tell, in words:
chapters 5 (its AMP part), 6 (its cudnn part) and 8 (all of it) show the files through `show_gpu_results`.

The suite measures each setting over a short window of steps after a few warm-up steps. In the first
epochs of the shapes data, batches keep meeting padded input shapes not seen before, and cuDNN builds its
convolution plans once for every new shape before it runs them (the first-shape cost). A window of such
steps mixes steady steps with first-shape steps, in proportions that differ from row to row, so its
medians and ranges rank nothing. A file ranks its settings only when its rows say which steps met a new
shape and what the others ran at (`gpu_file_is_steady`); their verdicts come from `bench.steady` and are
worded by `steady_sentences`, the one place a chapter's GPU-file verdicts come from.

- `read(folder)`: the files, each a `GpuFile`; `label(result)`: what kind of figures a file or part holds.
- `gpu_file_is_steady(result)`: whether a part (or every part of a file) leaves its new-shape steps out.
- `told(part)`: what a part's rows measured, with their spread; `file_sentences(found)`: what the file
  cannot show; `failure(part, error)`: a part that did not finish.
- `show_gpu_results(folder, parts)`: the files as the chapters show them; `brief(folder, part)`: one
  sentence per file for a chapter's "What to remember".
- `steady_sentences(result)`: the hook for a steady file's verdicts (none yet).
- `CHAPTER5_H200`, `chapter5_h200()`: chapter 5's own precision sweep on the same H200, the same day (kept in
  docs/measurements.md, not in a results file), and what it measured (chapter 5 words it).
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..stored.across_builds import spread_text
from ..stored.result import BenchResult, add_spread, load_suite, row_label
from ..wording import Said, say, shown, times

#: The row keys of a file whose rows leave their new-shape steps out (written by `bench.steady`).
STEADY_KEYS = ("new-shape steps", "img/s steady")
#: A step slower than this many times its row's median step counts as a slow step.
SLOW_FACTOR = 2.0
#: A row whose slow steps take more than this share of its measured time is dominated by them.
DOMINATED_SHARE = 0.5
#: What a part's rows are about, for a sentence saying the file has no verdict on it (literal keys).
TOPICS = {"amp": "gpu_files.topic_amp", "cudnn": "gpu_files.topic_cudnn"}
#: The stored notes that compare a part's settings (`sweeps.knob_note`; files written before it read the rows'
#: ranges ranked by medians alone): left out, since a file's verdicts come from `steady_sentences` only.
RANKING_NOTES = ("bench.knob_moved", "bench.knob_flat", "bench.knob_fewer", "bench.knob_overlap",
                 "bench.knob_no_spread")

#: Chapter 5's own precision sweep (`sweep_amp(steps=8, warmup=2)`) run on the H200 of the committed file, the
#: same day (docs/measurements.md, "Run 2"; in no results file). `first_shapes`: the batches at which each of the
#: bench set's padded shapes first appears (seed 0, batch 2; the replay in docs/measurements.md); `new_shape_s`:
#: what a step that met one cost more than a repeated one on that H200 (presets.py), by precision.
CHAPTER5_H200 = {
    "date": "2026-12-04", "hardware": "1x NVIDIA H200", "torch": "2.11.0+cu130", "steps": 8, "warmup": 2,
    "rows": [{"setting": "fp32 (no autocast)", "img/s": 9.16, "img/s lo": 7.57, "img/s hi": 11.2},
             {"setting": "fp16 autocast + GradScaler", "img/s": 2.50, "img/s lo": 2.28, "img/s hi": 2.71},
             {"setting": "bf16 autocast", "img/s": 2.21, "img/s lo": 1.97, "img/s hi": 3.14}],
    "first_shapes": (1, 2, 3, 4, 5, 8, 9, 14, 16, 19, 22, 26, 31, 32, 46, 53),
    "new_shape_s": {"fp32": "0.2", "fp16, bf16": "0.65-0.83"},
    "source": "docs/measurements.md",
}


def chapter5_h200() -> dict:
    """What chapter 5's own sweep on the H200 measured (`CHAPTER5_H200`): each row with its spread, and how
    many of each setting's measured batches (those after its warm-up) met a padded shape not seen before."""
    run = CHAPTER5_H200
    measured = range(run["warmup"] + 1, run["warmup"] + run["steps"] + 1)
    return {**run, "new": sum(batch in run["first_shapes"] for batch in measured),
            "rates": [(row["setting"], spread_text(row, "img/s", ".3g", " img/s")) for row in run["rows"]]}


@dataclass
class GpuFile:
    """One committed GPU suite file: its name, provenance, the parts that ran and those that failed."""

    name: str
    provenance: dict
    parts: dict[str, BenchResult]
    failed: dict[str, str]


def read(folder: Path | str) -> list[GpuFile]:
    """Every GPU suite file in `folder`, by name."""
    return [GpuFile(path.name, *load_suite(path)) for path in sorted(Path(folder).glob("*.json"))]


def _measured(result: BenchResult) -> list[dict]:
    """The rows that measured something: a median over all steps ("img/s") or over the steady ones
    (`bench.steady`'s "img/s steady")."""
    return [row for row in result.rows if row.get("img/s") is not None or row.get("img/s steady") is not None]


def _parts(result: BenchResult | GpuFile) -> list[BenchResult]:
    return list(result.parts.values()) if isinstance(result, GpuFile) else [result]


def gpu_file_is_steady(result: BenchResult | GpuFile) -> bool:
    """True only when the rows say they leave out the steps that met a new shape: every measured row (of
    the part, or of every part of the file) has the keys "new-shape steps" and "img/s steady". Nothing
    ranks the settings of a file or part that is not."""
    rows = [row for part in _parts(result) for row in _measured(part)]
    return bool(rows) and all(key in row for row in rows for key in STEADY_KEYS)


def _seconds(value: float | None) -> str:
    return say("gpu_files.seconds", seconds=value) if value is not None else say("gpu_files.unknown")


def steady_sentences(result: BenchResult | GpuFile) -> list[str]:
    """A steady file's (or part's) rows and verdicts, worded: each row's steady speed with its spread,
    the new-shape steps left out and their cost; each verdict `bench.steady` gave against its base, with
    the interval and rounds that decided it; and the rule, once."""
    from ..wording import words
    from .steady import NO_BAND
    sentences = []
    for part in _parts(result):
        for row in _measured(part):
            rate = spread_text({**row, "img/s": row["img/s steady"]}, "img/s", ".3g", " img/s") \
                if row.get("img/s steady") is not None else say("gpu_files.unknown")
            sentences.append("- " + say("gpu_files.steady_row", setting=shown(row_label(row)), rate=rate,
                                        steady=row["steady steps"], new=row["new-shape steps"],
                                        first=_seconds(row.get("first-shape s")), start=_seconds(row.get("first step s"))))
            if row.get("verdict") and row.get("ratio") is not None:
                sentences.append("- " + say("gpu_files.steady_verdict", setting=shown(row_label(row)),
                                            base=shown(row["vs"]), ratio=times(row["ratio"]), lo=row["ratio lo"],
                                            hi=row["ratio hi"], rounds=", ".join(f"{r:.2f}" for r in row["round ratios"]),
                                            words=words(row["verdict"], shown(row["vs"]))))
    return sentences + ([say("gpu_files.steady_rule", band=100 * NO_BAND)] if sentences else [])


def slow_steps(row: dict) -> tuple[int, float] | None:
    """(how many of the row's measured steps took over `SLOW_FACTOR` times its median step, their share of
    the row's measured time), or None when the row kept no step times."""
    times = row.get("step s")
    if not times:
        return None
    median = statistics.median(times)
    slow = [time for time in times if time > SLOW_FACTOR * median]
    return len(slow), sum(slow) / sum(times)


def dominated(result: BenchResult | GpuFile) -> bool:
    """Whether some measured row spent more than `DOMINATED_SHARE` of its measured time in slow steps."""
    found = [slow_steps(row) for part in _parts(result) for row in _measured(part)]
    return any(slow and slow[1] > DOMINATED_SHARE for slow in found)


def label(result: BenchResult | GpuFile) -> str:
    """What kind of figures a file (or part) holds, in the book's language: steady state, dominated by
    first-shape steps, or new-shape steps not separated."""
    if gpu_file_is_steady(result):
        return say("gpu_files.label_steady")
    return say("gpu_files.label_first_shape") if dominated(result) else say("gpu_files.label_unseparated")


def warmup_steps(result: BenchResult) -> int | None:
    """The warm-up steps before each setting's measured ones, read from the part's recorded command."""
    found = re.search(r"\bwarmup=(\d+)", str(result.provenance.get("command", "")))
    return int(found.group(1)) if found else None


def topic(part: str) -> str:
    """What a part's rows are about ("the precisions"), for sentences that say the file has no verdict on it."""
    key = TOPICS.get(part)
    return say(key) if key else say("gpu_files.topic_other", part=part)


def told(part: BenchResult, explain: bool = True) -> list[str]:
    """What a part's measured rows are, in paragraphs: a steady part's verdicts (`steady_sentences`);
    otherwise the window each row measured (its steps after the warm-up, the median with its spread, its
    slow steps and their share of the time) and, with `explain`, what those slow steps are."""
    if gpu_file_is_steady(part):
        return steady_sentences(part)
    rows = _measured(part)
    if not rows:
        return []
    warmup = warmup_steps(part)
    lines = []
    for row in rows:
        slow = slow_steps(row)
        values = {"setting": shown(row_label(row)), "steps": row.get("steps", len(row.get("step s") or [])),
                  "rate": spread_text(row, "img/s", ".3g", " img/s")}
        lines.append("- " + (say("gpu_files.row_slow", **values, slow=slow[0], factor=SLOW_FACTOR, share=100 * slow[1])
                             if slow and slow[0] else say("gpu_files.row", **values)))
    opening = (say("gpu_files.windows", warmup=warmup) if warmup is not None else say("gpu_files.windows_after_warmup"))
    reading = say("gpu_files.first_shape") if dominated(part) else say("gpu_files.unseparated")
    return [opening + "\n\n" + "\n".join(lines)] + ([reading] if explain else [])


def file_sentences(found: GpuFile) -> list[str]:
    """What a file that is not steady cannot show: a steady-state speed, a verdict between its rows, and
    the parts that never finished."""
    if gpu_file_is_steady(found):
        return []
    if found.failed:
        return [say("gpu_files.cannot_show_unfinished", parts=", ".join(found.failed))]
    return [say("gpu_files.cannot_show")]


def _relative(text: str) -> str:
    """Absolute paths of the machine that measured cut to the package's own (`maskrcnn_tut/...`)."""
    return re.sub(r"/\S*?/(maskrcnn_tut/)", r"\1", text)


def failure(part: str, error: str) -> str:
    """A part that did not finish, in words: one the launcher stopped at its time limit says so, where it
    was, and that the file has no row about it; any other error is quoted (without the machine's paths)."""
    timed_out = re.search(r"launch timed out after ([\d.]+) s", error)
    where = re.search(r" at (\S+), line (\d+) in (\w+)", error)
    if timed_out and where:
        return say("gpu_files.timed_out", part=part, seconds=timed_out.group(1), function=where.group(3),
                   path=_relative(where.group(1)), line=where.group(2), topic=topic(part))
    return say("bench.gpu_results_failed", part=part, error=_relative(error))


def _told_notes(part: BenchResult) -> None:
    """A part as the chapters show it: the stored notes that rank its settings by their medians alone left
    out (a file's verdicts are `steady_sentences`'), the speed table's note counting the steps its rows
    really measured, and a `steps` column."""
    steps = ", ".join(str(row["steps"]) for row in _measured(part) if row.get("steps") is not None)
    notes = []
    for note in part.notes:
        key = getattr(note, "key", None)
        if key in RANKING_NOTES:
            continue
        notes.append(Said(key, {**note.values, "steps": steps}) if key == "bench.table_setup" and steps else note)
    part.notes = notes
    if "steps" not in part.columns and any(row.get("steps") is not None for row in part.rows):
        at = part.columns.index("img/s") + 1 if "img/s" in part.columns else len(part.columns)
        part.columns.insert(at, "steps")


def show_gpu_results(folder: Path | str, parts: Sequence[str] | None = None) -> None:
    """Every GPU suite file in `folder` (only its `parts`, when given): a header naming the file, what kind
    of figures it holds (`label`), its hardware, torch, cuDNN, date and commands; what it cannot show; each
    part's table with the spread of its steps and what its rows measured (`told`); the parts that failed or
    did not fit the time."""
    from IPython.display import Markdown, display

    files = read(folder)
    if not files:
        print(say("bench.gpu_results_none"))
    wanted = (lambda name: True) if parts is None else (lambda name: name in parts)
    shown_any = False
    for found in files:
        names = [name for name in (*found.parts, *found.failed) if wanted(name)]
        if not names:
            continue
        shown_any = True
        prov = found.provenance
        commands = [*prov.get("earlier_commands", []), f"{prov['date']}: {prov['command']}"]
        display(Markdown(say("gpu_files.file", name=found.name, label=label(found), hardware=prov["hardware"],
                             torch=prov.get("torch", "?"), cudnn=prov.get("cudnn", "?"), date=prov["date"][:10],
                             commands="; ".join(f"`{command}`" for command in commands))
                         + "".join("\n\n" + sentence for sentence in file_sentences(found))))
        explained = False
        for name, part in found.parts.items():
            if not wanted(name):
                continue
            _told_notes(part)
            if add_spread(part) and not gpu_file_is_steady(part):
                part.notes[-1] = say("gpu_files.iqr_note")
            display(part)
            paragraphs = told(part, explain=not explained)
            explained = explained or bool(_measured(part))
            if paragraphs:
                display(Markdown("\n\n".join(paragraphs)))
        for name, error in found.failed.items():
            if wanted(name):
                print(failure(name, error))
        skipped = [name for name in prov.get("skipped_for_time", []) if wanted(name)]
        if skipped:
            print(say("bench.gpu_results_skipped", parts=", ".join(skipped)))
    if files and not shown_any:
        print(say("gpu_files.no_part", parts=", ".join(parts or ())))


def brief(folder: Path | str, part: str) -> str:
    """One sentence per committed file with `part`, for a chapter's "What to remember": its label and
    origin, and that it gives no verdict on the part's topic (a steady file: its verdicts, when worded)."""
    sentences = []
    for found in read(folder):
        if part not in found.parts and part not in found.failed:
            continue
        prov = found.provenance
        values = {"name": found.name, "label": label(found), "hardware": prov["hardware"],
                  "torch": prov.get("torch", "?"), "date": prov["date"][:10]}
        if part in found.parts and gpu_file_is_steady(found.parts[part]):
            sentences += steady_sentences(found.parts[part]) or [say("gpu_files.brief_steady", **values)]
        else:
            sentences.append(say("gpu_files.brief", **values, topic=topic(part)))
    return " ".join(sentences) if sentences else say("gpu_files.brief_none")
