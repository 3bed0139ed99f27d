"""The shapes dataset is COCO as COCO's own files are written, so loaders we did not write read it.

Every instance (`iscrowd: 0`) is a polygon list; torchvision's `CocoDetection` with pycocotools'
`annToMask` (and torchvision's transforms-v2 wrapper) decode exactly the masks our loader trains
on; and the masks agree with the pixels painted for each shape (IoU >= 0.9 per instance).
"""
import json

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from pycocotools import mask as mask_utils
from shapely.geometry import Polygon

from maskrcnn_tut.data.coco import CocoDetection, coco_paths
from maskrcnn_tut.data.shapes import MIN_AREA, coco_polygons, render_image

#: Least IoU of an instance's decoded polygons with the pixels painted for it. Unhidden shapes
#: match exactly; where a later shape's edge crosses, rasterizing the visible polygon and the later
#: polygon may both claim or both leave a boundary pixel (0.975 is the worst of 4000 instances).
MIN_IOU = 0.9


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_instance_is_a_polygon_list_as_in_coco(shapes_root, split):
    data = json.loads(coco_paths(shapes_root, split)[1].read_text())
    assert data["annotations"]
    for ann in data["annotations"]:
        assert ann["iscrowd"] == 0
        seg = ann["segmentation"]
        assert isinstance(seg, list) and seg, ann["id"]
        for polygon in seg:
            assert isinstance(polygon, list) and len(polygon) >= 6 and len(polygon) % 2 == 0, ann["id"]
            assert all(isinstance(v, (int, float)) for v in polygon)


@pytest.mark.parametrize("split", ["train", "val"])
def test_torchvision_and_pycocotools_decode_exactly_our_targets(shapes_root, split):
    image_dir, ann_file = coco_paths(shapes_root, split)
    theirs = torchvision.datasets.CocoDetection(str(image_dir), str(ann_file))
    wrapped = torchvision.datasets.wrap_dataset_for_transforms_v2(
        theirs, target_keys={"image_id", "boxes", "masks", "labels"})
    ours = CocoDetection(image_dir, ann_file, train=False)
    assert not ours.report.counts  # nothing to repair or drop
    index_of = {info["id"]: index for index, info in enumerate(ours.images)}
    assert sorted(index_of) == sorted(theirs.ids)
    for index, image_id in enumerate(theirs.ids):
        image, anns = theirs[index]
        our_image, target = ours.load(index_of[image_id])
        assert torch.equal(our_image, torch.from_numpy(np.array(image)).permute(2, 0, 1))
        masks = np.stack([theirs.coco.annToMask(ann) for ann in anns])
        assert torch.equal(target["masks"], torch.from_numpy(masks)), image_id
        _, their_target = wrapped[index]
        assert torch.equal(target["masks"], their_target["masks"].to(torch.uint8))
        assert torch.equal(target["boxes"], their_target["boxes"].float())
        assert [ours.label_to_cat[label] for label in target["labels"].tolist()] == their_target["labels"].tolist()


def test_masks_agree_with_the_painted_shapes(shapes_root):
    """Re-render the train images (write_split's seeds) and compare each annotation with its shape."""
    image_dir, ann_file = coco_paths(shapes_root, "train")
    data = json.loads(ann_file.read_text())
    checked = 0
    for info in data["images"]:
        image, shapes = render_image(np.random.default_rng([0, 0, info["id"] - 1]))
        assert np.array_equal(np.asarray(image), np.asarray(Image.open(image_dir / info["file_name"])))
        kept = [s for s in shapes if s["mask"].sum() >= MIN_AREA]
        anns = [a for a in data["annotations"] if a["image_id"] == info["id"]]
        assert [a["category_id"] for a in anns] == [s["category_id"] for s in kept]
        for ann, shape in zip(anns, kept):
            rle = mask_utils.merge(mask_utils.frPyObjects(ann["segmentation"], info["height"], info["width"]))
            mask = mask_utils.decode(rle).astype(bool)
            iou = (mask & shape["mask"]).sum() / (mask | shape["mask"]).sum()
            assert iou >= MIN_IOU, (ann["id"], iou)
            checked += 1
    assert checked >= len(data["images"])


def test_a_shape_inside_another_becomes_hole_free_polygons():
    outer = Polygon([(10, 10), (90, 10), (90, 90), (10, 90)])
    inner = Polygon([(40.5, 40.5), (60.5, 40.5), (60.5, 60.5), (40.5, 60.5)])
    polygons = coco_polygons(outer.difference(inner))
    assert len(polygons) == 2  # COCO polygons have no holes: cut through the hole
    decoded = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects(polygons, 100, 100))).astype(bool)
    expected = np.zeros((100, 100), dtype=bool)
    expected[10:90, 10:90] = True
    expected[41:61, 41:61] = False
    assert np.array_equal(decoded, expected)
