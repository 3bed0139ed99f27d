"""Bad inputs an operator's machine hands the data side: each one line, never a traceback or a
hang. An annotations json nested a million levels deep or that is a pipe, and the embedded shapes
dataset under a read-only cache folder."""
from __future__ import annotations

import os
import shutil

import pytest
from disks import tmpfs

from maskrcnn_tut.data import check
from maskrcnn_tut.data.shapes import ensure_shapes_dataset
from maskrcnn_tut.errors import ConfigError


def test_an_annotations_json_nested_a_million_levels_deep_is_one_line(small_shapes, tmp_path, capsys):
    root = tmp_path / "data"
    shutil.copytree(small_shapes, root)
    train_json = root / "annotations" / "instances_train2017.json"
    train_json.write_text("[" * 10**6 + "]" * 10**6)
    assert check.main(["--data-path", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {train_json}: lists or objects nested deeper than Python's JSON parser allows")
    assert "\n" not in err


@pytest.mark.timeout(60)  # reading a pipe waits forever
def test_an_annotations_file_that_is_a_pipe_is_one_line_not_a_wait(small_shapes, tmp_path, capsys):
    root = tmp_path / "data"
    shutil.copytree(small_shapes, root)
    train_json = root / "annotations" / "instances_train2017.json"
    train_json.unlink()
    os.mkfifo(train_json)
    val_json = root / "annotations" / "instances_val2017.json"
    assert check.main(["--train-json", str(train_json), "--train-images", str(root / "train2017"),
                       "--val-json", str(val_json), "--val-images", str(root / "val2017")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {train_json}: not a regular file (a folder, pipe or device), so not an annotation file"


def test_the_shapes_dataset_under_a_read_only_cache_is_one_line_naming_the_folder_and_the_variable(tmp_path,
                                                                                                   monkeypatch):
    with tmpfs(tmp_path / "cache", "1m", read_only=True) as cache:
        monkeypatch.setenv("MASKRCNN_TUT_CACHE", str(cache))
        with pytest.raises(ConfigError) as err:
            ensure_shapes_dataset(4, 2, progress=False)
    message = str(err.value)
    assert message.startswith(f"{cache}: cannot write the shapes dataset there (Read-only file system)")
    assert "MASKRCNN_TUT_CACHE" in message and "--data-path" in message
