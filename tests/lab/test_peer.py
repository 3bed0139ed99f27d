"""The side-by-side bench against torchvision's detection reference (`bench.peer`, `tools/peer_timed.py`),
with a fake reference written here: a tiny torchvision Mask R-CNN trained by a loop of its own, so no
test needs ../shared. The wrapper logs each training forward (the model's sizes set from the
environment); its records become steady lines, warm-up until the shapes stop changing, steps across
an evaluation left out; a run is stopped once it logged enough steps."""
import json
import os
import subprocess
import sys
import time

import pytest

from maskrcnn_tut.lab.bench import peer, steady
from maskrcnn_tut.lab.wording import VERDICTS

#: A reference stand-in: a tiny Mask R-CNN built at torchvision's 800/1333 px, batches drawn through a
#: DataLoader, images 120 px wide on even iterations, 90 on odd ones, an evaluation after iteration 1.
FAKE = """
import sys
import torch
from torch import nn
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import MultiScaleRoIAlign

backbone = nn.Conv2d(3, 8, 3, stride=4, padding=1)
backbone.out_channels = 8
model = MaskRCNN(backbone, box_predictor=FastRCNNPredictor(1024, 2), rpn_anchor_generator=AnchorGenerator(((16,),), ((1.0,),)),
                 box_roi_pool=MultiScaleRoIAlign(["0"], 7, 2), mask_roi_pool=MultiScaleRoIAlign(["0"], 14, 2),
                 mask_head=MaskRCNNHeads(8, [8], 1), mask_predictor=MaskRCNNPredictor(8, 8, 2),
                 rpn_post_nms_top_n_train=32, box_batch_size_per_image=16)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for i in torch.utils.data.DataLoader(range(int(sys.argv[1])), batch_size=None):
    model.train()
    width = 90 if i % 2 else 120
    masks = torch.zeros(1, 60, width, dtype=torch.uint8)
    masks[:, 10:40, 10:40] = 1
    target = {"boxes": torch.tensor([[10.0, 10.0, 40.0, 40.0]]), "labels": torch.tensor([1]), "masks": masks}
    loss = sum(model([torch.rand(3, 60, width)] * 2, [target] * 2).values())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    loss.item()
    if i == 1:
        model.eval()
        with torch.no_grad():
            model([torch.rand(3, 60, 200)])
"""


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(FAKE)
    return script


