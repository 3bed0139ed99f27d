"""`python -m maskrcnn_tut.lab.bench NAME [--out FILE] [--plot PNG]`: the speed table, a sweep, or the GPU suite.

A `UserError` (bad settings, no GPU for the suite, a benchmark worker that failed) prints as one
line, `error: <message>`, and exits with its code; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from ...errors import UserError, print_error
from ...flags import add_flags
from .accuracy import time_to_accuracy
from .gpu import gpu_suite
from .overhead import overhead
from .pipeline import pipeline, workers_alone
from .scaling import CPU_TABLE_BATCH, table
from .sweeps import SWEEPS

#: train.py's flags every benchmark takes (`flags.add_flags`), and the benchmark's own options.
SETTINGS = ("preset", "data_path", "batch_size", "min_size", "max_size")
OPTIONS = (*SETTINGS, "steps", "warmup", "nprocs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m maskrcnn_tut.lab.bench",
        description="Measure the article's speed table and the technique sweeps on this machine. Settings "
                    "not given are the preset's, except where a benchmark picks its own (the table on CPUs: "
                    f"--batch-size {CPU_TABLE_BATCH}).")
    parser.add_argument("--suite", choices=["gpu"], help="one bounded run of everything on a GPU machine")
    parser.add_argument("--max-minutes", type=float, default=8.0, help="time budget of --suite gpu")
    parser.add_argument("--results-dir", default="book/results", help="where --suite gpu writes its JSON")
    parser.add_argument("--parts", help="with --suite gpu: only these parts, comma-separated (table, amp, cudnn, "
                                        "channels_last, fast_path, fast_path_compiled); the day's file keeps the others")
    commands = parser.add_subparsers(dest="command", metavar="NAME")
    common = argparse.ArgumentParser(add_help=False)
    add_flags(common, SETTINGS, show_defaults=False)
    common.add_argument("--steps", type=int, help="measured steps (after warm-up)")
    common.add_argument("--warmup", type=int, help="warm-up steps, not measured")
    common.add_argument("--out", help="write the result as JSON to this file")
    common.add_argument("--plot", help="save the result's plot to this image file")
    table_cmd = commands.add_parser("table", parents=[common], help="Single / DP(N) / DDP(N) speed table")
    table_cmd.add_argument("--nprocs", type=int, help="N (default: GPUs present, else CPU cores)")
    for name, sweep in SWEEPS.items():
        commands.add_parser(name, parents=[common], help=sweep.__doc__.splitlines()[0])
    overhead_cmd = commands.add_parser("overhead", parents=[common], help=overhead.__doc__.splitlines()[0])
    overhead_cmd.add_argument("--image-size", type=int, help="square synthetic images of this side (default: min size)")
    overhead_cmd.add_argument("--rounds", type=int, help="alternating rounds of the three loops")
    add_flags(overhead_cmd, ("amp",), show_defaults=False)
    pipeline_cmd = commands.add_parser("pipeline", parents=[common], help=pipeline.__doc__.splitlines()[0])
    pipeline_cmd.add_argument("--rounds", type=int, help="rounds of the loop's steps, each repeated bare")
    add_flags(pipeline_cmd, ("amp", "workers"), show_defaults=False)
    alone_cmd = commands.add_parser("workers", parents=[common], help=workers_alone.__doc__.splitlines()[0])
    alone_cmd.add_argument("--repeats", type=int, help="measurements, one row each")
    add_flags(alone_cmd, ("workers",), show_defaults=False)
    accuracy_cmd = commands.add_parser("time-to-accuracy", help=time_to_accuracy.__doc__.splitlines()[0])
    accuracy_cmd.add_argument("--metric", default="segm_AP50", help="an evaluation key (default: segm_AP50)")
    accuracy_cmd.add_argument("--target", type=float, default=0.90, help="the value to reach (default: 0.90)")
    accuracy_cmd.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (default: 50)")
    accuracy_cmd.add_argument("--nprocs", type=int, default=2, help="torchrun processes (default: 2, the main job)")
    accuracy_cmd.add_argument("--variant", action="append", metavar="FLAGS",
                              help="train.py flags of a variant to run after eager, e.g. --variant='--fixed-shapes' "
                                   "(repeatable; default: the fast path's three flags)")
    accuracy_cmd.add_argument("--out", help="write the result as JSON to this file")
    accuracy_cmd.add_argument("--plot", help="save the result's plot to this image file")
    return parser


def run(args: argparse.Namespace, command: str) -> int:
    if args.suite == "gpu":
        parts = args.parts.split(",") if args.parts else None
        print(f"wrote {gpu_suite(args.max_minutes, args.results_dir, parts=parts)}")
        return 0
    if args.command is None:
        build_parser().print_help()
        return 2
    options = {k: getattr(args, k) for k in OPTIONS if getattr(args, k, None) is not None}
    if args.command == "time-to-accuracy":
        variants = ({"eager": ()} | {flags: tuple(shlex.split(flags)) for flags in args.variant}
                    if args.variant else None)
        result = time_to_accuracy(args.metric, args.target, args.eval_every, args.nprocs, variants)
    elif args.command == "pipeline":
        options.update({k: getattr(args, k) for k in ("rounds", "amp", "workers") if getattr(args, k) is not None})
        result = pipeline(**options)
    elif args.command == "workers":
        options = {k: v for k, v in options.items() if k not in ("steps", "warmup")}
        options.update({k: getattr(args, k) for k in ("repeats", "workers") if getattr(args, k) is not None})
        result = workers_alone(**options)
    elif args.command == "overhead":
        options.pop("data_path", None)
        options.update({k: getattr(args, k) for k in ("image_size", "rounds", "amp") if getattr(args, k) is not None})
        result = overhead(**options)
    else:
        result = (table if args.command == "table" else SWEEPS[args.command])(**options)
    result.provenance["command"] = command
    print(result.to_markdown())
    if args.out:
        print(f"wrote {result.save(args.out)}")
    if args.plot:
        result.plot().savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        return run(args, "python -m maskrcnn_tut.lab.bench " + shlex.join(argv))
    except UserError as err:
        print_error(str(err))
        return err.exit_code
