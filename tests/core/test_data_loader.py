"""The shapes dataset is real COCO and goes through the same loader users' data goes through."""
import json

import pytest
import torch
from pycocotools import mask as mask_utils

from maskrcnn_tut.config import derive, make_config
from maskrcnn_tut.data.coco import CocoDetection, coco_paths
from maskrcnn_tut.data.loader import build_eval_loader, build_train_loader, train_transforms
from maskrcnn_tut.data.shapes import write_split
from maskrcnn_tut.errors import DataError


def test_shapes_are_deterministic_coco_with_polygons(tmp_path, shapes_root):
    again = write_split(tmp_path, "train", 60, seed=0, progress=False)
    original = shapes_root / "annotations" / "instances_train2017.json"
    assert json.loads(again.read_text()) == json.loads(original.read_text())
    data = json.loads(original.read_text())
    assert {type(a["segmentation"]).__name__ for a in data["annotations"]} == {"list"}  # as COCO: polygons
    assert any(len(a["segmentation"]) > 1 for a in data["annotations"])  # a shape cut in pieces
    assert {c["name"] for c in data["categories"]} == {"square", "circle", "triangle"}
    for ann in data["annotations"]:
        img = next(i for i in data["images"] if i["id"] == ann["image_id"])
        rle = mask_utils.merge(mask_utils.frPyObjects(ann["segmentation"], img["height"], img["width"]))
        assert int(mask_utils.area(rle)) == ann["area"]  # area and box of the decoded mask, as COCO
        assert [float(v) for v in mask_utils.toBbox(rle)] == ann["bbox"]


def test_targets_masks_follow_a_flip(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "train"), transforms=train_transforms())
    flips = 0
    for seed in range(8):
        image, target = dataset[(0, seed)]
        plain_image, plain = dataset.load(0)
        if not torch.equal(image, plain_image):
            flips += 1
            assert torch.equal(image, plain_image.flip(-1))
            assert torch.equal(target["masks"], plain["masks"].flip(-1))
            width = plain_image.shape[-1]
            assert torch.allclose(target["boxes"][:, 0], width - plain["boxes"][:, 2])
        again, _ = dataset[(0, seed)]
        assert torch.equal(again, image)  # augmentation is a function of the sample's seed
    assert 0 < flips < 8


def test_crowd_excluded_categories_remapped_and_bad_boxes_counted(tmp_path, shapes_root):
    data = json.loads((shapes_root / "annotations" / "instances_val2017.json").read_text())
    for cat in data["categories"]:
        cat["id"] *= 10  # sparse ids, as in COCO itself
    for ann in data["annotations"]:
        ann["category_id"] *= 10
    data["annotations"][0]["iscrowd"] = 1
    data["annotations"][1]["bbox"] = [5, 5, 0, 10]
    path = tmp_path / "val.json"
    path.write_text(json.dumps(data))
    dataset = CocoDetection(shapes_root / "val2017", path, train=True)
    assert dataset.cat_to_label == {10: 1, 20: 2, 30: 3}
    assert dataset.report.counts["crowd"] == 1 and dataset.report.counts["degenerate_box"] == 1
    labels = torch.cat([dataset.load(i)[1]["labels"] for i in range(len(dataset))])
    assert set(labels.tolist()) <= {1, 2, 3}
    n_usable = sum(len(t) for t in dataset.targets)
    assert n_usable == len(data["annotations"]) - 2


def test_distributed_loader_gives_each_rank_disjoint_batches(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "train"), transforms=train_transforms())
    cfg = derive(make_config("cpu-tiny", workers=0, batch_size=3), 1, "cpu")
    seen = []
    for rank in range(2):
        loader = build_train_loader(dataset, cfg, rank, 2)
        loader.batch_sampler.set_epoch(0)
        ids = [t["image_id"] for _, targets in loader for t in targets]
        assert len(ids) == len(loader) * 3
        seen.append(set(ids))
    assert not seen[0] & seen[1]


def test_resumed_loader_skips_consumed_batches(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "train"), transforms=train_transforms())
    cfg = derive(make_config("cpu-tiny", workers=0, batch_size=4, aspect_ratio_group_factor=3), 1, "cpu")
    loader = build_train_loader(dataset, cfg, 0, 1)
    loader.batch_sampler.set_epoch(2)
    full = [[t["image_id"] for t in targets] for _, targets in loader]
    loader.batch_sampler.set_epoch(2, skip=3)
    resumed = [[t["image_id"] for t in targets] for _, targets in loader]
    assert resumed == full[3:]


def test_a_dataset_smaller_than_one_global_batch_is_one_line_data_error(shapes_root):
    dataset = CocoDetection(*coco_paths(shapes_root, "val"))
    batch_size = len(dataset) // 2 + 1
    cfg = derive(make_config("cpu-tiny", workers=0, batch_size=batch_size), 1, "cpu")
    assert len(build_train_loader(dataset, cfg, 0, 1)) >= 1  # fits one process
    with pytest.raises(DataError) as caught:
        build_train_loader(dataset, cfg, 0, 2)
    message = str(caught.value)
    assert f"{len(dataset)} usable training images" in message and "\n" not in message
    assert f"--batch-size {batch_size} on 2 process(es)" in message
    assert caught.value.exit_code == 2


