"""Run the default chain (run_all.sh) for several seeds and write the README's tables: greedy success of BC and each
iteration of each algorithm of ALGOS on each split of EVAL_SPLITS, per seed and as mean +- std over every (seed, world)
evaluation; per world with Q-Evolve's gain over BC; each run's time. run_all.sh's settings come from the environment
(those set are named in the table's header). A measurement, not a test.

    python bench/seeds.py                      # seeds 0 1 2, runs/seed<k>, writes runs/<ENV>_seeds.md
    EVAL_SPLITS='dev seen unseen' python bench/seeds.py --parallel   # the README's table (also dev)
    CRITIC_ARGS="--epochs 6" python bench/seeds.py --parallel --prefix runs/c6_s --out /tmp/seeds_c6.md
    ALGOS="qevolve rft outcome" python bench/seeds.py --parallel --table-only   # the table of runs as they stand
"""
import json
import os
import re
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import runner  # noqa: E402
from bench.mistakes import closed_arrivals  # noqa: E402
from critic_report import report_of  # noqa: E402
from envs import judge  # noqa: E402
from plumbing import check_out, die, read_json  # noqa: E402
from run_support import open_log, read_settings  # noqa: E402

# run_all.sh's variables that change what a run does (RUN, SEED, THREADS and PYTHON are set here).
# K is always printed.
RUN_ALL_SETTINGS = ["ENV", "ENV_KWARGS", "BASE", "PRETRAIN_ARGS", "N_EXPERT", "N_SELF", "N_EVAL", "EVAL_SPLITS",
                    "EVAL_WORLDS", "KEEP_OLD", "BC_ARGS", "COLLECT_ARGS", "CRITIC_ARGS", "GAE_ARGS", "BPPO_ARGS",
                    "ALGOS", "RFT_ARGS", "OUTCOME_ARGS", "ETO_ARGS", "QLASS_ARGS", "QLASS_M", "DEMOS", "REF",
                    "LATER_ARGS"]


