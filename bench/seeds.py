"""Run the default chain (run_all.sh) for several seeds and write the table the README shows:
per-seed and mean +- std success on seen / unseen for BC and every Q-Evolve iteration,
plus wall time and peak memory of each run. A measurement, not a test.

    python bench/seeds.py                      # seeds 0 1 2, runs/seed<k>, writes bench/results/seeds.md
    EVAL_SPLITS='dev seen unseen' python bench/seeds.py --parallel   # the README's table (also dev)
    CRITIC_ARGS="--epochs 6" python bench/seeds.py --parallel --prefix runs/c6_s --out /tmp/seeds_c6.md

run_all.sh's settings (K, ENV_KWARGS, BC_ARGS, COLLECT_ARGS, BPPO_ARGS, N_EXPERT, N_SELF, ...)
are read from the environment as usual; the ones that are set are named in the table's header.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run_all.sh's variables that change what a run does (RUN, SEED, THREADS and PYTHON are set here).
# K is always printed.
RUN_ALL_SETTINGS = ["ENV", "ENV_KWARGS", "BASE", "PRETRAIN_ARGS", "N_EXPERT", "N_SELF", "N_EVAL", "EVAL_SPLITS",
                    "KEEP_OLD", "BC_ARGS", "COLLECT_ARGS", "CRITIC_ARGS", "GAE_ARGS", "BPPO_ARGS"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds to run")
    p.add_argument("--prefix", default="runs/seed", help="run directory prefix (seed number appended)")
    p.add_argument("--out", default="bench/results/seeds.md", help="markdown table to write")
    p.add_argument("--parallel", action="store_true", help="run the seeds at once, one torch thread each")
    args = p.parse_args()
    K = int(os.environ.get("K", 2))  # run_all.sh's default
    runs = []
    procs = []
    for seed in args.seeds:
        run = f"{args.prefix}{seed}"
        env = {**os.environ, "RUN": run, "SEED": str(seed), "PYTHON": sys.executable}
        if args.parallel:
            env["THREADS"] = "1"
        fresh = not os.path.exists(os.path.join(ROOT, run, "results.md"))
        log = open(os.path.join(ROOT, f"{run}.log"), "w")
        t0 = time.time()
        proc = subprocess.Popen(["bash", "run_all.sh"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, t0))
        runs.append({"seed": seed, "run": run, "fresh": fresh})
        if not args.parallel:
            proc.wait()
            runs[-1]["wall_s"] = time.time() - t0
    for (proc, t0), r in zip(procs, runs):
        if proc.wait() != 0:
            sys.exit(f"run_all.sh failed for seed {r['seed']}; see {r['run']}.log")
        r.setdefault("wall_s", time.time() - t0)
    # ru_maxrss of children = the largest process any stage ran (KiB on Linux)
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024

    def rate(run, k, split):
        return json.load(open(os.path.join(ROOT, run, "eval", f"policy_{k}_{split}.json")))["success_rate"] * 100

    settings = [f"{k}={shlex.quote(os.environ[k])}" for k in RUN_ALL_SETTINGS if os.environ.get(k)]
    command = " ".join(settings + ["python", "bench/seeds.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    how = "in parallel, one torch thread each" if args.parallel else "one after another"
    lines = [f"Measured {datetime.date.today()} on {platform.machine()} with {os.cpu_count()} CPU cores by "
             f"`{command}` "
             f"(K={K}, {'these' if settings else 'default'} settings of run_all.sh; seeds run {how}).", "",
             "| policy | " + " | ".join(f"seed {r['seed']} seen / unseen" for r in runs)
             + " | mean +- std seen | mean +- std unseen |",
             "|---|" + "---|" * (len(runs) + 2)]
    for k in range(K + 1):
        seen = [rate(r["run"], k, "seen") for r in runs]
        unseen = [rate(r["run"], k, "unseen") for r in runs]
        sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
        name = "BC (policy_0)" if k == 0 else f"Q-Evolve iter {k} (policy_{k})"
        cells = " | ".join(f"{s:.0f}% / {u:.0f}%" for s, u in zip(seen, unseen))
        lines.append(f"| {name} | {cells} | {statistics.mean(seen):.1f} +- {sd(seen):.1f} | "
                     f"{statistics.mean(unseen):.1f} +- {sd(unseen):.1f} |")
    lines += ["", "| seed | wall time of this call | first to last artifact of the run |", "|---|---|---|"]
    for r in runs:
        note = "" if r["fresh"] else " (resumed: finished stages skipped)"
        first = os.path.getmtime(os.path.join(ROOT, r["run"], "data", "expert.jsonl"))
        last = os.path.getmtime(os.path.join(ROOT, r["run"], "eval", f"policy_{K}_unseen.json"))
        lines.append(f"| {r['seed']} | {r['wall_s'] / 60:.1f} min{note} | {(last - first) / 60:.1f} min |")
    if any(r["fresh"] for r in runs):
        lines += ["", f"Peak memory of the largest single stage process: {peak_mib:.0f} MiB."]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)), exist_ok=True)
    with open(os.path.join(ROOT, args.out), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
