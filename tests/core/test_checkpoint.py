"""Checkpoints survive crashes: a save killed midway leaves the previous one loadable and `--resume
auto` uses it; a truncated or foreign file is named in the error and skipped with a warning; a
checkpoint of another model is refused saying what differs; loading never runs code."""
import logging
import os
import signal
import subprocess
import time

import pytest
import torch
from checkpoints import resumable_payload
from conftest import PYTHON, run_flags, run_train, subprocess_env
from disks import tmpfs

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.errors import CheckpointError

CONFIG = {"backbone": "resnet18", "norm": "bn", "sync_bn": False, "fpn_channels": 128, "mask_head_layers": 2,
          "mask_head_channels": 128, "box_head_dim": 256, "num_classes": 4,
          "class_names": ["square", "circle", "triangle"], "derived": {"world_size": 1, "scaled_lr": 0.002}}


def _payload(step: int, numel: int = 1000) -> dict:
    return {"model": {"w": torch.full((numel,), float(step))}, "state": {"step": step}, "config": CONFIG}


# A child that saves step 4 over a folder holding step 2 and is SIGKILLed inside the save: after
# torch.save wrote the temp file, when it asks for fsync (before the rename).
KILLED_SAVE = """
import os, sys, time, torch
from pathlib import Path
from maskrcnn_tut import checkpoint as ckpt
real_fsync = os.fsync
def fsync_then_hang(fd):
    if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".step_"):
        Path(sys.argv[2]).touch()
        time.sleep(600)
    real_fsync(fd)
os.fsync = fsync_then_hang
ckpt.save(Path(sys.argv[1]), {"model": {"w": torch.full((4_000_000,), 4.0)}, "state": {"step": 4}}, 4, keep=2)
"""


@pytest.mark.system
def test_a_save_killed_midway_leaves_the_previous_checkpoint_for_auto_resume(tmp_path):
    ckpt_dir, writing = tmp_path / "checkpoints", tmp_path / "writing"
    ckpt.save(ckpt_dir, _payload(2), 2, keep=2)
    child = subprocess.Popen([PYTHON, "-c", KILLED_SAVE, str(ckpt_dir), str(writing)], env=subprocess_env())
    try:
        deadline = time.monotonic() + 300
        while not writing.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the child never reached the save"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    leftovers = [p.name for p in ckpt_dir.iterdir() if p.name.startswith(".step_0000004.pt.tmp-")]
    assert leftovers, "the kill should have hit the save between write and rename"
    assert [p.name for p in ckpt.numbered(ckpt_dir)] == ["step_0000002.pt"]
    path, payload = ckpt.newest_loadable(ckpt_dir)
    assert path.name == "step_0000002.pt" and payload["state"]["step"] == 2
    assert ckpt.load(ckpt_dir / "last.pt")["state"]["step"] == 2
    ckpt.save(ckpt_dir, _payload(4), 4, keep=2)  # the next save clears what the killed one left
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".")]


