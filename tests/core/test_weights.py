"""The starting points people actually use: torchvision's COCO Mask R-CNN state dict (`--weights`) and an
ImageNet ResNet-50 (`--weights-backbone`), built here from torchvision's builders with random weights
(nothing downloads), load into a 4-class model that then trains a step; a file of another model is one line."""
import logging

import pytest
import torch
import torchvision
from torchvision.models.detection import maskrcnn_resnet50_fpn, maskrcnn_resnet50_fpn_v2
from torchvision.ops import FrozenBatchNorm2d

from maskrcnn_tut.config import make_config
from maskrcnn_tut.errors import CheckpointError
from maskrcnn_tut.model import build_model
from maskrcnn_tut.train import main

CLASSES = 4  # + background


@pytest.fixture(scope="module")
def torchvision_files(tmp_path_factory) -> dict:
    """torchvision-shaped state dicts: Mask R-CNN v1 and v2 (91 classes), ImageNet ResNet-50 and ResNet-18."""
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    models = {"maskrcnn": maskrcnn_resnet50_fpn(weights=None, weights_backbone=None),
              "maskrcnn_v2": maskrcnn_resnet50_fpn_v2(weights=None, weights_backbone=None),
              "resnet50": torchvision.models.resnet50(), "resnet18": torchvision.models.resnet18()}
    files = {}
    for name, model in models.items():
        files[name] = root / f"{name}.pt"
        torch.save(model.state_dict(), files[name])
    return files


def _train_one_step(model) -> None:
    """One SGD step on a 128 px image with one square object: the losses are finite and weights move."""
    image = torch.rand(3, 128, 128)
    mask = torch.zeros(1, 128, 128, dtype=torch.uint8)
    mask[0, 32:96, 32:96] = 1
    target = {"boxes": torch.tensor([[32.0, 32.0, 96.0, 96.0]]), "labels": torch.tensor([2]), "masks": mask}
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    losses = model([image], [target])
    loss = sum(losses.values())
    assert torch.isfinite(loss), losses
    loss.backward()
    torch.optim.SGD(trainable, lr=0.01).step()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainable))


def _small_r50(**settings):
    return make_config("gpu-r50", min_size=128, max_size=128, rpn_pre_nms_top_n=100, rpn_post_nms_top_n=50,
                       box_batch_size_per_image=32, **settings)


def test_torchvision_maskrcnn_loads_into_a_4_class_model_with_frozen_bn_and_trains(torchvision_files, caplog):
    cfg = _small_r50(weights=str(torchvision_files["maskrcnn"]))
    assert cfg.norm == "frozen"  # the gpu-r50 preset freezes BatchNorm with --weights, as torchvision does
    with caplog.at_level(logging.INFO, logger="maskrcnn_tut.model"):
        model = build_model(cfg, CLASSES + 1)
    source = torch.load(torchvision_files["maskrcnn"], weights_only=True)
    own = model.state_dict()
    for key in ("backbone.body.layer4.2.conv3.weight", "backbone.body.bn1.running_var",
                "backbone.fpn.layer_blocks.3.0.weight", "rpn.head.cls_logits.weight",
                "roi_heads.box_head.fc7.weight", "roi_heads.mask_head.3.0.weight"):
        assert torch.equal(own[key], source[key]), key
    assert own["roi_heads.box_predictor.cls_score.weight"].shape[0] == CLASSES + 1  # re-initialised for 5
    assert isinstance(model.backbone.body.bn1, FrozenBatchNorm2d)
    report = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("--weights"))
    assert "loaded 301 tensors, 6 re-initialised" in report and "ignored" in report
    _train_one_step(model)


def test_imagenet_resnet50_seeds_the_backbone_alone_and_trains(torchvision_files, caplog):
    cfg = _small_r50(weights_backbone=str(torchvision_files["resnet50"]))
    assert cfg.norm == "frozen"
    with caplog.at_level(logging.INFO, logger="maskrcnn_tut.model"):
        model = build_model(cfg, CLASSES + 1)
    source = torch.load(torchvision_files["resnet50"], weights_only=True)
    body = model.backbone.body.state_dict()
    assert all(torch.equal(body[k], source[k]) for k in body)
    report = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("--weights-backbone"))
    assert "loaded 265 tensors, 0 re-initialised, 2 in the file ignored (e.g. fc.bias, fc.weight)" in report
    _train_one_step(model)


def test_torchvision_v2_loads_with_its_normalized_fpn_and_mask_head_under_norm_bn(torchvision_files, caplog):
    """v2 normalizes its FPN and mask head (BatchNorm): --norm bn gives our model the same layers, and
    only v2's conv box head and second RPN conv, which this model does not have, are left out."""
    with caplog.at_level(logging.INFO, logger="maskrcnn_tut.model"):
        build_model(_small_r50(weights=str(torchvision_files["maskrcnn_v2"])), CLASSES + 1)  # norm frozen
        assert "torchvision's v2 weights have them: --norm bn" in caplog.text
        caplog.clear()
        model = build_model(_small_r50(weights=str(torchvision_files["maskrcnn_v2"]), norm="bn"), CLASSES + 1)
    source = torch.load(torchvision_files["maskrcnn_v2"], weights_only=True)
    own = model.state_dict()
    for key in ("backbone.fpn.inner_blocks.0.1.running_var", "roi_heads.mask_head.3.1.weight",
                "backbone.body.layer3.5.bn2.weight"):
        assert torch.equal(own[key], source[key]), key
    assert "--norm bn" not in caplog.text and "re-initialised (e.g. roi_heads.box_head.fc6" in caplog.text


@pytest.mark.parametrize("flag,file,says", [
    ("weights", "resnet50", "give it as --weights-backbone"),
    ("weights_backbone", "maskrcnn", "give it as --weights"),
    ("weights_backbone", "resnet18", r"layer1.0.conv1.weight: shape \(64, 64, 3, 3\) vs the model\'s \(64, 64, 1, 1\)"),
])
def test_a_file_of_another_model_is_refused(torchvision_files, flag, file, says):
    with pytest.raises(CheckpointError, match=says) as caught:
        build_model(_small_r50(**{flag: str(torchvision_files[file])}), CLASSES + 1)
    assert len(str(caught.value).splitlines()) == 1


def test_train_py_says_a_mismatched_file_in_one_line(torchvision_files, shapes_root, tmp_path, capsys):
    """cpu-tiny is a ResNet-18: torchvision's R50 Mask R-CNN does not fit, and train.py says so."""
    flags = ["--data-path", str(shapes_root), "--output-dir", str(tmp_path / "run"), "--no-progress",
             "--weights", str(torchvision_files["maskrcnn"]), "--test-only"]
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --weights {torchvision_files['maskrcnn']}: does not match this model"), err
    assert len(err.splitlines()) == 1
