"""torchvision Mask R-CNN, built from local code only (nothing is ever downloaded).

Training from scratch needs normalization that learns: torchvision's default for pretrained
backbones, `FrozenBatchNorm2d`, is an identity when its statistics are random. `--norm bn` (the
default) uses trainable BatchNorm, `gn` GroupNorm, and `frozen` is only for `--weights` or
`--weights-backbone` that carry real statistics. `--sync-bn` turns BatchNorm into SyncBatchNorm across
processes. Weights are the user's own local files, in torchvision's key layout: a whole Mask R-CNN
(`load_weights`) or an ImageNet ResNet for the backbone alone (`load_backbone_weights`).
"""
from __future__ import annotations

import functools
import logging
import math
import pickle
import warnings

import torch
from torch import nn
from torchvision.models import resnet
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import misc as misc_ops

from .config import Config, Run
from .errors import CheckpointError

log = logging.getLogger(__name__)

NORM_LAYERS = {
    "bn": nn.BatchNorm2d,
    "frozen": misc_ops.FrozenBatchNorm2d,
    "gn": functools.partial(nn.GroupNorm, 32),
}


def build_model(cfg: Config | Run, num_classes: int) -> MaskRCNN:
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
    buckets = 2 if cfg.fixed_shapes else cfg.pad_buckets
    if buckets or cfg.channels_last:
        model.transform.__class__ = BatchTransform  # adds no state: only how a batch is laid out
        model.transform.buckets, model.transform.channels_last = buckets, cfg.channels_last
    if cfg.weights_backbone:
        load_backbone_weights(model, cfg.weights_backbone)
    if cfg.weights:
        load_weights(model, cfg.weights)
    if cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:
        model.backbone = model.backbone.to(memory_format=torch.channels_last)
    if cfg.compile_backbone:
        compile_backbone(model, "cuda" if cfg.accelerator != "cpu" and torch.cuda.is_available() else "cpu")
    return model


def _round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


class BatchTransform(GeneralizedRCNNTransform):
    """torchvision's transform, with two choices of how a batch is laid out.

    `buckets` (`--pad-buckets N`; `--fixed-shapes` is N = 2): each side of a batch is padded up to the
    next of N sizes spread evenly from min_size to max_size (rounded up to the stride), instead of to
    its largest image. After resizing, an image's sides lie between those two, so the backbone, FPN
    and RPN head meet at most N x N input shapes in all; with N = 2 three (landscape min x max,
    portrait max x min, and max x max for a batch of both). Repeated shapes are what cuDNN's plan
    cache, torch.compile, CUDA graphs and cudnn.benchmark need; the price is the padding. Boxes and
    the sizes that scale predictions back are the unpadded ones.
    `channels_last` (`--channels-last`): the batch is handed over in NHWC already.
    """

    buckets = 0
    channels_last = False

    def batch_images(self, images: list[torch.Tensor], size_divisible: int = 32) -> torch.Tensor:
        batch = self._bucketed_batch(images, size_divisible) if self.buckets else \
            super().batch_images(images, size_divisible)
        return batch.contiguous(memory_format=torch.channels_last) if self.channels_last else batch

    def bucket_sizes(self, size_divisible: int = 32) -> list[int]:
        """The side lengths a batch is padded to, smallest first."""
        low, high = max(self.min_size), max(self.max_size, max(self.min_size))
        steps = self.buckets - 1
        return [_round_up(low + (high - low) * i / steps, size_divisible) for i in range(self.buckets)]

    def _bucketed_batch(self, images: list[torch.Tensor], size_divisible: int) -> torch.Tensor:
        sizes = self.bucket_sizes(size_divisible)
        height, width = (max(image.shape[dim] for image in images) for dim in (-2, -1))
        # the first bucket that holds the side (an image larger than them all keeps torchvision's padding)
        height, width = (next((size for size in sizes if size >= side), _round_up(side, size_divisible))
                         for side in (height, width))
        batch = images[0].new_zeros((len(images), images[0].shape[0], height, width))
        for slot, image in zip(batch, images):
            slot[:, : image.shape[-2], : image.shape[-1]].copy_(image)
        return batch


#: Recompilations allowed per compiled part before torch.compile falls back to eager for it.
RECOMPILE_LIMIT = 8


