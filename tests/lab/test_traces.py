"""traces (profiler trace of DDP steps), timeline (memory over a step, shape census), diagrams (the
ring all-reduce simulated and drawn) and article (the article's code run as written)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import matplotlib
import pytest
import torch
from torch import nn

matplotlib.use("Agg")

from maskrcnn_tut.config import make_config  # noqa: E402
from maskrcnn_tut.lab import (  # noqa: E402
    article,
    bench,  # noqa: E402  (first: memory and bench import each other)
    diagrams,
    memory,
    timeline,
    trace_plots,
    traces,
)

# --------------------------------------------------------------------------- diagrams


@pytest.mark.parametrize("ranks, size", [(2, 10), (3, 7), (4, 16), (5, 23)])
def test_ring_allreduce_gives_every_rank_the_sum(ranks, size):
    gen = torch.Generator().manual_seed(ranks)
    tensors = [torch.randn(size, generator=gen) for _ in range(ranks)]
    results, steps, sent = diagrams.ring_allreduce(tensors)
    assert all(torch.allclose(result, sum(tensors), atol=1e-6) for result in results)
    assert len(steps) == 1 + 2 * (ranks - 1)
    assert [step.phase for step in steps[1:ranks]] == ["reduce-scatter"] * (ranks - 1)
    assert all(cell == frozenset(range(ranks)) for row in steps[-1].holds for cell in row)
    # after reduce-scatter, rank r holds the full sum of chunk r + 1
    assert all(steps[ranks - 1].holds[r][(r + 1) % ranks] == frozenset(range(ranks)) for r in range(ranks))
    chunk_sizes = [len(c) for c in torch.arange(size).tensor_split(ranks)]
    assert sent <= 2 * (ranks - 1) * max(chunk_sizes)


def test_ring_sends_two_n_minus_one_over_n_of_the_data():
    _, _, sent = diagrams.ring_allreduce([torch.ones(400) for _ in range(4)])
    assert sent / 400 == bench.projection.ring_allreduce_bytes(1, 4) == 1.5


def test_diagrams_draw():
    import matplotlib.pyplot as plt
    for fig in (diagrams.draw_dataparallel_vs_ddp(2), diagrams.draw_ring_allreduce(3)):
        assert fig.axes
        plt.close(fig)


# --------------------------------------------------------------------------- reading a trace


def _event(name, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "ts": float(ts), "dur": float(dur), "tid": tid, "pid": 7, "args": args}


def synthetic_rank(shift=0.0, start_reduce=1300.0):
    """One profiled step (µs): data 0-50, forward 50-450, backward 450-1300 (bucket launched at 1290),
    the bucket's all-reduce on gloo's thread from `start_reduce` to 1400, optimizer 1410-1460, step ends 1500."""
    s = shift
    return [
        _event(traces.STEP, s, 1500), _event(traces.DATA, s, 50), _event(traces.FORWARD, s + 50, 400),
        _event("c10d::broadcast_", s + 55, 5), _event("c10d::broadcast_", s + 61, 5),
        _event("autograd::engine::evaluate_function: AddmmBackward0", s + 450, 500),
        _event("autograd::engine::evaluate_function: ConvBackward0", s + 950, 350),
        _event("c10d::allreduce_", s + 1290, 5, **{"Input Dims": [[[2**18]], [], []]}),
        _event("gloo:all_reduce", s + start_reduce, s + 1400 - (s + start_reduce), tid=2),
        _event("c10d::allreduce_", s + 1402, 2),
        _event("gloo:all_reduce", s + 1403, 4, tid=3),  # the step's small logging all-reduce
        _event("Optimizer.step#SGD.step", s + 1410, 50),
    ]


def test_step_phases_reads_a_step():
    (row,) = traces.step_phases(synthetic_rank(start_reduce=1250.0))
    assert row["step ms"] == 1.5 and row["data ms"] == 0.05 and row["forward ms"] == 0.4
    assert row["backward ms"] == 0.85 and row["optimizer ms"] == 0.05
    assert row["gradient all-reduces"] == 1 and row["buffer broadcasts"] == 2
    assert row["all-reduce ms"] == pytest.approx(0.15)  # the small all-reduce is not a gradient bucket
    assert row["all-reduce during backward ms"] == pytest.approx(0.05)
    assert row["own work ms"] == pytest.approx(1.35) and row["waiting ms"] == pytest.approx(0.15)
    assert row["bucket MiB"] == [1.0] and row["all-reduces per backward"] == [1]  # 2**18 fp32 values, measured


def synthetic_no_sync_rank():
    """Two micro-steps (µs): forward 0-100 and backward 100-300 under no_sync (no bucket launched),
    forward 300-400 and backward 400-600 launching two buckets, their all-reduces 550-700."""
    return [
        _event(traces.STEP, 0, 800), _event(traces.FORWARD, 0, 100),
        _event("autograd::engine::evaluate_function: ConvBackward0", 100, 200), _event(traces.FORWARD, 300, 100),
        _event("autograd::engine::evaluate_function: ConvBackward0", 400, 200),
        _event("c10d::allreduce_", 500, 2, **{"Input Dims": [[[2**19]]]}),
        _event("c10d::allreduce_", 590, 2, **{"Input Dims": [[[2**18]]]}),
        _event("gloo:all_reduce", 550, 50, tid=2), _event("gloo:all_reduce", 600, 100, tid=2),
    ]


def test_step_phases_splits_accumulated_micro_steps():
    """no_sync: the first backward launches nothing, the last launches every bucket; backward time is
    the two backward passes, not the span from the first to the last (which holds a forward)."""
    (row,) = traces.step_phases(synthetic_no_sync_rank())
    assert row["all-reduces per backward"] == [0, 2] and row["bucket MiB"] == [2.0, 1.0]
    assert row["backward ms"] == pytest.approx(0.4) and row["backward span"] == (400.0, 600.0)
    assert row["all-reduce during backward ms"] == pytest.approx(0.05)


def test_transfer_and_wait_split_the_last_bucket_between_ranks():
    early, late = traces.step_phases(synthetic_rank(start_reduce=1300.0)), \
        traces.step_phases(synthetic_rank(start_reduce=1360.0))
    trace = traces.DDPTrace(steps={"ddp": [early, late]}, bucket_cap_mb=100.0, batch_size=8)
    (t0, w0), (t1, w1) = trace.transfer_and_wait()
    assert (t0, t1) == pytest.approx((0.04, 0.04)) and (w0, w1) == pytest.approx((0.06, 0.0))


def test_bucket_sizes_follow_the_cap():
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(3)))  # 4 MiB each
    assert traces.bucket_sizes_mb(model, 5.0) == pytest.approx([8.0, 4.0])
    assert traces.bucket_sizes_mb(model, 100.0) == pytest.approx([12.0])


def test_gradient_report_sizes_the_gradients():
    (row,) = traces.gradient_report(("cpu-tiny",), ranks=(2, 4))
    assert row["gradients MiB"] == pytest.approx(row["parameters (M)"] * 1e6 * 4 / 2**20)
    assert row["sent per rank, N=4 (MiB)"] == pytest.approx(1.5 * row["gradients MiB"])


def test_ddp_trace_labels_its_cpu_processes_not_the_gpus(monkeypatch):
    """M4: the trace hides the GPUs, so an 8-GPU host's label must not name them."""
    from fake_gpus import FakeNvml, host

    from maskrcnn_tut.lab import provenance
    host(monkeypatch, FakeNvml(8), "0,1,2,3,4,5,6,7")

    def fake_launch(worker, nprocs, cfg, steps, warmup, folder, backend):
        phases = traces.PHASES[:1] if nprocs == 1 else traces.PHASES[1:]
        for phase in phases:
            for rank in range(nprocs):
                events = synthetic_no_sync_rank() if phase == "ddp_no_sync" else synthetic_rank()
                (Path(folder) / f"{phase}.{rank}.json").write_text(json.dumps({"traceEvents": events}))

    monkeypatch.setattr(traces.processes, "launch", fake_launch)
    trace = traces.ddp_trace(steps=1, warmup=0)
    assert "Fake GPU" in provenance.hardware_label() and "Fake GPU" not in trace.hardware
    assert "GPUs hidden" in trace.hardware
    summary = trace.summary()
    assert summary["all-reduces per backward, no_sync"] == [0, 2] and summary["all-reduces per step"] == 1
    assert summary["backward share alone"][0] == pytest.approx(0.85 / 1.5)


