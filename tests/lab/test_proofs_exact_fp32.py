"""The accumulation proofs compute their gradients in exact fp32 (no TF32, deterministic cuDNN),
so their 1e-6 bounds hold on GPUs too, and leave the process's flags as they found them."""
from __future__ import annotations

import torch

from maskrcnn_tut.lab import proofs


def _flags() -> tuple:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)


def test_proof_gradients_run_without_tf32_and_with_deterministic_cudnn(monkeypatch, backend_flags):
    seen = []
    forward = proofs.TinyDetector.forward

    def recording_forward(self, images, targets):
        seen.append(_flags())
        return forward(self, images, targets)

    monkeypatch.setattr(proofs.TinyDetector, "forward", recording_forward)
    torch.backends.cudnn.allow_tf32 = True  # the defaults on a GPU, and a fast path's
    torch.backends.cuda.matmul.allow_tf32 = True
    before = _flags()
    assert proofs.accumulation_check(accum_steps=2, batch_size=2) < 1e-6
    assert seen and set(seen) == {(False, False, True, False)}
    assert _flags() == before
