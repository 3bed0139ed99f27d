"""Chapter 10's recipe card for 8 H100/H200 GPUs (lab/hub_recipe.py): every figure says how it is known
(derived from the package's settings, read from the committed H200 file, quoted, or a projection), and the
projections are the arithmetic they say they are."""
from __future__ import annotations

import pytest

from maskrcnn_tut.lab import book, hub_recipe, wording

KNOWN = ("the package", "derived here", "the preset", "the package's default", "projection", "quoted")


@pytest.fixture(autouse=True)
def english_afterwards():
    yield
    wording.set_language("en")


def test_every_row_says_how_it_is_known_and_nothing_was_measured_on_8_gpus():
    rows = hub_recipe.card(book.RESULTS, gpus=8, card_gib=80)
    assert [row["how it is known"].startswith(KNOWN) for row in rows] == [True] * len(rows)
    by_item = {row["item"]: row for row in rows}
    assert by_item["images per GPU, global batch, learning rate"]["value"].startswith("8 per GPU, 64 in all; SGD at lr 0.08")
    assert by_item["precision"]["value"].startswith("bf16") and "1.04-1.08x" in by_item["precision"]["how it is known"]
    speed = by_item["img/s per GPU"]
    assert speed["how it is known"].startswith("projection") and "Not measured on 8 GPUs" in speed["how it is known"]
    assert by_item["memory per GPU"]["how it is known"].startswith("projection")
    assert all(by_item[f"days for {epochs} epochs"]["how it is known"].startswith("projection") for epochs in (26, 72))


def test_the_speed_comes_from_the_committed_file_and_the_published_figure():
    steady = hub_recipe.h200_steady(book.RESULTS)
    assert steady["steps"] == 13 and steady["of"] == 19 and steady["img/s"] == pytest.approx(29.6, abs=0.1)
    assert steady["bf16 MiB per image"] == pytest.approx(6059 / 2)
    rows = {row["item"]: row["value"] for row in hub_recipe.card(book.RESULTS)}
    assert rows["img/s per GPU"].startswith("23-30")
    fastest, slowest = (118_287 * 26 / (speed * 8) / 86400 for speed in (steady["img/s"], 23))  # days at the ends
    assert rows["days for 26 epochs"].startswith(f"{fastest:.2f}-{slowest:.2f} days") and slowest < 0.2


def test_the_card_reads_in_japanese_too():
    wording.set_language("ja")
    rows = hub_recipe.card(book.RESULTS)
    assert rows[0]["item"] == "コマンド" and all(row["how it is known"] for row in rows)
