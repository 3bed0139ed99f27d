"""The GPU check's device run (`tools/gpu_check.sh`), here on the CPU at cpu-tiny's sizes: each stage
writes its files as it goes, and a run stopped in the middle of a stage keeps what the finished stages
wrote, readable, with stages.txt saying where it stopped."""
from __future__ import annotations

import gzip
import json
import signal
import subprocess
import time

import pytest
from conftest import REPO, subprocess_env

pytestmark = pytest.mark.system


def lines_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_run_stopped_mid_stage_keeps_the_finished_stages_files(tmp_path):
    out = tmp_path / "out"
    env = subprocess_env() | {"OUT": str(out), "GPU_CHECK_SITE": str(tmp_path / "site"), "GPU_CHECK_NO_SETUP": "1",
                              "GPU_CHECK_STAGES": "precision levers", "CUDA_VISIBLE_DEVICES": "",
                              "GPU_CHECK_TIME_SCALE": "3"}  # the bounds of the device, on a CPU that may be shared
    env.pop("OMP_NUM_THREADS")
    check = subprocess.Popen(["bash", "tools/gpu_check.sh"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not any(line["stage"] == "levers" for line in lines_of(out / "steps.jsonl")):
            assert check.poll() is None, (out / "check.log").read_text()
            assert time.monotonic() < deadline, "the levers stage never wrote a step"
            time.sleep(0.5)
        check.send_signal(signal.SIGTERM)  # as a scheduler or the device tool stops a run: in the middle of levers
        assert check.wait(timeout=60) != 0
    finally:
        check.kill()
    stages = (out / "stages.txt").read_text()
    rows = {line.split()[0]: line for line in stages.splitlines()[1:]}
    assert rows["precision"].endswith("ok") and "stopped by a signal" in stages
    summary = json.loads((out / "summary.json").read_text())
    precision = summary["stages"]["precision"]
    assert {row["setting"] for row in precision["rows"]} == {"fp32", "bf16"}
    assert all(row["img/s steady"] or row["steady steps"] == 0 for row in precision["rows"])
    assert [part["setting"] for part in precision["breakdown"]] == ["fp32", "bf16"]
    assert precision["breakdown"][0]["syncs package"] == 0  # a step train.py does not read
    steps = lines_of(out / "steps.jsonl")  # every line whole, though the run was stopped while writing them
    assert {line["stage"] for line in steps} == {"precision", "levers"}
    for name in ("trace_fp32.json.gz", "trace_bf16.json.gz"):
        assert json.loads(gzip.decompress((out / name).read_bytes()))["traceEvents"]
    assert (out / "nvml.csv").read_text().startswith("time,stage,gpu,util")
    assert not list(out.glob(".*.tmp-*"))  # no summary.json left half-written
