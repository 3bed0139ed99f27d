"""A /dev/shm too small for the DataLoader workers (a container's is 64 MB unless raised; here 64 KB, or
none left at all): on each of 2 ranks one line saying what to do, instead of a traceback per batch from
the workers' queue threads, ranks waiting forever for the batches those threads dropped, or the
package's traceback of an `OSError: [Errno 28]` from the loader's queue locks (POSIX semaphores in /dev/shm)."""
import os
import re
import shlex
import shutil
import subprocess

import pytest
from conftest import run_flags, subprocess_env, train_command

pytestmark = pytest.mark.system

FILL = "head -c 1m /dev/zero > /dev/shm/fill 2>/dev/null; "  # every page of the 64 KB taken


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a small /dev/shm: root, unshare")
@pytest.mark.parametrize("fill", ["", FILL], ids=["batches-do-not-fit", "no-room-for-the-queue-locks"])
def test_a_full_dev_shm_is_one_line_on_each_rank_naming_the_ways_out(small_shapes, tmp_path, fill):
    train = shlex.join(train_command(*run_flags(small_shapes, tmp_path / "run", "--workers", "2", "--max-steps", "2"),
                                     nproc=2))
    result = subprocess.run(["unshare", "--mount", "sh", "-c",
                             f"mount -t tmpfs -o size=64k tmpfs /dev/shm && {fill}{train}"],
                            capture_output=True, text=True, env=subprocess_env(), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = sorted(line for line in output.splitlines() if line.startswith("error:"))
    assert [line.split(":")[1].strip() for line in errors] == ["rank 0", "rank 1"], output[-3000:]
    for line in errors:
        assert "ran out of shared memory" in line and "--workers 0" in line, output[-3000:]
    assert "unable to allocate shared memory" not in output  # no worker's traceback
    assert "Errno 28" not in output and "Exception ignored" not in output, output[-3000:]
    assert not re.search(r"^\[rank\d\]:", output, re.M), output[-3000:]  # no rank's traceback
    assert not re.search(r'File ".*maskrcnn_tut/', output), output[-3000:]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a small /dev/shm: root, unshare")
def test_predict_on_a_full_dev_shm_is_one_line_on_each_rank(small_shapes, tmp_path):
    """predict's decoding workers meet it as training's do (they pack their batches the same way): before,
    a traceback of the queue lock's `OSError: [Errno 28]`."""
    import torch
    from checkpoints import resumable_payload

    torch.save(resumable_payload(3, data_path=str(small_shapes), min_size=96, max_size=128), tmp_path / "last.pt")
    command = shlex.join(train_command("--checkpoint", str(tmp_path / "last.pt"), "--out", str(tmp_path / "out"),
                                       "--workers", "2", "--no-progress", str(small_shapes / "val2017"), nproc=2,
                                       script=("-m", "maskrcnn_tut.predict")))
    result = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs /dev/shm && {command}"],
                            capture_output=True, text=True, env=subprocess_env(), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = sorted(line for line in output.splitlines() if line.startswith("error:"))
    assert [line.split(":")[1].strip() for line in errors] == ["rank 0", "rank 1"], output[-3000:]
    assert all("ran out of shared memory" in line and "--workers 0" in line for line in errors), output[-3000:]
    assert "Errno 28" not in output and not re.search(r'File ".*maskrcnn_tut/', output), output[-3000:]
