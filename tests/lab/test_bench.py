"""bench: the measurement, the speed table from the shell, a sweep, results files and the GPU suite's refusal.

Tiny settings (64 px images, a few steps): these check the machinery, not the speed. The speed
criteria are measured on a quiet machine with the commands in the README's benchmark section.
"""
from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest
import torch
from conftest import subprocess_env

from maskrcnn_tut import config, engine
from maskrcnn_tut.errors import BenchError
from maskrcnn_tut.lab import bench, provenance, rig
from maskrcnn_tut.lab.bench import sweeps
from maskrcnn_tut.lab.stored.result import BenchResult

TINY = dict(min_size=64, max_size=96, batch_size=2)


def test_measure_times_the_training_step_after_warmup():
    seen = []
    cfg = bench.bench_config("cpu-tiny", **TINY)
    measured = bench.measure(cfg, steps=3, warmup=1, shape="fixed", callbacks=[seen.append])
    assert [r.step for r in seen] == [2, 3, 4]  # warm-up step 1 excluded
    assert len(measured.iter_times) == 3 and measured.images_per_step == 2
    assert measured.processes == 1 and measured.threads == torch.get_num_threads()
    row = measured.row()
    assert row["img/s"] == pytest.approx(2 / sorted(measured.iter_times)[1])
    assert row["peak MiB/device"] > 100 and row["data ms"] < row["compute ms"]
    # the settings train.py runs with (config.derive): lr scaled from the reference batch to this one
    derived = config.derive(cfg, 1, "cpu")
    assert measured.lr == derived.scaled_lr == pytest.approx(cfg.lr * (2 / config.REFERENCE_BATCH) ** 0.5)
    factor = engine.lr_schedule(cfg.warmup_steps, rig.LONG_SCHEDULE, cfg.lr_decay)
    assert [r.lr for r in seen] == pytest.approx([derived.scaled_lr * factor(r.step - 1) for r in seen])
    with pytest.raises(ValueError, match="natural, fixed or varying"):
        bench.measure(cfg, steps=1, warmup=0, shape="square")


