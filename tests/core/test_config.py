"""Settings: one source per setting (defaults are cpu-tiny, presets hold differences), presets by
hardware, flags override presets, --help explains every flag, --print-config shows what a run derives."""
import dataclasses
import json
import subprocess

import pytest
import torch
from conftest import PYTHON, TRAIN_SCRIPT, subprocess_env

from maskrcnn_tut.config import PRESETS, REFERENCE_BATCH, Config, flag_fields, make_config
from maskrcnn_tut.errors import ConfigError
from maskrcnn_tut.flags import build_parser, parse_args


def test_flags_override_the_preset_and_epochs_override_its_step_budget():
    cfg, _ = parse_args(["--preset", "cpu-tiny", "--batch-size", "3", "--lr", "0.01"])
    assert (cfg.batch_size, cfg.lr, cfg.backbone) == (3, 0.01, Config.backbone)
    assert cfg.max_steps == Config.max_steps
    cfg, _ = parse_args(["--preset", "cpu-tiny", "--epochs", "2"])
    assert cfg.epochs == 2 and cfg.max_steps is None


def test_the_defaults_are_cpu_tiny_and_presets_hold_only_their_differences():
    defaults, tiny = Config(), make_config("cpu-tiny")
    assert {f.name: getattr(defaults, f.name) for f in flag_fields() if f.name != "preset"} == \
        {f.name: getattr(tiny, f.name) for f in flag_fields() if f.name != "preset"}
    for name, differences in PRESETS.items():
        assert {k: v for k, v in differences.items() if getattr(defaults, k) == v} == {}, name
    assert make_config("gpu-r50").bucket_cap_mb == 25.0 and defaults.bucket_cap_mb == 100.0


def test_every_setting_carries_its_help_and_derived_facts_are_not_settings():
    assert all(f.metadata["help"] for f in flag_fields())
    names = {f.name for f in dataclasses.fields(Config)}
    assert not names & {"world_size", "global_batch", "global_batch_size", "scaled_lr", "base_lr", "device",
                        "precision"}


def test_flags_take_their_types_and_choices_from_the_dataclass():
    args = build_parser().parse_args(["--bucket-cap-mb", "50", "--no-amp", "--backbone", "resnet50",
                                      "--max-steps", "7"])
    assert (args.bucket_cap_mb, args.amp, args.backbone, args.max_steps) == (50.0, False, "resnet50", 7)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--backbone", "vgg16"])


def test_the_bench_and_data_check_take_train_pys_flags():
    from maskrcnn_tut.data import check
    from maskrcnn_tut.lab.bench import cli

    def helps(parser):
        return {action.dest: action.help for action in parser._actions}

    train = helps(build_parser())
    table = cli.build_parser()._subparsers._group_actions[0].choices["table"]
    for parser in (check.build_parser(), table):
        shared = {name: text for name, text in helps(parser).items() if name in train}
        assert {"preset", "data_path", "min_size", "max_size"} <= set(shared)
        assert all(text.split(" (default:")[0] == train[name].split(" (default:")[0] for name, text in shared.items())
    assert "cpu-real" in helps(table)["preset"]
    args = cli.build_parser().parse_args(["table", "--preset", "cpu-real", "--batch-size", "2"])
    assert (args.preset, args.batch_size) == ("cpu-real", 2)


def test_default_preset_follows_the_hardware(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_args([])[0].preset == "cpu-tiny"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse_args([])[0].preset == "gpu-r50"


def test_unknown_preset_and_settings_are_rejected():
    with pytest.raises(ConfigError, match="--preset"):
        make_config("tpu-huge")
    with pytest.raises(ConfigError, match="unknown setting"):
        make_config("cpu-tiny", batchsize=3)


def test_help_explains_every_flag_and_the_reference_batch():
    text = build_parser().format_help()
    for flag in ("--data-path", "--batch-size", "--epochs", "--lr", "--workers", "--amp", "--resume",
                 "--output-dir", "--sync-bn", "--aspect-ratio-group-factor", "--test-only", "--print-freq",
                 "--accum-steps", "--clip-grad-norm", "--cudnn-benchmark", "--deterministic", "--seed",
                 "--eval-every", "--max-steps", "--amp-dtype", "--weights", "--preset"):
        assert flag in text
    assert f"global batch of {REFERENCE_BATCH}" in text.replace("\n", " ").replace("  ", " ")


@pytest.mark.system
def test_print_config_shows_the_settings_and_what_the_run_derives_without_training():
    out = subprocess.run([PYTHON, str(TRAIN_SCRIPT), "--print-config", "--preset", "cpu-tiny", "--batch-size", "3",
                          "--accum-steps", "2", "--lr", "0.004"], capture_output=True, text=True, timeout=120,
                         env=subprocess_env() | {"CUDA_VISIBLE_DEVICES": ""})  # the CPU's facts on any machine
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["backbone"] == "resnet18" and printed["lr"] == 0.004  # the user's lr stays as typed
    assert printed["derived"] == {"world_size": 1, "device": "cpu", "global_batch": 6,
                                  "scaled_lr": pytest.approx(0.004 * (6 / REFERENCE_BATCH) ** 0.5),
                                  "precision": "float32", "pin_memory": False, "fused_optimizer": False}


@pytest.mark.parametrize("memory_gib, capability, batch, precision", [
    (141, (9, 0), 8, "bfloat16"),   # an H200
    (24, (8, 6), 4, "bfloat16"),    # an RTX 3090 / A10
    (16, (7, 0), 2, "float16"),     # a V100: no bf16 units, so fp16 with a GradScaler
])
def test_gpu_r50_fits_its_batch_and_precision_to_the_card_in_print_config(monkeypatch, capsys, memory_gib, capability,
                                                                          batch, precision):
    """On a (simulated) CUDA host the preset is gpu-r50 with the card's images per GPU, aspect-ratio grouping,
    bucketed padding and bf16 where the card has bf16 units; the user's typed values still win."""
    from fake_gpus import FakeNvml, host

    from maskrcnn_tut import train
    host(monkeypatch, FakeNvml(gpus=1, memory_gib=memory_gib, capability=capability), "0")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    assert train.main(["--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["preset"], printed["batch_size"], printed["aspect_ratio_group_factor"], printed["pad_buckets"],
            printed["amp"]) == ("gpu-r50", batch, 3, 4, True)
    assert printed["derived"]["precision"] == precision and printed["derived"]["device"] == "cuda:0"
    assert printed["derived"]["fused_optimizer"] is True  # fused SGD: one kernel per step
    assert printed["derived"]["scaled_lr"] == pytest.approx(0.01 * batch / REFERENCE_BATCH)  # linear for SGD
    assert train.main(["--print-config", "--batch-size", "3", "--amp-dtype", "float16"]) == 0
    typed = json.loads(capsys.readouterr().out)
    assert (typed["batch_size"], typed["derived"]["precision"]) == (3, "float16")
