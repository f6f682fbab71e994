#!/usr/bin/env bash
# One tuning point on dev: run FROM's BC part (its demonstrations, policy_0 and its evaluations, iteration 1's own
# episodes unless ALGOS=qlass; with QLASS_TREES=1 its trees and QNet too, for a setting that changes only QLASS_M)
# hard-linked into a new run TO, whose settings record is FROM's with the settings given after TO, then one iteration
# of ALGOS evaluated on dev (run_all.sh with K=1 EVAL_SPLITS=dev). The tuning table: bench/plots.py paper --splits dev
# over the runs.
#
#   ALGOS="qevolve eto" bash bench/tune_dev.sh runs/paper0 runs/tuneA_0 CRITIC_ARGS="--epochs 8" ETO_ARGS="--beta 0.3"
set -euo pipefail
bad() { echo "error: $1" >&2; exit 2; }
cd "$(dirname "$0")/.."  # the checkout: FROM and TO are relative to it, as run_all.sh's RUN is
[ $# -ge 2 ] && [ -f "$1/settings.json" ] && [ ! -e "$2" ] \
  || bad "bench/tune_dev.sh FROM TO [VAR=VALUE ...]: FROM a run (its settings.json), TO a new folder"
from=$1 to=$2; shift 2
[[ $(realpath -m -- "$to")/ != "$(realpath -- "$from")"/* ]] || bad "bench/tune_dev.sh: TO ($to) is inside FROM ($from): \
the new run goes beside it"
keys=$(python - "$from/settings.json" <<'EOF'  # FROM's record: run_all.sh's (a dict with its SEED), else one line
import json, sys
try:
    s = json.load(open(sys.argv[1], encoding="utf-8"))
except (OSError, ValueError):
    s = None
if not isinstance(s, dict) or not isinstance(s.get("SEED"), str):
    sys.exit(print(f"error: bench/tune_dev.sh: {sys.argv[1]} is not a run's settings record (run_all.sh's)",
                   file=sys.stderr) or 2)
print(*s)
EOF
)
for kv in "$@"; do [[ " $keys " == *" ${kv%%=*} "* && $kv == *=* ]] || bad "bench/tune_dev.sh: '$kv' is not VAR=VALUE \
of a setting FROM's settings.json records (others, such as ALGOS, come from the environment)"; done
seed=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['SEED'])" "$from/settings.json")
setting() { env "$@" RUN="$to" SEED="$seed" K=1 EVAL_SPLITS=dev bash run_all.sh "${check[@]}"; }
own=()  # iteration 1's own episodes, which every ALGOS but qlass (its trees) starts from
for a in ${ALGOS:-qevolve}; do [ "$a" = qlass ] || own=(iter_1/self.jsonl iter_1/self.json); done
parts=(data policy_0 "${own[@]}" $([ "${QLASS_TREES:-0}" != 1 ] || echo qlass))
for p in "${parts[@]}"; do [ -e "$from/$p" ] || bad "bench/tune_dev.sh: $from has no $p yet; run it first (K=1)"; done
python -c 'import sys; sys.path.insert(0, "."); import run_support; run_support.check_run(sys.argv[1])' "$to" || exit 2
mkdir -- "$to" 2>/dev/null || bad "bench/tune_dev.sh: cannot make $to (its parent folder must exist)"
python - "$from/settings.json" "$to/settings.json" "$@" <<'EOF'
import json, sys
sys.path.insert(0, ".")
from plumbing import save_text
s = json.load(open(sys.argv[1]))
s.update(kv.split("=", 1) for kv in sys.argv[3:])
save_text(sys.argv[2], json.dumps(s, indent=2) + "\n")
EOF
check=(--check)  # TO's record and every setting checked before anything else is written (a refusal: TO removed)
setting "$@" >/dev/null || { rm -r -- "$to"; exit 2; }
mkdir "$to/iter_1"
for p in "${parts[@]}"; do cp -al "$from/$p" "$to/$p"; done
for w in "$from"/eval/world*; do mkdir -p "$to/eval/${w##*/}" && ln "$w"/policy_0_dev.* "$to/eval/${w##*/}/"; done
check=() && setting "$@"
