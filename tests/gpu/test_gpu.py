"""What only a GPU can show: fp16 with GradScaler (and its skip of an overflowing step), bf16, nccl,
DDP in one process, cuDNN flags, pinned copies and per-GPU RNG in checkpoints; and, through the
package's own entry points, the GPU findings of the static review:
`wrap_ddp` under the launcher with accumulation (C1), a
compiled run that evaluates and whose checkpoint `--test-only` loads (C2, C6), decode-on-device
then a step (W1, W4) and the exact accumulation proof (C7). Skipped without CUDA; `pytest -m gpu`
runs them on the GPU machine (tools/gpu_check.sh)."""
import io
import os

import pytest
import torch
from conftest import run_flags, run_train
from PIL import Image
from torchvision.io import decode_jpeg

from maskrcnn_tut import checkpoint as ckpt
from maskrcnn_tut import distributed as du
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.data.device_decode import Encoded, decode_batch
from maskrcnn_tut.engine import (
    TrainState,
    build_optimizer,
    configure_runtime,
    make_scaler,
    train_step,
)
from maskrcnn_tut.hardware import ddp_syncs_buffers
from maskrcnn_tut.lab import processes, proofs
from maskrcnn_tut.lab.synthetic import synthetic_batch
from maskrcnn_tut.model import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICE = torch.device("cuda", 0)


def _steps(precision_flags: dict, steps: int = 3):
    cfg = derive(make_config("cpu-tiny", min_size=128, max_size=192, **precision_flags), 1, DEVICE)
    torch.manual_seed(0)
    model = build_model(cfg, 4).to(DEVICE)
    optimizer, scaler = build_optimizer(model, cfg), make_scaler(cfg, DEVICE)
    state = TrainState()
    batches = iter([synthetic_batch(128, 2, seed=i) for i in range(steps)])
    records = [train_step(model, optimizer, scaler, batches, cfg, state)[-1] for _ in range(steps)]
    return cfg, scaler, records


def test_fp16_autocast_trains_with_an_active_grad_scaler():
    cfg, scaler, records = _steps({"amp": True, "amp_dtype": "float16"})
    assert cfg.precision == "float16" and scaler.is_enabled() and scaler.get_scale() > 0
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in records)


@pytest.mark.parametrize("read", [True, False])
def test_fp16_grad_scaler_skips_an_overflowing_step_and_backs_off(read):
    """A scale of 2**60 overflows fp16 gradients: GradScaler skips that step (the weights stay, the
    scale halves, the engine counts it) and the next step trains. A step the loop does not read
    (`read=False`) is counted when the next read step takes its values, with no host read of its own."""
    cfg = derive(make_config("cpu-tiny", min_size=128, max_size=192, amp=True, amp_dtype="float16"), 1, DEVICE)
    torch.manual_seed(0)
    model = build_model(cfg, 4).to(DEVICE)
    optimizer, scaler, state = build_optimizer(model, cfg), make_scaler(cfg, DEVICE), TrainState()
    batches = iter([synthetic_batch(128, 2, seed=i) for i in range(3)])
    train_step(model, optimizer, scaler, batches, cfg, state)
    scaler.update(new_scale=2.0 ** 60)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    train_step(model, optimizer, scaler, batches, cfg, state, read=read)
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert state.scaler_skipped == int(read) and scaler.get_scale() == 2.0 ** 59
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    record = train_step(model, optimizer, scaler, batches, cfg, state)[-1]
    assert state.scaler_skipped == 1
    assert torch.isfinite(torch.tensor(record.loss))


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
                            iter([synthetic_batch(128, 2)]), cfg, TrainState())[-1]
        assert torch.isfinite(torch.tensor(record.loss))
    finally:
        torch.distributed.destroy_process_group()


def test_cudnn_flags_and_tf32_follow_the_config():
    configure_runtime(derive(make_config("cpu-tiny", cudnn_benchmark=True), 1, DEVICE), DEVICE)
    assert torch.backends.cudnn.benchmark and torch.backends.cuda.matmul.allow_tf32
    configure_runtime(derive(make_config("cpu-tiny", cudnn_benchmark=True, deterministic=True), 1, DEVICE), DEVICE)
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
    # to_device scales uint8 pixels to [0, 1] on the device, as train_step expects; on an H200 the result was
    # not bitwise the CPU's x / 255 (x * (1/255) differs by one rounding for half the byte values): compare bytes
    assert all(m.device == DEVICE for m in moved)
    assert all(torch.equal(m.mul(255).round().to(torch.uint8).cpu(), i) for m, i in zip(moved, images))


def test_checkpoint_rng_holds_only_this_gpu_and_restores_it():
    state = ckpt.rng_state(DEVICE)
    assert state["cuda"].dtype == torch.uint8
    expected = torch.rand(3, device=DEVICE)
    ckpt.set_rng_state(state, DEVICE)
    assert torch.equal(torch.rand(3, device=DEVICE), expected)


