"""The chapters' verdicts, from hand-made rows: `wording` and the findings modules, each branch."""
from __future__ import annotations

import pytest

from maskrcnn_tut.lab import scale_findings, speed_findings, wording
from maskrcnn_tut.lab.bench import NO_DIFFERENCE
from maskrcnn_tut.lab.stored.result import BenchResult
from maskrcnn_tut.lab.wording import FASTER, NO_SPREAD, SLOWER, WITHIN_NOISE, english


def row(name: str, img_s: float, spread: float | None = 0.02, **more) -> dict:
    found = {"setup": name, "setting": name, "img/s": img_s, **more}
    if spread is not None:
        found["img/s lo"], found["img/s hi"] = img_s * (1 - spread), img_s * (1 + spread)
    return found


def result(rows: list[dict], **provenance) -> BenchResult:
    return BenchResult("test", "test", rows, list(rows[0]), [], provenance)


# --------------------------------------------------------------------------- wording


@pytest.mark.parametrize("a, b, verdict", [(12.0, 10.0, FASTER), (8.0, 10.0, SLOWER), (10.1, 10.0, WITHIN_NOISE)])
def test_compare_says_faster_only_when_the_ranges_lie_apart(a, b, verdict):
    found = wording.compare(row("a", a), row("b", b))
    assert found.verdict == verdict and found.ratio == pytest.approx(a / b)


def test_compare_without_a_spread_says_so():
    assert wording.compare(row("a", 12.0, None), row("b", 10.0)).verdict == NO_SPREAD


@pytest.mark.parametrize("value, verdict", [(1.5, FASTER), (2.5, SLOWER), (2.0, WITHIN_NOISE)])
def test_compare_to_a_fixed_figure(value, verdict):
    speedup = {"speedup": 2.0, "speedup lo": 1.9, "speedup hi": 2.1}
    assert wording.compare_to(speedup, value).verdict == verdict


@pytest.mark.parametrize("a, verdict", [(1.04, WITHIN_NOISE), (0.96, WITHIN_NOISE), (1.2, FASTER), (0.8, SLOWER)])
def test_compare_figures_uses_the_noise_threshold(a, verdict):
    assert wording.compare_figures(a, 1.0, noise=0.05).verdict == verdict


def test_words_name_the_other_side_and_explain_noise_once():
    assert wording.words(FASTER, "fp32") == "faster than fp32"
    assert wording.words(SLOWER) == "slower"
    assert wording.words(WITHIN_NOISE, "fp32") == "within noise of fp32"
    assert wording.words(NO_SPREAD, "fp32") == "no spread recorded"
    assert wording.times(1.234) == "1.23 times"
    assert wording.Comparison(0.5, SLOWER).words("x", slower="own words") == "own words"


def test_every_language_words_every_verdict():
    for lang, table in wording.MESSAGES.items():
        for verdict in wording.VERDICTS:
            assert wording.words(verdict, "x", lang=lang)
        assert {"than", "of", "noise", "times"} <= set(table)


def test_pick_refuses_a_verdict_without_a_template():
    assert wording.pick(WITHIN_NOISE, within_noise="n", faster="f") == "n"
    with pytest.raises(KeyError, match="no template"):
        wording.pick(SLOWER, faster="f")


# --------------------------------------------------------------------------- chapter 3


def loader_row(workers: int, img_s: float, compute_ms: float, spread: float | None = 0.02, persistent=False,
               start_ms=None) -> dict:
    found = row(f"workers={workers}", img_s, spread, **{"data ms": 10.0, "compute ms": compute_ms,
                                                       "epoch-start data ms": start_ms})
    found["knobs"] = {"workers": workers, "persistent_workers": persistent}
    return found


