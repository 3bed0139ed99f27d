"""Every invalid setting is rejected before training: one line naming the flag, exit code 2, no
traceback, the same under torchrun on every rank."""

import pytest
import torch
from checkpoints import resumable_payload
from conftest import TRAIN_SCRIPT, run_train

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.config import make_config, validate
from maskrcnn_tut.errors import ConfigError

INVALID = [  # (setting, value, the flag the message must name)
    ("batch_size", 0, "--batch-size"), ("epochs", 0, "--epochs"), ("accum_steps", 0, "--accum-steps"),
    ("min_size", 0, "--min-size"), ("max_size", -1, "--max-size"), ("max_steps", 0, "--max-steps"),
    ("checkpoint_every", 0, "--checkpoint-every"), ("keep_checkpoints", 0, "--keep-checkpoints"),
    ("lr", 0.0, "--lr"), ("workers", -1, "--workers"), ("skip_nonfinite", -1, "--skip-nonfinite"),
    ("dist_timeout", 0.0, "--dist-timeout"), ("clip_grad_norm", 0.0, "--clip-grad-norm"),
    ("backbone", "vgg16", "--backbone"), ("norm", "layer", "--norm"), ("optimizer", "lamb", "--optimizer"),
    ("amp_dtype", "float8", "--amp-dtype"), ("amp_dtype", "float16", "--amp-dtype"),
    ("dist_backend", "mpi", "--dist-backend"), ("dist_backend", "nccl", "--dist-backend"),
    ("grad_compression", "fp16", "--grad-compression"), ("anchor_sizes", "32,64", "--anchor-sizes"),
    ("test_only", True, "--test-only"), ("data_path", "/no/such/dir", "--data-path"),
    ("train_json", "/no/such.json", "--train-json"), ("resume", "/no/such.pt", "--resume"),
    ("weights", "/no/such.pt", "--weights"),
    # the rules that live beside their fields (`config.setting`): bounds, choices, finite numbers
    ("warmup_steps", -1, "--warmup-steps"), ("prefetch_factor", 0, "--prefetch-factor"),
    ("shapes_train", 0, "--shapes-train"), ("eval_every", 0, "--eval-every"), ("overfit", -3, "--overfit"),
    ("bucket_cap_mb", 0.0, "--bucket-cap-mb"), ("weight_decay", -1e-4, "--weight-decay"),
    ("momentum", 1.0, "--momentum"), ("lr", float("nan"), "--lr"), ("dist_timeout", float("inf"), "--dist-timeout"),
    ("lr_decay", "linear", "--lr-decay"), ("fpn_channels", -64, "--fpn-channels"),
]


@pytest.mark.parametrize("name,value,flag", INVALID, ids=[f"{n}={v}" for n, v, _ in INVALID])
def test_invalid_setting_names_its_flag(name, value, flag):
    cfg = make_config("cpu-tiny", **{name: value})
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_available=False)
    assert flag in str(err.value) and "\n" not in str(err.value)


def test_the_rule_messages_name_what_is_allowed():
    messages = {}
    for name, value in (("batch_size", 0), ("lr", -1.0), ("workers", -1), ("lr", float("nan")), ("norm", "ln")):
        with pytest.raises(ConfigError) as err:
            validate(make_config("cpu-tiny", **{name: value}), cuda_available=False)
        messages[name, str(value)] = str(err.value)
    assert messages == {
        ("batch_size", "0"): "--batch-size must be a positive integer, got 0",
        ("lr", "-1.0"): "--lr must be positive, got -1.0",
        ("workers", "-1"): "--workers must be 0 or more, got -1",
        ("lr", "nan"): "--lr must be a finite number, got nan",
        ("norm", "ln"): "--norm: 'ln' is not one of bn, frozen, gn"}


def test_more_processes_than_gpus_with_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = make_config("gpu-r50")
    validate(cfg, cuda_available=True, local_world_size=2)
    with pytest.raises(ConfigError, match=r"--nproc-per-node 4 is more than the 2 visible GPU\(s\)"):
        validate(cfg, cuda_available=True, local_world_size=4)
    validate(make_config("gpu-r50", dist_backend="gloo"), cuda_available=True, local_world_size=4)


