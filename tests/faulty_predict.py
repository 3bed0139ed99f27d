"""predict with a fault planted from outside the package (the package has no test hooks).

    torchrun ... tests/faulty_predict.py --stall-rank R --markers DIR -- <predict flags>

Rank R creates DIR/stalled and sleeps where it would predict its images (a rank that stops
answering, for a test to kill); every other rank, once its own images are predicted, creates
DIR/gathering<rank> and goes on into the collective that gathers the results, where it waits for R.
"""
import argparse
import os
import sys
import time
from pathlib import Path

from maskrcnn_tut import predict

parser = argparse.ArgumentParser()
parser.add_argument("--stall-rank", type=int, required=True)
parser.add_argument("--markers", type=Path, required=True)
args, rest = parser.parse_known_args()
rest = rest[1:] if rest[:1] == ["--"] else rest
rank = int(os.environ.get("RANK", 0))
gather_results = predict.gather_results


def stalled(*_, **__):
    (args.markers / "stalled").touch()
    time.sleep(600)


def gathering(*call, **kwargs):
    (args.markers / f"gathering{rank}").touch()
    return gather_results(*call, **kwargs)


if rank == args.stall_rank:
    predict.predict_shard = stalled
else:
    predict.gather_results = gathering
sys.exit(predict.main(rest))
