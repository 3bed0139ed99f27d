"""The hardware presets: each as its differences from `config.Config`'s defaults (cpu-tiny's), with
why beside every value, and what gpu-r50 picks for the CUDA card it runs on (`cuda_choices`).

`config.resolve` applies a preset's differences, then the card's choices, then what the user typed.
"""
from __future__ import annotations

from typing import Any

#: Each preset as its differences from the dataclass defaults, which are cpu-tiny's.
PRESETS: dict[str, dict[str, Any]] = {
    # Learns from scratch on the shapes dataset on 2 CPU cores in minutes: ResNet-18 with trainable
    # BatchNorm, a 64-channel normalized FPN with thin heads and 16-256 px anchors at 128 px, light
    # RPN/RoI sampling, AdamW 2e-3 for a global batch of 8 (2 processes x 4).
    "cpu-tiny": {},
    # Real photos on a CPU: cpu-tiny at 192/288 px instead of 128/192 (at 128 px a 640x480 COCO
    # photo becomes 170x128, where its small instances shrink to a few pixels). Meant first for the overfit
    # check (`--overfit 8 --max-steps 200`), which proves data, labels and pipeline in minutes.
    "cpu-real": dict(min_size=192, max_size=288),
    # Mask R-CNN R50-FPN as torchvision's detection reference trains it, where it can be:
    # its sizes and sampling, SGD momentum 0.9 with lr 0.02 per 16 images (its "0.02/8*$NGPU" at
    # 2 images per GPU, i.e. 0.01 for REFERENCE_BATCH = 8, scaled linearly to the global batch),
    # weight decay 1e-4, 1000 warm-up steps, x0.1 at 16/26 and 22/26 of training, DDP's own 25 MB
    # buckets. Where it differs, and why:
    # - no pretrained backbone is downloaded, so it trains from scratch: GroupNorm instead of
    #   BatchNorm (a few images per GPU are too few for batch statistics; He et al., "Rethinking
    #   ImageNet Pre-training", 2019), and 72 epochs (He et al.'s 6x schedule, 6 x 12 epochs, which
    #   they needed from scratch; torchvision's 26 epochs assume an ImageNet backbone). GroupNorm
    #   costs speed: Detectron2's model zoo measured a GN step 36 % slower than FrozenBN's. With
    #   --weights the preset freezes BatchNorm (norm frozen, torchvision's recipe) and torchvision's
    #   26 epochs are the right length.
    # - AMP on (torchvision's --amp is off by default), in bf16 without a GradScaler on GPUs that have
    #   bf16 units (compute capability 8.0 and later: `hardware.default_amp_dtype`), else fp16 with
    #   one. A GradScaler reads its scale and overflow flag on the host: syncs a bf16 step does not
    #   need. NVIDIA's own Mask R-CNN measured AMP at 1.04-1.08x TF32 on an A100, so the gain is
    #   small either way; chapter 5 measures it here.
    # - images grouped by aspect ratio (torchvision's --aspect-ratio-group-factor 3, which its
    #   reference turns on by default) and each batch side padded up to one of 4 sizes: a run meets
    #   a handful of input shapes, and each new shape costs a step of cuDNN plan building (0.2 s in
    #   TF32, 0.65-0.83 s in half precision on an H200, 2026-12-04); the bucket costs at most ~19 %
    #   more pixels than padding to the batch's largest image.
    # - images per GPU from the card's memory (`cuda_choices`), not torchvision's 2: at 2 images an
    #   H200 step took 55-70 ms, most of it the host dispatching ~2,000 kernels, while the GPU idled.
    # - cudnn.benchmark off (Detectron2's default too): the mask head's RoI count changes every
    #   step, so every step would autotune again; chapter 6 measures what it costs and gains.
    "gpu-r50": dict(
        backbone="resnet50", norm="gn", min_size=800, max_size=1333,
        fpn_channels=256, mask_head_layers=4, mask_head_channels=256, box_head_dim=1024,
        anchor_sizes="32,64,128,256,512",
        rpn_pre_nms_top_n=2000, rpn_post_nms_top_n=2000,
        rpn_batch_size_per_image=256, box_batch_size_per_image=512,
        batch_size=2, max_steps=None, epochs=72, optimizer="sgd", lr=0.01,
        warmup_steps=1000, lr_decay="steps", amp=True, bucket_cap_mb=25.0,
        aspect_ratio_group_factor=3, pad_buckets=4,
    ),
}

#: gpu-r50's images per GPU by the card's memory (GiB, at least): R50-FPN-GN at 800 px peaked at
#: 6.5 GB with 2 images (H200, 2026-12-04), about 3 GB an image, so 8 images fit a 40 GB card with
#: room for the largest batches; published single-GPU figures near 24 img/s (A100) use 12-16.
IMAGES_PER_GPU = ((40, 8), (20, 4), (0, 2))


def images_per_gpu(memory_gib: float) -> int:
    """gpu-r50's batch size for a card of `memory_gib` (`IMAGES_PER_GPU`)."""
    return next(images for least, images in IMAGES_PER_GPU if memory_gib >= least)


def cuda_choices(preset: str, card: tuple[float, tuple[int, int]] | None) -> dict[str, Any]:
    """What `preset` picks for the CUDA card `card` = (memory GiB, compute capability) it will train on
    (`hardware.cuda_card`; None without CUDA): gpu-r50's images per GPU."""
    if preset != "gpu-r50" or card is None:
        return {}
    return {"batch_size": images_per_gpu(card[0])}
