#!/usr/bin/env bash
# The real-model lab (docs/real_model.md, 'The lab': its budgets, their arithmetic and its runs on one H200 / H100):
# one command of at most 8 minutes on one GPU. SmolLM2 converted once (SMOLLM2_DIR=models/smollm2-135m, or from
# SMOLLM2_GGUF=<file>); then for each env of ENVS and seed of SEEDS, side by side, run_all.sh runs LAB/<env>-s<seed>
# with BASE=smollm2: BC, then each method of ALGOS from the same BC policy (Q-Evolve, iterated RFT, the outcome-level
# PG and ETO K=2 iterations, iteration by iteration; QLASS once, beside iteration 1), each policy evaluated on seen and
# unseen in worlds 0 and 1 beside the next training (greedily; QLASS: BC with its QNet's argmax of QLASS_M sampled
# replies); logs LAB/<env>-s<seed>.<algo>.it<k>[.eval].log; last bench/gpu_report.py -> bench/results/gpu_lab.md.
# Budgets (a variable you set wins): 400 demos, BC 2 epochs at 5e-5; per iteration 128 self episodes, critic 1 epoch at
# 1e-5, BPPO 1 at 2e-6, RFT 1 at 2e-5, ETO 1 at 1e-6 (beta 0.3); QLASS: trees on 64 train tasks, its QNet 1 epoch at
# 1e-5, 4 candidates a step; batches of 16; 100 tasks per (world, split). None tuned for SmolLM2.
# Settings: LAB=runs/gpu_lab, SEEDS="0 1 2", ENVS=kitchen (ENVS="kitchen household": with the control),
# ALGOS="qevolve rft outcome eto qlass" (qevolve always: its iteration-1 episodes are every method's), TESTS=
# (pytest's arguments: the suite beside the runs, -v into LAB/tests.log), PYTHON=python, DEADLINE=S (each run stopped
# there; the report counts what finished), CUDA_GRAPH=1 (02's decode steps from CUDA graphs where faster), MPS=1 (the
# GPU shared through NVIDIA's MPS);
# run_all.sh's settings pass to its runs; every setting is checked first (a bad one: one error line, exit 2).
# DRY=1: the same path on a CPU (a one-layer tiny model, SMOKE's budgets, two seeds, K=1, bf16; tests/test_gpu_lab.py).
#
#   bash bench/gpu_lab.sh                         # on the GPU machine (PYTHON=python3 where there is no python)
#   DRY=1 bash bench/gpu_lab.sh                   # anywhere, a minute or two
set -euo pipefail
bad() { echo "error: $1" >&2; exit 2; }
case "$*" in
  "") ;;
  -h|--help) sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) bad "bench/gpu_lab.sh takes no arguments, got '$*'; its settings are environment variables (--help)" ;;
esac
cd "$(dirname "$0")/.."
: "${LAB:=runs/gpu_lab}" "${DRY:=0}" "${ENVS:=kitchen}" "${TESTS:=}" "${DEADLINE:=}"
: "${ALGOS:=qevolve rft outcome eto qlass}"
: "${SMOLLM2_DIR:=models/smollm2-135m}" "${PYTHON:=$(command -v python >/dev/null && echo python || echo python3)}"
case $LAB in ''|-*|'~'*|*'$'*|*'`'*) bad "LAB must be a plain path (no leading - or ~, no \$ or backquote), got '$LAB'" ;; esac
[[ $ENVS =~ ^[[:space:]]*[A-Za-z0-9_]+([[:space:]]+[A-Za-z0-9_]+)*[[:space:]]*$ ]] || bad "ENVS must be environment \
names, got '$ENVS'"
[[ " $ALGOS " =~ ^(\ (qevolve|rft|outcome|eto|qlass))+\ $ && " $ALGOS " == *" qevolve "* ]] || bad "ALGOS must \
be words of: qevolve rft outcome eto qlass, qevolve among them (single spaces), got '$ALGOS'"
[[ $DEADLINE =~ ^([1-9][0-9]{0,8})?$ ]] || bad "DEADLINE must be seconds (decimal, no leading zero) or unset, got \
'$DEADLINE'"
[[ $DRY =~ ^[01]$ ]] || bad "DRY must be 0 or 1, got '$DRY'"
K=${K:-$((2 - DRY))}  # iterations: 2, a dry run 1
[[ $K =~ ^[1-9][0-9]{0,2}$ ]] || bad "K must be an iteration count from 1 to 999, got '$K'"
CUDA_GRAPH=${CUDA_GRAPH:-$((1 - DRY))} MPS=${MPS:-$((1 - DRY))}  # below; a CPU gains nothing from either
[[ $CUDA_GRAPH =~ ^[01]$ ]] || bad "CUDA_GRAPH must be 0 or 1, got '$CUDA_GRAPH'"
[[ $MPS =~ ^[01]$ ]] || bad "MPS must be 0 or 1, got '$MPS'"
SEEDS=${SEEDS:-$([ "$DRY" = 1 ] && echo "0 1" || echo "0 1 2")}  # a dry run: two seeds
[[ $SEEDS =~ ^[[:space:]]*(0|[1-9][0-9]{0,5})([[:space:]]+(0|[1-9][0-9]{0,5}))*[[:space:]]*$ ]] || bad "SEEDS must be \
seeds (numbers of at most 6 digits without a leading 0), got '$SEEDS'"
for v in SEEDS ENVS ALGOS; do  # one run folder per env and seed, one log per method
  [ -z "$(printf '%s\n' ${!v} | sort | uniq -d)" ] || bad "$v names one twice (two runs on one folder), got '${!v}'"
