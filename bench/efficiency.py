"""Success against the online environment steps spent, the paper's own axis (it reaches QLASS's success with about
1/30 of its online samples). For BC and each method of the runs (Q-Evolve, the outcome-level PG, iterated RFT): each
policy_k at the steps of its own self-collections so far (iteration 1's is policy_0's, shared; the expert's steps
are counted apart: every method has the same), greedy success on each split, the mean over seeds with a band of
+- one standard deviation (each seed's value: its mean over the worlds the run was evaluated in). Runs of several
N_SELF (a family each, one line style) give points at several budgets; nothing is tuned per point. The table beside
the picture gives the steps each method needs to reach 90% of the optimum's success (the good item always: it loses
only the outages) per seed, the first point at or above it, and their mean. Needs matplotlib.

    for S in 0 1 2 3 4; do RUN=runs/n50-s$S SEED=$S N_SELF=50 K=3 ALGOS="qevolve rft outcome" bash run_all.sh; done
    for S in 0 1 2 3 4; do RUN=runs/e$S SEED=$S ALGOS="qevolve rft outcome" bash run_all.sh; done
    python bench/efficiency.py --runs 'runs/n50-s{seed}' 'runs/e{seed}' --seeds 0 1 2 3 4
"""
import argparse
import datetime
import os
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import envs  # noqa: E402
from bench._stages import eval_worlds  # noqa: E402
from bench.plot_learning import ALGOS, curve  # noqa: E402
from plumbing import STAMP, Parser, check_out, die, parse_env_kwargs, read_json, save_text, write_atomic  # noqa: E402


def online_steps(run, tag, k):
    """The environment steps of the self-collections behind <tag>policy_k: iterations 1..k (02's env_steps)."""
    folder = {"": "", "outcome_": "outcome", "rft_": "rft"}[tag]
    paths = [os.path.join(ROOT, run, "iter_1" if j == 1 else os.path.join(folder, f"iter_{j}"), "self.json")
             for j in range(1, k + 1)]
    return sum((read_json(p) or die(f"{p}: missing; is {run} a run of run_all.sh?"))["env_steps"] for p in paths)


