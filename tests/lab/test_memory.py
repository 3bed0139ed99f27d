"""memory: the breakdown is exact where it can be, and agrees with measured memory growth on CPU."""
from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from maskrcnn_tut.config import make_config
from maskrcnn_tut.lab.memory import breakdown, measure_growth, memory_table
from maskrcnn_tut.model import build_model


def test_breakdown_sizes_each_part():
    cfg = make_config("cpu-tiny")
    one = breakdown(cfg, 96, 1, "cpu")
    two = breakdown(cfg, 96, 2, "cpu")
    params = sum(p.numel() for p in build_model(cfg, 4).parameters()) * 4 / 2**20
    assert one.parameters_mb == pytest.approx(params) and one.gradients_mb == pytest.approx(params)
    assert one.optimizer_mb == pytest.approx(2 * params, rel=0.01)  # AdamW: two moments per weight
    assert one.saved_tensors > 50 and one.activations_mb > 1
    assert two.activations_mb == pytest.approx(2 * one.activations_mb, rel=0.2)  # activations scale with the batch
    assert one.total_mb == pytest.approx(one.parameters_mb + one.growth_mb)


def test_breakdown_agrees_with_measured_growth_on_cpu():
    cfg = make_config("cpu-tiny")
    predicted = breakdown(cfg, 128, 2, "cpu").growth_mb
    measured = measure_growth(cfg, 128, 2)
    assert measured == pytest.approx(predicted, rel=0.25), (predicted, measured)


def test_memory_table_counts_small_sizes_and_extrapolates_larger_ones():
    result = memory_table("cpu-tiny", image_sizes=(96, 128, 192), batch_sizes=(1, 2), measure_sizes=(96, 128),
                          gpu_memory_gb=0.25)
    rows = result.rows
    assert [(r["image size"], r["batch"]) for r in rows] == [(96, 1), (96, 2), (128, 1), (128, 2), (192, 1), (192, 2)]
    assert [r["activations"] for r in rows] == ["counted"] * 4 + ["extrapolated"] * 2
    totals = [r["total MiB"] for r in rows]
    assert totals[0] < totals[2] < totals[4] and totals[4] < totals[5]
    assert {r["fits"] for r in rows} <= {"yes", "no"}
    assert any("extrapolated" in note for note in result.notes)
    assert "| image size |" in result.to_markdown()
    plt.close(result.plot())
    with pytest.raises(ValueError, match="at least two measure_sizes"):
        memory_table("cpu-tiny", measure_sizes=(96,))


def test_measurements_on_the_notebooks_gpu_give_its_cache_back(monkeypatch):
    """S4: a chapter's in-kernel GPU measurement left gigabytes in the kernel's caching allocator, out
    of reach of the processes the chapter starts next; here CUDA is faked as initialized."""
    import torch

    from maskrcnn_tut.errors import ConfigError
    from maskrcnn_tut.lab import memory

    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    memory.autocast_activations("cpu-tiny", image_sizes=(64, 96), device="cpu")
    assert emptied == [True]
    with pytest.raises(ConfigError, match="unknown preset"):
        memory.bytes_per_parameter("no-such-preset")
    assert emptied == [True, True]  # also when the measurement fails
