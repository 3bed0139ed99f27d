"""Train Mask R-CNN: `torchrun --nproc_per_node=N maskrcnn_tut/train.py [flags]` or `python maskrcnn_tut/train.py`.

Reads top to bottom: settings -> processes -> data -> model -> resume -> the loop (step, schedule,
log, checkpoint, evaluate) -> summary. Each piece is a module of the package that a chapter of the
book exercises; this file only composes them, so the course and the production run are one code.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut import distributed as du
from maskrcnn_tut import rundir
from maskrcnn_tut.config import Config, Run, derive, validate
from maskrcnn_tut.data.loader import (
    batch_stream,
    build_dataset,
    build_datasets,
    build_eval_loader,
    build_train_loader,
    steps_per_epoch,
)
from maskrcnn_tut.data.shapes import ensure_shapes_dataset
from maskrcnn_tut.engine import (
    TrainState,
    after_step,
    build_optimizer,
    build_scheduler,
    configure_runtime,
    make_scaler,
    train_step,
)
from maskrcnn_tut.errors import Preempted
from maskrcnn_tut.evaluate import coco_from_dict, evaluate
from maskrcnn_tut.flags import parse_args
from maskrcnn_tut.model import build_model
from maskrcnn_tut.monitor import MetricsLogger, StragglerCheck, img_per_s_wall
from maskrcnn_tut.preemption import StopRequest

log = logging.getLogger("maskrcnn_tut")


def prepare_paths(settings: Config, info: du.DistInfo) -> Config:
    """The settings with their paths filled in: the embedded shapes dataset when no data is given
    (one writer per machine), the output dir, and the backend the process group uses."""
    data_path = settings.data_path
    if data_path is None and settings.train_json is None:
        shapes = dict(n_train=settings.shapes_train, n_val=settings.shapes_val, seed=settings.shapes_seed)
        if info.local_rank == 0:
            ensure_shapes_dataset(**shapes, progress=info.is_main and settings.progress)
        du.barrier()
        data_path = str(ensure_shapes_dataset(**shapes, progress=False))
    output_dir = du.broadcast_object(settings.output_dir or str(Path("runs") / "train"))
    return dataclasses.replace(settings, data_path=data_path, output_dir=output_dir, dist_backend=info.backend)


def same_model_on_every_rank(model) -> None:
    """Rank 0's buffers (BatchNorm running statistics) on every rank: after DDP training each rank
    holds its own, and the shards of an evaluation must all be scored by the model the checkpoint saves."""
    if torch.distributed.is_initialized():
        for buffer in du.unwrap(model).buffers():
            torch.distributed.broadcast(buffer, src=0)


def evaluate_checkpoint(cfg: Run, info: du.DistInfo, found: tuple[Path, dict] | None) -> dict:
    """`--test-only`: score the checkpoint (or --weights) at the settings it was trained with."""
    if found is not None:
        cfg = dataclasses.replace(cfg, settings=ckpt.inference_config(cfg.settings, found[1], found[0]))
    val_set = build_dataset(cfg, "val")
    model = build_model(cfg, val_set.num_classes).to(info.device)
    if found is not None:
        ckpt.check_compatible(found[1], cfg.to_dict() | {"num_classes": val_set.num_classes,
                                                         "class_names": val_set.class_names}, found[0])
        ckpt.load_model_state(model, found[1], found[0])
    coco_gt = coco_from_dict(val_set.ground_truth()) if info.is_main else None
    metrics = evaluate(model, build_eval_loader(val_set, cfg, info.rank, info.world_size), coco_gt, info.device,
                       val_set.label_to_cat, progress=info.is_main and cfg.progress)
    if info.is_main:
        print(json.dumps(metrics))
    return metrics or {}


@rundir.releasing  # the output folder is this run's until it returns or fails
def run(settings: Config) -> dict:
    """The whole job in this process; returns the final metrics (on rank 0)."""
    # settings and processes: one process per GPU (or a share of the CPU cores each); `cfg` is the
    # settings plus what this run derives from them (global batch, scaled lr, precision, pin_memory)
    info = du.init_distributed(settings.dist_backend, settings.dist_timeout, settings.accelerator)
    cfg = derive(prepare_paths(settings, info), info.world_size, info.device)
    device = info.device
    configure_runtime(cfg, device)
    out = Path(cfg.output_dir)
    ckpt_dir = out / "checkpoints"
    found = ckpt.find_resume(cfg.resume, ckpt_dir, cfg.test_only)
    if cfg.test_only:
        return evaluate_checkpoint(cfg, info, found)
    rundir.claim(out, info)  # one run per output folder; a second one stops here naming the first

    # data: every rank cleans the same json the same way; rank 0 reports what it found. The
    # overfit check trains on the first N training images, unaugmented, and evaluates on the same N
    train_set, val_set = build_datasets(cfg)
    if cfg.overfit:
        train_set, val_set = train_set.first(cfg.overfit), train_set.first(cfg.overfit)  # no flips: memorize these
    cfg_dict = cfg.to_dict() | {"num_classes": train_set.num_classes, "class_names": train_set.class_names,
                                "usable_train_images": len(train_set)}  # a resume over changed data stops
    if info.is_main:
        for name, ds in (("train", train_set), ("val", val_set)):
            log.info("%s data %s: %d images; %s", name, ds.ann_file, len(ds), ds.report.summary())
    train_loader = build_train_loader(train_set, cfg, info.rank, info.world_size, device)
    val_loader = build_eval_loader(val_set, cfg, info.rank, info.world_size)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch(train_loader, cfg.accum_steps)

    # model: the same init on every rank, then per-rank randomness (RPN/RoI sampling)
    du.seed_everything(cfg.seed)
    model = build_model(cfg, train_set.num_classes).to(device)
    du.seed_everything(cfg.seed + info.rank)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    scaler = make_scaler(cfg, device)
    state = TrainState()

    # resume: an explicit checkpoint, or the newest good one in --output-dir; else a fresh run
    # that sets an earlier run in the same folder aside, whole
    if found is not None:
        path, payload = found
        ckpt.check_compatible(payload, cfg_dict, path)
        ckpt.load_model_state(model, payload, path)
        state = ckpt.restore_training(payload, optimizer, scheduler, scaler, info, cfg)
        if info.is_main:
            log.info("resumed from %s at step %d (epoch %d)", path, state.step, state.epoch)
            rundir.drop_replayed_rows(out, state.step)
    elif info.is_main:
        aside = rundir.set_aside_earlier_run(out)
        if aside:
            log.warning("%s held an earlier run: its files are now in %s", out, aside)
    du.barrier()

    model = du.wrap_ddp(model, cfg, info)
    coco_gt = coco_from_dict(val_set.ground_truth()) if info.is_main else None

    def run_eval() -> dict | None:
        same_model_on_every_rank(model)
        return evaluate(model, val_loader, coco_gt, device, val_set.label_to_cat,
                        progress=info.is_main and cfg.progress)

    if info.is_main:
        (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    logger = MetricsLogger(out if info.is_main else None, total_steps, state.step, cfg.global_batch,
                           device, cfg.print_freq, progress=info.is_main and cfg.progress)
    stragglers = StragglerCheck(every=cfg.print_freq)

    def save_checkpoint() -> None:
        rngs = du.all_gather_objects(ckpt.rng_state(device))
        if info.is_main:
            ckpt.save(ckpt_dir, {"model": du.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                                 "state": state.to_dict(), "rng": rngs, "config": cfg_dict},
                      state.step, cfg.keep_checkpoints)

    # the loop: one optimizer step (engine.train_step: accum_steps micro-batches), then the schedule
    # and the log (engine.after_step, which the lab's benchmarks call too), and checkpoints and
    # evaluation when they are due. A scheduler's signal
    # (preemption.StopRequest) saves after the current step on every rank, then stops; during the
    # final evaluation, whose step is saved already, it stops at once
    started = time.perf_counter()
    start_step = state.step
    batches = batch_stream(train_loader, state)
    # on GPUs the host reads a step's loss only when something needs it (a log line, a checkpoint, an
    # evaluation, the end), so it never waits for the device in between; a CPU reads every step for free
    read_all = device.type != "cuda"

    def due(step: int) -> bool:
        return (step % cfg.print_freq == 0 or step % cfg.checkpoint_every == 0 or step == total_steps
                or bool(cfg.eval_every and step % cfg.eval_every == 0))

    with StopRequest() as stop:
        model.train()
        try:
            while state.step < total_steps:
                state.stop_requested = stop.cause is not None
                records = train_step(model, optimizer, scaler, batches, cfg, state, read=read_all or due(state.step + 1))
                record = after_step(scheduler, records, (logger, stragglers))  # schedule, log, straggler check
                if record is None:
                    continue
                if record.step % cfg.checkpoint_every == 0 or record.step == total_steps or record.stop_requested:
                    save_checkpoint()
                if record.stop_requested:
                    raise Preempted(f"stopped {stop.agreed_cause()} after step {record.step}: checkpoint saved "
                                    f"in {ckpt_dir}; continue with --resume auto")
                if cfg.eval_every and record.step % cfg.eval_every == 0 and record.step < total_steps:
                    metrics = run_eval()
                    if info.is_main:
                        logger.log_eval(record.step, metrics)
        finally:
            logger.close()
        train_time = time.perf_counter() - started

        # summary: the final evaluation, and what the run did
        final = f"at the final evaluation: step {state.step}, the last, is saved in {ckpt_dir}; --resume auto scores it"
        with stop.at_once(final):
            cause = stop.agreed_cause()  # a signal during the last save
            if cause:
                raise Preempted(f"stopped {cause} {final}")
            metrics = run_eval()
        if info.is_main:
            logger.log_eval(state.step, metrics)
            images = (state.step - start_step) * cfg.global_batch
            summary = {"steps": state.step, "wall_s": round(time.perf_counter() - started, 1),
                       "img_per_s_wall": round(img_per_s_wall(images, train_time), 2),
                       "nonfinite_skipped": state.nonfinite_skipped, "scaler_skipped": state.scaler_skipped,
                       "load_failed": train_set.report.counts["load_failed"],
                       "val_load_failed": val_set.report.counts["load_failed"], **metrics}
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            print(f"done: {state.step} steps in {summary['wall_s']} s, {summary['img_per_s_wall']} img/s "
                  + "(wall time, mid-run evaluations and checkpoint saves included); "
                  + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
                  + f"; images that failed to decode: {summary['load_failed']} train, {summary['val_load_failed']} val"
                  + f"; outputs in {out}")
    return metrics or {}


def print_config(settings: Config) -> None:
    """`--print-config`: the settings and what this run derives from them, printed by rank 0."""
    info = du.init_distributed(settings.dist_backend, settings.dist_timeout, settings.accelerator)
    if info.is_main:
        cfg = derive(dataclasses.replace(settings, dist_backend=info.backend), info.world_size, info.device)
        print(json.dumps(cfg.to_dict(), indent=2))


def main(argv: list[str] | None = None) -> int:
    """Exit codes (`distributed.run_cli`): 0 done; 2 bad settings, data or checkpoint; 3 non-finite loss;
    4 another rank failed; 143 stopped by SIGTERM, SIGUSR1 or the end of torchrun after saving a checkpoint."""
    def body() -> None:
        cfg, print_only = parse_args(argv)
        validate(cfg, local_world_size=du.env_world()[3])
        if print_only:
            print_config(cfg)
        else:
            run(cfg)

    return du.run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
