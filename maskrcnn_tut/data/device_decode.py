"""`--decode-on-device`: JPEGs decoded on the training device (nvJPEG on GPUs), not in the workers.

Decoding a COCO photo costs a DataLoader worker about as much CPU as the rest of its sample, and a
GPU server often has fewer free cores per GPU than the loader wants. With this option a worker only
reads the file's bytes (and builds the target, masks included); the main process decodes the whole
batch in one `torchvision.io.decode_jpeg(..., device=)` call and then runs the sample's random
transforms there, on the device, from the same seed the worker would have used, so augmentation
stays a function of the sample and a resumed run sees the same flips.

What stays in the workers, decoded by PIL as without the option: files that are not JPEG (PNG,
say), JPEGs whose EXIF orientation rotates them, and JPEGs that are not plain RGB or grayscale
(CMYK). A JPEG that fails on the device is decoded again on the CPU; one that fails there too is
dropped from its batch and counted as `load_failed` (the worker's header check makes that rare).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import io as tv_io
from torchvision import tv_tensors

#: EXIF tag of the orientation; 1 means "as stored".
_ORIENTATION = 0x0112


@dataclass
class Encoded:
    """A JPEG's bytes (a 1-D uint8 tensor), to decode later on the device, and the seed its
    random transforms draw from then (None: the process's own RNG)."""

    data: torch.Tensor
    seed: int | None = None


def read_encoded(path: Path, width: int, height: int) -> Encoded | None:
    """The file's bytes when the device can decode them as they are, else None (decode on the CPU).

    The file is read once; PIL parses only its header from memory: the format, the size the
    start-up scan saw, the colour mode and the EXIF orientation."""
    raw = np.fromfile(path, dtype=np.uint8)  # an array of its own, so the tensor can move to the main process
    with Image.open(io.BytesIO(raw)) as img:
        plain = (img.format == "JPEG" and img.size == (width, height) and img.mode in ("RGB", "L")
                 and img.getexif().get(_ORIENTATION, 1) == 1)
    return Encoded(torch.from_numpy(raw)) if plain else None


def apply_transforms(transforms, image, target, seed: int | None):
    """`transforms(image, target)`, drawn from `seed` (the process's own RNG when None), leaving the
    process's RNG as it was: augmentation is a function of the sample, wherever it runs. Only the CPU
    generator, which the transforms draw from, is seeded: `torch.manual_seed` would also reseed every
    GPU's generator (RPN and RoI sampling) with the last sample's seed."""
    if seed is None:
        return transforms(image, target)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return transforms(image, target)


def decode_batch(images: list, targets: list, transforms, device: torch.device, on_failure) -> tuple[list, list]:
    """`images` with every `Encoded` one decoded on `device`, its target moved there and the random
    transforms applied; the others are left as the workers made them. `on_failure(target, err)` is
    called for an image that neither the device nor the CPU can decode; it is dropped."""
    encoded = [i for i, image in enumerate(images) if isinstance(image, Encoded)]
    if not encoded:
        return list(images), list(targets)
    data = [images[i].data for i in encoded]
    if device.type == "cuda":
        # nvJPEG writes on a stream of its own that does not wait for ours, into memory the caching
        # allocator may just have taken back from kernels still queued there (the last optimizer step)
        torch.cuda.current_stream(device).synchronize()
    try:
        decoded = tv_io.decode_jpeg(data, mode=tv_io.ImageReadMode.RGB, device=device)
    except RuntimeError:  # one bad file fails the whole call: decode one by one, the CPU as fallback
        decoded = [_decode_one(d, device) for d in data]
    images, targets = list(images), list(targets)
    dropped = []
    for i, pixels in zip(encoded, decoded):
        if isinstance(pixels, Exception):
            on_failure(targets[i], pixels)
            dropped.append(i)
            continue
        target = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in targets[i].items()}
        image = tv_tensors.Image(pixels)
        if transforms is not None:
            image, target = apply_transforms(transforms, image, target, images[i].seed)
        images[i], targets[i] = image, target
    keep = [i for i in range(len(images)) if i not in dropped]
    return [images[i] for i in keep], [targets[i] for i in keep]


def _decode_one(data: torch.Tensor, device: torch.device):
    """One JPEG on `device`, else on the CPU (then moved), else the exception."""
    try:
        return tv_io.decode_jpeg(data, mode=tv_io.ImageReadMode.RGB, device=device)
    except RuntimeError:
        try:
            return tv_io.decode_jpeg(data, mode=tv_io.ImageReadMode.RGB).to(device)
        except RuntimeError as err:
            return err
