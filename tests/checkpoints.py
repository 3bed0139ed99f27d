"""A checkpoint payload as train.py writes it, for tests that damage or mismatch one on purpose."""
from __future__ import annotations

import torch

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.engine import TrainState, build_optimizer, build_scheduler
from maskrcnn_tut.model import build_model

SHAPES_CLASSES = ["square", "circle", "triangle"]


def resumable_payload(step: int, **settings) -> dict:
    """Every entry train.py saves, for a cpu-tiny model (with `settings`) of the shapes' 3 classes."""
    cfg = derive(make_config("cpu-tiny", **settings), 1, "cpu")
    model = build_model(cfg, len(SHAPES_CLASSES) + 1)
    optimizer = build_optimizer(model, cfg)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": build_scheduler(optimizer, cfg, 10).state_dict(), "scaler": {},
            "state": TrainState(step=step).to_dict(), "rng": [ckpt.rng_state(torch.device("cpu"))],
            "config": cfg.to_dict() | {"num_classes": len(SHAPES_CLASSES) + 1, "class_names": SHAPES_CLASSES}}
