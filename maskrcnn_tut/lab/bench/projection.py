"""Scaling on paper, checked against measurements: the article's speed table taken apart, the
curve this machine measures (1, 2, 4, ... devices) and the curve a ring all-reduce predicts.

- `article_arithmetic(rows, coco_images)`: what the article's own figures imply (efficiency per
  row, memory per GPU, its card's headroom, days for COCO).
- `ring_allreduce_bytes(bytes, n)`: a ring all-reduce sends (and receives) 2(N-1)/N x the gradient
  bytes per process: N-1 steps of reduce-scatter and N-1 of all-gather, each moving 1/N of them.
- `predict(step_s, gradient_bytes, ...)`: per link scenario (`LINKS`) and device count, the
  all-reduce time and the speedup with the all-reduce hidden behind backward (its best case) and
  not hidden at all (its worst): two bounds, weak scaling (the same batch per device).
- `scaling_curve(...)`: the measured curve: `bench.table`'s 1 and N devices (through the cache)
  and DDP at every power of two between them.
- `plot_scaling(...)`: measured points with their spread, the predicted bounds, the article's and
  NVIDIA's published points.

The bandwidths are the usual per-direction figures for each link (assumptions, not measurements):
PCIe 3.0 x16 about 12 GB/s in practice (the article's RTX 2080 Ti; GeForce cards lack PCIe P2P, so
NCCL goes through host memory), PCIe 4.0 x16 about 25 GB/s (32 on paper), NVLink (A100) about 300
GB/s per direction, InfiniBand HDR / NDR about 25 / 50 GB/s per NIC (DGX-class nodes have one per
GPU). The share of a step an all-reduce can hide behind is backward's, which the caller measures.
Beyond `GPUS_PER_NODE` GPUs the ring crosses nodes, and its slowest hop sets the pace. Latency (microseconds per hop) is left out: it adds
2(N-1) hops per bucket and matters only at large N with small buckets.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ...errors import BenchError
from ...hardware import usable_cores
from ..book_fonts import fit_titles
from ..provenance import provenance
from ..stored.across_builds import cached
from ..stored.result import BenchResult, python_call
from ..wording import english, interval, say, shown, term
from .harness import bench_config, launch_measure
from .scaling import CPU_TABLE_BATCH, table

#: GPUs per node before a ring all-reduce has to cross the network between nodes.
GPUS_PER_NODE = 8
#: (GB/s within a node, GB/s between nodes), per direction.
LINKS = {
    "PCIe 3.0 ~12 GB/s (RTX 2080 Ti); InfiniBand ~25 GB/s per NIC": (12.0, 25.0),
    "PCIe 4.0 ~25 GB/s; InfiniBand ~25 GB/s per NIC": (25.0, 25.0),
    "NVLink ~300 GB/s; InfiniBand ~25 GB/s per NIC": (300.0, 25.0),
    "NVLink ~300 GB/s; InfiniBand ~50 GB/s per NIC": (300.0, 50.0),
}
PAPER_COUNTS = (1, 2, 4, 8, 16, 32, 64)
#: The article's recommended card (「推奨：RTX 2080 Ti またはそれ以上」) has 11 GB.
ARTICLE_CARD_GB = 11.0
#: The article's own rule (「最大 90% を超えない範囲」).
ARTICLE_MEMORY_RULE = 0.9
#: Common Mask R-CNN schedules in epochs of COCO train2017: the 1x schedule (mmdetection: "1x
#: indicates 12 epochs") and torchvision's detection reference (26 epochs).
SCHEDULES = {"the 1x schedule": 12, "torchvision's reference recipe": 26}
#: Images per GPU assumed where the article gives none: torchvision's reference (2 per GPU).
ASSUMED_ARTICLE_BATCH = 2
#: NVIDIA's published weak scaling of its PyTorch Mask R-CNN (R50-FPN), quoted as published.
PUBLISHED_SCALING = {
    "source": "NVIDIA DeepLearningExamples, PyTorch/Segmentation/MaskRCNN/README.md, training performance on "
              "NVIDIA DGX-1 (8x V100 16 GB, NVLink), PyTorch 19.02 NGC container, FP32, 2 images per GPU",
    "gpus": [1, 4, 8], "img/s": [8.47, 30.23, 56.35], "printed scaling": [1, 3.67, 6.96],
    "link": {"NVLink2 (DGX-1 V100) ~150 GB/s": (150.0, 150.0)},
}


# --------------------------------------------------------------------------- the article's table


def article_arithmetic(rows: Sequence[dict], coco_images: int, card_gb: float = ARTICLE_CARD_GB,
                       schedules: dict[str, int] = SCHEDULES) -> dict:
    """The article's speed table (rows with setup, devices, img/s, memory GB, speedup) taken apart.

    Returns per row: img/s per device, scaling efficiency (img/s over devices x the single row's),
    memory per device; and the single row's share of `card_gb`, days per epoch and per schedule at
    its img/s, and whether the multi-device rows compare methods at different device counts.
    """
    single, *others = rows
    table_rows = []
    for row in rows:
        table_rows.append({"setup": row["setup"], "devices": row["devices"], "img/s": row["img/s"],
                           "efficiency": row["img/s"] / (row["devices"] * single["img/s"]),
                           "memory GB": row["memory GB"], "GB per device": row["memory GB"] / row["devices"],
                           "speedup printed": row["speedup"], "speedup from img/s": row["img/s"] / single["img/s"]})
    epoch_days = coco_images / single["img/s"] / 86400
    counts = sorted({row["devices"] for row in others})
    return {"rows": table_rows, "card share": single["memory GB"] / card_gb, "card GB": card_gb,
            "epoch days": epoch_days, "schedule days": {name: epochs * epoch_days for name, epochs in schedules.items()},
            "schedules": dict(schedules), "device counts": counts,
            # each multi-device row is another method at another device count: method and count confounded
            "confounded": len(others) > 1 and len(counts) == len(others), "efficiencies": [r["efficiency"] for r in table_rows[1:]],
            "GB per device": [r["GB per device"] for r in table_rows]}


# --------------------------------------------------------------------------- on paper


def ring_allreduce_bytes(gradient_bytes: float, n: int) -> float:
    """Bytes each of `n` processes sends (and receives) in a ring all-reduce: 2(n-1)/n x the data."""
    return 2 * (n - 1) / n * gradient_bytes


def link_gbps(n: int, within: float, between: float, gpus_per_node: int = GPUS_PER_NODE) -> float:
    """The ring's slowest hop: within one node up to `gpus_per_node` GPUs, the network beyond."""
    return within if n <= gpus_per_node else min(within, between)


def predict(step_s: float, gradient_bytes: float, counts: Sequence[int] = PAPER_COUNTS,
            links: dict[str, tuple[float, float]] = LINKS, *, backward_share: float) -> list[dict]:
    """Weak scaling on paper: each device keeps the measured single-device `step_s` of compute and
    adds a ring all-reduce of `gradient_bytes` over the link. Per (link, N): the all-reduce ms, the
    speedup when it is hidden behind backward as far as backward lasts (`backward_share` of the
    step, measured; best case) and when it is not hidden at all (worst case), and the matching
    scaling efficiencies."""
    rows = []
    for name, (within, between) in links.items():
        for n in counts:
            seconds = ring_allreduce_bytes(gradient_bytes, n) / (link_gbps(n, within, between) * 1e9)
            hidden = step_s + max(0.0, seconds - backward_share * step_s)
            exposed = step_s + seconds
            rows.append({"link": name, "devices": n, "all-reduce ms": 1000 * seconds,
                         "speedup overlapped": n * step_s / hidden, "speedup not overlapped": n * step_s / exposed,
                         "efficiency overlapped": step_s / hidden, "efficiency not overlapped": step_s / exposed})
    return rows


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of fp32 gradients DDP all-reduces each step: 4 per trainable parameter."""
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def model_gradient_bytes(preset: str | None = None, num_classes: int | None = None) -> int:
    """`gradient_bytes` of the preset's Mask R-CNN (built on the CPU, random weights), for
    `num_classes` classes with the background (default: the benchmark's shapes data; COCO is 91)."""
    from ...data.loader import build_datasets
    from ...model import build_model
    cfg = bench_config(preset, None, amp=False)  # the gradients are fp32 whatever --amp (gpu-r50 turns it on) says
    if num_classes is None:
        num_classes = build_datasets(cfg)[0].num_classes
    return gradient_bytes(build_model(cfg, num_classes))


def bus_bandwidth_gbps(message_bytes: float, n: int, seconds: float) -> float:
    """The link bandwidth an all-reduce of `message_bytes` over `n` processes achieved in `seconds`
    (nccl-tests' "bus bandwidth"): the ring's bytes per process over the time."""
    return ring_allreduce_bytes(message_bytes, n) / seconds / 1e9


# --------------------------------------------------------------------------- measured


def ddp_point(nprocs: int, preset: str | None = None, steps: int = 16, warmup: int = 3, **overrides) -> BenchResult:
    """DDP over `nprocs` devices (GPUs, or on a CPU processes with cores // nprocs threads each),
    measured as `bench.table` measures its DDP row; one row."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and nprocs > gpus:
        raise BenchError(f"nprocs={nprocs}: this machine has {gpus} GPU(s)")
    if not gpus and overrides.get("batch_size") is None:
        overrides["batch_size"] = CPU_TABLE_BATCH
    cfg = bench_config(preset, None, batches_per_step=nprocs, **overrides)
    threads = None if gpus else max(1, usable_cores() // nprocs)
    measurement = launch_measure(cfg, nprocs, [{"steps": steps, "warmup": warmup}], threads)[0]
    row = {"setup": f"DDP({nprocs})", "processes": nprocs, "devices": nprocs, **measurement.row()}
    command = python_call("lab.bench.ddp_point", nprocs=nprocs, preset=preset, steps=steps, warmup=warmup, **overrides)
    return BenchResult("ddp_point", english("bench.ddp_point_title", n=nprocs), [row],
                       ["setup", "processes", "devices", "img/s", "peak MiB/device", "steps"], [], provenance(command))


def devices_used(row: dict) -> int:
    """The devices a speed-table row ran on, from its speedup and efficiency."""
    return max(1, round(row["speedup"] / row["scaling efficiency"]))


def scaling_curve(preset: str | None = None, steps: int = 16, warmup: int = 3, **overrides) -> BenchResult:
    """Speedup against devices: 1 and N from `bench.table` (through the cache, so the chapters that
    show the table show the same points), DDP at each power of two between them measured too
    (and cached). Rows: devices, setup, img/s, speedup with their spread where recorded."""
    speed = cached(table, preset=preset, steps=steps, warmup=warmup, **overrides)
    base = speed.rows[0]
    ddp = speed.row("DDP")
    top = devices_used(ddp) if ddp else 1
    rows = [{"devices": 1, "setup": base["setup"], "img/s": base["img/s"], "speedup": 1.0,
             **{k: base.get(k) for k in ("img/s lo", "img/s hi", "speedup lo", "speedup hi")}}]
    for n in [2 ** k for k in range(1, int(math.log2(top)) + 1) if 2 ** k < top]:
        point = cached(ddp_point, n, preset=preset, steps=steps, warmup=warmup, **overrides).rows[0]
        row = {"devices": n, "setup": point["setup"], "img/s": point["img/s"], "speedup": point["img/s"] / base["img/s"]}
        if interval(point) and interval(base):
            row.update({"img/s lo": point["img/s lo"], "img/s hi": point["img/s hi"],
                        "speedup lo": point["img/s lo"] / base["img/s hi"],
                        "speedup hi": point["img/s hi"] / base["img/s lo"]})
        rows.append(row)
    if ddp:
        rows.append({"devices": top, "setup": ddp["setup"], "img/s": ddp["img/s"], "speedup": ddp["speedup"],
                     **{k: ddp.get(k) for k in ("img/s lo", "img/s hi", "speedup lo", "speedup hi")}})
    for row in rows:
        row["scaling efficiency"] = row["speedup"] / row["devices"]
    notes = [english("bench.curve_note", top=top)]
    prov = {**speed.provenance, "baseline images/step": base.get("images/step"),
            "baseline step s": base["images/step"] / base["img/s"] if base.get("images/step") else None}
    return BenchResult("scaling", english("bench.curve_title"), rows,
                       ["devices", "setup", "img/s", "speedup", "scaling efficiency"], notes, prov)


def plot_scaling(curve: BenchResult | None, paper: list[dict], title: str, article_rows: Sequence[dict] = (),
                 published: dict | None = PUBLISHED_SCALING, hardware: str = ""):
    """Scaling efficiency (speedup / devices) against devices: the measured curve with its spread,
    each link's predicted band (between the not-overlapped and overlapped bounds), the article's
    and NVIDIA's published points. Efficiency rather than speedup, so that a few percent show."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    colors = ["tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink"]
    for index, link in enumerate(dict.fromkeys(row["link"] for row in paper)):
        rows = [row for row in paper if row["link"] == link]
        ns = [row["devices"] for row in rows]
        worst = [100 * row["efficiency not overlapped"] for row in rows]
        best = [100 * row["efficiency overlapped"] for row in rows]
        color = colors[index % len(colors)]
        ax.fill_between(ns, worst, best, color=color, alpha=0.2)
        ax.plot(ns, worst, color=color, linewidth=1.2, label=say("bench.on_paper", link=shown(link)))
    ax.axhline(100, linestyle=":", color="black", label=term("ideal (speedup = devices)"))
    if curve is not None:
        ns = [row["devices"] for row in curve.rows]
        ys = [100 * row["speedup"] / row["devices"] for row in curve.rows]
        low = [y - 100 * (row.get("speedup lo") or row["speedup"]) / row["devices"] for y, row in zip(ys, curve.rows)]
        high = [100 * (row.get("speedup hi") or row["speedup"]) / row["devices"] - y for y, row in zip(ys, curve.rows)]
        ax.errorbar(ns, ys, yerr=[low, high], fmt="o-", color="tab:green", capsize=4, markersize=7,
                    label=say("bench.measured_here", hardware=shown(hardware or curve.provenance.get("hardware", ""))))
    if article_rows:
        ax.plot([r["devices"] for r in article_rows], [100 * r["img/s"] / (r["devices"] * article_rows[0]["img/s"])
                                                        for r in article_rows], "s", color="tab:gray", markersize=7,
                label=term("the article (its GPUs, quoted)"))
    if published:
        base = published["img/s"][0]
        ax.plot(published["gpus"], [100 * v / (g * base) for v, g in zip(published["img/s"], published["gpus"])], "^",
                color="tab:red", markersize=7, label=term("NVIDIA DGX-1, 8x V100, FP32, batch 2 (published)"))
    ax.set_xscale("log", base=2)
    top = max(ax.get_ylim()[1], 105)
    ax.set_ylim(min(ax.get_ylim()[0], 75), top)
    ax.set(title=term(title), xlabel=term("devices (GPUs; on a CPU, processes of one core)"),
           ylabel=term("scaling efficiency (% of N x one device)"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1)
    return fit_titles(fig)


SECONDS_PER_DAY = 86_400


#: COCO schedules in epochs: Detectron2's 1x (90k iterations of 16 images, about 12 epochs over
#: train2017) and torchvision's reference recipe (26 epochs), both from an ImageNet backbone.
COCO_SCHEDULES = {"12 epochs (1x, Detectron2)": 12, "26 epochs (torchvision reference)": 26}


def coco_days(img_per_s: float, epochs: float, images: int) -> float:
    """Days one device needs for `epochs` passes over `images` at `img_per_s`."""
    return images * epochs / img_per_s / SECONDS_PER_DAY


def coco_days_table(speeds: Sequence[dict], images: int, schedules: dict[str, float] | None = None) -> list[dict]:
    """For each speed (a dict with "source" and "img/s", optionally "img/s lo"/"img/s hi"), the days
    each schedule takes on one device; with a spread, "days range" gives the longest schedule's
    days at the high and low img/s."""
    schedules = schedules or COCO_SCHEDULES
    rows = []
    for speed in speeds:
        row = {"source": speed["source"], "img/s": speed["img/s"]}
        row.update({english("bench.days", schedule=name): coco_days(speed["img/s"], epochs, images)
                    for name, epochs in schedules.items()})
        if speed.get("img/s lo") and speed.get("img/s hi"):
            longest = max(schedules.values())
            row["days range"] = (f"{coco_days(speed['img/s hi'], longest, images):.3g}-"
                                 f"{coco_days(speed['img/s lo'], longest, images):.3g}")
        rows.append(row)
    return rows
