"""The fast path's correctness on CPU: fixed-shape batches give the backbone three shapes at most
and the same losses as eager padding would on a batch that needs no extra padding; channels_last
and a compiled backbone give the same losses as eager; and a recompilation storm is caught."""
import dataclasses

import pytest
import torch
from compiled import compilations

from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.engine import autocast
from maskrcnn_tut.model import build_model, compile_backbone


def _losses(cfg, images, targets, compile_with: str | None = None) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg.settings, compile_backbone=False), 4).train()
    if compile_with:
        compile_backbone(model, "cpu", backend=compile_with)
    torch.manual_seed(1)  # the same RPN/RoI sampling in every variant
    with autocast(cfg, torch.device("cpu")):
        return {k: float(v.detach()) for k, v in model([i.float() / 255 for i in images], targets).items()}


def _cfg(**overrides):
    return derive(make_config("cpu-tiny", min_size=96, max_size=128, **overrides), 1, "cpu")


def _shapes_seen(cfg, sizes) -> set:
    model = build_model(cfg, 4).eval()
    seen = set()
    model.backbone.register_forward_pre_hook(lambda module, args: seen.add(tuple(args[0].shape)))
    with torch.inference_mode():
        for height, width in sizes:
            model([torch.rand(3, height, width)])
    return seen


def test_fixed_shapes_leave_three_input_shapes_whatever_the_image_sizes():
    sizes = [(h, w) for h in (60, 97, 130, 200) for w in (61, 99, 150, 310)]
    assert len(_shapes_seen(_cfg(), sizes)) > 3  # natural padding: a shape per size class
    assert _shapes_seen(_cfg(fixed_shapes=True), sizes) <= {(1, 3, 96, 128), (1, 3, 128, 96), (1, 3, 128, 128)}


def _landscape_batch(count: int = 2) -> tuple[list, list]:
    """96 x 128 images: at min_size 96 / max_size 128 their natural batch already has the fixed shape."""
    images, targets = [], []
    gen = torch.Generator().manual_seed(0)
    for k in range(count):
        images.append(torch.randint(0, 256, (3, 96, 128), dtype=torch.uint8, generator=gen))
        masks = torch.zeros(2, 96, 128, dtype=torch.uint8)
        masks[0, 10:50, 10:60] = 1
        masks[1, 40:90, 70:120] = 1
        targets.append({"boxes": torch.tensor([[10.0, 10, 60, 50], [70, 40, 120, 90]]),
                        "labels": torch.tensor([1, 2 + k % 2]), "masks": masks})
    return images, targets


@pytest.mark.parametrize("variant", [dict(channels_last=True), dict(fixed_shapes=True)])
def test_layout_variants_give_the_eager_losses(variant):
    images, targets = _landscape_batch()
    eager = _losses(_cfg(), images, targets)
    other = _losses(_cfg(**variant), images, targets)
    assert other.keys() == eager.keys()
    assert all(abs(other[k] - eager[k]) <= 1e-4 * max(1.0, abs(eager[k])) for k in eager), (eager, other)


def test_compiled_backbone_gives_the_eager_losses():
    images, targets = _landscape_batch()
    eager = _losses(_cfg(), images, targets)
    compiled = _losses(_cfg(), images, targets, compile_with="aot_eager")
    assert all(abs(compiled[k] - eager[k]) <= 1e-4 * max(1.0, abs(eager[k])) for k in eager), (eager, compiled)


def test_a_recompilation_storm_is_caught_and_fixed_shapes_prevent_it():
    """Counted with the cheap 'eager' backend: recompilation is decided by torch.compile's guards,
    whatever backend compiles."""
    # natural padding turns these into 6 batch shapes (96x96, 96x128, 128x96, 128x64, 64x128, 32x128)
    sizes = [(96, 96), (96, 128), (128, 96), (200, 96), (96, 200), (96, 400)]

    def compiled_graphs(cfg) -> int:
        model = build_model(cfg, 4).eval()
        compile_backbone(model, "cpu", backend="eager")
        before = compilations()
        with torch.inference_mode():
            for height, width in sizes:
                model([torch.rand(3, height, width)])
        return compilations() - before

    assert compiled_graphs(_cfg()) >= 10  # a storm: each new shape compiles the backbone and the RPN head again
    assert compiled_graphs(_cfg(fixed_shapes=True)) <= 4  # two orientations: backbone + RPN head, once each
