#!/usr/bin/env bash
# The project's GPU check, for the lent GPU machine (one H200, Python 3.12, torch 2.11 + torchvision 0.26
# preinstalled, no network, at most 8 files back). Two commands, each one device-tool `run`:
#
#   bash tools/gpu_check.sh            the device run (first, at most TOTAL_S = 570 s): setup, then the
#                                      stages of maskrcnn_tut/lab/bench/gpu_stages.py (precision, levers,
#                                      side_by_side, cudnn_benchmark, compiled), each its own bounded process
#   bash tools/gpu_check.sh --tests [--chapters 05,06]
#                                      the second, optional one: pytest -m gpu and a chapter or two
#
# Here, first:   bash tools/gpu_check.sh --fetch-wheels   (the wheels into .whl/, torchvision's reference
#                into .peer/; the device tool's `run` carries [".whl", ".peer"])
# Rehearsal:     bash tools/gpu_check.sh --rehearse [--tests]   (here, on the CPU: a fresh Python 3.12 venv with
#                only the device's torch stack plus .whl/, then the same command at cpu-tiny's sizes; on a busy
#                CPU, GPU_CHECK_TIME_SCALE=N stretches every bound N times)
#
# Every stage writes its files into $OUT (/tmp/gpu_check_out when unset) as it goes: steps.jsonl,
# summary.json (rewritten after each stage), trace_fp32.json.gz, trace_bf16.json.gz, ref.log, nvml.csv,
# check.log and stages.txt (every stage's status and seconds; also written when the run is stopped). A stage
# that runs out of time or fails costs only itself. Exit 1 when a stage failed.
set -uo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
export PIP_ROOT_USER_ACTION=ignore  # the device runs commands as root
TOTAL_S=${GPU_CHECK_TOTAL_S:-570}
#: each stage's limit in seconds (compiled gets what is left); GPU_CHECK_STAGES picks some, e.g. "precision levers"
declare -A LIMIT_S=([precision]=160 [levers]=130 [side_by_side]=120 [cudnn_benchmark]=60 [compiled]=100)
STAGES=(${GPU_CHECK_STAGES:-precision levers side_by_side cudnn_benchmark compiled})
PYTEST_S=150  # the compiled test alone took 73 s on the H200 (2026-12-04)
CARRY_LIMIT_MB=64
# myst_nb's glue imports only IPython, nbformat and docutils, which the requirements bring; its own closure
# (sphinx, babel, jupyter-cache and more, about 40 MB) would not fit the carry limit.
NO_DEPS=(myst-nb==1.4.0)
PLATFORMS=(--platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
# what the device run imports; --tests needs the rest too
RUN_IMPORTS=(pycocotools.coco pycocotools.mask shapely tqdm pynvml torch torchvision maskrcnn_tut.train
             maskrcnn_tut.lab.bench.gpu_stages maskrcnn_tut.lab.bench.peer)
TEST_IMPORTS=(pytest pytest_timeout nbclient nbformat ipykernel.kernelapp jupyter_client IPython docutils myst_nb.ext.glue
              matplotlib.pyplot ipywidgets maskrcnn_tut.lab.book)

quiet() { grep -v "^WARNING: Location 'file:" || true; }  # this machine's pip.conf names local indexes some lack

fetch_wheels() {
    grep -qx '/.whl/' .gitignore || echo /.whl/ >> .gitignore
    rm -rf .whl
    local pip=(python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp
               "${PLATFORMS[@]}" -c tools/gpu_constraints.txt -d .whl)
    { "${pip[@]}" -r tools/gpu_requirements.txt && "${pip[@]}" --no-deps "${NO_DEPS[@]}"; } 2> >(quiet >&2) || return 1
    # the device's own stack came in as dependencies (numpy, pillow): it is there already
    for name in $(grep -o '^[A-Za-z0-9_.-]*' tools/gpu_constraints.txt); do
        find .whl -iname "${name//-/_}-*.whl" -delete
    done
    local mb; mb=$(du -sm .whl | cut -f1)
    echo "$(ls .whl | wc -l) wheels, ${mb} MiB in .whl/" \
         "(the device tool carries at most ${CARRY_LIMIT_MB} MiB with the tree)"
    # the tree itself (tracked and untracked files) travels too: a few MiB
    (( mb < CARRY_LIMIT_MB - 8 )) || { echo "too large to carry beside the working tree"; return 1; }
    grep -qx '/.peer/' .gitignore || echo /.peer/ >> .gitignore
    python3 -c "from maskrcnn_tut.lab.bench.peer import copy_peer; print(copy_peer())"
}

# --- the check ---------------------------------------------------------------------------------------
OUT="${OUT:-/tmp/gpu_check_out}"
SITE="${GPU_CHECK_SITE:-/tmp/gpu_check_site}"
# Every bound times this: a rehearsal on a CPU that others share needs longer than the device
SCALE="${GPU_CHECK_TIME_SCALE:-1}"
TOTAL_S=$((TOTAL_S * SCALE))
STARTED=$(date +%s)
END=$((STARTED + TOTAL_S))
TABLE=()
FAILED=0

record() {  # record NAME STATUS SECONDS
    TABLE+=("$(printf '%-32s %4s s  %s' "$1" "$3" "$2")")
    [[ "$2" == FAILED* ]] && FAILED=1
    echo "-- $1: $2 ($3 s)"
}

stage() {  # stage NAME LIMIT_S COMMAND...: bounded by LIMIT_S and by what is left of TOTAL_S
    local name=$1 limit=$(($2 * SCALE)); shift 2
    local left=$((END - $(date +%s))); ((limit > left)) && limit=$left
    if ((limit < 5)); then record "$name" "FAILED: not run, the check's ${TOTAL_S} s were used up" 0; return 1; fi
    echo "== $name (at most $limit s)"
    local start rc; start=$(date +%s)
    # in the background, so that a signal to this script is handled at once (`stopped`); SIGINT set back to
    # its default there (a background job's is ignored), so that timeout's INT reaches the command
    env --default-signal=INT timeout -s INT -k 20 "$limit" "$@" & CHILD=$!
    wait "$CHILD"; rc=$?; CHILD=""
    local took=$(($(date +%s) - start))
    case $rc in
        0) record "$name" "${STATUS:-ok}" "$took" ;;
        124|137) record "$name" "FAILED: stopped at its $limit s" "$took" ;;
        *) record "$name" "FAILED (exit $rc)" "$took" ;;
    esac
    return "$rc"
}

