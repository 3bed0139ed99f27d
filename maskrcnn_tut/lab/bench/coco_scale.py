"""COCO-scale benchmark of the data pipeline: `python -m maskrcnn_tut.lab.bench.coco_scale --out /tmp/cocoscale`.

Writes a dataset of COCO train2017's shape (118,287 images, 860,001 instances as polygons with
COCO's point counts, ~1 % crowd regions as uncompressed RLE, a json of COCO's size) whose image
files are tiny (flat JPEGs of COCO's real sizes, ~5 KB each), then measures, each in fresh
processes started by `processes.launch` (gloo) so the figures are not mixed up:

- start-up: seconds until `CocoDetection` is ready to train, the first time (cleaning every
  image and annotation) and once its cleaned records are cached, with N ranks starting together;
- memory: resident MB the dataset adds to a training process (after start-up, and at the peak),
  and the largest process's peak resident MB (a rank, or one of the processes it forks to clean);
- workers: private MB each of 4 DataLoader workers holds after reading 1 and 3 epochs' share of
  records, after a full garbage collection in the worker, and while decoding real batches;
- evaluation: seconds and MB to gather 5k images' detections across 2 ranks (gloo).

The dataset is written once and reused (`--out`); `--skip` leaves phases out. Figures are printed
and written to `<out>/results.json`. Wall times depend on what else runs on the machine: the
start-up figures carry the CPU seconds and the load average they were measured at.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ... import distributed as du
from ...errors import UserError, print_error
from ...hardware import peak_memory_mb
from .. import processes
from ..device_memory import current_memory_mb

CPU = torch.device("cpu")

COCO_IMAGES, COCO_INSTANCES = 118_287, 860_001
#: COCO's most common image sizes (width, height); files are flat JPEGs of these sizes.
SIZES = ((640, 480), (640, 427), (480, 640), (640, 426), (427, 640), (500, 375), (640, 360))
CATEGORIES = [{"id": i, "name": f"class{i}", "supercategory": "thing"} for i in
              [*range(1, 12), *range(13, 26), 27, 28, *range(31, 45), *range(46, 66), 67, 70,
               *range(72, 83), *range(84, 91)]]  # COCO's 80 sparse ids


def _polygon(rng, width: int, height: int) -> tuple[list, list, float]:
    """(segmentation, bbox, area) of a jittered star-shaped polygon inside the image, with COCO's
    typical point count (8-40) and its 2-decimal coordinates; one in ten in two parts."""
    parts = 2 if rng.random() < 0.1 else 1
    cx, cy = rng.uniform(0.1, 0.9) * width, rng.uniform(0.1, 0.9) * height
    radius = min(width, height) * rng.uniform(0.02, 0.3)
    segmentation, xs_all, ys_all, area = [], [], [], 0.0
    for part in range(parts):
        n = int(rng.integers(8, 41))
        angles = np.sort(rng.uniform(0, 2 * np.pi, n))
        r = radius * rng.uniform(0.6, 1.0, n) / parts
        ox = part * radius * 1.2
        xs = np.clip(cx + ox + r * np.cos(angles), 0, width - 0.01).round(2)
        ys = np.clip(cy + r * np.sin(angles), 0, height - 0.01).round(2)
        area += 0.5 * abs(float(np.dot(xs, np.roll(ys, 1)) - np.dot(ys, np.roll(xs, 1))))
        segmentation.append(np.stack([xs, ys], 1).ravel().tolist())
        xs_all.append(xs)
        ys_all.append(ys)
    xs, ys = np.concatenate(xs_all), np.concatenate(ys_all)
    bbox = [round(float(xs.min()), 2), round(float(ys.min()), 2),
            round(float(xs.max() - xs.min()), 2), round(float(ys.max() - ys.min()), 2)]
    return segmentation, bbox, round(area, 2)


def _crowd(rng, width: int, height: int) -> tuple[dict, list, float]:
    """An uncompressed RLE rectangle, as COCO writes crowd regions."""
    w, h = int(rng.integers(20, width // 2)), int(rng.integers(20, height // 2))
    x0, y0 = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
    counts = [x0 * height + y0] + [h, height - h] * (w - 1) + [h, height * (width - x0 - w) + height - h - y0]
    return {"size": [height, width], "counts": counts}, [x0, y0, w, h], float(w * h)


def write_dataset(out: Path, n_images: int, n_instances: int, seed: int = 0) -> Path:
    """Write `out/train2017/*.jpg` and `out/annotations/instances_train2017.json`; returns the json."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    image_dir, ann_file = out / "train2017", out / "annotations" / "instances_train2017.json"
    image_dir.mkdir(parents=True, exist_ok=True)
    ann_file.parent.mkdir(parents=True, exist_ok=True)
    blobs = {}
    for size in SIZES:
        Image.new("RGB", size, (120, 110, 100)).save(out / "_blob.jpg", quality=75)
        blobs[size] = (out / "_blob.jpg").read_bytes()
    (out / "_blob.jpg").unlink()
    sizes = [SIZES[k] for k in rng.integers(0, len(SIZES), n_images)]
    per_image = np.bincount(rng.integers(0, n_images, n_instances), minlength=n_images)
    with open(ann_file, "w") as f:
        f.write('{"info": {"description": "COCO-shaped benchmark data"}, "images": [')
        for k, (width, height) in enumerate(sizes):
            name = f"{k + 1:012d}.jpg"
            (image_dir / name).write_bytes(blobs[(width, height)])
            f.write(("," if k else "") + json.dumps({"id": k + 1, "file_name": name, "width": width,
                                                     "height": height, "license": 1}))
        f.write('], "annotations": [')
        ann_id = 0
        for k, (width, height) in enumerate(sizes):
            for _ in range(per_image[k]):
                crowd = rng.random() < 0.01
                seg, bbox, area = _crowd(rng, width, height) if crowd else _polygon(rng, width, height)
                ann_id += 1
                f.write(("," if ann_id > 1 else "") + json.dumps(
                    {"id": ann_id, "image_id": k + 1, "category_id": CATEGORIES[int(rng.integers(0, 80))]["id"],
                     "iscrowd": int(crowd), "area": area, "bbox": bbox, "segmentation": seg}))
        f.write('], "categories": ' + json.dumps(CATEGORIES) + "}")
    return ann_file


