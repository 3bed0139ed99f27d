"""The host work of one training step, counted on the CPU as a GPU would see it (`bench.host_work`):
the package's own step makes one host sync on a step the loop reads and none on one it does not, so a
change that adds a sync to the step fails here; torchvision's syncs are counted and put down to it."""
import pytest
import torch

from maskrcnn_tut import engine
from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.engine import TrainState, build_optimizer, make_scaler, train_step
from maskrcnn_tut.lab.bench.host_work import count_host_work, optimizer_counters
from maskrcnn_tut.lab.synthetic import synthetic_batch
from maskrcnn_tut.model import build_model

#: The package's own host syncs in one step: the read of the shared all-reduce on a read step, none else.
PACKAGE_SYNCS = {True: 1, False: 0}


def one_step_work(read: bool, optimizer_name: str = "adamw"):
    cfg = derive(make_config("cpu-tiny", optimizer=optimizer_name), 1, "cpu")
    torch.manual_seed(0)
    model = build_model(cfg, 4)
    optimizer, scaler, state = build_optimizer(model, cfg), make_scaler(cfg, torch.device("cpu")), TrainState()
    batch = synthetic_batch(128, 2)
    train_step(model, optimizer, scaler, iter([batch]), cfg, state)  # optimizer state exists: a step in a run
    return count_host_work(lambda batches: train_step(model, optimizer, scaler, batches, cfg, state, read=read),
                           [batch], optimizer_counters(optimizer))


@pytest.mark.parametrize("read", [True, False])
@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_the_package_step_syncs_only_to_read_its_shared_values(read, optimizer_name):
    work = one_step_work(read, optimizer_name)
    assert work.syncs_from("maskrcnn_tut") == PACKAGE_SYNCS[read], work.syncs
    assert work.syncs_from("torchvision") > 10  # nonzero, boolean masks, nms: torchvision's own
    assert work.ops > 1000 and 0 < work.launches < work.ops


#: A loss read on every micro-step (`float(loss)`, as a log line might), compiled as a line of engine.py.
ADDED_SYNC = """
def forward_backward(*args, **kwargs):
    loss_dict, span = _original(*args, **kwargs)
    float(sum(loss_dict.values()).detach())
    return loss_dict, span
"""


def test_a_sync_added_to_the_step_is_counted(monkeypatch):
    """The check can fail: the same step with one more read in engine.py counts one more package sync."""
    namespace = {"_original": engine.forward_backward}
    exec(compile(ADDED_SYNC, engine.__file__, "exec"), namespace)
    monkeypatch.setattr(engine, "forward_backward", namespace["forward_backward"])
    work = one_step_work(read=False)
    assert work.syncs_from("maskrcnn_tut") == PACKAGE_SYNCS[False] + 1
    assert work.syncs["maskrcnn_tut: aten._local_scalar_dense"] == 1


def test_host_tensors_are_not_syncs():
    """Reads of host tensors (factories without a device, .cpu() results, the marked batches) cost nothing."""
    def step(batches):
        images, _ = next(batches)
        on_device = images[0].to("cpu")
        host = torch.zeros(3)
        host.sum().item(), on_device.cpu().tolist()  # the .cpu() is the one sync
    work = count_host_work(step, [synthetic_batch(32, 1)])
    assert work.syncs == {"other: Tensor.cpu": 1}
