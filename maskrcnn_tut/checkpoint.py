"""Checkpoints that survive crashes: atomic writes, auto-resume, weights-only loading.

A checkpoint is written to a temporary file, flushed and fsynced, then renamed over its final name
(a rename is atomic on POSIX), and the folder is fsynced so the rename itself is durable. A crash
mid-save therefore leaves the previous checkpoint intact (and a temporary file the next save
removes). `last.pt` is a hard link to the newest numbered checkpoint. Loading uses
`torch.load(weights_only=True)`: a checkpoint cannot run code. `newest_loadable` is what
`--resume auto` uses: the newest numbered checkpoint that loads and holds what a resume restores
(`check_resumable`), skipping broken ones with a warning; when there are checkpoints and none is
usable it stops saying why each one is not, instead of silently starting over.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from . import distributed as du
from .atomic import atomic_write, fsync_dir
from .config import Config, Run
from .engine import TrainState
from .errors import CheckpointError
from .model import build_model, torch_load, why_unloadable

log = logging.getLogger(__name__)


def _warn(message: str, *args) -> None:
    """A warning from rank 0 only: every rank restores the same checkpoint and meets the same news."""
    if du.info().is_main:
        log.warning(message, *args)


#: Settings that change the model's shapes or meaning: a checkpoint must agree on all of them.
MODEL_KEYS = ("backbone", "norm", "sync_bn", "fpn_channels", "mask_head_layers", "mask_head_channels",
              "box_head_dim", "anchor_sizes", "num_classes", "class_names")
_NUMBERED = re.compile(r"^step_(\d+)\.pt$")
_TEMPORARY = re.compile(r"^\..+\.tmp-(\d+)$")


def atomic_save(obj, path: Path) -> None:
    """`torch.save` to `path` by `atomic.atomic_write` (a temp file in the same folder, fsynced, renamed
    over `path`, the folder fsynced). A failed write (disk full, quota) raises `CheckpointError` and
    leaves `path` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0][:200]
        raise CheckpointError(f"{path}: cannot be written ({reason}); the previous checkpoint is untouched") from None


def remove_stale_temporaries(ckpt_dir: Path) -> list[Path]:
    """Delete temp files that processes killed mid-save left behind (any pid but this one's)."""
    removed = []
    for path in Path(ckpt_dir).iterdir() if Path(ckpt_dir).is_dir() else ():
        match = _TEMPORARY.match(path.name)
        if match and int(match.group(1)) != os.getpid():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def rng_state(device: torch.device) -> dict:
    """This process's random generators (Python, NumPy, torch CPU, and its own GPU's) as plain tensors.

    Only this process's GPU: a checkpoint then restores on any GPU count (rank r gets rank r's state).
    """
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
             "numpy_pos": int(np_state[2]), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if device.type == "cuda" and isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8:
        torch.cuda.set_rng_state(cuda, device)