def test_loader_finding_maps_verdicts_and_reads_the_answers():
    slower = speed_findings.loader(result([loader_row(0, 10.0, 90.0), loader_row(1, 8.0, 120.0, start_ms=50.0),
                                           loader_row(1, 9.5, 95.0, persistent=True, start_ms=5.0)]))
    assert slower["verdict"] == SLOWER and slower["compute_slowed"]
    assert slower["epoch start ms"] == (50.0, 5.0)
    assert slower["trend"] == SLOWER and slower["compute trend"] == pytest.approx(120 / 90 - 1)
    noisy = speed_findings.loader(result([loader_row(0, 10.0, 90.0, 0.2), loader_row(2, 11.0, 90.0, 0.2)]))
    assert noisy["verdict"] == WITHIN_NOISE and not noisy["compute_slowed"] and noisy["epoch start ms"] is None
    assert noisy["trend"] == WITHIN_NOISE
    too_large = speed_findings.loader(result([loader_row(0, 10.0, 90.0, None), loader_row(2, 13.0, 70.0, None)]))
    assert too_large["verdict"] == speed_findings.TOO_LARGE and too_large["spread"] == NO_DIFFERENCE
    assert too_large["trend"] == FASTER  # compute shrank beyond the no-difference threshold


def _sweep(rows: list[dict]) -> BenchResult:
    return BenchResult("loader", "t", rows, [])


def _row(workers: int, img_s: float, compute_ms: float, spread: float | None = None) -> dict:
    row = {"setting": f"workers={workers}", "img/s": img_s, "data ms": 10.0, "compute ms": compute_ms,
           "knobs": {"workers": workers, "persistent_workers": False}}
    if spread is not None:
        row["img/s lo"], row["img/s hi"] = img_s * (1 - spread), img_s * (1 + spread)
    return row


def test_loader_verdict_bounds_what_workers_can_save():
    slower = speed_findings.loader(_sweep([_row(0, 10.0, 90.0, 0.02), _row(1, 8.0, 120.0, 0.02)]))
    assert slower["verdict"] == SLOWER and slower["ratio"] == pytest.approx(0.8)
    assert slower["bound"] == pytest.approx(0.1) and slower["compute change"] == pytest.approx(1 / 3)
    noisy = speed_findings.loader(_sweep([_row(0, 10.0, 90.0, 0.2), _row(1, 11.0, 90.0, 0.2)]))
    assert noisy["verdict"] == WITHIN_NOISE
    # without a spread: the sweeps' no-difference threshold decides
    flat = speed_findings.loader(_sweep([_row(0, 10.0, 90.0), _row(2, 10.0 * (1 + NO_DIFFERENCE / 2), 90.0)]))
    assert flat["verdict"] == WITHIN_NOISE
    # data is 10 ms of a 100 ms step: workers can save at most 10 %
    assert speed_findings.loader(_sweep([_row(0, 10.0, 90.0), _row(2, 11.0, 90.0)]))["verdict"] == FASTER
    assert (speed_findings.loader(_sweep([_row(0, 10.0, 90.0), _row(2, 13.0, 90.0)]))["verdict"]
            == speed_findings.TOO_LARGE)


# --------------------------------------------------------------------------- chapter 4


def speed_row(setup: str, speedup: float, devices: int, threads: int | None = None, spread: float = 0.02) -> dict:
    return {**row(setup, 5.0 * speedup, spread), "threads/process": threads, "total MiB": 1000.0 * devices,
            "speedup": speedup, "scaling efficiency": speedup / devices,
            "speedup lo": speedup * (1 - spread), "speedup hi": speedup * (1 + spread)}


HOSTS = {
    "2-core CPU": [speed_row("Single (1 process x 1 thread)", 1.0, 1, 1),
                   speed_row("Single (1 process x 2 threads)", 1.3, 2, 2),
                   {"setup": "DP(2)", "note": "DataParallel needs >= 2 GPUs"},
                   speed_row("DDP(2) (2 processes x 1 thread)", 1.8, 2, 1),
                   speed_row("2 processes without gradient all-reduce", 1.9, 2, 1)],
    "1 GPU": [speed_row("Single GPU", 1.0, 1), {"setup": "DP", "note": "DataParallel needs >= 2 GPUs"},
              {"setup": "DDP", "note": "DDP needs >= 2 GPUs"}],
    "8 GPUs": [speed_row("Single GPU", 1.0, 1), speed_row("DP(8)", 5.0, 8), speed_row("DDP(8)", 7.2, 8)],
}


