"""A scheduler's signals in one process: a stop request instead of death, at once where nothing is
left to save, the launcher's end counted as one, and DataLoader workers that leave them to their rank."""
import os
import signal
import time

import pytest
import torch

from maskrcnn_tut import preemption
from maskrcnn_tut.data.loader import iterate, loader_kwargs
from maskrcnn_tut.errors import Preempted


def test_a_stop_signal_is_a_request_and_within_at_once_stops_there():
    with preemption.StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.cause == "by SIGUSR1"  # and this process lives on
        with pytest.raises(Preempted, match="stopped by SIGUSR1 at the end"), stop.at_once("at the end"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_the_end_of_the_launcher_is_a_stop_request(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(preemption, "LAUNCHER", -1)  # not this process's parent: as if torchrun had died
    with preemption.StopRequest() as stop:
        deadline = time.monotonic() + 10
        while stop.cause is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert stop.cause == "because torchrun (pid -1) ended"


class Pids(torch.utils.data.Dataset):
    """Each sample is the pid of the process that loaded it."""

    decode_device = None  # as `iterate` expects of a dataset

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor(os.getpid()), {}


def test_loader_workers_live_through_the_jobs_signals():
    loader = torch.utils.data.DataLoader(Pids(), batch_size=1, **loader_kwargs(1, False, True, 1))
    batches = iterate(loader)
    worker = int(next(batches)[0][0])
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        os.kill(worker, signum)
    time.sleep(0.5)
    assert [int(images[0]) for images, _ in batches] == [worker] * 3
