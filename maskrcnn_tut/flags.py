"""The command lines' flags, generated from `Config`: one per field, with help that shows the real default.

`train.py` takes every flag; `python -m maskrcnn_tut.data.check` and the bench take the few they
need through `add_flags`, so a flag means the same everywhere. Each flag's default is what the run
resolves on this machine: the preset the hardware picks (`config.default_preset`) when the preset
sets the field, else the dataclass default; only the flags the user typed override the preset
(`config.resolve`).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Iterable

from .config import PRESETS, Config, default_preset, flag_fields, flag_name, make_config, value_type


def _default_text(f: dataclasses.Field, preset: str) -> str:
    """' (default: X)' as the run would resolve it on this machine, naming the preset when it decides."""
    if "default:" in f.metadata["help"]:
        return ""  # the help text says what the default depends on
    value = PRESETS[preset].get(f.name, f.default)
    if value is None:
        return ""
    if isinstance(value, bool):
        value = flag_name(("" if value else "no_") + f.name)
    return f" (default: {value}{f', from preset {preset}' if f.name in PRESETS[preset] else ''})"


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None, show_defaults: bool = True) -> None:
    """Add the flags of the `Config` fields `names` (every setting when None) to `parser`: the field's
    type, its choices, --x/--no-x for a bool, and (with `show_defaults`, for a command that keeps the
    preset's defaults) the default in the help. Every default is None, so what was typed is what is
    not None (`typed_settings`)."""
    fields = {f.name: f for f in flag_fields()}
    preset = default_preset()
    for name in fields if names is None else names:
        f = fields[name]
        text = f.metadata["help"] + (_default_text(f, preset) if show_defaults else "")
        kind = value_type(f)
        if kind is bool:
            parser.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, default=None, help=text)
        elif f.metadata.get("choices"):
            parser.add_argument(flag_name(name), choices=f.metadata["choices"], default=None, help=text)
        else:
            parser.add_argument(flag_name(name), type=kind, default=None, metavar=name.upper(), help=text)


def typed_settings(args: argparse.Namespace) -> dict:
    """The settings the user typed on a command line built by `add_flags`."""
    names = {f.name for f in flag_fields()}
    return {name: value for name, value in vars(args).items() if name in names and value is not None}


def config_from(args: argparse.Namespace) -> Config:
    """The resolved `Config` of a parsed command line: its preset, then what was typed."""
    typed = typed_settings(args)
    return make_config(typed.pop("preset", None), **typed)


def build_parser() -> argparse.ArgumentParser:
    """train.py's command line: every setting, and --print-config."""
    parser = argparse.ArgumentParser(
        prog="torchrun [--nproc_per_node=N] maskrcnn_tut/train.py",
        description="Train Mask R-CNN on COCO-format data, on CPUs (gloo) or GPUs (nccl). "
                    "With no flags it trains on the embedded shapes dataset with the preset the "
                    f"hardware calls for (on this machine: {default_preset()}; the defaults below are its).",
    )
    add_flags(parser)
    parser.add_argument("--print-config", action="store_true",
                        help="print the settings and what this run derives from them (world size, global "
                             "batch, scaled lr, precision, pin_memory, device), then exit")
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[Config, bool]:
    """Parse train.py's flags into a resolved `Config`; returns (config, print_config_only)."""
    args = build_parser().parse_args(argv)
    return config_from(args), args.print_config
