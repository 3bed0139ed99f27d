"""The COCO-scale bench (`lab.bench.coco_scale`) at 1/24 of COCO's size: the process that cleans the
dataset peaks in proportion to the annotations json, not at the several times its size that parsing it
whole cost (7x: 3.2 GB for COCO's 473 MB, tests/core/test_data_cocojson.py shows why), and two ranks
starting together share one cleaning."""
from __future__ import annotations

import json

import pytest

from maskrcnn_tut.lab.bench import coco_scale


@pytest.mark.system
def test_the_cleaning_process_peaks_in_proportion_to_the_json(tmp_path):
    assert coco_scale.main(["--out", str(tmp_path), "--images", "5000", "--instances", "30000",
                            "--skip", "workers", "gather"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    first, ranks = results["first_start"], results["ranks_first_start"]
    assert first["images"] > 4900 and results["json_mb"] >= 15
    # what the cleaning adds at its peak: the json's index and the cleaned records, twice while they are
    # joined (at COCO's size 787 MB for a 473 MB json; parsing it whole, 3,234 MB)
    assert first["peak_rss_mb"] <= 2.5 * results["json_mb"] + 20, (first, results["json_mb"])
    assert results["startup_largest_process_mb"] == max(first["process_peak_mb"], results["cached_start"]["process_peak_mb"],
                                                        *ranks["rank_peak_mb"])
    assert ranks["ranks"] == 2 and max(ranks["rank_dataset_rss_mb"]) < results["json_mb"]
