"""What the chapters' batch-size and scaling figures say, as figures and verdicts.

Each function reads rows the lab measured or predicted (gradient noise by batch size, a run's
metrics, the scaling curve, `projection.predict`'s bounds) and returns what a chapter quotes with
a verdict from `wording`; the chapter keeps only its sentences. Nothing here measures.

- `gradient_noise(rows)`: noise against the 1/B line (chapter 1).
- `run_health(rows)`: data share and peak-memory growth of a monitored run (chapter 8).
- `curve_against_paper(curve, paper, busy, link)`: the measured scaling against its predicted bounds (chapter 8).
- `backward_share(records)`: the share of a measured step after forward, which an all-reduce can hide behind.
- `paper_bound(paper, devices, link)`, `article_bounds(...)`, `first_inefficient(paper)`: scaling on
  paper for the article's GPU and NVIDIA's published run (chapter 8).
- `straggler_answer(per_process, threshold, processes)`, `straggler_words(...)`: what StragglerCheck
  names, predicted and measured (chapter 9); `no_sync_check_words(gpus)`: where chapter 7's check ran.
- `table_verdicts(speed)`: sentences about a speed table, as far as its spread allows (chapters 4, 8, 9).

The sentences are entries of `prose/scale_findings.json`, in the book's language (`wording.say`);
row labels and notes a benchmark stored in English are shown through `bench.shown`.
"""
from __future__ import annotations

import statistics

from . import wording
from .bench import interval
from .bench.projection import devices_used
from .stored.across_builds import machine_busy, spread_text
from .stored.result import row_label
from .wording import FASTER, NO_SPREAD, SLOWER, WITHIN_NOISE, say, shown

#: The verdict of a scaling figure measured while other work kept the machine busy.
BUSY = "busy"
#: The verdict of a speedup whose whole range lies above the devices used: only noise does that.
ABOVE_DEVICES = "above devices"


def gradient_noise(rows: list[dict]) -> dict:
    """`proofs.gradient_noise` rows: the first and last batch, the noise factor between them against
    the 1/B prediction, and `verdict`: WITHIN_NOISE when the last batch's noise lies within two
    standard errors of the 1/B line from the first, SLOWER when it lies above (the noise falls
    slower than 1/B), FASTER below."""
    first, last = rows[0], rows[-1]
    ideal = first["relative gradient noise"] / last["batch size"]
    gap = last["relative gradient noise"] - ideal
    tolerance = 2 * ((last["noise SE"] or 0) ** 2 + ((first["noise SE"] or 0) / last["batch size"]) ** 2) ** 0.5
    verdict = WITHIN_NOISE if abs(gap) <= tolerance else SLOWER if gap > 0 else FASTER
    return {"first": first, "last": last, "ideal": ideal, "verdict": verdict,
            "factor": first["relative gradient noise"] / last["relative gradient noise"],
            "predicted factor": last["batch size"] / first["batch size"]}


def run_health(rows: list[dict]) -> dict:
    """A monitored run's metrics rows: the median step's data share, the peak memory and how much it
    rose over the first and the second half of the steps (a leak keeps rising)."""
    half = len(rows) // 2
    return {"data share": sorted(row["data_time"] / row["iter_time"] for row in rows)[half],
            "peak MiB": max(row["max_mem_mb"] for row in rows), "half": half, "rest": len(rows) - half,
            "first half MiB": rows[half - 1]["max_mem_mb"] - rows[0]["max_mem_mb"],
            "second half MiB": rows[-1]["max_mem_mb"] - rows[half - 1]["max_mem_mb"]}


def backward_share(records) -> float:
    """The median share of a step that comes after forward (backward and the optimizer step) in a
    run's `engine.StepRecord`s: what an all-reduce launched from backward can hide behind, at most."""
    return statistics.median((r.iter_time - r.data_time - r.rank_forward_times[0]) / r.iter_time for r in records)


def paper_row(paper: list[dict], devices: int, link: str) -> dict:
    """The `projection.predict` row for `devices` over the first link whose name starts with `link`."""
    return next(row for row in paper if row["devices"] == devices and row["link"].startswith(link))


def paper_bound(paper: list[dict], devices: int, link: str) -> float:
    """The not-overlapped (worst-case) scaling efficiency on paper at `devices` over `link`."""
    return paper_row(paper, devices, link)["efficiency not overlapped"]