def test_a_failed_write_raises_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt.save(tmp_path, _payload(2), 2, keep=2)

    def disk_full(obj, f):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"step_0000004.pt: cannot be written \(No space left"):
        ckpt.save(tmp_path, _payload(4), 4, keep=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step_0000002.pt"]
    assert ckpt.load(tmp_path / "last.pt")["state"]["step"] == 2


def test_truncated_checkpoint_is_named_and_auto_resume_falls_back_with_a_warning(tmp_path, caplog):
    for step in (2, 4):
        ckpt.save(tmp_path, _payload(step), step, keep=2)
    newest = tmp_path / "step_0000004.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncates last.pt too (hard link)
    with pytest.raises(CheckpointError, match=rf"{newest}: cannot be loaded"):
        ckpt.load(newest)
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut.checkpoint"):
        path, payload = ckpt.newest_loadable(tmp_path)
    assert path.name == "step_0000002.pt" and payload["state"]["step"] == 2
    assert f"{newest}: cannot be loaded" in caplog.text and "using an earlier checkpoint" in caplog.text


def test_loading_refuses_pickled_code_and_foreign_files(tmp_path):
    class Sneaky:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"model": {}, "state": {}, "payload": Sneaky()}, tmp_path / "sneaky.pt")
    with pytest.raises(CheckpointError, match=r"sneaky.pt: cannot be loaded \(UnpicklingError: .*posix.system") as err:
        ckpt.load(tmp_path / "sneaky.pt")
    assert "weights_only" not in str(err.value)  # torch's advice to load it unsafely is not repeated
    torch.save({"weights": torch.ones(2)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="foreign.pt: not a maskrcnn_tut checkpoint"):
        ckpt.load(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="missing.pt: checkpoint not found"):
        ckpt.load(tmp_path / "missing.pt")


def _unknown_state_key(payload):
    payload["state"]["lr_scale"] = 1


def _no_rng(payload):
    del payload["rng"]


def _model_of_another_shape(payload):
    payload["model"]["roi_heads.box_predictor.cls_score.weight"] = torch.zeros(7, 256)


def _config_of_no_model(payload):
    payload["config"]["norm"] = "layernorm"


@pytest.mark.parametrize("damage,reason", [
    (_config_of_no_model, r"its config describes no model this version builds"),
    (_unknown_state_key, r"training position \('state': \{.*'lr_scale': 1\}\) has other entries"),
    (_no_rng, r"has no random generator states"),
    (_model_of_another_shape, r"model tensors do not fit.*size mismatch")])
def test_a_wrong_payload_is_one_line_and_auto_resume_falls_back_to_the_previous_checkpoint(damage, reason, tmp_path,
                                                                                            caplog):
    ckpt.save(tmp_path, resumable_payload(1), 1, keep=2)
    payload = resumable_payload(2)
    damage(payload)
    newest = ckpt.save(tmp_path, payload, 2, keep=2)
    with pytest.raises(CheckpointError, match=rf"^{newest}: .*{reason}") as err:
        ckpt.find_resume(str(newest), tmp_path)
    assert "\n" not in str(err.value)
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut.checkpoint"):
        path, _ = ckpt.find_resume("auto", tmp_path)
    assert path.name == "step_0000001.pt"
    assert [r.message for r in caplog.records] == [f"--resume auto: {err.value}; using an earlier checkpoint"]
    assert ckpt.find_resume("auto", tmp_path, test_only=True)[0] == newest  # scoring needs only the model


def test_resume_auto_with_only_unusable_checkpoints_stops_saying_why_for_each(tmp_path):
    for step in (1, 2, 3):
        ckpt.save(tmp_path, _payload(step), step, keep=3)
    (tmp_path / "step_0000003.pt").write_bytes(b"")
    (tmp_path / "step_0000002.pt").write_bytes(b"\0" * 4096)
    with pytest.raises(CheckpointError) as err:
        ckpt.find_resume("auto", tmp_path)  # step 1 loads but holds no training state to resume
    message = str(err.value)
    assert message.startswith(f"--resume auto: none of the 3 checkpoints in {tmp_path} can be used (step_0000003.pt: ")
    assert "step_0000002.pt: cannot be loaded (RuntimeError: empty, cut short or not a torch" in message
    assert "step_0000001.pt: has no random generator states" in message and "weights_only" not in message
    assert "without --resume" in message and "\n" not in message


def test_a_resume_over_a_changed_training_set_stops_unless_allowed(tmp_path, caplog):
    run = derive(make_config("cpu-tiny"), 1, "cpu").to_dict()
    saved = {"config": run | {"usable_train_images": 60}}
    ckpt.check_compatible(saved, run | {"usable_train_images": 60}, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match=r"training set changed since .*a.pt was saved \(60 usable images then, "
                                              r"30 now\).*--allow-data-change"):
        ckpt.check_compatible(saved, run | {"usable_train_images": 30}, tmp_path / "a.pt")
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut.checkpoint"):
        ckpt.check_compatible(saved, run | {"usable_train_images": 30, "allow_data_change": True}, tmp_path / "a.pt")
    assert "30 usable training images, 60 when the checkpoint was saved" in caplog.text


def test_a_checkpoint_of_another_model_is_refused_saying_what_differs(tmp_path):
    ckpt.check_compatible({"config": CONFIG}, dict(CONFIG), tmp_path / "x.pt")
    other = CONFIG | {"backbone": "resnet34", "class_names": ["square", "circle", "star"]}
    with pytest.raises(CheckpointError) as err:
        ckpt.check_compatible({"config": CONFIG}, other, tmp_path / "x.pt")
    message = str(err.value)
    assert message.startswith("--resume:") and "backbone: checkpoint 'resnet18' vs run 'resnet34'" in message
    assert "'triangle'" in message and "'star'" in message and "num_classes" not in message


def test_keeps_the_newest_checkpoints_and_points_last_at_the_newest(tmp_path):
    for step in (1, 2, 3):
        ckpt.save(tmp_path, _payload(step), step, keep=2)
    assert [p.name for p in ckpt.numbered(tmp_path)] == ["step_0000003.pt", "step_0000002.pt"]
    assert os.path.samefile(tmp_path / "last.pt", tmp_path / "step_0000003.pt")


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    import random

    import numpy as np

    state = ckpt.rng_state(torch.device("cpu"))
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    torch.save({"rng": state}, tmp_path / "rng.pt")
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"], torch.device("cpu"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


@pytest.mark.system
def test_resume_auto_from_the_command_line_skips_a_corrupt_newest_checkpoint(small_shapes, tmp_path):
    """One process, 2 steps; then the newest checkpoint is truncated and the run resumes from step 1
    with a warning, replaying step 2 to exactly the weights the first run had."""
    flags = run_flags(small_shapes, tmp_path / "run", "--max-steps", "2", "--checkpoint-every", "1", "--deterministic",
                      "--resume", "auto")
    first = run_train(*flags, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt_dir = tmp_path / "run" / "checkpoints"
    expected = ckpt.load(ckpt_dir / "last.pt")["model"]
    newest = ckpt_dir / "step_0000002.pt"
    newest.write_bytes(newest.read_bytes()[:4096])
    again = run_train(*flags, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"--resume auto: {newest}: cannot be loaded" in again.stderr
    assert "resumed from" in again.stderr and "step_0000001.pt at step 1" in again.stderr
    resumed = ckpt.load(ckpt_dir / "last.pt")
    assert resumed["state"]["step"] == 2
    assert max(float((resumed["model"][k].double() - v.double()).abs().max()) for k, v in expected.items()
               if v.numel()) <= 1e-6


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB disk."""
    with tmpfs(tmp_path / "disk", "1m") as mount:
        yield mount


def test_a_full_disk_during_a_real_save_is_one_error_and_keeps_the_previous_checkpoint(small_disk):
    ckpt.save(small_disk, _payload(2), 2, keep=2)
    too_big = _payload(4) | {"model": {"w": torch.zeros(2**19)}}  # 2 MiB of weights on a 1 MiB disk
    with pytest.raises(CheckpointError, match=r"step_0000004.pt: cannot be written"):
        ckpt.save(small_disk, too_big, 4, keep=2)
    assert sorted(p.name for p in small_disk.iterdir()) == ["last.pt", "step_0000002.pt"]
    assert ckpt.load(small_disk / "last.pt")["state"]["step"] == 2
