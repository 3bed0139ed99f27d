"""tools/gpu_check.sh on a CPU: the GPU suite's budget at the check's --max-minutes, its file written after
every part with each part bounded through the launcher, and the chapter runner saving a notebook cut at
its deadline and killing what its kernel started. (`bash tools/gpu_check.sh --rehearse` runs the whole
check here.)"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch

from maskrcnn_tut.errors import BenchError
from maskrcnn_tut.lab import bench, processes
from maskrcnn_tut.lab.bench import gpu, harness
from maskrcnn_tut.lab.stored.across_builds import timing_row

TOOLS = Path(__file__).resolve().parents[2] / "tools"
BENCH_MINUTES = 3.5  # the suite's minutes in the first H200 check (2026-12-04)


def load_runner():
    spec = importlib.util.spec_from_file_location("run_chapters", TOOLS / "run_chapters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("minutes, gpus", [(BENCH_MINUTES, 1), (8.0, 8)])  # the check's device; the default
def test_the_budget_runs_amp_cudnn_and_channels_last(minutes, gpus):
    budgets = {part.name: (part, budget) for part, budget in gpu.plan(minutes, gpus)}
    for name in ("table", "amp", "cudnn", "channels_last"):
        part, budget = budgets[name]
        assert budget >= part.minimum_s >= gpu.STARTUP_S + gpu.SETTING_S * part.settings
        assert part.max_seconds(budget) >= 3
    assert sum(budget for _, budget in budgets.values()) <= 60 * minutes
    assert budgets["fast_path_compiled"][1] == 0  # no cold compiles in these few minutes


def test_the_compiled_rows_get_their_minutes_only_when_the_budget_has_them():
    assert dict((p.name, b) for p, b in gpu.plan(10, 1))["fast_path_compiled"] == gpu.COMPILED_LEFT_S
    assert dict((p.name, b) for p, b in gpu.plan(8, 1))["fast_path_compiled"] == 0


def test_the_suite_writes_its_file_after_every_part_and_bounds_each_through_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=141 * 2**30, major=9, minor=0))
    monkeypatch.setattr(gpu, "provenance", lambda command: {"hardware": "1x Test GPU", "date": "2026-12-02T00:00",
                                                               "command": command})
    seen = []

    def fake(name):
        def runner(preset, steps, warmup, max_seconds, **kwargs):
            path = tmp_path / "1x-test-gpu-2026-12-02.json"
            written = json.loads(path.read_text())["results"] if path.exists() else {}
            seen.append((name, sorted(written), harness._DEADLINES[-1] - time.monotonic(), max_seconds))
            if name == "cudnn":
                raise RuntimeError("cuDNN said no")
            return type("Result", (), {"to_dict": lambda self: {"rows": [name]}})()
        return runner

    for name, attr in [("table", "table"), ("amp", "sweep_amp"), ("cudnn", "sweep_cudnn"),
                       ("channels_last", "sweep_channels_last"), ("fast_path", "sweep_fast_path")]:
        monkeypatch.setattr(gpu, attr, fake(name))
    path = gpu.gpu_suite(BENCH_MINUTES, tmp_path)
    order = ["table", "amp", "cudnn", "channels_last", "fast_path"]
    assert [name for name, *_ in seen] == order
    # each part sees the file with every part before it (incremental writes)
    assert [written for _, written, *_ in seen] == [sorted(order[:i]) for i in range(len(order))]
    # the launcher's timeout: the time left less the later parts' minima, never below the part's own budget
    budgets = dict((p.name, b) for p, b in gpu.plan(BENCH_MINUTES, 1))
    for name, _, timeout, _ in seen[:4]:
        assert budgets[name] - 1 <= timeout <= 60 * BENCH_MINUTES
    data = json.loads(path.read_text())
    assert data["results"]["cudnn"] == {"error": "RuntimeError: cuDNN said no"}
    assert data["provenance"]["skipped_for_time"] == ["fast_path_compiled"]  # < COMPILED_LEFT_S left
    assert set(data["provenance"]["seconds"]) == set(order)

    # a second run of the part that failed keeps the day's other parts and says what ran before
    seen.clear()
    monkeypatch.setattr(gpu, "sweep_cudnn", fake("cudnn again"))
    assert gpu.gpu_suite(2, tmp_path, parts=["cudnn"]) == path
    assert [name for name, *_ in seen] == ["cudnn again"]
    again = json.loads(path.read_text())
    assert again["results"] == {**data["results"], "cudnn": {"rows": ["cudnn again"]}}
    assert set(again["provenance"]["seconds"]) == set(order)
    assert again["provenance"]["command"].endswith("--parts cudnn")
    assert again["provenance"]["earlier_commands"] == [f"2026-12-02T00:00: {data['provenance']['command']}"]
    with pytest.raises(BenchError, match="no part named cudnnn"):
        gpu.gpu_suite(2, tmp_path, parts=["cudnnn"])


def test_chapter_8_shows_each_gpu_file_with_its_failed_and_skipped_parts(tmp_path, monkeypatch, capsys):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda item: shown.append(item))
    gpu.write_suite(tmp_path / "1x-test-gpu-2026-12-02.json",
                    {"hardware": "1x Test GPU", "date": "2026-12-02T00:00", "command": "suite", "seconds": {},
                     "skipped_for_time": ["channels_last"], "earlier_commands": ["2026-12-01T00:00: first"]},
                    {"amp": {"name": "amp", "title": "AMP", "columns": ["setting", "img/s"], "notes": [],
                             "provenance": {}, "rows": [{"setting": "fp32", **timing_row([0.5, 0.4, 0.6], 2)}]},
                     "cudnn": {"error": "WorkerError: launch timed out"}})
    bench.show_gpu_results(tmp_path)
    assert "`2026-12-01T00:00: first`; `2026-12-02T00:00: suite`" in shown[0].data
    assert shown[1].name == "amp" and "img/s IQR" in shown[1].columns  # the spread beside the median
    printed = capsys.readouterr().out
    assert "cudnn: did not finish: WorkerError: launch timed out" in printed and "channels_last" in printed
    bench.show_gpu_results(tmp_path / "empty")
    assert "No GPU results" in capsys.readouterr().out


def test_launch_measure_ends_within_its_launch_deadline(monkeypatch):
    asked = {}
    monkeypatch.setattr(processes, "launch", lambda fn, n, *args, **kw: asked.update(kw) or [None])
    with harness.launch_deadline(5):
        harness.launch_measure(None, 1, [{}], threads=1)
    assert 4 < asked["timeout_s"] <= 5
    with harness.launch_deadline(-1), pytest.raises(BenchError, match="no time left"):
        harness.launch_measure(None, 1, [{}], threads=1)


def test_a_setting_stops_at_its_deadline_after_one_measured_step_at_least():
    cfg = harness.bench_config("cpu-tiny", workers=0)
    started = time.monotonic()
    cut = harness.measure(cfg, steps=500, warmup=2, deadline=started + 1.0)
    assert cut.cut and 1 <= len(cut.iter_times) < 500 and time.monotonic() - started < 30
    whole = harness.measure(cfg, steps=2, warmup=1, deadline=time.monotonic() + 600)
    assert not whole.cut and len(whole.iter_times) == 2


def test_one_process_shares_the_launch_time_among_its_settings(monkeypatch):
    deadlines = []
    monkeypatch.setattr(harness, "pin_cores", lambda threads: None)
    monkeypatch.setattr(harness, "measure", lambda cfg, **options: deadlines.append(options["deadline"]))
    until = time.monotonic() + 40
    harness.measure_worker(harness.bench_config("cpu-tiny"), [{}, {}, {}, {}], until)
    # the measure stub returns at once, so each setting in turn gets a quarter, a third, a half, all of what is left
    assert [round(d - until + 40 * (1 - share)) for d, share in zip(deadlines, (1 / 4, 1 / 3, 1 / 2, 1))] == [0] * 4


def test_the_chapters_rotate_by_day_unless_named():
    runner = load_runner()
    day = datetime.date(2026, 12, 2)
    groups = {tuple(p.stem for p in runner.chosen(None, day + datetime.timedelta(days=i)))
              for i in range(len(runner.ROTATION))}
    assert groups == {(name,) for name in runner.ROTATION}
    assert all((runner.BOOK / f"{name}.ipynb").exists() for name in runner.ROTATION)
    assert [p.stem for p in runner.chosen("05,11")] == ["05_mixed_precision", "11_beyond_the_article"]


@pytest.mark.system
def test_a_chapter_cut_at_its_deadline_is_saved_and_what_it_started_is_killed(tmp_path):
    runner = load_runner()
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import subprocess\n"  # like torchrun's workers: a session of its own
                                  "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
                                  "q = subprocess.Popen(['sleep', '300'])\nprint(p.pid, q.pid)"),
        nbformat.v4.new_code_cell("import time\ntime.sleep(300)")])
    nbformat.write(nb, tmp_path / "sleepy.ipynb")
    runner.adopt_orphans()
    started = time.monotonic()
    _, status = runner.run_chapter(tmp_path / "sleepy.ipynb", tmp_path / "out" / "sleepy.ipynb", 15)
    assert time.monotonic() - started < 30
    assert status == "cut at its 15 s deadline after 1 of 2 code cells"
    saved = nbformat.read(tmp_path / "out" / "sleepy.ipynb", as_version=4)
    assert saved.metadata["gpu_check"]["status"].startswith("cut at")
    pids = [int(pid) for pid in saved.cells[0].outputs[0]["text"].split()]
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
