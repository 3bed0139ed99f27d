"""The edges a user touches first: --help shows the real defaults, precision is decided once,
`derive` adds the run's facts apart from its settings, and bad weights or checkpoints are one line,
not a traceback."""
import dataclasses
import logging

import pytest
import torch

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.config import REFERENCE_BATCH, Run, derive, make_config, validate
from maskrcnn_tut.data.loader import build_eval_loader
from maskrcnn_tut.distributed import DistInfo
from maskrcnn_tut.engine import autocast, build_optimizer, build_scheduler, make_scaler
from maskrcnn_tut.errors import CheckpointError, ConfigError, UserError, print_error
from maskrcnn_tut.flags import build_parser, parse_args
from maskrcnn_tut.model import build_model
from maskrcnn_tut.train import main


def _help(monkeypatch, cuda: bool) -> str:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    return " ".join(build_parser().format_help().split()).replace("- ", "-")  # undo argparse's wrapping


def test_help_shows_each_flag_default_once_as_this_machine_resolves_it(monkeypatch):
    cpu = _help(monkeypatch, cuda=False)
    assert "(default: None)" not in cpu
    assert all((action.help or "").count("default:") <= 1 for action in build_parser()._actions)
    assert "--lr LR learning rate" in cpu and "(default: 0.002)" in cpu  # cpu-tiny's: the dataclass default
    assert "runs/train" in cpu and "date-time" not in cpu
    gpu = _help(monkeypatch, cuda=True)
    lr_help = gpu[gpu.index("--lr LR learning rate"):gpu.index("--momentum MOMENTUM SGD")]
    assert "from preset gpu-r50" in lr_help and "0.002" not in lr_help
    assert "(default: 25.0, from preset gpu-r50)" in gpu and "(default: 100.0)" in cpu  # --bucket-cap-mb


def test_no_amp_with_an_amp_dtype_is_refused_not_silently_enabled():
    cfg, _ = parse_args(["--preset", "cpu-tiny", "--no-amp", "--amp-dtype", "bfloat16"])
    with pytest.raises(ConfigError, match="--amp-dtype bfloat16 picks the dtype of --amp, which is off"):
        validate(cfg, cuda_available=False)


@pytest.mark.parametrize("amp,dtype,device,expected", [
    (False, None, "cpu", "float32"), (True, None, "cpu", "bfloat16"), (True, None, "cuda 7.0", "float16"),
    (True, None, "cuda 9.0", "bfloat16"), (True, "bfloat16", "cuda 9.0", "bfloat16")])
def test_precision_is_resolved_once_by_derive(amp, dtype, device, expected, monkeypatch):
    """bf16 by default, but fp16 on a GPU without bf16 units (compute capability below 8.0)."""
    device, _, capability = device.partition(" ")
    if capability:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None: tuple(int(n) for n in capability.split(".")))
    cfg = derive(make_config("cpu-tiny", amp=amp, amp_dtype=dtype), 1, device)
    assert cfg.precision == expected
    context = autocast(cfg, torch.device("cpu"))
    assert context._enabled == (expected != "float32")
    if context._enabled:
        assert context.fast_dtype == getattr(torch, expected)


def test_derive_scales_the_lr_to_the_global_batch_and_keeps_the_users_lr():
    cfg = make_config("cpu-tiny", batch_size=4, accum_steps=2, lr=1e-3)
    run = derive(cfg, 4, "cpu")
    assert run.global_batch == 32 and run.lr == cfg.lr == 1e-3 and run.batch_size == 4
    assert run.scaled_lr == pytest.approx(1e-3 * (32 / REFERENCE_BATCH) ** 0.5)  # AdamW: the square root
    assert run.pin_memory is False and derive(cfg, 1, "cuda").pin_memory is True
    assert derive(make_config("cpu-tiny", pin_memory=False), 1, "cuda").pin_memory is False
    with pytest.raises(TypeError, match="not from a Run"):
        derive(run, 4, "cpu")  # deriving twice would scale twice


@pytest.mark.parametrize("optimizer, rule, factor", [("sgd", "auto", 4.0), ("adamw", "auto", 2.0),
                                                     ("adamw", "linear", 4.0), ("sgd", "sqrt", 2.0),
                                                     ("sgd", "none", 1.0)])
def test_lr_scaling_follows_the_optimizer_unless_named(optimizer, rule, factor):
    cfg = make_config("cpu-tiny", optimizer=optimizer, lr_scaling=rule, batch_size=8)
    assert derive(cfg, 4, "cpu").scaled_lr == pytest.approx(cfg.lr * factor)  # 32 images, 4x the reference


