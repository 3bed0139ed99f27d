"""Every knob of a training run in one dataclass, the hardware presets, CLI parsing and validation.

A run's settings are resolved in three layers: dataclass defaults, then the preset (picked from the
hardware when `--preset` is not given), then the flags the user typed. `validate` rejects bad
settings before any heavy work with a `ConfigError` whose message names the flag.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError

#: The global batch the presets' learning rates are tuned for; `--lr` is scaled by
#: global_batch / REFERENCE_BATCH (the linear scaling rule of Goyal et al., 2017).
REFERENCE_BATCH = 8


@dataclass
class Config:
    # data
    data_path: str | None = None
    train_json: str | None = None
    train_images: str | None = None
    val_json: str | None = None
    val_images: str | None = None
    shapes_train: int = 2000
    shapes_val: int = 200
    shapes_seed: int = 0
    # model
    preset: str | None = None
    backbone: str = "resnet18"
    norm: str = "bn"
    sync_bn: bool = False
    min_size: int = 128
    max_size: int = 192
    fpn_channels: int = 64
    mask_head_layers: int = 2
    mask_head_channels: int = 64
    box_head_dim: int = 256
    anchor_sizes: str = "16,32,64,128,256"
    rpn_pre_nms_top_n: int = 200
    rpn_post_nms_top_n: int = 100
    rpn_batch_size_per_image: int = 64
    box_batch_size_per_image: int = 64
    weights: str | None = None
    # optimisation
    batch_size: int = 4
    epochs: int = 1
    max_steps: int | None = 450
    optimizer: str = "adamw"
    lr: float = 2e-3
    momentum: float = 0.9
    weight_decay: float = 1e-4
    warmup_steps: int = 50
    lr_decay: str = "cosine"
    accum_steps: int = 1
    clip_grad_norm: float | None = None
    amp: bool = False
    amp_dtype: str | None = None
    # data loading
    workers: int = 1
    persistent_workers: bool = True
    prefetch_factor: int = 2
    pin_memory: bool | None = None
    aspect_ratio_group_factor: int = -1
    # distributed
    dist_backend: str | None = None
    dist_timeout: float = 600.0
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    grad_compression: str = "none"
    # speed flags and reproducibility
    cudnn_benchmark: bool = False
    deterministic: bool = False
    channels_last: bool = False
    fixed_shapes: bool = False
    compile_backbone: bool = False
    decode_on_device: bool = False
    seed: int = 0
    # evaluation, logging, checkpoints
    eval_every: int | None = None
    print_freq: int = 10
    output_dir: str | None = None
    resume: str | None = None
    test_only: bool = False
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    skip_nonfinite: int = 0
    progress: bool = True
    overfit: int | None = None
    # resolved by `derive` for the processes of a run (not flags)
    world_size: int = 1
    global_batch_size: int = 0
    base_lr: float = 0.0
    device: str = "cpu"
    precision: str = ""
    given: tuple[str, ...] = ()  # the settings the user typed (they win over a checkpoint's)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Learns from scratch on the shapes dataset on 2 CPU cores in about 12 minutes: ResNet-18 with
#: trainable BatchNorm, a 64-channel normalized FPN with thin heads and 16-256 px anchors at
#: 128 px, light RPN/RoI sampling, AdamW 2e-3 for a global batch of 8 (2 processes x 4).
#: 100 MB buckets (all of cpu-tiny's 47 MiB of gradients in one): with one core per process, gloo's
#: all-reduce thread competes with backward for that core, so one all-reduce after backward was
#: faster than several during it (measured 6.0 against 5.6 img/s with 25 MB, 2 processes).
CPU_TINY = dict(
    backbone="resnet18", norm="bn", min_size=128, max_size=192,
    fpn_channels=64, mask_head_layers=2, mask_head_channels=64, box_head_dim=256,
    anchor_sizes="16,32,64,128,256",
    rpn_pre_nms_top_n=200, rpn_post_nms_top_n=100,
    rpn_batch_size_per_image=64, box_batch_size_per_image=64,
    batch_size=4, max_steps=450, optimizer="adamw", lr=2e-3, weight_decay=1e-4,
    warmup_steps=50, workers=1, bucket_cap_mb=100.0,
)

PRESETS: dict[str, dict[str, Any]] = {
    "cpu-tiny": CPU_TINY,
    # Real photos on a CPU: cpu-tiny at 192/288 px instead of 128/192 (at 128 px a 640x480 COCO
    # photo becomes 170x128 and half its instances end under 9 px). Meant first for the overfit
    # check (`--overfit 8 --max-steps 200`), which proves data, labels and pipeline in minutes.
    "cpu-real": CPU_TINY | dict(min_size=192, max_size=288),
    # Mask R-CNN R50-FPN as torchvision's detection reference trains it, where it can be:
    # its sizes and sampling, SGD momentum 0.9 with lr 0.02 per 16 images (its "0.02/8*$NGPU" at
    # 2 images per GPU, i.e. 0.01 for REFERENCE_BATCH = 8), weight decay 1e-4, 1000 warm-up steps,
    # x0.1 at 16/26 and 22/26 of training. Where it differs, and why:
    # - no pretrained backbone is downloaded, so it trains from scratch: GroupNorm instead of
    #   BatchNorm (2 images per GPU are too few for batch statistics; He et al., "Rethinking
    #   ImageNet Pre-training", 2019), and 72 epochs (6x torchvision's 26 for an ImageNet backbone,
    #   the schedule He et al. needed from scratch). With --weights the preset freezes BatchNorm
    #   (norm frozen) and torchvision's 26 epochs are the right length.
    # - AMP on (torchvision's --amp is off by default): fp16 autocast with GradScaler.
    # - cudnn.benchmark off (as Detectron2): the mask head sees a different number of RoIs every
    #   step, so autotuning never settles even with fixed image sizes; the bench measures it.
    "gpu-r50": dict(
        backbone="resnet50", norm="gn", min_size=800, max_size=1333,
        fpn_channels=256, mask_head_layers=4, mask_head_channels=256, box_head_dim=1024,
        anchor_sizes="32,64,128,256,512",
        rpn_pre_nms_top_n=2000, rpn_post_nms_top_n=2000,
        rpn_batch_size_per_image=256, box_batch_size_per_image=512,
        batch_size=2, max_steps=None, epochs=72, optimizer="sgd", lr=0.01, momentum=0.9, weight_decay=1e-4,
        warmup_steps=1000, lr_decay="steps", workers=8, amp=True, cudnn_benchmark=False,
    ),
}

BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101")
NORMS = ("bn", "frozen", "gn")
OPTIMIZERS = ("adamw", "sgd")
LR_DECAYS = ("cosine", "steps")
AMP_DTYPES = ("float16", "bfloat16")
COMPRESSIONS = ("none", "fp16", "bf16")


def default_preset() -> str:
    """The preset the hardware calls for: `gpu-r50` when CUDA is visible, else `cpu-tiny`."""
    return "gpu-r50" if torch.cuda.is_available() else "cpu-tiny"


def resolve(cfg: Config, explicit: set[str] | None = None) -> Config:
    """Fill `cfg` from its preset, keeping every field named in `explicit` (set by the user)."""
    explicit = explicit or set()
    preset = cfg.preset or default_preset()
    if preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg.preset = preset
    cfg.given = tuple(sorted(set(cfg.given) | explicit))
    for key, value in PRESETS[preset].items():
        if key not in explicit:
            setattr(cfg, key, value)
    if "epochs" in explicit and "max_steps" not in explicit:
        cfg.max_steps = None  # the user asked for epochs, not the preset's step budget
    if preset == "gpu-r50" and cfg.weights and "norm" not in explicit:
        cfg.norm = "frozen"  # pretrained BatchNorm statistics stay as they are (torchvision's recipe)
        if "epochs" not in explicit:
            cfg.epochs = 26
    return cfg


def make_config(preset: str | None = None, **overrides: Any) -> Config:
    """A resolved config for code and notebooks: `make_config("cpu-tiny", batch_size=2)`."""
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    cfg = Config(preset=preset, **overrides)
    return resolve(cfg, explicit=set(overrides))


def precision(cfg: Config, device_type: str) -> str:
    """The one precision decision: "float32" unless `--amp`; then `--amp-dtype`, else float16 on
    CUDA (with GradScaler) and bfloat16 on CPU."""
    if not cfg.amp:
        return "float32"
    return cfg.amp_dtype or ("float16" if device_type == "cuda" else "bfloat16")


def derive(cfg: Config, world_size: int, device: torch.device | str) -> Config:
    """The settings that depend on the run's processes, resolved once (pure: a new Config).

    Global batch = batch_size x accum_steps x world_size; lr = the flag's lr (tuned for a global
    batch of REFERENCE_BATCH) scaled linearly to it; pin_memory on with CUDA unless set; the
    autocast precision. `train.py` and the benchmark harness both call this.
    """
    device = torch.device(device)
    base_lr = cfg.base_lr or cfg.lr
    global_batch = cfg.batch_size * cfg.accum_steps * world_size
    return dataclasses.replace(
        cfg, world_size=world_size, device=str(device), global_batch_size=global_batch, base_lr=base_lr,
        lr=base_lr * global_batch / REFERENCE_BATCH,
        pin_memory=device.type == "cuda" if cfg.pin_memory is None else cfg.pin_memory,
        precision=precision(cfg, device.type))


def flag_name(name: str) -> str:
    """The command-line flag of a Config field: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def validate(cfg: Config, *, cuda_available: bool | None = None, local_world_size: int = 1) -> None:
    """Raise `ConfigError` for the first setting that cannot work, before any heavy work."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    positive = ["batch_size", "epochs", "accum_steps", "min_size", "max_size", "print_freq",
                "checkpoint_every", "keep_checkpoints", "shapes_train", "shapes_val",
                "rpn_pre_nms_top_n", "rpn_post_nms_top_n", "rpn_batch_size_per_image",
                "box_batch_size_per_image", "prefetch_factor", "fpn_channels", "mask_head_layers",
                "mask_head_channels", "box_head_dim"]
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{flag_name(name)} must be a positive integer, got {getattr(cfg, name)}")
    for name in ("max_steps", "eval_every", "overfit"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{flag_name(name)} must be a positive integer, got {value}")
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag_name(f.name)} must be a finite number, got {value}")
    for name in ("lr", "bucket_cap_mb"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{flag_name(name)} must be positive, got {getattr(cfg, name)}")
    if not 0 <= cfg.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1), got {cfg.momentum}")
    if cfg.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be 0 or more, got {cfg.weight_decay}")
    sizes = cfg.anchor_sizes.split(",")
    if len(sizes) != 5 or not all(s.strip().isdigit() and int(s) > 0 for s in sizes):
        raise ConfigError(f"--anchor-sizes {cfg.anchor_sizes!r}: give 5 positive integers, one per FPN "
                          "level (e.g. 32,64,128,256,512)")
    if cfg.workers < 0:
        raise ConfigError(f"--workers must be 0 or more, got {cfg.workers}")
    if cfg.warmup_steps < 0 or cfg.skip_nonfinite < 0:
        raise ConfigError("--warmup-steps and --skip-nonfinite must be 0 or more")
    if cfg.clip_grad_norm is not None and cfg.clip_grad_norm <= 0:
        raise ConfigError(f"--clip-grad-norm must be positive, got {cfg.clip_grad_norm}")
    if cfg.dist_timeout <= 0:
        raise ConfigError(f"--dist-timeout must be positive seconds, got {cfg.dist_timeout}")
    for name, allowed in (("backbone", BACKBONES), ("norm", NORMS), ("optimizer", OPTIMIZERS), ("lr_decay", LR_DECAYS),
                          ("grad_compression", COMPRESSIONS)):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{flag_name(name)}: {getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    if cfg.amp_dtype is not None and cfg.amp_dtype not in AMP_DTYPES:
        raise ConfigError(f"--amp-dtype: {cfg.amp_dtype!r} is not one of {', '.join(AMP_DTYPES)}")
    if not cuda and cfg.amp_dtype == "float16":
        raise ConfigError("--amp-dtype float16 needs a CUDA GPU; on CPU use --amp-dtype bfloat16 "
                          "(the default for --amp on CPU)")
    if cfg.amp_dtype is not None and not cfg.amp:
        raise ConfigError(f"--amp-dtype {cfg.amp_dtype} picks the dtype of --amp, which is off; add --amp "
                          "(or drop --amp-dtype for full fp32)")
    if cfg.dist_backend not in (None, "gloo", "nccl"):
        raise ConfigError(f"--dist-backend: {cfg.dist_backend!r} is not one of gloo, nccl")
    if cfg.dist_backend == "nccl" and not cuda:
        raise ConfigError("--dist-backend nccl needs CUDA GPUs; none are visible (use gloo)")
    if cuda and cfg.dist_backend != "gloo" and local_world_size > torch.cuda.device_count():
        raise ConfigError(f"--nproc-per-node {local_world_size} is more than the "
                          f"{torch.cuda.device_count()} visible GPU(s): nccl needs one GPU per process")
    if cfg.grad_compression != "none" and not cuda:
        raise ConfigError("--grad-compression needs CUDA GPUs (its DDP hooks are for nccl); use none on CPU")
    if cfg.sync_bn and cfg.norm != "bn":
        raise ConfigError(f"--sync-bn converts BatchNorm layers; it does not apply to --norm {cfg.norm}")
    if cfg.test_only and not (cfg.resume or cfg.weights):
        raise ConfigError("--test-only needs a model to evaluate: give --resume PATH or --weights PATH")
    if cfg.data_path is not None:
        root = Path(cfg.data_path)
        if not root.is_dir():
            raise ConfigError(f"--data-path {cfg.data_path}: no such directory")
        for split in ("val",) if cfg.test_only else ("train", "val"):
            ann = root / "annotations" / f"instances_{split}2017.json"
            if getattr(cfg, f"{split}_json") is None and not ann.is_file():
                raise ConfigError(f"--data-path {cfg.data_path}: no annotations/instances_{split}2017.json "
                                  f"(expected COCO layout: annotations/instances_{{train,val}}2017.json "
                                  f"and {{train,val}}2017/; or give --{split}-json)")
    elif (cfg.train_json is None) != (cfg.val_json is None):
        raise ConfigError("--train-json and --val-json go together (or use --data-path)")
    for name in ("train_json", "val_json", "train_images", "val_images", "weights"):
        value = getattr(cfg, name)
        if value is not None and not Path(value).exists():
            raise ConfigError(f"{flag_name(name)} {value}: no such file or directory")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_file():
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint file (use --resume auto to "
                          "resume from the newest checkpoint in --output-dir)")
    if cfg.output_dir is not None:
        out = Path(cfg.output_dir)
        probe = out
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if probe.exists() and (not probe.is_dir() or not os.access(probe, os.W_OK)):
            raise ConfigError(f"--output-dir {cfg.output_dir}: cannot write there ({probe} is not a writable directory)")
