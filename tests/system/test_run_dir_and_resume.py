"""What happens to a run's output folder and checkpoints when a careless user gets in the way: two
runs on one folder, a rerun without --resume, changed resumes, and --test-only scoring at the
checkpoint's own settings on any number of processes (preemption: test_preemption.py)."""
import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_flags, run_train, subprocess_env, train_command

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut import distributed as du
from maskrcnn_tut import rundir, train
from maskrcnn_tut.errors import DataError
from maskrcnn_tut.monitor import read_jsonl

pytestmark = pytest.mark.system


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def _wait(predicate, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _steps_logged(out: Path) -> list[int]:
    return [row["step"] for row in read_jsonl(out / "metrics.jsonl")]


def test_a_second_run_on_the_same_folder_stops_naming_the_first(small_shapes, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(train_command(*run_flags(small_shapes, out, "--max-steps", "40")),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=subprocess_env())
    try:
        _wait(lambda: len(_steps_logged(out)) >= 1, first)
        second = run_train(*run_flags(small_shapes, out, "--max-steps", "2"))
        assert second.returncode == 2
        assert _errors(second.stderr) == [line for line in second.stderr.splitlines() if line.strip()]
        assert f"is in use by another run (pid {first.pid} on" in second.stderr
        assert first.poll() is None  # the first run goes on untouched
    finally:
        first.kill()
        first.wait()


def test_a_finished_or_failed_run_frees_the_folder_for_the_next_in_the_same_process(small_shapes, tmp_path,
                                                                                   monkeypatch, capsys):
    """train.main again and again in one process (a notebook), with workers, on one folder. Issue 36: the
    lock lasted as long as the process, so the second run said the folder was "in use by another run
    (pid <its own>)"."""
    out = tmp_path / "run"
    flags = run_flags(small_shapes, out, "--max-steps", "1", "--workers", "2")
    assert train.main(flags) == 0

    def broken(cfg):
        raise DataError("no usable images (planted after the folder was claimed)")
    monkeypatch.setattr(train, "build_datasets", broken)
    assert train.main(flags) == 2
    assert _errors(capsys.readouterr().err) == ["error: no usable images (planted after the folder was claimed)"]
    rundir.releasing(rundir.claim)(out, du.DistInfo())  # free again after the failed run
    assert [p.name for p in ckpt.numbered(out / "checkpoints")] == ["step_0000001.pt"]  # the first run's, whole


def test_a_rerun_without_resume_sets_the_earlier_run_aside_whole(small_shapes, tmp_path):
    out = tmp_path / "run"
    assert run_train(*run_flags(small_shapes, out, "--max-steps", "2")).returncode == 0
    before = {name: (out / name).read_text() for name in ("config.json", "metrics.jsonl", "eval.jsonl", "summary.json")}
    again = run_train(*run_flags(small_shapes, out, "--max-steps", "1"))
    assert again.returncode == 0, again.stderr[-2000:]
    [aside] = out.glob("earlier-*")
    assert {name: (aside / name).read_text() for name in before} == before
    assert [p.name for p in ckpt.numbered(aside / "checkpoints")] == ["step_0000002.pt"]
    assert _steps_logged(out) == [1]


def test_folders_and_files_of_the_wrong_kind_and_test_only_without_checkpoint_are_one_line(small_shapes, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a folder")
    result = run_train(*run_flags(small_shapes, out, "--max-steps", "1"))
    assert result.returncode == 2 and _errors(result.stderr) == [result.stderr.strip()]
    assert "checkpoints is a file" in result.stderr
    empty = tmp_path / "empty"
    result = run_train(*run_flags(small_shapes, empty, "--test-only", "--resume", "auto"))
    assert result.returncode == 2 and "no checkpoint in" in result.stderr and "Traceback" not in result.stderr


def test_resume_applies_a_changed_lr_and_batch_and_says_so(small_shapes, tmp_path):
    out = tmp_path / "run"
    first = run_train(*run_flags(small_shapes, out, "--max-steps", "3", "--lr", "0.002",
                                 "--warmup-steps", "0"))
    assert first.returncode == 0, first.stderr[-2000:]
    # 3 steps of 2 images are 6 images into the 16-image epoch; 3 steps of 1 image land there too
    resumed = run_train(*run_flags(small_shapes, out, "--max-steps", "5", "--lr", "0.008",
                                   "--warmup-steps", "0", "--resume", "auto", "--batch-size", "1"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "instead of the checkpoint's" in resumed.stderr and "6 images into epoch 0" in resumed.stderr
    rows = read_jsonl(out / "metrics.jsonl")
    saved = json.loads((out / "config.json").read_text())
    assert saved["derived"]["scaled_lr"] == pytest.approx(0.008 * (1 / 8) ** 0.5)  # the lr this run trains with
    assert rows[-1]["lr"] > rows[2]["lr"] * 0.4  # the schedule continues from this run's base lr
    odd = run_train(*run_flags(small_shapes, tmp_path / "odd", "--max-steps", "1"))
    assert odd.returncode == 0
    refused = run_train(*run_flags(small_shapes, tmp_path / "odd", "--max-steps", "2", "--resume", "auto",
                                   "--batch-size", "3"))
    assert refused.returncode == 2 and "cannot continue at that place" in refused.stderr


def test_end_of_training_ap_equals_test_only_on_the_saved_checkpoint_at_its_own_sizes(small_shapes, tmp_path):
    out = tmp_path / "run"
    trained = run_train(*run_flags(small_shapes, out, "--max-steps", "4"), nproc=2)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # the sizes come from the checkpoint (96/128 px), not from this machine's preset (128/192);
    # a dataset with only a val split is enough to score it
    val_only = tmp_path / "val_only"
    (val_only / "annotations").mkdir(parents=True)
    (val_only / "val2017").symlink_to(small_shapes / "val2017")
    val_json = small_shapes / "annotations" / "instances_val2017.json"
    (val_only / "annotations" / "instances_val2017.json").symlink_to(val_json)
    flags = ["--data-path", str(val_only), "--output-dir", str(out), "--batch-size", "2", "--workers", "0",
             "--no-progress", "--test-only", "--resume", str(out / "checkpoints" / "last.pt")]
    scored = run_train(*flags, nproc=2)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert "min_size=96" in scored.stderr and "at step 4" in scored.stderr
    metrics = json.loads(scored.stdout.strip().splitlines()[-1])
    assert {k: round(v, 6) for k, v in metrics.items()} == {k: round(summary[k], 6) for k in metrics}


def test_resume_on_another_process_count_continues_at_the_same_place(small_shapes, tmp_path):
    """2 processes x 2 images, then 1 process x 4 images: the same images per micro-step, so the
    position carries over exactly; the RNG streams of a 2-rank checkpoint are reseeded on 1 rank."""
    out = tmp_path / "run"
    first = run_train(*run_flags(small_shapes, out, "--max-steps", "2"), nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_train(*run_flags(small_shapes, out, "--max-steps", "3", "--batch-size", "4",
                                   "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming on 1 processes from a 2-process checkpoint: RNG streams reseeded" in resumed.stderr
    state = ckpt.load(out / "checkpoints" / "last.pt")["state"]
    assert state["step"] == 3 and state["batch_in_epoch"] == 3  # 2 + 1 micro-steps of 4 images in all
    assert _steps_logged(out) == [1, 2, 3]
