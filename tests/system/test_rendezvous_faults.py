"""The rendezvous under network faults, and Ctrl-C: each a one-line error, never a hang or a traceback.

- a MASTER_PORT where something accepts connections and never answers: bounded by --dist-timeout;
- a taken MASTER_PORT: says so (and how to pick another), not "another rank died";
- Ctrl-C: `distributed.interrupted` turns it into one line and exit 130.
Each rank runs as its own `python -c` process (what torchrun starts), bounded by a subprocess timeout.
"""
from __future__ import annotations

import datetime
import json
import signal
import socket
import subprocess
import threading
import time

import pytest
import torch.distributed as dist
from conftest import PYTHON, subprocess_env

from maskrcnn_tut import distributed as du
from maskrcnn_tut.errors import RendezvousError, UserError
from maskrcnn_tut.lab.processes import free_port

pytestmark = pytest.mark.system

JOIN_SCRIPT = """
import sys, time
from maskrcnn_tut import distributed as du
from maskrcnn_tut.errors import UserError
started = time.monotonic()
try:
    du.init_distributed("gloo", timeout_s=float(sys.argv[1]))
except UserError as err:
    print(f"error: {err}", flush=True)
    print(f"after {time.monotonic() - started:.2f} s", flush=True)
    sys.exit(err.exit_code)
except RuntimeError as err:
    failure = du.peer_failure(err)
    if failure is None:
        raise
    print(f"error: {failure}", flush=True)
    sys.exit(failure.exit_code)
print("joined", flush=True)
"""


@pytest.fixture
def silent_port():
    """A port on 127.0.0.1 where a listener accepts every connection and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted, stop = [], threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def _start_rank(rank: int, port: int, timeout_s: float) -> subprocess.Popen:
    env = subprocess_env() | dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen([PYTHON, "-c", JOIN_SCRIPT, str(timeout_s)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, seconds: float) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still waiting after {seconds} s (no bound on the rendezvous): {out[-500:]} {err[-1500:]}")
    return out, err, time.monotonic() - started


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def _seconds(out: str) -> float:
    """How long init_distributed took before it failed (as the script printed it)."""
    return float(out.split("after ")[1].split()[0])


def test_a_port_that_accepts_and_never_answers_fails_within_the_timeout(silent_port):
    """Both ranks of a 2-rank group pointed at a silent listener: rank 1 (a store client) gives up
    after --dist-timeout with one line; rank 0 finds the port taken and says so. A third process,
    pointed at a port where nothing listens, says it could not reach rank 0."""
    timeout_s = 3
    procs = [_start_rank(0, silent_port, timeout_s), _start_rank(1, silent_port, timeout_s),
             _start_rank(1, free_port(), timeout_s)]
    results = [_finish(proc, 60) for proc in procs]
    for proc, (out, err, _) in zip(procs, results):
        assert "Traceback" not in err and "joined" not in out, err[-2000:]
        assert proc.returncode == RendezvousError.exit_code and len(_errors(out)) == 1, (out, err[-2000:])
        assert _seconds(out) < timeout_s + 4, out  # the timeout, the 2 s TCPStore gets on top, a probe
    taken, silent, closed = (_errors(out)[0] for out, _, _ in results)
    assert f"port {silent_port} is already in use" in taken
    assert f"rank 1: 127.0.0.1:{silent_port} (MASTER_ADDR:MASTER_PORT) accepts connections but did not answer" in silent
    assert "within --dist-timeout 3 s" in silent and "MASTER_PORT=" in silent
    assert "rank 1: could not reach rank 0's store at 127.0.0.1:" in closed and "is rank 0 running" in closed


def test_a_taken_port_is_not_called_a_dead_peer():
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(dist.DistNetworkError) as caught:  # what rank 0 meets on a taken MASTER_PORT
            dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True,
                          timeout=datetime.timedelta(seconds=2), wait_for_workers=False)
        assert du.peer_failure(caught.value) is None
        # the same through a rank-0 process: one line, exit 2, how to pick another port
        out, err, _ = _finish(_start_rank(0, port, 5), 40)
        assert "Traceback" not in err and "another rank died" not in out, err[-2000:]
        (line,) = _errors(out)
        assert f"port {port} is already in use" in line and "--master-port" in line and "MASTER_PORT=" in line
    finally:
        taken.close()


def test_a_dead_peer_is_still_a_dead_peer():
    reset = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:12345")
    assert isinstance(du.peer_failure(reset), UserError)


INTERRUPT_SCRIPT = """
import sys, time
from maskrcnn_tut import distributed as du
from maskrcnn_tut.lab import processes
def main():
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        return du.interrupted()
    return 0
code = main()
print("cleaning up", flush=True)
time.sleep(60 if sys.argv[1] == "again" else 0)  # a second Ctrl-C must end this at once
sys.exit(code)
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_is_one_line_from_rank_zero_and_exit_130(rank, tmp_path):
    error_file = tmp_path / "error.json"
    env = subprocess_env() | dict(RANK=str(rank), WORLD_SIZE="2", TORCHELASTIC_ERROR_FILE=str(error_file))
    proc = subprocess.Popen([PYTHON, "-c", INTERRUPT_SCRIPT, "again" if rank == 0 else "once"], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    if rank == 0:
        assert proc.stdout.readline().strip() == "cleaning up"
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    if rank == 0:
        assert len(lines) == 1 and lines[0].startswith("error: interrupted (Ctrl-C)"), err
    else:
        assert lines == [], err  # every rank got the Ctrl-C: only rank 0 says so
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("KeyboardInterrupt: interrupted (Ctrl-C)") and "\n" not in message
