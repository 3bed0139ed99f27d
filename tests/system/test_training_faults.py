"""Faults a real multi-process run meets, proven on CPU with gloo: a worker killed under torchrun
restarts and resumes to the same weights, a non-finite loss on one rank stops every rank without
touching the last good checkpoint, and a dead or hung peer never leaves a rank waiting forever (in
training, or in `predict`: exit 4 and one line)."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from checkpoints import resumable_payload
from conftest import PYTHON, REPO, TRAIN_SCRIPT, run_flags, subprocess_env, train_command

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.lab.processes import free_port
from maskrcnn_tut.monitor import read_jsonl

FAULTY_TRAIN = REPO / "tests" / "faulty_train.py"
FAULTY_PREDICT = REPO / "tests" / "faulty_predict.py"


def _start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env() | env,
                                start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for `proc`; on timeout kill its whole session (torchrun and its workers) and fail."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running after {timeout} s")


def _wait_for(ready, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Poll until `ready()` while `proc` runs."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} too early:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            _finish(proc, 0)
        time.sleep(0.1)


def _worker_pid(parent: int, rank: int) -> int:
    """The pid of torchrun's worker process with this RANK (its direct children carry the env)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no worker with RANK={rank} under pid {parent}")


def _max_abs_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def _weights(out: Path) -> dict:
    return ckpt.load(out / "checkpoints" / "last.pt")["model"]


def test_starting_an_epoch_mid_way_leaves_the_global_rng_alone(small_shapes):
    """A resumed run starts its loader mid-epoch; if that drew from the global RNG (which RPN and RoI
    sampling use), the resumed run would sample differently from the uninterrupted one."""
    from maskrcnn_tut.config import derive, make_config
    from maskrcnn_tut.data.loader import build_datasets, build_train_loader

    cfg = derive(make_config("cpu-tiny", data_path=str(small_shapes), workers=0, batch_size=2), 1, "cpu")
    loader = build_train_loader(build_datasets(cfg)[0], cfg, rank=0, world_size=1)
    before = torch.get_rng_state()
    loader.batch_sampler.set_epoch(1, skip=3)
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.system
def test_killed_worker_restarts_and_resumes_to_the_same_weights(small_shapes, tmp_path):
    # 6 steps cross an epoch boundary (4 steps an epoch); checkpoints at 2, 4, 6
    common = ("--max-steps", "6", "--checkpoint-every", "2", "--deterministic", "--resume", "auto")
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    proc = _start(train_command(*run_flags(small_shapes, reference, *common), nproc=2), tmp_path / "reference.log")
    _finish(proc, 300)
    assert proc.returncode == 0, (tmp_path / "reference.log").read_text()[-3000:]

    log = tmp_path / "interrupted.log"
    proc = _start(train_command(*run_flags(small_shapes, interrupted, *common), nproc=2, max_restarts=2), log)
    _wait_for((interrupted / "checkpoints" / "step_0000002.pt").exists, proc, log)
    os.kill(_worker_pid(proc.pid, rank=1), signal.SIGKILL)
    _finish(proc, 300)
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    assert "resumed from" in output and "step_0000002.pt" in output, output[-3000:]
    assert ckpt.load(interrupted / "checkpoints" / "last.pt")["state"]["step"] == 6
    assert _max_abs_difference(_weights(reference), _weights(interrupted)) <= 1e-6


@pytest.mark.system
def test_nonfinite_loss_on_one_rank_stops_both_and_keeps_the_last_good_checkpoint(small_shapes, tmp_path):
    """Rank 1's loss is NaN at steps 3 and 4: --skip-nonfinite 1 skips step 3, step 4 stops the run."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    flags = run_flags(small_shapes, out, "--max-steps", "8", "--checkpoint-every", "2", "--skip-nonfinite", "1")
    proc = _start(train_command(*flags, nproc=2, script=[str(FAULTY_TRAIN), "--nan-at", "3:1,4:1", "--"]), log)
    skipped = "non-finite loss at step 3 on rank(s) [1]: step skipped (1 of --skip-nonfinite 1)"
    _wait_for(lambda: skipped in log.read_text(), proc, log)
    _finish(proc, 60)  # one more step, then every rank stops: none is left waiting in a collective
    output = log.read_text()
    assert proc.returncode != 0
    stops = [line for line in output.splitlines() if "error: non-finite loss at step 4 on rank(s) [1]" in line]
    assert len(stops) == 2, output[-3000:]  # both ranks say so (each names its own terms)
    assert any("loss_classifier=nan" in line for line in stops)  # the rank with the NaN names its terms
    assert [p.name for p in ckpt.numbered(out / "checkpoints")] == ["step_0000002.pt"]
    assert ckpt.load(out / "checkpoints" / "last.pt")["state"]["step"] == 2
    assert [m["skipped_steps"] for m in read_jsonl(out / "metrics.jsonl")] == [0, 0, 1]


PEER_SCRIPT = """
import sys, time, torch
from maskrcnn_tut import distributed as du
du.init_distributed("gloo", timeout_s=float(sys.argv[1]))
du.all_reduce_sum(torch.ones(1))
print("joined", flush=True)
try:
    while True:
        du.all_reduce_sum(torch.ones(1))
        time.sleep(0.05)
except RuntimeError as err:
    print(du.peer_failure(err), flush=True)
    sys.exit(4)
