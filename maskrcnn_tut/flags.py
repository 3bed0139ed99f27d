"""The command line of train.py: one flag per `Config` field, with help that shows the real default.

Each flag's default is what the run resolves on this machine: the preset the hardware picks
(`config.default_preset`) when the preset sets the field, else the dataclass default; only the
flags the user typed override the preset (`config.resolve`).
"""
from __future__ import annotations

import argparse
import dataclasses

from .config import PRESETS, REFERENCE_BATCH, Config, default_preset, flag_name, resolve

HELP = {
    "data_path": "COCO root with annotations/instances_{train,val}2017.json and {train,val}2017/; "
                 "default: the embedded shapes dataset, generated on first use into the cache",
    "train_json": "train annotation json (overrides the --data-path layout)",
    "train_images": "train image folder (with --train-json)",
    "val_json": "validation annotation json",
    "val_images": "validation image folder (with --val-json)",
    "shapes_train": "images in the generated shapes train split",
    "shapes_val": "images in the generated shapes validation split",
    "shapes_seed": "seed of the generated shapes dataset",
    "preset": f"hardware preset ({', '.join(PRESETS)}); default: gpu-r50 with CUDA, else cpu-tiny",
    "backbone": "ResNet FPN backbone",
    "norm": "normalization: bn (trainable, from scratch), frozen (only with pretrained --weights), gn",
    "sync_bn": "convert BatchNorm to SyncBatchNorm across processes",
    "min_size": "shorter image side after resizing (pixels)",
    "max_size": "longer image side cap after resizing (pixels)",
    "fpn_channels": "FPN output channels (torchvision: 256)",
    "mask_head_layers": "3x3 convs in the mask head (torchvision: 4)",
    "mask_head_channels": "width of the mask head convs (torchvision: 256)",
    "box_head_dim": "width of the box head's two FC layers (torchvision: 1024)",
    "anchor_sizes": "anchor size (pixels) per FPN level, comma-separated (torchvision: 32,64,128,256,512)",
    "rpn_pre_nms_top_n": "RPN proposals kept before NMS per image (training)",
    "rpn_post_nms_top_n": "RPN proposals kept after NMS per image (training)",
    "rpn_batch_size_per_image": "anchors sampled per image for the RPN loss",
    "box_batch_size_per_image": "RoIs sampled per image for the box and mask heads",
    "weights": "local state dict (.pt) to start from; nothing is ever downloaded",
    "batch_size": "images per process per micro-step",
    "epochs": "passes over the training set (ignored when --max-steps is set)",
    "max_steps": "stop after this many optimizer steps (overrides --epochs)",
    "optimizer": "optimizer",
    "lr": f"learning rate for a global batch of {REFERENCE_BATCH} images; scaled linearly to the "
          "actual global batch (batch-size x accum-steps x processes): Goyal et al.'s rule for SGD; for "
          "AdamW only a heuristic (square-root scaling is the common alternative), so retune --lr when the "
          "global batch changes much",
    "momentum": "SGD momentum",
    "weight_decay": "weight decay",
    "warmup_steps": "linear warm-up length in optimizer steps",
    "lr_decay": "after warm-up: cosine (to 0 at the end) or steps (x0.1 at 16/26 and 22/26 of training, "
                "torchvision's 26-epoch schedule)",
    "accum_steps": "micro-steps accumulated per optimizer step (DDP syncs only on the last)",
    "clip_grad_norm": "clip the global gradient norm to this value",
    "amp": "mixed precision: fp16 + GradScaler on CUDA, bf16 on CPU",
    "amp_dtype": "autocast dtype of --amp: float16 (CUDA only) or bfloat16 (default: float16 on CUDA, "
                 "bfloat16 on CPU)",
    "workers": "DataLoader worker processes per training process",
    "persistent_workers": "keep DataLoader workers alive between epochs",
    "prefetch_factor": "batches each worker loads ahead",
    "pin_memory": "page-locked host memory for faster copies (default: on with CUDA, off on CPU)",
    "aspect_ratio_group_factor": "group images of similar aspect ratio into batches (-1: off)",
    "dist_backend": "process-group backend (default: nccl with CUDA, else gloo)",
    "dist_timeout": "seconds a collective may wait before the run fails instead of hanging",
    "bucket_cap_mb": "DDP gradient bucket size (MB)",
    "gradient_as_bucket_view": "let gradients alias DDP's buckets (saves a copy and memory)",
    "static_graph": "tell DDP the graph is the same every step",
    "broadcast_buffers": "sync BatchNorm buffers from rank 0 before each forward (DDP's forward_sync_buffers)",
    "find_unused_parameters": "let DDP handle parameters without gradients (slower)",
    "grad_compression": "compress gradients to fp16/bf16 before all-reduce (CUDA only)",
    "cudnn_benchmark": "let cuDNN time convolution algorithms (good for fixed sizes)",
    "deterministic": "deterministic algorithms and cuDNN (slower; for exact reproducibility)",
    "channels_last": "NHWC memory format for the backbone and its input batch (faster tensor cores on GPUs)",
    "fixed_shapes": "pad every batch to one of three shapes (landscape, portrait, mixed) instead of its largest "
                    "image, so shapes repeat for --compile-backbone, CUDA graphs and cudnn.benchmark",
    "compile_backbone": "torch.compile the backbone, FPN and RPN head (CUDA graphs on GPUs); use with "
                        "--fixed-shapes, or every new image shape compiles again",
    "decode_on_device": "decode training JPEGs on the device (nvJPEG on GPUs) in the main process; the workers "
                        "only read the files",
    "seed": "seed of model init (same on every rank) and data order",
    "eval_every": "evaluate every N optimizer steps (always at the end)",
    "print_freq": "log metrics every N optimizer steps",
    "output_dir": "where config.json, metrics.jsonl, eval.jsonl, checkpoints/ and TensorBoard go "
                  "(default: runs/train)",
    "resume": "checkpoint to resume from, or 'auto' for the newest good one in --output-dir",
    "test_only": "only evaluate the --resume/--weights model",
    "checkpoint_every": "save a checkpoint every N optimizer steps (and at the end)",
    "keep_checkpoints": "numbered checkpoints to keep besides last.pt",
    "skip_nonfinite": "skip up to N optimizer steps with a non-finite loss instead of stopping",
    "progress": "show a progress bar on rank 0",
    "overfit": "the overfit check: train on the first N training images and evaluate on the same N "
               "(proves data, labels and pipeline before a long run)",
}

