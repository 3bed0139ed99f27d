"""What the book's chapters show: the hardware cell, the chapter's data and config, tables, glued
figures, package source listings and pictures. Display only: nothing in the package imports it.

The measurements belong to the module each chapter names (`bench`, `memory`, `engine`, `proofs`,
`monitor`, `hardware`, ...); this module only shows them, so a chapter's cells stay a few lines of
reader-facing calls.

- `set_language(lang)`: the edition a chapter's cells write in ("en" or "ja"; its first code cell).
- `hardware_summary()`: the "your hardware" cell every chapter opens with.
- `version_pins()`: requirements.txt's pins beside the installed versions; `results_versions()`: the torch
  each committed results file was measured with (chapter 2).
- `book_config(**overrides)`, `shapes_data()`: this hardware's preset on the book's shapes dataset.
- `show_table` (`markdown_table` is `bench`'s), `glue`, `show_source`: tables, figures quoted by the
  prose, code.
- `line_plot`, `plot_data_vs_compute`, `show_predictions`, `setting_explorer`: pictures.
- `beside_article`, `plot_beside_article`: the article's speed table (quoted) beside this machine's.
- `PUBLISHED_FAST_PATH`: published fast-path figures (chapter 11), quoted with source and conditions;
  `PUBLISHED_AMP`: NVIDIA's AMP speed-up for Mask R-CNN among them (chapter 5 quotes it).
- `fits_table`: which batch fits on an 11, 24 or 80 GB card, from `memory.memory_table` (chapter 1).
- `run_command`, `torchrun`: run `train.py` from a cell.

Running and stripping the chapters before committing is `python tools/nb.py [--execute] book/*.ipynb`.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import distributed as du
from ..config import Config, default_preset, make_config
from . import wording
from .book_fonts import fit_titles
from .hub_recipe import COCO_TRAIN_IMAGES, PUBLISHED_AMP  # noqa: F401  (the chapters read book.COCO_TRAIN_IMAGES)
from .provenance import hardware, hardware_label
from .rig import shapes_config, shapes_dataset
from .stored.result import markdown_table
from .wording import english, say, shown, shown_rows, term

#: `book/results/`: results measured on other machines, read by both editions' chapters wherever they run.
RESULTS = Path(__file__).resolve().parents[2] / "book" / "results"
#: The article's speed table (「モニタリングとベンチマーク分析」), quoted as published: its GPUs, its figures.
ARTICLE_SPEED_TABLE = [
    {"setup": "Single GPU", "devices": 1, "img/s": 5.2, "memory GB": 10.8, "speedup": 1.0},
    {"setup": "2 GPU (DP)", "devices": 2, "img/s": 9.8, "memory GB": 20.5, "speedup": 1.88},
    {"setup": "4 GPU (DDP)", "devices": 4, "img/s": 19.5, "memory GB": 40.2, "speedup": 3.75},
]
#: Published figures chapter 11 sets beside the reader's own, quoted with their source and the
#: conditions they were measured under; none is measured by the book.
PUBLISHED_FAST_PATH = [
    {"figure": "R50-FPN Mask R-CNN to MLPerf's accuracy target", "published": "19.18 minutes",
     "hardware": "8x H100", "source": "MLPerf Training v3.0, result 3.0-2064",
     "conditions": "a whole system of fused kernels and fixed-size RPN, sampling and post-processing"},
    {"figure": "PyTorch Mask R-CNN training speed", "published": "24 img/s",
     "hardware": "1x A100, AMP", "source": PUBLISHED_AMP["source"],
     "conditions": f"AMP only {PUBLISHED_AMP['low']:.2f}-{PUBLISHED_AMP['high']:.2f}x there"},
    {"figure": "ResNet backbone step, eager against CUDA graphs", "published": "31 ms against 6 ms",
     "hardware": "one GPU, batch 1", "source": "PyTorch blog, \"Accelerating PyTorch with CUDA Graphs\"",
     "conditions": "batch 1, where launch overhead dominates"},
    {"figure": "MLPerf Mask R-CNN end to end with CUDA graphs", "published": "1.70x",
     "hardware": "272 GPUs", "source": "PyTorch blog, \"Accelerating PyTorch with CUDA Graphs\"",
     "conditions": "about one image per GPU; an 8-GPU run with more images per GPU gains less"},
]


# --------------------------------------------------------------------------- language


def set_language(lang: str) -> None:
    """Word everything later cells write in `lang` (the only line in which the two editions' code
    cells differ); Japanese plots get a CJK font (IPAexGothic, from matplotlib-fontja)."""
    wording.set_language(lang)
    if lang == "ja":
        import matplotlib_fontja  # registers the font and makes it matplotlib's default when imported
        matplotlib_fontja.japanize()  # and again on a later call, after matplotlib's settings were reset
        # IPAexGothic has one weight: bold labels are drawn regular, which matplotlib would report under every plot
        logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- hardware


def hardware_summary() -> dict[str, Any]:
    """Show what this machine has and which preset the chapter runs; returns `provenance.hardware()`
    with the preset added (key "preset")."""
    hw = {**hardware(), "preset": default_preset()}
    gpus = ", ".join(f"{n} ({m:.0f} GB)" for n, m in zip(hw["gpus"], hw["gpu_memory_gb"])) or term("none visible")
    cfg = make_config(hw["preset"])
    rows = [{"": "CPU", "this machine": say("book.cpu_row", cpu=hw["cpu"], cores=hw["cores"])},
            {"": "RAM", "this machine": f"{hw['ram_gb']:.0f} GB" if hw["ram_gb"] else term("unknown")},
            {"": "GPUs", "this machine": gpus},
            {"": "preset", "this machine": say("book.preset_row", preset=hw["preset"], backbone=cfg.backbone,
                                               min_size=cfg.min_size, batch=cfg.batch_size)}]
    show_table(rows)
    if not hw["gpus"]:
        prose(say("book.no_gpu"))
    return hw


def version_pins(requirements: Path | str | None = None) -> list[dict[str, Any]]:
    """Each `name==version` pin of the repository's requirements.txt beside the installed version."""
    from importlib.metadata import PackageNotFoundError, version
    path = Path(requirements) if requirements else Path(__file__).resolve().parents[2] / "requirements.txt"
    rows = []
    for line in path.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, pinned = (part.strip() for part in line.split("#")[0].split("=="))
            try:
                installed = version(name)
            except PackageNotFoundError:
                installed = "not installed"
            rows.append({"package": name, "pinned": pinned, "installed": installed,
                         "matches": installed.split("+")[0] == pinned})
    return rows


