"""The settings of a training run: one dataclass with each setting's help and rules beside it, the
hardware presets as differences from its defaults, validation, and the facts a run derives.

Settings resolve in three layers: the dataclass defaults (the `cpu-tiny` preset), then the preset's
differences (the preset is picked from the hardware when `--preset` is not given), then what the
user typed (`flags.py` makes one flag per field). `validate` rejects bad settings before any heavy
work with a `ConfigError` whose message names the flag. `derive` adds what the run's processes
decide (world size, global batch, scaled lr, precision, pin_memory, device) as a `Run`, apart from
the settings, so nothing that needs those facts can be handed settings that lack them.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError
from .hardware import cpu_has_bf16, cuda_card, default_amp_dtype
from .presets import PRESETS, cuda_choices

#: The global batch the presets' learning rates are tuned for; `--lr` is scaled from it to the run's
#: global batch by the rule `--lr-scaling` names (`lr_scale`).
REFERENCE_BATCH = 8

#: `--lr-scaling auto`'s rule for each optimizer: linear for SGD (Goyal et al., 2017), the square root
#: for AdamW, whose update size does not grow with the gradient's (Malladi et al., "On the SDEs and
#: Scaling Rules for Adaptive Gradient Algorithms", 2022).
AUTO_LR_SCALING = {"sgd": "linear", "adamw": "sqrt"}

def setting(default: Any, help: str, *, choices: tuple | None = None, bound: str | None = None) -> Any:
    """A `Config` field with its help (for `--help`) and its rules (for `validate`) beside it:
    `choices`, the values allowed; `bound`, ">0" (positive) or ">=0" (0 or more)."""
    return field(default=default, metadata={"help": help, "choices": choices, "bound": bound})


@dataclass
class Config:
    """Every setting a user can give, one flag each (`flags.py`); defaults are the cpu-tiny preset."""

    # data
    data_path: str | None = setting(
        None, "COCO root with annotations/instances_{train,val}2017.json and {train,val}2017/; training "
              "without it (or --train-json) uses the embedded shapes dataset, generated on first use into the cache")
    train_json: str | None = setting(None, "train annotation json (overrides the --data-path layout)")
    train_images: str | None = setting(None, "train image folder (with --train-json)")
    val_json: str | None = setting(None, "validation annotation json")
    val_images: str | None = setting(None, "validation image folder (with --val-json)")
    shapes_train: int = setting(2000, "images in the generated shapes train split", bound=">0")
    shapes_val: int = setting(200, "images in the generated shapes validation split", bound=">0")
    shapes_seed: int = setting(0, "seed of the generated shapes dataset")
    # model
    preset: str | None = setting(
        None, f"hardware preset ({', '.join(PRESETS)}); default: gpu-r50 with CUDA, else cpu-tiny")
    backbone: str = setting("resnet18", "FPN backbone", choices=("resnet18", "resnet34", "resnet50", "resnet101"))
    norm: str = setting("bn", "normalization: bn (trainable, from scratch), frozen (only with pretrained "
                              "--weights), gn", choices=("bn", "frozen", "gn"))
    sync_bn: bool = setting(False, "convert BatchNorm to SyncBatchNorm across processes")
    min_size: int = setting(128, "shorter image side after resizing (pixels)", bound=">0")
    max_size: int = setting(192, "longer image side cap after resizing (pixels)", bound=">0")
    fpn_channels: int = setting(64, "FPN output channels (torchvision: 256)", bound=">0")
    mask_head_layers: int = setting(2, "3x3 convs in the mask head (torchvision: 4)", bound=">0")
    mask_head_channels: int = setting(64, "width of the mask head convs (torchvision: 256)", bound=">0")
    box_head_dim: int = setting(256, "width of the box head's two FC layers (torchvision: 1024)", bound=">0")
    anchor_sizes: str = setting("16,32,64,128,256", "anchor size (pixels) per FPN level, comma-separated "
                                                    "(torchvision: 32,64,128,256,512)")
    rpn_pre_nms_top_n: int = setting(200, "RPN proposals kept before NMS per image (training)", bound=">0")
    rpn_post_nms_top_n: int = setting(100, "RPN proposals kept after NMS per image (training)", bound=">0")
    rpn_batch_size_per_image: int = setting(64, "anchors sampled per image for the RPN loss", bound=">0")
    box_batch_size_per_image: int = setting(64, "RoIs sampled per image for the box and mask heads", bound=">0")
    weights: str | None = setting(None, "local state dict (.pt) to start from; nothing is ever downloaded")
    weights_backbone: str | None = setting(
        None, "local ImageNet ResNet state dict (.pt, torchvision's resnet keys) for the backbone alone; the "
              "FPN and heads start random; nothing is ever downloaded")
    # optimisation
    batch_size: int = setting(4, "images per process per micro-step", bound=">0")
    epochs: int = setting(1, "passes over the training set (ignored when --max-steps is set)", bound=">0")
    max_steps: int | None = setting(450, "stop after this many optimizer steps (overrides --epochs)", bound=">0")
    optimizer: str = setting("adamw", "optimizer", choices=("adamw", "sgd"))
    lr: float = setting(
        2e-3, f"learning rate for a global batch of {REFERENCE_BATCH} images, scaled to the actual global batch "
              "(batch-size x accum-steps x processes) by --lr-scaling", bound=">0")
    lr_scaling: str = setting(
        "auto", "how --lr follows the global batch: linear (Goyal et al.'s rule for SGD), sqrt (the square "
                "root, the usual rule for AdamW), none; auto: linear for sgd, sqrt for adamw. Rules of thumb "
                "both: retune --lr when the global batch changes much", choices=("auto", "linear", "sqrt", "none"))
    momentum: float = setting(0.9, "SGD momentum")
    weight_decay: float = setting(1e-4, "weight decay", bound=">=0")
    warmup_steps: int = setting(50, "linear warm-up length in optimizer steps", bound=">=0")
    lr_decay: str = setting("cosine", "after warm-up: cosine (to 0 at the end) or steps (x0.1 at 16/26 and "
                                      "22/26 of training, torchvision's 26-epoch schedule)",
                            choices=("cosine", "steps"))
    accum_steps: int = setting(1, "micro-steps accumulated per optimizer step (DDP syncs only on the last)",
                               bound=">0")
    clip_grad_norm: float | None = setting(None, "clip the global gradient norm to this value", bound=">0")
    amp: bool = setting(False, "mixed precision: bf16 autocast, or fp16 + GradScaler on GPUs without bf16 units")
    amp_dtype: str | None = setting(None, "autocast dtype of --amp: float16 (CUDA only, with a GradScaler) or "
                                          "bfloat16 (default: bfloat16, but float16 on GPUs before compute "
                                          "capability 8.0)", choices=("float16", "bfloat16"))
    allow_emulated_bf16: bool = setting(False, "let --amp run bf16 on a CPU without bf16 instructions (AVX-512 BF16 "
                                               "or AMX), where torch emulates it, over 10 times slower than fp32")
    # data loading
    workers: int | None = setting(None, "DataLoader worker processes per training process (default: 1 on CPUs, whose "
                                        "cores the training threads use; on GPUs its cores less one, <= 4)", bound=">=0")
    persistent_workers: bool = setting(True, "keep DataLoader workers alive between epochs")
    prefetch_factor: int = setting(2, "batches each worker loads ahead", bound=">0")
    pin_memory: bool | None = setting(None, "page-locked host memory for faster copies (default: on with CUDA, "
                                            "off on CPU)")
    aspect_ratio_group_factor: int = setting(-1, "group images of similar aspect ratio into batches (-1: off)")
    # distributed
    accelerator: str = setting("auto", "what to train on: auto (the GPUs torch can use, else the CPU; stops when "
                                       "the machine has NVIDIA GPUs this torch cannot use), cpu (on purpose) or cuda",
                               choices=("auto", "cpu", "cuda"))
    dist_backend: str | None = setting(None, "process-group backend (default: nccl with CUDA, else gloo)",
                                       choices=("gloo", "nccl"))
    dist_timeout: float = setting(600.0, "seconds a collective may wait before the run fails instead of hanging",
                                  bound=">0")
    # With one core per process, gloo's all-reduce thread competes with backward for that core, so
    # one bucket holding all of cpu-tiny's gradients (one all-reduce after backward) beats several
    # overlapping it; on GPUs the preset keeps DDP's 25 MB.
    bucket_cap_mb: float = setting(100.0, "DDP gradient bucket size (MB)", bound=">0")
    gradient_as_bucket_view: bool = setting(True, "let gradients alias DDP's buckets (saves a copy and memory)")
    static_graph: bool = setting(False, "tell DDP the graph is the same every step")
    broadcast_buffers: bool = setting(True, "sync BatchNorm buffers from rank 0 before each forward (DDP's "
                                            "forward_sync_buffers)")
    find_unused_parameters: bool = setting(False, "let DDP handle parameters without gradients (slower)")
    grad_compression: str = setting("none", "compress gradients to fp16/bf16 before all-reduce (CUDA only)",
                                    choices=("none", "fp16", "bf16"))
    # speed flags and reproducibility
    cudnn_benchmark: bool = setting(False, "let cuDNN time convolution algorithms (good for fixed sizes)")
    deterministic: bool = setting(False, "deterministic algorithms and cuDNN (slower; exact on CPUs, best effort on GPUs)")
    channels_last: bool = setting(False, "NHWC memory format for the backbone and its input batch (faster "
                                         "tensor cores on GPUs)")
    pad_buckets: int = setting(0, "pad each side of a batch up to one of N sizes spread from --min-size to "
                                  "--max-size, not to the batch's largest image (0: torchvision's way), so a run "
                                  "meets a few input shapes, each paying cuDNN's first-shape cost once", bound=">=0")
    fixed_shapes: bool = setting(False, "pad every batch to one of three shapes (landscape, portrait, mixed), i.e. "
                                        "--pad-buckets 2, so shapes repeat for --compile-backbone, CUDA graphs and "
                                        "cudnn.benchmark")
    compile_backbone: bool = setting(False, "torch.compile the backbone, FPN and RPN head (CUDA graphs on GPUs); "
                                            "use with --fixed-shapes, or every new image shape compiles again")
    decode_on_device: bool = setting(False, "decode training JPEGs on the device (nvJPEG on GPUs) in the main "
                                            "process; the workers only read the files")
    seed: int = setting(0, "seed of model init (same on every rank) and data order")
    # evaluation, logging, checkpoints
    eval_every: int | None = setting(None, "evaluate every N optimizer steps (always at the end)", bound=">0")
    print_freq: int = setting(10, "log metrics every N optimizer steps", bound=">0")
    output_dir: str | None = setting(None, "where config.json, metrics.jsonl, eval.jsonl, checkpoints/ and "
                                           "TensorBoard go (default: runs/train)")
    resume: str | None = setting(None, "checkpoint to resume from, or 'auto' for the newest good one in --output-dir")
    allow_data_change: bool = setting(False, "with --resume: go on although the training set's count of usable "
                                             "images changed since the checkpoint (else such a resume stops)")
    test_only: bool = setting(False, "only evaluate the --resume/--weights model")
    checkpoint_every: int = setting(100, "save a checkpoint every N optimizer steps (and at the end)", bound=">0")
    keep_checkpoints: int = setting(2, "numbered checkpoints to keep besides last.pt", bound=">0")
    skip_nonfinite: int = setting(0, "skip up to N optimizer steps with a non-finite loss instead of stopping",
                                  bound=">=0")
    progress: bool = setting(True, "show a progress bar on rank 0")
    overfit: int | None = setting(None, "the overfit check: train on the first N training images and evaluate "
                                        "on the same N (proves data, labels and pipeline before a long run)",
                                  bound=">0")
    #: The settings the user typed (they win over a checkpoint's); a record, not a flag.
    given: tuple[str, ...] = field(default=(), metadata={"flag": False})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flag_fields() -> list[dataclasses.Field]:
    """The `Config` fields a flag sets: all but the record of which ones were typed."""
    return [f for f in dataclasses.fields(Config) if f.metadata.get("flag", True)]


def value_type(f: dataclasses.Field) -> type:
    """The type of a field's value when it has one: `int | None` -> int."""
    return {"int": int, "float": float, "bool": bool}.get(str(f.type).split(" | ")[0], str)