@pytest.mark.parametrize("slower, verdict", [(True, SLOWER), (False, FASTER), (None, WITHIN_NOISE)])
def test_own_work_verdict(slower, verdict):
    summary = {"own work alone": (100.0, 90, 110), "own work under DDP": (130.0, 120, 140), "slower_under_ddp": slower,
               "transfer": (5.0, 4, 6), "step under DDP": (200.0, 190, 210)}
    found = speed_findings.own_work(summary)
    assert found["verdict"] == verdict and found["slowdown"] == pytest.approx(0.3)
    assert found["transfer share"] == pytest.approx(0.025)


def test_allreduce_cost_is_within_noise_on_a_busy_machine():
    rows = HOSTS["2-core CPU"]
    assert speed_findings.allreduce_cost(result(rows)).verdict == SLOWER
    busy = result(rows, cache={"other load": 0.9})
    assert speed_findings.allreduce_cost(busy).verdict == WITHIN_NOISE
    assert speed_findings.allreduce_cost(result(HOSTS["8 GPUs"])) is None


# --------------------------------------------------------------------------- chapters 5 and 7


def test_against_first_compares_each_setting_with_the_first():
    found = speed_findings.against_first(result([row("fp32", 10.0), {"setting": "fp16", "note": "skipped"},
                                                 row("bf16", 15.0), row("x", 10.1)]))
    assert [(r["setting"], c.verdict) for r, c in found] == [("bf16", FASTER), ("x", WITHIN_NOISE)]
    assert found[0][1].ratio == pytest.approx(1.5)


def accum_row(batch: int, accum: int, img_s: float, peak: float) -> dict:
    return {**row(f"{batch} x {accum}", img_s), "peak MiB/device": peak,
            "knobs": {"batch_size": batch, "accum_steps": accum}}


def test_accumulation_sets_k_micro_batches_beside_one_large_batch():
    sweep = result([accum_row(2, 1, 10.0, 500), accum_row(8, 1, 12.0, 900), accum_row(2, 4, 9.0, 600)])
    found = speed_findings.accumulation(sweep)
    assert (found["k"], found["micro"]) == (4, 2) and found["large"]["peak MiB/device"] == 900
    assert found["comparison"].verdict == SLOWER and found["single"]["peak MiB/device"] == 500
    assert speed_findings.accumulation(None) is None
    assert speed_findings.accumulation(result([accum_row(2, 1, 10.0, 500)])) is None


# --------------------------------------------------------------------------- chapter 9