def results_versions(folder: Path | str | None = None) -> dict[str, str]:
    """{file name: torch version} of every committed results file that records one (`book/results/`)."""
    import json
    found = {}
    for path in sorted(Path(folder or RESULTS).rglob("*.json")):
        torch_version = json.loads(path.read_text()).get("provenance", {}).get("torch")
        if torch_version:
            found[path.name] = torch_version
    return found


# --------------------------------------------------------------------------- data and config


def shapes_data() -> Path:
    """The book's shapes dataset (written once into the cache, then reused by every chapter)."""
    return shapes_dataset("book")


def book_config(preset: str | None = None, **overrides) -> Config:
    """This hardware's preset (or `preset`) on the book's shapes dataset, without progress bars."""
    return shapes_config(preset, sizes="book", **overrides)


# --------------------------------------------------------------------------- display


def show_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".3g") -> None:
    """Display rows as a table in the notebook and the rendered page, in the book's language: headers
    and text cells through `bench.shown.shown` (a term, or stored English such as a benchmark's label,
    read back), numbers as they are; the rows themselves keep their English keys and values."""
    from IPython.display import Markdown, display
    if not rows:
        display(Markdown(markdown_table([])))
        return
    display(Markdown(markdown_table(*shown_rows(rows, columns), floatfmt)))


def glue(name: str, value: Any, fmt: str = "") -> None:
    """Store `value`, formatted with `fmt`, for the prose to quote as {glue:text}`name`."""
    from myst_nb import glue as myst_glue
    myst_glue(name, format(value, fmt), display=False)


def prose(markdown: str) -> None:
    """A paragraph whose numbers this run measured, shown as text (tag its cell `remove-input`).

    `{glue:text}` placeholders in markdown cells render in the built book but stay raw in
    JupyterLab, where the launch button takes readers; a paragraph displayed from a code cell
    reads the same in both.
    """
    from IPython.display import Markdown, display
    display(Markdown(markdown))


def source_listing(obj, start: str | None = None, stop: str | None = None) -> str:
    """A package function's code as markdown, named by file and lines: from the first line
    containing `start` (default: the first line) up to and including the next line containing
    `stop` (default: the last). Raises ValueError when an anchor is not in the code, so a chapter
    cannot silently show the wrong lines after the code changed."""
    lines, first = inspect.getsourcelines(obj)
    path = Path(inspect.getsourcefile(obj)).resolve()
    package_root = Path(__file__).resolve().parents[2]
    named = path.relative_to(package_root) if path.is_relative_to(package_root) else path.name
    name = getattr(obj, "__qualname__", repr(obj))

    def find(text: str, begin: int, which: str) -> int:
        for number in range(begin, len(lines)):
            if text in lines[number]:
                return number
        after = f" after line {first + begin}" if begin else ""
        raise ValueError(f"show_source({name}): the {which} anchor {text!r} is not in its code{after} "
                         f"({named}, lines {first}-{first + len(lines) - 1}); the code changed: update the "
                         "chapter's anchor")

    begin = find(start, 0, "start") if start else 0
    end = find(stop, begin, "stop") + 1 if stop else len(lines)
    code = "".join(lines[begin:end])
    return say("book.listing", path=named, first=first + begin, last=first + end - 1) + f"\n\n```python\n{code}```"


