"""The kernel's share of a CPU step: minor page faults and system CPU seconds per training step, with
freed memory kept for reuse (`hardware.keep_freed_memory`, as train.py runs) and with glibc's default,
each in a fresh process on the same synthetic batches (three shapes in turn, as real data brings).

    python -m maskrcnn_tut.lab.bench.faults [--preset cpu-real] [--size 288] [--steps 8]

Prints one JSON line per setting: faults and system seconds per step after the first, and the peak
resident MB, which keeping freed memory must not raise much.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys


def measure(preset: str, size: int, steps: int) -> dict:
    """In this process: `steps` rig steps; per step, minor faults and system seconds (the first left out)."""
    from ...hardware import proc_status_kib
    from ..rig import build_rig, shapes_config
    from ..synthetic import synthetic_batch
    shapes = [synthetic_batch(s, 2, objects=3, seed=i) for i, s in enumerate((size, size * 3 // 4, size * 5 // 4))]
    rig = build_rig(shapes_config(preset, accelerator="cpu", amp=False, batch_size=2, workers=0),
                    batches=itertools.cycle(shapes))
    faults, system = [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF)
        rig.step()
        rig.scheduler.step()
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(after.ru_minflt - before.ru_minflt)
        system.append(after.ru_stime - before.ru_stime)
    return {"faults/step": statistics.median(faults[1:]), "system s/step": round(statistics.median(system[1:]), 3),
            "peak MB": round(proc_status_kib("VmHWM") / 1024)}


def compare(preset: str = "cpu-real", size: int = 288, steps: int = 8) -> list[dict]:
    """Both settings, each in a fresh process (malloc's settings are the process's)."""
    rows = []
    for setting, env in (("freed memory kept", {}), ("glibc default", {"MALLOC_ARENA_TEST": "8"})):
        # any MALLOC_ variable leaves glibc as it is (keep_freed_memory respects set tunables)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-m", "maskrcnn_tut.lab.bench.faults", "--child", "--preset", preset, "--size", str(size),
                              "--steps", str(steps)], env={**clean, **env}, capture_output=True, text=True, check=True)
        rows.append({"setting": setting, **json.loads(out.stdout.splitlines()[-1])})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-real")
    parser.add_argument("--size", type=int, default=288)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.preset, args.size, args.steps)))
        return
    for row in compare(args.preset, args.size, args.steps):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
