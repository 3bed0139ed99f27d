"""The training step: accumulation equals the large batch, DDP syncs once per optimizer step,
the schedule warms up, and a non-finite loss stops the step with a clear error."""
import math
import time

import pytest
import torch

from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.engine import (
    TrainState,
    after_step,
    autocast_dtype,
    build_optimizer,
    build_scheduler,
    lr_schedule,
    make_scaler,
    train_step,
    zero_grads,
)
from maskrcnn_tut.errors import NonFiniteLossError
from maskrcnn_tut.lab import processes, proofs


@pytest.mark.parametrize("accum_steps,batch_size", [(2, 3), (4, 2)])
def test_accumulated_gradients_equal_the_large_batch(accum_steps, batch_size):
    assert proofs.accumulation_check(accum_steps, batch_size) < 1e-6


def test_accumulation_is_not_a_sum_of_unscaled_losses():
    """The check can fail: gradients of K unscaled micro-losses are K times too large."""
    batches = proofs.toy_batches(4, 2)
    torch.manual_seed(0)
    model = proofs.TinyDetector()
    accumulated = proofs.accumulated_gradients(model, batches, 4)
    unscaled = {k: 4 * v for k, v in accumulated.items()}
    assert proofs.max_abs_difference(accumulated, unscaled) > 1e-4


@pytest.mark.system
def test_ddp_accumulation_across_two_processes_syncs_once_per_step():
    result = processes.launch(proofs.ddp_accumulation_check, 2, 4, 2)
    assert result["max_abs_diff"] < 1e-6
    assert result["allreduce_calls_accumulated"] == 1  # one bucket, one sync per optimizer step
    assert result["allreduce_calls_every_micro_step"] == 4


def test_warmup_then_cosine_schedule():
    factor = lr_schedule(warmup_steps=10, total_steps=110)
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.5)
    assert factor(110) == pytest.approx(0.0, abs=1e-12)


