"""`python -m maskrcnn_tut.predict` in-process on a checkpoint trained for a few steps: COCO results that
`loadRes` reads with the training json's ids, one overlay per readable image, bad images counted, and a
wrong checkpoint or an empty folder said in one line."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import run_flags
from PIL import Image
from pycocotools.coco import COCO

from maskrcnn_tut import predict
from maskrcnn_tut.train import main as train_main


@pytest.fixture(scope="module")
def trained(small_shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("predict") / "run"
    assert train_main(run_flags(small_shapes, out, "--max-steps", "4")) == 0
    return out / "checkpoints" / "last.pt"


def _bad_and_odd_images(folder, photo):
    """Two that cannot be used (not an image, a truncated JPEG), one too small (1 px), and two
    that can, once converted (CMYK JPEG, 16-bit grey PNG)."""
    folder.mkdir()
    (folder / "notes.jpg").write_text("not an image")
    data = (folder / "cut.jpg")
    Image.open(photo).convert("RGB").save(data, quality=95)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    Image.new("RGB", (1, 1), "red").save(folder / "dot.png")
    Image.open(photo).convert("CMYK").save(folder / "cmyk.jpg")
    grey = (np.asarray(Image.open(photo).convert("L"), dtype=np.uint16) * 257)
    Image.fromarray(grey).save(folder / "deep.png")
    assert Image.open(folder / "deep.png").mode.startswith("I;16")


def _predict(*argv):
    return predict.run(predict.build_parser().parse_args(["--workers", "0", "--no-progress", *argv]))


def test_predict_writes_coco_results_overlays_and_counts_bad_images(trained, small_shapes, tmp_path):
    val_dir, val_json = small_shapes / "val2017", small_shapes / "annotations" / "instances_val2017.json"
    odd = tmp_path / "odd"
    _bad_and_odd_images(odd, sorted(val_dir.iterdir())[0])
    out = tmp_path / "out"
    summary = _predict("--checkpoint", str(trained), "--out", str(out), "--score-threshold", "0",
                       "--overlay-threshold", "0", "--batch-size", "3", str(val_dir), str(odd))
    assert summary["skipped"] == {"unreadable": 2, "too_small": 1}
    assert summary["images"] == 4 + 2 and summary["detections"] > 0
    gt = COCO(str(val_json))
    ids = json.loads((out / "images.json").read_text())
    by_name = {im["file_name"]: im["id"] for im in gt.dataset["images"]}
    assert all(ids[str(val_dir / name)] == image_id for name, image_id in by_name.items())  # val images keep theirs
    new_ids = {ids[str(odd / n)] for n in ("cmyk.jpg", "deep.png")}
    assert len(new_ids) == 2 and min(new_ids) > max(by_name.values())  # others numbered after them
    results = json.loads((out / "detections.json").read_text())
    assert {r["category_id"] for r in results} <= set(gt.getCatIds())
    val_results = [r for r in results if r["image_id"] in gt.getImgIds()]
    dt = gt.loadRes(val_results)  # pycocotools reads them: boxes, scores and RLE masks
    assert len(dt.getAnnIds()) == len(val_results) and isinstance(results[0]["segmentation"]["counts"], str)
    overlays = sorted(p.name for p in (out / "overlays").iterdir())
    assert overlays == sorted([p.name for p in val_dir.iterdir()] + ["cmyk.jpg", "deep.png"])  # PNG in, PNG out
    drawn = np.asarray(Image.open(out / "overlays" / overlays[0]))
    assert drawn.shape[2] == 3 and not np.array_equal(drawn, np.asarray(Image.open(val_dir / overlays[0])))
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_no_overlays_threshold_and_max_detections(trained, small_shapes, tmp_path):
    out = tmp_path / "out"
    summary = _predict("--checkpoint", str(trained), "--out", str(out), "--score-threshold", "0",
                       "--max-detections", "2", "--no-overlays", str(small_shapes / "val2017"))
    results = json.loads((out / "detections.json").read_text())
    per_image = np.bincount([r["image_id"] for r in results])
    assert per_image.max() <= 2 and summary["detections"] == len(results) and not (out / "overlays").exists()


@pytest.mark.parametrize("problem", ["empty folder", "missing path", "foreign checkpoint", "not a checkpoint"])
def test_bad_arguments_are_one_line_and_exit_code_2(problem, trained, small_shapes, tmp_path, capsys):
    images, checkpoint = small_shapes / "val2017", trained
    if problem == "empty folder":
        images = tmp_path / "empty"
        images.mkdir()
    elif problem == "missing path":
        images = tmp_path / "nowhere"
    elif problem == "foreign checkpoint":
        checkpoint = tmp_path / "foreign.pt"
        payload = torch.load(trained, weights_only=True)
        payload["model"] = {k: v[..., :1] if v.ndim else v for k, v in payload["model"].items()}
        torch.save(payload, checkpoint)
    else:
        checkpoint = tmp_path / "state.pt"
        torch.save({"conv1.weight": torch.zeros(1)}, checkpoint)
    code = predict.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--no-progress",
                         "--workers", "0", str(images)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_folder_copy_gets_new_ids_only_for_names_the_val_json_lacks(trained, small_shapes, tmp_path):
    photos = tmp_path / "photos"
    shutil.copytree(small_shapes / "val2017", photos)
    first = sorted(photos.iterdir())[0]
    first.rename(photos / "renamed.jpg")
    _predict("--checkpoint", str(trained), "--out", str(tmp_path / "out"), "--no-overlays", str(photos))
    ids = json.loads((tmp_path / "out" / "images.json").read_text())
    known = {im["file_name"]: im["id"] for im in COCO(str(small_shapes / "annotations" / "instances_val2017.json")).dataset["images"]}
    assert ids[str(photos / "renamed.jpg")] == max(known.values()) + 1
    assert all(ids[str(photos / name)] == i for name, i in known.items() if name != first.name)


def test_an_interrupted_run_leaves_valid_json_of_the_batches_done(trained, small_shapes, tmp_path, monkeypatch):
    monkeypatch.setattr(predict, "SAVE_EVERY", 1)
    drawn = []

    def interrupt_on_the_third_image(image, path):
        drawn.append(path)
        if len(drawn) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(predict.overlay, "save", interrupt_on_the_third_image)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _predict("--checkpoint", str(trained), "--out", str(out), "--batch-size", "2", str(small_shapes / "val2017"))
    results = json.loads((out / "detections.json").read_text())  # the first batch, whole
    assert len({r["image_id"] for r in results}) == 2


def test_a_checkpoint_of_a_compiled_backbone_loads(trained, small_shapes, tmp_path):
    """--compile-backbone saves the compiled parts' tensors as `backbone._orig_mod.*` and `rpn.head._orig_mod.*`."""
    payload = torch.load(trained, weights_only=True)
    payload["model"] = {k.replace("backbone.", "backbone._orig_mod.").replace("rpn.head.", "rpn.head._orig_mod."): v
                        for k, v in payload["model"].items()}
    compiled = tmp_path / "compiled.pt"
    torch.save(payload, compiled)
    summary = _predict("--checkpoint", str(compiled), "--out", str(tmp_path / "out"), "--no-overlays",
                       str(small_shapes / "val2017"))
    assert summary["images"] == 4
