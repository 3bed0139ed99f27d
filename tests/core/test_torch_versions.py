"""The torch versions the package supports differ in a few places; `hardware` finds each by feature
detection and the rest of the package goes through it. Faked older and newer DDP signatures show
that `wrap_ddp` passes whichever buffer-sync keyword the installed torch has."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from maskrcnn_tut import distributed as du
from maskrcnn_tut.config import make_config
from maskrcnn_tut.hardware import ddp_buffer_sync_keyword, ddp_syncs_buffers, set_recompile_limit


class OlderDDP:
    """DDP's constructor as torch 2.6-2.12 have it: `broadcast_buffers`, no `forward_sync_buffers`."""

    def __init__(self, module, device_ids=None, broadcast_buffers=True, bucket_cap_mb=None,
                 find_unused_parameters=False, gradient_as_bucket_view=False, static_graph=False):
        self.module, self.broadcast_buffers = module, broadcast_buffers


class NewerDDP:
    """DDP's constructor from torch 2.13: `forward_sync_buffers` beside the deprecated `broadcast_buffers`."""

    def __init__(self, module, device_ids=None, broadcast_buffers=None, bucket_cap_mb=None,
                 find_unused_parameters=False, gradient_as_bucket_view=False, static_graph=False,
                 forward_sync_buffers=None):
        if broadcast_buffers is not None:
            raise AssertionError("the deprecated keyword was passed to a torch that has the new one")
        self.module, self.forward_sync_buffers = module, forward_sync_buffers


@pytest.mark.parametrize("ddp_class", [OlderDDP, NewerDDP])
def test_wrap_ddp_passes_the_buffer_sync_keyword_this_torch_has(monkeypatch, ddp_class):
    monkeypatch.setattr(nn.parallel, "DistributedDataParallel", ddp_class)
    cfg = make_config("cpu-tiny", broadcast_buffers=False)
    ddp = du.wrap_ddp(nn.Linear(2, 2), cfg, du.DistInfo(world_size=2))
    assert isinstance(ddp, ddp_class)
    assert ddp_syncs_buffers(ddp) is False


def test_the_installed_torch_is_read_by_feature():
    keyword = ddp_buffer_sync_keyword(nn.parallel.DistributedDataParallel)
    assert keyword in ("forward_sync_buffers", "broadcast_buffers")


def test_buffer_sync_is_read_back_under_either_name():
    assert ddp_syncs_buffers(SimpleNamespace(forward_sync_buffers=True)) is True
    assert ddp_syncs_buffers(SimpleNamespace(broadcast_buffers=False)) is False


class Torch26DynamoConfig:
    """torch 2.6's dynamo config: the recompile limit still under its old name, and no other."""

    def __init__(self):
        self.cache_size_limit = 8

    def __setattr__(self, name, value):
        if name != "cache_size_limit":
            raise AttributeError(f"torch._dynamo.config.{name} does not exist")
        object.__setattr__(self, name, value)


def test_the_recompile_limit_is_set_under_the_name_this_torch_has(monkeypatch):
    import torch._dynamo

    old = Torch26DynamoConfig()
    monkeypatch.setattr(torch._dynamo, "config", old)
    set_recompile_limit(3)
    assert old.cache_size_limit == 3
    monkeypatch.undo()
    config = torch._dynamo.config  # the installed torch's: 2.6 knows only the old name, 2.7 and later both
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    try:
        set_recompile_limit(5)
        assert getattr(config, name) == 5
    finally:
        setattr(config, name, before)
