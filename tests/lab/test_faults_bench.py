"""`bench.faults`: the kernel's share of a CPU step, freed memory kept against glibc's default."""
import sys

import pytest

from maskrcnn_tut.lab.bench import faults


@pytest.mark.system
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keeping_freed_memory_cuts_a_steps_page_faults_without_raising_its_peak():
    kept, default = faults.compare("cpu-real", 288, steps=4)
    assert (kept["setting"], default["setting"]) == ("freed memory kept", "glibc default")
    assert kept["faults/step"] * 5 < default["faults/step"]
    assert kept["peak MB"] < default["peak MB"] * 1.2
