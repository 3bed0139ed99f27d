"""The package beside torchvision's detection reference (the peer): the same data, the same machine, the
closest settings, both timed the same way in steady state.

The peer is `references/detection/` of pytorch/vision, verbatim (`../shared/peer/torchvision-detection`
and its README). It is run, never copied into the project and never edited. `copy_peer()` puts it in
the checkout's `.peer/`, which git ignores (carry that folder to a GPU machine); `find_peer()` finds it
there, or at $MASKRCNN_TUT_PEER.

`side_by_side()` trains the reference's train.py, then the package's, each as a process run through
`tools/peer_timed.py` (one line per training forward: time, padded input shape, RoI count, data wait,
minor page faults and system CPU time) on the bench's shapes set, which is in the COCO layout the
reference reads (`check_coco`). Each process is stopped once it has logged `steps` measured steps, or
at `timeout_s`. Its lines become `steady` lines (`step_lines`): a step is warm-up until `quiet` steps in
a row met no new shape, then measured; a step that spans an evaluation (the reference evaluates after
every epoch) is left out. The result: both `steady.summarize` rows with minor faults and system CPU
seconds per measured step, the speed ratio package / reference with `steady.verdict` (one round each),
and what differs between the two (`differences`), to print beside the figure.

    python -m maskrcnn_tut.lab.bench.peer --out FILE.json [--rehearse] [--amp]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..provenance import provenance
from . import steady
from .harness import bench_dataset

ROOT = Path(__file__).resolve().parents[3]
PEER_TIMED = ROOT / "tools" / "peer_timed.py"
TRAIN = ROOT / "maskrcnn_tut" / "train.py"
#: Images per step: the reference's -b 2, its default.
BATCH = 2
#: The reference's class count on --dataset coco, whatever the data holds.
REFERENCE_CLASSES = 91
#: A step is measured after at most this many warm-up steps, shapes still changing or not.
MAX_WARMUP = 200
#: `--rehearse`: this machine's CPU at cpu-tiny's sizes, a few steps.
REHEARSAL = dict(device="cpu", sizes=(128, 192), steps=10, warmup_quiet=4)


def find_peer() -> Path:
    """The reference's folder: $MASKRCNN_TUT_PEER, else the checkout's `.peer/torchvision-detection`."""
    peer = Path(os.environ.get("MASKRCNN_TUT_PEER", ROOT / ".peer" / "torchvision-detection"))
    if not (peer / "train.py").is_file():
        raise FileNotFoundError(f"no torchvision detection reference at {peer}: run "
                                "`python -c 'from maskrcnn_tut.lab.bench.peer import copy_peer; copy_peer()'` "
                                "in a checkout beside ../shared, or set MASKRCNN_TUT_PEER")
    return peer


def copy_peer(src: Path | str = Path("../shared/peer/torchvision-detection")) -> Path:
    """Copy the reference's folder, verbatim, into the checkout's `.peer/` (`src` relative to the checkout)."""
    dest = ROOT / ".peer" / "torchvision-detection"
    shutil.copytree(ROOT / src, dest, dirs_exist_ok=True)
    return dest


def _readable(segmentation) -> bool:
    """A mask the reference's `convert_coco_poly_to_mask` reads: polygons (lists of 3+ x, y points; a
    list of 4 numbers would be read as a box) or uncompressed RLE."""
    if isinstance(segmentation, dict):
        return isinstance(segmentation.get("counts"), list)
    return bool(segmentation) and all(isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0 for p in segmentation)


def check_coco(root: Path) -> tuple[int, int]:
    """That `--dataset coco --data-path root` reads `root`: train2017/, val2017/ and
    annotations/instances_{train,val}2017.json, masks it can read and category ids below its 91
    classes. Returns (training images, classes with the background)."""
    splits = {}
    for split in ("train", "val"):
        ann = root / "annotations" / f"instances_{split}2017.json"
        if not ann.is_file() or not (root / f"{split}2017").is_dir():
            raise FileNotFoundError(f"{root}: not the COCO layout the reference reads (no {ann} or {split}2017/)")
        splits[split] = json.loads(ann.read_text())
        bad = [a["id"] for a in splits[split]["annotations"]
               if not _readable(a["segmentation"]) or not 0 < a["category_id"] < REFERENCE_CLASSES]
        if bad:
            raise ValueError(f"{ann}: {len(bad)} annotations the reference cannot read (e.g. id {bad[0]}): it "
                             f"reads polygons or uncompressed RLE, category ids 1-{REFERENCE_CLASSES - 1}")
    return len(splits["train"]["images"]), len(splits["train"]["categories"]) + 1


def records(path: Path) -> list[dict]:
    """The whole lines `tools/peer_timed.py` has written to `path` so far."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def step_lines(found: list[dict], label: str, quiet: int) -> list[dict]:
    """`steady` lines of the steps between consecutive records (module doc), with each step's minor faults
    and system CPU seconds; a step that spans an evaluation is left out, its shape counted as met."""
    lines, seen, calm = [], set(), 0
    for before, after in zip(found, found[1:]):
        shape = tuple(after["shape"] or ())
        new = shape not in seen
        seen.add(shape)
        if after["eval"]:
            continue
        measuring = calm >= quiet or len(lines) >= MAX_WARMUP
        if not measuring:
            calm = 0 if new else calm + 1
        lines.append({"setting": label, "phase": "measure" if measuring else "warm-up", "block": int(measuring),
                      "step": len(lines) + 1, "wall s": after["t"] - before["t"],
                      "data s": after["data s"] - before["data s"], "shape": list(shape), "rois": after["rois"],
                      "new shape": new, "minor faults": after["minflt"] - before["minflt"],
                      "system s": after["stime"] - before["stime"]})
    return lines