setup() {  # setup IMPORT...: the carried wheels and the package, then a quick import of what the command uses
    if [[ -n "${GPU_CHECK_NO_SETUP:-}" ]]; then echo "setup skipped (GPU_CHECK_NO_SETUP): this environment as it is"; return 0; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        && echo "the carried wheels installed at ${SECONDS} s" \
        && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        && echo "the package installed at ${SECONDS} s" \
        && python3 - "$@" <<'PY'
import importlib, sys, time
started, missing = time.time(), []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as err:  # every missing module at once, each with why
        missing.append(f"{name} ({type(err).__name__}: {err})")
import torch, torchvision, numpy, PIL
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), torchvision "
      f"{torchvision.__version__}, numpy {numpy.__version__}, pillow {PIL.__version__}, Python {sys.version.split()[0]}")
if missing:
    sys.exit("missing: " + "; ".join(missing))
print(f"imported {len(sys.argv) - 1} modules in {time.time() - started:.1f} s")
PY
}

begin() {  # the log, the environment, and stages.txt written however the run ends
    mkdir -p "$OUT"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" MASKRCNN_TUT_CACHE="$SITE-data" PYTHONUNBUFFERED=1
    exec > >(tee -a "$OUT/check.log") 2>&1
    TEE_PID=$!
    CHILD=""
    trap stopped INT TERM
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi: no GPU here"
}

run_stages() {
    begin
    if ! stage setup 60 bash "$SELF" --setup "${RUN_IMPORTS[@]}"; then finish; fi
    local name limit
    for name in "${STAGES[@]}"; do
        limit=${LIMIT_S[$name]}
        stage "$name" "$limit" python3 -m maskrcnn_tut.lab.bench.gpu_stages "$name" --out "$OUT" --seconds "$((limit * SCALE))"
    done
    finish
}

run_tests() {
    local chapters=()
    [[ "${1:-}" == "--chapters" && -n "${2:-}" ]] && chapters=(--chapters "$2")
    begin
    if ! stage setup 150 bash "$SELF" --setup "${RUN_IMPORTS[@]}" "${TEST_IMPORTS[@]}"; then finish; fi
    python3 -c "import torch; torch.cuda.is_available() or print('no CUDA: every test marked gpu is skipped (reasons below, from -rs)')"
    stage "pytest -m gpu" "$PYTEST_S" python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests/gpu/test_gpu.py \
        -k "${GPU_CHECK_TESTS:-}" -o addopts="" --timeout 100 --junitxml="$OUT/pytest_gpu.xml"
    local left=$((END - $(date +%s) - 15)) summary; summary=$(mktemp)
    stage chapters "$((left / SCALE))" python3 tools/run_chapters.py --out "$OUT" --deadline-s "$((left - 10))" \
        --summary "$summary" "${chapters[@]}"
    while IFS='|' read -r name seconds status; do record "  $name" "$status" "$seconds"; done < "$summary"
    finish
}

