"""Diagrams drawn from code (matplotlib), so they render in the static page as in a live notebook.

- `draw_dataparallel_vs_ddp(devices)`: one step of DataParallel (one process: scatter, replicate,
  threads, gather, reduce to GPU 0, step on GPU 0) beside one of DDP (a process per device: its own
  shard, gradient buckets all-reduced during backward, a step on every process) (chapter 4).
- `ring_allreduce(tensors)`: the ring all-reduce simulated on real tensors, step by step: the sums
  it returns are checked against `sum(tensors)` by the chapter, and its log says what every rank
  sent and received (chapter 4).
- `draw_ring_allreduce(ranks)`: that log drawn: who holds which partial sum of each chunk after
  every reduce-scatter and all-gather step, and the bytes a rank sends, 2(N-1)/N of the data.

Nothing here measures anything: the figures are the algorithms, not this machine. Their words are
in the book's language (`wording`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .book_fonts import fit_titles
from .wording import say, term

DP_COLOR, DDP_COLOR, COMM_COLOR, IDLE_COLOR = "#c6dbef", "#c7e9c0", "#fdd0a2", "#eeeeee"


def _box(ax, x: float, y: float, w: float, h: float, text: str, color: str, fontsize: float = 7.5) -> None:
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", linewidth=0.8,
                                edgecolor="#555555", facecolor=color))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, wrap=True)


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str = "#333333",
           style: str = "-|>", curve: float = 0.0) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle=style, color=color, lw=1.1,
                                                          connectionstyle=f"arc3,rad={curve}"))


def _columns(n: int, width: float = 1.0, gap: float = 0.45) -> list[float]:
    return [i * (width + gap) for i in range(n)]


def _frame(ax, xs: list[float], top: float, title: str, width: float = 1.0) -> None:
    for i, x in enumerate(xs):
        ax.text(x + width / 2, -0.35, f"GPU {i}", ha="center", fontsize=8, weight="bold")
    ax.set_xlim(-3.3, xs[-1] + width + 0.4)
    ax.set_ylim(-0.7, top + 0.9)
    ax.set_title(term(title), fontsize=10)


def _dataparallel(ax, n: int) -> None:
    """DataParallel's step, top to bottom, one column per GPU; arrows in the gaps above the boxes."""
    xs, width = _columns(n), 1.0
    rows = ["1 scatter the batch\n(chunks of images)", "2 replicate the weights\nfrom GPU 0 (every step)",
            "3 forward in threads\n(one Python process, one GIL)", "4 gather outputs\nand losses on GPU 0",
            "5 backward: gradients\nsummed onto GPU 0", "6 optimizer step\non GPU 0 only"]
    top = len(rows) * 1.2
    _box(ax, xs[0] - 0.1, top + 0.15, xs[-1] + width + 0.2, 0.55, term("one process drives every GPU"), DP_COLOR, 8)
    cells = {1: ("weights", "copy of\nweights"), 2: ("forward\nthread 0", "forward\nthread {i}"),
             3: ("all outputs", "outputs"), 4: ("all grads", "grads"), 5: ("step", "idle")}
    for r, label in enumerate(rows):
        y = top - (r + 1) * 1.2
        ax.text(-0.25, y + 0.4, term(label), ha="right", va="center", fontsize=7.5)
        for i, x in enumerate(xs):
            if r == 0:
                text, color = say("diagrams.images", first=2 * i, last=2 * i + 1), DP_COLOR
            else:
                text = term(cells[r][0]) if i == 0 else term(cells[r][1]).format(i=i)
                color = DP_COLOR if i == 0 or r in (0, 2) else IDLE_COLOR if r == 5 else COMM_COLOR
            _box(ax, x, y, width, 0.8, text, color)
            if i and r in (1, 3, 4):  # through GPU 0: out of it (replicate) or into it (gather, reduce)
                ends = ((xs[0] + 0.7, y + 0.82), (x + 0.3, y + 0.82))
                _arrow(ax, *(ends if r == 1 else ends[::-1]), curve=-0.25 if r == 1 else 0.25)
    _frame(ax, xs, top, "DataParallel (nn.DataParallel)")


def _ddp(ax, n: int) -> None:
    """DDP's step, top to bottom, one column per process with a compute lane and a communication lane."""
    xs, width = _columns(n), 1.0
    rows = ["1 its own shard of the data\n(DistributedSampler)", "2 forward on its own replica\n(BN buffers broadcast "
            "from rank 0)", "3 backward of the last layers\nfills bucket 0", "4 backward of the first layers,\n"
            "while bucket 0 is all-reduced", "5 bucket 1 all-reduced\n(the step waits for it)",
            "6 the same averaged gradients:\noptimizer step on every process"]
    top = len(rows) * 1.2
    for i, x in enumerate(xs):
        _box(ax, x, top + 0.15, width, 0.55, say("diagrams.process", i=i), DDP_COLOR, 8)
    for r, label in enumerate(rows):
        y = top - (r + 1) * 1.2
        ax.text(-0.25, y + 0.4, term(label), ha="right", va="center", fontsize=7.5)
        for i, x in enumerate(xs):
            if r in (0, 1, 5):
                text = say("diagrams.images", first=2 * i, last=2 * i + 1) if r == 0 else term(("forward", "step")[r == 5])
                _box(ax, x, y, width, 0.8, text, DDP_COLOR)
                continue
            compute = {2: ("backward\nL..k", DDP_COLOR), 3: ("backward\nk..1", DDP_COLOR), 4: ("wait", IDLE_COLOR)}[r]
            _box(ax, x, y, width * 0.55, 0.8, term(compute[0]), compute[1], 6.5)
            if r > 2:
                _box(ax, x + width * 0.6, y, width * 0.4, 0.8, f"all-\nreduce\nb{r - 3}", COMM_COLOR, 6)
        if r in (3, 4):  # the ring, in the gap under the row: each process sends to the next, the last to the first
            for i in range(n - 1):
                _arrow(ax, (xs[i] + width * 0.8, y - 0.02), (xs[i + 1] + width * 0.8, y - 0.02), "#e6550d", curve=0.3)
            _arrow(ax, (xs[-1] + width * 0.8, y - 0.3), (xs[0] + width * 0.8, y - 0.3), "#e6550d", curve=0.0)
    _frame(ax, xs, top, "DistributedDataParallel (one process per GPU)")