def test_autocast_dtype_follows_the_device(monkeypatch):
    """bf16 on CPUs and on GPUs with bf16 units (no GradScaler, whose reads sync the host); fp16 before them."""
    cfg = make_config("cpu-tiny", amp=True)
    assert autocast_dtype(derive(cfg, 1, "cpu")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, dtype in (((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((7, 5), torch.float16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert autocast_dtype(derive(cfg, 1, "cuda")) == dtype
    assert autocast_dtype(derive(make_config("cpu-tiny"), 1, "cpu")) is None
    assert not make_scaler(derive(cfg, 1, "cpu"), torch.device("cpu")).is_enabled()  # bf16 needs no GradScaler
    with pytest.raises(AttributeError, match="precision"):
        autocast_dtype(cfg)  # an underived config has no precision: the engine does not guess


class _NanModel(proofs.TinyDetector):
    def forward(self, images, targets):
        losses = super().forward(images, targets)
        losses["loss_other"] = losses["loss_other"] * math.nan
        return losses


def test_nonfinite_loss_names_step_and_terms():
    cfg = derive(make_config("cpu-tiny", optimizer="sgd"), 1, "cpu")
    model = _NanModel()
    optimizer = build_optimizer(model, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteLossError, match=r"step 1 on rank\(s\) \[0\].*loss_other=nan"):
        train_step(model, optimizer, make_scaler(cfg, torch.device("cpu")), iter(proofs.toy_batches(1, 2)),
                   cfg, TrainState())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no update applied


def test_skip_nonfinite_skips_and_counts():
    cfg = derive(make_config("cpu-tiny", optimizer="sgd", skip_nonfinite=1), 1, "cpu")
    model, state = _NanModel(), TrainState()
    record = train_step(model, build_optimizer(model, cfg), make_scaler(cfg, torch.device("cpu")),
                        iter(proofs.toy_batches(1, 2)), cfg, state)[-1]
    assert record.skipped and state.nonfinite_skipped == 1 and state.step == 1


class _SlowForward(proofs.TinyDetector):
    def forward(self, images, targets):
        time.sleep(0.2)
        return super().forward(images, targets)


def test_the_step_records_this_rank_forward_time_apart_from_the_rest():
    cfg = derive(make_config("cpu-tiny", optimizer="sgd"), 1, "cpu")
    model = _SlowForward()

    def slow_batches():
        for batch in proofs.toy_batches(1, 2):
            time.sleep(0.3)  # waiting for data is not forward time
            yield batch

    record = train_step(model, build_optimizer(model, cfg), make_scaler(cfg, torch.device("cpu")), slow_batches(),
                        cfg, TrainState())[-1]
    assert 0.2 <= record.rank_forward_times[0] < 0.3
    assert record.data_time >= 0.3 and record.iter_time >= 0.5


def test_ddp_gradients_stay_in_its_buckets_between_steps(tmp_path):
    """S3: with `gradient_as_bucket_view` the gradients are zeroed where they are, in DDP's buckets, so
    backward accumulates into them; set to None, every backward allocated them anew and the reducer
    copied them into the buckets."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), gradient_as_bucket_view=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):  # DDP rebuilds its buckets after the first backward
            zero_grads(model, optimizer)
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
        in_buckets = [p.grad.data_ptr() for p in model.parameters()]
        zero_grads(model, optimizer)
        assert [p.grad.data_ptr() for p in model.parameters() if p.grad is not None] == in_buckets
        assert all(not p.grad.any() for p in model.parameters())
        model(torch.ones(3, 4)).sum().backward()
        assert [p.grad.data_ptr() for p in model.parameters()] == in_buckets
    finally:
        torch.distributed.destroy_process_group()
    plain = torch.nn.Linear(4, 2)
    plain(torch.ones(1, 4)).sum().backward()
    zero_grads(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    assert all(p.grad is None for p in plain.parameters())  # without DDP: freed, as before


def test_unread_steps_come_back_at_the_read_step_with_the_values_a_read_would_give():
    """`read=False` (train.py on GPUs between log lines): the host does not take the step's values; the
    next read step returns every step since, oldest first, with the losses that reading each would give."""
    cfg = derive(make_config("cpu-tiny", optimizer="sgd"), 1, "cpu")
    runs = {}
    for pattern in ((True, True, True), (False, False, True)):
        torch.manual_seed(0)
        model, state = proofs.TinyDetector(), TrainState()
        optimizer, batches = build_optimizer(model, cfg), iter(proofs.toy_batches(3, 2))
        returned = [train_step(model, optimizer, make_scaler(cfg, torch.device("cpu")), batches, cfg, state, read=read)
                    for read in pattern]
        runs[pattern] = returned
        assert state.step == 3 and state.unread == []
    read_each, read_late = runs[(True, True, True)], runs[(False, False, True)]
    assert read_late[:2] == [[], []]
    assert [r.step for r in read_late[2]] == [1, 2, 3]
    assert [r.loss for r in read_late[2]] == [records[0].loss for records in read_each]


def test_a_nonfinite_loss_in_an_unread_step_stops_at_the_read_step_naming_it():
    cfg = derive(make_config("cpu-tiny", optimizer="sgd"), 1, "cpu")
    model, state = _NanModel(), TrainState()
    optimizer, scaler = build_optimizer(model, cfg), make_scaler(cfg, torch.device("cpu"))
    batches = iter(proofs.toy_batches(2, 2))
    assert train_step(model, optimizer, scaler, batches, cfg, state, read=False) == []
    with pytest.raises(NonFiniteLossError, match=r"step 1 on rank\(s\) \[0\]"):
        train_step(model, optimizer, scaler, batches, cfg, state)


def test_skip_nonfinite_reads_every_step_whatever_the_loop_asks():
    cfg = derive(make_config("cpu-tiny", optimizer="sgd", skip_nonfinite=1), 1, "cpu")
    model, state = _NanModel(), TrainState()
    records = train_step(model, build_optimizer(model, cfg), make_scaler(cfg, torch.device("cpu")),
                         iter(proofs.toy_batches(1, 2)), cfg, state, read=False)
    assert [r.skipped for r in records] == [True]


def test_after_step_is_train_py_tail_schedule_once_then_every_record_to_every_callback():
    """`after_step` (train.py's loop and the benches' copy of it): a stop request in the state reaches the
    record; the schedule steps once per step, read or not; the records go to the callbacks oldest first."""
    cfg = derive(make_config("cpu-tiny", optimizer="sgd", warmup_steps=10), 1, "cpu")
    model, state = proofs.TinyDetector(), TrainState()
    optimizer, scaler, batches = build_optimizer(model, cfg), make_scaler(cfg, torch.device("cpu")), iter(proofs.toy_batches(2, 2))
    scheduler = build_scheduler(optimizer, cfg, 100)
    seen = []
    callbacks = (lambda r: seen.append(("log", r.step)), lambda r: seen.append(("stragglers", r.step)))
    assert after_step(scheduler, train_step(model, optimizer, scaler, batches, cfg, state, read=False), callbacks) is None
    state.stop_requested = True
    newest = after_step(scheduler, train_step(model, optimizer, scaler, batches, cfg, state), callbacks)
    assert newest.step == 2 and newest.stop_requested and scheduler.last_epoch == 2
    assert seen == [("log", 1), ("stragglers", 1), ("log", 2), ("stragglers", 2)]
    assert "stop_requested" not in state.to_dict()  # a request, not a checkpoint's business