def test_valid_presets_pass(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    validate(make_config("cpu-tiny"), cuda_available=False)
    validate(make_config("gpu-r50"), cuda_available=True)


def _incompatible_checkpoint(path):
    """A checkpoint train.py could have written for a ResNet-34 model: `--resume` must refuse it before training."""
    ckpt.atomic_save(resumable_payload(1, backbone="resnet34"), path)
    return path


def test_cli_rejects_each_bad_setting_with_one_line_and_exit_code_2(shapes_root, tmp_path, capsys):
    """`train.main` as the script runs it, in this process (cheap); the process-level exit code and
    the absence of a traceback are checked by the two subprocess tests below."""
    from maskrcnn_tut.train import main

    (tmp_path / "a_file").write_text("")
    data = ["--data-path", str(shapes_root), "--output-dir", str(tmp_path / "run"), "--no-progress"]
    cases = {  # flags -> what the single error line starts with
        ("--data-path", "/no/such/dir"): "error: --data-path /no/such/dir: no such directory",
        (*data, "--batch-size", "0"): "error: --batch-size must be a positive integer, got 0",
        (*data, "--min-size", "-5"): "error: --min-size must be a positive integer, got -5",
        (*data, "--accum-steps", "0"): "error: --accum-steps must be a positive integer, got 0",
        (*data, "--preset", "tpu-huge"): "error: --preset: unknown preset 'tpu-huge'",
        (*data, "--amp-dtype", "float16"): "error: --amp-dtype float16 needs a CUDA GPU",
        (*data, "--output-dir", str(tmp_path / "a_file" / "run")): f"error: --output-dir {tmp_path / 'a_file' / 'run'}: "
                                                                    "cannot write there",
        (*data, "--resume", "/no/such.pt"): "error: --resume /no/such.pt: no such checkpoint file",
        (*data, "--resume", str(_incompatible_checkpoint(tmp_path / "r34.pt"))):
            f"error: --resume: {tmp_path / 'r34.pt'} does not match this run's model (backbone: "
            "checkpoint 'resnet34' vs run 'resnet18')",
    }
    for flags, expected in cases.items():
        assert main(list(flags)) == 2, flags
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(expected), (flags, err[-2000:])
        assert "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.system
def test_the_script_exits_2_with_one_line_and_no_traceback(shapes_root, tmp_path):
    out = run_train("--data-path", str(shapes_root), "--output-dir", str(tmp_path / "run"), "--accum-steps", "0")
    assert out.returncode == 2
    assert out.stderr.strip() == "error: --accum-steps must be a positive integer, got 0"


@pytest.mark.system
def test_torchrun_ranks_all_reject_a_bad_setting_once_and_its_summary_names_it(shapes_root, tmp_path):
    out = run_train("--data-path", str(shapes_root), "--output-dir", str(tmp_path / "run"), "--batch-size", "0",
                    nproc=2)
    assert out.returncode != 0
    ours = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert ours == ["error: --batch-size must be a positive integer, got 0"], out.stderr[-3000:]  # rank 0 says it
    assert "exitcode  : 2" in out.stderr  # torchrun's summary of each rank
    assert "error_file: <N/A>" not in out.stderr  # the summary reads the error file each rank wrote
    assert "ConfigError: --batch-size must be a positive integer, got 0" in out.stderr
    assert "maskrcnn_tut/" not in out.stderr.replace(str(TRAIN_SCRIPT), "")  # no traceback from our code


@pytest.mark.parametrize("has_bf16", [False, True])
def test_amp_on_a_cpu_without_bf16_instructions_stops_with_one_line_unless_allowed(monkeypatch, capsys, has_bf16):
    """bf16 autocast emulated on an AVX2-only CPU took over 12 times fp32's step: --amp there is refused before
    the first step, naming the CPU's capability and --no-amp; --allow-emulated-bf16 runs it anyway. A CPU with
    bf16 instructions (AVX-512 BF16 or AMX) is not affected."""
    from maskrcnn_tut import config, train
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    cfg = make_config("cpu-tiny", amp=True, accelerator="cpu")
    if has_bf16:
        validate(cfg, cuda_available=False)
        return
    with pytest.raises(ConfigError, match=r"--amp: this CPU \(AVX2\) has no bf16 instructions.*--no-amp.*"
                                          r"--allow-emulated-bf16"):
        validate(cfg, cuda_available=False)
    validate(make_config("cpu-tiny", amp=True, accelerator="cpu", allow_emulated_bf16=True), cuda_available=False)
    validate(make_config("cpu-tiny", accelerator="cpu"), cuda_available=False)  # fp32: nothing to refuse
    assert train.main(["--amp", "--accelerator", "cpu", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --amp: this CPU (AVX2)")
