"""The straggler check's forward times cost the GPU no device-wide synchronization per forward:
on CUDA they are events recorded on the stream and read once the step's work is queued. CUDA is
faked here (events and synchronize), the model runs on the CPU."""
from __future__ import annotations

import torch
from torch import nn

from maskrcnn_tut import engine


class FakeEvent:
    """A CUDA event whose clock is a counter: each record is 0.25 s after the one before."""

    clock = 0.0
    waited: list = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.time = None

    def record(self, stream=None):
        FakeEvent.clock += 0.25
        self.time = FakeEvent.clock

    def synchronize(self):
        FakeEvent.waited.append(self)

    def elapsed_time(self, end) -> float:
        return (end.time - self.time) * 1000


class LossModel(nn.Module):
    def forward(self, images, targets):
        return {"loss": sum(image.sum() for image in images)}


def test_cuda_forward_times_come_from_events_without_device_syncs(monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "waited", [])
    cuda = torch.device("cuda", 0)
    spans = [engine._forward(LossModel(), [torch.ones(2)], [{}], cuda)[1] for _ in range(3)]
    assert synchronized == []  # the old timing synchronized the device twice per forward
    assert FakeEvent.waited == []  # nothing waits until the step reads its times
    assert sum(engine._seconds(*span) for span in spans) == 0.75
    assert FakeEvent.waited == [stop for _, stop in spans]


def test_cpu_forward_times_are_host_seconds():
    _, (start, stop) = engine._forward(LossModel(), [torch.ones(2)], [{}], torch.device("cpu"))
    assert isinstance(start, float) and 0 <= engine._seconds(start, stop) < 1
