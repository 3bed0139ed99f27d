#!/usr/bin/env bash
# The training core installed alone: `pip install -e .` into a fresh venv (no system site-packages,
# so only pyproject's [project] dependencies are there), then the book's libraries must be missing
# and the main job must train 5 steps on 2 processes. Prints the install's time and size.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
started=$SECONDS
# (the machine's pip configuration names local wheel folders; pip warns about each one it skips)
"$work/venv/bin/pip" install --quiet --disable-pip-version-check -e . 2> >(grep -v "^WARNING: Location 'file:" >&2)
echo "core-only install: $((SECONDS - started)) s, $(du -sh "$work/venv" | cut -f1) on disk"
"$work/venv/bin/python" - <<'PY'
import importlib.util
present = [name for name in ("matplotlib", "ipywidgets", "IPython", "pynvml") if importlib.util.find_spec(name)]
assert not present, f"the core-only install brought in {present}"
PY
started=$SECONDS
OMP_NUM_THREADS=1 "$work/venv/bin/torchrun" --nproc_per_node=2 maskrcnn_tut/train.py --max-steps 5 \
    --output-dir "$work/run" --no-progress
test -s "$work/run/summary.json"
echo "core-only run: 5 steps on 2 processes in $((SECONDS - started)) s"