def main():
    args = runner.runs_parser(__doc__, "seeds").parse_args()
    runner.distinct("--seeds", args.seeds)
    runner.check_runs(args.prefix, args.seeds, made=args.table_only)
    runner.table_out(args.out, "bench/seeds.py")  # before any run
    for seed in [] if args.table_only else args.seeds:  # its log (new, or one this script wrote), then every setting
        check_out(os.path.join(ROOT, f"{args.prefix}{seed}.log"), "run_log")
        runner.check(f"{args.prefix}{seed}", {"SEED": str(seed)}, f"seed {seed}: ")
    K = os.environ.get("K", "2")  # run_all.sh's default, read as run_all.sh reads it
    if not re.fullmatch(r"0|[1-9][0-9]{0,8}", K) or int(K) > 999:
        die(f"K must be a non-negative integer (decimal, no leading zero, at most 999), got {K!r}")
    K = int(K)
    runs, procs = [], []
    for seed in [] if args.table_only else args.seeds:
        run = f"{args.prefix}{seed}"
        env = {"SEED": str(seed), "PYTHON": sys.executable, **({"THREADS": "1"} if args.parallel else {})}
        runs.append({"seed": seed, "run": run, "fresh": not os.path.exists(os.path.join(ROOT, run, "results.md"))})
        log = open_log(os.path.join(ROOT, f"{run}.log"), "bench/seeds.py",
                       f": bash run_all.sh with RUN={run} SEED={seed}")
        procs.append((runner.launch(run, env, log), time.time()))
        if args.parallel and len(procs) == 1:  # the first run builds the shared base model alone (once)
            while runner.running(procs[0][0]) and "02_collect.py" not in open(log.name).read():
                time.sleep(2)
        if not args.parallel:
            runs[-1]["code"], runs[-1]["wall_s"], _, runs[-1]["peak_mib"] = runner.wait(*procs[-1])
    for proc, r in zip(procs, runs):
        if "code" not in r:
            r["code"], r["wall_s"], _, r["peak_mib"] = runner.wait(*proc)
        if r["code"] != 0:
            sys.exit(f"run_all.sh failed for seed {r['seed']}; see {r['run']}.log")
    made = f"{'these' if any(os.environ.get(k) for k in RUN_ALL_SETTINGS) else 'default'} settings of run_all.sh"
    if args.table_only:  # what made the runs: their last iteration evaluated, the settings they recorded
        runs = [{"seed": seed, "run": f"{args.prefix}{seed}", "fresh": False} for seed in args.seeds]
        K = max([int(m[1]) for r in runs for _, _, files in os.walk(os.path.join(ROOT, r["run"], "eval"))
                 for m in [re.search(r"policy_(\d+)_", f) for f in files] if m], default=0)
        read = lambda run: read_settings(run) if os.path.lexists(os.path.join(run, "settings.json")) else {}
        records = [{k: v for k, v in read(os.path.join(ROOT, r["run"])).items() if k not in ("stage", "SEED")}
                   for r in runs]
        if any(rec != records[0] for rec in records):
            die(f"the runs {', '.join(r['run'] for r in runs)} were made with different settings (their "
                "settings.json): one table is of one configuration")
        made = ("run_all.sh's settings as the runs recorded them: " + " ".join(
            f"{k}={shlex.quote(v)}" for k, v in records[0].items() if v) if records[0] else
            "run_all.sh's settings not recorded")
    peak_mib = max([r["peak_mib"] for r in runs if "peak_mib" in r], default=0)  # the largest stage process
    splits = os.environ.get("EVAL_SPLITS", "seen unseen").split()
    worlds = runner.eval_worlds(runs[0]["run"])
    algos = os.environ.get("ALGOS", "qevolve").split()
    if set(algos) - {a[0] for a in runner.ALGOS}:
        die(f"ALGOS must be words of: {' '.join(a[0] for a in runner.ALGOS)}, got {' '.join(algos)!r}")
    evaluated = {f for r in runs for _, _, files in os.walk(os.path.join(ROOT, r["run"], "eval")) for f in files}
    for s in splits:  # a split no run was evaluated on: a table of 'not run'
        if not any(f.endswith(f"_{s}.json") for f in evaluated):
            die(f"EVAL_SPLITS names {s!r}, on which no run of {args.prefix}* was evaluated; name the splits they were")

    found = {r["run"]: runner.evaluations(r["run"]) for r in runs}
    rate = lambda run, policy, split, world: found[run][policy, world, split]["success_rate"] * 100

    def habit(policy):  # household: the share of arrivals at a closed receptacle where it examines first;
        verbs, flaws = [], []  # kitchen: the share of decisions (flawed or good item used) that used the flawed one
        for r in runs:
            for w in worlds:
                for s in splits:
                    for line in open(os.path.join(ROOT, r["run"], "eval", f"world{w}", f"{policy}_{s}.jsonl")):
                        ep = json.loads(line)
                        verbs += [v for v, _ in closed_arrivals(ep)]
                        prev = [ep["obs0"]] + [st["obs"] for st in ep["steps"]]
                        flaws += [judge(ep["env"], o, st["action"]) for o, st in zip(prev, ep["steps"])]
        flaws = [f for f in flaws if f]
        return (f"{verbs.count('examine') / len(verbs):.2f}" if verbs else
                f"{1 - flaws.count('correct') / len(flaws):.2f}" if flaws else "-")

    mean = statistics.mean
    policies = [("policy_0", "BC (policy_0)")] + [
        (p, f"{runner.NAME[a]} iter {k} ({p})") for a in algos for k in range(1, K + 1)
        for p in [f"{'' if a == 'qevolve' else a + '_'}policy_{k}"]]
    slash = "/".join(splits)
    how = ("by earlier calls; this one ran nothing" if args.table_only
           else "in parallel, one torch thread each" if args.parallel else "one after another")
    lines = [runner.measured(runner.command("bench/seeds.py", RUN_ALL_SETTINGS))
             + f" (K={K}, {made}; seeds run {how}). "
             f"Greedy success in % on {slash}; every policy is evaluated in worlds {', '.join(worlds)} "
             "(world 0 is the one the run trained in).", "",
             "Per seed (the mean over the worlds), and mean +- std over every (seed, world) evaluation; the mistake "
             "rate over every seed, world and split of " + slash + ": in household the habit rate (`bench/mistakes.py`"
             ": the share of arrivals at a closed receptacle where the policy examines before it opens), in kitchen "
             "the flaw rate (the share of its decisions that used the item the observation called flawed):", "",
             "| policy | " + " | ".join(f"seed {r['seed']} {slash}" for r in runs)
             + " | " + " | ".join(f"{s} mean +- std" for s in splits) + " | mistake rate |",
             "|---|" + "---|" * (len(runs) + len(splits) + 1)]
    done = lambda policy: all((policy, w, s) in found[r["run"]] for r in runs for w in worlds for s in splits)
    for policy, name in policies:
        if not done(policy):
            lines.append(f"| {name} | " + " | ".join(["not run"] * (len(runs) + len(splits) + 1)) + " |")
            continue
        cells = [" / ".join(f"{mean(rate(r['run'], policy, s, w) for w in worlds):.1f}" for s in splits) for r in runs]
        every = [[rate(r["run"], policy, s, w) for r in runs for w in worlds] for s in splits]
        spread = [runner.pm(xs) for xs in every]
        lines.append(f"| {name} | " + " | ".join(cells + spread + [habit(policy)]) + " |")
    if K:  # K = 0: BC only, no gain to show
        lines += ["", f"Per world (the mean over the seeds), and Q-Evolve iter {K}'s gain over BC:", "",
                  f"| world | BC {slash} | Q-Evolve iter {K} {slash} | gain {slash} |", "|---|---|---|---|"]
    for w in (worlds + [None]) if K and done(f"policy_{K}") else []:  # None: every world (the means above)
        ws = worlds if w is None else [w]
        bc = [mean(rate(r["run"], "policy_0", s, v) for r in runs for v in ws) for s in splits]
        last = [mean(rate(r["run"], f"policy_{K}", s, v) for r in runs for v in ws) for s in splits]
        fmt = (lambda xs, sign="": " / ".join(f"{x:{sign}.1f}" for x in xs))
        name = "all" if w is None else f"{w}{' (trained in)' if w == '0' else ''}"
        lines.append(f"| {name} | {fmt(bc)} | {fmt(last)} | {fmt([b - a for a, b in zip(bc, last)], '+')} |")
    lines += ["", "| seed | wall time of this call | first to last artifact of the run |", "|---|---|---|"]
    for r in runs:
        note = "" if r["fresh"] else " (resumed: finished stages skipped)"
        wall = f"{r['wall_s'] / 60:.1f} min{note}" if "wall_s" in r else "- (ran nothing)"
        first = os.path.getmtime(os.path.join(ROOT, r["run"], "data", "expert.jsonl"))
        evals = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, r["run"], "eval")) for f in files
                 if f.endswith(".json")]  # the run's last artifact: its newest evaluation
        span = f"{(max(map(os.path.getmtime, evals)) - first) / 60:.1f} min" if evals else "not run"
        lines.append(f"| {r['seed']} | {wall} | {span} |")
    if any(r["fresh"] for r in runs):
        lines += ["", f"Peak memory of the largest single stage process: {peak_mib:.0f} MiB."]
    held = [(r["seed"], k, report_of(path)["heldout"]) for r in runs for k in range(1, K + 1)
            for path in [os.path.join(ROOT, r["run"], f"iter_{k}", "adv.jsonl")] if os.path.exists(path)]
    if any(h for *_, h in held):  # each Q-Evolve critic on the self episodes 03 held out (critic_report.py)
        f = lambda x, spec=".2f": "-" if x != x else format(x, spec)  # NaN: no such step, or no V*
        nan = float("nan")
        best = lambda h, key: f" ({f(h['bayes'][key])}: {f(h[key] / h['bayes'][key])})" if h.get("bayes") else ""
        lines += ["", "Each Q-Evolve critic on the self episodes it never trained on (critic_report.py, 04's held-out "
                  "printout): the explained variance of the return on r_env and the V gap after a mistake (V just "
                  "after a harmful step - after a correct one), each with (the exact Bayes critic's: the learned "
                  "critic's share of it) where the world has one, and V's correlation with the Bayes critic's V* and "
                  "its spread (std V / std V*; in brackets at s_0, before the first step); mean V against the mean "
                  "return, the AUC of V for success, the mean A_t at harmful / correct steps:", "",
                  "| seed | iteration | episodes | explained variance | V gap after a mistake | corr / spread with V* "
                  "| V / return | AUC | A at harmful / correct |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {seed} | {k} | {h['episodes']} | {f(h['explained_variance'])}{best(h, 'explained_variance')} | "
                  f"{f(h['v_gap'])}{best(h, 'v_gap')} | {f(h.get('corr_bayes', nan))} / "
                  f"{f(h.get('spread_bayes', nan))} ({f(h.get('spread_bayes_s0', nan))}) | "
                  f"{h['v_mean']:.2f} / {h['ret_mean']:.2f} | {f(h['auc_v'])} | "
                  f"{f(h['adv_harmful'], '+.3f')} / {f(h['adv_correct'], '+.3f')} |" for seed, k, h in held if h]
    labels = [(r["seed"], k, (read_json(os.path.join(ROOT, r["run"], f"iter_{k}", "self.json")) or {}).get("labels"),
               (read_json(os.path.join(ROOT, r["run"], f"iter_{k}", "adv.json")) or {}).get("adv_mean_by_label", {}))
              for r in runs for k in range(1, K + 1)]
    if any(lab for _, _, lab, _ in labels):  # 02's retrospective labels in each Q-Evolve iteration's self episodes
        lines += ["", "The retrospective labels of each Q-Evolve iteration's self episodes (pi_{k-1}'s, on train): the "
                  "share of steps per label, and the mean A_t 04 gave the steps of each label (over the whole buffer, "
                  "expert steps too):", "", "| seed | iteration | steps | ok | invalid | repeat | format "
                  "| A_t at ok / invalid / repeat |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {seed} | {k} | {sum(lab.values())} | " + " | ".join(
            f"{lab[x] / sum(lab.values()):.3f}" for x in ("ok", "invalid", "repeat", "format")) + " | " + " / ".join(
            f"{adv[x]:+.3f}" if x in adv else "-" for x in ("ok", "invalid", "repeat")) + " |"
            for seed, k, lab, adv in labels if lab]
    runner.write_table(args.out, lines)


if __name__ == "__main__":
    main()
