"""A /dev/shm too small for the DataLoader workers' batches (a container's is 64 MB unless raised; here
64 KB): one line saying what to do, instead of a traceback per batch from the workers' queue threads
and ranks waiting forever for the batches those threads dropped."""
import os
import re
import shlex
import shutil
import subprocess

import pytest
from conftest import run_flags, subprocess_env, train_command

pytestmark = pytest.mark.system


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a small /dev/shm: root, unshare")
def test_a_full_dev_shm_is_one_line_naming_the_ways_out(small_shapes, tmp_path):
    train = shlex.join(train_command(*run_flags(small_shapes, tmp_path / "run", "--workers", "2", "--max-steps", "2"),
                                     nproc=2))
    result = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs /dev/shm && {train}"],
                            capture_output=True, text=True, env=subprocess_env(), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "ran out of shared memory" in errors[0] and "--workers 0" in errors[0], output[-3000:]
    assert "unable to allocate shared memory" not in output  # no worker's traceback
    assert not re.search(r'File ".*maskrcnn_tut/', output), output[-3000:]