@pytest.mark.system
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU table")
def test_table_from_the_shell_writes_json_with_provenance(tmp_path):
    out = tmp_path / "t.json"
    command = [sys.executable, "-m", "maskrcnn_tut.lab.bench", "table", "--preset", "cpu-tiny", "--steps", "2",
               "--warmup", "1", "--min-size", "64", "--max-size", "96", "--batch-size", "2", "--nprocs", "2",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = BenchResult.load(out)
    setups = [row["setup"] for row in result.rows]
    assert setups[0].startswith("Single (1 process x 1 thread)") and setups[-1] == "2 processes without gradient all-reduce"
    assert any(s.startswith("DP(2)") for s in setups)
    dp_row = next(row for row in result.rows if row["setup"].startswith("DP(2)"))
    assert "needs >= 2 GPUs" in dp_row["note"] and dp_row.get("img/s") is None
    first = result.rows[0]
    ddp = next(row for row in result.rows if row["setup"].startswith("DDP(2)"))
    assert result.rows[-1]["img/s"] > 0 and "ceiling" in result.rows[-1]["note"]
    assert first["speedup"] == 1.0 and ddp["processes"] == 2 and ddp["threads/process"] == 1
    assert ddp["speedup"] == pytest.approx(ddp["img/s"] / first["img/s"])
    assert ddp["scaling efficiency"] == pytest.approx(ddp["speedup"] / 2)
    assert ddp["total MiB"] == pytest.approx(2 * ddp["peak MiB/device"], rel=0.3)
    for key in ("cpu", "cores", "gpus", "torch", "cuda", "cudnn", "nccl", "date"):
        assert key in result.provenance
    assert result.provenance["command"] == "python -m maskrcnn_tut.lab.bench " + " ".join(command[3:])
    assert "| setup |" in done.stdout and "Speed table" in done.stdout


@pytest.mark.system
def test_sweep_reports_each_setting_and_what_made_no_difference():
    result = bench.sweep_accum("cpu-tiny", accum_steps=(1, 2), steps=2, warmup=1, **TINY)
    assert [row["setting"] for row in result.rows] == [
        "batch 2 x accum 1 (2 images/step)", "batch 2 x accum 2 (4 images/step)", "batch 4 x accum 1 (4 images/step)"]
    assert all(row["img/s"] > 0 and row["peak MiB/device"] > 0 for row in result.rows)
    assert any(note.startswith("4 images per step: 2 micro-batches of 2 peaked at") for note in result.notes)
    assert json.loads(json.dumps(result.to_dict()))["rows"][0]["knobs"]["accum_steps"] == 1


def spread_row(setting: str, img_s: float, spread: float = 0.02, **knobs) -> dict:
    return {"setting": setting, "img/s": img_s, "img/s lo": img_s * (1 - spread), "img/s hi": img_s * (1 + spread),
            "knobs": knobs}


def test_knob_note_compares_rows_that_differ_only_in_that_knob():
    rows = [spread_row(f"w{w} p{p}", speed, workers=w, persistent=p)
            for w, p, speed in [(0, False, 10.0), (1, False, 10.2), (1, True, 13.0)]]
    assert "no measurable difference" in sweeps.knob_note(rows[:2], "workers", "the loader keeps up.")
    note = sweeps.knob_note(rows, "persistent", "")
    assert "27%" in note and "best of those: w1 pTrue" in note
    sized = [{"setting": f"{size} px", "img/s": 100.0 / size, "peak MiB/device": size * 2.0,
              "knobs": {"min_size": size, "max_size": size, "steps": steps}} for size, steps in [(64, 8), (128, 4)]]
    assert "fewer than two" in sweeps.knob_note(sized, "min_size", "")
    assert "best of those: 64 px" in sweeps.knob_note(sized, "min_size", "", key="peak MiB/device",
                                                      moves_with=("max_size",))  # memory is not timed: it ranks
    assert "fewer than two" in sweeps.knob_note(rows[:1], "workers", "")


def test_knob_note_ranks_only_settings_whose_ranges_lie_apart():
    """M3 (book-review-3): the notes under the sweep tables gave verdicts the book's rule forbids."""
    apart = [spread_row("fp32 (no autocast)", 10.0, amp=False, amp_dtype=None),
             spread_row("bf16 autocast", 14.0, amp=True, amp_dtype="bfloat16")]
    # fp32 is compared too (it differs in `amp`, which moves with the dtype): not "fewer than two settings"
    assert "best of those: bf16 autocast" in sweeps.knob_note(apart, "amp_dtype", "", moves_with=("amp",))
    overlapping = [spread_row("fp32 (no autocast)", 10.0, 0.3, amp=False, amp_dtype=None),
                   spread_row("bf16 autocast", 12.0, 0.3, amp=True, amp_dtype="bfloat16")]
    note = sweeps.knob_note(overlapping, "amp_dtype", "", moves_with=("amp",))
    assert "ranges overlap" in note and "best" not in note and "20%" in note
    no_spread = [{**row, "img/s all steps": row["img/s"]} for row in apart]
    note = sweeps.knob_note(no_spread, "amp_dtype", "", key="img/s all steps", moves_with=("amp",))
    assert "no spread recorded" in note and "best" not in note


def test_knob_note_on_the_committed_h200_amp_rows_ranks_nothing():
    from maskrcnn_tut.lab import book
    from maskrcnn_tut.lab.stored.result import load_suite
    _, parts, _ = load_suite(book.RESULTS / "1x-nvidia-h200-2026-12-04.json")
    rows = parts["amp"].rows
    assert "best of those" in str(parts["amp"].notes[0])  # what the suite wrote then
    for key in ("img/s", "img/s all steps"):
        note = sweeps.knob_note(rows, "amp_dtype", "", key=key, moves_with=("amp",))
        assert "best" not in note and ("ranges overlap" in note or "no spread" in note)


def test_result_round_trips_and_renders(tmp_path):
    result = BenchResult("amp", "AMP", [{"setting": "fp32", "img/s": 2.0, "peak MiB/device": 900.0}],
                         bench.SWEEP_COLUMNS, ["bf16 skipped: no bf16 instructions"], provenance.provenance("test"))
    again = BenchResult.load(result.save(tmp_path / "r.json"))
    assert again == result
    assert "| fp32 | 2 |" in again.to_markdown() and "- bf16 skipped" in again.to_markdown()
    plt.close(again.plot())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_suite_refuses_plainly_on_a_cpu_machine(capsys):
    assert bench.main(["--suite", "gpu", "--max-minutes", "1"]) == 2
    assert "needs CUDA GPUs and this machine has none" in capsys.readouterr().err


def test_overhead_times_three_loops_on_one_model_and_counts_the_mask_heads_work():
    from maskrcnn_tut.lab.bench.overhead import LOOPS, overhead

    result = overhead("cpu-tiny", image_size=64, batch_size=2, rounds=2, steps=1, warmup=1, max_size=96)
    assert [row["loop"] for row in result.rows] == list(LOOPS)
    bare = result.rows[0]
    assert bare["overhead s"] == 0 and all(row["s/step"] > 0 for row in result.rows)
    for row in result.rows:  # one mean count per round, at least the objects of the batch (gt boxes are positives)
        counts = [float(c) for c in row["mask RoIs/step by round"].split(", ")]
        assert len(counts) == 2 and min(counts) >= 2 * 3


def test_training_seconds_sum_the_windows_and_count_slow_ones_as_compiling():
    from maskrcnn_tut.lab.bench.accuracy import training_seconds

    rows = [{"step": 10, "iter_time": 5.0}, {"step": 20, "iter_time": 0.5}, {"step": 30, "iter_time": 0.5},
            {"step": 35, "iter_time": 0.6}]
    cumulative, compiling = training_seconds(rows, print_freq=10)
    assert cumulative == [(10, 50.0), (20, 55.0), (30, 60.0), (35, 63.0)]
    assert compiling == pytest.approx(50.0 - 5.5)  # the first window, over a window at the median 0.55 s/step


@pytest.mark.system
def test_time_to_accuracy_runs_each_variant_and_finds_the_first_eval_at_target(shapes_root):
    from maskrcnn_tut.lab.bench.accuracy import time_to_accuracy

    tiny = ("--data-path", str(shapes_root), "--max-steps", "4", "--min-size", "64", "--max-size", "96",
            "--batch-size", "2", "--workers", "0")
    result = time_to_accuracy("bbox_AP50", target=0.0, eval_every=2, nprocs=1, print_freq=2, extra_flags=tiny,
                              variants={"eager": (), "fixed shapes": ("--fixed-shapes",)})
    assert [row["variant"] for row in result.rows] == ["eager", "fixed shapes"]
    for row in result.rows:
        assert row["steps"] == 4 and row["first eval with bbox_AP50 >= 0.0"] == 2  # reached at the first eval
        assert [step for step, _, _ in row["curve"]] == [2, 4] and 0 < row["training s to it"] < row["training s, all steps"]
    with pytest.raises(BenchError, match="multiple"):
        time_to_accuracy(eval_every=5, print_freq=10)


def test_chapter_6s_repeat_check_runs_on_the_cpu_on_a_gpu_machine_too(monkeypatch):
    """M5 (book-review-3): chapter 6 prints "two CPU runs ..." under nbval; on a GPU machine the pair runs in a
    fresh process that sees no GPU, so the line is true there and the same as here."""
    from maskrcnn_tut.lab.bench import harness
    seen = {}

    def fake_launch(fn, nprocs, *args, backend=None, **_):
        seen.update(fn=fn, nprocs=nprocs, backend=backend, visible=harness.os.environ.get("CUDA_VISIBLE_DEVICES"))
        return [[1.0], [1.0]]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness.processes, "launch", fake_launch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert bench.cpu_repeated_losses("cfg", 3, 1) == [[1.0], [1.0]]
    assert seen == {"fn": harness.repeated_losses, "nprocs": 1, "backend": "gloo", "visible": ""}
    assert harness.os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # put back
