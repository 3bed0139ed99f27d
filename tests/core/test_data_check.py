"""Broken COCO data: every problem kind is found, counted and repaired or dropped, `data.check`
reports each one, training on it works, and data that leaves nothing to train on stops the run
before heavy work with one line and exit code 2."""
import json
import logging
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from broken_coco import EXIF_REFERENCE, write_broken_coco
from conftest import PYTHON, TRAIN_SCRIPT, subprocess_env
from PIL import Image

from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.data import check
from maskrcnn_tut.data.clean import PROBLEMS
from maskrcnn_tut.data.coco import LOAD_FAILED_KEY, CocoDetection, coco_paths, read_rgb
from maskrcnn_tut.data.loader import batch_stream, build_train_loader, train_transforms
from maskrcnn_tut.errors import DataError
from maskrcnn_tut.lab.processes import free_port

#: Kinds that only happen while training runs (a file that breaks after the start-up scan).
RUNTIME_KINDS = {"load_failed"}


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return write_broken_coco(tmp_path_factory.mktemp("broken"))


@pytest.fixture(scope="module")
def broken_train(broken):
    return CocoDetection(*coco_paths(broken.root, "train"), train=True)


def test_every_problem_kind_is_planted_and_counted(broken, broken_train):
    assert set(broken.expected) == set(PROBLEMS) - RUNTIME_KINDS
    assert dict(broken_train.report.counts) == dict(broken.expected)
    assert len(broken_train) == broken.usable_train_images


def test_every_kept_sample_has_rgb_pixels_and_masks_of_its_size(broken_train):
    for index in range(len(broken_train)):
        image, target = broken_train[index]
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        assert target["masks"].shape[1:] == image.shape[1:]
        assert len(target["masks"]) == len(target["boxes"]) == len(target["labels"]) > 0
        assert (target["masks"].flatten(1).sum(1) > 0).all()
        boxes = target["boxes"]
        assert (boxes[:, 2:] > boxes[:, :2]).all()
        assert (boxes[:, 2] <= image.shape[2]).all() and (boxes[:, 3] <= image.shape[1]).all()
        assert set(target["labels"].tolist()) <= {1, 2, 3}


def test_exif_rotated_image_is_decoded_upright(broken, broken_train):
    upright = np.asarray(Image.open(broken.root / EXIF_REFERENCE).convert("RGB"), dtype=np.float32)
    decoded = np.asarray(read_rgb(broken.root / "train2017" / "exif_rotated.jpg"), dtype=np.float32)
    assert decoded.shape == upright.shape
    assert np.abs(decoded - upright).mean() < 8  # JPEG noise only; a sideways image differs wholesale
    sideways = np.asarray(Image.open(broken.root / "train2017" / "exif_rotated.jpg").convert("RGB"))
    assert sideways.shape != upright.shape or np.abs(sideways - upright).mean() > 20


def test_sixteen_bit_image_keeps_its_grey_levels(broken):
    decoded = np.asarray(read_rgb(broken.root / "train2017" / "mode_16bit.png"), dtype=np.int32)
    raw = np.asarray(Image.open(broken.root / "train2017" / "mode_16bit.png"), dtype=np.int32)
    assert np.abs(decoded[..., 0] - raw // 257).max() <= 1
    assert (decoded[..., 0] == decoded[..., 2]).all()


def _copy_with_a_file_broken_after_the_scan(shapes_root, tmp_path, **kwargs) -> CocoDetection:
    root = tmp_path / "copy"
    shutil.copytree(shapes_root, root)
    dataset = CocoDetection(*coco_paths(root, "val"), train=True, **kwargs)
    broken_file = root / "val2017" / dataset.images[0]["file_name"]
    broken_file.write_bytes(broken_file.read_bytes()[:100])
    return dataset


def _decode_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "failed to decode" in r.getMessage()]


def test_a_file_that_breaks_after_the_scan_is_replaced_by_the_next_image(tmp_path, shapes_root, caplog):
    dataset = _copy_with_a_file_broken_after_the_scan(shapes_root, tmp_path)
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut.data.coco"):
        image, target = dataset[0]
        again, _ = dataset[0]
    assert target["image_id"] == dataset.images[1]["id"] and LOAD_FAILED_KEY not in target
    assert dataset.report.counts["load_failed"] == 2  # every failure counted...
    assert len(_decode_warnings(caplog)) == 1  # ...but logged once per image