def compile_backbone(model: MaskRCNN, device_type: str, backend: str = "inductor") -> None:
    """`torch.compile` the backbone + FPN and the RPN head (`--compile-backbone`), shapes static.

    On GPUs mode "reduce-overhead" captures them in CUDA graphs (a few kernel launches instead of
    hundreds at small batches). Every new input shape compiles again: with `--fixed-shapes` a run
    meets at most three; after `RECOMPILE_LIMIT` torch falls back to eager for that part with a
    warning (tests/compiled.py counts the graphs). The RoI heads and post-processing stay eager (their
    shapes change with every step's proposals).

    Both parts compile in place (`nn.Module.compile`), so the state dict keeps its plain keys and a
    compiled run's checkpoints load into any model. With CUDA graphs every model call marks a new
    step first: else, at inference (no backward pending), the RPN head's graph would start a new
    generation and free the backbone's features that the RoI heads still read (pytorch#160281).
    """
    from .hardware import set_recompile_limit
    set_recompile_limit(RECOMPILE_LIMIT)
    mode = "reduce-overhead" if device_type == "cuda" and backend == "inductor" else None
    model.backbone.compile(dynamic=False, mode=mode, backend=backend)
    model.rpn.head.compile(dynamic=False, mode=mode, backend=backend)
    if mode == "reduce-overhead":
        model.register_forward_pre_hook(_begin_cuda_graph_step)


def _begin_cuda_graph_step(module: nn.Module, args) -> None:
    """One CUDA-graph generation per model call, shared by the backbone and the RPN head."""
    torch.compiler.cudagraph_mark_step_begin()


