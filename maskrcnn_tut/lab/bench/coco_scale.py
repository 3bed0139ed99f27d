"""COCO-scale benchmark of the data pipeline: `python -m maskrcnn_tut.lab.bench.coco_scale --out /tmp/cocoscale`.

Writes a dataset of COCO train2017's shape (118,287 images, 860,001 instances as polygons with
COCO's point counts, ~1 % crowd regions as uncompressed RLE, a json of COCO's size) whose image
files are tiny (flat JPEGs of COCO's real sizes, ~5 KB each), then measures, each in a fresh
process so the figures are not mixed up:

- start-up: seconds until `CocoDetection` is ready to train, the first time (cleaning every
  image and annotation) and once its cleaned records are cached, with N ranks starting together;
- memory: resident MB the dataset adds to a training process (after start-up, and at the peak);
- workers: private MB each of 4 DataLoader workers holds after reading 1 and 3 epochs' share of
  records, after a full garbage collection in the worker, and while decoding real batches;
- evaluation: seconds and MB to gather 5k images' detections across 2 ranks (gloo).

The dataset is written once and reused (`--out`); `--skip` leaves phases out. Figures are printed
and written to `<out>/results.json`. Wall times depend on what else runs on the machine: the
start-up figures carry the CPU seconds and the load average they were measured at.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

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


def _rss_mb(pid: int | str = "self") -> dict[str, float]:
    """rss, pss and uss (private) MB of a process, from /proc/PID/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) / 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"],
            "uss": fields["Private_Clean"] + fields["Private_Dirty"]}


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the forked cleaners)."""
    import resource
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def _peak_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _open_dataset(out: Path, cache_dir: str | None):
    """The train split as training builds it (whatever the CocoDetection's version takes)."""
    from maskrcnn_tut.data.coco import CocoDetection

    kwargs = dict(train=True)
    params = inspect.signature(CocoDetection).parameters
    if "min_size" in params:
        kwargs.update(min_size=800, max_size=1333)
    if "cache_dir" in params:
        kwargs.update(cache_dir=cache_dir)
    return CocoDetection(out / "train2017", out / "annotations" / "instances_train2017.json", **kwargs)


def child_startup(out: Path, cache_dir: str | None) -> dict:
    import gc

    import torch  # noqa: F401  (a training process has it loaded: not the dataset's memory)

    import maskrcnn_tut.data.loader  # noqa: F401

    gc.collect()
    before = _rss_mb()
    cpu = _cpu_s()
    started = time.perf_counter()
    dataset = _open_dataset(out, cache_dir)
    ready = time.perf_counter() - started
    cpu = _cpu_s() - cpu
    gc.collect()
    after = _rss_mb()
    return {"ready_s": round(ready, 1), "cpu_s": round(cpu, 1), "load_avg": round(os.getloadavg()[0], 1),
            "images": len(dataset), "dataset_rss_mb": round(after["rss"] - before["rss"]),
            "dataset_uss_mb": round(after["uss"] - before["uss"]), "peak_rss_mb": round(_peak_mb() - before["rss"]),
            "problems": dict(dataset.report.counts)}


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


def child_workers(out: Path, cache_dir: str | None, workers: int, decode_batches: int) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from maskrcnn_tut.data.loader import collate

    dataset = _open_dataset(out, cache_dir)
    figures = {"main_rss_mb": round(_rss_mb()["rss"])}
    batches = _Batches(len(dataset), workers)
    touch = DataLoader(_Touch(dataset), batch_sampler=batches, num_workers=workers, persistent_workers=True)
    uss = lambda: [round(_rss_mb(w.pid)["uss"]) for w in touch._iterator._workers]  # noqa: E731
    started = time.perf_counter()
    for epoch in range(3):
        for _ in touch:
            pass
        if epoch == 0:
            figures["touch_epoch_s"] = round(time.perf_counter() - started, 1)
            figures["worker_uss_mb_after_1_epoch"] = uss()
    figures["worker_uss_mb_after_3_epochs"] = uss()
    batches.collect = True
    for _ in touch:
        pass
    figures["worker_uss_mb_after_full_gc"] = uss()
    del touch
    loader = DataLoader(dataset, batch_size=2, num_workers=workers, collate_fn=collate, persistent_workers=True,
                        sampler=torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(1)))
    started = time.perf_counter()
    for k, _ in enumerate(loader):
        if k + 1 == decode_batches:
            break
    figures["decode_img_per_s"] = round(2 * decode_batches / (time.perf_counter() - started), 1)
    figures["worker_uss_mb_decoding"] = [round(_rss_mb(w.pid)["uss"]) for w in loader._iterator._workers]
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


