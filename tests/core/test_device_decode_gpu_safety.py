"""`--decode-on-device` leaves the GPUs' random generators alone (the RPN and RoI sampling draw from
them) and lets the device finish its queued work before nvJPEG writes on a stream of its own."""
from __future__ import annotations

import torch

from maskrcnn_tut.data import device_decode
from maskrcnn_tut.data.device_decode import Encoded, apply_transforms, decode_batch


def test_seeded_transforms_leave_the_cuda_generators_alone(monkeypatch):
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", reseeded.append)
    draw = lambda image, target: (torch.rand(1).item(), target)  # noqa: E731
    before = torch.random.get_rng_state()
    first = apply_transforms(draw, None, {}, seed=7)
    assert apply_transforms(draw, None, {}, seed=7) == first  # a function of the sample's seed
    assert torch.equal(torch.random.get_rng_state(), before)  # the process's CPU generator as it was
    assert reseeded == []


def test_the_stream_is_synchronized_before_a_cuda_decode(monkeypatch):
    events = []

    class Stream:
        def synchronize(self):
            events.append("synchronize")

    def decode_jpeg(data, mode, device):
        events.append("decode")
        return [torch.zeros(3, 2, 2, dtype=torch.uint8) for _ in data]

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream())
    monkeypatch.setattr(device_decode.tv_io, "decode_jpeg", decode_jpeg)
    images, _ = decode_batch([Encoded(torch.zeros(4, dtype=torch.uint8))], [{}], None,
                             torch.device("cuda", 0), on_failure=None)
    assert events == ["synchronize", "decode"] and len(images) == 1
