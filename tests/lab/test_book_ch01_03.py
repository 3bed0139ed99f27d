"""Chapters 1-3: the gradient-noise estimator is unbiased, the bytes-per-parameter derivation holds,
the COCO arithmetic, set_epoch, the loader verdict, the setup table, and a book config without
dead links."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from maskrcnn_tut.config import make_config
from maskrcnn_tut.lab import article, bench, memory, proofs

REPO = Path(__file__).resolve().parents[2]
CHAPTERS = ["00_preface", "01_why_multiple_gpus", "02_system_and_setup", "03_dataloader_tuning"]


# --------------------------------------------------------------------------- gradient noise


def _partition_gram(vectors: torch.Tensor, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """The Gram matrix of the batch means of one random partition of `vectors` into batches."""
    order = torch.randperm(vectors.shape[0], generator=generator)
    means = vectors[order].reshape(-1, batch_size, vectors.shape[1]).mean(1).double()
    return means @ means.T


@pytest.mark.parametrize("batch_size", [1, 2, 4, 8])
def test_batch_variance_is_unbiased_where_the_plain_mean_is_not(batch_size):
    # a pool of 16 "per-image gradients", split at random into disjoint batches, many times
    generator = torch.Generator().manual_seed(batch_size)
    pool = torch.randn(16, 50, generator=generator) + 0.3
    expected = float(pool.var(dim=0, unbiased=True).sum()) / batch_size  # S^2 / B
    k = pool.shape[0] // batch_size
    estimates = [proofs.batch_variance(_partition_gram(pool, batch_size, generator))[0] for _ in range(1000)]
    mean = sum(estimates) / len(estimates)
    assert mean == pytest.approx(expected, rel=0.03)
    # the first edition's estimate (divide by k, not k - 1) is low by (N - B) / N
    assert mean * (k - 1) / k == pytest.approx(expected * (16 - batch_size) / 16, rel=0.03)


def test_noise_from_gram_gives_a_jackknife_error_from_three_batches():
    grads = torch.randn(4, 30, generator=torch.Generator().manual_seed(0)) + 1.0
    noise, error = proofs._noise_from_gram(grads.double() @ grads.double().T)
    variance, mean_norm = proofs.batch_variance(grads.double() @ grads.double().T)
    assert noise == pytest.approx(variance / mean_norm)
    assert error is not None and 0 < error < noise
    assert proofs._noise_from_gram(grads[:2].double() @ grads[:2].double().T)[1] is None


def test_gram_in_slices_matches_the_full_product():
    grads = torch.randn(5, 1000, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(proofs._gram(grads.to(torch.bfloat16), chunk=300),
                          (grads.to(torch.bfloat16).double() @ grads.to(torch.bfloat16).double().T), rtol=1e-5)


def test_gradient_noise_rows_and_limits(shapes_root):
    cfg = make_config("cpu-tiny", data_path=str(shapes_root), min_size=96, max_size=128, progress=False)
    rows = proofs.gradient_noise(cfg, batch_sizes=(1, 2), images_per_size=4)
    assert [(r["batch size"], r["batches"]) for r in rows] == [(1, 4), (2, 2)]
    assert all(r["relative gradient noise"] > 0 for r in rows)
    assert rows[0]["noise SE"] is not None and rows[1]["noise SE"] is None  # two batches: no jackknife
    with pytest.raises(ValueError, match="fewer than two batches"):
        proofs.gradient_noise(cfg, batch_sizes=(4,), images_per_size=4)
    with pytest.raises(ValueError, match="the dataset has"):
        proofs.gradient_noise(cfg, batch_sizes=(1,), images_per_size=10_000)


# --------------------------------------------------------------------------- bytes per parameter


def test_derived_bytes():
    assert sum(memory.derived_bytes("sgd").values()) == 12
    assert sum(memory.derived_bytes("adamw").values()) == 16
    assert memory.derived_bytes("sgd", momentum=0.0)["optimizer state"] == 0


def test_bytes_per_parameter_holds_after_a_real_step():
    result = memory.bytes_per_parameter("cpu-tiny", image_size=64, device="cpu")
    count = sum(p.numel() for p in memory.build_model(make_config("cpu-tiny"), num_classes=4).parameters())
    assert result.provenance["parameters"] == count
    assert [r["recipe"] for r in result.rows] == [name for name, _, _ in memory.RECIPES]
    for row in result.rows:
        assert row["as derived"], row
        assert row["gradient dtype"] == "float32"  # autocast keeps fp32 gradients
        assert row["measured MiB"] == pytest.approx(row["derived MiB"], rel=1e-3)
    assert {r["autocast"] for r in result.rows} == {"off", "bfloat16"}
    assert "| recipe |" in result.to_markdown()


def test_autocast_activations_counts_then_extrapolates():
    rows = memory.autocast_activations("cpu-tiny", image_sizes=(96, 128), extrapolate_to=(192,), device="cpu")
    assert [(r["image size"], r["activations"]) for r in rows] == [(96, "counted"), (128, "counted"),
                                                                    (192, "extrapolated")]
    assert rows[0]["fp32 MiB"] < rows[1]["fp32 MiB"] < rows[2]["fp32 MiB"]
    assert all(r["autocast / fp32"] == pytest.approx(r["autocast MiB"] / r["fp32 MiB"]) for r in rows)


def test_fixed_bytes_uses_the_presets_optimizer():
    tiny = memory.fixed_bytes("cpu-tiny")
    assert tiny["optimizer"] == "adamw" and tiny["bytes per parameter"] == 16
    assert tiny["MiB"] == pytest.approx(tiny["parameters"] * 16 / 2**20)


# --------------------------------------------------------------------------- COCO arithmetic


def test_the_articles_own_arithmetic():
    # 118,287 images at the article's 5.2 img/s: about 3 days for 12 epochs, about 7 for 26
    assert bench.projection.coco_days(5.2, 12, 118_287) == pytest.approx(3.16, abs=0.01)
    assert bench.projection.coco_days(5.2, 26, 118_287) == pytest.approx(6.85, abs=0.01)
    rows = bench.projection.coco_days_table([{"source": "a", "img/s": 5.2},
                                   {"source": "b", "img/s": 2.0, "img/s lo": 1.0, "img/s hi": 4.0}], 118_287)
    assert rows[0]["26 epochs (torchvision reference), days"] == pytest.approx(6.85, abs=0.01)
    assert "days range" not in rows[0]
    low, high = (float(x) for x in rows[1]["days range"].split("-"))
    assert low == pytest.approx(bench.projection.coco_days(4.0, 26, 118_287), rel=1e-2)
    assert high == pytest.approx(bench.projection.coco_days(1.0, 26, 118_287), rel=1e-2)


# --------------------------------------------------------------------------- set_epoch


def test_set_epoch_changes_the_order_and_ranks_do_not_overlap(shapes_root):
    cfg = make_config("cpu-tiny", data_path=str(shapes_root), workers=0, progress=False)
    without = proofs.first_batches(cfg, set_epoch=False)
    with_it = proofs.first_batches(cfg, set_epoch=True)
    assert without[0] == without[1] == with_it[0]
    assert with_it[1] != with_it[0]
    rank1 = proofs.first_batches(cfg, set_epoch=True, rank=1)
    assert not set(rank1[0]) & set(with_it[0])


# --------------------------------------------------------------------------- setup table and book config


def test_stack_today_reads_the_report():
    report = [{"": "PyTorch / torchvision", "this machine": "9.9 / 8.8"}, {"": article.CUDA_ROW, "this machine": "99.0"},
              {"": "GPUs", "this machine": "none visible"}, {"": "NCCL", "this machine": "x"},
              {"": "distributed backends", "this machine": "gloo"}, {"": "Python", "this machine": "3.x"}]
    rows = article.stack_today(report)
    mine = {row["the article"].split()[0]: row["this machine"] for row in rows}
    assert mine["PyTorch"] == "9.9 / 8.8" and mine["CUDA"].startswith("CUDA 99.0")
    launch = next(row for row in rows if "torch.distributed.launch" in row["the article"])
    assert "torchrun" in launch["today"] and "torchrun" in launch["this machine"]


def test_book_config_has_no_placeholder_links():
    config = yaml.safe_load((REPO / "_config.yml").read_text())
    urls = [config.get("repository", {}).get("url", "")] + [v for k, v in config.get("launch_buttons", {}).items()
                                                           if k.endswith("_url")]
    assert not any("example" in url for url in urls if url)
    html = config.get("html", {})
    if any(html.get(b) for b in ("use_repository_button", "use_issues_button", "use_edit_page_button")):
        assert config["repository"]["url"]
    if config.get("launch_buttons", {}).get("jupyterhub_url"):
        assert config["repository"]["url"], "a hub launch button clones repository.url"


def test_book_config_is_valid_for_jupyter_book():
    jb_config = pytest.importorskip("jupyter_book.config")
    final = jb_config.get_final_config(user_yaml=REPO / "_config.yml", cli_config={"latex_individualpages": False},
                                       validate=True, raise_on_invalid=True, sourcedir=REPO)[0]
    assert final["html_theme_options"]["launch_buttons"]["jupyterhub_url"] == ""


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapters_show_measured_prose_in_jupyterlab_and_answer_their_exercises(chapter):
    cells = json.loads((REPO / "book" / f"{chapter}.ipynb").read_text())["cells"]
    markdown = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "{glue:" not in markdown  # glue placeholders stay raw in JupyterLab
    for cell in cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] == "code" and "book.prose(" in "".join(cell["source"]):
            assert "remove-input" in tags
    if "## Try it" in markdown:
        answers = [c for c in cells if "hide-output" in c.get("metadata", {}).get("tags", [])
                   and f'"ch{chapter[:2]}.answers"' in "".join(c["source"])]
        assert answers, f"{chapter}: its exercises have no collapsed answer"


def test_chapter_3s_set_epoch_demonstration_is_not_split():
    """M1 (book-review-3): the lead-in that ends 'both ways:' is followed by the table it promises, and the
    section on what the workers cost comes after the set_epoch section, not inside it."""
    import nbformat
    cells = nbformat.read(REPO / "book" / "03_dataloader_tuning.ipynb", as_version=4).cells
    lead = next(i for i, cell in enumerate(cells) if cell.cell_type == "markdown" and "## `set_epoch`" in cell.source)
    assert cells[lead].source.rstrip().endswith("both ways:")
    assert cells[lead + 1].cell_type == "code" and "proofs.first_batches" in cells[lead + 1].source
    workers = next(i for i, cell in enumerate(cells) if cell.source.startswith("## What the workers cost"))
    batch_stream = next(i for i, cell in enumerate(cells) if "book.show_source(loader.batch_stream)" in cell.source)
    assert workers > batch_stream > lead
