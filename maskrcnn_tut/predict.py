"""Run a trained model on new images: `python -m maskrcnn_tut.predict --checkpoint CKPT IMAGES... --out DIR`
(or under `torchrun --nproc_per_node=N`: the images are split over the ranks, results gathered on rank 0).

The model is rebuilt at the settings the checkpoint was trained with (its saved config). Outputs:
`detections.json`, COCO results (category ids of the training json, XYWH boxes, RLE masks) that
`pycocotools`' `COCO.loadRes` reads and `COCOeval` scores; `images.json`, each image's path and id
(an image listed in the checkpoint's val json by file name keeps that id, so its results can be
scored; others are numbered after them); and `overlays/`, each image with its detections drawn
(unless `--no-overlays`). An image that cannot be used (unreadable, truncated, a few pixels, a
strip, a decompression bomb) is skipped and counted, never stopping the run; an --out that cannot be
written is one line; JSON files are written whole and renamed into place, so an interrupted run
leaves the previous complete file, never half of one. SIGTERM or SIGUSR1 (a scheduler's, or torchrun's
passing one on) ends every process after its current batch: detections.json and images.json then
hold the images predicted by then, and the run ends with one line, exit 143; a rerun predicts them all.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.transforms.v2 import functional as F
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import distributed as du
from . import overlay
from .atomic import atomic_write
from .config import Config, derive
from .data.clean import category_labels, load_coco_json, resize_fails
from .data.coco import read_rgb
from .data.loader import collate, dataset_paths, iterate, to_device
from .errors import ConfigError, DataError, OutputError, Preempted
from .evaluate import gather_results, to_coco_results
from .flags import add_flags
from .preemption import StopRequest

log = logging.getLogger("maskrcnn_tut.predict")

#: What a folder is searched for (a file named on the command line is tried whatever its suffix).
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
#: An image with a side under this many pixels is not a photo of objects: skipped as too_small.
MIN_SIDE = 8
#: Skipped images whose reason is logged one by one; later ones are counted only.
LOGGED_SKIPS = 5
#: A single process rewrites detections.json and images.json every this many batches (a long run keeps what it did).
SAVE_EVERY = 50


@dataclasses.dataclass(frozen=True)
class Item:
    """One input image: where it is, the id its results carry, and its overlay's file name."""

    path: Path
    image_id: int
    overlay_name: str


def find_images(inputs: list[str]) -> list[Path]:
    """The files named, and the images under each folder named (sorted, recursive), once each."""
    found: dict[Path, None] = {}
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            images = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not images:
                raise DataError(f"{name}: no images in this folder (looked for {', '.join(sorted(IMAGE_SUFFIXES))})")
            found.update(dict.fromkeys(images))
        elif path.is_file():
            found[path] = None
        else:
            raise DataError(f"{name}: no such file or directory")
    return list(found)


def val_index(cfg: Config, num_classes: int) -> tuple[dict[int, int], dict[str, int]]:
    """({label: category id}, {file name: image id}) from the val json the checkpoint was trained
    with; without it, labels stand for categories and every image is numbered."""
    fallback = {label: label for label in range(1, num_classes)}, {}
    try:
        data = load_coco_json(dataset_paths(cfg, "val")[1])
    except (DataError, TypeError) as err:
        log.warning("the checkpoint's val json cannot be read (%s): category ids are the model's labels 1..%d "
                    "and images are numbered", str(err)[:200], num_classes - 1)
        return fallback
    _, cat_to_label = category_labels(data["categories"])
    if len(cat_to_label) != num_classes - 1:
        log.warning("the val json has %d categories, the model %d: category ids are the model's labels",
                    len(cat_to_label), num_classes - 1)
        return fallback
    ids = {Path(str(im.get("file_name"))).name: im["id"] for im in data["images"] if isinstance(im.get("id"), int)}
    return {label: cat for cat, label in cat_to_label.items()}, ids


def plan(paths: list[Path], known_ids: dict[str, int]) -> list[Item]:
    """Each image with its id (the val json's by file name, else numbered after the largest used)
    and an overlay name (its own, or with its id when two inputs share a name)."""
    known = {known_ids[p.name] for p in paths if p.name in known_ids}
    next_id, items, names, assigned = max(known, default=0) + 1, [], set(), set()
    for path in paths:
        image_id = known_ids.get(path.name)
        if image_id is None or image_id in assigned:  # a second file of the same name is another image
            image_id, next_id = next_id, next_id + 1
        assigned.add(image_id)
        suffix = ".png" if path.suffix.lower() == ".png" else ".jpg"
        name = path.stem + suffix if path.stem + suffix not in names else f"{path.stem}_{image_id}{suffix}"
        names.add(name)
        items.append(Item(path, image_id, name))
    return items


