"""The pictures of a `traces.DDPTrace`: DDP's three ideas, each drawn from the steps it profiled.

- `plot_buckets(trace)`: one rank's backward with the moment each gradient bucket was ready and
  its all-reduce launched, labelled with the bucket's measured size (idea 1, buckets).
- `plot_steps(trace, phases)`: one profiled step of each rank per phase, one lane per rank for its
  main thread (data, forward, backward, optimizer) and one for gloo's threads (gradient
  all-reduces, buffer broadcasts): with one bucket against several it shows the overlap (idea 2),
  with accumulated micro-batches the all-reduces only after the last backward (idea 3, `no_sync`).

Titles, labels and lanes are in the book's language (`wording`).
"""
from __future__ import annotations

from .book_fonts import fit_titles
from .traces import DATA, FORWARD, NO_SYNC_ACCUM, SMALL_BUCKET_MB, STEP, DDPTrace
from .wording import say, shown, term

COLORS = {"data": "tab:orange", "forward": "tab:blue", "backward": "tab:green", "optimizer": "tab:purple",
          "waiting for gradients": "lightgray", "all-reduce": "tab:red"}
#: Each phase's title: an entry of prose/trace_plots.json.
TITLES = {"ddp": "trace_plots.title_ddp", "ddp_small_buckets": "trace_plots.title_small",
          "ddp_no_sync": "trace_plots.title_no_sync"}


def _main_lanes(row: dict, events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(start, duration) µs of each kind of work on the rank's main thread in one profiled step."""
    lo, hi = row["step span"]
    main = next(e["tid"] for e in events if e.get("name") == STEP)
    lanes = {"data": [], "forward": [], "optimizer": []}
    for e in events:
        if e.get("ph") == "X" and e["tid"] == main and lo <= e["ts"] < hi:
            kind = {DATA: "data", FORWARD: "forward"}.get(e["name"]) or (
                "optimizer" if e["name"].startswith("Optimizer.step") else None)
            if kind:
                lanes[kind].append((e["ts"], e["dur"]))
    lanes["backward"] = [(a, b - a) for a, b in row["backward spans"]]
    b_end, g_end = row["backward span"][1], max((b for _, b in row["grad spans"]), default=0.0)
    lanes["waiting for gradients"] = [(b_end, g_end - b_end)] if g_end > b_end else []
    return lanes


def _cap(trace: DDPTrace, phase: str) -> float:
    return trace.bucket_cap_mb if phase == "ddp" else SMALL_BUCKET_MB


def plot_steps(trace: DDPTrace, phases: tuple[str, ...], title: str):
    """One profiled step of each rank for each phase (module doc), on the ranks' shared clock."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(phases), 1, figsize=(10, 1.9 * len(phases) + 0.9), squeeze=False)
    for ax, phase in zip(axes[:, 0], phases):
        origin = min(rank[-1]["step span"][0] for rank in trace.steps[phase])
        ms = lambda us: (us - origin) / 1000  # noqa: E731
        for r, (rank_steps, events) in enumerate(zip(trace.steps[phase], trace.events[phase])):
            row = rank_steps[-1]
            y = 2 * (len(trace.steps[phase]) - 1 - r)
            for kind, spans in _main_lanes(row, events).items():
                ax.broken_barh([(ms(a), d / 1000) for a, d in spans], (y + 1, 0.8), color=COLORS[kind],
                               label=term(kind) if r == 0 else None)
            ax.broken_barh([(ms(a), (b - a) / 1000) for a, b in row["grad spans"]], (y, 0.8), color=COLORS["all-reduce"],
                           label=term("gradient all-reduce (gloo thread)") if r == 0 else None)
            lo, hi = row["step span"]
            casts = [(ms(e["ts"]), e["dur"] / 1000) for e in events if e.get("ph") == "X"
                     and e.get("name", "").endswith(":broadcast") and lo <= e["ts"] < hi]
            ax.broken_barh(casts, (y, 0.8), color="black",
                           label=term("buffer broadcast (gloo thread)") if r == 0 else None)
            ax.text(-5, y + 0.9, say("trace_plots.rank", rank=r), ha="right", va="center", fontsize=8)
        n = len(trace.bucket_mb(phase))
        buckets = say("trace_plots.bucket" if n == 1 else "trace_plots.buckets", n=n)
        ax.set(title=say(TITLES[phase], cap=_cap(trace, phase), buckets=buckets, micro=NO_SYNC_ACCUM),
               xlabel=term("milliseconds from the first rank's step start"), yticks=[])
        ax.grid(alpha=0.3, axis="x")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=4, loc="lower center")
    fig.suptitle(f"{term(title)}\n" + say("trace_plots.steps_subtitle", batch=trace.batch_size,
                                                       hardware=shown(trace.hardware)), fontsize=9)
    return fit_titles(fig, rect=(0, 0.1, 1, 1))


def plot_buckets(trace: DDPTrace, phase: str = "ddp_small_buckets"):
    """Rank 0's backward in one profiled step, with each bucket's launch and measured size."""
    import matplotlib.pyplot as plt
    row = trace.steps[phase][0][-1]
    origin = row["backward span"][0]
    ms = lambda us: (us - origin) / 1000  # noqa: E731
    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.broken_barh([(ms(a), (b - a) / 1000) for a, b in row["backward spans"]], (1, 0.8), color=COLORS["backward"],
                   label=term("backward (main thread)"))
    ax.broken_barh([(ms(a), (b - a) / 1000) for a, b in row["grad spans"]], (0, 0.8), color=COLORS["all-reduce"],
                   label=term("bucket all-reduce (gloo thread)"))
    for k, (launch, mb) in enumerate(zip(row["bucket launches"], row["bucket MiB"]), 1):
        ax.axvline(ms(launch), color="black", lw=1, ls="--")
        ax.text(ms(launch), 2.0, " " + say("trace_plots.ready", bucket=k, mb=mb), fontsize=8, va="bottom")
    ax.set(ylim=(-0.2, 2.8), yticks=[0.4, 1.4], yticklabels=["gloo", term("main")],
           xlabel=term("milliseconds from the start of backward"),
           title=say("trace_plots.buckets_title", cap=_cap(trace, phase), hardware=shown(trace.hardware)))
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="lower right")
    return fit_titles(fig)
