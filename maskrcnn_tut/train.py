"""Train Mask R-CNN: `torchrun --nproc_per_node=N maskrcnn_tut/train.py [flags]` or `python maskrcnn_tut/train.py`.

Reads top to bottom: settings -> processes -> data -> model -> optimizer -> resume -> loop ->
evaluation -> summary. Every piece is a module of the package the book's chapters exercise.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut import distributed as du
from maskrcnn_tut.config import REFERENCE_BATCH, Config, ConfigError, parse_args, validate
from maskrcnn_tut.data.coco import DataError
from maskrcnn_tut.data.loader import build_datasets, build_eval_loader, build_train_loader, steps_per_epoch
from maskrcnn_tut.data.shapes import ensure_shapes_dataset
from maskrcnn_tut.engine import (NonFiniteLossError, TrainState, autocast, build_optimizer, lr_schedule,
                                 make_scaler, train)
from maskrcnn_tut.evaluate import coco_from_dict, evaluate
from maskrcnn_tut.model import build_model
from maskrcnn_tut.monitor import MetricsLogger, StragglerCheck

log = logging.getLogger("maskrcnn_tut")


def configure_runtime(cfg: Config, device: torch.device) -> None:
    """cuDNN and determinism flags (chapter 6), and fast matmuls where they exist."""
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not cfg.deterministic
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def resolve_run(cfg: Config, info: du.DistInfo) -> None:
    """Settings that depend on the processes: device, batch, scaled lr, data and output paths."""
    cfg.world_size = info.world_size
    cfg.device = str(info.device)
    cfg.dist_backend = info.backend
    cfg.global_batch_size = cfg.batch_size * cfg.accum_steps * info.world_size
    cfg.base_lr = cfg.lr
    cfg.lr = cfg.base_lr * cfg.global_batch_size / REFERENCE_BATCH
    if cfg.pin_memory is None:
        cfg.pin_memory = info.device.type == "cuda"
    if cfg.data_path is None and cfg.train_json is None:
        if info.local_rank == 0:  # one writer per machine; the others wait at the barrier
            cfg.data_path = str(ensure_shapes_dataset(cfg.shapes_train, cfg.shapes_val, cfg.shapes_seed,
                                                      progress=info.is_main and cfg.progress))
        du.barrier()
        cfg.data_path = str(ensure_shapes_dataset(cfg.shapes_train, cfg.shapes_val, cfg.shapes_seed, progress=False))
    cfg.output_dir = du.broadcast_object(cfg.output_dir or str(Path("runs") / "train"))


def run(cfg: Config) -> dict:
    """The whole job in this process; returns the final metrics (on rank 0)."""
    info = du.init_distributed(cfg.dist_backend, cfg.dist_timeout)
    resolve_run(cfg, info)
    device = info.device
    configure_runtime(cfg, device)
    out = Path(cfg.output_dir)
    ckpt_dir = out / "checkpoints"

    # data: every rank cleans the same json the same way; rank 0 reports what it found
    train_set, val_set = build_datasets(cfg)
    cfg_dict = cfg.to_dict() | {"num_classes": train_set.num_classes, "class_names": train_set.class_names}
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        for name, ds in (("train", train_set), ("val", val_set)):
            log.info("%s data %s: %d images; %s", name, ds.ann_file, len(ds), ds.report.summary())
    train_loader = build_train_loader(train_set, cfg, info.rank, info.world_size)
    val_loader = build_eval_loader(val_set, cfg, info.rank, info.world_size)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch(train_loader, cfg.accum_steps)

    # model: the same init on every rank, then per-rank randomness (RPN/RoI sampling)
    du.seed_everything(cfg.seed)
    model = build_model(cfg, train_set.num_classes).to(device)
    du.seed_everything(cfg.seed + info.rank)
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.warmup_steps, total_steps))
    scaler = make_scaler(cfg, device)
    state = TrainState()

    # resume: an explicit checkpoint, or the newest good one in --output-dir
    resume_from = None
    if cfg.resume == "auto":
        found = ckpt.newest_loadable(ckpt_dir)
        if found is None:
            log.info("--resume auto: no checkpoint in %s, starting fresh", ckpt_dir)
        resume_from = found
    elif cfg.resume:
        resume_from = (Path(cfg.resume), ckpt.load(Path(cfg.resume)))
    if resume_from is not None:
        path, payload = resume_from
        ckpt.check_compatible(payload["config"], cfg_dict, path)
        model.load_state_dict(payload["model"])
        if not cfg.test_only:
            optimizer.load_state_dict(payload["optimizer"])
            scheduler.load_state_dict(payload["scheduler"])
            scaler.load_state_dict(payload["scaler"])
            state = TrainState(**payload["state"])
            rngs = payload["rng"]
            if len(rngs) == info.world_size:
                ckpt.set_rng_state(rngs[info.rank])
            elif info.is_main:
                log.warning("resuming on %d processes from a %d-process checkpoint: RNG streams reseeded",
                            info.world_size, len(rngs))
        if info.is_main:
            log.info("resumed from %s at step %d (epoch %d)", path, state.step, state.epoch)
    elif info.is_main and not cfg.test_only:
        aside = ckpt.set_aside_old_run(ckpt_dir)
        if aside:
            log.warning("%s held an earlier run's checkpoints: moved to %s", ckpt_dir, aside)
        for name in ("metrics.jsonl", "eval.jsonl"):
            (out / name).unlink(missing_ok=True)
    du.barrier()

    model = du.wrap_ddp(model, cfg, info)
    coco_gt = coco_from_dict(val_set.ground_truth()) if info.is_main else None

    def run_eval() -> dict | None:
        return evaluate(model, val_loader, coco_gt, device, val_set.label_to_cat,
                        amp_context=lambda: autocast(cfg, device), progress=info.is_main and cfg.progress)

    if cfg.test_only:
        metrics = run_eval()
        if info.is_main:
            print(json.dumps(metrics))
        return metrics or {}

    if info.is_main:
        (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    logger = MetricsLogger(out if info.is_main else None, total_steps, state.step, cfg.global_batch_size,
                           device, cfg.print_freq, progress=info.is_main and cfg.progress)

    def save_checkpoint() -> None:
        rngs = du.all_gather_objects(ckpt.rng_state())
        if info.is_main:
            ckpt.save(ckpt_dir, {"model": du.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                                 "state": state.to_dict(), "rng": rngs, "config": cfg_dict},
                      state.step, cfg.keep_checkpoints)

    def after_step(record) -> None:
        if record.step % cfg.checkpoint_every == 0 or record.step == total_steps:
            save_checkpoint()
        if cfg.eval_every and record.step % cfg.eval_every == 0 and record.step < total_steps:
            metrics = run_eval()
            if info.is_main:
                logger.log_eval(record.step, metrics)

    started = time.perf_counter()
    start_step = state.step
    try:
        train(model, optimizer, scheduler, scaler, train_loader, cfg, device, state, total_steps,
              callbacks=[logger, StragglerCheck(every=cfg.print_freq), after_step])
    finally:
        logger.close()
    train_time = time.perf_counter() - started
    metrics = run_eval()
    if info.is_main:
        logger.log_eval(state.step, metrics)
        images = (state.step - start_step) * cfg.global_batch_size
        summary = {"steps": state.step, "wall_s": round(time.perf_counter() - started, 1),
                   "train_img_per_s": round(images / max(train_time, 1e-9), 2),
                   "nonfinite_skipped": state.nonfinite_skipped, "scaler_skipped": state.scaler_skipped,
                   **metrics}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"done: {state.step} steps in {summary['wall_s']} s, {summary['train_img_per_s']} img/s; "
              + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()) + f"; outputs in {out}")
    return metrics or {}


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 bad settings, data or checkpoint; 3 non-finite loss; 4 another rank failed."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    rank = du.env_world()[0]
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        cfg, print_only = parse_args(argv)
        validate(cfg, local_world_size=du.env_world()[3])
        if print_only:
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        run(cfg)
    except (ConfigError, DataError, ckpt.CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except RuntimeError as err:
        reason = du.peer_failure(err)
        if reason is None:
            raise
        print(f"error: rank {rank}: {reason}", file=sys.stderr)
        return 4
    finally:
        du.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
