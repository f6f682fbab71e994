"""Plot greedy success per iteration from the runs of bench/seeds.py: one panel per split, a thin
line per seed (its mean over the worlds the run was evaluated in) and the mean over seeds in bold.
Needs matplotlib (requirements-plot.txt).

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
from plumbing import STAMP, check_out, die, write_atomic  # noqa: E402


def curve(run, split):
    """Success in % of policy_0, policy_1, ... on `split`, each the mean over the run's worlds."""
    worlds = eval_worlds(run)
    path = lambda w, k: os.path.join(ROOT, run, "eval", f"world{w}", f"policy_{k}_{split}.json")
    out, k = [], 0
    while all(os.path.exists(path(w, k)) for w in worlds):
        out.append(statistics.mean(json.load(open(path(w, k)))["success_rate"] for w in worlds) * 100)
        k += 1
    return out, len(worlds)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        curves = [curve(run, split) for run in runs]
        n = min(len(c) for c, _ in curves)
        if n == 0:
            die(f"no evaluation of policy_0 on {split!r} in every run")
        for i, (c, _) in enumerate(curves):
            ax.plot(range(n), c[:n], color="tab:blue", alpha=0.35, lw=1, marker="o", ms=3,
                    label=f"each seed ({', '.join(map(str, args.seeds))})" if i == 0 else None)
        mean = [statistics.mean(c[k] for c, _ in curves) for k in range(n)]
        ax.plot(range(n), mean, color="tab:blue", lw=2.5, marker="o", label="mean over seeds")
        for k, m in enumerate(mean):
            ax.annotate(f"{m:.1f}", (k, m), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
        ax.set_xticks(range(n), ["BC"] + [f"iter {k}" for k in range(1, n)])
        ax.set_title(f"{split} (mean over {curves[0][1]} worlds)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("greedy success (%)")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    write_atomic(args.out, lambda tmp: fig.savefig(tmp, dpi=110, format="png",
                                                   metadata={"Software": STAMP + "bench/plot_learning.py"}))
    print(f"plot_learning: wrote {args.out}")


if __name__ == "__main__":
    main()