def default_preset(accelerator: str = "auto") -> str:
    """The preset the hardware calls for: `gpu-r50` when CUDA is visible and not declined with
    `--accelerator cpu`, else `cpu-tiny`."""
    return "gpu-r50" if accelerator != "cpu" and torch.cuda.is_available() else "cpu-tiny"


def resolve(cfg: Config, explicit: set[str] | None = None) -> Config:
    """Fill `cfg` from its preset, keeping every field named in `explicit` (set by the user)."""
    explicit = explicit or set()
    preset = cfg.preset or default_preset(cfg.accelerator)
    if preset not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg.preset = preset
    cfg.given = tuple(sorted(set(cfg.given) | explicit))
    card = cuda_card() if cfg.accelerator != "cpu" else None
    for key, value in (PRESETS[preset] | cuda_choices(preset, card)).items():
        if key not in explicit:
            setattr(cfg, key, value)
    if "epochs" in explicit and "max_steps" not in explicit:
        cfg.max_steps = None  # the user asked for epochs, not the preset's step budget
    if preset == "gpu-r50" and (cfg.weights or cfg.weights_backbone) and "norm" not in explicit:
        cfg.norm = "frozen"  # pretrained BatchNorm statistics stay as they are (torchvision's recipe)
        if "epochs" not in explicit:
            cfg.epochs = 26
    return cfg