def test_serialized_records_hold_the_json_targets_in_memory_in_the_cache_and_in_a_spawned_worker(
        shapes_root, tmp_path, monkeypatch):
    """The flat pickled storage (and its memory-mapped cache) gives exactly the targets pycocotools
    decodes from the json, and the same ground truth, sizes and report, however it was built."""
    import pickle

    import numpy as np
    from pycocotools.coco import COCO

    from maskrcnn_tut.data import records

    monkeypatch.setattr(records, "CACHE_MIN_IMAGES", 1)  # the shapes are small: cache them anyway
    image_dir, ann_file = coco_paths(shapes_root, "train")
    plain = CocoDetection(image_dir, ann_file)
    built = CocoDetection(image_dir, ann_file, cache_dir=tmp_path)  # cleans and writes the cache
    mapped = CocoDetection(image_dir, ann_file, cache_dir=tmp_path)  # maps the file
    assert len(list(tmp_path.glob("*.records"))) == 1 and isinstance(mapped.records.buffer, np.memmap)
    spawned = pickle.loads(pickle.dumps(mapped))  # as a spawned worker receives it: mapped again
    assert isinstance(spawned.records.buffer, np.memmap) and len(pickle.dumps(mapped)) < mapped.records.nbytes
    coco = COCO(str(ann_file))
    for index in range(len(plain)):
        image, target = plain.load(index)
        anns = coco.loadAnns(coco.getAnnIds(imgIds=target["image_id"]))
        assert torch.equal(target["masks"], torch.from_numpy(np.stack([coco.annToMask(a) for a in anns])))
        xyxy = [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)]
        assert torch.equal(target["boxes"], torch.tensor(xyxy, dtype=torch.float32))
        assert target["labels"].tolist() == [plain.cat_to_label[a["category_id"]] for a in anns]
        for other in (built, mapped, spawned):
            other_image, other_target = other.load(index)
            assert torch.equal(image, other_image)
            assert all(torch.equal(target[k], other_target[k]) for k in ("boxes", "masks", "labels"))
    for other in (built, mapped, spawned):
        assert other.ground_truth() == plain.ground_truth() and other.aspect_ratios() == plain.aspect_ratios()
        assert other.report.counts == plain.report.counts and other.num_instances == plain.num_instances
    assert plain.num_instances == sum(len(t) for t in plain.targets) == len(coco.getAnnIds())


def test_the_records_cache_follows_a_changed_json(shapes_root, tmp_path, monkeypatch):
    from maskrcnn_tut.data import records

    monkeypatch.setattr(records, "CACHE_MIN_IMAGES", 1)
    image_dir, ann_file = coco_paths(shapes_root, "val")
    copy = tmp_path / "val.json"
    copy.write_text(ann_file.read_text())
    first = CocoDetection(image_dir, copy, cache_dir=tmp_path / "cache")
    data = json.loads(copy.read_text())
    data["annotations"] = data["annotations"][1:]
    copy.write_text(json.dumps(data))
    second = CocoDetection(image_dir, copy, cache_dir=tmp_path / "cache")
    assert second.num_instances == first.num_instances - 1
    assert len(list((tmp_path / "cache").glob("*.records"))) == 1  # the stale cache was removed


def test_evaluation_loads_with_every_worker_and_decodes_no_masks(shapes_root):
    """S2: the evaluation loader had one worker whatever --workers said, and decoded every ground-truth
    mask although evaluation scores against the json; its boxes, labels and images are training's."""
    dataset = CocoDetection(*coco_paths(shapes_root, "val"), train=False)
    cfg = derive(make_config("cpu-tiny", workers=2, batch_size=2), 1, "cpu")
    loader = build_eval_loader(dataset, cfg, 0, 1)
    assert loader.num_workers == 2 and not loader.persistent_workers
    images, targets = next(iter(loader))
    assert all("masks" not in target for target in targets)
    for image, target, k in zip(images, targets, range(2)):
        full_image, full = dataset.load(k)
        assert torch.equal(image, full_image) and full["masks"].shape[0] == len(full["boxes"]) > 0
        assert torch.equal(target["boxes"], full["boxes"]) and torch.equal(target["labels"], full["labels"])


def test_the_default_worker_count_leaves_the_cores_to_the_training_threads(monkeypatch):
    """Without --workers: 1 on CPUs (the training threads use every core); on GPUs one less than the
    process's share of the cores, at least 1 and at most 4; --workers, when given, always wins."""
    from maskrcnn_tut.data import loader as data_loader
    cpu, gpu = (derive(make_config("gpu-r50"), 8, device) for device in ("cpu", "cuda"))
    assert data_loader.worker_count(cpu) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for cores, expected in [(8, 1), (16, 1), (24, 2), (64, 4)]:
        monkeypatch.setattr(data_loader, "usable_cores", lambda cores=cores: cores)
        assert data_loader.worker_count(gpu) == expected, cores
    assert data_loader.worker_count(derive(make_config("gpu-r50", workers=6), 8, "cuda")) == 6