def read_image(path: Path, min_size: int, max_size: int) -> tuple[torch.Tensor | None, str]:
    """(uint8 CHW RGB image, "") or (None, why it is skipped). An image over PIL's decompression-bomb
    limit is skipped before it is decoded: a few KB of PNG can hold gigapixels."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = F.pil_to_tensor(read_rgb(path))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        return None, f"too_large ({str(err).split(', could')[0]})"
    except Exception as err:  # noqa: BLE001 - any file content: corrupt, truncated, not an image
        return None, f"unreadable ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})"
    height, width = image.shape[-2:]
    if min(height, width) < MIN_SIDE:
        return None, f"too_small ({width}x{height} px)"
    if resize_fails([width], [height], min_size, max_size)[0]:
        return None, f"extreme_aspect ({width}x{height} px)"
    return image, ""


class ImageFiles(Dataset):
    """This rank's images, decoded in DataLoader workers; a failure is a reason, not an exception."""

    def __init__(self, items: list[Item], min_size: int, max_size: int):
        self.items, self.min_size, self.max_size = items, min_size, max_size

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return (self.items[index], *read_image(self.items[index].path, self.min_size, self.max_size))


def postprocess_unpasted(transform, result: list[dict], image_shapes, original_image_sizes) -> list[dict]:
    """torchvision's post-processing (boxes scaled back to each image) with the masks left at the model's
    28x28 beside their image's size, for `evaluate.binary_masks` to paste one at a time: torchvision
    pastes them all as float32 (a 12-megapixel photo's 100 detections: 5 GB, and twice that to stack)."""
    small = [pred.pop("masks", None) for pred in result]
    result = GeneralizedRCNNTransform.postprocess(transform, result, image_shapes, original_image_sizes)
    for pred, masks, size in zip(result, small, original_image_sizes):
        if masks is not None:
            pred["masks"], pred["image_size"] = masks, tuple(size)
    return result


def write_json(obj, path: Path) -> None:
    """Write whole, then rename into place (`atomic.atomic_write`): readers see the previous file or the new one."""
    atomic_write(path, lambda f: json.dump(obj, f), mode="w")


def out_error(out: Path, err: OSError, name_file: bool = True) -> OutputError:
    """An OSError writing under --out as one line naming the folder, the file and what to do."""
    rank = f"rank {du.info().rank}: " if du.info().world_size > 1 else ""
    what = f" {err.filename}" if err.filename and name_file else " there"
    advice = "free space there or give another --out" if err.errno == errno.ENOSPC else \
        "give a folder this process can write to"
    return OutputError(f"{rank}--out {out}: cannot write{what} ({err.strerror or err}); {advice}")


@contextlib.contextmanager
def writing(out: Path, name_file: bool = True):
    """Within, an OSError (a read-only or full disk) is `out_error`'s one line."""
    try:
        yield
    except OSError as err:
        raise out_error(out, err, name_file) from None