def test_decode_failures_in_worker_processes_are_counted_in_the_main_process(tmp_path, shapes_root, caplog):
    dataset = _copy_with_a_file_broken_after_the_scan(shapes_root, tmp_path, transforms=train_transforms())
    cfg = derive(make_config("cpu-tiny", workers=1, batch_size=1, aspect_ratio_group_factor=-1), 1, "cpu")
    loader = build_train_loader(dataset, cfg, 0, 1)
    assert loader.num_workers == 1 and len(loader) == len(dataset)  # every image, every epoch
    state = SimpleNamespace(epoch=0, batch_in_epoch=0)
    stream = batch_stream(loader, state)
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut.data.coco"):
        batches = [next(stream) for _ in range(2 * len(loader))]
    assert (state.epoch, state.batch_in_epoch) == (1, len(loader))
    assert dataset.report.counts["load_failed"] == 2  # once per epoch, in this process's report
    assert dataset.report.examples["load_failed"] == [dataset.images[0]["id"]]
    assert all(LOAD_FAILED_KEY not in t for _, targets in batches for t in targets)  # stripped
    assert len(_decode_warnings(caplog)) == 1


@pytest.mark.system
def test_check_prints_a_row_for_every_problem_kind(broken):
    out = subprocess.run([PYTHON, "-m", "maskrcnn_tut.data.check", "--data-path", str(broken.root)],
                         capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith("  ")}
    for kind, count in broken.expected.items():
        assert int(rows[kind][1]) == count, (kind, rows.get(kind))
        assert PROBLEMS[kind][:30] in out.stdout
    assert f"{broken.usable_train_images} usable images" in out.stdout


@pytest.mark.parametrize("preset,sizes", [("gpu-r50", (800, 1333)), ("cpu-real", (192, 288))])
def test_check_uses_the_presets_image_sizes(preset, sizes, broken, capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(check, "check_split", lambda cfg, split, verify: seen.append((cfg.min_size, cfg.max_size))
                        or CocoDetection(*coco_paths(broken.root, split), train=split == "train"))
    assert check.main(["--data-path", str(broken.root), "--preset", preset]) == 0
    assert seen == [sizes, sizes]
    assert f"--min-size {sizes[0]} --max-size {sizes[1]} (preset {preset})" in capsys.readouterr().out
    assert check.main(["--data-path", str(broken.root), "--preset", preset, "--min-size", "64"]) == 0
    assert seen[-1] == (64, sizes[1])  # a typed size wins over the preset's


def _write_json(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", ["invalid_json", "empty_json", "no_usable_images"])
def test_nothing_to_train_on_is_one_line_and_exit_code_2(case, broken, tmp_path, capsys):
    root = tmp_path / "data"
    shutil.copytree(broken.root, root)
    train_json = root / "annotations" / "instances_train2017.json"
    if case == "invalid_json":
        _write_json(train_json, '{"images": [')
    elif case == "empty_json":
        _write_json(train_json, "")
    else:
        shutil.rmtree(root / "train2017")
        (root / "train2017").mkdir()
    assert check.main(["--data-path", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {train_json}:") and "\n" not in err
    with pytest.raises(DataError, match=str(train_json)):
        CocoDetection(*coco_paths(root, "train"))


@pytest.mark.system
def test_training_stops_before_heavy_work_on_unusable_data(broken, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(broken.root, root)
    _write_json(root / "annotations" / "instances_train2017.json", "not json")
    out = subprocess.run([PYTHON, str(TRAIN_SCRIPT), "--data-path", str(root), "--output-dir", str(tmp_path / "run"),
                          "--no-progress"], capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, out.stderr[-2000:]
    assert errors[0].startswith(f"error: {root / 'annotations' / 'instances_train2017.json'}: not valid JSON")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.system
def test_two_processes_train_on_broken_data_and_log_the_counts(broken, tmp_path):
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
           str(TRAIN_SCRIPT), "--data-path", str(broken.root), "--output-dir", str(tmp_path / "run"),
           "--batch-size", "2", "--min-size", "96", "--max-size", "128", "--workers", "0", "--no-progress",
           "--max-steps", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert out.returncode == 0, out.stderr[-3000:]
    summary = next(line for line in out.stderr.splitlines() if "INFO train data" in line)
    for kind, count in broken.expected.items():
        assert f"{kind}: {count} (" in summary, kind
    assert f": {broken.usable_train_images} images;" in summary
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
