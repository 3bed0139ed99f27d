"""`python -m maskrcnn_tut.predict` as an operator meets it (issue 36's probes), in processes of its own:
stopped by SIGTERM mid-run, on 1 process (the terminal's or SLURM's signal to every process) and under
torchrun on 2 (Kubernetes' signal to torchrun, which passes it on), with 2 DataLoader workers each, then
run again into the same folder; and a large photo with many detections, whose peak memory is measured."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoints import resumable_payload
from conftest import REPO, subprocess_env, train_command
from PIL import Image

PACKAGE_TRACEBACK = re.compile(r'File ".*maskrcnn_tut/')
IMAGES = 40


@pytest.fixture(scope="module")
def checkpoint(small_shapes, tmp_path_factory):
    """A cpu-tiny checkpoint at 96/128 px (untrained: 100 detections an image at --score-threshold 0)."""
    path = tmp_path_factory.mktemp("predict-operator") / "last.pt"
    torch.save(resumable_payload(3, data_path=str(small_shapes), min_size=96, max_size=128), path)
    return path


def _predict(checkpoint, out: Path, folder: Path, nproc: int, log: Path) -> subprocess.Popen:
    flags = ["--checkpoint", str(checkpoint), "--out", str(out), "--workers", "2", "--batch-size", "1",
             "--no-progress", "--score-threshold", "0", str(folder)]
    with open(log, "w") as sink:
        return subprocess.Popen(train_command(*flags, nproc=nproc, script=("-m", "maskrcnn_tut.predict")),
                                stdout=sink, stderr=subprocess.STDOUT, env=subprocess_env(), start_new_session=True)


def _session(sid: int) -> list[int]:
    """The processes still alive in session `sid` (the command's, its ranks' and their workers')."""
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        if entry.name.isdigit() and fields[0] != "Z" and int(fields[3]) == sid:
            alive.append(int(entry.name))
    return alive


def _consistent_pair(out: Path) -> dict:
    """images.json, checked against detections.json: the same images, none of the earlier run's."""
    images = json.loads((out / "images.json").read_text())
    detected = {result["image_id"] for result in json.loads((out / "detections.json").read_text())}
    assert detected == set(images.values()) and "earlier.jpg" not in images, (sorted(detected), images)
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    return images


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_mid_predict_is_one_line_and_leaves_the_images_done_then_a_rerun_completes(
        nproc, checkpoint, small_shapes, tmp_path):
    """Issue 36: predict had no handler, so SIGTERM ended it silently (exit -15); a single process left its last
    periodic detections.json beside the earlier run's images.json. Now every process stops after its batch,
    rank 0 writes both files for the images done, and the run says so in one line (exit 143)."""
    folder, out, log = tmp_path / "images", tmp_path / "out", tmp_path / "predict.log"
    folder.mkdir()
    photos = sorted((small_shapes / "val2017").iterdir())
    for k in range(IMAGES):
        shutil.copy(photos[k % len(photos)], folder / f"{k:03d}{photos[0].suffix}")
    out.mkdir()  # an earlier run's outputs
    (out / "images.json").write_text(json.dumps({"earlier.jpg": 999}))
    (out / "detections.json").write_text(json.dumps([{"image_id": 999, "category_id": 1, "bbox": [0, 0, 1, 1],
                                                      "score": 0.9}]))
    proc = _predict(checkpoint, out, folder, nproc, log)
    deadline = time.monotonic() + 240
    while not (out / "overlays").is_dir() or len(list((out / "overlays").iterdir())) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    if nproc == 1:
        os.killpg(proc.pid, signal.SIGTERM)  # a terminal's or SLURM's: every process, workers too
    else:
        os.kill(proc.pid, signal.SIGTERM)  # Kubernetes': torchrun, which sends it on to each rank
    try:
        proc.wait(timeout=90)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    output = log.read_text()
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and re.fullmatch(rf"error: stopped by SIGTERM after predicting (\d+) of {IMAGES} images: "
                                           rf"detections.json and images.json in {out} hold those \1; rerun to "
                                           "predict them all", ours[0]), output[-3000:]
    assert not PACKAGE_TRACEBACK.search(output), output[-3000:]
    if nproc == 1:
        assert proc.returncode == 143 and "Traceback" not in output, output[-3000:]
    images = _consistent_pair(out)
    assert 0 < len(images) == int(ours[0].split("predicting ")[1].split()[0]) < IMAGES
    time.sleep(1)
    assert _session(proc.pid) == []  # no rank or loader worker left behind

    rerun = _predict(checkpoint, out, folder, 1, log)
    assert rerun.wait(timeout=400) == 0, log.read_text()[-3000:]
    assert len(_consistent_pair(out)) == IMAGES


PEAK_SCRIPT = """
import resource, sys
from maskrcnn_tut import predict
checkpoint, small, large, out = sys.argv[1:]
flags = ["--checkpoint", checkpoint, "--workers", "0", "--no-progress", "--score-threshold", "0"]
assert predict.main([*flags, "--out", out + "/small", small]) == 0  # imports, the model, the allocator warm
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert predict.main([*flags, "--out", out + "/large", large]) == 0
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_large_photo_with_many_detections_is_pasted_one_mask_at_a_time(checkpoint, small_shapes, tmp_path):
    """Issue 36 probe: torchvision pastes every detection's mask at the photo's size as float32 and stacks
    them (twice the memory); 100 detections on a 2000x1500 photo took 2.3 GB more than a small one, a
    12-megapixel photo about 10 GB. Pasted one at a time (predict.postprocess_unpasted and
    evaluate.binary_masks), the same results and overlays took 74 MB more."""
    photo = Image.open(sorted((small_shapes / "val2017").iterdir())[0]).convert("RGB")
    photo.resize((100, 75)).save(tmp_path / "small.jpg")
    photo.resize((2000, 1500)).save(tmp_path / "large.jpg")
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(checkpoint), str(tmp_path / "small.jpg"),
                          str(tmp_path / "large.jpg"), str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         env=subprocess_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    grown_mb = int(run.stdout.split()[-1])
    detections = json.loads((tmp_path / "large" / "detections.json").read_text())
    assert len(detections) == 100 and {d["segmentation"]["size"][0] for d in detections} == {1500}
    assert grown_mb < 400, f"predicting the large photo took {grown_mb} MB more at its peak"
