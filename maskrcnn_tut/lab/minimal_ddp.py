"""A minimal DDP training script: the article's training code, corrected, in one file (chapter 4).

    torchrun --standalone --nproc_per_node=2 maskrcnn_tut/lab/minimal_ddp.py --out DIR [--epochs 3] [--resume]

`main` is the whole recipe, each numbered comment a correction of the article's code: (1) the device first,
then the process group bound to it; (2) the model on its device before DDP wraps it; (3) a
`DistributedSampler`, so each process reads its own shard, and (4) `set_epoch`, so each epoch has a new
order; (5) `no_sync` on all but the last micro-batch of an accumulated step, so gradients are all-reduced
once per optimizer step; (6) one writer of the checkpoint, and a barrier so no process reads a half-written
file; (7) resuming with `map_location`, so every process loads rank 0's tensors onto its own device. The
loss dict is summed, and the gradients are zeroed after each optimizer step (the article's AMP loop never
zeroes them, chapter 5).

The model and data are stand-ins with Mask R-CNN's interface (lists of images and target dicts in, a dict of
losses out), so the script runs in seconds on two CPU processes; `maskrcnn_tut/train.py` runs the same steps
for Mask R-CNN. Besides training, rank 0 writes `report.json`: which samples each rank read in each epoch and
each epoch's losses, for the chapter's checks (`runs`, `checks`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

#: The stand-in dataset's size: an even number, so two ranks split it without the sampler's padding.
SAMPLES = 24


class TinyDetector(nn.Module):
    """Mask R-CNN's interface in a few weights: `model(images, targets)` returns a dict of losses."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 2)

    def forward(self, images, targets):
        out = self.head(torch.relu(self.conv(torch.stack(images))).mean(dim=(2, 3)))
        wanted = torch.stack([target["value"] for target in targets])
        return {"loss_a": nn.functional.mse_loss(out[:, 0], wanted[:, 0]),
                "loss_b": nn.functional.smooth_l1_loss(out[:, 1], wanted[:, 1])}


def stand_in_data(count: int = SAMPLES) -> list[tuple[torch.Tensor, dict]]:
    """`count` (image, target) pairs, the same on every rank; each target carries its sample's index."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.rand(3, 16, 16, generator=gen), {"value": torch.randn(2, generator=gen), "index": torch.tensor(i)})
            for i in range(count)]


def collate(batch):
    return tuple(zip(*batch))  # detection batches are lists: images of any size, one target dict each


def main(argv=None) -> None:
    args = parse(argv)
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available() and not args.cpu:  # (1) the device first, then the group bound to it
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = TinyDetector().to(device)  # (2) on its device before DDP wraps it
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = stand_in_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # (3) each rank its own shard
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, collate_fn=collate)
    checkpoint, start, log = Path(args.out) / "checkpoint.pt", 0, Log()
    if args.resume and checkpoint.exists():  # (7) rank 0's tensors, onto this rank's device
        state = torch.load(checkpoint, map_location=device, weights_only=True)  # tensors and numbers, no code
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)  # (4) a new order every epoch, split the same way on every rank
        for step, (images, targets) in enumerate(loader):
            images = [image.to(device) for image in images]
            targets = [{key: value.to(device) for key, value in target.items()} for target in targets]
            last = (step + 1) % args.accum_steps == 0 or step + 1 == len(loader)
            with contextlib.nullcontext() if last else model.no_sync():  # (5) all-reduce once per step
                loss = sum(model(images, targets).values())  # the loss dict, summed
                (loss / args.accum_steps).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
            log.step(epoch, targets, loss)
        if dist.get_rank() == 0:  # (6) one writer ...
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, checkpoint)
        dist.barrier()  # ... and no rank goes on (or reads it) before it is written
    log.write(Path(args.out) / "report.json", start)
    dist.destroy_process_group()


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for checkpoint.pt and report.json")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="per process")
    parser.add_argument("--accum-steps", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint.pt")
    parser.add_argument("--cpu", action="store_true", help="gloo processes on the CPU even where there are GPUs")
    return parser.parse_args(argv)


class Log:
    """For the chapter's checks, not for training: the samples each rank read and each epoch's losses,
    gathered on rank 0 into report.json."""

    def __init__(self):
        self.seen, self.losses = {}, {}

    def step(self, epoch: int, targets, loss: torch.Tensor) -> None:
        self.seen.setdefault(epoch, []).extend(int(target["index"]) for target in targets)
        self.losses.setdefault(epoch, []).append(float(loss))

    def write(self, path: Path, start: int) -> None:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"seen": self.seen, "losses": self.losses})
        if dist.get_rank() == 0:
            path.write_text(json.dumps({"start epoch": start, "ranks": gathered}))


# --------------------------------------------------------------------------- the chapter's runs


def command(out: Path | str, *flags: str, processes: int = 2) -> list[str]:
    """The torchrun command that runs this script on `processes` CPU processes (gloo)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            __file__, "--out", str(out), "--cpu", *flags]


def runs(folder: Path | str, epochs: int = 3, show=print) -> dict:
    """The script three times on two CPU processes: `epochs` epochs straight ("straight"); then, in another
    folder, one epoch fewer ("stopped") and a restart with --resume up to `epochs` ("resumed"). Returns each
    run's report and the straight and resumed runs' final checkpoints."""
    folder = Path(folder)
    plan = {"straight": ("straight", ["--epochs", str(epochs)]), "stopped": ("restarted", ["--epochs", str(epochs - 1)]),
            "resumed": ("restarted", ["--epochs", str(epochs), "--resume"])}
    found = {}
    for name, (sub, flags) in plan.items():
        out = folder / sub
        out.mkdir(parents=True, exist_ok=True)
        cmd = command(out, *flags)
        show("$ torchrun " + " ".join(cmd[cmd.index("--standalone"):]).replace(__file__, "maskrcnn_tut/lab/minimal_ddp.py"))
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if done.returncode:
            raise RuntimeError(f"minimal_ddp.py failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        found[name] = json.loads((out / "report.json").read_text())
        found[name + " checkpoint"] = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    return found


def checks(found: dict) -> dict[str, bool]:
    """What chapter 4 says of the script, checked on `runs`' reports: the ranks split every epoch without
    overlap, each epoch's order differs, and the resumed run ends where the straight run did."""
    straight = found["straight"]["ranks"]
    epochs = sorted(straight[0]["seen"])
    split = all(not set(straight[0]["seen"][e]) & set(straight[1]["seen"][e])
                and sorted(straight[0]["seen"][e] + straight[1]["seen"][e]) == list(range(SAMPLES)) for e in epochs)
    reordered = all(straight[0]["seen"][a] != straight[0]["seen"][b] for a, b in zip(epochs, epochs[1:]))
    last = epochs[-1]
    resumed = found["resumed"]
    same_losses = all(resumed["ranks"][r]["losses"][last] == straight[r]["losses"][last] for r in (0, 1))
    a, b = found["straight checkpoint"]["model"], found["resumed checkpoint"]["model"]
    return {"split": split, "reordered": reordered, "resumed from": resumed["start epoch"] == int(last),
            "same losses": same_losses, "same weights": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)}


if __name__ == "__main__":
    main()