done

if [ "$DRY" = 1 ]; then
  chain=(env SMOKE=1 BASE=tiny PRECISION=bf16 RFT_ARGS="${RFT_ARGS:-"--epochs 1"}"
         EVAL_SPLITS="${EVAL_SPLITS:-seen unseen}"
         BC_ARGS="${BC_ARGS:-"--epochs 1 --d-model 32 --n-layers 1 --n-heads 2 --vocab-size 400"}")
  report="$LAB/gpu_lab.md"
else
  # one check for a GPU, here: its run_all.sh calls skip theirs (CPU_OK=1)
  [ -n "${QEVOLVE_LOCKED:-}" ] || $PYTHON -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
    || bad "no GPU here: the lab trains SmolLM2 for 8 minutes on one; DRY=1 runs the same path on a CPU"
  # every process's allocator: growing segments, less lost to fragments while up to 18 processes share the GPU
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  chain=(env BASE=smollm2 SMOLLM2_DIR="$SMOLLM2_DIR" EVAL_WORLDS="0 1" EVAL_SPLITS="${EVAL_SPLITS:-seen unseen}"
         CPU_OK=1
         N_EXPERT="${N_EXPERT:-400}" N_SELF="${N_SELF:-128}" N_EVAL="${N_EVAL:-100}" THREADS="${THREADS:-2}"
         BC_ARGS="${BC_ARGS:-"--epochs 2 --lr 5e-5 --batch-size 16"}"
         CRITIC_ARGS="${CRITIC_ARGS:-"--epochs 1 --lr 1e-5 --batch-size 16"}"
         BPPO_ARGS="${BPPO_ARGS:-"--epochs 1 --lr 2e-6 --batch-size 16"}"
         RFT_ARGS="${RFT_ARGS:-"--epochs 1 --lr 2e-5 --batch-size 16"}"
         ETO_ARGS="${ETO_ARGS:-"--epochs 1 --lr 1e-6 --beta 0.3 --batch-size 16"}" QLASS_M="${QLASS_M:-4}"
         QLASS_ARGS="${QLASS_ARGS:-"--tasks 64 --epochs 1 --lr 1e-5 --batch-size 16 --num-envs 128"}")
  report=bench/results/gpu_lab.md
fi

# Every file it writes: new or one it wrote (plumbing.py's rule), checked first, written atomically (run_support save)
logs=("$LAB/tests.log" "$LAB/decode_step.log" "$LAB/mps.log" "$LAB/machine.log") runs=()
for env in $ENVS; do for seed in $SEEDS; do
  runs+=("$LAB/$env-s$seed") logs+=("$LAB/$env-s$seed".qevolve.it0{,.eval}.log "$LAB/$env-s$seed.seconds")
  for algo in $ALGOS; do
    for k in $(seq 1 "$([ "$algo" = qlass ] && echo 1 || echo "$K")"); do logs+=("$LAB/$env-s$seed.$algo.it$k"{,.eval}.log); done
  done
done; done
if [ -z "${QEVOLVE_LOCKED:-}" ]; then  # first: the checks, then this script again holding each run's folder
  [ -z "$TESTS" ] || $PYTHON -m pytest -q --co -p no:cacheprovider $TESTS >/dev/null 2>&1 || bad "TESTS='$TESTS': \
pytest collects no test from it (python -m pytest --co $TESTS says why)"
  $PYTHON run_support.py check run_log "${logs[@]}"
  $PYTHON run_support.py check table "$report"
  $PYTHON run_support.py check lab "$LAB"  # RUN's rule: new, or only what a lab wrote (a file of its own named above)
  seeds=($SEEDS)
  for env in $ENVS; do  # run_all.sh's settings, as the runs of this env get them (the first seed's)
    "${chain[@]}" ALGOS="$ALGOS" ENV="$env" SEED="${seeds[0]}" K="$K" RUN="$LAB/$env-s${seeds[0]}" \
      PYTHON="$PYTHON" bash run_all.sh --check >/dev/null
  done
  exec $PYTHON run_support.py lock "${runs[@]}" -- bash bench/gpu_lab.sh
