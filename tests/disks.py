"""Real small or read-only filesystems for the tests of full and read-only disks: a tmpfs mounted
for the test (needs root, as CI and the development machine run; skipped elsewhere)."""
from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(mount: Path, size: str = "1m", read_only: bool = False):
    """A tmpfs of `size` at `mount` (created), read-only when asked, unmounted afterwards."""
    mount.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