stopped() {  # a signal to the script: the running stage stops as at its limit, then stages.txt is written
    if [[ -n "$CHILD" ]]; then kill -INT "$CHILD" 2>/dev/null; wait "$CHILD"; fi
    record "(the rest)" "FAILED: stopped by a signal" $(($(date +%s) - STARTED))
    finish
}

finish() {
    trap - INT TERM
    { echo "GPU check, $(date -u +%FT%TZ), $(($(date +%s) - STARTED)) s of $TOTAL_S s"
      printf '%s\n' "${TABLE[@]}"; } \
        | tee "$OUT/stages.txt"
    exec >&- 2>&-
    wait "$TEE_PID"
    exit "$FAILED"
}

# --- the rehearsal ----------------------------------------------------------------------------------
rehearse() {
    # A fixed place, emptied first: the bytecode of its torch, kept under PYTHONPYCACHEPREFIX, stays valid
    # from one rehearsal to the next (the device's image has its bytecode compiled too)
    local start work=/tmp/gpu_rehearse; start=$(date +%s)
    if [ -e "$work" ]; then  # the last rehearsal's files go away meanwhile
        mv "$work" "$work.old.$$" && { rm -rf "$work.old.$$" & }
    fi
    mkdir -p "$work" || return 1
    local cache="${XDG_CACHE_HOME:-$HOME/.cache}/maskrcnn_tut-gpu-rehearse" py=python3.12 stack
    python3.12 -c '' 2>/dev/null || py="env PYENV_VERSION=$(pyenv latest 3.12) python3.12"
    mapfile -t stack < <(grep -v '^#' tools/gpu_constraints.txt)
    echo "== venv: Python 3.12 with the device's torch stack only ($work/venv; wheels kept in $cache)"
    # The wheels are kept here (the index serves them uncacheable to pip), and uv links their files from
    # its cache where pip would unzip 2.6 GB again (minutes on 2 cores); the venv itself starts empty.
    [ -x "$cache/uv/bin/uv" ] || python3 -m pip install -q --target "$cache/uv" uv==0.13.9 2> >(quiet >&2) || return 1
    install_stack() {
        "$cache/uv/bin/uv" pip install -q --python "$work/venv/bin/python" --no-index --find-links "$cache/wheels" \
            "${stack[@]}"
    }
    fetch_stack() { "$work/venv/bin/python" -m pip download -q -d "$cache/wheels" "${stack[@]}" 2> >(quiet >&2); }
    $py -m venv "$work/venv" && { install_stack 2>/dev/null || { fetch_stack && install_stack; }; } \
        || { echo "venv: FAILED"; return 1; }
    local venv_s=$(($(date +%s) - start))
    [ -d .whl ] && [ -d .peer ] || fetch_wheels || return 1
    echo "-- venv: ok ($venv_s s)"
    # the device has no pip configuration and no network: neither does the check here; and where this machine
    # says not to write bytecode, every process would compile torch's Python again
    env -u PIP_FIND_LINKS -u PYTHONDONTWRITEBYTECODE PIP_CONFIG_FILE=/dev/null PATH="$work/venv/bin:$PATH" \
        OUT="$work/out" GPU_CHECK_SITE="$work/site" PYTHONPYCACHEPREFIX="$cache/pycache" bash tools/gpu_check.sh "$@"
    local rc=$?
    sed -i "2i $(printf '%-32s %4s s  %s' venv "$venv_s" "ok (rehearsal: Python 3.12, torch 2.11, torchvision 0.26)")" \
        "$work/out/stages.txt"
    echo; echo "rehearsal: exit $rc, $(($(date +%s) - start)) s in all; results in $work/out"
    cat "$work/out/stages.txt"
    return "$rc"
}

case "${1:-}" in
    --fetch-wheels) fetch_wheels ;;
    --rehearse) shift; rehearse "$@" ;;
    --setup) shift; setup "$@" ;;
    --tests) shift; run_tests "$@" ;;
    "") run_stages ;;
    *) echo "usage: bash tools/gpu_check.sh [--fetch-wheels | --rehearse [--tests] | --tests [--chapters 05,06]]"; exit 2 ;;
esac