def draw_dataparallel_vs_ddp(devices: int = 3):
    """One training step of DataParallel beside one of DDP over `devices` GPUs; returns the figure."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 5.2))
    _dataparallel(axes[0], devices)
    _ddp(axes[1], devices)
    for ax in axes:
        ax.set_axis_off()
    fig.suptitle(say("diagrams.dp_vs_ddp"), fontsize=9)
    return fit_titles(fig)


@dataclass
class RingStep:
    """One step of the ring all-reduce: its phase, what each rank sent, and who now holds what."""

    phase: str  # "start", "reduce-scatter" or "all-gather"
    sends: list[tuple[int, int, int]]  # (from rank, to rank, chunk)
    holds: list[list[frozenset]]  # holds[rank][chunk]: the ranks whose data that copy of the chunk sums


def ring_allreduce(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[RingStep], int]:
    """The ring all-reduce of one tensor per rank, simulated: every rank ends with the sum.

    Each tensor is cut into N chunks. Reduce-scatter: in step s, rank r sends chunk (r - s) mod N to
    rank r + 1, which adds it to its own; after N - 1 steps rank r holds the full sum of chunk
    (r + 1) mod N. All-gather: N - 1 more steps pass the finished chunks around the ring.
    Returns every rank's result, the steps, and the elements one rank sent in all.
    """
    n = len(tensors)
    data = [list(t.detach().clone().flatten().tensor_split(n)) for t in tensors]
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    steps = [RingStep("start", [], [row[:] for row in holds])]
    sent = 0
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            if phase == "reduce-scatter":
                sends = [(r, (r + 1) % n, (r - s) % n) for r in range(n)]
            else:
                sends = [(r, (r + 1) % n, (r + 1 - s) % n) for r in range(n)]
            payload = [(dst, c, data[src][c].clone(), holds[src][c]) for src, dst, c in sends]
            for dst, c, chunk, who in payload:  # everyone sends at once, then everyone receives
                if phase == "reduce-scatter":
                    data[dst][c] += chunk
                    holds[dst][c] = holds[dst][c] | who
                else:
                    data[dst][c] = chunk
                    holds[dst][c] = who
            sent += data[0][sends[0][2]].numel()
            steps.append(RingStep(phase, sends, [row[:] for row in holds]))
    results = [torch.cat(chunks).reshape(tensors[r].shape) for r, chunks in enumerate(data)]
    return results, steps, sent


def draw_ring_allreduce(ranks: int = 4):
    """`ring_allreduce` over `ranks` ranks drawn step by step; returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    _, steps, sent = ring_allreduce([torch.zeros(ranks * 4) for _ in range(ranks)])
    columns = 4
    rows = -(-len(steps) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.0 * columns, 2.9 * rows), squeeze=False)
    cmap = colormaps["Greens"]
    for k, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if k == len(steps):
            ax.text(0.0, 0.5, say("diagrams.per_rank", ratio=2 * (ranks - 1) / ranks, ranks=ranks),
                    fontsize=8, va="center", transform=ax.transAxes)
        if k >= len(steps):
            continue
        step = steps[k]
        sending = {(src, c) for src, _, c in step.sends}
        receiving = {(dst, c) for _, dst, c in step.sends}
        for r in range(ranks):
            for c in range(ranks):
                who = step.holds[r][c]
                face = cmap(0.15 + 0.75 * (len(who) - 1) / max(ranks - 1, 1))
                edge = "#e6550d" if (r, c) in receiving else "#777777"
                ax.add_patch(plt.Rectangle((c, ranks - 1 - r), 0.92, 0.86, facecolor=face, edgecolor=edge,
                                           linewidth=2.0 if (r, c) in receiving else 0.6))
                label = term("all") if len(who) == ranks else "+".join(str(i) for i in sorted(who))
                ax.text(c + 0.46, ranks - 1 - r + 0.43, label, ha="center", va="center", fontsize=7,
                        weight="bold" if (r, c) in sending else "normal",
                        color="white" if len(who) > ranks / 2 else "black")
        for r in range(ranks):
            ax.text(-0.15, ranks - 1 - r + 0.43, say("diagrams.rank", rank=r), ha="right", va="center", fontsize=7)
        for c in range(ranks):
            ax.text(c + 0.46, ranks + 0.05, say("diagrams.chunk", chunk=c), ha="center", va="bottom", fontsize=6.5)
        number = k if step.phase == "reduce-scatter" else k - (ranks - 1)
        title = say("diagrams.start") if step.phase == "start" else \
            say("diagrams.ring_step", phase=step.phase, number=number)
        ax.set_title(title, fontsize=8)
        ax.set_xlim(-1.2, ranks + 0.1)
        ax.set_ylim(-0.2, ranks + 0.6)
    fig.suptitle(say("diagrams.ring_title", ranks=ranks, chunks=2 * (ranks - 1), sent=sent, elements=ranks * 4,
                     ratio=2 * (ranks - 1) / ranks), fontsize=9)
    return fit_titles(fig)
