"""The sweep a teacher shows as one plot: greedy success of BC, Q-Evolve, the outcome-level PG and iterated
RFT against the number of decisions per kitchen task - from one (the outcome of an episode names its one
decision, so outcome credit should be enough) to several (a failure's cause is one step among many: step
credit has a job). Each point is the mean over seeds of run_all.sh's runs at that number of decisions, with
+- one standard deviation over the seeds as its bar (each seed's value: its mean over the worlds it was
evaluated in). Reads the runs of bench/seeds.py, one prefix per number of decisions; writes the PNG and a
table beside it. Needs matplotlib (requirements-plot.txt).

    for D in 1 2 6; do K=1 ENV_KWARGS="{\"decisions\": $D}" ALGOS="qevolve rft outcome" \
        python bench/seeds.py --parallel --prefix runs/sweep-d$D-s --out /tmp/sweep_d$D.md; done
    python bench/plot_sweep.py --decisions 1 2 4 6 --prefix 'runs/sweep-d{D}-s' --prefix4 runs/k
"""
import argparse
import datetime
import os
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.plot_learning import ALGOS, curve  # noqa: E402
from plumbing import STAMP, Parser, check_out, die, save_text, write_atomic  # noqa: E402


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decisions", type=int, nargs="+", default=[1, 2, 4, 6], help="kitchen's decisions, one point each")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (run directories PREFIX<seed>)")
    p.add_argument("--prefix", default="runs/sweep-d{D}-s", help="run directory prefix, {D} = the decisions")
    p.add_argument("--prefix4", default="", help="the prefix for 4 decisions (kitchen's default: the main runs)")
    p.add_argument("--iteration", type=int, default=1, help="the iteration k of each method plotted")
    p.add_argument("--splits", nargs="+", default=["seen", "unseen"], help="one panel each")
    p.add_argument("--out", default="docs/img/sweep.png", help="the PNG (and its table: the same name, .md)")
    args = p.parse_args()
    for flag, xs, least in (("--seeds", args.seeds, 0), ("--decisions", args.decisions, 1)):
        if min(xs) < least or len(set(xs)) < len(xs):
            die(f"{flag} must be distinct integers of at least {least}, got {' '.join(map(str, xs))}")
    if "{D}" not in args.prefix:
        die(f"--prefix must name the decisions as {{D}} (one run folder per number of decisions), got {args.prefix!r}")
    if not args.out.endswith(".png") or args.iteration < 1:
        die(f"--out must end in .png and --iteration be at least 1, got {args.out!r} and {args.iteration}")
    table = args.out[:-4] + ".md"
    check_out(args.out, "png")  # new, or a PNG this project wrote (its stamp): never a user's picture
    check_out(table, "table")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        die("matplotlib is not installed: pip install -r requirements-plot.txt")
    prefix = lambda d: args.prefix4 if d == 4 and args.prefix4 else args.prefix.replace("{D}", str(d))
    for d in args.decisions:
        for s in args.seeds:
            if not os.path.isdir(os.path.join(ROOT, f"{prefix(d)}{s}", "eval")):
                die(f"{prefix(d)}{s}/eval not found; run bench/seeds.py for {d} decisions first (--help)")
    # points[split][name] = [(mean, std) per number of decisions]
    methods = [("", "BC", 0)] + [(tag, name, args.iteration) for tag, (name, _) in ALGOS.items()]
    points = {split: {} for split in args.splits}
    for split in args.splits:
        for tag, name, k in methods:
            row = []
            for d in args.decisions:
                xs = [curve(f"{prefix(d)}{s}", split, tag)[0] for s in args.seeds]
                if any(len(x) <= k for x in xs):
                    die(f"{name} iteration {k} is not evaluated on {split!r} in every run of {prefix(d)}*")
                vals = [x[k] for x in xs]
                row.append((statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0))
            points[split][name] = row
    fig, axes = plt.subplots(1, len(args.splits), figsize=(4.4 * len(args.splits), 3.4), sharey=True, squeeze=False)
    colours = {"BC": "tab:gray", **{name: c for name, c in ALGOS.values()}}
    for ax, split in zip(axes[0], args.splits):
        for i, (name, row) in enumerate(points[split].items()):
            shift = (i - 1.5) * 0.06  # side by side, so the bars do not hide each other
            ax.errorbar([d + shift for d in args.decisions], [m for m, _ in row], yerr=[s for _, s in row],
                        color=colours[name], marker="o", capsize=3, lw=1.8,
                        label=name if name == "BC" else f"{name} iter {args.iteration}")
        ax.set_xticks(args.decisions)
        ax.set(title=split, xlabel="decisions per task (kitchen)", ylim=(0, 100))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"greedy success (%), seeds {', '.join(map(str, args.seeds))}")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    write_atomic(args.out, lambda tmp: fig.savefig(tmp, dpi=110, format="png",
                                                   metadata={"Software": STAMP + "bench/plot_sweep.py"}))
    plt.close(fig)
    command = " ".join(["python", "bench/plot_sweep.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    lines = [f"Measured {datetime.date.today()} by `{command}` from the runs it names (each made by bench/seeds.py, "
             "on the machine its table names). "
             f"Greedy success in %, mean +- std over seeds {', '.join(map(str, args.seeds))}; each seed's value is "
             "its mean over the worlds it was evaluated in.", "",
             "| method | " + " | ".join(f"{d} decision{'s' * (d > 1)} {'/'.join(args.splits)}"
                                     for d in args.decisions) + " |",
             "|---|" + "---|" * len(args.decisions)]
    for _, name, _ in methods:
        cells = [" / ".join(f"{points[s][name][j][0]:.1f} +- {points[s][name][j][1]:.1f}" for s in args.splits)
                 for j in range(len(args.decisions))]
        lines.append(f"| {name if name == 'BC' else f'{name} iter {args.iteration}'} | " + " | ".join(cells) + " |")
    save_text(table, "\n".join(lines) + "\n")
    print("\n".join(lines) + f"\nplot_sweep: wrote {args.out} and {table}")


if __name__ == "__main__":
    main()