@pytest.mark.system
def test_ddp_trace_profiles_real_steps(tmp_path):
    trace = traces.ddp_trace(steps=1, warmup=1, batch_size=2, min_size=64, max_size=96)
    for phase in traces.PHASES:
        assert len(trace.steps[phase]) == (1 if phase == "single" else 2)
        assert all(row["forward ms"] > 0 and row["backward ms"] > 0 for row in trace.rows(phase))
    assert all(row["gradient all-reduces"] == 0 for row in trace.rows("single"))
    assert all(row["gradient all-reduces"] == len(row["bucket MiB"]) == 1 for row in trace.rows("ddp"))
    assert all(row["gradient all-reduces"] == len(row["bucket MiB"]) >= 2 for row in trace.rows("ddp_small_buckets"))
    assert all(row["all-reduces per backward"][0] == 0 and row["all-reduces per backward"][-1] >= 2
               for row in trace.rows("ddp_no_sync"))  # no_sync: only the last micro-step all-reduces
    assert all(row["buffer broadcasts"] >= 1 for row in trace.rows("ddp"))  # BatchNorm buffers, every forward
    # one bucket: its all-reduce can start only when backward has produced the last gradient
    assert all(row["all-reduce during backward ms"] <= 0.1 * row["all-reduce ms"] + 1 for row in trace.rows("ddp"))
    assert trace.summary()["transfer"][0] > 0
    path = traces.save_trace(trace, tmp_path / "trace.json.gz")
    events = json.loads(gzip.open(path, "rt").read())["traceEvents"]
    assert {"rank 0", "rank 1"} <= {e.get("pid") for e in events}
    assert any(e.get("name") == "gloo:all_reduce" for e in events)
    assert len(trace.table()) == 4
    import matplotlib.pyplot as plt
    for fig in (trace_plots.plot_buckets(trace), trace_plots.plot_steps(trace, ("ddp", "ddp_no_sync"), "t")):
        plt.close(fig)


