"""After the course (chapter 12): what a user does with `train.py` and `predict` on photos of their own.

- `run_cli(main, prog, argv)`: print the command a user types, run the same entry point in this process.
- `overfit_images(cfg, n)`, `losses(run_dir)`, `overfit_check(...)`: the overfit check's images, its
  loss curve and its verdict.
- `predict_images(argv)`: `python -m maskrcnn_tut.predict` in this process, returning its summary.
- `coco_scores(gt_json, results_json)`: a results JSON scored by pycocotools, as any COCO tool reads it.
- `explain_result(result, gt_json)`, `check_results(out_dir, gt_json)`: one detection of the results JSON,
  field by field; what another tool relies on in it, checked.
- `show_overlays(folder, names)`: predict's overlay images in a grid.
- `torchvision_files(folder)`, `weights_report(cfg, num_classes)`, `weights_checks(...)`: state dicts shaped
  as torchvision's (built here with random values: nothing downloads), what `--weights` /
  `--weights-backbone` load from them, and what the loaded model must be.

What these functions say comes from `prose/after_course.json`, in the book's language (`wording.say`).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import shlex
from pathlib import Path
from typing import Callable, Sequence

import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from .. import distributed as du
from .. import predict
from ..config import Config
from ..data.loader import build_dataset
from ..evaluate import coco_metrics
from ..model import build_model
from ..monitor import read_jsonl
from .book_fonts import fit_titles
from .wording import say

#: The overfit check passes when the last logged loss is at most this fraction of the first.
OVERFIT_LOSS_RATIO = 0.5
#: The fields of a COCO results entry (the format `predict` writes and `COCO.loadRes` reads); what
#: each means is entry `meaning_<field>` of `prose/after_course.json`.
#: Each field of a detections.json entry, with the catalog key of what it means.
RESULT_FIELDS = {"image_id": "after_course.meaning_image_id", "category_id": "after_course.meaning_category_id",
                 "bbox": "after_course.meaning_bbox", "score": "after_course.meaning_score",
                 "segmentation": "after_course.meaning_segmentation"}


def run_cli(main: Callable[[list[str]], int], prog: str, argv: Sequence) -> None:
    """Print `prog argv` as a shell line, then call the entry point `main` with the same arguments in
    this process (no interpreter start-up per command); raise when it exits non-zero."""
    args = [str(a) for a in argv]
    print(f"$ {prog} {shlex.join(args)}", flush=True)
    code = main(args)
    if code:
        raise RuntimeError(say("after_course.exited", prog=prog, code=code))


def overfit_images(cfg: Config, count: int) -> list[Path]:
    """The files of the first `count` training images: the ones `train.py --overfit count` memorizes."""
    dataset = build_dataset(cfg, "train").first(count)
    return [dataset.image_dir / image["file_name"] for image in dataset.images]


def predict_images(argv: Sequence) -> dict:
    """`python -m maskrcnn_tut.predict ARGV` in this process (printed as typed); returns its summary
    (images, detections, skipped, seconds, img_per_s)."""
    args = [str(a) for a in argv]
    print(f"$ python -m maskrcnn_tut.predict {shlex.join(args)}", flush=True)
    parsed = predict.build_parser().parse_args(args)
    predict.check_args(parsed)
    try:
        return predict.run(parsed)
    finally:
        du.shutdown()


def losses(run_dir: Path | str) -> tuple[list[int], list[float]]:
    """(steps, training losses) as train.py logged them in `metrics.jsonl`."""
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def overfit_check(loss_values: Sequence[float], ratio: float = OVERFIT_LOSS_RATIO) -> dict:
    """Whether the loss on a handful of images fell to `ratio` of where it began: a pipeline whose
    data, labels or loss are broken cannot memorize even a few images."""
    if len(loss_values) < 2:
        raise ValueError(say("after_course.two_losses"))
    first, last = float(loss_values[0]), float(loss_values[-1])
    return {"first": first, "last": last, "ratio": last / first, "passed": last <= ratio * first}


def coco_scores(gt_json: Path | str, results_json: Path | str, image_ids: Sequence[int] | None = None) -> dict:
    """AP and AP50 (0-1) for boxes and masks of a results JSON against a COCO annotation json, with
    pycocotools as any COCO tool runs it; `image_ids` restricts the evaluation to those images."""
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints as it goes
        gt = COCO(str(gt_json))
    metrics = coco_metrics(gt, json.loads(Path(results_json).read_text()), image_ids)
    return {f"{kind} {name}": metrics[f"{kind}_{name}"] for kind in ("bbox", "segm") for name in ("AP", "AP50")}


def explain_result(result: dict, gt_json: Path | str) -> list[dict]:
    """One results entry as rows (field, value, meaning), its category named from the annotation json
    and its mask decoded (pixels, and whether they lie inside its box)."""
    names = {c["id"]: c["name"] for c in json.loads(Path(gt_json).read_text())["categories"]}
    rows = []
    for field in RESULT_FIELDS:
        value = result[field]
        if field == "category_id":
            value = f"{value} ({names[value] if value in names else say('after_course.not_in_json')})"
        elif field == "segmentation":
            mask = mask_utils.decode(value)
            value = say("after_course.mask", size=value["size"], counts=value["counts"][:16], pixels=int(mask.sum()))
        rows.append({"field": field, "value": value, "meaning": say(RESULT_FIELDS[field])})
    return rows


def check_results(out_dir: Path | str, gt_json: Path | str) -> dict[str, bool]:
    """What another tool relies on in predict's output folder, each a yes or no: pycocotools reads
    detections.json, its images are the ones images.json lists, its classes are the json's
    categories, and each mask is [height, width] of its image as the file on disk has it."""
    from PIL import Image
    out = Path(out_dir)
    results = json.loads((out / "detections.json").read_text())
    sizes = {}
    for path, image_id in json.loads((out / "images.json").read_text()).items():
        with Image.open(path) as image:
            sizes[image_id] = [image.height, image.width]
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(gt_json))
        try:
            read = not results or len(gt.loadRes(results).getAnnIds()) == len(results)
        except Exception:  # noqa: BLE001 - whatever pycocotools raises on a bad file
            read = False
    return {"pycocotools' loadRes reads detections.json": read,
            "every detection's image is listed in images.json": all(r["image_id"] in sizes for r in results),
            "every category_id is one of the training json's": {r["category_id"] for r in results} <= set(gt.getCatIds()),
            "every mask has its image's height and width": all(r["segmentation"]["size"] == sizes.get(r["image_id"])
                                                                for r in results)}


def show_overlays(folder: Path | str, names: Sequence[str], title: str, columns: int = 4):
    """The overlay images `predict` wrote into `folder`, in a grid with their file names."""
    import matplotlib.pyplot as plt
    from PIL import Image
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.7 * rows), squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    for ax, name in zip(axes.flat, names):
        ax.imshow(Image.open(Path(folder) / name))
        ax.set_title(name, fontsize=8)
    fig.suptitle(title)
    return fit_titles(fig)


def torchvision_files(folder: Path | str) -> dict[str, Path]:
    """State dicts shaped exactly as torchvision's pretrained files (its builders with weights=None, so
    random values): Mask R-CNN R50-FPN v1 for `--weights`, ResNet-18 for `--weights-backbone`."""
    from torchvision.models import resnet18
    from torchvision.models.detection import maskrcnn_resnet50_fpn
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"maskrcnn_resnet50_fpn": folder / "maskrcnn_resnet50_fpn.pt", "resnet18": folder / "resnet18.pt"}
    torch.save(maskrcnn_resnet50_fpn(weights=None, weights_backbone=None).state_dict(), files["maskrcnn_resnet50_fpn"])
    torch.save(resnet18().state_dict(), files["resnet18"])
    return files


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def weights_report(cfg: Config, num_classes: int) -> tuple[torch.nn.Module, list[str]]:
    """The model train.py builds for `cfg` (its --weights / --weights-backbone loaded) and the lines
    the loading logged: what was loaded, re-initialised and ignored."""
    logger = logging.getLogger("maskrcnn_tut.model")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = build_model(cfg, num_classes)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return model, handler.lines


def weights_checks(model: torch.nn.Module, path: Path | str, num_classes: int) -> dict[str, bool]:
    """What `--weights` promises for a torchvision Mask R-CNN file, each a yes or no: the backbone,
    FPN and RPN are the file's, the class layers have this dataset's outputs, BatchNorm is frozen.
    Each check is worded in the book's language (the chapter prints them; no code reads them back)."""
    from torchvision.ops import FrozenBatchNorm2d
    source = torch.load(path, map_location="cpu", weights_only=True)
    own = model.state_dict()
    kept = [k for k in own if k.startswith(("backbone.", "rpn.")) and not k.endswith("num_batches_tracked")]
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.BatchNorm2d, FrozenBatchNorm2d))]
    scores = "roi_heads.box_predictor.cls_score.weight"
    return {say("after_course.weights_kept"): all(torch.equal(own[k], source[k]) for k in kept),
            say("after_course.weights_classes", classes=num_classes, file=source[scores].shape[0]):
                own[scores].shape[0] == num_classes,
            say("after_course.weights_frozen"): bool(norms) and all(isinstance(m, FrozenBatchNorm2d) for m in norms)}

