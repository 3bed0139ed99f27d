"""A process that ends with a DataLoader still alive exits: its workers block the job's signals (they
leave them to their rank), so multiprocessing's SIGTERM at exit cannot end them."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import subprocess_env

SCRIPT = textwrap.dedent("""
    import torch
    from torch.utils.data import DataLoader, Dataset
    from maskrcnn_tut.data import loader

    class Tiny(Dataset):
        decode_device = None
        def __len__(self):
            return 8
        def __getitem__(self, index):
            return torch.zeros(3, 4, 4, dtype=torch.uint8), {"image_id": index}

    batches = loader.iterate(DataLoader(Tiny(), batch_size=2, num_workers=2, persistent_workers=True,
                                        collate_fn=loader.collate))
    next(batches)
    print("one batch, workers left running")
""")


def test_a_process_leaving_loader_workers_alive_still_exits_cleanly():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env=subprocess_env())
    assert out.returncode == 0 and "workers left running" in out.stdout, out.stderr[-2000:]
    assert "killed by signal" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
