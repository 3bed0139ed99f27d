#!/usr/bin/env bash
# The project's GPU check: one run of at most ~9 minutes on the lent GPU machine (one H200, Python 3.12,
# torch 2.11 + torchvision 0.26 preinstalled; no pycocotools, nbval, nbclient, ipykernel).
#
# Here, first:   bash tools/gpu_check.sh --fetch-wheels     (downloads the missing packages into .whl/)
# There:         bash tools/gpu_check.sh                    (the device tool's `run`, carry [".whl"])
#
# It runs (1) the GPU tests (`pytest -m gpu`), (2) `python -m maskrcnn_tut.lab.bench --suite gpu`, writing
# book/results/<hardware>-<date>.json, and (3) every chapter on the GPU (nbclient), keeping their outputs;
# everything it produces is copied to $OUT (or ./gpu_check_out when $OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pycocotools==2.0.11 shapely==2.1.2 nbclient==0.10.2 nbformat==5.10.4 ipykernel==6.30.1
        jupyter_client==8.6.3 jupyter_core==5.8.1 traitlets==5.14.3 fastjsonschema==2.21.2 jsonschema==4.25.1
        jsonschema-specifications==2025.4.1 referencing==0.36.2 rpds-py==0.27.0 attrs==25.3.0 pyzmq==27.0.2
        tornado==6.5.2 comm==0.2.3 debugpy==1.8.16 matplotlib-inline==0.1.7 nest-asyncio==1.6.0 psutil==7.0.0
        ipython==9.4.0 ipywidgets==8.1.7 widgetsnbextension==4.0.14 jupyterlab_widgets==3.0.15 myst-nb==1.3.0
        pytest==8.4.1 pytest-timeout==2.4.0 iniconfig==2.1.0 pluggy==1.6.0 tqdm==4.67.1 nvidia-ml-py==13.580.65)
if [ "${1:-}" = "--fetch-wheels" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    for wheel in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$wheel" || echo "could not fetch $wheel (pick a version pip finds)"
    done
    exit 0
fi
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" MASKRCNN_TUT_CACHE=/tmp/maskrcnn_tut_cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)" | tee "$OUT/versions.txt"

echo "== 1. GPU tests"
timeout 120 python3 -m pytest -p no:cacheprovider -q -m gpu tests/gpu/test_gpu.py -o addopts="" 2>&1 | tee "$OUT/pytest_gpu.txt"

echo "== 2. bench --suite gpu"
timeout 300 python3 -m maskrcnn_tut.lab.bench --suite gpu --max-minutes 4 --results-dir book/results 2>&1 | tee "$OUT/bench_suite.txt"
cp book/results/*.json "$OUT/" 2>/dev/null

echo "== 3. chapters on the GPU (60 s each at most, outputs kept)"
mkdir -p "$OUT/chapters"
for nb in book/[0-9]*.ipynb; do
    timeout 70 python3 - "$nb" "$OUT/chapters/$(basename "$nb")" <<'PY' 2>&1 | tail -3 | tee -a "$OUT/chapters.txt"
import sys, time, nbformat
from nbclient import NotebookClient
source, target = sys.argv[1], sys.argv[2]
nb = nbformat.read(source, as_version=4)
started = time.time()
try:
    NotebookClient(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": "book"}}).execute()
    status = "ok"
except Exception as err:
    status = f"FAILED: {type(err).__name__}: {str(err).splitlines()[-1][:300] if str(err) else ''}"
nbformat.write(nb, target)
print(f"{source}: {status} in {time.time() - started:.0f} s")
PY
done
echo "done: results in $OUT"
