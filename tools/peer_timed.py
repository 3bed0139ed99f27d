"""Run a training script, unedited, with one flushed JSON line per training forward of its Mask R-CNN.

    PEER_STEPS=steps.jsonl [PEER_MIN_SIZE=128 PEER_MAX_SIZE=192] python tools/peer_timed.py SCRIPT -- ARGS...

runs SCRIPT (torchvision's references/detection/train.py, or maskrcnn_tut/train.py) as `python SCRIPT
ARGS` would. First it registers a global forward pre-hook that waits for the first torchvision
`GeneralizedRCNN` to be called, hooks that model, its backbone and its mask head, and removes itself,
so that no other module's call pays for it. Each forward of the model in training mode then appends
to $PEER_STEPS

    {"t": perf_counter, "shape": [h, w], "rois": n, "data s": s, "minflt": n, "stime": s, "eval": bool, "threads": n}

A line ends the step that the line before it began: "t" is taken as the forward starts, "shape" (the
backbone's input, the padded batch) and "rois" (RoIs into the mask head) are the ended step's, "data
s" (seconds spent in DataLoader iterators' `__next__`), "minflt" and "stime" (getrusage of this
process: minor page faults, system CPU seconds) are totals so far, "eval" says whether the model ran
in eval mode since the line before (an evaluation between epochs), "threads" is torch's thread count.
The first line has no shape. Both scripts read each step's loss on the host (the reference with
`.item()`, train.py on CPUs always and on GPUs at its log steps: pass --print-freq 1), so the time
between two lines is that step's wall time.

PEER_MIN_SIZE / PEER_MAX_SIZE set the model's resize sizes (as its builder's min_size/max_size would)
before its first forward.
"""
from __future__ import annotations

import json
import os
import resource
import runpy
import sys
import time

import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter
from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN


class StepLog:
    """The hooks and the file they write (module doc)."""

    def __init__(self, path: str):
        self.out = open(path, "a")
        self.shape, self.rois, self.data_s, self.evaluated = None, 0, 0.0, False
        self.finder = torch.nn.modules.module.register_module_forward_pre_hook(self.find_model)
        next_batch = _BaseDataLoaderIter.__next__

        def timed_next(iterator):
            started = time.perf_counter()
            try:
                return next_batch(iterator)
            finally:
                self.data_s += time.perf_counter() - started
        _BaseDataLoaderIter.__next__ = timed_next

    def find_model(self, module, args) -> None:
        if not isinstance(module, GeneralizedRCNN):
            return
        self.finder.remove()
        if "PEER_MIN_SIZE" in os.environ:
            module.transform.min_size = (int(os.environ["PEER_MIN_SIZE"]),)
        if "PEER_MAX_SIZE" in os.environ:
            module.transform.max_size = int(os.environ["PEER_MAX_SIZE"])
        module.register_forward_pre_hook(self.forward)
        module.backbone.register_forward_pre_hook(self.backbone)
        if getattr(module.roi_heads, "mask_head", None) is not None:
            module.roi_heads.mask_head.register_forward_pre_hook(self.mask_head)
        self.forward(module, args)  # this call's own hooks were fixed before the model's were added

    def backbone(self, module, args) -> None:
        if module.training:
            self.shape = list(args[0].shape[-2:])

    def mask_head(self, module, args) -> None:
        if module.training:
            self.rois += args[0].shape[0]

    def forward(self, module, _args) -> None:
        if not module.training:
            self.evaluated = True
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        line = {"t": time.perf_counter(), "shape": self.shape, "rois": self.rois, "data s": self.data_s,
                "minflt": usage.ru_minflt, "stime": usage.ru_stime, "eval": self.evaluated,
                "threads": torch.get_num_threads()}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()
        self.shape, self.rois, self.evaluated = None, 0, False


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit(__doc__.split("\n\n")[1])
    script = os.path.abspath(sys.argv[1])
    StepLog(os.environ["PEER_STEPS"])
    sys.argv = [script, *sys.argv[3:]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` puts it: the reference imports its siblings
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