@pytest.mark.parametrize("processes", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("per_process", [1, 2, 4])
def test_split_batches_shares_the_same_images_evenly(processes, per_process):
    uneven, even = speed_findings.split_batches(per_process, processes)
    assert len(even) == len(uneven) == processes
    assert sum(even) == sum(uneven) and max(even) - min(even) <= 1
    assert max(uneven) > min(uneven) or per_process == 1  # one image cannot be split unevenly


def run(batches: list[int], step_s: float, steps: list[float] | None, warnings=()) -> dict:
    return {"batch per rank": batches, "step s": step_s, "step s all": steps, "forward s per rank": [0.1, 0.3],
            "warnings": list(warnings)}


@pytest.mark.parametrize("uneven_steps, even_steps, uneven_s, verdict", [
    ([1.5, 1.5, 1.6], [1.0, 1.0, 1.1], 1.5, FASTER),
    ([1.0, 1.5, 2.0], [1.0, 1.2, 1.5], 1.5, WITHIN_NOISE),
    ([1.0, 1.0, 1.1], [1.5, 1.5, 1.6], 1.0, SLOWER),
    (None, None, 1.5, NO_SPREAD),
    (None, None, 0.9, SLOWER)])
def test_imbalance_verdicts(uneven_steps, even_steps, uneven_s, verdict):
    found = speed_findings.imbalance(run([1, 3], uneven_s, uneven_steps, ["slow rank 1"]), run([2, 2], 1.0, even_steps))
    assert found["verdict"] == verdict and found["cost"] == pytest.approx(uneven_s - 1)
    assert found["expected"] == pytest.approx(0.5) and found["forward ratio"] == pytest.approx(3) and found["warned"]


# --------------------------------------------------------------------------- chapter 11


def test_fast_path_and_time_to_accuracy():
    fast = speed_findings.fast_path(result([row("eager", 10.0), row("fixed", 12.0), {"setting": "compiled"}]))
    assert fast["best"]["setting"] == "fixed" and fast["ratio"] == pytest.approx(1.2)
    key = "first eval with segm_AP50 >= 0.3"
    tta = result([{"variant": "eager", key: 40, "training s to it": 100.0, "of it compiling s": 0.0},
                  {"variant": "fast", key: 40, "training s to it": 80.0, "of it compiling s": 20.0},
                  {"variant": "never", key: None, "training s to it": None, "of it compiling s": 0.0}],
                 metric="segm_AP50", target=0.3)
    found = speed_findings.time_to_accuracy(tta)
    fast_run, never = found["variants"]
    assert found["eager"].step == 40 and fast_run.ratio == pytest.approx(0.8)
    assert fast_run.ratio_without_compiling == pytest.approx(0.6)
    assert never.step is None and never.ratio is None and not found["same_step"]


# --------------------------------------------------------------------------- scale findings (chapters 1, 8, 9)


def noise_row(batch: int, noise: float, se: float | None) -> dict:
    return {"batch size": batch, "relative gradient noise": noise, "noise SE": se}


@pytest.mark.parametrize("last, verdict", [(0.13, WITHIN_NOISE), (0.5, SLOWER), (0.01, FASTER)])
def test_gradient_noise_against_the_one_over_b_line(last, verdict):
    found = scale_findings.gradient_noise([noise_row(1, 1.0, 0.05), noise_row(8, last, 0.01)])
    assert found["verdict"] == verdict and found["ideal"] == pytest.approx(0.125)
    assert found["factor"] == pytest.approx(1 / last) and found["predicted factor"] == 8


def test_run_health_splits_the_peak_growth_in_halves():
    rows = [{"data_time": d, "iter_time": 1.0, "max_mem_mb": m} for d, m in [(0.1, 100), (0.3, 150), (0.2, 160),
                                                                            (0.5, 170)]]
    found = scale_findings.run_health(rows)
    assert found["data share"] == pytest.approx(0.3) and found["peak MiB"] == 170
    assert (found["first half MiB"], found["second half MiB"], found["half"], found["rest"]) == (50, 20, 2, 2)


PAPER = [{"link": link, "devices": n, "all-reduce ms": ms, "speedup not overlapped": n * eff,
          "speedup overlapped": n * min(1.0, eff + 0.05), "efficiency not overlapped": eff,
          "efficiency overlapped": min(1.0, eff + 0.05)}
         for link, n, ms, eff in [("measured here (gloo)", 2, 50.0, 0.8), ("PCIe 3", 4, 30.0, 0.95),
                                  ("PCIe 3", 8, 35.0, 0.93), ("PCIe 3", 64, 40.0, 0.85), ("NVLink", 8, 5.0, 0.99)]]


def top(speedup: float, spread: float | None = 0.02) -> dict:
    found = {"devices": 2, "speedup": speedup}
    if spread is not None:
        found["speedup lo"], found["speedup hi"] = speedup * (1 - spread), speedup * (1 + spread)
    return found


@pytest.mark.parametrize("point, busy, verdict", [
    (top(1.8), True, scale_findings.BUSY), (top(2.5), False, scale_findings.ABOVE_DEVICES),
    (top(1.8), False, FASTER), (top(1.6), False, WITHIN_NOISE), (top(1.2), False, SLOWER),
    (top(1.2, None), False, NO_SPREAD)])
def test_curve_against_paper(point, busy, verdict):
    found = scale_findings.curve_against_paper(point, PAPER, busy, "measured here")
    assert found["verdict"] == verdict and found["bounds"] == pytest.approx((1.6, 1.7))


def test_the_first_inefficient_row():
    assert scale_findings.first_inefficient(PAPER, 0.9)["devices"] == 2
    assert scale_findings.first_inefficient(PAPER[1:3], 0.9) is None


# --------------------------------------------------------------------------- a speed table's sentences


def _spread(row, lo, hi):
    return {**row, "speedup lo": lo, "speedup hi": hi, "img/s lo": row["img/s"] * lo / row["speedup"],
            "img/s hi": row["img/s"] * hi / row["speedup"]}


def _measured(setup, speedup, devices, threads=None, processes=1):
    return {"setup": setup, "processes": processes, "threads/process": threads, "img/s": 4.0 * speedup,
            "speedup": speedup, "scaling efficiency": speedup / devices, "peak MiB/device": 1000.0,
            "total MiB": 1000.0 * processes}


def _cpu_table(ddp_range, ceiling_range):
    """The rows of `bench.table` on 2 CPU processes, labelled as the bench labels them."""
    rows = [_spread(_measured(english("bench.single_thread", threads=1), 1.0, 1, 1), 1.0, 1.0),
            _spread(_measured(english("bench.single_threads", threads=2), 1.3, 2, 2), 1.2, 1.4),
            {"setup": "DP(2)", "processes": 1, "note": english("dataparallel.needs_gpus", gpus=0)},
            _spread(_measured(english("bench.ddp_thread", n=2, threads=1), 1.8, 2, 1, 2), *ddp_range),
            _spread(_measured(english("bench.without_allreduce", n=2), 1.9, 2, 1, 2), *ceiling_range)]
    return BenchResult("table", "t", rows, [], [], {})


def test_table_verdicts_say_within_noise_when_the_ranges_overlap():
    noisy = scale_findings.table_verdicts(_cpu_table((1.6, 2.0), (1.7, 2.0)))
    assert noisy["result"] == ("Here DDP(2) (2 processes x 1 thread) reached 1.80x (IQR 1.60-2.00x) the speed of "
                               "Single (1 process x 1 thread), a scaling efficiency of 90 %.")
    assert noisy["allreduce"].endswith(": the ranges overlap, so the all-reduce cost "
                                    "nothing measurable here.")
    assert "DDP's processes beat" in noisy["threads"]
    assert noisy["dp"].startswith("There is no DP row: DataParallel needs >= 2 GPUs")
    assert "DDP(2) (2 processes x 1 thread): 1000 MiB per device, 2000 MiB in all" in noisy["memory"]
    clear = scale_findings.table_verdicts(_cpu_table((1.75, 1.82), (1.88, 1.95)))
    assert "whole range lies below, so here the all-reduce cost about 5 %" in clear["allreduce"]
    flat = scale_findings.table_verdicts(_cpu_table((0.9, 1.5), (1.7, 2.0)))
    assert "Its range includes 1x: whether DDP was faster at all is within noise" in flat["result"]
    superlinear = scale_findings.table_verdicts(_cpu_table((2.1, 2.6), (1.7, 2.0)))
    assert "more than 2 devices' worth" in superlinear["result"] and "cannot tell how DDP scales" in \
        superlinear["result"]


def test_table_verdicts_on_one_and_eight_gpus():
    one = BenchResult("table", "t", [_measured("Single GPU", 1.0, 1), {"setup": "DP", "note": "DataParallel needs "
                      ">= 2 GPUs; this machine has 1"}, {"setup": "DDP", "note": "DDP needs >= 2 GPUs"}], [], [], {})
    verdicts = scale_findings.table_verdicts(one)
    assert "single device" in verdicts["result"] and verdicts["allreduce"] == "" and verdicts["threads"] == ""
    eight = BenchResult("table", "t", [_spread(_measured("Single GPU", 1.0, 1), 1.0, 1.0),
                                       _spread(_measured("DP(8)", 5.0, 8), 4.6, 5.3),
                                       _spread(_measured("DDP(8)", 7.2, 8, processes=8), 7.0, 7.4)], [], [], {})
    verdicts = scale_findings.table_verdicts(eight)
    assert verdicts["dp"].startswith("At the same 8 GPUs, DataParallel reached 5.00x")
    assert verdicts["dp"].endswith("DDP was faster, with the method the only difference.")


def test_a_busy_machine_makes_every_table_comparison_within_noise():
    table = _cpu_table((1.75, 1.82), (1.88, 1.95))
    table.provenance = {"cache": {"other load": 0.7}}
    verdicts = scale_findings.table_verdicts(table)
    assert "70% of this machine's cores busy" in verdicts["result"]
    assert "measured on a busy machine, so what the all-reduce cost cannot be told" in verdicts["allreduce"]
    assert verdicts["threads"].endswith("within noise of DDP.")


def _alone(workers: list[float], main: list[float]) -> BenchResult:
    return BenchResult("workers", "t", [{"worker cpu ms/image": w, "main cpu ms/image": m} for w, m in zip(workers, main)], [])


@pytest.mark.parametrize("workers_after, main_after, lighter", [
    ([5.0, 5.2], [0.7, 0.8], "both"),        # every repeat below every earlier one, for both
    ([5.0, 6.5], [0.7, 0.8], "main"),        # one worker repeat inside the earlier range
    ([5.0, 5.2], [0.7, 0.95], "workers"),
    ([6.2, 6.9], [0.9, 1.0], "neither"),
])
def test_workers_alone_names_only_what_every_repeat_lowered(workers_after, main_after, lighter):
    found = speed_findings.workers_alone(_alone(workers_after, main_after), _alone([6.1, 6.8, 7.0], [0.9, 1.0, 1.1]))
    assert found["lighter"] == lighter
    assert found["workers before"] == 6.8 and found["main before"] == 1.0 and found["repeats"] == 2
    assert found["workers after"] == pytest.approx(sum(workers_after) / 2)


def test_pooled_pairs_pool_the_runs_that_kept_their_pairs():
    def run(ratios):
        row = {"vs bare %": 0.0} if ratios is None else {"vs bare %": 0.0, "pair ratios": ratios}
        return BenchResult("pipeline", "t", [row, {}], [], [], {})

    assert speed_findings.pooled_pairs([run(None)]) is None  # runs from before the pairs were kept
    found = speed_findings.pooled_pairs([run(None), run([0.9, 1.0, 1.1]), run([1.02, 1.04, 1.06, 1.08])])
    assert (found["runs"], found["pairs"]) == (2, 7) and found["median %"] == pytest.approx(4.0)
    assert found["lo %"] <= found["median %"] <= found["hi %"] and found["lo %"] >= -10 and found["hi %"] <= 10
    assert speed_findings.pooled_pairs([run([0.9, 1.0, 1.1]), run([1.02, 1.04, 1.06, 1.08])]) == found  # seeded


def test_fastest_names_a_row_only_when_it_is_ahead_of_every_other():
    """Chapter 6's answer on a GPU named the top median and the top 'all steps' figure whatever the spread
    (review-3: nothing on a page ranks settings whose ranges overlap)."""
    apart = [row("a", 10.0, **{"img/s all steps": 8.0}), row("b", 13.0, **{"img/s all steps": 9.0})]
    assert speed_findings.fastest(apart) == (apart[1], apart[1])
    overlapping = [row("a", 10.0, 0.3, **{"img/s all steps": 8.0}), row("b", 11.0, 0.3, **{"img/s all steps": 8.2})]
    assert speed_findings.fastest(overlapping) == (None, None)
