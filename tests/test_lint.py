"""ruff, with the rules in pyproject.toml's [tool.ruff], over the package, the tests and the tools."""
import subprocess
import sys

from conftest import REPO


def test_ruff_finds_nothing():
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
               "maskrcnn_tut", "tests", "tools"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
