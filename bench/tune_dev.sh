#!/usr/bin/env bash
# One tuning point on dev: run FROM's BC part (its demonstrations, policy_0 and its evaluations, iteration 1's own
# episodes; with QLASS_TREES=1 its trees and QNet too, for a setting that changes only QLASS_M) hard-linked into a new
# run TO, whose settings record is FROM's with the settings given after TO, then one iteration of ALGOS evaluated on
# dev (run_all.sh with K=1 EVAL_SPLITS=dev). The tuning table: bench/plots.py paper --splits dev over the runs.
#
#   bash bench/tune_dev.sh runs/paper0 runs/tuneA_0 BPPO_ARGS="--epochs 2 --kl-coef 0.0125" QLASS_M=4
set -euo pipefail
[ $# -ge 2 ] && [ -e "$1/settings.json" ] && [ ! -e "$2" ] \
  || { echo "error: bench/tune_dev.sh FROM TO [VAR=VALUE ...]: FROM a run (its settings.json), TO a new folder" >&2; exit 2; }
from=$1 to=$2; shift 2
mkdir -p "$to/iter_1"
for p in data policy_0 iter_1/self.jsonl iter_1/self.json $([ "${QLASS_TREES:-0}" = 1 ] && echo qlass); do
  cp -al "$from/$p" "$to/$p"
done
for w in "$from"/eval/world*; do mkdir -p "$to/eval/${w##*/}" && ln "$w"/policy_0_dev.* "$to/eval/${w##*/}/"; done
python - "$from/settings.json" "$to/settings.json" "$@" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
for kv in sys.argv[3:]:
    k, v = kv.split("=", 1)
    s[k] = v
json.dump(s, open(sys.argv[2], "w"), indent=2)
EOF
env "$@" RUN="$to" SEED="$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['SEED'])" "$from/settings.json")" \
  K=1 EVAL_SPLITS=dev bash run_all.sh