def make_config(preset: str | None = None, **overrides: Any) -> Config:
    """A resolved config for code and notebooks: `make_config("cpu-tiny", batch_size=2)`."""
    unknown = set(overrides) - {f.name for f in flag_fields()}
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    cfg = Config(preset=preset, **overrides)
    return resolve(cfg, explicit=set(overrides))


@dataclass(frozen=True)
class Run:
    """One run's settings and the facts its processes decide, computed from them on construction.

    Settings read through it (`run.batch_size`); the derived facts are its own fields. It cannot be
    changed in place, and `dataclasses.replace` accepts only `settings`, `world_size` and `device`
    and derives every fact again, so no fact outlives the settings it came from.
    """

    settings: Config
    world_size: int
    device: torch.device
    #: images per optimizer step over all processes: batch_size x accum_steps x world_size
    global_batch: int = field(init=False)
    #: the user's lr (for REFERENCE_BATCH images) scaled to the global batch (`lr_scale`)
    scaled_lr: float = field(init=False)
    #: the autocast dtype: "float32" unless --amp; then --amp-dtype, else `hardware.default_amp_dtype`
    precision: str = field(init=False)
    #: --pin-memory when typed, else on with CUDA
    pin_memory: bool = field(init=False)
    #: the optimizer's fused implementation, on CUDA: one kernel per step for all parameters where the
    #: per-parameter loop launches hundreds (the host is what an H200 waits on at a few images per GPU)
    fused_optimizer: bool = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.settings, Config):
            raise TypeError(f"a Run derives from settings (a Config), not from a {type(self.settings).__name__}")
        cfg = dataclasses.replace(self.settings)  # its own copy: editing the caller's cannot stale the facts
        device = torch.device(self.device)
        global_batch = cfg.batch_size * cfg.accum_steps * self.world_size
        precision = "float32"
        if cfg.amp:
            precision = cfg.amp_dtype or default_amp_dtype(device)
        facts = dict(settings=cfg, device=device, global_batch=global_batch, precision=precision,
                     scaled_lr=cfg.lr * lr_scale(cfg, global_batch),
                     pin_memory=device.type == "cuda" if cfg.pin_memory is None else cfg.pin_memory,
                     fused_optimizer=device.type == "cuda")
        for name, value in facts.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """A setting, for a name that is not one of the run's own fields."""
        if name.startswith("__") or name == "settings":  # copy and pickle probe these before settings exist
            raise AttributeError(name)
        return getattr(self.settings, name)

    def facts(self) -> dict[str, Any]:
        """What `derive` decided, as JSON values."""
        return dict(world_size=self.world_size, device=str(self.device), global_batch=self.global_batch,
                    scaled_lr=self.scaled_lr, precision=self.precision, pin_memory=self.pin_memory,
                    fused_optimizer=self.fused_optimizer)

    def to_dict(self) -> dict[str, Any]:
        """The settings, and the derived facts under "derived" (config.json, checkpoints, --print-config)."""
        return self.settings.to_dict() | {"derived": self.facts()}


