"""preflight: /dev/shm, the NCCL variables, all-reduce bandwidth, and a
hang reproduced with one stalled gloo rank, read from outside with faulthandler (and py-spy where
it is installed)."""
from __future__ import annotations

import pytest

from maskrcnn_tut.lab import preflight, processes
from maskrcnn_tut.lab.bench import communication


def test_shm_report_says_how_big_and_what_to_do(tmp_path, monkeypatch):
    here = preflight.shm_report(tmp_path)
    assert here["total MiB"] > 0 and here["ok"] in (True, False)
    missing = preflight.shm_report(tmp_path / "nope")
    assert missing["ok"] is None and "--shm-size" in missing["fix"]
    monkeypatch.setattr(preflight, "MIN_SHM_MB", 10**12)
    small = preflight.shm_report(tmp_path)
    assert small["ok"] is False and "insufficient shared memory" in small["finding"]
    assert "emptyDir" in small["fix"] and "medium: Memory" in small["fix"]
    assert preflight.shm_needed_mb(10.0, workers=4, prefetch_factor=2, processes=8) == 640.0


def test_nccl_environment_names_what_is_set():
    rows = preflight.nccl_environment({"NCCL_DEBUG": "INFO", "PATH": "/bin"})
    names = [row["variable"].split("=")[0] for row in rows]
    for name in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"):
        assert name in names
    assert {row["variable"].split("=")[0]: row["set here"] for row in rows}["NCCL_DEBUG"] == "INFO"


@pytest.mark.system
def test_allreduce_bandwidth_across_two_gloo_processes():
    rows = processes.launch(communication.allreduce_bandwidth, 2, (0.25, 1.0), 2, backend="gloo", timeout_s=120)
    assert [row["MB"] for row in rows] == [0.25, 1.0]
    for row in rows:
        assert row["processes"] == 2 and row["backend"] == "gloo" and row["ms min"] <= row["ms"] <= row["ms max"]
        assert row["bus GB/s"] == pytest.approx(1 * row["MB"] * 2**20 / (row["ms"] / 1000) / 1e9, rel=1e-6)


PY_SPY_DUMP = """Process 4242: python -c ...
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2501)
    wrapper (torch/distributed/c10d_logger.py:81)
    all_reduce_sum (maskrcnn_tut/distributed.py:232)
    train_loop (myproject/train.py:88)
    _worker (maskrcnn_tut/distributed.py:270)
Thread 4250 (idle): "maskrcnn_tut-parent-watch"
    _watch_parent (maskrcnn_tut/distributed.py:247)
"""

FAULTHANDLER_DUMP = """Thread 0x00007f00 (most recent call first):
  File "/x/maskrcnn_tut/distributed.py", line 247 in _watch_parent
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f01 (most recent call first):
  File "/x/myproject/data.py", line 17 in read_forever
  File "/x/myproject/train.py", line 80 in train_loop
  File "/x/maskrcnn_tut/distributed.py", line 270 in _worker
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
"""


def test_classify_stack_reads_both_formats():
    coloured = PY_SPY_DUMP.replace("all_reduce (", "\x1b[32mall_reduce\x1b[0m (").replace(":88)", ":\x1b[2m88\x1b[0m)")
    assert preflight.classify_stack(coloured) == preflight.classify_stack(PY_SPY_DUMP)
    waiting = preflight.classify_stack(PY_SPY_DUMP)
    assert waiting["waiting in a collective"] and waiting["collective"] == "all_reduce"
    assert (waiting["function"], waiting["file"], waiting["line"]) == ("train_loop", "train.py", 88)
    stuck = preflight.classify_stack(FAULTHANDLER_DUMP)
    assert not stuck["waiting in a collective"] and stuck["collective"] is None
    assert (stuck["function"], stuck["file"], stuck["line"]) == ("read_forever", "data.py", 17)


@pytest.mark.system
@pytest.mark.parametrize("tool", ["faulthandler", "py-spy"])
def test_a_stalled_rank_is_found_from_outside(tool):
    if tool == "py-spy" and preflight.py_spy() is None:
        pytest.skip("py-spy is not installed")
    diagnosis = preflight.diagnose_hang(nprocs=2, stall_rank=1, after_s=1.0, tool=tool)
    assert diagnosis["tool"] == tool and diagnosis["result"] == {"all-reduce": 2.0}  # released, then finished
    victim, culprit = diagnosis["ranks"]
    assert victim["waiting in a collective"] and victim["collective"] == "all_reduce"
    assert not culprit["waiting in a collective"] and culprit["function"] == "stalled_step"
    lines = preflight.hang_summary(diagnosis)
    assert lines[0].startswith("rank 0: waits in all_reduce") and "look here" in lines[1]
