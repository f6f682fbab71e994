"""The paper's ablation table in miniature, plus the baselines: one row per variant, seen / unseen success and average
reward (each seed's mean over its run's worlds) as mean +- std over seeds, and the environment steps each used. Every
variant starts from a default run (run_all.sh with K=1, ALGOS="qevolve rft outcome"; bench/seeds.py makes it if
missing) and changes one thing: a stage's flags (VARIANTS below) in a run_all.sh run runs/seed<k>/ablation/<variant>
into which the default run's artifacts upstream of that stage are hard-linked (run_all.sh redoes only what is
downstream); w/o PI is policy_0 with the default critic reranking --candidates samples per step (02 --rerank). Reruns
resume (skip-if-exists). A measurement, not a test.

    python bench/ablation.py --parallel          # seeds 0 1 2: runs/seed<k>
    python bench/ablation.py --seeds 0           # one seed, one process
    python bench/ablation.py --parallel --variants rft awr   # only some rows (the others: 'not run')
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.runner import (check_runs, command, distinct, eval_worlds, evaluations, launch, measured, pm, row,  # noqa
                          runs_parser, table_out, wait, write_table)
from plumbing import check_flags, check_out, die, save_text  # noqa: E402
from run_support import open_log, read_settings  # noqa: E402

SPLITS = ("seen", "unseen")

# name, label, what it is: a policy run_all.sh evaluated, run_all.sh's settings added to the default run's, or rerank
VARIANTS = [
    ("bc", "BC (SFT)", "policy_0"),
    ("qevolve", "Q-Evolve (full)", "policy_1"),
    ("rft", "RFT (BC on expert + successful self)", "rft_policy_1"),
    ("outcome", "outcome-level PG (A_t = R - mean R, no critic)", "outcome_policy_1"),
    ("no_rr", "w/o retrospective rewards (--no-aux)", {"CRITIC_ARGS": "--no-aux"}),
    ("no_wiql", "w/o weighted IQL (--uniform-weights)", {"CRITIC_ARGS": "--uniform-weights"}),
    ("no_gae", "w/o GAE (--advantage qv)", {"GAE_ARGS": "--advantage qv"}),
    ("aux_adv", "r_aux also in A_t (--rewards critic)", {"GAE_ARGS": "--rewards critic"}),
    ("no_pi", "w/o policy improvement (Q-rerank of BC samples)", "rerank"),
    ("awr", "AWR instead of BPPO", {"BPPO_ARGS": "--objective awr"}),
    ("centred", "A centred (--adv-norm center)", {"BPPO_ARGS": "--adv-norm center"}),
    ("sym_clip", "symmetric clipping (eps_low = eps_high = 0.2)", {"BPPO_ARGS": "--eps-low 0.2 --eps-high 0.2"}),
]
# what a variant of each stage's flags takes from the default run: everything upstream of that stage
SHARED = {"CRITIC_ARGS": [], "GAE_ARGS": ["iter_1/critic"], "BPPO_ARGS": ["iter_1/critic", "iter_1/adv.jsonl",
                                                                          "iter_1/adv.json"]}


def share(run, d, key):
    """The default run's artifacts upstream of the variant's stage, hard-linked into its RUN folder d: the expert
    demos, policy_0 and its evaluations, iteration 1's self buffer (and critic / advantages)."""
    evals = [os.path.join("eval", f"world{w}", f) for w in eval_worlds(run)
             for f in os.listdir(os.path.join(ROOT, run, "eval", f"world{w}")) if f.startswith("policy_0_")]
    for p in ["data", "policy_0", "iter_1/self.jsonl", "iter_1/self.json", *SHARED[key], *evals]:
        src, dst = os.path.join(ROOT, run, p), os.path.join(ROOT, d, p)
        if not os.path.lexists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copytree(src, dst, copy_function=os.link) if os.path.isdir(src) else os.link(src, dst)


def run_variant(run, seed, threads, candidates, log, only):
    """The variants named in `only` of one seed: each a run_all.sh run (K=1, its RUN run/ablation/<name>) from the
    default run's shared artifacts with the variant's flags after the run's own *_ARGS; w/o PI an 02 --rerank of
    policy_0. Whatever exists is skipped (run_all.sh's rule), so a rerun resumes."""
    record = {k: v for k, v in read_settings(os.path.join(ROOT, run)).items() if k != "stage"}
    worlds = eval_worlds(run)
    for name, _, how in sorted(VARIANTS, key=lambda v: v[2] == "rerank"):  # the slow rerank last
        d = f"{run}/ablation/{name}"
        if name not in only or how not in ("rerank",) and isinstance(how, str):
            continue
        if how == "rerank":  # evaluated in the run's own environment (ENV / ENV_KWARGS), as 02 recorded it
            run_args = json.load(open(os.path.join(ROOT, run, "data", "expert.json")))["args"]
            for w in worlds:
                for split in SPLITS:
                    if os.path.exists(os.path.join(ROOT, f"{d}/world{w}/{split}.json")):
                        continue
                    cmd = [sys.executable, "02_collect.py", "--policy", f"{run}/policy_0", "--env", run_args["env"],
                           "--env-kwargs", run_args["env_kwargs"], "--env-seed", w, "--split", split, "--rerank",
                           f"{run}/iter_1/critic", "--candidates", str(candidates), "--out",
                           f"{d}/world{w}/{split}.jsonl", "--seed", str(seed), "--threads", str(threads),
                           "--metrics", f"{run}/ablation/metrics.jsonl"]
                    print("==", " ".join(cmd), file=log, flush=True)
                    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
            continue
        (key, flags), = how.items()
        share(run, d, key)
        settings = {**record, key: f"{record.get(key, '')} {flags}".strip()}
        if not os.path.exists(os.path.join(ROOT, d, "settings.json")):  # the record run_all.sh would write
            check_out(os.path.join(ROOT, d, "settings.json"), "settings")
            save_text(os.path.join(ROOT, d, "settings.json"), json.dumps({"stage": "run_all.sh", **settings}, indent=2)
                      + "\n")
        print(f"== {name}: bash run_all.sh with RUN={d} K=1 {key}={settings[key]!r}", file=log, flush=True)
        proc = launch(d, {**settings, "K": "1", "ALGOS": "qevolve", "EVAL_SPLITS": " ".join(SPLITS), "N_EVAL": "0",
                          "EVAL_WORLDS": " ".join(worlds), "THREADS": str(threads), "PYTHON": sys.executable}, log)
        if wait(proc)[0]:
            raise subprocess.CalledProcessError(proc.returncode, "run_all.sh")


