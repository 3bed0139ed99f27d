"""Which operators does the training step run that the bare model step does not?

    python tools/overhead_ops.py [--preset gpu-r50] [--image-size 800] [--pairs 2]

Builds one model and alternates the bare step (`bench.overhead`'s: forward, summed losses, backward,
optimizer step) with `engine.train_step` on the same two synthetic images, each under `torch.profiler`,
and prints, for each pair, the operators whose self CPU time differs most. A loop overhead shows as an
operator only the step runs (or one it runs more of); model-kernel noise shows as convolution times
that go up in one pair and down in the next. A developer's check: `bench overhead` gives the figures.
"""
from __future__ import annotations

import argparse
import collections
import time

from torch.profiler import ProfilerActivity, profile

from maskrcnn_tut.lab.bench.overhead import fixed_batch_rig


def self_cpu_seconds(fn) -> tuple[float, collections.Counter]:
    """Wall seconds of one call of `fn`, and its operators' self CPU seconds by name."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        fn()
        wall = time.perf_counter() - started
    by_op = collections.Counter()
    for event in prof.key_averages():
        by_op[event.key] += event.self_cpu_time_total / 1e6
    return wall, by_op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpu-r50")
    parser.add_argument("--image-size", type=int, default=800)
    parser.add_argument("--pairs", type=int, default=2, help="profiled (bare, train_step) pairs")
    parser.add_argument("--top", type=int, default=8, help="operators shown each way per pair")
    args = parser.parse_args()
    rig = fixed_batch_rig(args.preset, args.image_size, batch_size=2, amp=False)
    bare, step = rig.bare_step, rig.train_step
    bare(), step()  # warm-up
    for pair in range(1, args.pairs + 1):
        (bare_s, bare_ops), (step_s, step_ops) = self_cpu_seconds(bare), self_cpu_seconds(step)
        diff = {op: step_ops[op] - bare_ops[op] for op in set(bare_ops) | set(step_ops)}
        ranked = sorted(diff.items(), key=lambda kv: kv[1])
        print(f"pair {pair}: bare {bare_s:.3f} s, train_step {step_s:.3f} s ({step_s - bare_s:+.3f} s)")
        for op, seconds in ranked[::-1][:args.top] + ranked[:args.top]:
            only = " (only in train_step)" if op not in bare_ops else ""
            print(f"  {seconds:+.3f} s  {op}{only}")


if __name__ == "__main__":
    main()
