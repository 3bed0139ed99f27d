"""after_course (chapter 12): the overfit verdict, results JSON scored and explained with pycocotools, the
overfit images and in-process predict on a short run, and the --weights reports captured."""
import json

import numpy as np
import pytest
import torch
from conftest import run_flags
from PIL import Image
from pycocotools import mask as mask_utils

from maskrcnn_tut.config import make_config
from maskrcnn_tut.lab import after_course
from maskrcnn_tut.train import main as train_main


def test_overfit_check_needs_the_loss_halved():
    assert after_course.overfit_check([4.0, 3.0, 1.9])["passed"]
    verdict = after_course.overfit_check([4.0, 3.5, 2.1])
    assert not verdict["passed"] and verdict["ratio"] == pytest.approx(2.1 / 4.0)
    with pytest.raises(ValueError):
        after_course.overfit_check([4.0])


def _square(x0, y0, side, height=40, width=50):
    mask = np.zeros((height, width), dtype=np.uint8)
    mask[y0:y0 + side, x0:x0 + side] = 1
    rle = mask_utils.encode(np.asfortranarray(mask))
    rle["counts"] = rle["counts"].decode("ascii")
    return rle


@pytest.fixture
def gt_json(tmp_path):
    """Two 50x40 images, one 10 px square each (category 7, 'kite')."""
    gt = {"images": [{"id": i, "file_name": f"{i}.png", "width": 50, "height": 40} for i in (1, 2)],
          "categories": [{"id": 7, "name": "kite"}],
          "annotations": [{"id": i, "image_id": i, "category_id": 7, "bbox": [5.0, 5.0, 10.0, 10.0], "area": 100,
                           "iscrowd": 0, "segmentation": _square(5, 5, 10)} for i in (1, 2)]}
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt))
    return path


def _result(image_id, x0, y0, score=0.9):
    return {"image_id": image_id, "category_id": 7, "bbox": [float(x0), float(y0), 10.0, 10.0], "score": score,
            "segmentation": _square(x0, y0, 10)}


def test_coco_scores_reads_the_file_and_restricts_to_the_images_given(gt_json, tmp_path):
    results = tmp_path / "detections.json"
    results.write_text(json.dumps([_result(1, 5, 5), _result(2, 30, 25)]))  # image 2's detection misses
    both = after_course.coco_scores(gt_json, results)
    assert both["segm AP50"] == pytest.approx(0.5, abs=0.01) and both["bbox AP50"] == pytest.approx(0.5, abs=0.01)
    assert after_course.coco_scores(gt_json, results, image_ids=[1]) == pytest.approx(
        {"bbox AP": 1.0, "bbox AP50": 1.0, "segm AP": 1.0, "segm AP50": 1.0})
    assert after_course.coco_scores(gt_json, results, image_ids=[2])["segm AP50"] == 0.0


def test_explain_result_names_the_category_and_decodes_the_mask(gt_json):
    rows = {row["field"]: row for row in after_course.explain_result(_result(1, 5, 5), gt_json)}
    assert list(rows) == list(after_course.RESULT_FIELDS)
    assert rows["category_id"]["value"] == "7 (kite)" and "100 pixels" in rows["segmentation"]["value"]


def _predict_folder(tmp_path, results, images):
    """A folder as predict writes it: detections.json, and images.json naming 50x40 PNG files."""
    out = tmp_path / "pred"
    out.mkdir(parents=True)
    listed = {}
    for image_id in images:
        path = tmp_path / f"{image_id}.png"
        Image.new("RGB", (50, 40)).save(path)
        listed[str(path)] = image_id
    (out / "images.json").write_text(json.dumps(listed))
    (out / "detections.json").write_text(json.dumps(results))
    return out


def test_check_results_catches_what_another_tool_would_trip_on(gt_json, tmp_path):
    good = [_result(1, 5, 5), _result(2, 30, 25)]
    assert all(after_course.check_results(_predict_folder(tmp_path / "a", good, [1, 2]), gt_json).values())
    transposed = [{**good[0], "segmentation": {**good[0]["segmentation"], "size": [50, 40]}}]
    checks = after_course.check_results(_predict_folder(tmp_path / "b", transposed, [1, 2]), gt_json)
    assert not checks["every mask has its image's height and width"]
    checks = after_course.check_results(_predict_folder(tmp_path / "c", good, [1]), gt_json)
    assert not checks["every detection's image is listed in images.json"]
    checks = after_course.check_results(_predict_folder(tmp_path / "d", [{**good[0], "category_id": 1}], [1]), gt_json)
    assert not checks["every category_id is one of the training json's"]
    checks = after_course.check_results(_predict_folder(tmp_path / "e", [_result(9, 5, 5)], [9]), gt_json)
    assert not checks["pycocotools' loadRes reads detections.json"]  # an image the json does not have


def test_run_cli_prints_the_command_and_raises_on_failure(capsys):
    seen = []
    after_course.run_cli(lambda argv: seen.append(argv) or 0, "python tool.py", ["--out", "a b", 3])
    assert seen == [["--out", "a b", "3"]] and "$ python tool.py --out 'a b' 3" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="exited with code 2"):
        after_course.run_cli(lambda argv: 2, "python tool.py", [])


def test_overfit_then_predict_on_the_memorized_images(small_shapes, tmp_path):
    out = tmp_path / "run"
    after_course.run_cli(train_main, "python maskrcnn_tut/train.py",
                         run_flags(small_shapes, out, "--overfit", "3", "--max-steps", "2"))
    steps, loss_values = after_course.losses(out)
    assert steps == [1, 2] and all(np.isfinite(loss_values))
    cfg = make_config("cpu-tiny", data_path=str(small_shapes), min_size=96, max_size=128)
    photos = after_course.overfit_images(cfg, 3)
    train_json = json.loads((small_shapes / "annotations" / "instances_train2017.json").read_text())
    assert [p.name for p in photos] == [im["file_name"] for im in train_json["images"][:3]]
    summary = after_course.predict_images(["--checkpoint", out / "checkpoints" / "last.pt", "--out", tmp_path / "pred",
                                           "--workers", 0, "--no-progress", "--score-threshold", 0, *photos])
    assert summary["images"] == 3 and summary["img_per_s"] > 0
    assert sorted(p.name for p in (tmp_path / "pred" / "overlays").iterdir()) == sorted(p.name for p in photos)
    results = json.loads((tmp_path / "pred" / "detections.json").read_text())
    assert results and all(after_course.check_results(tmp_path / "pred", small_shapes / "annotations" / "instances_val2017.json").values())


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory):
    torch.manual_seed(0)
    return after_course.torchvision_files(tmp_path_factory.mktemp("weights"))


def test_weights_report_says_what_loaded(weight_files):
    cfg = make_config("gpu-r50", weights=str(weight_files["maskrcnn_resnet50_fpn"]), min_size=128, max_size=128)
    model, lines = after_course.weights_report(cfg, 4)
    assert len(lines) == 1 and "loaded 301 tensors, 6 re-initialised" in lines[0]
    source = torch.load(weight_files["maskrcnn_resnet50_fpn"], weights_only=True)
    assert torch.equal(model.state_dict()["backbone.body.layer1.0.conv1.weight"], source["backbone.body.layer1.0.conv1.weight"])
    assert list(after_course.weights_checks(model, weight_files["maskrcnn_resnet50_fpn"], 4).values()) == [True] * 3
    with torch.no_grad():
        model.backbone.fpn.layer_blocks[0][0].weight.add_(1)  # a model the file did not fill
    checks = after_course.weights_checks(model, weight_files["maskrcnn_resnet50_fpn"], 5)
    assert list(checks.values()) == [False, False, True]
    _, lines = after_course.weights_report(make_config("cpu-tiny", weights_backbone=str(weight_files["resnet18"])), 4)
    assert len(lines) == 1 and lines[0].startswith("--weights-backbone") and "fc.weight" in lines[0]