def _gather_worker(rank: int, world: int, port: int, n_images: int, per_image: int, queue) -> None:
    import torch.distributed as dist

    from maskrcnn_tut import distributed as du

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results, ids = _fake_results(rank, world, n_images, per_image)
    made = _rss_mb()["rss"]
    dist.barrier()
    started = time.perf_counter()
    try:
        from maskrcnn_tut.evaluate import gather_results
        gathered = gather_results(results, ids)
        total = len(gathered[0]) if gathered else 0
    except ImportError:  # an earlier version: the lists of dicts themselves
        gathered = du.all_gather_objects((results, ids))
        total = sum(len(r) for r, _ in gathered)
    elapsed = time.perf_counter() - started
    queue.put({"rank": rank, "gather_s": round(elapsed, 1), "detections": total,
               "peak_rss_mb": round(_peak_mb()), "results_made_rss_mb": round(made)})
    dist.destroy_process_group()


def child_gather(n_images: int, per_image: int, world: int = 2) -> dict:
    import torch.multiprocessing as mp

    from maskrcnn_tut.lab.processes import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gather_worker, args=(r, world, port, n_images, per_image, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    ranks = sorted((queue.get(timeout=600) for _ in procs), key=lambda f: f["rank"])
    for p in procs:
        p.join()
    return {"eval_images": n_images, "detections": ranks[0]["detections"],
            "gather_s": max(f["gather_s"] for f in ranks),
            "rank_peak_rss_mb": [f["peak_rss_mb"] for f in ranks],
            "rank_rss_before_gather_mb": [f["results_made_rss_mb"] for f in ranks]}


def _child(phase: str, out: Path, *args) -> dict:
    """Run one measurement in a fresh interpreter; its figures come back as json on stdout."""
    code = (f"import json, sys; from pathlib import Path; from maskrcnn_tut.data import scale; "
            f"print(json.dumps(scale.child_{phase}(Path({str(out)!r}), *{args!r})))")
    if phase == "gather":
        code = f"import json; from maskrcnn_tut.data import scale; print(json.dumps(scale.child_gather(*{args!r})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the {phase} measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ranks_together(out: Path, cache_dir: str, ranks: int) -> dict:
    """`ranks` processes opening the dataset at once (as torchrun starts them): the slowest's time."""
    code = ("import json; from pathlib import Path; from maskrcnn_tut.data import scale; "
            f"print(json.dumps(scale.child_startup(Path({str(out)!r}), {cache_dir!r})))")
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(ranks)]
    figures = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"error: a rank failed:\n{stderr[-3000:]}")
        figures.append(json.loads(stdout.strip().splitlines()[-1]))
    return {"ranks": ranks, "all_ready_s": round(time.perf_counter() - started, 1),
            "rank_ready_s": [f["ready_s"] for f in figures],
            "rank_dataset_rss_mb": [f["dataset_rss_mb"] for f in figures]}


def main(argv: list[str] | None = None) -> int:
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
        results["first_start"] = _child("startup", args.out, cache)
        print("first start:", results["first_start"], flush=True)
        if cache:
            results["cached_start"] = _child("startup", args.out, cache)
            print("cached start:", results["cached_start"], flush=True)
    if "ranks" not in args.skip and cache:
        shutil.rmtree(cache, ignore_errors=True)
        results["ranks_first_start"] = _ranks_together(args.out, cache, args.ranks)
        print("ranks starting together:", results["ranks_first_start"], flush=True)
    if "workers" not in args.skip:
        results["workers"] = _child("workers", args.out, cache, args.workers, 50)
        print("workers:", results["workers"], flush=True)
    if "gather" not in args.skip:
        results["gather"] = _child("gather", args.out, args.eval_images, args.detections)
        print("evaluation gather:", results["gather"], flush=True)
    results["cpu"] = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name")), "unknown")
    results["cores"] = len(os.sched_getaffinity(0))
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
