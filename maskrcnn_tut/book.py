"""What the book's chapters share: the hardware cell, the chapter's data and config, tables, glued
figures, package source listings and prediction pictures.

The measurements themselves belong to the module each chapter names (`bench`, `memory`, `engine`,
`checks`, `monitor`, ...); this module only shows them, so a chapter's cells stay a few lines of
reader-facing calls. The few experiments no other module owns (chapter 1's gradient noise versus
batch size, chapter 9's straggler and all-reduce timings) are here because they exist only to be
shown in the book.

- `hardware()` / `hardware_summary()`: the "your hardware" cell every chapter opens with.
- `environment_report()`: chapter 2's full report (versions, memory, P2P and NVLink between GPUs).
- `book_config(**overrides)`: this hardware's preset on the book's small shapes dataset.
- `show_table`, `glue`, `show_source`, `show_predictions`, `line_plot`, `plot_data_vs_compute`:
  display.
- `run_command`, `torchrun`, `model_from_run`: run `train.py` from a cell and look at what it saved.
- `process_report`, `demo_processes`: what each process started by `distributed.launch` sees (chapter 4).
- `imbalance_run`, `allreduce_timing`: chapter 9's straggler and communication experiments (run in
  processes started by `distributed.launch`, so they live here, importable).
- `beside_article`, `plot_beside_article`: the article's speed table (quoted) beside this machine's.
- `fits_table`: which batch fits on an 11, 24 or 80 GB card, from `memory.memory_table` (chapter 1).
- `setting_explorer`: an ipywidgets control that reruns one measurement, with a static picture.
- `python -m maskrcnn_tut.book [--execute] book/*.ipynb`: (run and) strip chapters before committing,
  keeping the reference outputs of `# NBVAL_CHECK_OUTPUT` cells that nbval compares against.
"""
from __future__ import annotations

import inspect
import os
import platform
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import distributed as du
from .config import Config, default_preset, make_config
from .data.shapes import ensure_shapes_dataset

#: The book's dataset: big enough for a few epochs of short runs, small enough to write in seconds.
BOOK_SHAPES = {"n_train": 128, "n_val": 32, "seed": 0}
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
#: Images in COCO train2017, the dataset behind the usual Mask R-CNN schedules.
COCO_TRAIN_IMAGES = 118_287
#: The article's speed table (「モニタリングとベンチマーク分析」), quoted as published: its GPUs, its figures.
ARTICLE_SPEED_TABLE = [
    {"setup": "Single GPU", "devices": 1, "img/s": 5.2, "memory GB": 10.8, "speedup": 1.0},
    {"setup": "2 GPU (DP)", "devices": 2, "img/s": 9.8, "memory GB": 20.5, "speedup": 1.88},
    {"setup": "4 GPU (DDP)", "devices": 4, "img/s": 19.5, "memory GB": 40.2, "speedup": 3.75},
]


# --------------------------------------------------------------------------- hardware


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def hardware() -> dict[str, Any]:
    """CPU model and usable cores, RAM, the visible GPUs and the preset this machine gets."""
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {"cpu": _cpu_model(), "cores": du.cpu_cores(), "ram_gb": _ram_gb(),
            "gpus": [g.name for g in gpus], "gpu_memory_gb": [g.total_memory / 2**30 for g in gpus],
            "preset": default_preset()}


def hardware_label() -> str:
    """A short name of this machine for plot titles: '4x NVIDIA A100-SXM4-80GB' or '2-core AMD EPYC'."""
    hw = hardware()
    if hw["gpus"]:
        names = sorted(set(hw["gpus"]))
        return " + ".join(f"{hw['gpus'].count(n)}x {n}" for n in names)
    return f"{hw['cores']}-core {hw['cpu']} (no GPU)"


