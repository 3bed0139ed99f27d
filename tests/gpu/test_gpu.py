"""What only a GPU can show: fp16 with GradScaler, bf16, nccl, DDP in one process, cuDNN flags,
pinned copies and per-GPU RNG in checkpoints. Skipped without CUDA; `pytest -m gpu` runs them
on the GPU machine (tools/gpu_check.sh)."""
import os

import pytest
import torch

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.engine import (
    TrainState,
    build_optimizer,
    configure_runtime,
    make_scaler,
    train_step,
)
from maskrcnn_tut.lab import processes
from maskrcnn_tut.lab.synthetic import synthetic_batch
from maskrcnn_tut.model import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICE = torch.device("cuda", 0)


def _steps(precision_flags: dict, steps: int = 3):
    cfg = derive(make_config("cpu-tiny", min_size=128, max_size=192, **precision_flags), 1, DEVICE)
    torch.manual_seed(0)
    model = build_model(cfg, 4).to(DEVICE)
    optimizer, scaler = build_optimizer(model, cfg), make_scaler(cfg, DEVICE)
    state, names = TrainState(), []
    batches = iter([synthetic_batch(128, 2, seed=i) for i in range(steps)])
    records = [train_step(model, optimizer, scaler, batches, cfg, DEVICE, state, names) for _ in range(steps)]
    return cfg, scaler, records


def test_fp16_autocast_trains_with_an_active_grad_scaler():
    cfg, scaler, records = _steps({"amp": True, "amp_dtype": "float16"})
    assert cfg.precision == "float16" and scaler.is_enabled() and scaler.get_scale() > 0
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in records)


def test_bf16_autocast_needs_no_scaler():
    cfg, scaler, records = _steps({"amp": True, "amp_dtype": "bfloat16"})
    assert cfg.precision == "bfloat16" and not scaler.is_enabled()
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in records)


def test_nccl_group_of_one_and_ddp_train_a_step(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(processes.free_port()))
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                         rank=0, world_size=1)
    try:
        cfg = derive(make_config("cpu-tiny"), 1, DEVICE)
        model = torch.nn.parallel.DistributedDataParallel(build_model(cfg, 4).to(DEVICE), device_ids=[0])
        record = train_step(model, build_optimizer(model, cfg), make_scaler(cfg, DEVICE),
                            iter([synthetic_batch(128, 2)]), cfg, DEVICE, TrainState(), [])
        assert torch.isfinite(torch.tensor(record.loss))
    finally:
        torch.distributed.destroy_process_group()


def test_cudnn_flags_and_tf32_follow_the_config():
    configure_runtime(make_config("cpu-tiny", cudnn_benchmark=True), DEVICE)
    assert torch.backends.cudnn.benchmark and torch.backends.cuda.matmul.allow_tf32
    configure_runtime(make_config("cpu-tiny", cudnn_benchmark=True, deterministic=True), DEVICE)
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def test_pinned_batches_copy_without_blocking():
    from maskrcnn_tut.data.loader import to_device
    images, targets = synthetic_batch(64, 2)
    pinned = [image.pin_memory() for image in images]
    assert all(image.is_pinned() for image in pinned)
    moved, _ = to_device(pinned, targets, DEVICE, non_blocking=True)
    torch.cuda.synchronize()
    assert all(m.device == DEVICE and torch.equal(m.cpu(), i) for m, i in zip(moved, images))


def test_checkpoint_rng_holds_only_this_gpu_and_restores_it():
    state = ckpt.rng_state(DEVICE)
    assert state["cuda"].dtype == torch.uint8
    expected = torch.rand(3, device=DEVICE)
    ckpt.set_rng_state(state, DEVICE)
    assert torch.equal(torch.rand(3, device=DEVICE), expected)
