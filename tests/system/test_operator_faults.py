"""Faults an operator's machine and folders hand a run, tried as a cluster user would: a pipe
among the images, a read-only cache, checkpoints that load but cannot be resumed from, or none
that can. Each is one line and a counted skip or a clear stop; never a hang or a silent restart."""
import os
import shutil
import subprocess

import pytest
import torch
from conftest import PYTHON, run_flags, run_train, subprocess_env, train_command
from disks import tmpfs

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.monitor import read_jsonl

pytestmark = pytest.mark.system


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_a_pipe_among_the_images_is_counted_not_waited_on(small_shapes, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(small_shapes, root)
    image = next((root / "train2017").iterdir())
    image.unlink()
    os.mkfifo(image)  # opening it for reading waits for a writer that never comes
    out = subprocess.run([PYTHON, "-m", "maskrcnn_tut.data.check", "--data-path", str(root)], capture_output=True,
                         text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith("  ")}
    assert rows["not_a_file"][1] == "1", out.stdout


def test_training_on_the_shapes_dataset_under_a_read_only_cache_is_one_line(tmp_path):
    with tmpfs(tmp_path / "cache", "1m", read_only=True) as cache:
        out = subprocess.run(train_command("--output-dir", str(tmp_path / "run"), "--shapes-train", "4",
                                           "--shapes-val", "2", "--no-progress"),
                             capture_output=True, text=True, timeout=120,
                             env=subprocess_env() | {"MASKRCNN_TUT_CACHE": str(cache)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert _errors(out.stderr) == [f"error: {cache}: cannot write the shapes dataset there (Read-only file system); "
                                   "set MASKRCNN_TUT_CACHE to a writable folder, or train on your own data with "
                                   "--data-path"]


def test_resume_auto_past_a_wrong_payload_on_two_processes_with_workers_then_none_usable_stops(small_shapes, tmp_path):
    """As users run it (2 processes, loader workers): the newest checkpoint lacks its RNG streams,
    so --resume auto warns once (not once per rank) and resumes from the one before; when no
    checkpoint is usable it stops saying why for each, instead of starting over."""
    out = tmp_path / "run"
    flags = run_flags(small_shapes, out, "--max-steps", "2", "--checkpoint-every", "1", "--workers", "2",
                      "--resume", "auto")
    first = run_train(*flags, nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = out / "checkpoints" / "step_0000002.pt"
    payload = ckpt.load(newest)
    del payload["rng"]
    torch.save(payload, newest)
    again = run_train(*flags, "--max-steps", "3", nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    skipped = [line for line in again.stderr.splitlines() if "using an earlier checkpoint" in line]
    assert len(skipped) == 1 and f"{newest}: has no random generator states" in skipped[0], again.stderr[-3000:]
    assert "step_0000001.pt at step 1" in again.stderr and "Traceback" not in again.stderr
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    for path in ckpt.numbered(out / "checkpoints"):
        path.write_bytes(path.read_bytes()[:1000])
    stopped = run_train(*flags, "--max-steps", "4")
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert _errors(stopped.stderr) and _errors(stopped.stderr)[0].startswith(
        f"error: --resume auto: none of the 2 checkpoints in {out / 'checkpoints'} can be used (step_0000003.pt: ")
    assert "Traceback" not in stopped.stderr and not (out / "earlier").exists()


def test_a_resume_after_half_the_training_images_were_deleted_stops_unless_allowed(small_shapes, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(small_shapes, root)
    flags = run_flags(root, tmp_path / "run", "--max-steps", "1", "--resume", "auto")
    first = run_train(*flags)
    assert first.returncode == 0, first.stderr[-3000:]
    images = sorted((root / "train2017").iterdir())
    for image in images[::2]:
        image.unlink()
    stopped = run_train(*flags, "--max-steps", "2")
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert _errors(stopped.stderr) == [
        f"error: --resume: the training set changed since {tmp_path / 'run' / 'checkpoints' / 'step_0000001.pt'} was "
        f"saved ({len(images)} usable images then, {len(images) // 2} now), so its place in the epoch points at "
        "other images; restore the data, or give --allow-data-change to go on with it"]
    allowed = run_train(*flags, "--max-steps", "2", "--allow-data-change")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert f"{len(images) // 2} usable training images, {len(images)} when the checkpoint was saved" in allowed.stderr
