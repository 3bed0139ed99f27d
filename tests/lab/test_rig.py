"""rig: the lab's measurements train what train.py trains.

train.py writes its set-up out and the lab builds the same one in `rig.build_rig`; these tests run
train.py's `run` up to its first step and compare what it would train with what the rig builds
from the same settings: the initial weights, the random state the first step starts from (seeded
in the same order), the first batch, the loader's device, the precision and the scaler.
"""
from __future__ import annotations

import signal

import pytest
import torch

from maskrcnn_tut import distributed as du
from maskrcnn_tut import train
from maskrcnn_tut.config import make_config
from maskrcnn_tut.lab import rig as rig_module
from maskrcnn_tut.lab.rig import build_rig, synthetic_batches


class FirstStep(Exception):
    """Raised by the stand-in train_step once it has seen what train.py would train."""


def _settings(data, out):
    return make_config("cpu-tiny", data_path=str(data), output_dir=str(out), batch_size=2, min_size=64, max_size=96,
                       workers=0, progress=False, max_steps=1, seed=7, decode_on_device=True)


def _snapshot(model, batches, cfg, scaler) -> dict:
    """What the first step would start from (taking the first batch)."""
    rng = torch.get_rng_state()
    return {"weights": {k: v.detach().clone() for k, v in du.unwrap(model).state_dict().items()}, "rng": rng,
            "batch": next(batches), "precision": cfg.precision, "scaler": scaler.is_enabled()}


def _spy_loader(monkeypatch, module, devices: list) -> None:
    build = module.build_train_loader

    def spy(dataset, cfg, rank, world_size, device=None):
        devices.append(device)
        return build(dataset, cfg, rank, world_size, device)

    monkeypatch.setattr(module, "build_train_loader", spy)


@pytest.fixture
def train_py_first_step(shapes_root, tmp_path, monkeypatch):
    """train.py's `run` on the settings, stopped at its first step: (snapshot, loader devices)."""
    seen, devices = {}, []

    def first_step(model, optimizer, scaler, batches, cfg, state, *args, **kwargs):
        seen.update(_snapshot(model, batches, cfg, scaler))
        raise FirstStep

    monkeypatch.setattr(train, "train_step", first_step)
    _spy_loader(monkeypatch, train, devices)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(FirstStep):
            train.run(_settings(shapes_root, tmp_path / "train"))
    finally:
        signal.signal(signal.SIGTERM, handler)
    return seen, devices


def test_the_rig_builds_what_train_py_trains(train_py_first_step, shapes_root, tmp_path, monkeypatch):
    from_train, train_devices = train_py_first_step
    rig_devices = []
    _spy_loader(monkeypatch, rig_module, rig_devices)
    rig = build_rig(_settings(shapes_root, tmp_path / "rig"))
    from_rig = _snapshot(rig.model, rig.batches, rig.cfg, rig.scaler)
    assert from_rig["weights"].keys() == from_train["weights"].keys()
    assert all(torch.equal(from_rig["weights"][k], v) for k, v in from_train["weights"].items())
    assert torch.equal(from_rig["rng"], from_train["rng"])  # seeded again (seed + rank) after the model
    (rig_images, rig_targets), (train_images, train_targets) = from_rig["batch"], from_train["batch"]
    assert all(torch.equal(a, b) for a, b in zip(rig_images, train_images))
    assert [t["image_id"] for t in rig_targets] == [t["image_id"] for t in train_targets]
    assert all(torch.equal(a["boxes"], b["boxes"]) for a, b in zip(rig_targets, train_targets))
    # the loader is given the device (--decode-on-device decodes there), as train.py gives it
    assert rig_devices == train_devices == [torch.device("cpu")]
    assert rig.train_set.decode_device == torch.device("cpu")
    assert (from_rig["precision"], from_rig["scaler"]) == (from_train["precision"], from_train["scaler"])


def test_the_rig_derives_precision_and_scaler_from_the_settings():
    settings = make_config("cpu-tiny", amp=True, amp_dtype="float16", batch_size=1, min_size=32, max_size=32)
    rig = build_rig(settings, device="cpu", batches=synthetic_batches(settings))
    assert rig.cfg.precision == "float16" and rig.scaler.is_enabled()  # GradScaler only for fp16
    bf16 = make_config("cpu-tiny", amp=True, batch_size=1, min_size=32, max_size=32)
    assert not build_rig(bf16, device="cpu", batches=synthetic_batches(bf16)).scaler.is_enabled()


def test_a_model_of_your_own_is_trained_as_given():
    model = torch.nn.Linear(2, 2)
    settings = make_config("cpu-tiny")
    rig = build_rig(settings, device="cpu", batches=iter(()), model=model, wrap=None)
    assert rig.model is model and rig.module is model and rig.loader is None
    assert rig.optimizer.param_groups[0]["params"][0] is model.weight