# --------------------------------------------------------------------------- measurements (children)


def _private_mb(pid: int | str = "self") -> float:
    """Private (unshared) MB of a process, from /proc/PID/smaps_rollup: what a DataLoader worker
    holds of its own once copy-on-write has copied the pages it touched."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) / 1024
    return fields["Private_Clean"] + fields["Private_Dirty"]


def _children_peak_mb() -> float:
    """Peak resident MB of the largest finished child (the forked cleaners)."""
    import resource
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the forked cleaners)."""
    import resource
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def _open_dataset(out: Path, cache_dir: str | None):
    """The train split as a gpu-r50 run cleans it (800/1333 px), through the records cache."""
    from maskrcnn_tut.data.coco import CocoDetection

    return CocoDetection(out / "train2017", out / "annotations" / "instances_train2017.json", train=True,
                         min_size=800, max_size=1333, cache_dir=cache_dir)


def startup_worker(out: Path, cache_dir: str | None) -> list[dict]:
    """Run inside `processes.launch`: open the dataset on every rank at once (as torchrun starts
    them); each rank's seconds until ready, CPU seconds, and the memory the dataset added."""
    import gc

    import maskrcnn_tut.data.loader  # noqa: F401  (a training process has it loaded: not the dataset's memory)

    gc.collect()
    rss, private = current_memory_mb(CPU), _private_mb()
    cpu = _cpu_s()
    started = time.perf_counter()
    dataset = _open_dataset(out, cache_dir)
    ready = time.perf_counter() - started
    cpu = _cpu_s() - cpu
    gc.collect()
    return du.all_gather_objects({
        "ready_s": round(ready, 1), "cpu_s": round(cpu, 1), "load_avg": round(os.getloadavg()[0], 1),
        "images": len(dataset), "dataset_rss_mb": round(current_memory_mb(CPU) - rss),
        "dataset_uss_mb": round(_private_mb() - private), "peak_rss_mb": round(peak_memory_mb(CPU) - rss),
        "process_peak_mb": round(max(peak_memory_mb(CPU), _children_peak_mb())),
        "problems": dict(dataset.report.counts)})


