"""Shared fixtures: a small shapes dataset generated once per test session."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "maskrcnn_tut" / "train.py"


@pytest.fixture(scope="session")
def shapes_root(tmp_path_factory) -> Path:
    """60 train / 20 val shapes images in COCO layout (a few seconds to write)."""
    from maskrcnn_tut.data.shapes import ensure_shapes_dataset

    return ensure_shapes_dataset(60, 20, seed=0, root=tmp_path_factory.mktemp("data") / "shapes", progress=False)


@pytest.fixture
def tiny_flags(shapes_root, tmp_path) -> list[str]:
    """Flags for a seconds-long training run on the small dataset."""
    return ["--data-path", str(shapes_root), "--output-dir", str(tmp_path / "run"), "--batch-size", "2",
            "--min-size", "96", "--max-size", "128", "--workers", "0", "--no-progress", "--print-freq", "1"]


def run_flags(data: Path, out: Path, *extra: str) -> list[str]:
    """train.py flags for a seconds-long run on a small dataset: 2 images per process at 96/128 px."""
    return ["--data-path", str(data), "--output-dir", str(out), "--batch-size", "2", "--min-size", "96",
            "--max-size", "128", "--workers", "0", "--no-progress", "--print-freq", "1", *extra]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable
