"""After training: `torchrun -m maskrcnn_tut.predict` on 2 processes over the val images and a broken file
writes one overlay per readable image and COCO results that `COCOeval` scores to the AP `--test-only` gives
the same checkpoint on the same images (both one image per forward pass: padding a batch moves AP)."""
import json

from conftest import run_flags, run_train
from pycocotools.coco import COCO

from maskrcnn_tut.data.coco import CocoDetection
from maskrcnn_tut.evaluate import coco_from_dict, coco_metrics


def test_predict_on_two_processes_scores_as_test_only_does(shapes, tmp_path):
    data = shapes(16, 6)
    out = tmp_path / "run"
    trained = run_train(*run_flags(data, out, "--max-steps", "30"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    last = out / "checkpoints" / "last.pt"
    scored = run_train("--data-path", str(data), "--output-dir", str(out), "--batch-size", "1", "--workers", "0",
                       "--no-progress", "--test-only", "--resume", str(last))
    assert scored.returncode == 0, scored.stderr[-3000:]
    test_only = json.loads(scored.stdout.strip().splitlines()[-1])

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "half.png").write_bytes((data / "val2017" / "000001.png").read_bytes()[:300])
    predicted = tmp_path / "predicted"
    result = run_train("--checkpoint", str(last), "--out", str(predicted), "--batch-size", "1", "--workers", "0",
                       "--no-progress", str(data / "val2017"), str(broken), nproc=2,
                       script=("-m", "maskrcnn_tut.predict"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "predicted 6 images" in result.stdout and "skipped unreadable 1" in result.stdout, result.stdout
    assert sorted(p.name for p in (predicted / "overlays").iterdir()) == sorted(p.name for p in (data / "val2017").iterdir())

    results = json.loads((predicted / "detections.json").read_text())
    val_json = data / "annotations" / "instances_val2017.json"
    val_ids = COCO(str(val_json)).getImgIds()
    assert sorted(json.loads((predicted / "images.json").read_text()).values()) == sorted(val_ids)
    COCO(str(val_json)).loadRes(results)
    ground_truth = CocoDetection(data / "val2017", val_json, train=False, min_size=96, max_size=128).ground_truth()
    metrics = coco_metrics(coco_from_dict(ground_truth), results, val_ids)
    assert test_only["bbox_AP50"] > 0, test_only  # a model that finds something, so the comparison means something
    for key in ("bbox_AP", "bbox_AP50", "segm_AP", "segm_AP50"):
        assert abs(metrics[key] - test_only[key]) <= 1e-3, (key, metrics, test_only)
