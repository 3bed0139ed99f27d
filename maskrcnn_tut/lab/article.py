"""The article's code, run as written, to show what it really does (chapters 4 and 5).

- `launchers()`: the article's `python -m torch.distributed.launch` against `torchrun`, each starting
  a probe script whose first attempt fails: what each hands the script (the injected `--local-rank`
  argument, LOCAL_RANK), whether `--max-restarts` restarts it, and the deprecation warning.
- `amp_branch(model, ...)`: the article's AMP branch line for line (its `torch.cuda.amp` names
  replaced by `torch.autocast` / `torch.amp.GradScaler(device)`, so it runs on a CPU too).
- `article_errors()`: that branch on torchvision's Mask R-CNN and on the toy detector, each error
  it raises, as one line.
- `reference_recipe()`: the `gpu-r50` preset beside torchvision's reference recipe, setting by setting.
- `missing_zero_grad()`: the branch with the loss summed (so it runs) but still without
  `zero_grad`, over steps on one batch at lr 0, against `engine.train_step`; with GradScaler off
  (bf16, fp32) gradients pile up; with it on, its in-place unscale hides that, until one
  non-finite gradient stays in `.grad` for good and every later step is skipped.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .. import distributed as du
from ..config import lr_scale, make_config
from . import wording
from .proofs import TinyDetector, toy_batches
from .provenance import environment_report
from .rig import build_rig, synthetic_batches
from .wording import say

_PROBE = """import json, os, sys
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
print("PROBE " + json.dumps({"argv": sys.argv[1:], "LOCAL_RANK": os.environ.get("LOCAL_RANK"), "attempt": attempt}),
      flush=True)
sys.exit(1 if attempt == 0 else 0)  # the first attempt fails: does the launcher start it again?
"""


def launchers(timeout_s: float = 120.0) -> list[dict]:
    """Start the probe with each launcher (1 process, `--max-restarts=1`); one row per launcher."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "train_script.py"
        probe.write_text(_PROBE)
        flags = ["--standalone", "--nproc_per_node=1", "--max-restarts=1", "--monitor-interval=0.1", str(probe)]
        torchrun = Path(sys.executable).with_name("torchrun")
        commands = {"python -m torch.distributed.launch": [sys.executable, "-m", "torch.distributed.launch", *flags],
                    "torchrun": [str(torchrun) if torchrun.exists() else "torchrun", *flags]}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "default"}
        for name, command in commands.items():
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=folder)
            seen = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("PROBE ")]
            rows.append({"launcher": name, "arguments the script got": " ".join(seen[0]["argv"]) or wording.term("(none)"),
                         "LOCAL_RANK": seen[0]["LOCAL_RANK"], "attempts": len(seen),
                         "restarted after the failure": len(seen) > 1 and done.returncode == 0,
                         "deprecation warning": "is deprecated" in done.stderr})
    return rows


def amp_branch(model, optimizer, scaler, images, targets, device_type: str = "cpu",
               dtype: torch.dtype = torch.bfloat16) -> None:
    """The article's `if USE_AMP:` branch, line for line (device-generic names for its torch.cuda.amp)."""
    with torch.autocast(device_type, dtype=dtype):
        preds, losses = model(images, targets)
    scaler.scale(losses).backward()
    scaler.step(optimizer)
    scaler.update()


def _error(call) -> str:
    try:
        call()
    except Exception as err:  # the point: which error the article's code raises
        return f"{type(err).__name__}: {err}"
    return wording.term("no error")


def _toy(seed: int = 0):
    """The toy detector, one batch of its uint8 images as float in [0, 1], its targets, the uint8 images."""
    du.seed_everything(seed)
    model = TinyDetector()
    raw, targets = toy_batches(1, 4, seed)[0]
    return model, [image.float() / 255 for image in raw], targets, raw