def show_source(obj, start: str | None = None, stop: str | None = None) -> None:
    """Show a package function's code (see `source_listing`; a missing anchor is an error)."""
    from IPython.display import Markdown, display
    display(Markdown(source_listing(obj, start, stop)))


def line_plot(x: Sequence, series: dict[str, Sequence], title: str, xlabel: str, ylabel: str,
              logx: bool = False, logy: bool = False, bars: bool = False):
    """A titled line plot naming this machine (grouped bars with `bars`, for x without an order: ranks)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series.items()):
        if not bars:
            ax.plot(x, ys, marker="o", label=term(label))
            continue
        ax.bar([v + (i - (len(series) - 1) / 2) * width for v in x], ys, width, label=term(label))
        ax.set_xticks(list(x))
    ax.set(title=f"{term(title)}\n{hardware_label()}", xlabel=term(xlabel), ylabel=term(ylabel))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return fit_titles(fig)


def plot_data_vs_compute(result, title: str | None = None):
    """Stacked bars of a benchmark result's rows: median data time and compute time per step (ms)."""
    import matplotlib.pyplot as plt
    rows = [row for row in result.rows if row.get("data ms") is not None]
    labels = [shown(row.get("setting", row.get("setup", ""))) for row in rows]
    compute = [row["compute ms"] for row in rows]
    data = [row["data ms"] for row in rows]
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.45 * len(rows)))
    ax.barh(labels, compute, color="tab:blue", label=term("compute"))
    ax.barh(labels, data, left=compute, color="tab:orange", label=term("data (waiting for the loader)"))
    ax.invert_yaxis()
    ax.set(title=f"{term(title) if title else shown(result.title)}\n"
                 f"{shown(result.provenance['hardware']) if 'hardware' in result.provenance else hardware_label()}",
           xlabel=term("milliseconds per step (median)"))
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="lower right")
    return fit_titles(fig)


def beside_article(result) -> list[dict]:
    """The article's speed table above the rows of a measured `bench.table` result, each labelled
    (in English: `show_table` shows the rows in the book's language)."""
    rows = [{"source": "the article (its GPUs)", **{k: v for k, v in row.items() if k != "devices"}}
            for row in ARTICLE_SPEED_TABLE]
    for row in result.rows:
        if row.get("img/s"):
            rows.append({"source": "this machine", "setup": row["setup"], "img/s": row["img/s"],
                         "memory GB": row["total MiB"] / 1024, "speedup": row["speedup"]})
    return rows


def plot_beside_article(result):
    """Speedup against devices used: the article's rows and this machine's, with the ideal line."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4))
    article = ARTICLE_SPEED_TABLE
    ax.plot([r["devices"] for r in article], [r["speedup"] for r in article], "s--", color="tab:gray",
            label=term("the article (its GPUs, quoted)"))
    for r in article:
        ax.annotate(r["setup"], (r["devices"], r["speedup"]), textcoords="offset points", xytext=(6, -10), fontsize=8)
    mine = [r for r in result.rows if r.get("img/s")]
    devices = [r["speedup"] / r["scaling efficiency"] for r in mine]
    ax.plot(devices, [r["speedup"] for r in mine], "o", color="tab:green", markersize=8, label=term("this machine"))
    for d, r in zip(devices, mine):
        ax.annotate(shown(r["setup"]), (d, r["speedup"]), textcoords="offset points", xytext=(6, 4), fontsize=8,
                    color="tab:green")
    top = max(devices + [r["devices"] for r in article])
    ax.plot([1, top], [1, top], ":", color="black", label=term("ideal (speedup = devices)"))
    hardware = shown(result.provenance["hardware"]) if "hardware" in result.provenance else hardware_label()
    ax.set(title=say("book.speedup_title", hardware=hardware), xlabel=term("devices used (GPUs; on a CPU, cores)"),
           ylabel=term("speedup over one device (x)"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fit_titles(fig)


def fits_table(result, cards_gb: Sequence[float] = (11, 24, 80), headroom: float = 0.9) -> list[dict]:
    """From a `memory.memory_table` result: per image size, the largest batch whose total stays
    below `headroom` of each card's memory ("none" when not even batch 1 fits); in English, which
    `show_table` shows in the book's language."""
    sizes = sorted({row["image size"] for row in result.rows})
    table = []
    for size in sizes:
        rows = [row for row in result.rows if row["image size"] == size]
        entry = {"image size": f"{size} x {size}"}
        for card in cards_gb:
            fitting = [row["batch"] for row in rows if row["total MiB"] < headroom * card * 1024]
            entry[english("book.card", card=card)] = english("book.batch", batch=max(fitting)) if fitting else "none"
        table.append(entry)
    return table


