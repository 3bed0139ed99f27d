"""train.py with a fault planted from outside the package (the package has no test hooks).

    torchrun ... tests/faulty_train.py --nan-at STEP:RANK[,STEP:RANK] -- <train.py flags>
    torchrun ... tests/faulty_train.py --unused-parameter -- <train.py flags>

--nan-at makes that rank's loss terms NaN at that optimizer step (a forward hook on the model, so
checkpoints keep the model's own keys); --unused-parameter adds a parameter no loss uses, which
DDP reports in the next step.
"""
import argparse
import os
import sys

import torch
from torch import nn

from maskrcnn_tut import train

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", default="")
parser.add_argument("--unused-parameter", action="store_true")
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


train.build_model = faulty_build_model
sys.exit(train.main(rest))