class _Touch:
    """What a DataLoader worker does to the dataset's storage, without decoding pixels: read
    sample i's image entry and every field of its instances, as `CocoDetection.load` does. Index
    -1 runs a full garbage collection in the worker instead (what a long run eventually does)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        if i == -1:
            import gc
            return gc.collect()
        info, target = self.dataset.images[i], self.dataset.targets[i]
        return len(info["file_name"]) + sum(len(a["rle"]["counts"]) + len(a["box"]) + a["label"] for a in target)


class _Batches:
    """An epoch of shuffled batches of 512, or (`collect`) one batch [-1] per worker."""

    def __init__(self, n: int, workers: int):
        self.n, self.workers, self.collect, self.epoch = n, workers, False, 0

    def __iter__(self):
        if self.collect:
            yield from [[-1]] * self.workers
            return
        order = np.random.default_rng(self.epoch).permutation(self.n).tolist()
        self.epoch += 1
        yield from (order[k:k + 512] for k in range(0, self.n, 512))

    def __len__(self):
        return self.workers if self.collect else -(-self.n // 512)


def _workers_private_mb(loader) -> list[int]:
    """`_private_mb` of each of a running DataLoader's worker processes."""
    return [round(_private_mb(w.pid)) for w in loader._iterator._workers]


def workers_worker(out: Path, cache_dir: str | None, workers: int, decode_batches: int) -> dict:
    """Run inside `processes.launch` (one process): the private memory of DataLoader workers
    reading the dataset's records, after a full garbage collection, and while decoding."""
    from torch.utils.data import DataLoader

    from maskrcnn_tut.data.loader import collate

    dataset = _open_dataset(out, cache_dir)
    figures = {"main_rss_mb": round(current_memory_mb(CPU))}
    batches = _Batches(len(dataset), workers)
    touch = DataLoader(_Touch(dataset), batch_sampler=batches, num_workers=workers, persistent_workers=True)
    started = time.perf_counter()
    for epoch in range(3):
        for _ in touch:
            pass
        if epoch == 0:
            figures["touch_epoch_s"] = round(time.perf_counter() - started, 1)
            figures["worker_uss_mb_after_1_epoch"] = _workers_private_mb(touch)
    figures["worker_uss_mb_after_3_epochs"] = _workers_private_mb(touch)
    batches.collect = True
    for _ in touch:
        pass
    figures["worker_uss_mb_after_full_gc"] = _workers_private_mb(touch)
    del touch
    loader = DataLoader(dataset, batch_size=2, num_workers=workers, collate_fn=collate, persistent_workers=True,
                        sampler=torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(1)))
    started = time.perf_counter()
    for k, _ in enumerate(loader):
        if k + 1 == decode_batches:
            break
    figures["decode_img_per_s"] = round(2 * decode_batches / (time.perf_counter() - started), 1)
    figures["worker_uss_mb_decoding"] = _workers_private_mb(loader)
    return figures


def _fake_results(rank: int, world: int, n_images: int, per_image: int, seed: int = 0) -> tuple[list, list]:
    """COCO results as `evaluate.to_coco_results` makes them, for this rank's shard."""
    rng = np.random.default_rng(seed + rank)
    from pycocotools import mask as mask_utils

    rles = []
    for _ in range(16):  # a few real encoded masks of 640x480, reused
        mask = np.zeros((480, 640), dtype=np.uint8, order="F")
        x, y = rng.integers(0, 500), rng.integers(0, 380)
        mask[y:y + rng.integers(10, 100), x:x + rng.integers(10, 140)] = 1
        rles.append(mask_utils.encode(mask)["counts"].decode("ascii"))
    results, ids = [], list(range(rank + 1, n_images + 1, world))
    for image_id in ids:
        for k in range(per_image):
            results.append({"image_id": image_id, "category_id": int(rng.integers(1, 81)),
                            "bbox": [round(float(v), 2) for v in rng.uniform(0, 300, 4)],
                            "score": round(float(rng.random()), 5),
                            # a string object of its own per detection, as real results have
                            "segmentation": {"size": [480, 640], "counts": (rles[k % 16] + "0")[:-1]}})
    return results, ids