def curve_against_paper(curve_top: dict, paper: list[dict], busy: bool, link: str) -> dict:
    """The scaling curve's last point against the prediction over `link`, the link measured on this
    machine (named in the book's language): `bounds` (speedup not overlapped, overlapped) and `verdict`: BUSY (measured on a busy
    machine), ABOVE_DEVICES (its range lies above N, which only noise can do), else its range
    against the not-overlapped bound: FASTER above it (the all-reduce does not limit it),
    WITHIN_NOISE, SLOWER below (it loses more than the all-reduce), NO_SPREAD."""
    n = curve_top["devices"]
    row = paper_row(paper, n, link)
    bounds = (row["speedup not overlapped"], row["speedup overlapped"])
    verdict = (BUSY if busy else ABOVE_DEVICES if wording.compare_to(curve_top, float(n)).verdict == FASTER
               else wording.compare_to(curve_top, bounds[0]).verdict)
    return {"devices": n, "bounds": bounds, "verdict": verdict, "has spread": interval(curve_top, "speedup") is not None}


def article_bounds(paper: list[dict], article_efficiencies: tuple[float, float], published: dict,
                   published_paper: list[dict]) -> dict:
    """Scaling on paper for R50-FPN at the article's speed beside the article's rows and NVIDIA's.

    The worst-case (not overlapped) efficiencies over PCIe 3.0 (the article's card) and 4.0 at 4
    GPUs, PCIe 3.0 at 8 and 64, NVLink at 8; `article`: where the article's 4-GPU row lies against
    the PCIe 3.0 bound (FASTER above it, SLOWER below, WITHIN_NOISE within a point: the data cannot
    tell bandwidth from stragglers); NVIDIA's published efficiencies and `published bound`, the
    bound for its own step and link (`published_paper`), and whether it lies `published far below`
    it (more than 5 points)."""
    bound = {f"{link} {n}": paper_bound(paper, n, link)
             for link, n in (("PCIe 3", 4), ("PCIe 4", 4), ("PCIe 3", 8), ("PCIe 3", 64), ("NVLink", 8))}
    article = article_efficiencies[-1]
    gap = article - bound["PCIe 3 4"]
    published_eff = [value / published["img/s"][0] / gpus for value, gpus in zip(published["img/s"], published["gpus"])]
    nvidia = paper_bound(published_paper, published["gpus"][-1], "")
    return {**bound, "all-reduce ms PCIe 3 4": paper_row(paper, 4, "PCIe 3")["all-reduce ms"],
            "article": WITHIN_NOISE if abs(gap) <= 0.01 else FASTER if gap > 0 else SLOWER,
            "published efficiencies": published_eff, "published bound": nvidia,
            "published far below": published_eff[-1] < nvidia - 0.05}


def first_inefficient(paper: list[dict], efficiency: float = 0.9) -> dict | None:
    """The first predicted row whose worst-case efficiency falls below `efficiency`, or None."""
    return next((row for row in paper if row["efficiency not overlapped"] < efficiency), None)


def straggler_answer(per_process: int, threshold: float, processes: int) -> dict:
    """One process given one image more than the others: the ratio `StragglerCheck` computes (its
    forward time over the median of all ranks', if forward time grows with the images), whether it
    crosses the threshold, and `needed`, how much slower than the others a rank must be to be named:
    with 2 ranks the median is their mean, so a rank r times slower shows as 2r / (1 + r)."""
    times = [per_process] * (processes - 1) + [per_process + 1]
    ratio = times[-1] / statistics.median(times)
    needed = threshold / (2 - threshold) if processes == 2 else threshold
    return {"ratio": ratio, "warns": ratio > threshold, "needed": needed}


def straggler_words(found: dict, balanced: dict, threshold: float, processes: int, gpus: int) -> str:
    """What StragglerCheck did in the two runs of chapter 9, as measured (`speed_findings.imbalance`'s
    `found` and the balanced run), and what the processes shared: with fewer GPUs than processes they
    share one device, so each one's forward time includes the other's work."""
    even = ", ".join(map(str, balanced["batch per rank"]))
    needed = straggler_answer(1, threshold, processes)["needed"]
    ratio = found["forward ratio"]
    if not found["warned"]:
        said = say("scale_findings.straggler_quiet", ratio=ratio, processes=processes, needed=needed)
    else:
        said = say("scale_findings.straggler_both" if found["balanced warned"] else "scale_findings.straggler_named",
                   even=even, ratio=ratio)
    if processes == 2:
        said += say("scale_findings.straggler_two", needed=needed, threshold=threshold)
    if gpus in (0, 1):
        said += say("scale_findings.straggler_cpu" if gpus == 0 else "scale_findings.straggler_one_gpu")
    return said