_RESOLVED = {"world_size", "global_batch_size", "base_lr", "device", "precision", "given"}


def _default_text(name: str, preset: str) -> str:
    """' (default: X)' as the run would resolve it on this machine, naming the preset when it decides."""
    if "default:" in HELP[name]:
        return ""  # the help text says what the default depends on
    value = PRESETS[preset].get(name, getattr(Config, name, None))
    if value is None:
        return ""
    if isinstance(value, bool):
        value = f"--{'' if value else 'no-'}{name.replace('_', '-')}"
    return f" (default: {value}{f', from preset {preset}' if name in PRESETS[preset] else ''})"


def build_parser() -> argparse.ArgumentParser:
    preset = default_preset()
    parser = argparse.ArgumentParser(
        prog="torchrun [--nproc_per_node=N] maskrcnn_tut/train.py",
        description="Train Mask R-CNN on COCO-format data, on CPUs (gloo) or GPUs (nccl). "
                    "With no flags it trains on the embedded shapes dataset with the preset the "
                    f"hardware calls for (on this machine: {preset}; the defaults below are its).",
    )
    for f in dataclasses.fields(Config):
        if f.name in _RESOLVED:
            continue
        flag = flag_name(f.name)
        text = HELP[f.name] + _default_text(f.name, preset)
        if str(f.type).startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        parser.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=text)
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[Config, bool]:
    """Parse flags into a resolved `Config`; returns (config, print_config_only)."""
    args = vars(build_parser().parse_args(argv))
    print_only = args.pop("print_config")
    given = {k: v for k, v in args.items() if v is not None}
    cfg = Config(**given)
    return resolve(cfg, explicit=set(given)), print_only
