"""`hardware.keep_freed_memory`: large tensors freed and made again each step are not faulted in afresh.

glibc maps each allocation above its mmap threshold (32 MB at most) on its own and unmaps it when freed,
so every step's large activations cost the kernel fresh zeroed pages (minor faults, system CPU). Each
case runs in a fresh process, since malloc's settings are the process's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, sys, torch
from maskrcnn_tut.hardware import keep_freed_memory, proc_status_kib
kept = keep_freed_memory() if sys.argv[1] == "kept" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_step = []
for step in range(10):  # a step's activations: a few large tensors of sizes that vary by step
    before = faults()
    made = [torch.ones(mb * 2**18) for mb in ((40, 48, 36) if step % 2 else (44, 32, 52))]
    grad = made[0] * 2
    del made, grad
    per_step.append(faults() - before)
print(json.dumps({"kept": kept, "faults": per_step, "peak_mb": proc_status_kib("VmHWM") / 1024}))
"""

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


def _run(mode: str, env: dict | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True,
                         env={**clean, **(env or {})})
    return json.loads(out.stdout)


@linux
def test_a_steps_large_tensors_are_reused_without_faulting_their_pages_in_again():
    default, kept = _run("default"), _run("kept")
    assert kept["kept"] is True
    pages = 32 * 2**20 // 4096  # the smallest tensor's pages
    assert min(default["faults"][4:]) > 3 * pages  # each step maps and faults its tensors in again
    # the heap keeps its pages: at most a few late growths where a freed hole did not fit the next tensor
    # (one on torch 2.6 alone; two, of 40 and 52 MB, in a full `pytest --all`), never one per step
    assert sum(kept["faults"][4:]) < sum(default["faults"][4:]) / 4
    assert kept["peak_mb"] < default["peak_mb"] * 1.5  # kept memory stays near the steps' own peak


@linux
def test_a_process_that_set_glibcs_tunables_keeps_them():
    assert _run("kept", {"MALLOC_MMAP_THRESHOLD_": "65536"})["kept"] is False