fi
[ "$DRY" = 1 ] || [ -e "$SMOLLM2_DIR" ] || $PYTHON -m models.smollm2 --out "$SMOLLM2_DIR" \
  ${SMOLLM2_GGUF:+--gguf "$SMOLLM2_GGUF"}
save() { $PYTHON run_support.py save run_log "$1" bench/gpu_lab.sh; }

pids=() graph=0
start=$(date +%s)
# MPS=1: NVIDIA's multi-process service, so that the processes' small kernels run at once instead of taking turns; its
# daemon in a fresh temporary folder for this lab alone, stopped (and the folder removed) at the end. Without it where the control is missing or a
# first CUDA program failed under it or was served by no server: LAB/mps.log says which, the report quotes it.
# At any end, Ctrl-C (INT) and TERM too: every process the lab started stopped (its runs resume as run_all.sh's do),
# the MPS daemon stopped, and its temporary folders (MPS's, the CUDA-graph verdict's, the sampler's file) gone.
descendants() { local c; for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }  # parents first
daemon=0 mpsdir="" verdict="" use=""
finish() {
  trap - EXIT
  trap '' INT TERM  # a second signal (timeout's TERM to the group) must not cut the cleanup short
  kill -TERM $(descendants $$) 2>/dev/null || true
  [ "$daemon" = 0 ] || echo quit | nvidia-cuda-mps-control || true
  rm -rf -- ${mpsdir:+"$mpsdir"} ${verdict:+"${verdict%/verdict}"} ${use:+"$use"}
}
trap finish EXIT
trap 'exit 130' INT TERM
mps="off (MPS=0)"
if [ "$MPS" = 1 ]; then
  mps="off: no nvidia-cuda-mps-control"
  if command -v nvidia-cuda-mps-control >/dev/null; then
    mpsdir=$(mktemp -d -t gpu_lab_mps.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY=$mpsdir CUDA_MPS_LOG_DIRECTORY=$mpsdir
    mps="off: nvidia-cuda-mps-control -d failed"
    if nvidia-cuda-mps-control -d; then
      daemon=1  # finish stops it
      # a first CUDA program: it allocates (with the lab's allocator setting) and multiplies, as the runs will
      server="" mps="off: a first CUDA program failed under MPS"
      if timeout 120 $PYTHON -c "import torch; torch.cuda.is_available() and \
           (torch.ones(512, 512, device='cuda') @ torch.ones(512, 512, device='cuda')).sum().item()"; then
        server=$(echo get_server_list | nvidia-cuda-mps-control) || server=""
        mps="off: no MPS server served a CUDA program"
      fi
      if [ -n "$server" ]; then mps="on (server $server)"; else echo quit | nvidia-cuda-mps-control; daemon=0; fi
    fi
    [[ $mps == on* ]] || { unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; rm -rf -- "$mpsdir"; mpsdir=""; }
  fi
fi
echo "MPS: $mps" | save "$LAB/mps.log"
# Each second (where nvidia-smi is): the GPU memory all processes hold, its utilisation, the CPU's runnable threads
# (/proc/loadavg) -> LAB/machine.log, in the report.
sampler=""
if command -v nvidia-smi >/dev/null; then
  use=$(mktemp /tmp/gpu_lab_use.XXXXXX)
  ( while kill -0 $$ 2>/dev/null; do  # ends with the lab, however it ends
      gpu=$(nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits \
        | sed -n 1p) || gpu=""  # the first GPU; a failed call is a sample the report skips
      echo "$gpu, $(cut -d' ' -f4 /proc/loadavg | cut -d/ -f1)"; sleep 1
    done > "$use" ) &
  sampler=$!
fi
# 02 --cuda-graph where bench/speed/decode_step.py timed SmolLM2's decode step (random weights, 128 rows) faster from a
# CUDA graph than eager (LAB/decode_step.log); it runs beside BC; each run's first 02 waits for $verdict (1 graph, 0 not)
verdict=$(mktemp -d -t gpu_lab_graph.XXXXXX)/verdict  # its folder removed when the runs end
( set +e; c=0
  if [ "$CUDA_GRAPH" = 1 ]; then
    if timeout 240 $PYTHON bench/speed/decode_step.py --model "$SMOLLM2_DIR" --random --batch 128 --cuda-graph 2>&1 \
         | save "$LAB/decode_step.log"; then
      ms() { grep -o "$1: [0-9.]*" "$LAB/decode_step.log" | awk '{ print $NF }'; }
      if awk "BEGIN { exit !($(ms 'cuda graph') < $(ms eager)) }"; then c=1; fi
    fi
    [ "$c" = 1 ] || echo "gpu_lab: the CUDA-graph decode step failed or was not faster ($LAB/decode_step.log): \
02 runs eager" >&2
  fi
  echo "$c" > "$verdict.new" && mv "$verdict.new" "$verdict" ) &
judge=$!
# lab ALGO ENV SEED K EVAL: run_all.sh for one algorithm up to iteration K, resuming; EVAL=0 its training, 1 its
# evaluations; stopped at DEADLINE. Its log: LAB/<env>-s<seed>.<algo>.it<K>[.eval].log
lab() {
  local left="" log=$LAB/$2-s$3.$1.it$4
  [ "$5" = 0 ] || log+=.eval
  if [ -n "$DEADLINE" ]; then left=$(( DEADLINE - ($(date +%s) - start) )); [ "$left" -gt 0 ] || return 124; fi
  ${left:+timeout "$left"} "${chain[@]}" CUDA_GRAPH="$graph" ALGOS="$1" ENV="$2" SEED="$3" K="$4" EVAL="$5" \
    RUN="$LAB/$2-s$3" PYTHON="$PYTHON" bash run_all.sh 2>&1 | save "$log.log"
}
# Per run: BC, then iteration by iteration (every method finishes k before any starts k + 1: DEADLINE stops them
# alike); iteration 1's baselines start once Q-Evolve's episodes exist, QLASS (trees of policy_0, once) with them.
# Iteration k's evaluations run beside k + 1's training.
others=$(printf '%s\n' $ALGOS | grep -vx qevolve | tr '\n' ' ' || true)
for env in $ENVS; do
  for seed in $SEEDS; do
    ( t0=$(date +%s) rc=0 evals=() run=$LAB/$env-s$seed
      lab qevolve "$env" "$seed" 0 0 || rc=$?  # BC (K=0): expert demos and policy_0
      until [ -e "$verdict" ]; do sleep 1; done
      graph=$(cat "$verdict")
      if [ "$rc" = 0 ]; then lab qevolve "$env" "$seed" 0 1 & evals=($!); fi  # BC's evaluation
      for k in $(seq 1 "$K"); do
        [ "$rc" = 0 ] || break
        lab qevolve "$env" "$seed" "$k" 0 & trains=($!)
        until [ -e "$run/iter_1/self.json" ] || ! kill -0 "${trains[0]}" 2>/dev/null; do sleep 1; done
        ran=(qevolve)
        if [ -e "$run/iter_1/self.json" ]; then
          for algo in $others; do
            [ "$algo" != qlass ] || [ "$k" = 1 ] || continue
            lab "$algo" "$env" "$seed" "$k" 0 & trains+=($!) ran+=("$algo")
          done
        fi
        for pid in "${trains[@]}" "${evals[@]}"; do wait "$pid" || rc=$?; done
        [ "$rc" = 0 ] || break
        evals=()
        for algo in "${ran[@]}"; do lab "$algo" "$env" "$seed" "$k" 1 & evals+=($!); done
      done
      for pid in "${evals[@]}"; do wait "$pid" || rc=$?; done
      echo $(( $(date +%s) - t0 )) | save "$LAB/$env-s$seed.seconds"
      exit "$rc" ) &
    pids+=($!)
  done
done
if [ -n "$TESTS" ]; then
  ( $PYTHON -m pytest -v -p no:cacheprovider $TESTS 2>&1 | save "$LAB/tests.log" ) &
  pids+=($!)
fi
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done  # by id: never a monitor started beside them
wait "$judge" || true  # the verdict's writer, before its folder goes
rm -r -- "${verdict%/verdict}"
echo "gpu_lab: the runs took $(( $(date +%s) - start )) s"
if [ -n "$sampler" ]; then kill "$sampler" || true; save "$LAB/machine.log" < "$use"; rm -f "$use"; fi
command="bash bench/gpu_lab.sh"  # with the settings it was given, for the report's first line
for v in TESTS DEADLINE N_EVAL N_SELF N_EXPERT K SEEDS ENVS CUDA_GRAPH MPS DRY; do
  if printenv "$v" >/dev/null; then val=${!v}; [[ $val == *' '* ]] && val="'$val'"; command="$v=$val $command"; fi
done
$PYTHON bench/gpu_report.py --lab "$LAB" --out "$report" --command "$command"
if [ "$failed" = 1 ]; then echo "gpu_lab: a run or a test failed (logs in $LAB)" >&2; fi
exit "$failed"
