"""Plot greedy success per iteration from the runs of bench/seeds.py: one panel per split, one line per
algorithm of the runs (Q-Evolve, and the baselines the runs have: the outcome-level PG, iterated RFT), each
from the same BC policy, the mean over seeds with a band of +- one standard deviation over the seeds (each
seed's value: its mean over the worlds the run was evaluated in). Needs matplotlib (requirements-plot.txt).

    python bench/plot_learning.py                                   # runs/seed0..2 -> docs/img/learning_curve.png
    python bench/plot_learning.py --seeds 0 1 --prefix runs/s --out /tmp/curve.png --splits dev
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench._stages import eval_worlds  # noqa: E402
from plumbing import STAMP, Parser, check_out, die, write_atomic  # noqa: E402

ALGOS = {"": ("Q-Evolve", "tab:blue"), "outcome_": ("outcome-level PG", "tab:orange"),
         "rft_": ("iterated RFT", "tab:green")}  # run_all.sh's policy name prefix -> the line's name and colour


def curve(run, split, tag=""):
    """Success in % of policy_0 (BC), <tag>policy_1, <tag>policy_2, ... on `split`, each the mean over the run's
    worlds."""
    worlds = eval_worlds(run)
    path = lambda w, k: os.path.join(ROOT, run, "eval", f"world{w}", f"{tag if k else ''}policy_{k}_{split}.json")
    out, k = [], 0
    while all(os.path.exists(path(w, k)) for w in worlds):
        out.append(statistics.mean(json.load(open(path(w, k)))["success_rate"] for w in worlds) * 100)
        k += 1
    return out, len(worlds)


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (run directories --prefix<seed>)")
    p.add_argument("--prefix", default="runs/seed", help="run directory prefix, as bench/seeds.py writes them")
    p.add_argument("--splits", nargs="+", default=["seen", "unseen"], help="one panel each")
    p.add_argument("--out", default="docs/img/learning_curve.png", help="the PNG to write")
    args = p.parse_args()
    if not args.out.endswith(".png"):
        die(f"--out must end in .png, got {args.out!r}")
    check_out(args.out, "png")  # new, or a PNG this project wrote (its stamp): never a user's picture
    runs = [f"{args.prefix}{s}" for s in args.seeds]
    for run in runs:
        if not os.path.isdir(os.path.join(ROOT, run, "eval")):
            die(f"{run}/eval not found; run python bench/seeds.py first")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        die("matplotlib is not installed: pip install -r requirements-plot.txt")

    fig, axes = plt.subplots(1, len(args.splits), figsize=(4.2 * len(args.splits), 3.4), sharey=True, squeeze=False)
    for ax, split in zip(axes[0], args.splits):
        n_worlds, top = curve(runs[0], split)[1], 1
        for i, (tag, (name, colour)) in enumerate(ALGOS.items()):
            curves = [curve(run, split, tag)[0] for run in runs]
            n = min(len(c) for c in curves)
            if n < 2 and tag:  # this algorithm is not in the runs
                continue
            if n == 0:
                die(f"no evaluation of policy_0 on {split!r} in every run")
            mean = [statistics.mean(c[k] for c in curves) for k in range(n)]
            sd = [statistics.stdev([c[k] for c in curves]) if len(curves) > 1 else 0.0 for k in range(n)]
            ax.fill_between(range(n), [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                            color=colour, alpha=0.15, lw=0)
            ax.plot(range(n), mean, color=colour, lw=2, marker="o", label=name)
            ax.annotate(f"{mean[-1]:.1f}", (n - 1, mean[-1]), textcoords="offset points", xytext=(8, 8 - 9 * i),
                        fontsize=8, color=colour)  # one above the other where the lines end together
            top = max(top, n)
        ax.set_xticks(range(top), ["BC"] + [f"iter {k}" for k in range(1, top)])
        ax.set_title(f"{split} (mean over {n_worlds} worlds)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("greedy success (%)")
    fig.suptitle(f"seeds {', '.join(map(str, args.seeds))}: the mean, and a band of +- one std over the seeds",
                 fontsize=9)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    write_atomic(args.out, lambda tmp: fig.savefig(tmp, dpi=110, format="png",
                                                   metadata={"Software": STAMP + "bench/plot_learning.py"}))
    print(f"plot_learning: wrote {args.out}")


if __name__ == "__main__":
    main()