def save(ckpt_dir: Path, payload: dict, step: int, keep: int) -> Path:
    """Write `step_<N>.pt`, point `last.pt` at it, and delete numbered ones beyond the newest `keep`."""
    ckpt_dir = Path(ckpt_dir)
    remove_stale_temporaries(ckpt_dir)
    path = ckpt_dir / f"step_{step:07d}.pt"
    atomic_save(payload, path)
    link = ckpt_dir / f".last.pt.tmp-{os.getpid()}"
    link.unlink(missing_ok=True)
    try:
        os.link(path, link)
        os.replace(link, ckpt_dir / "last.pt")
        fsync_dir(ckpt_dir)
    except OSError:  # filesystems without hard links get a copy
        link.unlink(missing_ok=True)
        atomic_save(payload, ckpt_dir / "last.pt")
    for old in numbered(ckpt_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def numbered(ckpt_dir: Path) -> list[Path]:
    """Numbered checkpoints, newest first."""
    if not Path(ckpt_dir).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).iterdir() if (m := _NUMBERED.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _first_line(err: Exception) -> str:
    """The error's first line that is not torch's advice to load with `weights_only=False`: that is
    the step that runs whatever code a file from elsewhere holds, so it is never repeated here."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and "weights_only" not in line]
    return f"{type(err).__name__}: {lines[0][:200] if lines else 'empty, cut short or not a torch checkpoint file'}"


def load(path: Path) -> dict:
    """Load a checkpoint safely; a truncated or foreign file raises `CheckpointError` naming it."""
    try:
        payload = torch_load(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except Exception as err:  # truncated zip, not a torch file, unsafe pickle...
        raise CheckpointError(f"{path}: cannot be loaded ({why_unloadable(err, path)})") from None
    if not isinstance(payload, dict) or "model" not in payload or "state" not in payload:
        raise CheckpointError(f"{path}: not a maskrcnn_tut checkpoint (no model/state entries)")
    return payload


#: Entries each element of a checkpoint's `rng` list has (`rng_state`).
_RNG_KEYS = {"python", "numpy", "numpy_pos", "torch"}


def check_resumable(payload: dict, path: Path) -> None:
    """One line for a checkpoint that lacks what a resume restores (position, RNG streams, optimizer,
    schedule and scaler state, model tensors that fit its config), before restoring starts."""
    state, rngs = payload["state"], payload.get("rng")
    fields = {f.name for f in dataclasses.fields(TrainState)}
    if not isinstance(state, dict) or not all(k in fields and type(v) is int for k, v in state.items()):
        raise CheckpointError(f"{path}: its training position ('state': {state!r}) "
                              f"has other entries than the integers {sorted(fields)}, so it cannot be resumed from")
    if not isinstance(rngs, list) or not rngs or not all(isinstance(r, dict) and _RNG_KEYS <= r.keys() for r in rngs):
        raise CheckpointError(f"{path}: has no random generator states ('rng'), so it cannot be resumed from")
    missing = [k for k in ("optimizer", "scheduler", "scaler") if not isinstance(payload.get(k), dict)]
    if missing:
        raise CheckpointError(f"{path}: has no {', '.join(missing)} state, so it cannot be resumed from")
    saved = payload.get("config")
    if isinstance(saved, dict) and "num_classes" in saved:  # without them `check_compatible` refuses it
        with torch.device("meta"):  # shapes only: no memory, no initialization
            model = _saved_model(saved, path)[0]
        load_model_state(model, payload, path, assign=True)


def newest_loadable(ckpt_dir: Path, resuming: bool = False) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads (and, `resuming`, passes `check_resumable`), warning about each
    newer one; None when there are none; when none is usable, one line saying why for each."""
    problems: list[CheckpointError] = []
    for path in numbered(ckpt_dir):
        try:
            payload = load(path)
            if resuming:
                check_resumable(payload, path)
        except CheckpointError as err:
            problems.append(err)
            continue
        for problem in problems:
            _warn("--resume auto: %s; using an earlier checkpoint", problem)
        return path, payload
    if problems:
        raise CheckpointError(f"--resume auto: none of the {len(problems)} checkpoints in {ckpt_dir} can be used ("
                              + "; ".join(str(p).replace(f"{ckpt_dir}/", "") for p in problems)
                              + "); move them away, or start over without --resume (the earlier run is then set "
                              "aside whole in an earlier-<date-time> folder)")
    return None


#: Settings that shape inference; `--test-only` takes them from the checkpoint unless typed.
INFERENCE_KEYS = MODEL_KEYS[:-2] + ("min_size", "max_size", "rpn_pre_nms_top_n", "rpn_post_nms_top_n", "channels_last")


def find_resume(resume: str | None, ckpt_dir: Path, test_only: bool = False) -> tuple[Path, dict] | None:
    """What `--resume` names: None (start fresh), 'auto' (the newest good checkpoint, if any) or a path."""
    if resume is None:
        return None
    if resume == "auto":
        found = newest_loadable(ckpt_dir, resuming=not test_only)
        if found is None and test_only:
            raise CheckpointError(f"--test-only --resume auto: no checkpoint in {ckpt_dir} to evaluate")
        if found is None:
            log.info("--resume auto: no checkpoint in %s, starting fresh", ckpt_dir)
        return found
    payload = load(Path(resume))
    if not test_only:
        check_resumable(payload, Path(resume))
    return Path(resume), payload


def inference_config(cfg: Config, payload: dict, path: Path) -> Config:
    """`cfg` with every setting that shapes inference taken from the checkpoint, unless the user
    typed it; logs what it used (a model trained at 288 px and scored at 192 px scores wrongly)."""
    saved = payload.get("config") or {}
    taken = {k: saved[k] for k in INFERENCE_KEYS if k in saved and k not in cfg.given}
    cfg = dataclasses.replace(cfg, **taken)
    log.info("--test-only: %s at step %s; inference settings %s", path, payload["state"].get("step"),
             ", ".join(f"{k}={getattr(cfg, k)}{'' if k in taken else ' (typed)'}" for k in INFERENCE_KEYS))
    return cfg


def check_compatible(payload: dict, cfg: dict, path: Path) -> None:
    """Refuse a checkpoint whose model, optimizer or training set (its count of usable images, which
    `--allow-data-change` lets differ with a warning) differs from this run's, saying what differs."""
    saved = payload.get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"--resume: {path} has no config, so nothing says which model it holds; "
                              "use a checkpoint written by train.py (or --weights for a bare state dict)")
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs run {cfg.get(k)!r}"
             for k in MODEL_KEYS if saved.get(k) != cfg.get(k)]
    if diffs:
        raise CheckpointError(f"--resume: {path} does not match this run's model ({'; '.join(diffs)}); "
                              "resume with the settings and data it was trained with, or start fresh "
                              "in another --output-dir")
    if cfg.get("test_only"):
        return
    before, now = saved.get("usable_train_images"), cfg.get("usable_train_images")
    if None not in (before, now) and before != now:
        if not cfg.get("allow_data_change"):
            raise CheckpointError(f"--resume: the training set changed since {path} was saved ({before} usable images "
                                  f"then, {now} now), so its place in the epoch points at other images; restore the "
                                  "data, or give --allow-data-change to go on with it")
        _warn("--resume --allow-data-change: %d usable training images, %d when the checkpoint was saved", now, before)
    if not isinstance(saved.get("derived"), dict):
        raise CheckpointError(f"--resume: {path} was saved by an earlier version of maskrcnn_tut (its config has no "
                              "derived run facts), so its place and lr cannot carry over; start fresh in another "
                              "--output-dir")
    if saved.get("optimizer") != cfg.get("optimizer"):
        raise CheckpointError(f"--resume: {path} was trained with --optimizer {saved.get('optimizer')}, this run "
                              f"asks for {cfg.get('optimizer')}; its optimizer state cannot carry over (resume "
                              f"with --optimizer {saved.get('optimizer')}, or start from it with --weights)")