def torch_load(path) -> object:
    """`torch.load` on the CPU with `weights_only=True`: tensors and plain containers only, a file that
    would run code is refused (`why_unloadable` says so); torch's warnings about the file are left out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def why_unloadable(err: Exception, path) -> str:
    """Why `torch_load(path)` failed, as "<error type>: <what the file is>", on one line; never torch's
    advice to load the file with `weights_only=False`, the step that runs whatever code it holds."""
    kind = type(err).__name__
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and "weights_only" not in line]
    if isinstance(err, OSError):
        return f"{kind}: {err.strerror or err}"
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        head = b"?"
    if not head:
        return f"{kind}: the file is empty"
    if isinstance(err, pickle.UnpicklingError) and str(err).startswith("Weights only load failed"):
        named = next((line.split("GLOBAL ", 1)[1].split()[0] for line in lines if "GLOBAL " in line), None)
        what = f"it names {named}" if named else (lines[0][:120] if lines else "objects other than tensors")
        return f"{kind}: refused, it holds Python objects, not only tensors, and loading them could run code ({what})"
    if head.isascii() and all(c >= 32 or c in b"\t\r\n" for c in head):
        text = head.decode().splitlines()[0][:40] if head.strip() else ""
        return f"{kind}: a text file, not one torch.save wrote (it starts {text!r})"
    if head.startswith(b"PK") and "central directory" in str(err):
        return f"{kind}: cut short or damaged (torch.save's zip archive has no end: {lines[0][:80]})"
    return f"{kind}: {lines[0][:200] if lines else 'empty, cut short or not a torch checkpoint file'}"


def read_state_dict(path: str, flag: str) -> dict:
    """A local state dict (or a train.py checkpoint's "model"), loaded without running code."""
    try:
        state = torch_load(path)
    except Exception as err:  # not a torch file, truncated, unsafe pickle...
        raise CheckpointError(f"{flag} {path}: not a loadable torch state dict ({why_unloadable(err, path)})") from None
    if isinstance(state, dict):
        state = state.get("model", state.get("state_dict", state))
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{flag} {path}: holds no state dict (a dict of tensors)")
    return state


#: The layers whose shapes follow the class count: a --weights file of another dataset's classes leaves them
#: at their initialisation; any other tensor of another shape (or not of numbers) means another model.
CLASS_LAYERS = ("roi_heads.box_predictor.", "roi_heads.mask_predictor.mask_fcn_logits.")


def _fits(own: torch.Tensor, theirs) -> bool:
    return (isinstance(theirs, torch.Tensor) and own.shape == theirs.shape
            and own.dtype.is_floating_point == theirs.dtype.is_floating_point)


def _load_matching(module: nn.Module, state: dict, flag: str, path: str, required: str, hint: str) -> None:
    """Load the tensors of `state` whose name and shape `module` has; every one of `module`'s
    tensors under `required` must be among them, and no other tensor of the file but the class
    layers' may have another shape or type (else one line, with `hint`); none may be NaN or infinite.
    Logs what was loaded, what stays at its initialisation (another class count) and what the file
    had extra. BatchNorm's `num_batches_tracked` counters are no weights: dropped where the model has none."""
    own = module.state_dict()
    state = {k: v for k, v in state.items() if not (k.endswith("num_batches_tracked") and k not in own)}
    loaded = {k: v for k, v in state.items() if k in own and _fits(own[k], v)}
    clash = next((k for k in state if k in own and k not in loaded and not k.startswith(CLASS_LAYERS)), None)
    if clash is not None:
        theirs, mine = state[clash], own[clash]
        found = (f"shape {tuple(theirs.shape)} vs the model's {tuple(mine.shape)}" if getattr(theirs, "shape", None)
                 != mine.shape else f"{getattr(theirs, 'dtype', type(theirs).__name__)} vs the model's {mine.dtype}")
        raise CheckpointError(f"{flag} {path}: does not match this model ({clash}: {found}); {hint}")
    broken = next((k for k, v in loaded.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if broken is not None:
        raise CheckpointError(f"{flag} {path}: {broken} holds NaN or infinite values: the file is damaged, or was "
                              "saved by a run that diverged")
    missing = [k for k in own if k.startswith(required) and k not in loaded and not k.endswith("num_batches_tracked")]
    if missing or not loaded:
        example = missing[0] if missing else next(iter(own))
        found = "absent" if example not in state else f"shape {tuple(getattr(state[example], 'shape', ()))} " \
                                                      f"vs the model's {tuple(own[example].shape)}"
        needed = sum(k.startswith(required) and not k.endswith("num_batches_tracked") for k in own)
        raise CheckpointError(f"{flag} {path}: does not match this model ({len(missing) or needed} of the "
                              f"{needed} backbone tensors it needs missing or of another shape, e.g. {example}: "
                              f"{found}); {hint}")
    module.load_state_dict(loaded, strict=False)
    fresh = [k for k in own if k not in loaded and not k.endswith("num_batches_tracked")]
    ignored = sorted(set(state) - set(loaded))
    log.info("%s %s: loaded %d tensors, %d re-initialised%s, %d in the file ignored%s", flag, path, len(loaded),
             len(fresh), f" (e.g. {', '.join(fresh[:3])})" if fresh else "", len(ignored),
             f" (e.g. {', '.join(ignored[:3])})" if ignored else "")


def load_weights(model: MaskRCNN, path: str) -> None:
    """`--weights`: a torchvision-shaped Mask R-CNN state dict (torchvision's `maskrcnn_resnet50_fpn`
    or `_v2`, or a train.py checkpoint). The whole backbone must load; heads of another class count
    (or another design) stay at their initialisation and are reported."""
    state = read_state_dict(path, "--weights")
    backbone_only = "conv1.weight" in state and not any(k.startswith("backbone.") for k in state)
    hint = ("it holds a bare ResNet (ImageNet classifier keys): give it as --weights-backbone" if backbone_only else
            "--weights takes a Mask R-CNN state dict of this model's shapes (check --backbone, --norm and the FPN and "
            "head sizes: torchvision's files fit --preset gpu-r50, its v1 weights with --norm frozen)")
    _load_matching(model, state, "--weights", path, "backbone.body.", hint)
    fpn_norm = "backbone.fpn.inner_blocks.0.1.weight"
    if (fpn_norm in state) != (fpn_norm in model.state_dict()):
        log.warning("--weights %s: the file's FPN and mask head %s normalization layers and this model's %s "
                    "(torchvision's v2 weights have them: --norm bn; its v1 weights have none: --norm frozen)",
                    path, "have" if fpn_norm in state else "have no", "do not" if fpn_norm in state else "do")


def load_backbone_weights(model: MaskRCNN, path: str) -> None:
    """`--weights-backbone`: an ImageNet ResNet state dict (torchvision's `resnet50().state_dict()`
    keys) for the backbone's body alone; its classifier (`fc`) is ignored, the FPN and heads stay random."""
    state = read_state_dict(path, "--weights-backbone")
    full_model = any(k.startswith("backbone.body.") for k in state)
    hint = ("it holds a whole detection model: give it as --weights" if full_model else
            "--weights-backbone takes a torchvision ResNet state dict matching --backbone")
    _load_matching(model.backbone.body, state, "--weights-backbone", path, "", hint)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
