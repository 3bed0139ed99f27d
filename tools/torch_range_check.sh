#!/usr/bin/env bash
# The package on a torch that a hub or cluster image brings, not requirements.txt's pins:
#
#     bash tools/torch_range_check.sh PYTHON_VERSION TORCH TORCHVISION      e.g.  3.12 2.11.0 0.26.0
#
# In a fresh venv of that Python (pythonX.Y on PATH, else pyenv's) it installs that torch and torchvision first,
# then the training core alone (`pip install -e .`: pyproject's [project] dependencies, no extras), which must
# keep them (pyproject's range), must not bring the book's libraries and must train: a 2-process gloo train.py
# run. Then the extras a hub user adds (`pip install -e .[book,test]`), the unit tier and the DDP-knobs test.
# CI runs it on the oldest supported torch and on the GPU machine's. Prints the time of each part.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=$2 vision_version=$3
if "python$1" -c "" 2>/dev/null; then
    python="python$1"
else  # a pyenv shim that names another version, or none: pyenv's own install of that version
    python=$(ls -d "$(pyenv root 2>/dev/null)"/versions/"$1".*/bin/"python$1" 2>/dev/null | tail -1)
    [[ -n "$python" ]] || { echo "no Python $1 here (python$1 or pyenv)"; exit 1; }
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
"$python" -m venv "$work/venv"
# torch's wheels (3-6 GB with CUDA's) are kept here: the index serves them uncacheable to pip, and uv links
# their files from its cache where pip would unzip them again (minutes on 2 cores)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/maskrcnn_tut-torch-range"
stack=("torch==$torch_version" "torchvision==$vision_version")
# (the machine's pip configuration names local wheel folders; pip warns about each one it skips)
quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }
[ -x "$cache/uv/bin/uv" ] || quiet python3 -m pip install -q --target "$cache/uv" uv==0.13.9
install_stack() {
    "$cache/uv/bin/uv" pip install -q --compile-bytecode --python "$work/venv/bin/python" --no-index \
        --find-links "$cache/wheels" "${stack[@]}"
}
install_stack 2>/dev/null || { quiet "$work/venv/bin/pip" download -q --only-binary=:all: -d "$cache/wheels" "${stack[@]}" && install_stack; }
echo "torch stack: $((SECONDS - started)) s"
kept_torch() {  # pip must keep that torch whatever the project asks for
    "$work/venv/bin/python" - "$torch_version" "$vision_version" <<'PY'
import sys, torch, torchvision
kept = (torch.__version__.split("+")[0], torchvision.__version__.split("+")[0])
assert kept == tuple(sys.argv[1:]), f"installing the project replaced torch {sys.argv[1:]} with {kept}"
print(f"torch {torch.__version__}, torchvision {torchvision.__version__} on Python {sys.version.split()[0]}")
PY
}
pip_install() { quiet "$work/venv/bin/pip" install --quiet --disable-pip-version-check -e "$1"; }
pip_install . && kept_torch
"$work/venv/bin/python" - <<'PY'
import importlib.util
present = [name for name in ("matplotlib", "ipywidgets", "IPython", "pynvml") if importlib.util.find_spec(name)]
assert not present, f"the core-only install brought in {present}"
PY
echo "core-only install: $((SECONDS - started)) s, $(du -sh "$work/venv" | cut -f1) on disk"
export PATH="$work/venv/bin:$PATH"
started=$SECONDS
OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 maskrcnn_tut/train.py --max-steps 5 --output-dir "$work/run" --no-progress
test -s "$work/run/summary.json"
echo "2-process gloo run, the core alone: $((SECONDS - started)) s"
started=$SECONDS
pip_install ".[book,test]" && kept_torch
echo "extras install: $((SECONDS - started)) s"
started=$SECONDS
python -m pytest -q
echo "unit tier: $((SECONDS - started)) s"
started=$SECONDS
python -m pytest -q tests/system/test_ddp_knobs.py
echo "DDP knobs: $((SECONDS - started)) s"
