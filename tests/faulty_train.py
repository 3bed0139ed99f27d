"""train.py with a fault planted from outside the package (the package has no test hooks).

    torchrun ... tests/faulty_train.py --nan-at STEP:RANK[,STEP:RANK] -- <train.py flags>
    torchrun ... tests/faulty_train.py --unused-parameter -- <train.py flags>
    torchrun ... tests/faulty_train.py --pause-in-save MARKER --pause-in-eval MARKER -- <train.py flags>

--nan-at makes that rank's loss terms NaN at that optimizer step (a forward hook on the model, so
checkpoints keep the model's own keys); --unused-parameter adds a parameter no loss uses, which
DDP reports in the next step. --pause-in-save and --pause-in-eval create MARKER and wait 3 s within
each checkpoint save (torch.save has written the file, not yet renamed into place) and each
evaluation (scored, not yet returned): a window for a test to send a signal in.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from maskrcnn_tut import train

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", default="")
parser.add_argument("--unused-parameter", action="store_true")
parser.add_argument("--pause-in-save", type=Path)
parser.add_argument("--pause-in-eval", type=Path)
args, rest = parser.parse_known_args()
rest = rest[1:] if rest[:1] == ["--"] else rest
rank = int(os.environ.get("RANK", 0))
nan_steps = {int(step) for step, r in (item.split(":") for item in args.nan_at.split(",") if item) if int(r) == rank}
build_model = train.build_model


def faulty_build_model(cfg, num_classes):
    model = build_model(cfg, num_classes)
    calls = {"training": 0}

    def poison(module, inputs, losses):
        if not module.training:
            return None
        calls["training"] += 1  # one forward per optimizer step at --accum-steps 1
        if calls["training"] in nan_steps:
            return {name: value * float("nan") for name, value in losses.items()}
        return None

    model.register_forward_hook(poison)
    if args.unused_parameter:
        model.unused = nn.Parameter(torch.zeros(3))
    return model


def pause_after(function, marker: Path):
    def paused(*args, **kwargs):
        result = function(*args, **kwargs)
        marker.touch()
        time.sleep(3)
        return result
    return paused


train.build_model = faulty_build_model
if args.pause_in_save:
    torch.save = pause_after(torch.save, args.pause_in_save)
if args.pause_in_eval:
    train.evaluate = pause_after(train.evaluate, args.pause_in_eval)
sys.exit(train.main(rest))
