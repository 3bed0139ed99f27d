"""What the chapters' batch-size and scaling figures say, as figures and verdicts.

Each function reads rows the lab measured or predicted (gradient noise by batch size, a run's
metrics, the scaling curve, `projection.predict`'s bounds) and returns what a chapter quotes with
a verdict from `wording`; the chapter keeps only its sentences. Nothing here measures.

- `gradient_noise(rows)`: noise against the 1/B line (chapter 1).
- `run_health(rows)`: data share and peak-memory growth of a monitored run (chapter 8).
- `curve_against_paper(curve, paper, busy)`: the measured scaling against its predicted bounds (chapter 8).
- `paper_bound(paper, devices, link)`, `article_bounds(paper, efficiencies)`, `first_inefficient(paper)`:
  scaling on paper for the article's GPU (chapter 8).
- `straggler_answer(per_process, threshold)`: one more image on one process (chapter 9).
"""
from __future__ import annotations

from .bench import above, interval
from .wording import FASTER, NO_SPREAD, SLOWER, WITHIN_NOISE

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


def paper_row(paper: list[dict], devices: int, link: str) -> dict:
    """The `projection.predict` row for `devices` over the first link whose name starts with `link`."""
    return next(row for row in paper if row["devices"] == devices and row["link"].startswith(link))


def paper_bound(paper: list[dict], devices: int, link: str) -> float:
    """The not-overlapped (worst-case) scaling efficiency on paper at `devices` over `link`."""
    return paper_row(paper, devices, link)["efficiency not overlapped"]


def curve_against_paper(curve_top: dict, paper: list[dict], busy: bool) -> dict:
    """The scaling curve's last point against the prediction over the measured link ("measured
    here"): `bounds` (speedup not overlapped, overlapped) and `verdict`: BUSY (measured on a busy
    machine), ABOVE_DEVICES (its range lies above N, which only noise can do), else its range
    against the not-overlapped bound: FASTER above it (the all-reduce does not limit it),
    WITHIN_NOISE, SLOWER below (it loses more than the all-reduce), NO_SPREAD."""
    n = curve_top["devices"]
    row = paper_row(paper, n, "measured here")
    bounds = (row["speedup not overlapped"], row["speedup overlapped"])
    order = above(curve_top, bounds[0])
    verdict = (BUSY if busy else ABOVE_DEVICES if above(curve_top, float(n)) == 1
               else {1: FASTER, 0: WITHIN_NOISE, -1: SLOWER, None: NO_SPREAD}[order])
    return {"devices": n, "bounds": bounds, "verdict": verdict, "has spread": interval(curve_top, "speedup") is not None}


def article_bounds(paper: list[dict], article_efficiencies: tuple[float, float], published: dict) -> dict:
    """Scaling on paper for R50-FPN at the article's speed beside the article's rows and NVIDIA's
    published throughputs: the worst-case efficiencies over PCIe at 4 and 64 GPUs and over NVLink
    at 8, whether the article's rows lie `article below` the PCIe bound at 4, the published
    efficiencies per GPU count and whether the 8-GPU one lies `published far below` (more than
    5 points) NVLink's bound."""
    pcie4, pcie64, nvlink8 = (paper_bound(paper, n, link) for n, link in ((4, "PCIe"), (64, "PCIe"), (8, "NVLink")))
    published_eff = [value / published["img/s"][0] / gpus for value, gpus in zip(published["img/s"], published["gpus"])]
    return {"PCIe 4": pcie4, "PCIe 64": pcie64, "NVLink 8": nvlink8, "PCIe 8": paper_bound(paper, 8, "PCIe"),
            "all-reduce ms PCIe 4": paper_row(paper, 4, "PCIe")["all-reduce ms"],
            "article below": max(article_efficiencies) < pcie4,
            "published efficiencies": published_eff, "published far below": published_eff[2] < nvlink8 - 0.05}


def first_inefficient(paper: list[dict], efficiency: float = 0.9) -> dict | None:
    """The first predicted row whose worst-case efficiency falls below `efficiency`, or None."""
    return next((row for row in paper if row["efficiency not overlapped"] < efficiency), None)


def straggler_answer(per_process: int, threshold: float) -> dict:
    """One process given one image more than the others: its forward time as a multiple of
    theirs if it grows with the images, and whether that crosses StragglerCheck's threshold."""
    ratio = (per_process + 1) / per_process
    return {"ratio": ratio, "warns": ratio > threshold}
