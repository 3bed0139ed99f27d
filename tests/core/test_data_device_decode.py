"""`--decode-on-device`: JPEG bytes from the workers, decoded and augmented in the main process.

On this CPU machine the device is the CPU, so the checks are that the path gives the samples the
worker path gives (same flips from the same seed, same masks and boxes, the same pixels up to the
decoder's rounding), keeps what it cannot decode in the workers, and counts what fails.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import run_flags, run_train
from PIL import Image

from maskrcnn_tut.data.coco import CocoDetection
from maskrcnn_tut.data.device_decode import Encoded, decode_batch
from maskrcnn_tut.data.loader import train_transforms

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def jpeg_root(shapes_root, tmp_path_factory):
    """The small shapes dataset with its train images as JPEGs, except the first, left a PNG."""
    root = tmp_path_factory.mktemp("jpeg") / "shapes"
    shutil.copytree(shapes_root, root)
    ann = root / "annotations" / "instances_train2017.json"
    data = json.loads(ann.read_text())
    for image in data["images"][1:]:
        png = root / "train2017" / image["file_name"]
        image["file_name"] = png.with_suffix(".jpg").name
        Image.open(png).convert("RGB").save(png.with_suffix(".jpg"), quality=95)
        png.unlink()
    ann.write_text(json.dumps(data))
    return root


def _datasets(root):
    kwargs = dict(image_dir=root / "train2017", ann_file=root / "annotations" / "instances_train2017.json",
                  transforms=train_transforms())
    in_workers, on_device = CocoDetection(**kwargs), CocoDetection(**kwargs)
    on_device.decode_device = CPU
    return in_workers, on_device


def test_device_path_gives_the_worker_paths_samples(jpeg_root):
    in_workers, on_device = _datasets(jpeg_root)
    flips = set()
    for index in range(1, 9):
        seed = 1000 + index
        image, target = in_workers[(index, seed)]
        encoded, raw_target = on_device[(index, seed)]
        assert isinstance(encoded, Encoded) and encoded.seed == seed and encoded.data.dim() == 1
        (decoded,), (decoded_target,) = decode_batch([encoded], [raw_target], on_device.transforms, CPU, None)
        assert torch.equal(decoded_target["masks"], target["masks"])  # the same flip, from the same seed
        assert torch.equal(decoded_target["boxes"], target["boxes"])
        assert decoded.shape == image.shape
        assert (decoded.int() - image.int()).abs().float().mean() < 1.0  # decoders round differently
        unflipped = in_workers.load(index)[1]["masks"]
        flips.add(not torch.equal(unflipped, target["masks"]))
    assert flips == {True, False}  # both outcomes were checked


def test_files_the_device_cannot_take_are_decoded_in_the_worker(jpeg_root):
    _, on_device = _datasets(jpeg_root)
    image, _ = on_device[(0, 7)]  # the PNG
    assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3


def test_an_undecodable_jpeg_is_dropped_from_its_batch_and_reported():
    good = Encoded(torch.frombuffer(bytearray(_jpeg_bytes()), dtype=torch.uint8))
    bad = Encoded(torch.frombuffer(bytearray(b"\xff\xd8\xff\xe0 not a jpeg"), dtype=torch.uint8))
    failed = []
    images, targets = decode_batch([good, bad], [{"image_id": 1}, {"image_id": 2}], None, CPU,
                                   lambda target, err: failed.append(target["image_id"]))
    assert failed == [2] and [t["image_id"] for t in targets] == [1] and images[0].shape == (3, 8, 8)


def _jpeg_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="JPEG")
    return buffer.getvalue()


@pytest.mark.system
def test_train_py_runs_with_decode_on_device(jpeg_root, tmp_path):
    flags = run_flags(jpeg_root, tmp_path / "run", "--max-steps", "2", "--decode-on-device", "--workers", "1")
    done = run_train(*flags)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["load_failed"] == 0


def test_benchmarks_time_the_decode_on_device_path(jpeg_root, monkeypatch):
    """The benchmark harness once built its loader without the device, so `--decode-on-device` left
    the dataset decoding in the workers and every benchmark timed the other path."""
    from maskrcnn_tut.data import loader
    from maskrcnn_tut.lab import bench

    decoded = []
    decode = loader.decode_batch

    def counting(images, *args):
        decoded.append(len(images))
        return decode(images, *args)

    monkeypatch.setattr(loader, "decode_batch", counting)
    cfg = bench.bench_config("cpu-tiny", str(jpeg_root), decode_on_device=True, batch_size=2, min_size=64, max_size=96)
    bench.measure(cfg, steps=1, warmup=0)
    assert decoded == [2]  # the one measured step's batch, decoded on the device