def article_errors() -> dict[str, str]:
    """The article's AMP branch on Mask R-CNN (cpu-tiny, 2 images) and on the toy detector: the error
    each raises; then the toy with the tuple unpacking dropped (`losses = model(...)`, the loss dict)."""
    settings = make_config("cpu-tiny", batch_size=2)
    rig = build_rig(settings, device="cpu", batches=synthetic_batches(settings))
    maskrcnn = rig.module
    images, targets = next(rig.batches)
    images = [image.float() / 255 for image in images]
    rows = {}
    scaler = torch.amp.GradScaler("cpu")
    sgd = torch.optim.SGD(maskrcnn.parameters(), lr=0.0)
    rows["Mask R-CNN (5 losses)"] = _error(lambda: amp_branch(maskrcnn, sgd, scaler, images, targets))
    toy, toy_images, toy_targets, _ = _toy()
    sgd = torch.optim.SGD(toy.parameters(), lr=0.0)
    rows["toy detector (2 losses)"] = _error(lambda: amp_branch(toy, sgd, scaler, toy_images, toy_targets))

    def dict_loss() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = toy(toy_images, toy_targets)
        scaler.scale(losses).backward()
    rows["toy, losses = model(...) (the loss dict)"] = _error(dict_loss)
    return rows


def _article_steps(model, batches, scaler, zero_grad: bool) -> tuple[list[torch.Tensor], list[bool]]:
    """The article's AMP branch with the loss dict summed, optionally with zero_grad: per step, the
    gradient the optimizer saw (after unscaling) and whether the scaler skipped the step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen, skipped = [], []
    for images, targets in batches:
        if zero_grad:
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = sum(model(images, targets).values())
        scaler.scale(losses).backward()
        scale = scaler.get_scale() if scaler.is_enabled() else None
        if scaler.is_enabled():
            scaler.unscale_(optimizer)  # what scaler.step does first; done here to read the gradient
        seen.append(model.conv.weight.grad.detach().clone())
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scale is not None and scaler.get_scale() < scale)
    return seen, skipped


def missing_zero_grad(steps: int = 4) -> dict:
    """The article's AMP loop without `zero_grad` on the toy detector, same batch every step, lr 0 (so
    each step's own gradient is the same), against `engine.train_step`. Returns the gradient norm of
    the last step over the first's: with the scaler off, with it on; and, with it on and one batch
    whose loss is infinite first, how many of the `steps` later steps were skipped, without and with
    zero_grad."""
    model, images, targets, raw = _toy()
    same = [(images, targets)] * steps
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ratio = lambda grads: float(grads[-1].norm() / grads[0].norm())  # noqa: E731
    out = {"steps": steps}
    out["scaler off"] = ratio(_article_steps(model, same, torch.amp.GradScaler("cpu", enabled=False), False)[0])
    model.zero_grad(set_to_none=True)
    model.load_state_dict(start)
    out["scaler on"] = ratio(_article_steps(model, same, torch.amp.GradScaler("cpu"), False)[0])
    bad = [(images, [{"value": torch.full((2,), float("inf"))} for _ in targets])]
    for zero_grad in (False, True):
        model.zero_grad(set_to_none=True)
        model.load_state_dict(start)
        skipped = _article_steps(model, bad + same, torch.amp.GradScaler("cpu"), zero_grad)[1]
        out[f"skipped after one inf loss, zero_grad={zero_grad}"] = sum(skipped[1:])
    # the package's step on the same batches: it zeroes the gradients itself
    model.zero_grad(set_to_none=True)
    model.load_state_dict(start)
    settings = make_config("cpu-tiny", optimizer="sgd", lr=1e-12, weight_decay=0.0)
    batches = iter([(raw, targets)] * steps)  # uint8, as a loader gives them: to_device scales them
    rig = build_rig(settings, device="cpu", batches=batches, model=model, wrap=None)
    grads = []
    for _ in range(steps):
        rig.step()
        grads.append(model.conv.weight.grad.detach().clone())
    out["engine.train_step"] = ratio(grads)
    return out


def ddp_before_to_device() -> str:
    """The article's `DDP(net, device_ids=[local_rank], output_device=local_rank)` with `net` never moved
    to its GPU: the error DDP raises, in a one-process gloo group of this process (made and removed
    here when there is none)."""
    import torch.distributed as dist
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Linear(2, 2)  # built on the CPU, as every module is; the article never calls .to(...)
        return _error(lambda: torch.nn.parallel.DistributedDataParallel(net, device_ids=[0], output_device=0))
    finally:
        if made:
            dist.destroy_process_group()


#: The environment report's row naming the CUDA runtime the wheel bundles.
CUDA_ROW = "CUDA (the wheel's runtime)"


def stack_today(report: list[dict] | None = None) -> list[dict]:
    """The article's software stack (「必要なソフトウェア Stack」 and its launch command), what this
    book uses instead, and what this machine has (`provenance.environment_report()`)."""
    have = {row[""]: row["this machine"] for row in (report or environment_report())}
    torchrun = shutil.which("torchrun") or (str(Path(sys.executable).with_name("torchrun"))
                                            if Path(sys.executable).with_name("torchrun").exists() else None)
    try:
        import cv2  # noqa: F401  (only to say whether it is there)
        opencv = say("article.installed_unused")
    except ImportError:
        opencv = say("article.not_installed")
    rows = [("article.pytorch_article", "article.pytorch_today", have.get("PyTorch / torchvision", "")),
            ("article.cuda_article", "article.cuda_today",
             say("article.cuda_here", cuda=have.get(CUDA_ROW, ""), gpus=have.get("GPUs", ""))),
            ("article.nccl_article", "article.nccl_today",
             say("article.nccl_here", nccl=have.get("NCCL", ""), backends=have.get("distributed backends", ""))),
            ("article.launch_article", "article.launch_today",
             f"torchrun: `{torchrun}`" if torchrun else say("article.no_torchrun")),
            ("article.opencv_article", "article.opencv_today", f"OpenCV {opencv}"),
            ("article.numpy_article", "article.numpy_today",
             say("article.numpy_here", numpy=_version("numpy"), pillow=_version("pillow"),
                         python=have.get("Python", "")))]
    return [{"the article": say(then), "today": say(now), "this machine": here}
            for then, now, here in rows]


#: torchvision's detection reference for Mask R-CNN R50-FPN (references/detection), quoted: its README's
#: command (`--epochs 26 --lr-steps 16 22 --aspect-ratio-group-factor 3 --weights-backbone
#: ResNet50_Weights.IMAGENET1K_V1`) and train.py's defaults (`-b 2` images and `-j 4` workers per GPU, `--lr
#: 0.02` for 8 GPUs x 2 images, momentum 0.9, `--wd 1e-4` with `--norm-weight-decay` unset, so on every
#: parameter, a linear warm-up over the first 1000 iterations, `--amp` off).
TORCHVISION_REFERENCE = {
    "backbone at the start": "ImageNet weights", "backbone layers trained": "layer2 to layer4 (stem and layer1 frozen)",
    "normalization": "frozen BatchNorm", "epochs": 26,
    "images per GPU": 2, "lr for 16 images": 0.02, "momentum": 0.9, "weight decay": "0.0001 on every parameter",
    "warm-up": "1000 steps", "lr decay": "x0.1 at 16/26 and 22/26", "aspect-ratio grouping": "factor 3",
    "AMP": "off", "DataLoader workers per process": 4,
}


def reference_recipe() -> list[dict]:
    """`gpu-r50` beside torchvision's reference recipe (`TORCHVISION_REFERENCE`), setting by setting,
    from the preset itself: what it shares and where it differs (chapters 0 and 2; config.py's
    comments on the preset say why)."""
    cfg = make_config("gpu-r50")
    term = wording.term
    mine = {
        "backbone at the start": say("article.local_file", path=cfg.weights_backbone) if cfg.weights_backbone else
        say("article.from_scratch"),
        "backbone layers trained": term("all layers"),  # model.build_model freezes none
        "normalization": term({"gn": "GroupNorm", "frozen": "frozen BatchNorm", "bn": "BatchNorm"}[cfg.norm]),
        "epochs": cfg.epochs, "images per GPU": cfg.batch_size,
        "lr for 16 images": round(cfg.lr * lr_scale(cfg, 16), 6), "momentum": cfg.momentum,
        "weight decay": say("article.decay_on_weights", decay=cfg.weight_decay),
        "warm-up": say("article.steps", steps=cfg.warmup_steps),
        "lr decay": term("x0.1 at 16/26 and 22/26" if cfg.lr_decay == "steps" else cfg.lr_decay),
        "aspect-ratio grouping": say("article.factor", factor=cfg.aspect_ratio_group_factor)
        if cfg.aspect_ratio_group_factor > 0 else term("off"), "AMP": term("on" if cfg.amp else "off"),
        "DataLoader workers per process": say("article.workers_rule") if cfg.workers is None else cfg.workers,
    }
    quote = {name: term(value) if isinstance(value, str) else value for name, value in TORCHVISION_REFERENCE.items()}
    return [{"setting": term(name), "torchvision's reference (quoted)": quoted, "gpu-r50": mine[name],
             "same": quoted == mine[name]} for name, quoted in quote.items()]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return say("article.not_installed")