def hardware_summary() -> dict[str, Any]:
    """Show what this machine has and which preset the chapter runs; returns `hardware()`."""
    hw = hardware()
    gpus = ", ".join(f"{n} ({m:.0f} GB)" for n, m in zip(hw["gpus"], hw["gpu_memory_gb"])) or "none visible"
    cfg = make_config(hw["preset"])
    rows = [{"": "CPU", "this machine": f"{hw['cpu']}, {hw['cores']} usable cores"},
            {"": "RAM", "this machine": f"{hw['ram_gb']:.0f} GB" if hw["ram_gb"] else "unknown"},
            {"": "GPUs", "this machine": gpus},
            {"": "preset", "this machine": f"`{hw['preset']}`: {cfg.backbone}-FPN, {cfg.min_size} px, "
                                           f"batch {cfg.batch_size} per process"}]
    show_table(rows)
    if not hw["gpus"]:
        print(textwrap.fill("No GPU: every chapter runs its CPU analogue (gloo processes instead of one "
                            "process per GPU, bfloat16 where the CPU has it instead of float16). On a GPU "
                            "machine the same cells pick the gpu-r50 preset and use every visible GPU.", 100))
    return hw


def _nvlink_links(index: int) -> int | None:
    """Active NVLink links of GPU `index` (None when NVML cannot tell)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        active = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                active += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                break
        return active
    except Exception:  # no NVML library, no driver, or a GPU without NVLink
        return None


def _cudnn_version() -> str:
    if not torch.backends.cudnn.is_available():
        return "not available"
    number = torch.backends.cudnn.version()  # major * 10000 + minor * 100 + patch (cuDNN 9)
    usable = "" if torch.cuda.is_available() else " (in the wheel; unused without a GPU)"
    return f"{number // 10000}.{number % 10000 // 100}.{number % 100}{usable}"


def environment_report() -> list[dict[str, str]]:
    """Chapter 2's report: hardware, GPU interconnect and the versions of the software stack."""
    hw = hardware()
    rows = [("CPU", f"{hw['cpu']}; {hw['cores']} usable cores; "
                    f"vector ISA {torch.backends.cpu.get_cpu_capability()}"),
            ("RAM", f"{hw['ram_gb']:.1f} GB" if hw["ram_gb"] else "unknown"),
            ("GPUs", ", ".join(f"{n} ({m:.0f} GB)" for n, m in zip(hw["gpus"], hw["gpu_memory_gb"]))
             or "none visible")]
    count = len(hw["gpus"])
    if count > 1:
        pairs = [(i, j) for i in range(count) for j in range(count) if i != j]
        peer = sum(torch.cuda.can_device_access_peer(i, j) for i, j in pairs)
        rows.append(("P2P access", f"{peer} of {len(pairs)} GPU pairs can read each other's memory directly"))
    if count:
        links = [_nvlink_links(i) for i in range(count)]
        rows.append(("NVLink", "unknown (NVML unavailable)" if None in links
                     else ", ".join(f"GPU{i}: {n} active links" for i, n in enumerate(links))))
    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    import torchvision
    rows += [("Python", platform.python_version()),
             ("PyTorch / torchvision", f"{torch.__version__} / {torchvision.__version__}"),
             ("CUDA (the wheel's runtime)", torch.version.cuda or "CPU-only build"),
             ("cuDNN", _cudnn_version()),
             ("NCCL", nccl or "not used (no GPU)"),
             ("distributed backends", ", ".join(b for b in ("gloo", "nccl", "mpi")
                                                if getattr(torch.distributed, f"is_{b}_available")()))]
    return [{"": name, "this machine": value} for name, value in rows]


def version_pins(requirements: Path | str | None = None) -> list[dict[str, Any]]:
    """Each `name==version` pin of the repository's requirements.txt beside the installed version."""
    from importlib.metadata import PackageNotFoundError, version
    path = Path(requirements) if requirements else Path(__file__).resolve().parent.parent / "requirements.txt"
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


# --------------------------------------------------------------------------- data and config


def shapes_data() -> Path:
    """The book's shapes dataset (written once into the cache, then reused by every chapter)."""
    return ensure_shapes_dataset(**BOOK_SHAPES, progress=False)


def book_config(preset: str | None = None, **overrides) -> Config:
    """This hardware's preset (or `preset`) on the book's shapes dataset, without progress bars."""
    settings = {"data_path": str(shapes_data()), "progress": False, **overrides}
    return make_config(preset, **settings)