def _resumed_position(state: TrainState, saved: dict, run: Run) -> TrainState:
    """The checkpoint's place in its epoch, in this run's batch units (images per micro-step over
    all ranks); refuses when no whole number of this run's batches lands on that place, when the
    images read so far in the epoch are not the first ones of this run's order (aspect-ratio
    groups are made per batch and per rank), and when an --epochs schedule (steps per epoch) would
    no longer count the checkpoint's steps."""
    before = saved["batch_size"] * saved["derived"]["world_size"]
    now = run.batch_size * run.world_size
    per_step = (before * saved.get("accum_steps", 1), now * run.accum_steps)
    if per_step[0] != per_step[1] and not run.max_steps:
        raise CheckpointError(f"--resume: the checkpoint's {state.step} steps were of {per_step[0]} images, this "
                              f"run's are of {per_step[1]} (--batch-size x processes x --accum-steps), so its --epochs "
                              f"{run.epochs} schedule would count other steps (its lr, and where it ends); resume with "
                              f"{per_step[0]} images per step, or give --max-steps")
    layout = (saved["batch_size"], saved["derived"]["world_size"], saved.get("aspect_ratio_group_factor", -1))
    if state.batch_in_epoch and layout != (run.batch_size, run.world_size, run.aspect_ratio_group_factor) and \
            max(layout[2], run.aspect_ratio_group_factor) >= 0:
        raise CheckpointError(f"--resume: the checkpoint stopped {state.batch_in_epoch * before} images into epoch "
                              f"{state.epoch} with --batch-size {layout[0]} on {layout[1]} processes and "
                              f"--aspect-ratio-group-factor {layout[2]}; this run's batches group other images, so the "
                              "rest of the epoch would repeat some and skip others: resume with the checkpoint's "
                              "batch, processes and grouping, or from a checkpoint at an epoch's end")
    if before == now or state.batch_in_epoch == 0:
        return state
    consumed = state.batch_in_epoch * before
    if consumed % now:
        raise CheckpointError(f"--resume: the checkpoint stopped {consumed} images into epoch {state.epoch} with "
                              f"{before} images per micro-step; this run's {now} (--batch-size {run.batch_size} x "
                              f"{run.world_size} processes) cannot continue at that place without repeating or "
                              "skipping images: resume with a batch that divides it, or after the epoch ends")
    _warn("--resume: %d images per micro-step instead of %d: continuing %d images into epoch %d",
          now, before, consumed, state.epoch)
    return dataclasses.replace(state, batch_in_epoch=consumed // now)


def _apply_lr(optimizer, scheduler, saved_lr: float, lr: float) -> None:
    """Put this run's scaled lr into a resumed schedule (a checkpoint restores its own)."""
    if abs(saved_lr - lr) <= 1e-12 * max(abs(lr), 1.0):
        return
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    factors = [fn(scheduler.last_epoch) for fn in scheduler.lr_lambdas]
    for group, factor in zip(optimizer.param_groups, factors):
        group["lr"] = lr * factor
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    _warn("--resume: lr %.4g (this run) instead of the checkpoint's %.4g, from step %d on",
          lr, saved_lr, scheduler.last_epoch)


def restore_training(payload: dict, optimizer, scheduler, scaler, info, run: Run) -> TrainState:
    """Optimizer, schedule (at this run's scaled lr), GradScaler, position (in this run's batch
    units) and this rank's RNG streams from a checkpoint that `check_compatible` accepted; state
    that does not fit this run's optimizer is one `CheckpointError` line."""
    saved = payload["config"]
    try:
        optimizer.load_state_dict(payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
        if scaler.is_enabled() and not payload["scaler"]:
            _warn("resuming a run without fp16 GradScaler state with fp16 autocast: the scaler starts afresh")
        else:
            scaler.load_state_dict(payload["scaler"])
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"--resume: the checkpoint's optimizer, schedule or scaler state does not fit this "
                              f"run ({_first_line(err)})") from None
    _apply_lr(optimizer, scheduler, saved["derived"]["scaled_lr"], run.scaled_lr)
    rngs = payload["rng"]
    if len(rngs) == info.world_size:
        set_rng_state(rngs[info.rank], info.device)
    else:
        _warn("resuming on %d processes from a %d-process checkpoint: RNG streams reseeded", info.world_size, len(rngs))
    return _resumed_position(TrainState(**payload["state"]), saved, run)


def _settings(saved: dict) -> Config:
    """The settings a checkpoint's model was built with, for rebuilding it here: no weights files,
    no SyncBatchNorm (one process), no compilation."""
    fields = {f.name for f in dataclasses.fields(Config)} - {"given"}
    cfg = Config(**{k: saved[k] for k in fields if k in saved})
    return dataclasses.replace(cfg, weights=None, weights_backbone=None, sync_bn=False, compile_backbone=False)


def _saved_model(saved: dict, path: Path) -> tuple[torch.nn.Module, Config]:
    """(the model a checkpoint's config describes, its settings), built here; one `CheckpointError`
    line when this version cannot build it (a config from another version or program)."""
    cfg = _settings(saved)
    try:
        return build_model(cfg, saved["num_classes"]), cfg
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: its config describes no model this version builds "
                              f"({_first_line(err)})") from None


