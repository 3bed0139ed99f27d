"""torchvision Mask R-CNN, built from local code only (nothing is ever downloaded).

Training from scratch needs normalization that learns: torchvision's default for pretrained
backbones, `FrozenBatchNorm2d`, is an identity when its statistics are random. `--norm bn` (the
default) uses trainable BatchNorm, `gn` GroupNorm, and `frozen` is only for `--weights` that carry
real statistics. `--sync-bn` turns BatchNorm into SyncBatchNorm across processes.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torchvision.models import resnet
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import misc as misc_ops

from .errors import CheckpointError

log = logging.getLogger(__name__)

NORM_LAYERS = {
    "bn": nn.BatchNorm2d,
    "frozen": misc_ops.FrozenBatchNorm2d,
    "gn": functools.partial(nn.GroupNorm, 32),
}


def build_model(cfg, num_classes: int) -> MaskRCNN:
    """Mask R-CNN with a ResNet-FPN backbone as the config describes, randomly initialised.

    The head widths are knobs: `gpu-r50` keeps torchvision's (FPN 256, four 256-wide mask
    convs, 1024-d box head); `cpu-tiny` halves the FPN and thins the heads, which makes a step
    about 3x faster on a CPU while still learning the shapes dataset. Trained from scratch, the
    FPN and mask head get the same normalization as the backbone (as torchvision's v2 recipe
    does), and anchor sizes follow the object sizes (`--anchor-sizes`).
    """
    norm = NORM_LAYERS[cfg.norm]
    body = getattr(resnet, cfg.backbone)(weights=None, norm_layer=norm)
    widths = [body.layer1[-1].conv1.in_channels * (2 ** i) for i in range(4)]  # C2..C5 channels
    head_norm = None if cfg.norm == "frozen" else norm  # torchvision's v1 heads (pretrained) have none
    backbone = BackboneWithFPN(body, {f"layer{i + 1}": str(i) for i in range(4)}, widths, cfg.fpn_channels,
                               norm_layer=head_norm)
    sizes = tuple((int(s),) for s in cfg.anchor_sizes.split(","))
    anchors = AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * len(sizes))
    mask_layers = [cfg.mask_head_channels] * cfg.mask_head_layers
    model = MaskRCNN(
        backbone, num_classes=None, min_size=cfg.min_size, max_size=cfg.max_size,
        rpn_anchor_generator=anchors,
        rpn_pre_nms_top_n_train=cfg.rpn_pre_nms_top_n, rpn_post_nms_top_n_train=cfg.rpn_post_nms_top_n,
        rpn_pre_nms_top_n_test=cfg.rpn_pre_nms_top_n, rpn_post_nms_top_n_test=cfg.rpn_post_nms_top_n,
        rpn_batch_size_per_image=cfg.rpn_batch_size_per_image,
        box_batch_size_per_image=cfg.box_batch_size_per_image,
        box_head=TwoMLPHead(cfg.fpn_channels * 7 * 7, cfg.box_head_dim),
        box_predictor=FastRCNNPredictor(cfg.box_head_dim, num_classes),
        mask_head=MaskRCNNHeads(cfg.fpn_channels, mask_layers, 1, norm_layer=head_norm),
        mask_predictor=MaskRCNNPredictor(mask_layers[-1], mask_layers[-1], num_classes),
    )
    if cfg.weights:
        load_weights(model, cfg.weights)
    if cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:
        model.backbone = model.backbone.to(memory_format=torch.channels_last)
    return model


def load_weights(model: nn.Module, path: str) -> None:
    """Load a local state dict; heads whose shape differs (another class count) stay random."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # not a torch file, truncated, unsafe pickle...
        raise CheckpointError(f"--weights {path}: not a loadable torch state dict ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''})") from None
    state = state.get("model", state) if isinstance(state, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"--weights {path}: holds no state dict (a dict of tensors)")
    own = model.state_dict()
    matching = {k: v for k, v in state.items()
                if k in own and isinstance(v, torch.Tensor) and own[k].shape == v.shape}
    skipped = sorted(set(state) - set(matching))
    if not matching:
        raise CheckpointError(f"--weights {path}: no tensor matches this model (is it a Mask R-CNN "
                         f"state dict for backbone {model.backbone.body.__class__.__name__}?)")
    model.load_state_dict(matching, strict=False)
    if skipped:
        log.warning("--weights %s: %d tensors left at random init (shape or name differs), e.g. %s",
                    path, len(skipped), ", ".join(skipped[:3]))


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