def optimum(run, split):
    """The good item always, in % on `split`: it wins every task without an outage (envs/kitchen.py)."""
    kwargs = parse_env_kwargs((read_json(os.path.join(ROOT, run, "settings.json")) or {}).get("ENV_KWARGS", "{}"))
    wins = [statistics.mean(env.generate(t)["outage_at"] is None for t in env.task_ids(split))
            for w in eval_worlds(run) for env in [envs.make("kitchen", seed=int(w), **kwargs)]]
    return 100 * statistics.mean(wins)


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="one run folder pattern per N_SELF, {seed} = the seed")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds")
    p.add_argument("--splits", nargs="+", default=["seen", "unseen"], help="one panel each")
    p.add_argument("--out", default="docs/img/efficiency.png", help="the PNG (its table: the same name, .md)")
    args = p.parse_args()
    if not args.out.endswith(".png") or any("{seed}" not in r for r in args.runs) or len(set(args.seeds)) < len(
            args.seeds) or len(set(args.runs)) < len(args.runs):
        die("--out must end in .png, each of --runs hold {seed}, and --runs and --seeds be distinct")
    for pattern in args.runs:  # {seed} is the one field: another ({split}) was a KeyError after the checks
        try:
            pattern.format(seed=0)
        except (KeyError, IndexError, ValueError):
            die(f"--runs {pattern}: {{seed}} is the one field a pattern may hold")
    table = args.out[:-4] + ".md"
    for path, kind in ((args.out, "png"), (table, "table")):
        check_out(path, kind)
    for pattern in args.runs:
        for s in args.seeds:
            if not os.path.isdir(os.path.join(ROOT, pattern.format(seed=s), "eval")):
                die(f"{pattern.format(seed=s)}/eval not found: make the runs first (--help)")
            run = pattern.format(seed=s)
            for split in args.splits:  # BC's evaluation on each split: else an IndexError after the checks
                if not any(os.path.exists(os.path.join(ROOT, run, "eval", f"world{w}", f"policy_0_{split}.json"))
                           for w in eval_worlds(run)):
                    die(f"--splits {split}: {run} was not evaluated on it; name the splits its runs were (EVAL_SPLITS)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        die("matplotlib is not installed: pip install -r requirements-plot.txt")
    methods = [("bc", "BC", "tab:gray")] + [(tag, name, colour) for tag, (name, colour) in ALGOS.items()]
    # points[split][(method, family)] = [(steps per seed, success per seed) for k = 0..K]
    points = {split: {} for split in args.splits}
    for split in args.splits:
        for tag, name, _ in methods:
            for pattern in args.runs:
                runs = [pattern.format(seed=s) for s in args.seeds]
                curves = [curve(r, split, "" if tag == "bc" else tag)[0] for r in runs]
                top = 0 if tag == "bc" else min(len(c) for c in curves) - 1
                points[split][name, pattern] = [
                    ([0 if k == 0 else online_steps(r, tag, k) for r in runs], [c[k] for c in curves])
                    for k in range(top + 1)]
    best = {split: statistics.mean(optimum(pattern.format(seed=s), split) for s in args.seeds) for split in
            args.splits}
    fig, axes = plt.subplots(1, len(args.splits), figsize=(4.8 * len(args.splits), 3.6), sharey=True, squeeze=False)
    styles = ["-", "--", ":", "-."]
    n_self = {pattern: (read_json(os.path.join(ROOT, pattern.format(seed=args.seeds[0]), "settings.json")) or {}).get(
        "N_SELF", "?") for pattern in args.runs}  # each family's episodes per iteration
    for ax, split in zip(axes[0], args.splits):
        for tag, name, colour in methods:
            for i, pattern in enumerate(args.runs):
                row = points[split][name, pattern]
                x = [statistics.mean(steps) for steps, _ in row]
                y = [statistics.mean(ok) for _, ok in row]
                sd = [statistics.stdev(ok) if len(ok) > 1 else 0.0 for _, ok in row]
                ax.plot(x, y, styles[i % 4], color=colour, marker="o", ms=3,
                        label=f"{name}, {n_self[pattern]} episodes an iteration" if tag != "bc" else (
                            name if i == 0 else None))
                ax.fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], color=colour,
                                alpha=0.12)
        ax.axhline(best[split], color="black", lw=0.8, ls=":")
        ax.axhline(0.9 * best[split], color="black", lw=0.6, ls="--")
        ax.set_xscale("symlog", linthresh=100)
        ax.set_xlim(left=0)
        ax.set(title=split, xlabel="online environment steps (own episodes)", ylim=(0, 100))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"greedy success (%), seeds {', '.join(map(str, args.seeds))}")
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    write_atomic(args.out, lambda tmp: fig.savefig(tmp, dpi=110, format="png",
                                                   metadata={"Software": STAMP + "bench/efficiency.py"}))
    plt.close(fig)

    command = " ".join(["python", "bench/efficiency.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    lines = [f"Measured {datetime.date.today()} by `{command}` from the runs it names (made by run_all.sh, on the "
             f"machine their notes name). Greedy success in %, mean +- std over seeds "
             f"{', '.join(map(str, args.seeds))}, each seed's value its mean over the worlds it was evaluated in; "
             "steps: the online environment steps of the method's own self-collections (iteration 1's, policy_0's, "
             "shared), mean over the seeds.", "",
             f"The optimum (the good item always): {' / '.join(f'{best[s]:.1f}' for s in args.splits)} on "
             f"{'/'.join(args.splits)}.", "", "| method | runs | k | online steps | " + " | ".join(args.splits) + " |",
             "|---|---|---|---|" + "---|" * len(args.splits)]
    for tag, name, _ in methods:
        for pattern in args.runs[:1] if tag == "bc" else args.runs:
            for k, (steps, _) in list(enumerate(points[args.splits[0]][name, pattern]))[tag != "bc":]:  # k = 0: BC
                cells = [f"{statistics.mean(ok):.1f} +- {statistics.stdev(ok) if len(ok) > 1 else 0:.1f}"
                         for split in args.splits for ok in [points[split][name, pattern][k][1]]]
                lines.append(f"| {name} | {pattern} | {k} | {statistics.mean(steps):.0f} | " + " | ".join(cells) + " |")
    lines += ["", "The online steps to reach 90% of the optimum: per seed, the fewest steps of a point at or above it "
              "(any of the runs; '>N': not reached, N the most steps of that seed's points); the mean over the seeds "
              "that reached it, and how many did.", "",
              "| method | split | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean (seeds reached) |",
              "|---|---|" + "---|" * len(args.seeds) + "---|"]
    for tag, name, _ in methods[1:]:
        for split in args.splits:
            cells, reached = [], []
            for i in range(len(args.seeds)):
                pts = [(steps[i], ok[i]) for pattern in args.runs for steps, ok in points[split][name, pattern]]
                hit = [x for x, ok in pts if ok >= 0.9 * best[split]]
                cells.append(f"{min(hit)}" if hit else f">{max(x for x, _ in pts)}")
                reached += [min(hit)] if hit else []
            mean = f"{statistics.mean(reached):.0f} ({len(reached)})" if reached else "- (0)"
            lines.append(f"| {name} | {split} | " + " | ".join(cells) + f" | {mean} |")
    first = methods[1][1]  # Q-Evolve, against each baseline at the same budget, paired by seed
    lines += ["", f"{first} minus each method at the same budget (runs, k), paired by seed: the mean gap in points "
              "+- its standard error over seeds (std / sqrt(seeds)); '*': beyond two standard errors.", "",
              "| method | runs | k | " + " | ".join(args.splits) + " |", "|---|---|---|" + "---|" * len(args.splits)]
    for _, name, _ in methods[2:]:
        for pattern in args.runs:
            for k in range(1, len(points[args.splits[0]][name, pattern])):
                cells = []
                for split in args.splits:
                    ours, theirs = points[split][first, pattern][k][1], points[split][name, pattern][k][1]
                    gap = [a - b for a, b in zip(ours, theirs)]
                    se = statistics.stdev(gap) / len(gap) ** 0.5 if len(gap) > 1 else float("nan")
                    star = " *" if abs(statistics.mean(gap)) > 2 * se else ""
                    cells.append(f"{statistics.mean(gap):+.1f} +- {se:.1f}{star}")
                lines.append(f"| {name} | {pattern} | {k} | " + " | ".join(cells) + " |")
    save_text(table, "\n".join(lines) + "\n")
    print("\n".join(lines) + f"\nefficiency: wrote {args.out} and {table}")


if __name__ == "__main__":
    main()