def ddp_steps_through_wrap_ddp(accum_steps: int) -> dict:
    """Run inside `processes.launch`: two optimizer steps of `accum_steps` micro-steps through
    `wrap_ddp` and `train_step`, as train.py trains; this rank's losses and DDP's buffer sync."""
    info = du.info()
    cfg = derive(make_config("cpu-tiny", accum_steps=accum_steps, broadcast_buffers=False), info.world_size,
                 info.device)
    torch.manual_seed(0)
    model = du.wrap_ddp(build_model(cfg, 4).to(info.device), cfg, info)
    optimizer, scaler, state = build_optimizer(model, cfg), make_scaler(cfg, info.device), TrainState()
    batches = iter([synthetic_batch(128, 2, seed=10 * info.rank + i) for i in range(2 * accum_steps)])
    losses = [train_step(model, optimizer, scaler, batches, cfg, state)[-1].loss for _ in range(2)]
    return {"device": str(info.device), "losses": losses, "syncs_buffers": ddp_syncs_buffers(model)}


def test_wrap_ddp_under_the_launcher_trains_with_accumulation():
    result = processes.launch(ddp_steps_through_wrap_ddp, 2, 2, backend="gloo", timeout_s=240)
    assert result["device"].startswith("cuda") and result["syncs_buffers"] is False
    assert all(torch.isfinite(torch.tensor(loss)) for loss in result["losses"])


def test_a_compiled_run_evaluates_and_its_checkpoint_loads_without_the_flag(small_shapes, tmp_path):
    out = tmp_path / "run"
    compiled = run_train(*run_flags(small_shapes, out, "--preset", "cpu-tiny", "--max-steps", "2", "--fixed-shapes",
                                    "--compile-backbone", "--eval-every", "1"), timeout=420)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert not [key for key in ckpt.load(out / "checkpoints" / "last.pt")["model"] if "_orig_mod" in key]
    scored = run_train(*run_flags(small_shapes, out, "--preset", "cpu-tiny", "--test-only", "--resume", "auto"),
                       timeout=240)
    assert scored.returncode == 0 and "bbox_AP" in scored.stdout, scored.stderr[-3000:]


def _jpeg(seed: int, size=(160, 128)) -> torch.Tensor:
    """A noise JPEG with full-resolution colour (4:4:4): with the default 4:2:0, nvJPEG and libjpeg upsample
    the colour planes differently, which on noise differs by 13 levels on average (measured on an H200)."""
    pixels = torch.randint(0, 256, (size[1], size[0], 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="JPEG", quality=95, subsampling=0)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _seeded_identity(image, target):
    """Transforms that draw from the RNG as a random flip does, and change nothing."""
    torch.rand(1)
    return image, target


def test_decode_on_device_then_a_step_keeps_the_cuda_rng_and_the_pixels():
    cfg = derive(make_config("cpu-tiny", min_size=128, max_size=192), 1, DEVICE)
    torch.manual_seed(0)
    model = build_model(cfg, 4).to(DEVICE)
    optimizer, scaler, state = build_optimizer(model, cfg), make_scaler(cfg, DEVICE), TrainState()
    train_step(model, optimizer, scaler, iter([synthetic_batch(128, 2)]), cfg, state)  # queued work
    data = [_jpeg(seed) for seed in range(4)]
    targets = [{"boxes": torch.tensor([[10.0, 10, 60, 60]]), "labels": torch.tensor([1]),
                "masks": torch.zeros(1, 128, 160, dtype=torch.uint8)} for _ in data]
    for target in targets:
        target["masks"][0, 10:60, 10:60] = 1
    rng_before = torch.cuda.get_rng_state(DEVICE)
    images, moved = decode_batch([Encoded(d, seed=k) for k, d in enumerate(data)], targets, _seeded_identity,
                                 DEVICE, on_failure=lambda target, err: pytest.fail(str(err)))
    assert torch.equal(torch.cuda.get_rng_state(DEVICE), rng_before)  # W4: the GPU's generator untouched
    for image, raw in zip(images, data):
        assert image.device == DEVICE
        assert (image.int().cpu() - decode_jpeg(raw).int()).abs().float().mean() < 2  # nvJPEG vs libjpeg rounding
    record = train_step(model, optimizer, scaler, iter([(images, moved)]), cfg, state)[-1]
    assert torch.isfinite(torch.tensor(record.loss))


def test_the_ddp_accumulation_proof_is_exact_on_the_gpu():
    result = processes.launch(proofs.ddp_accumulation_check, 2, backend="gloo", timeout_s=240)
    assert result["max_abs_diff"] < 1e-6, result
