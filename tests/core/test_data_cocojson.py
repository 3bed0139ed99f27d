"""The annotations json read a piece at a time (`data.cocojson.read_coco`) cleans to exactly what reading
it whole does, on the broken dataset's every problem kind and on what the layout of a json may vary
(key order, white space, string ids, non-ASCII names, keys given twice, chunks that cut numbers), and
holds a fraction of the file where parsing it whole held several times it."""
from __future__ import annotations

import json
import os
import shutil
import tracemalloc

import pytest
from broken_coco import write_broken_coco

from maskrcnn_tut.data.clean import clean_coco, load_coco_json
from maskrcnn_tut.data.cocojson import CocoIndex, read_coco
from maskrcnn_tut.errors import DataError

CHUNKS = (1, 7, 4096, None)  # None: the default (the whole small file in one chunk)


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    broken = write_broken_coco(tmp_path_factory.mktemp("broken"), good_images=2)
    images = broken.root / "train2017"
    for name in ("good_0.png", "good_1.png"):
        shutil.copy(images / name, images / name.replace("good", "画像é"))
    return broken


def _variants(base: dict) -> dict[str, str]:
    """The broken train split's json written as exporters vary it."""
    string_ids = json.loads(json.dumps(base))
    for img in string_ids["images"][::2]:
        if isinstance(img.get("id"), int):
            old, img["id"] = img["id"], f"img-{img['id']}"
            for ann in string_ids["annotations"]:
                if isinstance(ann, dict) and ann.get("image_id") == old:
                    ann["image_id"] = img["id"]
    unicode = json.loads(json.dumps(base))
    for img in unicode["images"]:
        if isinstance(img, dict) and img.get("file_name") in ("good_0.png", "good_1.png"):
            img["file_name"] = img["file_name"].replace("good", "画像é")
            img["note"] = 'ünïcødé \u2028 \\" ]}'
    return {
        "plain": json.dumps(base),
        "reordered": json.dumps({"categories": base["categories"], "annotations": base["annotations"],
                                 "info": {"x": [1, {"y": "]}[{"}]}, "images": base["images"]}, indent=2),
        "string_ids": json.dumps(string_ids),
        "unicode": json.dumps(unicode, ensure_ascii=False, separators=(",", ":")),
        "unicode_escaped": json.dumps(unicode),
        "keys_twice": ('{"images": [{"id": 5, "file_name": "x.png"}], "annotations": "no", '
                       + json.dumps(base)[1:-1] + ', "info": 1, "info": 2.5e3 }\n\n'),
        "odd_elements": json.dumps({**base, "annotations": [*base["annotations"], 12345, -0.0, 1e308, True, None,
                                                            "s", [1, [2]], {"image_id": 1.5}]}),
    }


def _cleaned(index: CocoIndex, image_dir, train: bool) -> tuple:
    records, report, sizes = clean_coco(index, image_dir, train=train)
    examples = {kind: found for kind, found in report.examples.items() if found}
    return [bytes(records.raw(i)) for i in range(len(records))], dict(report.counts), examples, sizes.tolist()


@pytest.mark.parametrize("train", [True, False])
def test_a_json_read_a_piece_at_a_time_cleans_to_what_reading_it_whole_does(broken, tmp_path, train):
    base = json.loads((broken.root / "annotations" / "instances_train2017.json").read_text())
    image_dir = broken.root / "train2017"
    for name, text in _variants(base).items():
        path = tmp_path / f"{name}.json"
        path.write_text(text, encoding="utf-8")
        whole = _cleaned(CocoIndex.build(load_coco_json(path)), image_dir, train)
        assert whole[0] and whole[1]["duplicate_annotation_id"] == 2, name  # the problems are there to compare
        for chunk in CHUNKS:
            index = read_coco(path, *([chunk] if chunk else []))
            assert index.annotations.path == path, (name, chunk)  # streamed, not read whole again
            assert _cleaned(index, image_dir, train) == whole, (name, chunk)


@pytest.mark.parametrize("text", [
    "", "not json", "[1, 2]", '{"images": [1,], "annotations": [], "categories": []}', '{"images": [] "a": 1}',
    '{"images": [{"id": 1, "file_name": "a.png"}], "annotations": [], "categories": [{"id": 1}]} x',
    '{"images": [{"id": 1, "file_name": "a.png"}], "annotations": [{"id": 1}, ', '\ufeff{"images": []}',
    '{"images": [' + "[" * 5000 + "]" * 5000 + '], "annotations": [], "categories": []}',
    '{"images": {}, "annotations": [], "categories": [{"id": 1}]}', '{"images": [], "annotations": [], "categories": []}',
    '{"images": [{"id": 1, "file_name": "a.png"}], "annotations": [], "categories": [{"id": 1}, {"id": 1}]}',
    '{"images": [{"id": ' + "9" * 5000 + ', "file_name": "a.png"}], "annotations": [], "categories": [{"id": 1}]}',
])
def test_a_bad_json_is_the_one_line_reading_it_whole_gives(tmp_path, text):
    path = tmp_path / "instances.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as whole:
        load_coco_json(path)
    for chunk in (3, 4096):
        with pytest.raises(DataError) as streamed:
            read_coco(path, chunk)
        assert str(streamed.value) == str(whole.value) and "\n" not in str(whole.value)


def test_a_json_rewritten_between_reading_and_cleaning_is_one_line(broken, tmp_path):
    path = tmp_path / "instances.json"
    shutil.copy(broken.root / "annotations" / "instances_train2017.json", path)
    index = read_coco(path)
    path.write_text(path.read_text() + " ")
    with pytest.raises(DataError, match="changed while it was being read"):
        clean_coco(index, broken.root / "train2017")


def _python_peak_mb(read, path) -> float:
    tracemalloc.start()
    try:
        read(path)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_reading_holds_a_fraction_of_the_file_where_parsing_it_whole_held_several_times_it(tmp_path):
    """COCO's shape (7 instances an image, polygons of 8-40 points with 2 decimals) at 1/100 of its
    size: the Python objects reading leaves and builds at its peak, against the file's size."""
    images = [{"id": k, "file_name": f"{k:012d}.jpg", "width": 640, "height": 480} for k in range(1, 1201)]
    annotations = [{"id": n, "image_id": n % 1200 + 1, "category_id": 1, "iscrowd": 0, "area": 1234.5,
                    "bbox": [10.5, 20.25, 100.0, 80.75],
                    "segmentation": [[round(100 + (n * 7 + i * 13) % 300 + i / 7, 2) for i in range(16 + 2 * (n % 25))]]}
                   for n in range(1, 8601)]
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": [{"id": 1}]}))
    del images, annotations
    file_mb = os.path.getsize(path) / 2**20
    chunk = 1 << 18
    streamed_mb = _python_peak_mb(lambda p: read_coco(p, chunk), path)
    whole_mb = _python_peak_mb(lambda p: CocoIndex.build(load_coco_json(p)), path)
    assert whole_mb > 4 * file_mb, (whole_mb, file_mb)  # what one rank held at COCO's size: 3.2 GB
    assert streamed_mb < 0.8 * file_mb + 3 * chunk / 2**20, (streamed_mb, file_mb)  # ~200 bytes an annotation
