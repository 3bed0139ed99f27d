"""Shared test helpers (the shapes dataset, one way to run train.py) and the test tiers.

Tiers: `pytest` runs the unit tests. Tests marked `system` (they start train.py, torchrun or other
processes) and the chapters (nbval; marked `book` here) run with `pytest -m system`, `pytest -m book`,
or together with everything else under `pytest --all`, which CI runs. Naming files or folders, or any
`-m`, runs what is named, whatever its tier.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maskrcnn_tut.lab.processes import free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "maskrcnn_tut" / "train.py"
PYTHON = sys.executable


def pytest_configure(config):
    """One figure-cache session for the run: the Japanese chapters read what the English ones measured
    (lab/stored/within_build.py); removed when the run ends."""
    from maskrcnn_tut.lab.stored import within_build

    inherited = within_build.session_dir()
    config.figures_session = None if inherited else within_build.start_session()


def pytest_unconfigure(config):
    from maskrcnn_tut.lab.stored import within_build

    within_build.end_session(getattr(config, "figures_session", None))


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="run every tier: unit, system and the chapters (CI)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the chapters `book` and everything in tests/system `system`; a plain `pytest` keeps only the unit tier."""
    system = Path(__file__).parent / "system"
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.book)
        elif item.path.is_relative_to(system):
            item.add_marker(pytest.mark.system)
    plain = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr
    if config.getoption("--all") or not plain:
        return
    keep = [item for item in items if not item.get_closest_marker("system") and not item.get_closest_marker("book")]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


@pytest.fixture
def backend_flags():
    """Restores torch's TF32, cuDNN benchmark and determinism flags after a test that sets them (pytest's
    monkeypatch cannot undo them on torch < 2.9, where they are attributes of module-like objects)."""
    import torch

    flags = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
             (torch.backends.cudnn, "benchmark"), (torch.backends.cudnn, "deterministic")]
    saved = [getattr(owner, name) for owner, name in flags]
    yield
    for (owner, name), value in zip(flags, saved):
        setattr(owner, name, value)


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    """`shapes(n_train, n_val)`: the root of a shapes dataset in COCO layout, written once per size."""
    from maskrcnn_tut.data.shapes import ensure_shapes_dataset

    roots: dict[tuple[int, int], Path] = {}

    def make(n_train: int, n_val: int) -> Path:
        if (n_train, n_val) not in roots:
            root = tmp_path_factory.mktemp("data") / f"shapes-{n_train}-{n_val}"
            roots[n_train, n_val] = ensure_shapes_dataset(n_train, n_val, seed=0, root=root, progress=False)
        return roots[n_train, n_val]

    return make


@pytest.fixture(scope="session")
def shapes_root(shapes) -> Path:
    """60 train / 20 val images (a few seconds to write)."""
    return shapes(60, 20)


@pytest.fixture(scope="session")
def small_shapes(shapes) -> Path:
    """16 train images (4 steps an epoch for 2 processes x 2 images) and 4 to evaluate: cheap runs."""
    return shapes(16, 4)


def run_flags(data: Path, out: Path, *extra: str) -> list[str]:
    """train.py flags for a seconds-long run on a small dataset: 2 images per process at 96/128 px."""
    return ["--data-path", str(data), "--output-dir", str(out), "--batch-size", "2", "--min-size", "96",
            "--max-size", "128", "--workers", "0", "--no-progress", "--print-freq", "1", *extra]


@pytest.fixture
def tiny_flags(shapes_root, tmp_path) -> list[str]:
    """`run_flags` on the 60/20 dataset into this test's folder."""
    return run_flags(shapes_root, tmp_path / "run")


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def train_command(*flags: str, nproc: int = 1, max_restarts: int = 0, script=(str(TRAIN_SCRIPT),)) -> list[str]:
    """train.py (or `script`, a list) with `flags`: plain Python for one process, else torchrun on a free port."""
    if nproc == 1:
        return [PYTHON, *script, *flags]
    return [PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5", f"--master-port={free_port()}", *script, *flags]


def run_train(*flags: str, nproc: int = 1, timeout: float = 240, **command) -> subprocess.CompletedProcess:
    """Run `train_command(*flags, nproc=nproc, **command)` to the end, its output captured as text."""
    return subprocess.run(train_command(*flags, nproc=nproc, **command), capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env())
