"""bench.table on every kind of host: 8 gloo processes on 2 cores, a simulated 1-GPU and 8-GPU
machine (device discovery and the launcher patched: the code paths, not the kernels), one core;
a failed benchmark worker reaching the shell as one line; the data sized to the processes."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import subprocess_env

from maskrcnn_tut.errors import BenchError
from maskrcnn_tut.lab import bench
from maskrcnn_tut.lab.bench import scaling


def _fake_measurement(processes: int, images: int) -> bench.Measurement:
    return bench.Measurement(processes=processes, threads=1, images_per_step=images, iter_times=[0.5, 0.5, 0.5],
                             data_times=[0.01] * 3, epoch_starts=[], peak_memory_mb=[1000.0] * processes,
                             steps_per_epoch=4)


@pytest.fixture
def fake_host(monkeypatch):
    """A machine with `gpus` GPUs (0: a CPU machine with `cores` cores); records every launch."""
    launches = []

    def host(gpus: int, cores: int = 16):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index: SimpleNamespace(total_memory=80 * 2**30, major=9, minor=0))
        monkeypatch.setattr(scaling, "usable_cores", lambda: cores)
        monkeypatch.setattr(scaling, "provenance", lambda command: {"hardware": f"{gpus} fake GPUs",
                                                                          "command": command})

        def launch(cfg, nprocs, runs, threads=None):
            launches.append({"cfg": cfg, "nprocs": nprocs, "runs": runs, "threads": threads})
            n_dp = runs[0].get("dataparallel") or 1
            return [_fake_measurement(nprocs * n_dp, cfg.batch_size * nprocs * n_dp) for _ in runs]

        monkeypatch.setattr(scaling, "launch_measure", launch)
        return launches

    return host


def test_one_gpu_table_says_plainly_there_is_no_dp_or_ddp_row(fake_host):
    launches = fake_host(1)
    result = bench.table(steps=3, warmup=1)
    assert [row["setup"] for row in result.rows] == ["Single GPU", "DP", "DDP"]
    assert [launch["nprocs"] for launch in launches] == [1]
    assert result.row("DDP") is None and result.row("DP") is None  # nothing measured: no StopIteration
    assert "needs >= 2 GPUs; this machine has 1" in result.row("DDP", measured=False)["note"]
    assert "needs >= 2 GPUs; this machine has 1" in result.row("DP", measured=False)["note"]
    assert result.row("Single")["speedup"] == 1.0
    assert any("Only the single-GPU row was measured" in note for note in result.notes)
    assert "| DDP |" in result.to_markdown() and "None" not in result.to_markdown()


def test_eight_gpu_table_measures_single_dp_and_ddp_on_all_gpus(fake_host):
    launches = fake_host(8)
    result = bench.table(steps=3, warmup=1)
    assert [row["setup"] for row in result.rows] == ["Single GPU", "DP(8)", "DDP(8)"]
    single, dp, ddp = launches
    assert single["nprocs"] == 1 and "dataparallel" not in single["runs"][0]
    assert dp["nprocs"] == 1 and dp["runs"][0]["dataparallel"] == 8
    assert ddp["nprocs"] == 8
    assert single["cfg"].preset == "gpu-r50" and single["cfg"].batch_size == 8  # the preset's batch on 80 GB cards
    assert result.row("DDP")["speedup"] == pytest.approx(8.0)
    assert result.row("DDP")["scaling efficiency"] == pytest.approx(1.0)
    assert result.row("DP")["GPUs"] == 8 and "threads/process" not in result.columns
    with pytest.raises(BenchError, match="this machine has 8 GPU"):
        bench.table(nprocs=9)


def test_one_gpu_of_eight_and_one_core_tables(fake_host):
    fake_host(8)
    one = bench.table(nprocs=1, steps=3, warmup=1)
    assert one.row("DDP") is None and "nprocs=1" in one.row("DDP", measured=False)["note"]
    launches = fake_host(0, cores=1)
    cpu = bench.table(steps=3, warmup=1)
    assert [row["setup"] for row in cpu.rows] == ["Single (1 process x 1 thread)", "DP(1)", "DDP"]
    assert cpu.row("DDP") is None and "needs >= 2 processes" in cpu.row("DDP", measured=False)["note"]
    assert [launch["nprocs"] for launch in launches[-1:]] == [1]


def test_bench_data_holds_whole_batches_for_every_process():
    cfg = bench.bench_config("cpu-tiny", batches_per_step=8, batch_size=8)
    images = json.loads((bench.bench_dataset(64) / "annotations" / "instances_train2017.json").read_text())["images"]
    assert cfg.data_path == str(bench.bench_dataset(64)) and len(images) >= 2 * 64
    assert bench.bench_config("cpu-tiny", batch_size=2).data_path == str(bench.bench_dataset(1))  # the 32 images
    assert len(json.loads((bench.bench_dataset(1) / "annotations" / "instances_train2017.json")
                          .read_text())["images"]) == bench.BENCH_SHAPES["n_train"]


@pytest.mark.system
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU table")
def test_table_with_more_processes_than_cores():
    """More processes than cores, 11 images each: 33 images per step, more than the 32 the benchmark
    data had (the CPU table's batch of 8 on more than 4 cores), so every worker raised before the
    data was sized to the processes."""
    result = bench.table(nprocs=3, steps=1, warmup=1, min_size=64, max_size=96, batch_size=11)
    setups = [row["setup"] for row in result.rows]
    cores = bench.harness.usable_cores()
    assert setups[0] == f"Single (1 process x {max(1, cores // 3)} thread{'s' * (cores >= 6)})"
    ddp = result.row("DDP(3)")
    assert ddp["processes"] == 3 and ddp["img/s"] > 0 and ddp["steps"] == 1
    assert result.row("3 processes without gradient all-reduce")["img/s"] > 0
    assert "needs >= 2 GPUs" in result.row("DP(3)", measured=False)["note"]
    if cores < 3:
        assert any(f"3 processes share {cores} usable cores" in note for note in result.notes)


@pytest.mark.system
def test_failed_bench_worker_reaches_the_shell_as_one_line():
    """Data of your own with fewer images than one batch: the worker's loader raises, the shell
    user reads one line (the worker's traceback stays in WorkerError.details)."""
    too_small = bench.bench_dataset(1)  # 32 images
    command = [sys.executable, "-m", "maskrcnn_tut.lab.bench", "amp", "--preset", "cpu-tiny", "--data-path", str(too_small),
               "--batch-size", "64", "--steps", "1", "--warmup", "1", "--min-size", "64", "--max-size", "96"]
    done = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "worker 0 failed" in errors[0], done.stderr


@pytest.mark.system
def test_bad_setting_reaches_the_shell_as_one_line():
    command = [sys.executable, "-m", "maskrcnn_tut.lab.bench", "table", "--preset", "cpu-tiny", "--min-size", "-5"]
    done = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [line for line in done.stderr.strip().splitlines()
                                                if line.startswith("error: --min-size")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without GPUs")
def test_dataparallel_measure_refuses_plainly_without_two_gpus():
    cfg = bench.bench_config("cpu-tiny", min_size=64, max_size=96, batch_size=2)
    with pytest.raises(BenchError, match="DataParallel needs >= 2 GPUs; this machine has 0"):
        bench.measure(cfg, steps=1, warmup=0, dataparallel=True)
