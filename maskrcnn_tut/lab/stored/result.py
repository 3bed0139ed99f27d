"""What a benchmark measured: `BenchResult` (rows, notes, provenance), its markdown table and plots,
and the files of the GPU suite (`results_path`, `load_suite`; `gpu_files` words and shows them)."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..book_fonts import fit_titles
from ..wording import MESSAGES, english, from_json, language, say, shown, shown_rows, term, to_json


def _cell(value: Any, floatfmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return format(value, floatfmt)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".3g") -> str:
    """Rows of dicts as a markdown table (columns: the first row's keys unless given; None as blank)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c), floatfmt) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def python_call(name: str, **kwargs) -> str:
    """The Python call that produced a result, for its provenance (None arguments left out)."""
    arguments = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None)
    return f"maskrcnn_tut.{name}({arguments})"


def row_label(row: dict) -> str:
    """A row's name: its setup (speed table) or setting (sweeps)."""
    label = row.get("setup", row.get("setting", ""))
    return label if isinstance(label, str) else str(label)  # a recorded sentence stays one (`wording.Said`)


@dataclass
class BenchResult:
    """What one benchmark measured: rows (dicts), the columns to show, notes and provenance."""

    name: str
    title: str
    rows: list[dict]
    columns: list[str]
    notes: list[str] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)

    def row(self, prefix: str, measured: bool = True) -> dict | None:
        """The first row whose setup (or setting) starts with `prefix`, or None when there is none,
        e.g. `row("DDP")` on a machine with one GPU. measured=True passes over the rows that only
        say why a setup was not run (they have no img/s)."""
        return next((row for row in self.rows if row_label(row).startswith(prefix)
                     and (not measured or row.get("img/s") is not None)), None)

    def to_markdown(self) -> str:
        """The title, table and notes in the book's language (English, as stored, in the shell)."""
        lines = [f"**{shown(self.title)}** ({shown(self.provenance.get('hardware', ''))})", "",
                 markdown_table(*shown_rows(self.rows, self.columns)) if self.rows else markdown_table([])]
        lines += [""] + [f"- {shown(note)}" for note in self.notes] if self.notes else []
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def plot(self):
        """A bar chart of img/s and peak memory per row, or the plot registered for this result's name."""
        return _PLOTS.get(self.name, _plot_sweep)(self)

    def to_dict(self) -> dict:
        """For a JSON file: every recorded sentence as its key and values (`wording.to_json`)."""
        return to_json(dataclasses.asdict(self))

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict) -> BenchResult:
        return cls(**from_json(data))

    @classmethod
    def load(cls, path: Path | str) -> BenchResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


# --------------------------------------------------------------------------- plots


def _pyplot():
    """matplotlib's pyplot, imported on the first plot: every benchmark worker process imports this
    package, and none of them draws (pyplot would add about half a second to each start)."""
    import matplotlib.pyplot as plt
    return plt

def _plot_sweep(result: BenchResult):
    plt = _pyplot()
    measured = [row for row in result.rows if row.get("img/s") is not None]
    labels = [shown(row_label(row)) for row in measured]
    fig, (ax_speed, ax_memory) = plt.subplots(1, 2, figsize=(11, 3.2 + 0.12 * len(labels)))
    ax_speed.barh(labels, [row["img/s"] for row in measured], color="tab:green")
    ax_speed.set(xlabel=term("images / s (median step)"), title=term("Throughput"))
    ax_memory.barh(labels, [row["peak MiB/device"] for row in measured], color="tab:purple")
    ax_memory.set(xlabel="MiB", title=term("Peak memory per device"))
    for ax in (ax_speed, ax_memory):
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"{shown(result.title)} — {shown(result.provenance.get('hardware', ''))}")
    return fit_titles(fig)


def _plot_table(result: BenchResult):
    fig = _plot_sweep(result)
    ax_speed = fig.axes[0]
    measured = [row for row in result.rows if row.get("img/s") is not None]
    for y, row in enumerate(measured):
        ax_speed.annotate(f" {row['speedup']:.2f}{MESSAGES[language()]['x']}", (row["img/s"], y), va="center",
                          fontsize=8)
    return fig


def _plot_time_to_accuracy(result: BenchResult):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in result.rows:
        seconds, values = zip(*[(s, v) for _, s, v in row["curve"]]) if row["curve"] else ((), ())
        ax.plot(seconds, values, marker="o", label=shown(row["variant"]))
    metric, target = result.provenance["metric"], result.provenance["target"]
    ax.axhline(target, color="tab:red", linestyle="--", label=say("bench.target", metric=metric, target=target))
    ax.set(xlabel=term("training seconds (evaluation left out)"), ylabel=metric,
           title=f"{shown(result.title)}\n{shown(result.provenance.get('hardware', ''))}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fit_titles(fig)


_PLOTS: dict[str, Callable] = {"table": _plot_table, "time-to-accuracy": _plot_time_to_accuracy}


def register_plot(name: str, plot: Callable[[BenchResult], Any]) -> None:
    """Draw results named `name` with `plot` (the module that makes such results registers it, so
    this one need not know their rows)."""
    _PLOTS[name] = plot


# --------------------------------------------------------------------------- the GPU suite's files


def results_path(results_dir: Path | str, prov: dict) -> Path:
    """`<results_dir>/<hardware>-<date>.json`, the hardware label made file-name safe."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", prov["hardware"]).strip("-").lower()
    return Path(results_dir) / f"{slug}-{prov['date'][:10]}.json"


def add_spread(result: BenchResult) -> bool:
    """The speedup ranges and the "img/s IQR" column of a result whose measured rows carry their
    spread (`timing_row`); returns False, changing nothing, when some measured row has none."""
    rows = [row for row in result.rows if row.get("img/s") is not None]
    if not rows or any(row.get("img/s lo") is None for row in rows):
        return False
    base = rows[0]
    for row in rows:
        if row.get("speedup") is None:
            continue
        if row is base:
            row["speedup lo"] = row["speedup hi"] = 1.0
        else:
            row["speedup lo"] = row["img/s lo"] / base["img/s hi"]
            row["speedup hi"] = row["img/s hi"] / base["img/s lo"]
    for row in rows:
        row["img/s IQR"] = f"{row['img/s lo']:.3g}-{row['img/s hi']:.3g}"
    if "img/s" in result.columns and "img/s IQR" not in result.columns:
        result.columns.insert(result.columns.index("img/s") + 1, "img/s IQR")
    result.notes.append(english("bench.iqr_note"))
    return True


def load_suite(path: Path | str) -> tuple[dict, dict[str, BenchResult], dict[str, str]]:
    """A `gpu_suite` file: (provenance, {name: BenchResult} of the parts that ran, {name: error} of those
    that failed)."""
    data = json.loads(Path(path).read_text())
    results = data["results"].items()
    return (data["provenance"], {name: BenchResult.from_dict(r) for name, r in results if "error" not in r},
            {name: r["error"] for name, r in results if "error" in r})