def timed_run(label: str, script: Path, args: list[str], folder: Path, steps: int, quiet: int,
              timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Train `script` through tools/peer_timed.py (its lines and output in `folder`) until it has logged
    `steps` measured steps, ends, or runs `timeout_s`; its `summarize` row, how it ended, its lines."""
    log, output = folder / f"{label}.jsonl", folder / f"{label}.out"
    log.unlink(missing_ok=True)
    command = [sys.executable, str(PEER_TIMED), str(script), "--", *args]
    deadline = time.monotonic() + timeout_s
    with open(output, "w") as out:
        process = subprocess.Popen(command, cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {}), "PEER_STEPS": str(log)})
        ended = "time limit"
        try:
            while process.poll() is None and time.monotonic() < deadline:
                if sum(line["phase"] == "measure" for line in step_lines(records(log), label, quiet)) >= steps:
                    ended = "enough steps"
                    break
                time.sleep(1)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # the loader's workers too
            else:
                ended = f"exit {process.returncode}"
            process.wait()
    lines = step_lines(records(log), label, quiet)
    measured = [line for line in lines if line["phase"] == "measure"]
    row = {"setting": label, "ended": ended, "command": command, **steady.summarize(lines, BATCH),
           "minor faults/step": statistics.mean(line["minor faults"] for line in measured) if measured else None,
           "system s/step": statistics.mean(line["system s"] for line in measured) if measured else None,
           "threads": records(log)[-1]["threads"] if lines else None, "lines": lines}
    if not measured:
        row["output tail"] = output.read_text()[-3000:]
    return row


def differences(classes: int, device: str, amp: bool) -> list[str]:
    """How the two runs differ, to print beside their figures."""
    found = [
        f"model: the reference builds maskrcnn_resnet50_fpn from scratch with trainable BatchNorm in the backbone, "
        f"no norm layers in FPN or heads and {REFERENCE_CLASSES} classes; the package's (gpu-r50, --norm bn) has "
        f"BatchNorm in the backbone, FPN and mask head and the data's {classes} classes (background included); "
        "sizes, anchors, RPN and RoI sampling and head widths are the same",
        "optimizer: both SGD, momentum 0.9, lr 0.0025 at 2 images, weight decay 1e-4; the reference decays every "
        "parameter, the package none of its norm and bias parameters" + (", and runs fused SGD" if device == "cuda"
                                                                            else ""),
        "lr warm-up (no effect on speed): the reference's over its first epoch, the package's over 1000 steps",
        "host reads: the reference reads each of its 5 losses and their sum every step (.item(), for its logger); "
        "the package reads its losses once a step" + (" (at --print-freq 1, so it also logs a metrics line and "
                                                      "TensorBoard scalars every step)" if device == "cuda" else ""),
        "data: both decode and flip (p 0.5) in DataLoader workers, no aspect-ratio grouping, batches padded to "
        "their largest image; the reference starts its workers afresh every epoch and evaluates after each "
        "(steps spanning an evaluation are left out), the package keeps its workers and packs a worker's batch "
        "in one shared-memory block",
        "timing: the runs follow each other (one round each), not interleaved; the reference's sampler is "
        "unseeded, so the two meet different batches: compared over steps without a new shape",
    ]
    if device == "cuda":
        found.append("precision: fp16 autocast with a GradScaler in both (the package's --amp --amp-dtype float16)"
                     if amp else "precision: fp32; the package turns TF32 matmuls on (the reference keeps torch's "
                                 "fp32 matmuls; convolutions use TF32 in both)")
    return found


def side_by_side(steps: int = 60, warmup_quiet: int = steady.QUIET_STEPS, device: str | None = None,
                 amp: bool = False, timeout_s: float = 600.0, sizes: tuple[int, int] | None = None,
                 workers: int | None = None, log_dir: Path | str | None = None) -> dict:
    """The reference's train.py, then the package's, on the bench's shapes set (module doc). device: cuda
    when there is one, else cpu; amp: fp16 autocast with a GradScaler (the reference's --amp, CUDA only);
    timeout_s: each run's limit; sizes: (min, max) resize sizes (default the reference's 800, 1333);
    workers: DataLoader workers of each (default 4 on CUDA, 1 on a CPU); log_dir: where the runs' step
    lines and output go (default a temporary folder)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if amp and device != "cuda":
        raise ValueError("the reference's --amp is CUDA autocast: amp needs device='cuda'")
    workers = workers if workers is not None else (4 if device == "cuda" else 1)
    peer, root = find_peer(), bench_dataset(BATCH)
    images, classes = check_coco(root)
    budget = MAX_WARMUP + steps  # steps either run may take
    reference = ["--dataset", "coco", "--model", "maskrcnn_resnet50_fpn", "--data-path", str(root), "--device", device,
                 "-b", str(BATCH), "-j", str(workers), "--epochs", str(math.ceil(budget / (images // BATCH)) + 1),
                 "--lr", "0.0025", "--aspect-ratio-group-factor", "-1", "--print-freq", "1000",
                 "--output-dir", "", *(["--amp"] if amp else [])]  # its default, ".", saves a checkpoint every epoch
    size_env = {"PEER_MIN_SIZE": str(sizes[0]), "PEER_MAX_SIZE": str(sizes[1])} if sizes else {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(log_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        package = ["--data-path", str(root), "--preset", "gpu-r50", "--norm", "bn", "--batch-size", str(BATCH),
                   "--aspect-ratio-group-factor", "-1", "--pad-buckets", "0", "--workers", str(workers),
                   "--max-steps", str(budget), "--checkpoint-every", str(budget), "--output-dir", str(Path(tmp) / "run"),
                   "--accelerator", device, "--no-progress",
                   *(["--amp", "--amp-dtype", "float16"] if amp else ["--no-amp"]),
                   *(["--print-freq", "1"] if device == "cuda" else []),  # a CPU reads every step anyway
                   *(["--min-size", str(sizes[0]), "--max-size", str(sizes[1])] if sizes else [])]
        rows = [timed_run("reference", peer / "train.py", reference, folder, steps, warmup_quiet, timeout_s, size_env),
                timed_run("package", TRAIN, package, folder, steps, warmup_quiet, timeout_s)]
    found = steady.verdict(rows[0]["lines"], rows[1]["lines"])
    return {"device": device, "precision": "fp16 autocast + GradScaler" if amp else "fp32",
            "sizes": list(sizes or (800, 1333)), "images/step": BATCH, "workers": workers, "data": str(root),
            "rows": rows, "ratio package/reference": found["ratio"], "ratio lo": found["lo"],
            "ratio hi": found["hi"], "verdict": found["verdict"], "differences": differences(classes, device, amp)}


def describe(result: dict) -> str:
    """A few lines for a log: each run's speed, faults and system time, the ratio and its verdict."""
    def number(value, form):
        return "-" if value is None else format(value, form)
    text = [f"{result['device']}, {result['precision']}, {result['sizes'][0]}/{result['sizes'][1]} px, "
            f"{result['images/step']} images a step, {result['workers']} workers"]
    for row in result["rows"]:
        text.append(f"{row['setting']}: {number(row['img/s steady'], '.2f')} img/s steady (IQR "
                    f"{number(row['img/s lo'], '.2f')}-{number(row['img/s hi'], '.2f')}) over {row['steady steps']} of "
                    f"{row['steps']} measured steps after {row['warm-up steps']} warm-up, {row['shapes']} shapes; "
                    f"{number(row['minor faults/step'], '.0f')} minor faults and "
                    f"{number(row['system s/step'], '.3f')} system s a step; {row['threads']} threads; {row['ended']}")
    text.append(f"package/reference {number(result['ratio package/reference'], '.3f')} (95 % "
                f"{number(result['ratio lo'], '.3f')}-{number(result['ratio hi'], '.3f')}): {result['verdict']}")
    return "\n".join(text + [f"- {line}" for line in result["differences"]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the package beside torchvision's detection reference, in "
                                                 "steady state, one after the other on the bench's shapes set")
    parser.add_argument("--out", required=True, help="the result as JSON; each run's step lines beside it")
    parser.add_argument("--rehearse", action="store_true",
                        help=f"on this CPU at {REHEARSAL['sizes'][0]}/{REHEARSAL['sizes'][1]} px, "
                             f"{REHEARSAL['steps']} measured steps")
    parser.add_argument("--amp", action="store_true", help="fp16 autocast with a GradScaler in both (CUDA)")
    parser.add_argument("--steps", type=int, help="measured steps of each (default 60; rehearsal "
                                                  f"{REHEARSAL['steps']})")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="each run's limit")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a run in progress is killed on the way out
    settings = {**(REHEARSAL if args.rehearse else {}), "amp": args.amp, "timeout_s": args.timeout_s}
    if args.steps:
        settings["steps"] = args.steps
    out = Path(args.out)
    result = side_by_side(**settings, log_dir=out.with_suffix(".runs"))
    result["provenance"] = provenance(" ".join(["python -m maskrcnn_tut.lab.bench.peer", *sys.argv[1:]]))
    out.write_text(json.dumps(result, indent=1))
    print(describe(result))


if __name__ == "__main__":
    main()