@torch.inference_mode()
def show_predictions(model, dataset, count: int = 4, top: int = 3, title: str = ""):
    """Ground truth (top row) beside the model's `top` highest-scoring masks and boxes (bottom row),
    on the first `count` images of `dataset`."""
    import matplotlib.pyplot as plt
    import numpy as np
    module = du.unwrap(model).eval()
    device = next(module.parameters()).device
    fig, axes = plt.subplots(2, count, figsize=(2.6 * count, 5.4), squeeze=False)
    colors = plt.get_cmap("tab10")
    for column in range(count):
        image, target = dataset[column]
        output = module([image.to(device).float() / 255])[0]
        keep = output["scores"].argsort(descending=True)[:top]
        for row, (masks, labels, boxes, scores) in enumerate((
                (target["masks"].bool(), target["labels"], target["boxes"], None),
                (output["masks"][keep, 0] > 0.5, output["labels"][keep], output["boxes"][keep], output["scores"][keep]))):
            picture = image.permute(1, 2, 0).numpy().astype(float) / 255
            for k, mask in enumerate(masks.cpu().numpy()):
                color = np.array(colors(int(labels[k]))[:3])
                picture[mask] = 0.5 * picture[mask] + 0.5 * color
            ax = axes[row, column]
            ax.imshow(picture)
            for k, box in enumerate(boxes.cpu().tolist()):
                name = dataset.class_names[int(labels[k]) - 1]
                text = name if scores is None else f"{name} {float(scores[k]):.2f}"
                ax.add_patch(plt.Rectangle(box[:2], box[2] - box[0], box[3] - box[1], fill=False,
                                           color=colors(int(labels[k])), linewidth=1.2))
                ax.text(box[0], box[1], text, fontsize=7, color="white", va="bottom",
                        bbox=dict(facecolor=colors(int(labels[k])), alpha=0.7, pad=1, linewidth=0))
            ax.set_axis_off()
        axes[0, column].set_title(say("book.image", image=target["image_id"]), fontsize=9)
    axes[0, 0].text(-0.08, 0.5, term("ground truth"), rotation=90, va="center", ha="right",
                    transform=axes[0, 0].transAxes)
    axes[1, 0].text(-0.08, 0.5, say("book.top_predictions", top=top), rotation=90, va="center",
                    ha="right", transform=axes[1, 0].transAxes)
    fig.suptitle(f"{term(title)}\n{hardware_label()}".strip())
    return fit_titles(fig)


def setting_explorer(measure: Callable[..., Any], options: dict[str, Sequence], initial: dict[str, Any]):
    """Dropdowns for `options`, a Run button, and the picture of `measure(**initial)`.

    `measure(**settings)` returns a matplotlib figure. The first picture is shown as an ordinary
    output, so a rendered page (where no kernel runs the button) still shows a static figure;
    in a live notebook each click reruns the measurement and replaces the picture.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    controls = {name: widgets.Dropdown(options=list(values), value=initial[name], description=name,
                                       style={"description_width": "initial"})
                for name, values in options.items()}
    button = widgets.Button(description=term("Run this setting"), icon="play")
    output = widgets.Output()

    def run(_=None) -> None:
        output.clear_output(wait=True)
        with output:
            fig = measure(**{name: control.value for name, control in controls.items()})
            display(fig)
            plt.close(fig)

    button.on_click(run)
    display(widgets.HBox([*controls.values(), button]), output)
    fig = measure(**initial)
    display(fig)
    plt.close(fig)


def run_command(args: Sequence[str], cwd: Path | str | None = None) -> None:
    """Run a command from a cell (e.g. `torchrun ... train.py`), streaming its output; raise on failure."""
    import shlex
    import subprocess
    print("$ " + shlex.join(str(a) for a in args), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env, cwd=cwd) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
    if proc.returncode:
        raise RuntimeError(f"{args[0]} failed with exit code {proc.returncode} (its output is above)")


def torchrun() -> str:
    """The `torchrun` next to this Python (the one that has the package installed)."""
    candidate = Path(sys.executable).with_name("torchrun")
    return str(candidate) if candidate.exists() else "torchrun"
