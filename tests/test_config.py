"""Settings: presets by hardware, flags override presets, --help explains every flag."""
import subprocess

import pytest
from conftest import PYTHON, TRAIN_SCRIPT

from maskrcnn_tut.config import PRESETS, REFERENCE_BATCH, make_config
from maskrcnn_tut.errors import ConfigError
from maskrcnn_tut.flags import build_parser, parse_args


def test_flags_override_the_preset_and_epochs_override_its_step_budget():
    cfg, _ = parse_args(["--preset", "cpu-tiny", "--batch-size", "3", "--lr", "0.01"])
    assert (cfg.batch_size, cfg.lr, cfg.backbone) == (3, 0.01, PRESETS["cpu-tiny"]["backbone"])
    assert cfg.max_steps == PRESETS["cpu-tiny"]["max_steps"]
    cfg, _ = parse_args(["--preset", "cpu-tiny", "--epochs", "2"])
    assert cfg.epochs == 2 and cfg.max_steps is None


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


def test_print_config_resolves_without_training():
    out = subprocess.run([PYTHON, str(TRAIN_SCRIPT), "--print-config", "--preset", "cpu-tiny"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"backbone": "resnet18"' in out.stdout
