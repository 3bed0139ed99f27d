"""Machine facts the package decides with: usable cores honour a real cgroup CPU quota (which
`nproc` and `sched_getaffinity` do not see), and the provenance names the machine."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from maskrcnn_tut import hardware
from maskrcnn_tut.lab import provenance

CGROUP = Path("/sys/fs/cgroup")
PROBE = "from maskrcnn_tut.hardware import usable_cores, cgroup_cpu_limit; print(usable_cores(), cgroup_cpu_limit())"


def _make_quota_group(name: str, cpus: float) -> tuple[Path, Path]:
    """A real cgroup limited to `cpus` CPUs: (its folder, the file a PID is written to). v1 or v2."""
    period = 100_000
    if (CGROUP / "cgroup.controllers").exists():  # v2
        if "cpu" not in (CGROUP / "cgroup.subtree_control").read_text().split():
            (CGROUP / "cgroup.subtree_control").write_text("+cpu")
        folder = CGROUP / name
        folder.mkdir()
        (folder / "cpu.max").write_text(f"{int(cpus * period)} {period}")
    else:  # v1
        folder = CGROUP / "cpu" / name
        folder.mkdir()
        (folder / "cpu.cfs_period_us").write_text(str(period))
        (folder / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
    return folder, folder / "cgroup.procs"


@pytest.mark.system
@pytest.mark.skipif(os.geteuid() != 0, reason="making a cgroup needs root (CI and the dev machine are root)")
def test_usable_cores_honour_a_real_cgroup_cpu_quota():
    try:
        folder, procs = _make_quota_group(f"maskrcnn_tut_test_{os.getpid()}", 1.0)
    except OSError as err:
        pytest.skip(f"cannot create a cgroup here: {err}")
    try:
        script = f'echo $$ > {procs} && exec {sys.executable} -c "{PROBE}"'
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        cores, limit = out.stdout.split()
        assert float(limit) == 1.0 and int(cores) == 1
        outside = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
        assert int(outside.stdout.split()[0]) == len(os.sched_getaffinity(0))
    finally:
        folder.rmdir()


def test_provenance_names_the_machine_and_the_command():
    prov = provenance.provenance("python -m something")
    assert prov["command"] == "python -m something" and prov["cores"] == hardware.usable_cores()
    assert prov["hardware"] == provenance.hardware_label() and prov["torch"] and prov["date"]