def lr_scale(cfg: Config, global_batch: int) -> float:
    """The factor `--lr` is multiplied by for `global_batch` images per step under `--lr-scaling`."""
    rule = AUTO_LR_SCALING[cfg.optimizer] if cfg.lr_scaling == "auto" else cfg.lr_scaling
    ratio = global_batch / REFERENCE_BATCH
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def derive(cfg: Config, world_size: int, device: torch.device | str) -> Run:
    """The run `cfg` makes on `world_size` processes on `device`: `train.py` and the lab call this once
    per run, and the optimizer, autocast, GradScaler, loaders and metrics take what it returns."""
    return Run(cfg, world_size, device)


def flag_name(name: str) -> str:
    """The command-line flag of a Config field: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def _check_field(f: dataclasses.Field, value: Any) -> None:
    """The rules beside the field (`setting`'s choices and bound), and finiteness for every float."""
    flag, choices, bound = flag_name(f.name), f.metadata.get("choices"), f.metadata.get("bound")
    if value is None and str(f.type).endswith("| None"):
        return  # unset: the run decides (or does without)
    if choices and value not in choices:
        raise ConfigError(f"{flag}: {value!r} is not one of {', '.join(choices)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{flag} must be a finite number, got {value}")
    if bound == ">0" and value <= 0:
        what = "a positive integer" if value_type(f) is int else "positive"
        raise ConfigError(f"{flag} must be {what}, got {value}")
    if bound == ">=0" and value < 0:
        raise ConfigError(f"{flag} must be 0 or more, got {value}")


def validate(cfg: Config, *, cuda_available: bool | None = None, local_world_size: int = 1) -> None:
    """Raise `ConfigError` for the first setting that cannot work, before any heavy work."""
    cuda = (torch.cuda.is_available() if cuda_available is None else cuda_available) and cfg.accelerator != "cpu"
    for f in flag_fields():
        _check_field(f, getattr(cfg, f.name))
    if not 0 <= cfg.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1), got {cfg.momentum}")
    sizes = cfg.anchor_sizes.split(",")
    if len(sizes) != 5 or not all(s.strip().isdigit() and int(s) > 0 for s in sizes):
        raise ConfigError(f"--anchor-sizes {cfg.anchor_sizes!r}: give 5 positive integers, one per FPN "
                          "level (e.g. 32,64,128,256,512)")
    if not cuda and cfg.amp_dtype == "float16":
        raise ConfigError("--amp-dtype float16 needs a CUDA GPU; on CPU use --amp-dtype bfloat16 "
                          "(the default for --amp on CPU)")
    if cfg.amp and not cuda and cpu_has_bf16() is False and not cfg.allow_emulated_bf16:
        raise ConfigError(f"--amp: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no bf16 instructions (AVX-512 "
                          "BF16 or AMX), so bf16 autocast would be emulated, over 10 times slower than fp32 here; "
                          "train without it (--no-amp), or pass --allow-emulated-bf16 to run it anyway")
    if cfg.amp_dtype is not None and not cfg.amp:
        raise ConfigError(f"--amp-dtype {cfg.amp_dtype} picks the dtype of --amp, which is off; add --amp "
                          "(or drop --amp-dtype for full fp32)")
    if cfg.dist_backend == "nccl" and not cuda:
        raise ConfigError("--dist-backend nccl needs CUDA GPUs; none are visible (use gloo)")
    if cuda and cfg.dist_backend != "gloo" and local_world_size > torch.cuda.device_count():
        raise ConfigError(f"--nproc-per-node {local_world_size} is more than the "
                          f"{torch.cuda.device_count()} visible GPU(s): nccl needs one GPU per process")
    if cfg.grad_compression != "none" and not cuda:
        raise ConfigError("--grad-compression needs CUDA GPUs (its DDP hooks are for nccl); use none on CPU")
    if cfg.static_graph and cfg.accum_steps > 1:
        raise ConfigError(f"--static-graph does not work with --accum-steps {cfg.accum_steps}: DDP's static graph "
                          "breaks on no_sync() accumulation (pytorch#143580); drop one of the two")
    if cfg.pad_buckets == 1:
        raise ConfigError("--pad-buckets 1 would pad every batch to --max-size on both sides; give 0 (off) or 2 or more")
    if cfg.sync_bn and cfg.norm != "bn":
        raise ConfigError(f"--sync-bn converts BatchNorm layers; it does not apply to --norm {cfg.norm}")
    if cfg.test_only and not (cfg.resume or cfg.weights):
        raise ConfigError("--test-only needs a model to evaluate: give --resume PATH or --weights PATH")
    _check_paths(cfg)


def _check_paths(cfg: Config) -> None:
    """The data, weights, checkpoint and output paths exist (or can be written)."""
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
    for name in ("train_json", "val_json", "train_images", "val_images", "weights", "weights_backbone"):
        value = getattr(cfg, name)
        if value is not None and not Path(value).exists():
            raise ConfigError(f"{flag_name(name)} {value}: no such file or directory")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_file():
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint file (use --resume auto to "
                          "resume from the newest checkpoint in --output-dir)")
    if cfg.output_dir is not None:
        probe = Path(cfg.output_dir)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if probe.exists() and (not probe.is_dir() or not os.access(probe, os.W_OK)):
            raise ConfigError(f"--output-dir {cfg.output_dir}: cannot write there ({probe} is not a writable directory)")