def test_a_run_cannot_keep_stale_facts():
    cfg = make_config("cpu-tiny", batch_size=4)
    run = derive(cfg, 2, "cpu")
    cfg.batch_size = 1  # the caller's settings: the run holds its own copy
    assert (run.batch_size, run.global_batch) == (4, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch_size = 2
    with pytest.raises(TypeError):
        dataclasses.replace(run, batch_size=2)
    smaller = dataclasses.replace(run, settings=dataclasses.replace(run.settings, batch_size=2))
    assert (smaller.global_batch, smaller.scaled_lr) == (4, pytest.approx(run.scaled_lr / 2 ** 0.5))
    assert dataclasses.replace(run, world_size=4).global_batch == 16


def test_what_needs_derived_facts_fails_on_settings_never_derived_naming_the_fact():
    """Such functions take a `Run` (their type says so): settings have none of its facts, so nothing
    can read a fact the run did not derive."""
    cfg = make_config("cpu-tiny", amp=True)
    for attribute in ("global_batch", "scaled_lr", "precision", "world_size", "device"):
        assert not hasattr(cfg, attribute)
    model = build_model(cfg, 4)
    for needs, fact in ((lambda: build_optimizer(model, cfg), "scaled_lr"),
                        (lambda: autocast(cfg, torch.device("cpu")), "precision"),
                        (lambda: make_scaler(cfg, torch.device("cpu")), "precision"),
                        (lambda: build_eval_loader([], cfg, 0, 1), "device")):
        with pytest.raises(AttributeError, match=f"'Config' object has no attribute '{fact}'"):
            needs()
    assert isinstance(derive(cfg, 1, "cpu"), Run)


def test_every_user_error_has_an_exit_code():
    assert issubclass(ConfigError, UserError) and ConfigError("x").exit_code == 2


def test_an_error_line_is_one_write_so_two_failing_ranks_cannot_run_their_lines_together(monkeypatch):
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr("sys.stderr", Recorder())
    print_error("non-finite loss at step 4")
    assert writes == ["error: non-finite loss at step 4\n"]


def test_a_bad_weights_file_is_one_line_and_exit_code_2(shapes_root, tmp_path, capsys):
    bad = tmp_path / "weights.pt"
    bad.write_text("these are not weights")
    flags = ["--data-path", str(shapes_root), "--output-dir", str(tmp_path / "run"), "--no-progress",
             "--weights", str(bad), "--test-only"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith(f"error: --weights {bad}: not a loadable torch state dict"), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def _training_parts(cfg):
    model = build_model(cfg, 4)
    optimizer = build_optimizer(model, cfg)
    return model, optimizer, build_scheduler(optimizer, cfg, 10)


def test_resuming_an_fp32_run_with_fp16_starts_a_fresh_scaler(caplog):
    fp32 = derive(make_config("cpu-tiny"), 1, "cpu")
    payload_config = fp32.to_dict()
    model, optimizer, scheduler = _training_parts(fp32)
    payload = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
               "scaler": make_scaler(fp32, torch.device("cpu")).state_dict(), "rng": [ckpt.rng_state(torch.device("cpu"))],
               "state": {"step": 3, "epoch": 0, "batch_in_epoch": 3, "nonfinite_skipped": 0, "scaler_skipped": 0},
               "config": payload_config}
    fp16_scaler = torch.amp.GradScaler("cpu", enabled=True)  # what --amp-dtype float16 makes on a GPU
    with caplog.at_level(logging.WARNING):
        state = ckpt.restore_training(payload, optimizer, scheduler, fp16_scaler, DistInfo(), fp32)
    assert state.step == 3 and fp16_scaler.is_enabled()
    assert "scaler starts afresh" in caplog.text


def test_a_checkpoint_without_config_of_the_previous_format_or_of_another_optimizer_is_refused(tmp_path):
    run = derive(make_config("cpu-tiny"), 1, "cpu").to_dict()
    with pytest.raises(CheckpointError, match="has no config"):
        ckpt.check_compatible({"model": {}, "state": {}}, run, tmp_path / "a.pt")
    saved = dict(run, optimizer="adamw")
    with pytest.raises(CheckpointError, match="trained with --optimizer adamw, this run asks for sgd"):
        ckpt.check_compatible({"config": saved}, dict(run, optimizer="sgd"), tmp_path / "a.pt")
    settings_only = make_config("cpu-tiny").to_dict()  # the previous format: derived facts mixed in, none apart
    with pytest.raises(CheckpointError, match="saved by an earlier version") as err:
        ckpt.check_compatible({"config": settings_only}, run, tmp_path / "a.pt")
    assert "\n" not in str(err.value)
    ckpt.check_compatible({"config": settings_only}, dict(run, test_only=True), tmp_path / "a.pt")  # scoring works


def test_rng_state_holds_only_this_process_device():
    state = ckpt.rng_state(torch.device("cpu"))
    assert "cuda" not in state


def test_steps_decay_drops_at_torchvision_epochs_16_and_22_of_26():
    from maskrcnn_tut.engine import lr_schedule
    factor = lr_schedule(warmup_steps=0, total_steps=260, decay="steps")
    assert [factor(s) for s in (0, 159, 160, 219, 220, 259)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


def test_gpu_r50_is_torchvision_recipe_from_scratch_and_freezes_bn_with_weights(tmp_path):
    cfg = make_config("gpu-r50")
    assert (cfg.optimizer, cfg.lr, cfg.momentum, cfg.norm, cfg.lr_decay) == ("sgd", 0.01, 0.9, "gn", "steps")
    assert derive(make_config("gpu-r50"), 8, "cuda").scaled_lr == pytest.approx(0.02)  # 0.02/8*NGPU at 2 img/GPU
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"")
    pretrained = make_config("gpu-r50", weights=str(weights))
    assert pretrained.norm == "frozen" and pretrained.epochs == 26
