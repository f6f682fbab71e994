"""The paper's ablation table in miniature (AlfWorld, 1 iteration in the paper), plus the
baselines: one row per variant, seen / unseen success and average reward (each seed's mean over
the worlds its run was evaluated in, run_all.sh's EVAL_WORLDS) as mean +- std over seeds, and the
environment steps each used. A measurement, not a test.

Every variant starts from the same artifacts of a default run (run_all.sh, iteration 1), which are
reused, never recomputed: the expert demos, the BC policy (policy_0), the self-collected
buffer of iteration 1 and the default critic / advantages / Q-Evolve policy. A variant changes
exactly one thing and redoes only the stages downstream of it:

    BC (SFT)           policy_0, as run_all.sh evaluated it
    Q-Evolve           policy_1, as run_all.sh evaluated it
    RFT                rft/policy_1 of run_all.sh (ALGOS=rft): 01 --filter success on expert + self, from policy_0
    outcome-level PG   outcome/policy_1 of run_all.sh (ALGOS=outcome): 04 --advantage outcome -> 05, no critic
    w/o RR             03_critic.py --no-aux             -> 04 -> 05
    w/o W-IQL          03_critic.py --uniform-weights    -> 04 -> 05
    w/o GAE            04_gae.py --advantage qv          -> 05
    r_aux in A_t       04_gae.py --rewards critic        -> 05  (A_t on r_env + r_aux; the paper keeps it out)
    w/o PI             no policy update: policy_0 acts, the default critic reranks
                       --candidates sampled replies per step (02_collect.py --rerank; QLASS-style)
    AWR                05_bppo.py --objective awr
    A centred          05_bppo.py --adv-norm center (the buffer's mean advantage removed: the gain left is step credit)
    symmetric clip     05_bppo.py --eps-low 0.2 (= --eps-high)

    python bench/ablation.py --parallel          # seeds 0 1 2: runs/seed<k> (made by bench/seeds.py if missing,
                                                 # its table runs/seed0_1_2.seeds.md)
    python bench/ablation.py --seeds 0           # one seed, one process
    python bench/ablation.py --parallel --variants rft awr   # only some rows (the others: 'not run')

Outputs go to runs/seed<k>/ablation/<variant>/ (skip-if-exists, so a rerun resumes) and the
table to bench/results/ablation.md.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench._stages import check_runs, eval_worlds  # noqa: E402
from plumbing import Parser, check_flags, check_out, die, read_json, save_text  # noqa: E402
from run_support import open_log  # noqa: E402

SPLITS = ("seen", "unseen")

# name, label, stage that changes (None: reuse run_all.sh's artifacts), its extra flags
VARIANTS = [
    ("bc", "BC (SFT)", None, ""),
    ("qevolve", "Q-Evolve (full)", None, ""),
    ("rft", "RFT (BC on expert + successful self)", None, ""),
    ("outcome", "outcome-level PG (A_t = R - mean R, no critic)", None, ""),
    ("no_rr", "w/o retrospective rewards (--no-aux)", "03", "--no-aux"),
    ("no_wiql", "w/o weighted IQL (--uniform-weights)", "03", "--uniform-weights"),
    ("no_gae", "w/o GAE (--advantage qv)", "04", "--advantage qv"),
    ("aux_adv", "r_aux also in A_t (--rewards critic)", "04", "--rewards critic"),
    ("no_pi", "w/o policy improvement (Q-rerank of BC samples)", "rerank", ""),
    ("awr", "AWR instead of BPPO", "05", "--objective awr"),
    ("centred", "A centred (--adv-norm center)", "05", "--adv-norm center"),
    ("sym_clip", "symmetric clipping (eps_low = eps_high = 0.2)", "05", "--eps-low 0.2 --eps-high 0.2"),
]


def run_variant(run, seed, threads, candidates, log, only):
    """Run the variants named in `only` of one seed, stage by stage; an existing output is skipped."""
    py = sys.executable
    common = ["--seed", str(seed), "--threads", str(threads), "--metrics", f"{run}/ablation/metrics.jsonl"]
    buffer = [f"{run}/data/expert.jsonl", f"{run}/iter_1/self.jsonl"]
    # evaluate in the run's own environment (run_all.sh's ENV / ENV_KWARGS), as 02 recorded it
    with open(os.path.join(ROOT, run, "data", "expert.json")) as f:
        run_args = json.load(f)["args"]
    envargs = ["--env", run_args["env"], "--env-kwargs", run_args["env_kwargs"]]
    # the run's own stage flags (run_all.sh's *_ARGS, as its settings.json recorded them), the variant's after them
    ran = {k: shlex.split((read_json(os.path.join(ROOT, run, "settings.json")) or {}).get(k, ""))
           for k in ("CRITIC_ARGS", "GAE_ARGS", "BPPO_ARGS")}

    def stage(out, cmd):
        if os.path.exists(os.path.join(ROOT, out)):
            return
        print("==", " ".join(cmd), file=log, flush=True)
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)

    def evaluate(policy, d, rerank=()):
        for w in eval_worlds(run):
            for split in SPLITS:
                stage(f"{d}/world{w}/{split}.json", [py, "02_collect.py", "--policy", policy, *envargs, "--env-seed", w,
                                                     "--split", split, *(rerank or ["--greedy"]),
                                                     "--out", f"{d}/world{w}/{split}.jsonl", *common])

    for name, _, changes, flags in sorted(VARIANTS, key=lambda v: v[2] == "rerank"):  # the slow rerank last
        if name not in only:
            continue
        d = f"{run}/ablation/{name}"
        extra = flags.split()
        if changes is None:
            continue
        if changes == "rerank":
            evaluate(f"{run}/policy_0", d, ["--rerank", f"{run}/iter_1/critic", "--candidates", str(candidates)])
            continue
        else:
            critic, adv = f"{run}/iter_1/critic", f"{run}/iter_1/adv.jsonl"
            if changes == "03":
                critic = f"{d}/critic"
                stage(critic, [py, "03_critic.py", "--data", *buffer, "--policy", f"{run}/policy_0",
                               "--out", critic, *ran["CRITIC_ARGS"], *extra, *common])
            if changes in ("03", "04"):
                adv = f"{d}/adv.jsonl"
                stage(f"{d}/adv.json", [py, "04_gae.py", "--data", *buffer, "--critic", critic, "--out", adv,
                                        *ran["GAE_ARGS"], *(extra if changes == "04" else []), *common])
            stage(f"{d}/policy", [py, "05_bppo.py", "--data", adv, "--policy", f"{run}/policy_0",
                                  "--ref", f"{run}/policy_0", "--out", f"{d}/policy", *ran["BPPO_ARGS"],
                                  *(extra if changes == "05" else []), *common])
        evaluate(f"{d}/policy", d)


def result(run, name, split):
    """(summary of the evaluation over the run's worlds: mean success and reward, summed costs,
    env steps spent on training data) of one variant."""
    policy = {"bc": "policy_0", "qevolve": "policy_1", "rft": "rft_policy_1", "outcome": "outcome_policy_1"}.get(name)
    path = (f"{run}/ablation/{name}/world{{}}/{split}.json" if policy is None
            else f"{run}/eval/world{{}}/{policy}_{split}.json")
    evals = [json.load(open(os.path.join(ROOT, path.format(w)))) for w in eval_worlds(run)]
    summary = {k: statistics.mean(e[k] for e in evals) for k in ("success_rate", "avg_reward")}
    summary.update({k: sum(e[k] for e in evals) for k in ("env_steps", "generated_tokens")})
    steps = json.load(open(os.path.join(ROOT, run, "data", "expert.json")))["env_steps"]
    if name != "bc":  # every other variant learns from (or, for w/o PI, its critic learns from) the self data
        steps += json.load(open(os.path.join(ROOT, run, "iter_1", "self.json")))["env_steps"]
    return summary, steps


def run_all_variants(args, runs):
    """Make any missing default run (bench/seeds.py), then every variant of every seed."""
    missing = [s for s, r in zip(args.seeds, runs) if not os.path.exists(os.path.join(ROOT, r, "results.md"))]
    if missing:  # the shared artifacts: the default chain and its baselines, K=1
        cmd = [sys.executable, "bench/seeds.py", "--seeds", *map(str, missing), "--prefix", args.prefix,
               "--out", f"{args.prefix}{'_'.join(map(str, missing))}.seeds.md"]  # beside the runs, not bench/results
        subprocess.run(cmd + (["--parallel"] if args.parallel else []), cwd=ROOT, check=True,
                       env={**os.environ, "K": "1", "ALGOS": "qevolve rft outcome"})
    threads = 1 if args.parallel else 2
    logs = [open_log(os.path.join(ROOT, f"{r}.ablation.log"), "bench/ablation.py") for r in runs]
    if args.parallel:
        import multiprocessing as mp
        procs = [mp.Process(target=run_variant, args=(r, s, threads, args.candidates, log, args.variants))
                 for r, s, log in zip(runs, args.seeds, logs)]
        for pr in procs:
            pr.start()
        for pr, r in zip(procs, runs):
            pr.join()
            if pr.exitcode:
                sys.exit(f"a stage failed for {r}; see {r}.ablation.log")
    else:
        for r, s, log in zip(runs, args.seeds, logs):
            try:
                run_variant(r, s, threads, args.candidates, log, args.variants)
            except subprocess.CalledProcessError:
                sys.exit(f"a stage failed for {r}; see {r}.ablation.log")


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (run directories --prefix<seed>)")
    p.add_argument("--prefix", default="runs/seed", help="run directory prefix, as bench/seeds.py writes them")
    p.add_argument("--candidates", type=int, default=4, help="w/o PI: candidate replies per step for the rerank")
    p.add_argument("--parallel", action="store_true", help="run the seeds at once, one torch thread each")
    p.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS], choices=[v[0] for v in VARIANTS],
                   metavar="NAME", help="run only these variants (default: all): " + ", ".join(v[0] for v in VARIANTS))
    p.add_argument("--out", default="bench/results/ablation.md", help="markdown table to write")
    p.add_argument("--table-only", action="store_true",
                   help="run nothing: write the table from the variants finished so far (others: 'not run')")
    args = p.parse_args()
    check_flags(args, candidates="at least 1")
    if min(args.seeds) < 0 or len(set(args.seeds)) < len(args.seeds):  # two runs of one seed share a directory
        die(f"--seeds must be distinct non-negative integers, got {' '.join(map(str, args.seeds))}")
    if len(set(args.variants)) < len(args.variants):
        die(f"--variants must be distinct, got {' '.join(args.variants)}")
    if not args.out.endswith(".md"):
        die(f"--out {args.out}: the table is markdown, its name must end in .md")
    check_runs(args.prefix, args.seeds, made=args.table_only)
    check_out(os.path.join(ROOT, args.out), "table")  # a table this script (or seeds.py) wrote, or a new file
    t0 = time.time()
    runs = [f"{args.prefix}{s}" for s in args.seeds]
    if not args.table_only:
        for r in runs:  # before any work: each log new, or one this script wrote (its stamped first line)
            check_out(os.path.join(ROOT, f"{r}.ablation.log"), "run_log")
        run_all_variants(args, runs)

    sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
    lines = [f"Measured {datetime.date.today()} on {platform.machine()} with {os.cpu_count()} CPU cores by "
             f"`{' '.join(['python', 'bench/ablation.py'] + [shlex.quote(a) for a in sys.argv[1:]])}` (seeds "
             f"{' '.join(map(str, args.seeds))}; one iteration; 100 greedy episodes per split and world, "
             f"w/o PI samples "
             f"{args.candidates} candidates per step at temperature 1; each seed's mean over worlds "
             f"{', '.join(eval_worlds(runs[0]))}"
             + ("" if args.table_only else f"; this call took {(time.time() - t0) / 60:.0f} min") + ").",
             "", "| variant | seen success | unseen success | seen avg reward | unseen avg reward | train env steps "
             "| eval env steps (seen + unseen, all worlds) | eval tokens generated |",
             "|---|---|---|---|---|---|---|---|"]
    def done(name):
        try:
            [result(r, name, split) for r in runs for split in SPLITS]
            return True
        except FileNotFoundError:
            return False

    for name, label, _, _ in VARIANTS:
        if not done(name):
            lines.append(f"| {label} | not run | | | | | | |")
            continue
        cells = {}
        for split in SPLITS:
            res = [result(r, name, split) for r in runs]
            succ = [x["success_rate"] * 100 for x, _ in res]
            rew = [x["avg_reward"] for x, _ in res]
            cells[split] = (succ, rew, res)
        (s_succ, s_rew, s_res), (u_succ, u_rew, u_res) = cells["seen"], cells["unseen"]
        steps = statistics.mean(st for _, st in s_res)
        ev_steps = statistics.mean(a["env_steps"] + b["env_steps"] for (a, _), (b, _) in zip(s_res, u_res))
        ev_tok = statistics.mean(a["generated_tokens"] + b["generated_tokens"] for (a, _), (b, _) in zip(s_res, u_res))
        lines.append(f"| {label} | {statistics.mean(s_succ):.1f} +- {sd(s_succ):.1f} | "
                     f"{statistics.mean(u_succ):.1f} +- {sd(u_succ):.1f} | {statistics.mean(s_rew):.3f} | "
                     f"{statistics.mean(u_rew):.3f} | {steps:.0f} | {ev_steps:.0f} | {ev_tok:.0f} |")
    lines += ["", "Per seed (seen / unseen success):", "",
              "| variant | " + " | ".join(f"seed {s}" for s in args.seeds) + " |", "|---|" + "---|" * len(runs)]
    for name, label, _, _ in VARIANTS:
        if not done(name):
            continue
        row = [f"{result(r, name, 'seen')[0]['success_rate']:.0%} / {result(r, name, 'unseen')[0]['success_rate']:.0%}"
               for r in runs]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    save_text(os.path.join(ROOT, args.out), text)
    print(text)


if __name__ == "__main__":
    main()