# --------------------------------------------------------------------------- display


def _cell(value: Any, floatfmt: str) -> str:
    if isinstance(value, float):
        return format(value, floatfmt)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".3g") -> str:
    """Rows of dicts as a markdown table (columns: the first row's keys unless given)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, ""), floatfmt) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def show_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".3g") -> None:
    """Display rows as a table in the notebook and the rendered page."""
    from IPython.display import Markdown, display
    display(Markdown(markdown_table(rows, columns, floatfmt)))


def glue(name: str, value: Any, fmt: str = "") -> None:
    """Store `value`, formatted with `fmt`, for the prose to quote as {glue:text}`name`."""
    from myst_nb import glue as myst_glue
    myst_glue(name, format(value, fmt), display=False)


def show_source(obj, start: str | None = None, stop: str | None = None) -> None:
    """Show a package function's code, named by file and lines (optionally from line `start` on,
    up to and including the first line containing `stop`)."""
    from IPython.display import Markdown, display
    lines, first = inspect.getsourcelines(obj)
    begin = next((i for i, line in enumerate(lines) if start in line), 0) if start else 0
    end = next((i + 1 for i, line in enumerate(lines[begin:], begin) if stop in line), len(lines)) if stop else len(lines)
    path = Path(inspect.getsourcefile(obj)).resolve()
    package_root = Path(__file__).resolve().parent.parent
    shown = path.relative_to(package_root) if path.is_relative_to(package_root) else path.name
    code = "".join(lines[begin:end])
    display(Markdown(f"`{shown}`, lines {first + begin}-{first + end - 1}:\n\n```python\n{code}```"))


def line_plot(x: Sequence, series: dict[str, Sequence], title: str, xlabel: str, ylabel: str,
              logx: bool = False, logy: bool = False):
    """A titled line plot naming this machine; returns the figure."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    ax.set(title=f"{title}\n{hardware_label()}", xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_data_vs_compute(result, title: str | None = None):
    """Stacked bars of a benchmark result's rows: median data time and compute time per step (ms)."""
    import matplotlib.pyplot as plt
    rows = [row for row in result.rows if row.get("data ms") is not None]
    labels = [row.get("setting", row.get("setup", "")) for row in rows]
    compute = [row["compute ms"] for row in rows]
    data = [row["data ms"] for row in rows]
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.45 * len(rows)))
    ax.barh(labels, compute, color="tab:blue", label="compute")
    ax.barh(labels, data, left=compute, color="tab:orange", label="data (waiting for the loader)")
    ax.invert_yaxis()
    ax.set(title=f"{title or result.title}\n{result.provenance.get('hardware', hardware_label())}",
           xlabel="milliseconds per step (median)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def beside_article(result) -> list[dict]:
    """The article's speed table above the rows of a measured `bench.table` result, each labelled."""
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
            label="the article (its GPUs, quoted)")
    for r in article:
        ax.annotate(r["setup"], (r["devices"], r["speedup"]), textcoords="offset points", xytext=(6, -10), fontsize=8)
    mine = [r for r in result.rows if r.get("img/s")]
    devices = [r["speedup"] / r["scaling efficiency"] for r in mine]
    ax.plot(devices, [r["speedup"] for r in mine], "o", color="tab:green", markersize=8, label="this machine")
    for d, r in zip(devices, mine):
        ax.annotate(r["setup"], (d, r["speedup"]), textcoords="offset points", xytext=(6, 4), fontsize=8,
                    color="tab:green")
    top = max(devices + [r["devices"] for r in article])
    ax.plot([1, top], [1, top], ":", color="black", label="ideal (speedup = devices)")
    ax.set(title=f"Speedup against devices used\nthis machine: {result.provenance.get('hardware', hardware_label())}",
           xlabel="devices used (GPUs; on a CPU, cores)", ylabel="speedup over one device (x)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fits_table(result, cards_gb: Sequence[float] = (11, 24, 80), headroom: float = 0.9) -> list[dict]:
    """From a `memory.memory_table` result: per image size, the largest batch whose total stays
    below `headroom` of each card's memory ("none" when not even batch 1 fits)."""
    sizes = sorted({row["image size"] for row in result.rows})
    table = []
    for size in sizes:
        rows = [row for row in result.rows if row["image size"] == size]
        entry = {"image size": f"{size} x {size}"}
        for card in cards_gb:
            fitting = [row["batch"] for row in rows if row["total MiB"] < headroom * card * 1024]
            entry[f"{card:g} GB card"] = f"batch {max(fitting)}" if fitting else "none"
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
        axes[0, column].set_title(f"image {target['image_id']}", fontsize=9)
    axes[0, 0].text(-0.08, 0.5, "ground truth", rotation=90, va="center", ha="right",
                    transform=axes[0, 0].transAxes)
    axes[1, 0].text(-0.08, 0.5, f"top {top} predictions", rotation=90, va="center",
                    ha="right", transform=axes[1, 0].transAxes)
    fig.suptitle(f"{title}\n{hardware_label()}".strip())
    fig.tight_layout()
    return fig


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
    button = widgets.Button(description="Run this setting", icon="play")
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


def model_from_run(output_dir: Path | str):
    """The model a `train.py` run saved: its config.json rebuilt and its last checkpoint loaded."""
    import dataclasses
    import json
    from . import checkpoint
    from .model import build_model
    out = Path(output_dir)
    saved = json.loads((out / "config.json").read_text())
    cfg = Config(**{f.name: saved[f.name] for f in dataclasses.fields(Config) if f.name in saved})
    model = build_model(cfg, saved["num_classes"])
    model.load_state_dict(checkpoint.load(out / "checkpoints" / "last.pt")["model"])
    return model.eval()


def process_report() -> list[dict] | None:
    """Run inside `distributed.launch`: each rank's place in the group and one all-reduce, gathered."""
    info = du.info()
    total = du.all_reduce_sum(torch.tensor([info.rank + 1.0], device=info.device))
    mine = {"rank": info.rank, "local rank": info.local_rank, "world size": info.world_size,
            "backend": info.backend, "device": str(info.device), "CPU threads": torch.get_num_threads(),
            "process id": os.getpid(), "all-reduce of rank + 1": float(total)}
    return du.all_gather_objects(mine)


def demo_processes() -> tuple[int, str | None]:
    """(processes, backend) for the chapters' multi-process demos: one per GPU (nccl) with two or
    more GPUs, else two gloo processes (two GPU processes cannot share one GPU under nccl)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (gpus, None) if gpus >= 2 else (2, "gloo")


# --------------------------------------------------------------------------- chapter 9's experiments


def imbalance_run(batch_sizes: Sequence[Sequence[int]], steps: int = 6, warmup: int = 1) -> list[dict]:
    """Run inside `distributed.launch`: for each entry of `batch_sizes`, DDP steps where rank r
    trains `entry[r]` images per step.

    Returns, per entry, each rank's median compute time per step, the median step time (every rank
    waits for the slowest at the all-reduce) and the warnings of a `monitor.StragglerCheck`.
    """
    import statistics
    from .bench import bench_config, measure
    from .monitor import StragglerCheck
    info = du.info()
    results = []
    for per_rank in batch_sizes:
        check = StragglerCheck(every=warmup + steps)
        compute: list[list[float]] = []
        measured = measure(bench_config(batch_size=per_rank[info.rank]), steps=steps, warmup=warmup,
                           callbacks=[check, lambda record: compute.append(record.rank_compute_times)])
        results.append({"batch per rank": list(per_rank),
                        "compute s per rank": [statistics.median(times) for times in zip(*compute)],
                        "step s": statistics.median(measured.iter_times), "warnings": check.warnings})
    return results


def allreduce_timing(total_mb: float, bucket_mbs: Sequence[float], repeats: int = 5) -> list[dict]:
    """Run inside `distributed.launch`: median time to all-reduce `total_mb` of fp32 gradients in
    buckets of each size, and in the default bucket size after compressing them to fp16 (what
    DDP's fp16 compression hook sends). Returns rows on every rank."""
    import statistics
    import time
    info = du.info()
    gradients = torch.zeros(int(total_mb * 2**20 / 4), device=info.device)

    def median_seconds(chunks: list[torch.Tensor]) -> float:
        times = []
        for _ in range(repeats + 1):  # the first round warms the connections up
            du.barrier()
            start = time.perf_counter()
            for chunk in chunks:
                du.all_reduce_sum(chunk)
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    rows = []
    for bucket in bucket_mbs:
        chunks = list(gradients.split(max(1, int(bucket * 2**20 / 4))))
        rows.append({"sent as": f"fp32 in {bucket:g} MB buckets", "all-reduces": len(chunks),
                     "MB per process": total_mb, "ms": 1000 * median_seconds(chunks)})
    default_bucket = 25.0
    chunks = list(gradients.half().split(max(1, int(default_bucket * 2**20 / 2))))
    rows.append({"sent as": f"fp16 in {default_bucket:g} MB buckets (compressed)", "all-reduces": len(chunks),
                 "MB per process": total_mb / 2, "ms": 1000 * median_seconds(chunks)})
    return rows


# --------------------------------------------------------------------------- chapter 1's experiment


def gradient_noise(cfg: Config, batch_sizes: Sequence[int], images_per_size: int, seed: int = 0) -> list[dict]:
    """How far one batch's gradient is from the average gradient, for each batch size.

    For batch size B, `images_per_size // B` disjoint batches are drawn and each one's gradient
    taken (one `engine.train_step` at a vanishing learning rate, from the same weights). The noise
    is the mean squared distance of those gradients from their average, relative to the average's
    squared norm; for independent samples it falls as 1/B.
    """
    from . import checks
    from .data.loader import build_datasets, collate
    from .model import build_model

    train_set, _ = build_datasets(cfg)
    torch.manual_seed(seed)
    model = build_model(cfg, train_set.num_classes)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = []
    for batch_size in batch_sizes:
        grads = []
        for first in range(0, images_per_size - batch_size + 1, batch_size):
            model.load_state_dict(start)
            torch.manual_seed(seed + first)
            batch = collate([train_set[i] for i in order[first:first + batch_size]])
            flat = torch.cat([g.flatten() for g in checks.accumulated_gradients(model, [batch], 1).values()])
            grads.append(flat)
        stacked = torch.stack(grads)
        mean = stacked.mean(0)
        noise = float(((stacked - mean) ** 2).sum(1).mean() / (mean ** 2).sum())
        rows.append({"batch size": batch_size, "batches": len(grads), "relative gradient noise": noise})
    model.load_state_dict(start)
    return rows


# --------------------------------------------------------------------------- committing notebooks


def execute_notebook(path: Path | str, timeout: int = 600) -> None:
    """Run a chapter in place, in its own folder (as `jupyter-book build` and nbval do)."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(Path(path).resolve().parent)}}).execute()
    nbformat.write(nb, path)


def strip_outputs(path: Path | str) -> None:
    """Clear a notebook's outputs except those of `# NBVAL_CHECK_OUTPUT` cells (nbval's reference)."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code_cells, 1):
        cell.metadata.pop("execution", None)
        checked = cell.source.lstrip().startswith(CHECK_MARK) and cell.outputs
        # nbval compares a cell's outputs only if the stored cell counts as run
        cell.execution_count = number if checked else None
        if not checked:
            cell.outputs = []
        for output in cell.outputs:
            output.pop("execution_count", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(
        prog="python -m maskrcnn_tut.book",
        description="Prepare chapters for committing: outputs cleared except the reference outputs of "
                    "'# NBVAL_CHECK_OUTPUT' cells, which nbval compares against.")
    parser.add_argument("notebooks", nargs="+", help="chapter notebooks, e.g. book/07_gradient_accumulation.ipynb")
    parser.add_argument("--execute", action="store_true",
                        help="run each chapter first, refreshing the reference outputs")
    args = parser.parse_args(argv)
    for notebook in args.notebooks:
        if args.execute:
            execute_notebook(notebook)
        strip_outputs(notebook)
        print(f"{'executed and ' if args.execute else ''}stripped {notebook}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