def no_sync_check_words(gpus: int) -> str:
    """Where chapter 7's two-process `no_sync` check ran (`proofs.ddp_accumulation_check` puts its toy
    model on each process's device, rank r on GPU r % gpus, and the chapter asks for gloo)."""
    return say("scale_findings.no_sync_cpu" if gpus == 0 else "scale_findings.no_sync_one_gpu" if gpus == 1
               else "scale_findings.no_sync_gpus")


def _pct(value: float) -> str:
    return f"{100 * value:.0f} %"


def table_verdicts(speed) -> dict[str, str]:
    """Sentences about a `bench.table` result that hold only as far as its spread allows: the DDP
    speedup, DDP against the same processes without the all-reduce (CPU), against one process with
    all the threads (CPU) and against DataParallel at the same N (GPUs); memory per device and in
    all. Each comparison is a `wording` verdict; on a busy machine no two rows are comparable."""
    measured = [row for row in speed.rows if row.get("img/s") is not None]
    base, ddp = measured[0], speed.row("DDP")
    out = {"result": "", "allreduce": "", "threads": "", "dp": "", "memory": "", "busy": machine_busy(speed)}

    def verdict(a, b) -> str:
        found = wording.compare(a, b).verdict
        return WITHIN_NOISE if out["busy"] and found != NO_SPREAD else found

    if ddp is None:
        out["result"] = say("scale_findings.no_ddp")
    else:
        out["result"] = say("scale_findings.result", ddp=shown(ddp["setup"]), speed=spread_text(ddp), base=shown(base["setup"]),
                             efficiency=_pct(ddp["scaling efficiency"]))
        n = devices_used(ddp)
        if wording.compare_to(ddp, 1.0).verdict == WITHIN_NOISE:
            out["result"] += say("scale_findings.includes_one", within=wording.words(WITHIN_NOISE))
        elif (wording.compare_to(ddp, float(n)).verdict == FASTER
              or (interval(ddp, "speedup") is None and ddp["speedup"] > 1.02 * n)):
            out["result"] += say("scale_findings.superlinear", n=n)
    if out["busy"]:
        out["result"] = (out["result"] + say("scale_findings.sep") + shown(out["busy"])).strip()
    ceiling = speed.row(f"{devices_used(ddp)} processes without") if ddp else None
    if ddp and ceiling:
        gap = _pct(1 - ddp["img/s"] / ceiling["img/s"])
        out["allreduce"] = say("scale_findings.allreduce", speed=spread_text(ceiling)) + wording.pick(
            verdict(ddp, ceiling), within_noise=say("scale_findings.allreduce_busy") if out["busy"] else
            say("scale_findings.allreduce_within_noise", noise=wording.noise()), slower=say("scale_findings.allreduce_slower", gap=gap),
            faster=say("scale_findings.allreduce_faster"), no_spread=say("scale_findings.allreduce_no_spread", gap=gap))
    threads = [row for row in measured if (row.get("threads/process") or 0) > (base.get("threads/process") or 0)
               and row.get("processes") == 1]
    if ddp and threads:
        other = max(threads, key=lambda row: row["threads/process"])
        out["threads"] = say("scale_findings.threads", threads=other["threads/process"], speed=spread_text(other)) + wording.pick(
            verdict(ddp, other), faster=say("scale_findings.threads_faster"), slower=say("scale_findings.threads_slower"),
            within_noise=say("scale_findings.threads_within_noise", words=wording.words(WITHIN_NOISE, "DDP")),
            no_spread=say("scale_findings.threads_no_spread"))
    dp = speed.row("DP")
    if dp is None:
        unmeasured = next((row for row in speed.rows if row_label(row).startswith("DP")), None)
        note = (unmeasured or {}).get("note")
        out["dp"] = say("scale_findings.no_dp", note=say("scale_findings.dp_not_measured") if note is None else shown(note))
    elif ddp:
        out["dp"] = say("scale_findings.dp", devices=devices_used(ddp), dp=spread_text(dp), ddp=spread_text(ddp)) + wording.pick(
            verdict(ddp, dp), faster=say("scale_findings.dp_faster"), slower=say("scale_findings.dp_slower"),
            within_noise=say("scale_findings.dp_within_noise", noise=wording.noise()), no_spread=say("scale_findings.dp_no_spread"))
    out["memory"] = say("scale_findings.memory_sep").join(
        say("scale_findings.memory", setup=shown(row["setup"]), device=row["peak MiB/device"], total=row["total MiB"])
        for row in measured)
    return out