def test_the_wrapper_logs_each_training_forward_at_the_sizes_asked(fake, tmp_path):
    log = tmp_path / "steps.jsonl"
    env = {**os.environ, "PEER_STEPS": str(log), "PEER_MIN_SIZE": "64", "PEER_MAX_SIZE": "160"}
    done = subprocess.run([sys.executable, str(peer.PEER_TIMED), str(fake), "--", "6"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = peer.records(log)
    assert len(found) == 6  # one line per training forward, none for the evaluation
    # a line carries the step it ends: 60 px high images at min size 64 (not 800), 96 or 128 wide padded
    assert found[0]["shape"] is None
    assert [r["shape"] for r in found[1:]] == [[64, 128], [64, 96], [64, 128], [64, 96], [64, 128]]
    assert [r["eval"] for r in found] == [False, False, True, False, False, False]
    assert all(r["rois"] > 0 for r in found[1:]) and found[0]["threads"] >= 1
    for key in ("t", "data s", "minflt", "stime"):
        assert all(a[key] <= b[key] for a, b in zip(found, found[1:])), key
    assert found[-1]["data s"] > 0

    lines = peer.step_lines(found, "fake", quiet=1)
    # the step across the evaluation (the 2nd) is left out; its shape counts as met
    assert [(line["shape"], line["new shape"], line["phase"]) for line in lines] == [
        ([64, 128], True, "warm-up"), ([64, 128], False, "warm-up"), ([64, 96], False, "measure"),
        ([64, 128], False, "measure")]
    assert lines[0]["wall s"] == pytest.approx(found[1]["t"] - found[0]["t"])
    assert lines[2]["minor faults"] == found[4]["minflt"] - found[3]["minflt"]
    row = steady.summarize(lines, images_per_step=2)
    assert (row["steps"], row["steady steps"], row["warm-up steps"], row["shapes"]) == (2, 2, 2, 2)
    assert row["img/s steady"] > 0
    assert steady.verdict(lines, lines)["verdict"] in VERDICTS


def records(shapes, evals=()):
    """Made-up wrapper records: a step of 0.1 s (0.5 s for a new shape), 10 faults and 0.01 system s each."""
    found, t, seen = [{"t": 0.0, "shape": None, "rois": 0, "data s": 0.0, "minflt": 0, "stime": 0.0, "eval": False,
                       "threads": 2}], 0.0, set()
    for i, shape in enumerate(shapes):
        t += 0.5 if tuple(shape) not in seen else 0.1
        seen.add(tuple(shape))
        found.append({"t": t, "shape": shape, "rois": 5, "data s": 0.001 * (i + 1), "minflt": 10 * (i + 1),
                      "stime": 0.01 * (i + 1), "eval": i in evals, "threads": 2})
    return found


def test_warm_up_lasts_until_the_shapes_stop_changing():
    a, b, c = [64, 96], [64, 128], [96, 64]
    lines = peer.step_lines(records([a, b, a, b, c, a, b, a, c]), "x", quiet=3)
    assert [line["phase"] for line in lines] == ["warm-up"] * 8 + ["measure"]  # c came after 2 quiet steps
    lines = peer.step_lines(records([a, b, a, b, a, a, a, c, a], evals={4}), "x", quiet=3)
    assert len(lines) == 8 and [line["phase"] for line in lines].count("measure") == 3
    assert lines[-2]["new shape"] and lines[-2]["block"] == 1  # a new shape after the warm-up: measured, flagged
    assert lines[0]["data s"] == pytest.approx(0.001) and lines[0]["minor faults"] == 10
    assert lines[0]["system s"] == pytest.approx(0.01)
    row = steady.summarize(lines, 2)
    assert (row["steady steps"], row["new-shape steps"]) == (2, 1) and row["img/s steady"] == pytest.approx(20)


def test_a_run_is_stopped_once_it_logged_enough_measured_steps(fake, tmp_path):
    started = time.monotonic()
    row = peer.timed_run("fake", fake, ["100000"], tmp_path, steps=3, quiet=1, timeout_s=120)
    assert row["ended"] == "enough steps" and time.monotonic() - started < 60
    assert row["steps"] >= 3 and row["minor faults/step"] is not None and row["system s/step"] is not None
    assert json.loads((tmp_path / "fake.jsonl").read_text().splitlines()[0])["shape"] is None


def test_a_failed_run_keeps_its_output(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('no data here')\n")
    row = peer.timed_run("broken", script, [], tmp_path, steps=3, quiet=1, timeout_s=60)
    assert row["ended"] == "exit 1" and "no data here" in row["output tail"] and row["img/s steady"] is None


def test_the_bench_data_is_what_the_reference_reads(tmp_path):
    images, classes = peer.check_coco(peer.bench_dataset(peer.BATCH))
    assert images >= 32 and classes == 4
    (tmp_path / "train2017").mkdir()
    (tmp_path / "val2017").mkdir()
    (tmp_path / "annotations").mkdir()
    ann = {"images": [{"id": 1}], "categories": [{"id": 1}],
           "annotations": [{"id": 7, "category_id": 1, "segmentation": {"counts": "PQ1", "size": [9, 9]}}]}
    for split in ("train", "val"):
        (tmp_path / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(ann))
    with pytest.raises(ValueError, match="e.g. id 7"):  # compressed RLE, which the shapes set wrote before v2
        peer.check_coco(tmp_path)
    assert not peer._readable([[1, 2, 3, 4]])  # pycocotools would take it for a box
    assert peer._readable([[1, 2, 3, 4, 5, 6]]) and peer._readable({"counts": [3, 4], "size": [2, 2]})


def test_the_peer_is_copied_verbatim_into_the_checkout_and_found_there(tmp_path, monkeypatch):
    shared = tmp_path / "shared" / "peer" / "torchvision-detection"
    shared.mkdir(parents=True)
    (shared / "train.py").write_text("print('the reference')\n")
    (shared / "LICENSE").write_text("BSD 3-Clause\n")
    (tmp_path / "checkout").mkdir()
    monkeypatch.setattr(peer, "ROOT", tmp_path / "checkout")
    monkeypatch.delenv("MASKRCNN_TUT_PEER", raising=False)
    with pytest.raises(FileNotFoundError, match="copy_peer"):
        peer.find_peer()
    copied = peer.copy_peer()  # ../shared/peer/torchvision-detection, from the checkout
    assert peer.find_peer() == copied == tmp_path / "checkout" / ".peer" / "torchvision-detection"
    assert sorted(p.name for p in copied.iterdir()) == ["LICENSE", "train.py"]
    assert (copied / "train.py").read_bytes() == (shared / "train.py").read_bytes()
    monkeypatch.setenv("MASKRCNN_TUT_PEER", str(shared))
    assert peer.find_peer() == shared


@pytest.mark.system
def test_side_by_side_runs_the_package_beside_a_reference(fake, tmp_path, monkeypatch):
    """The package's train.py with side_by_side's flags, beside the fake reference (which ignores its own)."""
    fake.write_text(FAKE.replace("int(sys.argv[1])", "100000"))
    monkeypatch.setenv("MASKRCNN_TUT_PEER", str(fake.parent))
    result = peer.side_by_side(steps=2, warmup_quiet=1, device="cpu", sizes=(64, 96), timeout_s=300,
                               log_dir=tmp_path / "runs")
    assert [row["ended"] for row in result["rows"]] == ["enough steps"] * 2, [r.get("output tail") for r in result["rows"]]
    assert result["rows"][1]["shapes"] >= 1 and max(result["rows"][1]["lines"][0]["shape"]) <= 96
    assert result["ratio package/reference"] > 0 and result["verdict"] in VERDICTS
    assert any("4 classes" in line for line in result["differences"])
    assert "package/reference" in peer.describe(result)