def gather_worker(n_images: int, per_image: int) -> dict:
    """Run inside `processes.launch`: gather every rank's share of `n_images` images' detections
    (`evaluate.gather_results`, as evaluation does); the slowest rank's seconds and each rank's memory."""
    from maskrcnn_tut.evaluate import gather_results

    info = du.info()
    results, ids = _fake_results(info.rank, info.world_size, n_images, per_image)
    made = current_memory_mb(CPU)
    du.barrier()
    started = time.perf_counter()
    gathered = gather_results(results, ids)
    elapsed = time.perf_counter() - started
    ranks = du.all_gather_objects({"gather_s": round(elapsed, 1), "peak_rss_mb": round(peak_memory_mb(CPU)),
                                   "results_made_rss_mb": round(made),
                                   "detections": len(gathered[0]) if gathered else 0})
    return {"eval_images": n_images, "detections": ranks[0]["detections"],
            "gather_s": max(f["gather_s"] for f in ranks),
            "rank_peak_rss_mb": [f["peak_rss_mb"] for f in ranks],
            "rank_rss_before_gather_mb": [f["results_made_rss_mb"] for f in ranks]}


def _ranks_together(out: Path, cache_dir: str, ranks: int) -> dict:
    """`ranks` processes opening the dataset at once (as torchrun starts them): the slowest's time."""
    started = time.perf_counter()
    figures = processes.launch(startup_worker, ranks, out, cache_dir, backend="gloo")
    return {"ranks": ranks, "all_ready_s": round(time.perf_counter() - started, 1),
            "rank_ready_s": [f["ready_s"] for f in figures],
            "rank_dataset_rss_mb": [f["dataset_rss_mb"] for f in figures],
            "rank_peak_mb": [f["process_peak_mb"] for f in figures]}


def main(argv: list[str] | None = None) -> int:
    """Write the dataset once, measure the phases not skipped; a failed phase ends it with one line."""
    try:
        return measure(argv)
    except UserError as err:  # a worker's failure (`WorkerError`) included
        print_error(str(err))
        return err.exit_code


def measure(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maskrcnn_tut.lab.bench.coco_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/cocoscale"))
    parser.add_argument("--images", type=int, default=COCO_IMAGES)
    parser.add_argument("--instances", type=int, default=COCO_INSTANCES)
    parser.add_argument("--ranks", type=int, default=2, help="processes starting together (default 2)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--eval-images", type=int, default=5000)
    parser.add_argument("--detections", type=int, default=100, help="per evaluated image")
    parser.add_argument("--skip", nargs="*", default=[], choices=["startup", "ranks", "workers", "gather"])
    parser.add_argument("--no-cache", action="store_true", help="measure without the records cache")
    args = parser.parse_args(argv)
    ann = args.out / "annotations" / "instances_train2017.json"
    results = {}
    if not ann.exists():
        started = time.perf_counter()
        write_dataset(args.out, args.images, args.instances)
        print(f"wrote {args.images} images, {args.instances} instances in {time.perf_counter() - started:.0f} s; "
              f"json {ann.stat().st_size / 2**20:.0f} MB", flush=True)
    results["json_mb"] = round(ann.stat().st_size / 2**20)
    cache = None if args.no_cache else str(args.out / "cache")
    if "startup" not in args.skip:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
        results["first_start"] = processes.launch(startup_worker, 1, args.out, cache, backend="gloo")[0]
        print("first start:", results["first_start"], flush=True)
        if cache:
            results["cached_start"] = processes.launch(startup_worker, 1, args.out, cache, backend="gloo")[0]
            print("cached start:", results["cached_start"], flush=True)
    if "ranks" not in args.skip and cache:
        shutil.rmtree(cache, ignore_errors=True)
        results["ranks_first_start"] = _ranks_together(args.out, cache, args.ranks)
        print("ranks starting together:", results["ranks_first_start"], flush=True)
    peaks = [results[k]["process_peak_mb"] for k in ("first_start", "cached_start") if k in results]
    if peaks or "ranks_first_start" in results:  # a rank or one of its cleaners, whichever peaked highest
        results["startup_largest_process_mb"] = max(peaks + results.get("ranks_first_start", {}).get("rank_peak_mb", []))
    if "workers" not in args.skip:
        results["workers"] = processes.launch(workers_worker, 1, args.out, cache, args.workers, 50, backend="gloo")
        print("workers:", results["workers"], flush=True)
    if "gather" not in args.skip:
        results["gather"] = processes.launch(gather_worker, 2, args.eval_images, args.detections, backend="gloo")
        print("evaluation gather:", results["gather"], flush=True)
    results["cpu"] = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name")), "unknown")
    results["cores"] = len(os.sched_getaffinity(0))
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