"""


@pytest.mark.system
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "hung"])
def test_a_dead_or_hung_peer_makes_the_other_rank_exit_with_a_message(fault, tmp_path):
    timeout_s = 5
    port = free_port()
    procs = []
    for rank in range(2):
        env = subprocess_env() | dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([PYTHON, "-c", PEER_SCRIPT, str(timeout_s)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        assert procs[0].stdout.readline().strip() == "joined"
        os.kill(procs[1].pid, fault)
        started = time.monotonic()
        output, _ = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 4, output
        assert "another rank died or stopped answering within --dist-timeout" in output
        if fault == signal.SIGSTOP:
            assert time.monotonic() - started >= timeout_s - 1  # it waited for the timeout, then gave up
    finally:
        procs[1].kill()
        procs[1].wait()
        procs[0].kill()


def _exit_status(pid: int, timeout: float = 60) -> int:
    """The exit code of `pid`, a child of a paused torchrun: read from /proc once it is a zombie."""
    deadline = time.monotonic() + timeout
    while True:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            return int(fields[-1]) >> 8  # exit_code, as waitpid reports it
        assert time.monotonic() < deadline, f"rank 0 (pid {pid}) still running {timeout} s after its peer died"
        time.sleep(0.05)


@pytest.mark.system
def test_predict_on_two_ranks_one_killed_ends_the_other_with_exit_4_and_one_line(small_shapes, tmp_path):
    """Rank 1 stops answering while predicting; rank 0, done with its images, waits to gather the results;
    rank 1 is killed. torchrun is paused meanwhile: it would end rank 0 (SIGTERM) as soon as it saw rank 1
    die, and what is tested is rank 0's own exit, not torchrun's clean-up racing it."""
    checkpoint, markers, log = tmp_path / "last.pt", tmp_path / "markers", tmp_path / "predict.log"
    ckpt.atomic_save(resumable_payload(1), checkpoint)
    markers.mkdir()
    flags = ("--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--batch-size", "1", "--workers", "0",
             "--no-progress", str(small_shapes / "val2017"))
    proc = _start(train_command(*flags, nproc=2, script=[str(FAULTY_PREDICT), "--stall-rank", "1",
                                                         "--markers", str(markers), "--"]), log)
    _wait_for(lambda: (markers / "stalled").exists() and (markers / "gathering0").exists(), proc, log)
    rank0, rank1 = _worker_pid(proc.pid, rank=0), _worker_pid(proc.pid, rank=1)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        os.kill(rank1, signal.SIGKILL)
        status = _exit_status(rank0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _finish(proc, 120)
    output = log.read_text()
    assert status == 4, output[-3000:]
    ours = [line for line in output.splitlines() if "error: " in line]
    assert len(ours) == 1 and "rank 0: another rank died or stopped answering" in ours[0], output[-3000:]
    assert "PeerFailure: rank 0: another rank died" in output  # torchrun's summary, from its error file
    assert "maskrcnn_tut/" not in output.replace(str(FAULTY_PREDICT), "")  # no traceback through our code



def _alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (not ended, not a zombie)."""
    running = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                running.append(pid)
        except OSError:
            pass
    return running


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.system
def test_a_rank_killed_with_loader_workers_running_leaves_one_line_exit_4_and_no_orphans(small_shapes, tmp_path):
    """Issue 36 probe (already right, kept here): training on 2 processes with 2 DataLoader workers each;
    rank 1 is SIGKILLed mid-run, torchrun paused meanwhile (as in the predict test above). Rank 0 says so
    in one line and exits 4 well within --dist-timeout; rank 1's workers, orphaned, end on their own
    (torch's watchdog sees their parent gone), rank 0's with it; nothing of the run is left."""
    out, log = tmp_path / "run", tmp_path / "train.log"
    flags = run_flags(small_shapes, out, "--max-steps", "40", "--workers", "2", "--dist-timeout", "20")
    proc = _start(train_command(*flags, nproc=2), log)
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len(read_jsonl(out / "metrics.jsonl")) >= 2, proc, log)
    rank0, rank1 = _worker_pid(proc.pid, rank=0), _worker_pid(proc.pid, rank=1)
    workers = _children(rank0) + _children(rank1)
    assert len(workers) == 4, workers
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        status = _exit_status(rank0, timeout=20)
        took = time.monotonic() - started
        deadline = time.monotonic() + 20
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = _alive(workers)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _finish(proc, 120)
    output = log.read_text()
    assert status == 4 and took < 20, (status, took, output[-3000:])
    ours = [line for line in output.splitlines() if "error: " in line]
    assert len(ours) == 1 and "rank 0: another rank died or stopped answering" in ours[0], output[-3000:]
    assert "maskrcnn_tut/" not in output.replace(str(TRAIN_SCRIPT), "")  # no traceback through our code
    assert orphans == [], f"loader workers still running after their ranks ended: {orphans}"

@pytest.mark.system
def test_unused_parameters_under_ddp_are_one_line_naming_the_flag(small_shapes, tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(train_command(*run_flags(small_shapes, out, "--max-steps", "3"), nproc=2,
                                script=[str(FAULTY_TRAIN), "--unused-parameter", "--"]), log)
    _finish(proc, 120)
    output = log.read_text()
    assert proc.returncode != 0
    ours = [line for line in output.splitlines() if line.startswith("error:")]
    assert ours and all("--find-unused-parameters" in line for line in ours), output[-3000:]
    assert "maskrcnn_tut/" not in output.replace(str(TRAIN_SCRIPT), "")  # no traceback through our code