def result(run, name, split):
    """(the evaluation over the run's worlds: mean success and reward, summed costs; env steps spent on training
    data) of one variant; KeyError: not run."""
    how = next(v[2] for v in VARIANTS if v[0] == name)
    if how == "rerank":
        found = {w: f"{run}/ablation/{name}/world{w}/{split}.json" for w in eval_worlds(run)}
        found = {w: json.load(open(os.path.join(ROOT, p))) for w, p in found.items() if os.path.exists(
            os.path.join(ROOT, p))}
    else:
        found = evaluations(run if isinstance(how, str) else f"{run}/ablation/{name}")
        found = {w: e for (pol, w, s), e in found.items() if s == split and pol == (
            how if isinstance(how, str) else "policy_1")}
    evals = [found[w] for w in eval_worlds(run)]
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
    p = runs_parser(__doc__, "ablation")
    p.add_argument("--candidates", type=int, default=4, help="w/o PI: candidate replies per step for the rerank")
    p.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS], choices=[v[0] for v in VARIANTS],
                   metavar="NAME", help="run only these variants (default: all): " + ", ".join(v[0] for v in VARIANTS))
    args = p.parse_args()
    check_flags(args, candidates="at least 1")
    distinct("--seeds", args.seeds)
    if len(set(args.variants)) < len(args.variants):
        die(f"--variants must be distinct, got {' '.join(args.variants)}")
    check_runs(args.prefix, args.seeds, made=args.table_only)
    table_out(args.out, "bench/ablation.py")
    t0 = time.time()
    runs = [f"{args.prefix}{s}" for s in args.seeds]
    if not args.table_only:
        for r in runs:  # before any work: each log new, or one this script wrote (its stamped first line)
            check_out(os.path.join(ROOT, f"{r}.ablation.log"), "run_log")
        run_all_variants(args, runs)

    lines = [measured(command("bench/ablation.py")) + f" (seeds {' '.join(map(str, args.seeds))}; one iteration; "
             f"100 greedy episodes per split and world, w/o PI samples {args.candidates} candidates per step at "
             f"temperature 1; each seed's mean over worlds {', '.join(eval_worlds(runs[0]))}"
             + ("" if args.table_only else f"; this call took {(time.time() - t0) / 60:.0f} min") + ").",
             "", "| variant | seen success | unseen success | seen avg reward | unseen avg reward | train env steps "
             "| eval env steps (seen + unseen, all worlds) | eval tokens generated |", "|---" * 8 + "|"]
    res = {}
    for name, _, _ in VARIANTS:
        try:
            res[name] = {split: [result(r, name, split) for r in runs] for split in SPLITS}
        except (FileNotFoundError, KeyError):
            pass
    mean = statistics.mean
    for name, label, _ in VARIANTS:
        if name not in res:
            lines.append(f"| {label} | not run | | | | | | |")
            continue
        (s_res, u_res), ok = res[name].values(), lambda rs: [x["success_rate"] * 100 for x, _ in rs]
        both = lambda k: mean(a[k] + b[k] for (a, _), (b, _) in zip(s_res, u_res))
        lines.append(row(label, pm(ok(s_res)), pm(ok(u_res)), f"{mean(x['avg_reward'] for x, _ in s_res):.3f}",
                         f"{mean(x['avg_reward'] for x, _ in u_res):.3f}", f"{mean(st for _, st in s_res):.0f}",
                         f"{both('env_steps'):.0f}", f"{both('generated_tokens'):.0f}"))
    lines += ["", "Per seed (seen / unseen success):", "",
              "| variant | " + " | ".join(f"seed {s}" for s in args.seeds) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(f"{a['success_rate']:.0%} / {b['success_rate']:.0%}"
                                          for (a, _), (b, _) in zip(*res[name].values())) + " |"
              for name, label, _ in VARIANTS if name in res]
    write_table(args.out, lines)


if __name__ == "__main__":
    main()
