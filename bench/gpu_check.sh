#!/usr/bin/env bash
# The GPU check: one command of at most 10 minutes on one GPU (docs/real_model.md, 'On a GPU').
#   1. the test suite, one line per test, into CHECK/tests.log (on pytest-xdist's workers: pyproject.toml)
#   2. SmolLM2's chain (run_all.sh BASE=smollm2, K=1, world 0, reduced budgets below) on household and shop,
#      side by side with the tests, each chain's log in CHECK/<env>.log and its wall-clock in CHECK/<env>.seconds
#   3. bench/gpu_report.py: per-stage seconds, tokens/s, peak GPU memory and model FLOP utilisation, how far
#      05 moved the policy, the results tables -> bench/results/gpu.md
# Each log is written when its command ends (atomically, its first line the script's stamp). DRY=1 runs the same script on a CPU with the tiny model, SMOKE's budgets and --precision bf16, its report in
# CHECK/gpu.md (tests/test_gpu_check.py, so CI keeps it working). Settings: CHECK=runs/gpu_check,
# ENVS="household shop", TESTS="--slow tests" (pytest's arguments; empty: no tests), PYTHON=python (else python3),
# SMOLLM2_DIR=models/smollm2-135m (converted first if missing: from the installed wheel, or from
# SMOLLM2_GGUF=<file> where the wheel is not installed).
#
#   bash bench/gpu_check.sh                 # on the GPU machine
#   DRY=1 ENVS=household TESTS= bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=${CHECK:-runs/gpu_check}
DRY=${DRY:-0}
ENVS=${ENVS:-"household shop"}
TESTS=${TESTS-"--slow tests"}
SMOLLM2_DIR=${SMOLLM2_DIR:-models/smollm2-135m}
PYTHON=${PYTHON:-$(command -v python >/dev/null && echo python || echo python3)}
bad() { echo "error: $1" >&2; exit 2; }
case $CHECK in ''|-*|'~'*|*'$'*|*'`'*) bad "CHECK must be a plain path (no leading - or ~, no \$ or backquote), got '$CHECK'" ;; esac
[[ $ENVS =~ ^[[:space:]]*[A-Za-z0-9_]+([[:space:]]+[A-Za-z0-9_]+)*[[:space:]]*$ ]] || bad "ENVS must be environment \
names, got '$ENVS'"

if [ "$DRY" = 1 ]; then
  chain=(env SMOKE=1 BASE_CACHE="$CHECK/base" PRECISION=bf16 K=1 EVAL_WORLDS=0)
  report="$CHECK/gpu.md"
else  # SmolLM2, converted once before the two chains start (not twice at the same time)
  [ -e "$SMOLLM2_DIR" ] || $PYTHON -m models.smollm2 --out "$SMOLLM2_DIR" ${SMOLLM2_GGUF:+--gguf "$SMOLLM2_GGUF"}
  chain=(env BASE=smollm2 SMOLLM2_DIR="$SMOLLM2_DIR" K=1 EVAL_WORLDS=0 N_EXPERT=500 N_SELF=200 N_EVAL=100
         BC_ARGS="--epochs 2 --lr 5e-5 --batch-size 16" CRITIC_ARGS="--epochs 1 --lr 1e-5 --batch-size 16")
  report=bench/results/gpu.md
fi
# Every file it writes goes through plumbing.py's rule (new, or one this script wrote: its stamped first line) and is
# written atomically when its command ends (plumbing.py save): checked before anything runs.
logs=("$CHECK/tests.log")
for env in $ENVS; do logs+=("$CHECK/$env.log" "$CHECK/$env.seconds"); done
$PYTHON plumbing.py check run_log "${logs[@]}"
$PYTHON plumbing.py check table "$report"
save() { $PYTHON plumbing.py save run_log "$1" bench/gpu_check.sh; }

pids=()
for env in $ENVS; do
  ( start=$(date +%s)
    "${chain[@]}" ENV="$env" RUN="$CHECK/$env" PYTHON="$PYTHON" bash run_all.sh 2>&1 | save "$CHECK/$env.log"
    echo $(( $(date +%s) - start )) | save "$CHECK/$env.seconds" ) &
  pids+=($!)
done
if [ -n "$TESTS" ]; then
  ( $PYTHON -m pytest -v -p no:cacheprovider $TESTS 2>&1 | save "$CHECK/tests.log" ) &
  pids+=($!)
fi
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done  # by id: never a monitor started beside them
$PYTHON bench/gpu_report.py --check "$CHECK" --out "$report"
if [ "$failed" = 1 ]; then echo "gpu_check: a chain or a test failed (logs in $CHECK)" >&2; fi
exit "$failed"