def load_model_state(model: torch.nn.Module, payload: dict, path: Path, assign: bool = False) -> None:
    """The checkpoint's model tensors into `model` (strict), or one `CheckpointError` line saying
    what does not fit. Keys a run with --compile-backbone once saved under `_orig_mod.` are accepted."""
    try:
        model.load_state_dict({k.replace("._orig_mod", ""): v for k, v in payload["model"].items()}, assign=assign)
    except (RuntimeError, TypeError, AttributeError) as err:
        problems = [line.strip() for line in str(err).splitlines() if line.strip()][-3:]  # the first is a header
        raise CheckpointError(f"{path}: its model tensors do not fit the model its config describes "
                              f"({' '.join(problems)[:300]})") from None


def model_from_checkpoint(path: Path | str) -> tuple[torch.nn.Module, Config, dict, int | None]:
    """(model in eval mode, its settings, the saved config, the step it was saved at) of a train.py
    checkpoint: the model rebuilt at the settings it was trained with (no weights files, no
    compilation), its tensors loaded; one `CheckpointError` line when the file holds something else."""
    path = Path(path)
    payload = load(path)
    saved = payload.get("config")
    if not isinstance(saved, dict) or "num_classes" not in saved or "class_names" not in saved:
        raise CheckpointError(f"{path}: has no training config, so nothing says which model it holds; "
                              "use a checkpoint written by train.py")
    model, cfg = _saved_model(saved, path)
    load_model_state(model, payload, path)
    return model.eval(), cfg, saved, payload["state"].get("step")


def model_from_run(output_dir: Path | str) -> torch.nn.Module:
    """The model a `train.py` run saved last, in eval mode."""
    return model_from_checkpoint(Path(output_dir) / "checkpoints" / "last.pt")[0]
