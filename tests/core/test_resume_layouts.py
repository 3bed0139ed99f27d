"""A resume after changing --workers, --batch-size or the number of processes (issue 36's probes): it
continues with the images the epoch has not read yet and the schedule the checkpoint's run followed, or
stops with one line saying why it cannot.

Fixed there: with a --seed other than 0, one process shuffled an epoch otherwise than several (its own
seed formula), so a run resumed on another process count read some images of that epoch twice and
others never; an --epochs run resumed at another number of images per step counted its steps in the
new size (a third epoch begun, the lr mid-warm-up at the end); aspect-ratio groups made at another batch
size or process count are other images. Already right: another --workers count resumes to the same
weights (its sampling does not depend on the workers: `test_resume_with_other_workers_is_exact`)."""
import dataclasses

import pytest
import torch
from checkpoints import resumable_payload
from conftest import run_flags

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.data.loader import build_dataset, build_train_loader
from maskrcnn_tut.engine import TrainState
from maskrcnn_tut.train import main


def _epoch(data, processes: int, batch: int, seed: int, epoch: int = 1, skip: int = 0) -> list[list[int]]:
    """The dataset indices each step of `epoch` reads over all ranks, after `skip` steps."""
    run = derive(make_config("cpu-tiny", data_path=str(data), batch_size=batch, seed=seed, min_size=96,
                             max_size=128), processes, "cpu")
    dataset = build_dataset(run, "train")
    ranks = []
    for rank in range(processes):
        batches = build_train_loader(dataset, run, rank, processes).batch_sampler
        batches.set_epoch(epoch, skip)
        ranks.append([[index for index, _ in batch] for batch in batches])
    return [sorted(i for rank in ranks for i in rank[step]) for step in range(len(ranks[0]))]


@pytest.mark.parametrize("before,after", [((2, 2), (1, 4)), ((1, 4), (2, 2)), ((2, 2), (4, 1)), ((1, 2), (1, 1))])
@pytest.mark.parametrize("seed", [0, 1])
def test_an_epoch_resumed_on_another_layout_reads_each_image_once(small_shapes, before, after, seed):
    read = [i for step in _epoch(small_shapes, *before, seed)[:2] for i in step]  # two steps, then the checkpoint
    rest = [i for step in _epoch(small_shapes, *after, seed, skip=len(read) // (after[0] * after[1])) for i in step]
    assert sorted(read + rest) == list(range(16)), (read, rest)


def _checkpoint(path, step: int, epoch: int, batch_in_epoch: int, **settings):
    """A train.py checkpoint of a cpu-tiny run on the shapes at 96/128 px, stopped at that place."""
    payload = resumable_payload(step, min_size=96, max_size=128, **settings)
    payload["state"] = payload["state"] | {"epoch": epoch, "batch_in_epoch": batch_in_epoch}
    torch.save(payload, path)
    return path


def _resume(data, tmp_path, capsys, checkpoint, *flags) -> str:
    assert main(run_flags(data, tmp_path / "run", "--resume", str(checkpoint), *flags)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --resume: "), lines
    return lines[0]


def test_an_epochs_schedule_resumed_at_another_images_per_step_is_refused(small_shapes, tmp_path, capsys):
    """2 epochs of 4 steps of 4 images, stopped at step 6; at 2 images a step the run would plan 16 steps
    and train 10 more: 20 images where 8 were left. With --max-steps the user says how far."""
    saved = _checkpoint(tmp_path / "step6.pt", 6, 1, 2, batch_size=4, epochs=2)
    line = _resume(small_shapes, tmp_path, capsys, saved, "--epochs", "2", "--batch-size", "2")
    assert "the checkpoint's 6 steps were of 4 images, this run's are of 2" in line and "--max-steps" in line, line


def test_aspect_ratio_groups_of_another_batch_are_refused_mid_epoch(small_shapes, tmp_path, capsys):
    saved = _checkpoint(tmp_path / "step2.pt", 2, 0, 2, batch_size=2, aspect_ratio_group_factor=3)
    line = _resume(small_shapes, tmp_path, capsys, saved, "--max-steps", "4", "--batch-size", "1",
                   "--aspect-ratio-group-factor", "3")
    assert "stopped 4 images into epoch 0 with --batch-size 2 on 1 processes and --aspect-ratio-group-factor 3" in line


def test_resume_with_other_workers_is_exact(small_shapes, tmp_path):
    """2 steps without workers, then 2 more with 2 workers: the weights of 4 steps straight."""
    assert main(run_flags(small_shapes, tmp_path / "straight", "--max-steps", "4", "--seed", "1")) == 0
    assert main(run_flags(small_shapes, tmp_path / "half", "--max-steps", "2", "--seed", "1")) == 0
    flags = run_flags(small_shapes, tmp_path / "resumed", "--max-steps", "4", "--seed", "1",
                      "--resume", str(tmp_path / "half" / "checkpoints" / "last.pt"))
    flags[flags.index("--workers") + 1] = "2"
    assert main(flags) == 0
    straight, resumed = (ckpt.load(tmp_path / name / "checkpoints" / "last.pt") for name in ("straight", "resumed"))
    assert straight["state"] == resumed["state"]
    assert all(torch.equal(straight["model"][k], resumed["model"][k]) for k in straight["model"])


def test_the_refusals_leave_same_layout_resumes_alone(small_shapes):
    """The checks above pass a resume at the checkpoint's own layout, grouped or not, and any layout
    at an epoch's end or with --max-steps (the existing resume tests cover them running)."""
    saved = resumable_payload(6, min_size=96, max_size=128, batch_size=2, aspect_ratio_group_factor=3)["config"]
    state = TrainState(step=6, epoch=0, batch_in_epoch=6)
    same = derive(make_config("cpu-tiny", batch_size=2, aspect_ratio_group_factor=3), 1, "cpu")
    assert ckpt._resumed_position(state, saved, same) == state
    at_epoch_end = dataclasses.replace(state, epoch=1, batch_in_epoch=0)
    other = derive(make_config("cpu-tiny", batch_size=1, aspect_ratio_group_factor=3), 1, "cpu")
    assert ckpt._resumed_position(at_epoch_end, saved, other) == at_epoch_end