# --------------------------------------------------------------------------- memory timeline, shapes


def test_memory_timeline_counts_what_breakdown_counts():
    cfg = make_config("cpu-tiny")
    whole = timeline.memory_timeline(cfg, batch_size=2, image_size=64)
    counted = memory.breakdown(cfg, 64, 2, "cpu")
    assert whole.peak_saved_mb == pytest.approx(counted.activations_mb, rel=0.01)
    assert whole.parameters_mb == pytest.approx(counted.parameters_mb)
    assert whole.optimizer_mb == pytest.approx(counted.optimizer_mb)
    assert whole.points[-1][1] == 0 and whole.points[-1][2] == pytest.approx(counted.gradients_mb)
    assert whole.peak_mb <= counted.total_mb + 1e-6
    split = timeline.memory_timeline(cfg, batch_size=1, accum_steps=2, image_size=64)
    assert split.peak_saved_mb < whole.peak_saved_mb
    assert sum(1 for p in split.points if p[3] == "next micro-batch") == 1


def test_shape_census_sees_the_mask_head():
    from maskrcnn_tut.data.shapes import ensure_shapes_dataset
    root = ensure_shapes_dataset(16, 4, seed=0, progress=False)
    cfg = make_config("cpu-tiny", data_path=str(root), batch_size=2, min_size=64, max_size=96)
    census = timeline.shape_census(cfg, steps=2)
    assert census["backbone"]["steps"] == 2 and len(census["backbone"]["shapes"]) == 2
    assert all(shape[1:] == (cfg.fpn_channels, 14, 14) for shape in census["mask head"]["shapes"])
    assert 1 <= census["mask head"]["distinct"] <= 2
    fixed = timeline.batch_shapes(make_config("cpu-tiny", data_path=str(root), batch_size=2, fixed_shapes=True))
    assert fixed["distinct"] <= 3 and fixed["batches"] == 8
    assert timeline.batch_shapes(cfg, batches=10)["batches"] == 10  # beyond one epoch, as chapter 11 counts


# --------------------------------------------------------------------------- the article's code


def test_article_amp_branch_raises_its_real_errors():
    errors = article.article_errors()
    assert errors["Mask R-CNN (5 losses)"].startswith("ValueError: too many values to unpack")
    assert errors["toy detector (2 losses)"].startswith("AttributeError")
    assert errors["toy, losses = model(...) (the loss dict)"].startswith("AttributeError")


def test_missing_zero_grad():
    z = article.missing_zero_grad(steps=3)
    assert z["scaler off"] == pytest.approx(3.0)
    assert z["scaler on"] == pytest.approx(1.0, abs=1e-3)
    assert z["skipped after one inf loss, zero_grad=False"] == 3
    assert z["skipped after one inf loss, zero_grad=True"] == 0
    assert z["engine.train_step"] == pytest.approx(1.0)


@pytest.mark.system
def test_both_launchers_restart_only_one_injects_local_rank():
    launch, torchrun = article.launchers()
    assert launch["arguments the script got"] == "--local-rank=0" and torchrun["arguments the script got"] == "(none)"
    assert launch["restarted after the failure"] and torchrun["restarted after the failure"]
    assert launch["deprecation warning"] and not torchrun["deprecation warning"]


def test_ddp_refuses_a_module_left_on_the_cpu():
    assert article.ddp_before_to_device().startswith("ValueError: DistributedDataParallel device_ids")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memory_timeline(tmp_path):
    cfg = make_config("gpu-r50", min_size=256, max_size=256)
    points, _ = timeline.cuda_memory_timeline(cfg, 1, tmp_path / "snapshot.pickle")
    assert points and (tmp_path / "snapshot.pickle").stat().st_size > 0
    assert max(mb for _, mb in points) > 0


def test_buffer_sync_words_name_both_keywords_by_torch_version(monkeypatch):
    """L8: torch 2.13+ calls it forward_sync_buffers (broadcast_buffers deprecated); older torch the reverse."""
    monkeypatch.setattr(traces, "ddp_buffer_sync_keyword", lambda cls: "forward_sync_buffers")
    new = traces.buffer_sync_words(3)
    assert "`forward_sync_buffers`" in new and "`broadcast_buffers` is its deprecated older name" in new
    monkeypatch.setattr(traces, "ddp_buffer_sync_keyword", lambda cls: "broadcast_buffers")
    old = traces.buffer_sync_words(3)
    assert "calls the switch `broadcast_buffers`" in old and "`forward_sync_buffers` is its name from torch 2.13" in old
