"""The minimal DDP script chapter 4 shows (maskrcnn_tut/lab/minimal_ddp.py): run with torchrun on two gloo
processes, it splits every epoch between the ranks, reorders each epoch, and resumes from its checkpoint to the
weights and losses of a run that never stopped; its checks fail on reports that do not."""
from __future__ import annotations

import ast
import copy
import inspect

import pytest
import torch

from maskrcnn_tut.lab import minimal_ddp


@pytest.mark.system  # three torchrun launches of two processes: the system tier, not the unit tier's two minutes
def test_the_script_runs_on_two_gloo_processes_and_resumes_to_the_same_weights(tmp_path):
    shown = []
    found = minimal_ddp.runs(tmp_path, show=shown.append)
    assert minimal_ddp.checks(found) == {"split": True, "reordered": True, "resumed from": True,
                                         "same losses": True, "same weights": True}
    assert len(shown) == 3 and all(line.startswith("$ torchrun --standalone --nproc_per_node=2") for line in shown)
    assert (tmp_path / "straight" / "checkpoint.pt").exists() and found["stopped"]["start epoch"] == 0


def reports() -> dict:
    """Hand-made reports of a good run: 4 samples, 2 ranks, 2 epochs."""
    straight = {"start epoch": 0, "ranks": [{"seen": {"0": [0, 1], "1": [2, 1]}, "losses": {"0": [1.0], "1": [0.5]}},
                                            {"seen": {"0": [2, 3], "1": [0, 3]}, "losses": {"0": [1.1], "1": [0.6]}}]}
    resumed = {"start epoch": 1, "ranks": [{"seen": {"1": [2, 1]}, "losses": {"1": [0.5]}},
                                           {"seen": {"1": [0, 3]}, "losses": {"1": [0.6]}}]}
    weights = {"model": {"w": torch.ones(2)}}
    return {"straight": straight, "resumed": resumed, "straight checkpoint": weights,
            "resumed checkpoint": copy.deepcopy(weights)}


def test_the_checks_fail_on_runs_that_do_not_do_what_the_chapter_says(monkeypatch):
    monkeypatch.setattr(minimal_ddp, "SAMPLES", 4)
    assert all(minimal_ddp.checks(reports()).values())
    shared = reports()  # no DistributedSampler: both ranks read the same samples
    shared["straight"]["ranks"][1]["seen"] = copy.deepcopy(shared["straight"]["ranks"][0]["seen"])
    assert not minimal_ddp.checks(shared)["split"]
    same_order = reports()  # no set_epoch: every epoch in the same order
    same_order["straight"]["ranks"][0]["seen"]["1"] = [0, 1]
    same_order["straight"]["ranks"][1]["seen"]["1"] = [2, 3]
    assert not minimal_ddp.checks(same_order)["reordered"]
    drifted = reports()  # a resume that restored something else
    drifted["resumed checkpoint"]["model"]["w"] += 1e-7
    drifted["resumed"]["ranks"][0]["losses"]["1"] = [0.51]
    assert not minimal_ddp.checks(drifted)["same weights"] and not minimal_ddp.checks(drifted)["same losses"]


def test_main_is_the_short_recipe_the_chapter_shows():
    """The script's training function stays about 40 lines and has each of its corrections."""
    source = inspect.getsource(minimal_ddp.main)
    assert len(source.splitlines()) <= 45
    for piece in ("torch.cuda.set_device(device)", "device_id=device", "DistributedSampler(", "sampler.set_epoch(epoch)",
                  "model.no_sync()", "dist.get_rank() == 0", "dist.barrier()", "map_location=device",
                  "optimizer.zero_grad()", "sum(model(images, targets).values())"):
        assert piece in source, piece
    ast.parse(inspect.getsource(minimal_ddp))  # the file is the script torchrun runs
