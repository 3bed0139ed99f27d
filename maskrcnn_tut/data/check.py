"""Validate a COCO dataset before training: `python -m maskrcnn_tut.data.check --data-path ROOT`.

Runs the checks training runs at start-up (`maskrcnn_tut.data.clean`'s rules, through
`CocoDetection`) on each split, for a model resizing to the preset's --min-size/--max-size (the
preset the hardware picks, or `--preset`), and prints a table per split: how many of each problem
kind, example ids, and what training will do about them. Exit code 0 when training can use the data
(after the repairs listed); on bad settings or a split that leaves nothing to train on or
evaluate, one line `error: ...` and the error's exit code (2).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from ..config import Config, validate
from ..errors import UserError, print_error
from ..flags import add_flags, config_from
from .coco import CocoDetection
from .loader import dataset_paths

SPLITS = ("train", "val")
#: The settings that decide what the check finds: where the data is, and the model's resize.
FLAGS = ("data_path", "train_json", "train_images", "val_json", "val_images", "preset", "min_size", "max_size")


def check_split(cfg: Config, split: str, verify_pixels: bool = False) -> CocoDetection:
    """Clean `split` as training does (train drops images without annotations, val keeps them),
    for a model resizing to `cfg`'s sizes. Always a fresh scan: no cached records are read or written."""
    image_dir, ann_file = dataset_paths(cfg, split)
    return CocoDetection(image_dir, ann_file, train=split == "train", verify_pixels=verify_pixels,
                         min_size=cfg.min_size, max_size=cfg.max_size)


def format_report(split: str, dataset: CocoDetection, example_width: int = 28) -> str:
    """A fixed-width table of `dataset.report` under a line naming the split and what is usable."""
    instances = dataset.num_instances
    lines = [f"{split}: {dataset.ann_file}: {len(dataset)} usable images, {instances} instances, "
             f"{len(dataset.categories)} categories"]
    rows = dataset.report.rows()
    if not rows:
        return "\n".join(lines + ["  no problems found"])
    kind_width = max(len("problem"), *(len(kind) for kind, *_ in rows))
    lines.append(f"  {'problem':<{kind_width}}  {'count':>6}  {'example ids':<{example_width}}  training will")
    for kind, count, examples, action in rows:
        if len(examples) > example_width:
            examples = examples[: example_width - 3] + "..."
        lines.append(f"  {kind:<{kind_width}}  {count:>6}  {examples:<{example_width}}  {action}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m maskrcnn_tut.data.check",
        description="Report every problem training would repair or drop in a COCO dataset, per split: give "
                    "--data-path ROOT (or --train-json and --val-json).")
    add_flags(parser, FLAGS)
    parser.add_argument("--verify-pixels", action="store_true",
                        help="decode every image fully (slower; finds corrupt data inside files of any format)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.data_path and not args.train_json:
        print_error("give --data-path ROOT (or --train-json and --val-json)")
        return 2
    try:
        cfg = config_from(args)
        validate(dataclasses.replace(cfg, amp=False, amp_dtype=None), cuda_available=False)  # no model runs here
        print(f"checking for a model that resizes to --min-size {cfg.min_size} --max-size {cfg.max_size} "
              f"(preset {cfg.preset})", end="\n\n")
        for split in SPLITS:
            print(format_report(split, check_split(cfg, split, args.verify_pixels)), end="\n\n")
    except UserError as err:  # bad settings or data; anything else is a bug and keeps its traceback
        print_error(str(err))
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