def prepare_out(out: Path) -> None:
    """--out made and a file written in it, before any image is read."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file, not a folder; give a folder for the outputs")
    with writing(out, name_file=False):
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out) as probe:
            probe.write(b"0")
            probe.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="[torchrun --nproc_per_node=N] python -m maskrcnn_tut.predict",
        description="Detect and segment objects in images with a train.py checkpoint; write COCO results "
                    "(detections.json), the image ids (images.json) and overlays.")
    parser.add_argument("inputs", nargs="+", metavar="IMAGES_OR_DIRS", help="image files and folders (searched recursively)")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint train.py wrote (e.g. RUN/checkpoints/last.pt)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--score-threshold", type=float, default=0.05,
                        help="keep detections scoring above this (default 0.05, as COCO evaluation does)")
    parser.add_argument("--overlay-threshold", type=float, default=0.5,
                        help="draw detections scoring at least this on the overlays (default 0.5)")
    parser.add_argument("--max-detections", type=int, default=100, help="detections kept per image (default 100)")
    parser.add_argument("--batch-size", type=int, default=2, help="images per forward pass per process (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="decoding worker processes per process (default 2)")
    parser.add_argument("--no-overlays", action="store_true", help="write only the JSON files")
    add_flags(parser, ["accelerator"], show_defaults=False)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def check_args(args: argparse.Namespace) -> None:
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--max-detections", args.max_detections, 1),
                             ("--workers", args.workers, 0)):
        if value < low:
            raise ConfigError(f"{flag} {value}: must be at least {low}")
    for flag, value in (("--score-threshold", args.score_threshold), ("--overlay-threshold", args.overlay_threshold)):
        if not 0 <= value <= 1:
            raise ConfigError(f"{flag} {value}: a score threshold is between 0 and 1")
    if not Path(args.checkpoint).is_file():
        raise ConfigError(f"--checkpoint {args.checkpoint}: no such file")


def predict_shard(model, loader: DataLoader, run_facts, label_to_cat: dict[int, int], class_names: list[str],
                  args: argparse.Namespace, out: Path, progress: bool,
                  stop: StopRequest | None = None) -> tuple[list[dict], list[int], Counter]:
    """This rank's (COCO results, ids of the images predicted, skips by reason), overlays written as it
    goes, until its images are done or `stop` is asked; a single process also rewrites detections.json
    and images.json every `SAVE_EVERY` batches."""
    results, done, skipped = [], [], Counter()
    device = run_facts.device
    batches = tqdm(iterate(loader), desc="predict", unit="batch", total=len(loader), disable=not progress)
    for batch_number, columns in enumerate(batches, 1):
        if stop is not None and stop.cause:
            break
        batch = list(zip(*columns))  # (item, image or None, reason) each
        for item, _, reason in (entry for entry in batch if entry[1] is None):
            skipped[reason.split(" ")[0]] += 1
            if sum(skipped.values()) <= LOGGED_SKIPS:
                later = "; later skips are only counted, in the summary" if sum(skipped.values()) == LOGGED_SKIPS else ""
                log.warning("skipped %s: %s%s", item.path, reason, later)
        readable = [(item, image) for item, image, _ in batch if image is not None]
        if not readable:
            continue
        images, _ = to_device([image for _, image in readable], [], device)
        outputs = model(images)  # fp32, as evaluate scores (autocast would round the decoded boxes)
        ids = [item.image_id for item, _ in readable]
        results.extend(to_coco_results(outputs, ids, label_to_cat))
        done.extend(ids)
        if not args.no_overlays:
            for (item, image), output in zip(readable, outputs):
                with writing(out):
                    overlay.save(overlay.draw(image, output, class_names, args.overlay_threshold),
                                 out / "overlays" / item.overlay_name)
        if run_facts.world_size == 1 and batch_number % SAVE_EVERY == 0:
            write_outputs(out, loader.dataset.items, results, done)
    return results, done, skipped


def write_outputs(out: Path, items: list[Item], results: list[dict], ids: list[int]) -> None:
    """detections.json, then images.json of the same images, each written whole (`write_json`)."""
    predicted = set(ids)
    with writing(out):
        write_json(results, out / "detections.json")
        write_json({str(item.path): item.image_id for item in items if item.image_id in predicted}, out / "images.json")


def run(args: argparse.Namespace) -> dict | None:
    """Predict this rank's share of the images; rank 0 writes the outputs and returns a summary. A stop
    signal (SIGTERM, SIGUSR1, the end of torchrun) ends each rank's loop after its batch; rank 0 writes the
    images predicted by then and every rank raises `Preempted` (one line, exit 143)."""
    with StopRequest() as stop:
        info = du.init_distributed(accelerator=args.accelerator or "auto")
        device = info.device
        paths = find_images(args.inputs)
        model, cfg, saved, step = ckpt.model_from_checkpoint(args.checkpoint)
        model.roi_heads.score_thresh, model.roi_heads.detections_per_img = args.score_threshold, args.max_detections
        model.transform.postprocess = functools.partial(postprocess_unpasted, model.transform)
        model.to(device)
        label_to_cat, known_ids = val_index(cfg, saved["num_classes"])
        items = plan(paths, known_ids)
        out = Path(args.out)
        prepare_out(out)
        if info.is_main:
            log.info("%s (step %s, %s, %d classes, %d/%d px): %d images on %d process(es)", args.checkpoint, step,
                     cfg.backbone, saved["num_classes"] - 1, cfg.min_size, cfg.max_size, len(items), info.world_size)
        shard = ImageFiles(items[info.rank::info.world_size], cfg.min_size, cfg.max_size)
        loader = DataLoader(shard, batch_size=args.batch_size, num_workers=args.workers, collate_fn=collate)  # packs
        started = time.perf_counter()
        with torch.inference_mode():
            results, done, skipped = predict_shard(model, loader, derive(cfg, info.world_size, device), label_to_cat,
                                                   saved["class_names"], args, out,
                                                   info.is_main and not args.no_progress, stop)
        seconds = time.perf_counter() - started
        gathered = gather_results(results, done)
        shards = du.all_gather_objects((dict(skipped), len(done), stop.cause))
        if gathered is not None:
            write_outputs(out, items, *gathered)
    predicted, cause = sum(n for _, n, _ in shards), next((c for *_, c in shards if c), None)
    if cause and predicted + sum(sum(s.values()) for s, _, _ in shards) < len(items):
        raise Preempted(f"stopped {cause} after predicting {predicted} of {len(items)} images: detections.json and "
                        f"images.json in {out} hold those {predicted}; rerun to predict them all")
    if gathered is None:
        return None
    counts = sum((Counter(s) for s, _, _ in shards), Counter())
    summary = {"images": predicted, "detections": len(gathered[0]), "skipped": dict(counts),
               "seconds": round(seconds, 2), "img_per_s": round(predicted / max(seconds, 1e-9), 2)}
    print(f"predicted {summary['images']} images ({summary['detections']} detections) in {summary['seconds']} s, "
          f"{summary['img_per_s']} img/s on {info.world_size} process(es); skipped "
          f"{', '.join(f'{k} {v}' for k, v in counts.items()) or 'none'}; outputs in {out}")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Exit codes (`distributed.run_cli`): 0 done; 2 bad arguments, inputs or checkpoint; 4 another rank failed;
    143 stopped by SIGTERM, SIGUSR1 or the end of torchrun (the images predicted by then are written)."""
    def body() -> None:
        args = build_parser().parse_args(argv)
        check_args(args)
        run(args)

    return du.run_cli(body, kept="the files already in --out are whole; rerun to predict every image")


if __name__ == "__main__":
    sys.exit(main())
