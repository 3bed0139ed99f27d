"""The steady-state bench's logic on made-up step sequences (`bench.steady`): first-shape steps are left
out of the speed and reported apart, warm-up waits for the shapes to stop changing, and a verdict needs
an interval outside the noise band and every round on its side."""
import random

import pytest

from maskrcnn_tut.lab.bench import steady
from maskrcnn_tut.lab.wording import FASTER, INCONCLUSIVE, SLOWER, WITHIN_NOISE


def lines(walls, new=(), phase="measure", blocks=1, label="a"):
    """A setting's lines: step i takes walls[i] s, the steps in `new` meet a new shape; `blocks` rounds."""
    per_block = len(walls) // blocks
    return [{"setting": label, "phase": phase, "block": 1 + i // per_block if phase == "measure" else 0,
             "step": i + 1, "wall s": wall, "data s": 0.001, "shape": [800, 1000 + 32 * (i in new)], "rois": 10,
             "new shape": i in new} for i, wall in enumerate(walls)]


def test_first_shape_steps_are_left_out_of_the_speed_and_reported_apart():
    warm = lines([5.0, 0.8, 0.8, 0.1, 0.1], new={0, 1, 2}, phase="warm-up")
    measured = lines([0.1] * 8 + [0.7, 0.7], new={8, 9})
    row = steady.summarize(warm + measured, images_per_step=2)
    assert row["img/s steady"] == pytest.approx(20.0)  # 2 images / 0.1 s, the two 0.7 s steps left out
    assert row["img/s all steps"] == pytest.approx(2 * 10 / 2.2)
    assert (row["steps"], row["steady steps"], row["new-shape steps"], row["warm-up steps"]) == (10, 8, 2, 5)
    assert row["first-shape s"] == pytest.approx(0.75 - 0.1)  # median new-shape step (0.8, 0.8, 0.7, 0.7) over repeated
    assert row["first-shape steps"] == 4 and row["first step s"] == 5.0  # the very first step apart


def test_a_run_of_new_shapes_only_has_no_steady_speed():
    row = steady.summarize(lines([0.5, 0.6], new={0, 1}), images_per_step=2)
    assert row["img/s steady"] is None and row["img/s all steps"] == pytest.approx(4 / 1.1)


def noisy(median, n, spread, seed):
    draw = random.Random(seed)
    return [median * (1 + draw.uniform(-spread, spread)) for _ in range(n)]


def test_verdicts_need_the_interval_outside_the_band_and_every_round_on_its_side():
    base = lines(noisy(0.10, 60, 0.02, 1), blocks=3)
    faster = lines(noisy(0.08, 60, 0.02, 2), blocks=3, label="b")
    same = lines(noisy(0.10, 60, 0.02, 3), blocks=3, label="c")
    assert steady.verdict(base, faster)["verdict"] == FASTER
    assert steady.verdict(faster, base)["verdict"] == SLOWER
    assert steady.verdict(base, same)["verdict"] == WITHIN_NOISE
    found = steady.verdict(base, faster)
    assert found["lo"] <= found["ratio"] <= found["hi"] and len(found["rounds"]) == 3


def test_speeds_compare_per_image_when_the_batch_differs():
    """Twice the images in 1.5 times the step is faster; the step time alone would call it slower."""
    base, bigger = lines([0.10] * 30, blocks=3), lines([0.15] * 30, blocks=3, label="b")
    found = steady.verdict(base, bigger, images=(2, 4))
    assert found["ratio"] == pytest.approx(4 / 0.15 / (2 / 0.10)) and found["verdict"] == FASTER


def test_rounds_that_disagree_leave_it_inconclusive():
    base = lines([0.10] * 60, blocks=3)
    # faster by 20 % in two rounds, slower in the third: pooled the interval clears the band, the rounds do not agree
    other = lines([0.08] * 20 + [0.08] * 20 + [0.11] * 20, blocks=3, label="b")
    found = steady.verdict(base, other)
    assert found["lo"] > 1 + steady.NO_BAND and found["verdict"] == INCONCLUSIVE
    wide = lines(noisy(0.095, 60, 0.4, 4), blocks=3, label="c")  # an interval that straddles the band's edge
    assert steady.verdict(base, wide)["verdict"] == INCONCLUSIVE


def test_new_shape_steps_do_not_decide_a_verdict():
    """The artifact of 2026-12-04: the same steady speed, one side's window full of new shapes."""
    base = lines([0.07] * 30, blocks=3)
    other = lines([0.07, 0.07, 0.8, 0.8, 0.07, 0.07, 0.07, 0.8, 0.07, 0.07] * 3, new={2, 3, 7, 12, 13, 17, 22, 23, 27},
                  blocks=3, label="b")
    assert steady.verdict(base, other)["verdict"] == WITHIN_NOISE


class _Scripted(steady.Setting):
    """A Setting whose steps meet the shapes of a script instead of a model's."""

    def __init__(self, new_shapes):
        self.script, self.lines, self.label = iter(new_shapes), [], "scripted"

    def run(self, steps, phase, block, sink=None):
        made = [{"phase": phase, "new shape": next(self.script)} for _ in range(steps)]
        self.lines += made
        return made


def test_warm_up_lasts_until_no_new_shape_for_quiet_steps():
    script = [True] * 3 + [False] * 2 + [True] + [False] * 10
    setting = _Scripted(script)
    assert setting.warm_up(quiet=4, max_steps=50) == 6 + 4  # the last new shape at step 6, then 4 quiet ones
    assert _Scripted([True] * 100).warm_up(quiet=4, max_steps=12) == 12
