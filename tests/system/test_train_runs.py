"""The CLI end to end: one process, two torchrun processes, and two torchrun "nodes"."""
import json
import subprocess

import pytest
import torch
from conftest import TRAIN_SCRIPT, run_train, subprocess_env

from maskrcnn_tut.lab.processes import free_port
from maskrcnn_tut.monitor import read_jsonl

METRIC_KEYS = {"step", "epoch", "lr", "loss", "loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness",
               "loss_rpn_box_reg", "data_time", "iter_time", "img_per_s", "max_mem_mb"}
EVAL_KEYS = {"step", "bbox_AP", "bbox_AP50", "bbox_AP75", "segm_AP", "segm_AP50", "segm_AP75"}


def _run(*flags, nproc=1):
    out = run_train(*flags, nproc=nproc)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _check_outputs(run_dir, world_size, steps, batch, accum=1):
    config = json.loads((run_dir / "config.json").read_text())
    derived = config["derived"]  # what the run decided, apart from the settings
    assert derived["world_size"] == world_size and config["batch_size"] == batch
    assert derived["global_batch"] == batch * accum * world_size
    assert derived["scaled_lr"] == pytest.approx(config["lr"] * (derived["global_batch"] / 8) ** 0.5)  # AdamW
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert METRIC_KEYS <= set(metrics[-1])
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert evals[-1]["step"] == steps and EVAL_KEYS <= set(evals[-1])
    assert all(0.0 <= evals[-1][k] <= 1.0 for k in EVAL_KEYS - {"step"})
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["state"]["step"] == steps and len(ckpt["rng"]) == world_size
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_single_process_with_accumulation(tiny_flags, tmp_path):
    _run(*tiny_flags, "--max-steps", "2", "--accum-steps", "2")
    _check_outputs(tmp_path / "run", world_size=1, steps=2, batch=2, accum=2)


def test_two_processes_with_torchrun(tiny_flags, tmp_path):
    out = _run(*tiny_flags, "--max-steps", "3", "--eval-every", "2", nproc=2)
    _check_outputs(tmp_path / "run", world_size=2, steps=3, batch=2)
    assert [e["step"] for e in read_jsonl(tmp_path / "run" / "eval.jsonl")] == [2, 3]
    assert out.stdout.count("done:") == 1  # only rank 0 reports


def test_two_nodes_with_c10d_rendezvous(tiny_flags, tmp_path):
    port = free_port()
    node = ["torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-two-nodes", str(TRAIN_SCRIPT),
            *tiny_flags, "--max-steps", "2"]
    procs = [subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=subprocess_env()) for _ in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    _check_outputs(tmp_path / "run", world_size=2, steps=2, batch=2)
