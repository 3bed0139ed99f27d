"""Synthetic detection batches: random square images with box-shaped masks, for measurements that
must not depend on a dataset (memory by image size, the loop's overhead, the GPU tests)."""
from __future__ import annotations

import torch


def synthetic_batch(image_size: int, batch_size: int, objects: int = 3, seed: int = 0) -> tuple[list, list]:
    """`batch_size` random uint8 square images, each with `objects` boxes and box-shaped masks."""
    gen = torch.Generator().manual_seed(seed)
    images, targets = [], []
    for _ in range(batch_size):
        images.append(torch.randint(0, 256, (3, image_size, image_size), dtype=torch.uint8, generator=gen))
        boxes, masks = [], torch.zeros(objects, image_size, image_size, dtype=torch.uint8)
        for k in range(objects):
            w, h = torch.randint(image_size // 8, image_size // 2, (2,), generator=gen).tolist()
            x = int(torch.randint(0, image_size - w, (1,), generator=gen))
            y = int(torch.randint(0, image_size - h, (1,), generator=gen))
            boxes.append([x, y, x + w, y + h])
            masks[k, y:y + h, x:x + w] = 1
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32),
                        "labels": torch.arange(objects) % 3 + 1, "masks": masks})
    return images, targets
