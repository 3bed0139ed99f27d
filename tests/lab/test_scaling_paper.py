"""Chapter 8's scaling on paper: the article's row against PCIe 3.0 (its card) and 4.0 (N7), NVIDIA's
published run against its own step and link, and the backward share measured from a run (L10)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from maskrcnn_tut.lab import book, scale_findings
from maskrcnn_tut.lab.bench import projection
from maskrcnn_tut.lab.wording import FASTER, SLOWER, WITHIN_NOISE


def test_backward_share_is_what_follows_forward_in_each_step():
    records = [SimpleNamespace(iter_time=1.0, data_time=0.1, rank_forward_times=[0.3, 0.35]),
               SimpleNamespace(iter_time=2.0, data_time=0.0, rank_forward_times=[0.5]),
               SimpleNamespace(iter_time=1.0, data_time=0.0, rank_forward_times=[0.2])]
    assert scale_findings.backward_share(records) == pytest.approx(0.75)


def article_paper():
    r50 = 178e6
    step = projection.ASSUMED_ARTICLE_BATCH / book.ARTICLE_SPEED_TABLE[0]["img/s"]
    published = projection.PUBLISHED_SCALING
    nvidia_step = projection.ASSUMED_ARTICLE_BATCH / published["img/s"][0]
    return (projection.predict(step, r50, backward_share=0.6), published,
            projection.predict(nvidia_step, r50, links=published["link"], backward_share=0.6))


def test_the_article_sits_at_the_pcie3_bound_not_below_it():
    """At 12 GB/s the no-overlap bound at 4 GPUs is ~94.5 %: the article's 93.8 % is at it (the old
    verdict, against 25 GB/s, said below)."""
    paper, published, nvidia = article_paper()
    found = scale_findings.article_bounds(paper, (0.94, 0.9375), published, nvidia)
    assert found["PCIe 3 4"] == pytest.approx(0.945, abs=0.005) and found["PCIe 4 4"] > 0.97
    assert found["article"] == WITHIN_NOISE
    assert scale_findings.article_bounds(paper, (0.9, 0.90), published, nvidia)["article"] == SLOWER
    assert scale_findings.article_bounds(paper, (0.99, 0.99), published, nvidia)["article"] == FASTER


def test_nvidia_is_judged_against_its_own_step_and_nvlink2():
    paper, published, nvidia = article_paper()
    found = scale_findings.article_bounds(paper, (0.94, 0.94), published, nvidia)
    assert found["published bound"] == pytest.approx(0.99, abs=0.01) and found["published far below"]
    assert found["published efficiencies"][-1] == pytest.approx(56.35 / 8.47 / 8)
