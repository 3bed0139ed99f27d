"""`bench.pipeline`: the loop with its workers against the bare step is a like-for-like comparison."""
from __future__ import annotations

import json
import multiprocessing

from maskrcnn_tut.lab import bench


def test_each_bare_step_repeats_the_loops_step_and_the_workers_cpu_is_read():
    result = bench.pipeline("cpu-tiny", workers=1, rounds=2, steps=2, warmup=1)
    loop, bare = result.rows
    # same weights, batch and random draws: the same loss, to float rounding (it would differ if the
    # rewind missed the optimizer, the schedule, the RNG or the loader's position), in the round that
    # times the loop first and in the one that times the bare steps first
    assert loop["pairs"] == len(loop["pair ratios"]) == 4 and loop["loss gap"] < 1e-5
    assert loop["s/step"] > 0 and bare["s/step"] > 0 and loop["vs bare % lo"] <= loop["vs bare %"] <= loop["vs bare % hi"]
    assert loop["worker CPU ms/image"] > 0 and loop["process CPU s/step"] > 0
    assert any("pack into shared memory" in note for note in result.notes)
    assert any("Rounds alternate" in note for note in result.notes)
    json.dumps(result.to_dict())  # what the bench cache writes: its notes' values are plain data (a device was not)
    assert multiprocessing.active_children() == []  # its persistent workers ended, not left for a garbage collection
