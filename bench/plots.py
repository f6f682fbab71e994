"""The pictures of the runs (matplotlib: requirements-plot.txt): greedy success in %, the mean over seeds +- one std
(each seed's value: its mean over its run's worlds), one line per method of runner.METHODS the runs have. learning:
per iteration (bench/seeds.py's runs), one panel per split. sweep: at --iteration against kitchen's decisions per
task (one run prefix per number of decisions; a table beside the PNG). efficiency: against the online environment
steps of each method's own self-collections, runs of several N_SELF; a table beside the PNG with the steps to 90% of
the optimum (the good item always) and Q-Evolve's paired gap to each method.

    python bench/plots.py learning                          # runs/seed0..2 -> docs/img/learning_curve.png
    python bench/plots.py learning --seeds 0 1 --prefix runs/s --out /tmp/curve.png --splits dev
    for D in 1 2 6; do K=1 ENV_KWARGS="{\"decisions\": $D}" ALGOS="qevolve rft outcome" \
        python bench/seeds.py --parallel --prefix runs/sweep-d$D-s --out /tmp/sweep_d$D.md; done
    python bench/plots.py sweep --decisions 1 2 4 6 --prefix 'runs/sweep-d{D}-s' --prefix4 runs/k
    for S in 0 1 2 3 4; do RUN=runs/n50-s$S SEED=$S N_SELF=50 K=3 ALGOS="qevolve rft outcome" bash run_all.sh; done
    for S in 0 1 2 3 4; do RUN=runs/e$S SEED=$S ALGOS="qevolve rft outcome" bash run_all.sh; done
    python bench/plots.py efficiency --runs 'runs/n50-s{seed}' 'runs/e{seed}' --seeds 0 1 2 3 4
paper: the paper's table in miniature (BC, ETO, QLASS, Q-Evolve and the project's baselines) and success against each
method's online environment steps: a table a run pattern (a budget), one panel a regime (the runs' DEMOS), its
budgets' points on one curve a method; 95% intervals over seeds (t):

    for S in 0 1 2 3 4; do RUN=runs/paper$S SEED=$S ALGOS="qevolve eto qlass rft outcome" bash run_all.sh; done
    for S in 0 1 2 3 4; do RUN=runs/n50_$S SEED=$S N_SELF=50 ALGOS="qevolve eto rft outcome" bash run_all.sh; done
    python bench/plots.py paper --runs 'runs/paper{seed}' 'runs/n50_{seed}' --seeds 0 1 2 3 4
"""
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import envs  # noqa: E402, I001
from bench.runner import (ALGOS, METHODS, command, curve, distinct, eval_worlds, measured, parser, pm, pyplot,  # noqa
                          save_png, sd, shipped_by)
from plumbing import check_out, die, parse_env_kwargs, read_json, save_text  # noqa: E402
from run_support import tracked  # noqa: E402

WRITER = "bench/plots.py"
mean = statistics.mean
se = (lambda xs: statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan"))  # standard error of the mean


def online_steps(run, method, k):
    """The environment steps of the self-collections behind the method's policy_k: iterations 1..k (02's env_steps;
    iteration 1's is policy_0's, shared)."""
    folder = next(m[2] for m in METHODS if m[0] == method)
    paths = [os.path.join(ROOT, run, "iter_1" if j == 1 else os.path.join(folder, f"iter_{j}"), "self.json")
             for j in range(1, k + 1)]
    return sum((read_json(p) or die(f"{p}: missing; is {run} a run of run_all.sh?"))["env_steps"] for p in paths)


def optimum(run, split):
    """The good item always, in % on `split`: it wins every task without an outage (envs/kitchen.py)."""
    kwargs = parse_env_kwargs((read_json(os.path.join(ROOT, run, "settings.json")) or {}).get("ENV_KWARGS", "{}"))
    wins = [mean(env.generate(t)["outage_at"] is None for t in env.task_ids(split))
            for w in eval_worlds(run) for env in [envs.make("kitchen", seed=int(w), **kwargs)]]
    return 100 * mean(wins)


def panels(splits, width, height=3.4):
    """matplotlib is imported here, after every check of the flags and runs."""
    fig, axes = pyplot().subplots(1, len(splits), figsize=(width * len(splits), height), sharey=True, squeeze=False)
    return fig, axes[0]


def finish(fig, axes, out, legend, label="greedy success (%)", fontsize=7):
    """The common ending: the y label, the legend, and the PNG stamped with this script."""
    axes[0].set_ylabel(label)
    axes[0].legend(fontsize=fontsize, loc=legend)
    fig.tight_layout()
    save_png(fig, out, WRITER)


def learning(args):
    runs = [f"{args.prefix}{s}" for s in args.seeds]
    for run in runs:
        if not os.path.isdir(os.path.join(ROOT, run, "eval")):
            die(f"{run}/eval not found; run python bench/seeds.py first")
    fig, axes = panels(args.splits, 4.2)
    for ax, split in zip(axes, args.splits):
        n_worlds, top = curve(runs[0], split)[1], 1
        for i, (_, tag, _, name, colour) in enumerate(ALGOS):
            curves = [curve(run, split, tag)[0] for run in runs]
            n = min(len(c) for c in curves)
            if n < 2 and tag:  # this algorithm is not in the runs
                continue
            if n == 0:
                die(f"no evaluation of policy_0 on {split!r} in every run")
            m = [mean(c[k] for c in curves) for k in range(n)]
            d = [sd([c[k] for c in curves]) for k in range(n)]
            ax.fill_between(range(n), [a - b for a, b in zip(m, d)], [a + b for a, b in zip(m, d)], color=colour,
                            alpha=0.15, lw=0)
            ax.plot(range(n), m, color=colour, lw=2, marker="o", label=name)
            ax.annotate(f"{m[-1]:.1f}", (n - 1, m[-1]), textcoords="offset points", xytext=(8, 8 - 9 * i),
                        fontsize=8, color=colour)  # one above the other where the lines end together
            top = max(top, n)
        ax.set_xticks(range(top), ["BC"] + [f"iter {k}" for k in range(1, top)])
        ax.set(title=f"{split} (mean over {n_worlds} worlds)", ylim=(0, 100))
        ax.grid(alpha=0.3)
    fig.suptitle(f"seeds {', '.join(map(str, args.seeds))}: the mean, and a band of +- one std over the seeds",
                 fontsize=9)
    finish(fig, axes, args.out, "lower right")
    print(f"plot_learning: wrote {args.out}")


def sweep(args, table):
    distinct("--decisions", args.decisions, 1)
    if "{D}" not in args.prefix:
        die(f"--prefix must name the decisions as {{D}} (one run folder per number of decisions), got {args.prefix!r}")
    if args.iteration < 1:
        die(f"--iteration must be at least 1, got {args.iteration}")
    prefix = lambda d: args.prefix4 if d == 4 and args.prefix4 else args.prefix.replace("{D}", str(d))
    for d in args.decisions:
        for s in args.seeds:
            if not os.path.isdir(os.path.join(ROOT, f"{prefix(d)}{s}", "eval")):
                die(f"{prefix(d)}{s}/eval not found; run bench/seeds.py for {d} decisions first (--help)")
    methods = [("", "BC", 0, "tab:gray")] + [(tag, name, args.iteration, c) for _, tag, _, name, c in ALGOS]
    points = {split: {} for split in args.splits}  # points[split][name] = [(mean, std) per number of decisions]
    for split in args.splits:
        for tag, name, k, _ in methods:
            for d in args.decisions:
                xs = [curve(f"{prefix(d)}{s}", split, tag)[0] for s in args.seeds]
                if any(len(x) <= k for x in xs):
                    die(f"{name} iteration {k} is not evaluated on {split!r} in every run of {prefix(d)}*")
                points[split].setdefault(name, []).append((mean(x[k] for x in xs), sd([x[k] for x in xs])))
    fig, axes = panels(args.splits, 4.4)
    for ax, split in zip(axes, args.splits):
        for i, (_, name, _, colour) in enumerate(methods):
            row, shift = points[split][name], (i - 1.5) * 0.06  # side by side, so the bars do not hide each other
            ax.errorbar([d + shift for d in args.decisions], [m for m, _ in row], yerr=[s for _, s in row],
                        color=colour, marker="o", capsize=3, lw=1.8,
                        label=name if name == "BC" else f"{name} iter {args.iteration}")
        ax.set_xticks(args.decisions)
        ax.set(title=split, xlabel="decisions per task (kitchen)", ylim=(0, 100))
        ax.grid(alpha=0.3)
    finish(fig, axes, args.out, "lower left", f"greedy success (%), seeds {', '.join(map(str, args.seeds))}")
    lines = [measured(command(WRITER), machine=False) + " from the runs it names (each made by bench/seeds.py, on the "
             f"machine its table names). Greedy success in %, mean +- std over seeds {', '.join(map(str, args.seeds))}"
             "; each seed's value is its mean over the worlds it was evaluated in.", "",
             "| method | " + " | ".join(f"{d} decision{'s' * (d > 1)} {'/'.join(args.splits)}"
                                     for d in args.decisions) + " |", "|---|" + "---|" * len(args.decisions)]
    for _, name, _, _ in methods:
        cells = [" / ".join(f"{points[s][name][j][0]:.1f} +- {points[s][name][j][1]:.1f}" for s in args.splits)
                 for j in range(len(args.decisions))]
        lines.append(f"| {name if name == 'BC' else f'{name} iter {args.iteration}'} | " + " | ".join(cells) + " |")
    return lines


def efficiency(args, table):
    if any("{seed}" not in r for r in args.runs) or len(set(args.runs)) < len(args.runs):
        die("each of --runs must hold {seed}, and --runs and --seeds be distinct")
    for pattern in args.runs:  # {seed} is the one field: another ({split}) was a KeyError after the checks
        try:
            pattern.format(seed=0)
        except (KeyError, IndexError, ValueError):
            die(f"--runs {pattern}: {{seed}} is the one field a pattern may hold")
    for run in [pattern.format(seed=s) for pattern in args.runs for s in args.seeds]:
        if not os.path.isdir(os.path.join(ROOT, run, "eval")):
            die(f"{run}/eval not found: make the runs first (--help)")
        for split in args.splits:  # BC's evaluation on each split: else an IndexError after the checks
            if not any(os.path.exists(os.path.join(ROOT, run, "eval", f"world{w}", f"policy_0_{split}.json"))
                       for w in eval_worlds(run)):
                die(f"--splits {split}: {run} was not evaluated on it; name the splits its runs were (EVAL_SPLITS)")
    points = {split: {} for split in args.splits}  # [split][(name, family)] = [(steps per seed, success per seed)]
    for split in args.splits:
        for key, tag, _, name, _ in METHODS:
            for pattern in args.runs:
                runs = [pattern.format(seed=s) for s in args.seeds]
                curves = [curve(r, split, tag)[0] for r in runs]
                top = 0 if key == "bc" else min(len(c) for c in curves) - 1
                points[split][name, pattern] = [([0 if k == 0 else online_steps(r, key, k) for r in runs],
                                                 [c[k] for c in curves]) for k in range(top + 1)]
    best = {split: mean(optimum(pattern.format(seed=s), split) for s in args.seeds) for split in args.splits}
    fig, axes = panels(args.splits, 4.8, 3.6)
    n_self = {pattern: (read_json(os.path.join(ROOT, pattern.format(seed=args.seeds[0]), "settings.json")) or {}).get(
        "N_SELF", "?") for pattern in args.runs}  # each family's episodes per iteration
    for ax, split in zip(axes, args.splits):
        for key, _, _, name, colour in METHODS:
            for i, pattern in enumerate(args.runs):
                row = points[split][name, pattern]
                x, y, d = ([mean(s) for s, _ in row], [mean(ok) for _, ok in row], [sd(ok) for _, ok in row])
                ax.plot(x, y, ["-", "--", ":", "-."][i % 4], color=colour, marker="o", ms=3,
                        label=f"{name}, {n_self[pattern]} episodes an iteration" if key != "bc" else (
                            name if i == 0 else None))
                ax.fill_between(x, [a - b for a, b in zip(y, d)], [a + b for a, b in zip(y, d)], color=colour,
                                alpha=0.12)
        ax.axhline(best[split], color="black", lw=0.8, ls=":")
        ax.axhline(0.9 * best[split], color="black", lw=0.6, ls="--")
        ax.set_xscale("symlog", linthresh=100)
        ax.set_xlim(left=0)
        ax.set(title=split, xlabel="online environment steps (own episodes)", ylim=(0, 100))
        ax.grid(alpha=0.3)
    finish(fig, axes, args.out, "lower right", f"greedy success (%), seeds {', '.join(map(str, args.seeds))}", 6)
    lines = [measured(command(WRITER), machine=False) + " from the runs it names (made by run_all.sh, on the machine "
             f"their notes name). Greedy success in %, mean +- std over seeds {', '.join(map(str, args.seeds))}, each "
             "seed's value its mean over the worlds it was evaluated in; steps: the online environment steps of the "
             "method's own self-collections (iteration 1's, policy_0's, shared), mean over the seeds.", "",
             f"The optimum (the good item always): {' / '.join(f'{best[s]:.1f}' for s in args.splits)} on "
             f"{'/'.join(args.splits)}.", "", "| method | runs | k | online steps | " + " | ".join(args.splits) + " |",
             "|---|---|---|---|" + "---|" * len(args.splits)]
    for key, _, _, name, _ in METHODS:
        for pattern in args.runs[:1] if key == "bc" else args.runs:
            for k, (steps, _) in list(enumerate(points[args.splits[0]][name, pattern]))[key != "bc":]:  # k = 0: BC
                cells = [pm(ok) for split in args.splits
                         for ok in [points[split][name, pattern][k][1]]]
                lines.append(f"| {name} | {pattern} | {k} | {mean(steps):.0f} | " + " | ".join(cells) + " |")
    lines += ["", "The online steps to reach 90% of the optimum: per seed, the fewest steps of a point at or above it "
              "(any of the runs; '>N': not reached, N the most steps of that seed's points); the mean over the seeds "
              "that reached it, and how many did.", "",
              "| method | split | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean (seeds reached) |",
              "|---|---|" + "---|" * len(args.seeds) + "---|"]
    first, need = ALGOS[0][3], {}  # need[name, split]: each seed's steps to 90% of the optimum, None: not reached
    for _, _, _, name, _ in ALGOS:
        for split in args.splits:
            cells, need[name, split] = [], []
            for i in range(len(args.seeds)):
                pts = [(steps[i], ok[i]) for pattern in args.runs for steps, ok in points[split][name, pattern]]
                hit = [x for x, ok in pts if ok >= 0.9 * best[split]]
                cells.append(f"{min(hit)}" if hit else f">{max(x for x, _ in pts)}")
                need[name, split].append(min(hit) if hit else None)
            reached = [x for x in need[name, split] if x is not None]
            lines.append(f"| {name} | {split} | " + " | ".join(cells) + " | "
                         + (f"{mean(reached):.0f} ({len(reached)})" if reached else "- (0)") + " |")
    for _, _, _, name, _ in ALGOS[1:]:  # the paper's claim as a ratio: Q-Evolve's steps over the baseline's, by seed
        for split in args.splits:
            ratio = [a / b if a and b else None for a, b in zip(need[first, split], need[name, split])]
            both = [r for r in ratio if r is not None]
            if not both:  # (iterated RFT: never reached)
                continue
            cells = ["-" if r is None else f"{r:.2f}" for r in ratio]
            star = " *" if abs(mean(both) - 1) > 2 * se(both) else ""
            lines.append(f"| {first} / {name} | {split} | " + " | ".join(cells)
                         + f" | {mean(both):.2f} +- {se(both):.2f}{star} ({len(both)}) |")
    lines += ["", f"The last rows: {first}'s steps over a baseline's, per seed where both reached 90% (the paper's "
              "claim as a ratio); the mean +- its standard error over those seeds; '*': 1 beyond two standard errors."]
    lines += ["", f"{first} minus each method at the same budget (runs, k), paired by seed: the mean gap in points "
              "+- its standard error over seeds (std / sqrt(seeds)); '*': beyond two standard errors.", "",
              "| method | runs | k | " + " | ".join(args.splits) + " |", "|---|---|---|" + "---|" * len(args.splits)]
    for _, _, _, name, _ in ALGOS[1:]:
        for pattern in args.runs:
            for k in range(1, len(points[args.splits[0]][name, pattern])):
                cells = []
                for split in args.splits:
                    row = points[split]
                    gap = [a - b for a, b in zip(row[first, pattern][k][1], row[name, pattern][k][1])]
                    cells.append(f"{mean(gap):+.1f} +- {se(gap):.1f}{' *' if abs(mean(gap)) > 2 * se(gap) else ''}")
                lines.append(f"| {name} | {pattern} | {k} | " + " | ".join(cells) + " |")
    return lines


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t, 97.5%, by df
PAPER = [("bc", "", "BC"), ("eto", "eto_", "ETO"), ("qlass", "qlass_", "QLASS"), ("qevolve", "", "Q-Evolve"),
         ("rft", "rft_", "iterated RFT"), ("outcome", "outcome_", "outcome-level PG")]  # the paper's table's order
COLOUR = {"bc": "tab:gray", "eto": "tab:purple", "qlass": "tab:red", "qevolve": "tab:blue", "rft": "tab:green",
          "outcome": "tab:orange"}


def ci(xs):
    """mean and the half-width of its 95% interval over the seeds (t with n - 1 degrees of freedom; nan for one)."""
    return mean(xs), T975.get(len(xs) - 1, 1.96) * se(xs) if len(xs) > 1 else float("nan")


def paired(xs, ys):
    """xs minus ys, paired by seed: the mean gap [its 95% interval], 'shown' where the interval excludes 0."""
    m, h = ci([a - b for a, b in zip(xs, ys)])
    return f"{m:+.1f} [{m - h:+.1f}, {m + h:+.1f}]{' shown' if abs(m) > h else ''}"


def own_steps(run, key, k):
    """A policy's online environment steps to date, from what it wrote: QLASS's trees, else its own episodes (02's
    env_steps) of iterations 1..k (iteration 1's, policy_0's, shared; BC: none)."""
    if key == "qlass":
        paths = [os.path.join(ROOT, run, "qlass", "trees.json")]
    else:
        paths = [os.path.join(ROOT, run, f"iter_{j}" if j == 1 or key == "qevolve" else os.path.join(key, f"iter_{j}"),
                              "self.json") for j in range(1, k + 1)]
    return sum((read_json(p) or die(f"{p}: missing; is {run} a run of run_all.sh?"))["env_steps"] for p in paths)


def mistakes(run, tag, k, split):
    """Of the evaluation's uses of an offered item, the share that took the flawed one: of ingredients (harmful, for
    good) and of tools (recoverable: put back, a step lost), in %, over the run's worlds."""
    from envs.kitchen import INGREDIENTS, judge
    n = {"harmful": 0, "recoverable": 0, "ingredient": 0, "tool": 0}  # flawed uses; all uses
    for w in eval_worlds(run):
        path = os.path.join(ROOT, run, "eval", f"world{w}", f"{tag if k else ''}policy_{k}_{split}.jsonl")
        for ep in map(json.loads, open(path)):
            prev = ep["obs0"]
            for s in ep["steps"]:
                verdict = judge(prev, s["action"])
                if verdict:
                    n["ingredient" if s["action"].split()[1] in INGREDIENTS else "tool"] += 1
                    n[verdict] = n.get(verdict, 0) + 1
                prev = s["obs"]
    return 100 * n["harmful"] / max(n["ingredient"], 1), 100 * n["recoverable"] / max(n["tool"], 1)


def paper(args, table):
    seeds = args.seeds
    for run in [p.format(seed=s) for p in args.runs for s in seeds]:
        if not os.path.isdir(os.path.join(ROOT, run, "eval")):
            die(f"{run}/eval not found: make the runs first (--help)")
    # per regime (run pattern) and method: [(iteration, [steps per seed], {split: [success per seed]})]
    found = {}
    for pattern in args.runs:
        runs = [pattern.format(seed=s) for s in seeds]
        for key, tag, _ in PAPER:
            curves = {sp: [curve(r, sp, tag)[0] for r in runs] for sp in args.splits}
            top = min(len(c) for cs in curves.values() for c in cs) - 1  # the iterations every run has
            found[pattern, key] = [(i, [own_steps(r, key, i) if i else 0 for r in runs],
                                    {sp: [c[i] for c in curves[sp]] for sp in args.splits})
                                   for i in ([0] if key == "bc" else range(1, top + 1))]
    best = {sp: mean(optimum(args.runs[0].format(seed=s), sp) for s in seeds) for sp in args.splits}
    lines = [measured(command(WRITER), machine=False) + " from the runs it names (made by run_all.sh, on the machine "
             f"their notes name). Greedy success in % (QLASS: its Q-guided sampling), each seed's value its mean over "
             f"the worlds it was evaluated in; mean [95% interval over seeds {', '.join(map(str, seeds))}: t with "
             f"{len(seeds) - 1} degrees of freedom]; online env steps: each policy's own environment steps to date "
             "(its episodes; QLASS's trees), the demonstrations' apart, mean over the seeds.", "",
             f"The optimum (the good item always): {' / '.join(f'{best[sp]:.1f}' for sp in args.splits)} on "
             f"{' / '.join(args.splits)}.", ""]
    fmt = lambda xs: "{:.1f} [{:.1f}, {:.1f}]".format(*(lambda m, h: (m, m - h, m + h))(*ci(xs)))
    made = {p: read_json(os.path.join(ROOT, p.format(seed=seeds[0]), "settings.json")) or {} for p in args.runs}
    for pattern in args.runs:  # each heading names the settings its runs changed from the first runs'
        changed = ", ".join(f"{k}={v}" for k, v in made[pattern].items() if made[args.runs[0]].get(k) != v)
        lines += [f"### {pattern}" + (f" ({changed})" if changed else ""), "",
                  "| method | iteration | online env steps | " + " | ".join(args.splits)
                  + " | harmful ingredients taken (%, " + args.splits[0] + ") | flawed tools taken (%) |",
                  "|---|---|---|" + "---|" * len(args.splits) + "---|---|"]
        for key, tag, name in PAPER:
            for i, steps, ok in found[pattern, key]:
                bad = [mistakes(pattern.format(seed=s), tag, i, args.splits[0]) for s in seeds]
                lines.append(f"| {name} | {i} | {mean(steps):.0f} | " + " | ".join(fmt(ok[sp]) for sp in args.splits)
                             + f" | {mean(b[0] for b in bad):.1f} | {mean(b[1] for b in bad):.1f} |")
        ours = {i: ok for i, _, ok in found[pattern, "qevolve"]}
        if not ours:  # runs without Q-Evolve (a baseline's tuning point): no gap to give
            lines += [""] * (pattern != args.runs[-1])
            continue
        lines += ["", "Q-Evolve minus each method, paired by seed: the mean gap in points [its 95% interval]; "
                  "'shown' where the interval excludes 0. Q-Evolve at the same iteration (QLASS, BC: at each).", "",
                  "| Q-Evolve iteration | against | " + " | ".join(args.splits) + " |",
                  "|---|---|" + "---|" * len(args.splits)]
        for key, _, name in PAPER:
            for i, _, ok in found[pattern, key]:
                for j in sorted(ours) if key in ("bc", "qlass") else [i] if key != "qevolve" and i in ours else []:
                    cells = [paired(ours[j][sp], ok[sp]) for sp in args.splits]
                    lines.append(f"| {j} | {name}{'' if key in ('bc', 'qlass') else f' iteration {i}'} | "
                                 + " | ".join(cells) + " |")
    if args.against_first:  # tuning: a method's every other setting against its first runs', which share its BC
        lines += ["", "Each setting minus the same method in the first runs that have it, paired by seed, at each "
                  "iteration: the mean gap in points [its 95% interval]; 'shown' where the interval excludes 0.", "",
                  "| method | runs | iteration | " + " | ".join(args.splits) + " |", "|---|---|---|" + "---|" *
                  len(args.splits)]
        for key, _, name in PAPER[1:]:
            have = [pattern for pattern in args.runs if found[pattern, key]]
            base = {i: ok for i, _, ok in found[have[0], key]} if have else {}
            for pattern in have[1:]:
                for i, _, ok in (point for point in found[pattern, key] if point[0] in base):
                    cells = [paired(ok[sp], base[i][sp]) for sp in args.splits]
                    lines.append(f"| {name} | {pattern} minus {have[0]} | {i} | " + " | ".join(cells) + " |")
    # a regime (its runs' DEMOS) is one panel; its runs' budgets (N_SELF, QLASS's trees) are points on one curve
    regimes = {}
    for pattern in args.runs:
        regimes.setdefault(made[pattern].get("DEMOS", "all"), []).append(pattern)
    sp = args.splits[0]
    for demos, patterns in regimes.items():  # each method's points over the regime's budgets, by their mean steps
        pts = {key: sorted((p for pattern in patterns for p in found[pattern, key]), key=lambda p: mean(p[1]))
               for key, _, _ in PAPER[1:]}
        pts["bc"] = found[patterns[0], "bc"]
        lines += ["", f"### DEMOS={demos}: {', '.join(patterns)}", "",
                  f"Online env steps to 90% of the optimum on {sp}: per seed, the fewest steps of a point at or above "
                  "it, over these runs ('>N': not reached); Q-Evolve's steps over each method's where both reached it.",
                  "",
                  "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | Q-Evolve / method |",
                  "|---|" + "---|" * len(seeds) + "---|"]
        need = {key: [min((st[n] for _, st, ok in pts[key] if ok[sp][n] >= 0.9 * best[sp]), default=None)
                      for n in range(len(seeds))] for key, _, _ in PAPER[1:]}  # None: not reached
        ours = need["qevolve"]
        for key, _, name in [m for m in PAPER[1:] if pts[m[0]]]:  # the methods the runs have
            ratio = [a / b for a, b in zip(ours, need[key]) if a and b]
            cells = [f"{x}" if x is not None else f">{max([st[n] for _, st, _ in pts[key]], default=0)}"
                     for n, x in enumerate(need[key])]
            lines.append(f"| {name} | " + " | ".join(cells) + " | "
                         + (f"{mean(ratio):.2f} ({len(ratio)} seeds)" if ratio and key != "qevolve" else "-") + " |")
        if pts["qlass"] and pts["qevolve"]:  # the paper's claim: QLASS's success, 1/30 the steps
            lines += ["", "The paper's claim (QLASS's success with 1/30 of its online samples): per seed, QLASS's "
                      f"best {sp} success and its online steps, the fewest online steps at which Q-Evolve is at or "
                      "above that success, and their ratio ('-': Q-Evolve never is).", "",
                      "| seed | QLASS success | QLASS steps | Q-Evolve steps | Q-Evolve / QLASS |",
                      "|---|---|---|---|---|"]
            for n, seed in enumerate(seeds):
                q_ok, q_steps = max((ok[sp][n], -st[n]) for _, st, ok in pts["qlass"])
                hit = min((st[n] for _, st, ok in pts["qevolve"] if ok[sp][n] >= q_ok), default=None)
                lines.append(f"| {seed} | {q_ok:.1f} | {-q_steps} | {'-' if hit is None else hit} | "
                             + ("-" if hit is None else f"{hit / -q_steps:.2f}") + " |")
        lines.append("")
        regimes[demos] = pts
    fig, axes = pyplot().subplots(1, len(regimes), figsize=(5.2 * len(regimes) + 2.2, 3.8), sharey=True,
                                  squeeze=False)
    for ax, (demos, pts) in zip(axes[0], regimes.items()):
        bc = mean(pts["bc"][0][2][sp])
        ax.axhline(bc, color=COLOUR["bc"], lw=1, label="BC")
        for key, _, name in [m for m in PAPER[1:] if pts[m[0]]]:  # the methods the runs have
            x = [0] + [mean(st) for _, st, _ in pts[key]]
            m, h = zip(*[ci(ok[sp]) for _, _, ok in pts[key]])
            y, h = [bc] + list(m), [0] + list(h)
            ax.plot(x, y, color=COLOUR[key], marker="o", ms=4, lw=2, label=name)
            ax.fill_between(x, [a - b for a, b in zip(y, h)], [a + b for a, b in zip(y, h)], color=COLOUR[key],
                            alpha=0.15, lw=0)
        ax.axhline(0.9 * best[sp], color="black", lw=0.6, ls="--", label="90% of the optimum")
        budgets = sorted({made[p].get("N_SELF", "?") for p in args.runs
                          if made[p].get("DEMOS", "all") == demos}, key=lambda v: int(v) if v.isdigit() else 0)
        ax.set(title=f"DEMOS={demos}: {', '.join(budgets)} episodes an iteration", xlabel="online environment steps",
               ylim=(0, 100))
        ax.set_xscale("symlog", linthresh=100)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{args.splits[0]} success (%): mean, 95% band")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))  # off the data
    fig.tight_layout()
    save_png(fig, args.out, WRITER)
    return lines


def ours(png, plot, default):
    """Whether --out may replace png: not a figure the checkout ships (tracked), or one this plot made - its default
    --out, or the table beside it names this plot's command. Never another script's figure (show_credit.py's)."""
    if not tracked(png) or os.path.realpath(png) == os.path.realpath(os.path.join(ROOT, default)):
        return True
    try:
        with open(png[:-4] + ".md", encoding="utf-8") as f:
            return f"`python bench/plots.py {plot} " in f.readline()
    except (OSError, UnicodeDecodeError):
        return False


def main(argv=None):
    p = parser(__doc__)
    sub = p.add_subparsers(dest="plot", required=True, metavar="{learning,sweep,efficiency,paper}")
    plots = {name: sub.add_parser(name, help=help_) for name, help_ in (
        ("learning", "success per iteration"), ("sweep", "success against kitchen's decisions per task"),
        ("efficiency", "success against the online environment steps"),
        ("paper", "the paper's table and success against each method's online steps"))}
    for name, q in plots.items():
        q.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2] if name in ("learning", "sweep") else
                       [0, 1, 2, 3, 4],
                       help="seeds (run directories PREFIX<seed>)")
        q.add_argument("--splits", nargs="+", default=["seen", "unseen"], help="one panel each")
        q.add_argument("--out", default=f"docs/img/{'learning_curve' if name == 'learning' else name}.png",
                       help="the PNG to write" + ("" if name == "learning" else " (its table: the same name, .md)"))
    plots["learning"].add_argument("--prefix", default="runs/seed", help="run directory prefix, as bench/seeds.py's")
    plots["sweep"].add_argument("--decisions", type=int, nargs="+", default=[1, 2, 4, 6], help="one point each")
    plots["sweep"].add_argument("--prefix", default="runs/sweep-d{D}-s", help="run directory prefix, {D}: decisions")
    plots["sweep"].add_argument("--prefix4", default="", help="the prefix for 4 decisions (kitchen's default runs)")
    plots["sweep"].add_argument("--iteration", type=int, default=1, help="the iteration k of each method plotted")
    plots["efficiency"].add_argument("--runs", nargs="+", required=True, help="one run folder pattern per N_SELF, "
                                     "{seed} = the seed")
    plots["paper"].add_argument("--runs", nargs="+", required=True, help="one run folder pattern per budget "
                                "(those of one DEMOS share a panel), {seed} = the seed")
    plots["paper"].add_argument("--against-first", action="store_true", help="tuning points: each method's runs "
                                "against its first runs', paired by seed (runs that share its BC policy)")
    args = p.parse_args(argv)
    if not args.out.endswith(".png"):
        die(f"--out must end in .png, got {args.out!r}")
    distinct("--seeds", args.seeds)
    table = args.out[:-4] + ".md"
    if not ours(args.out, args.plot, plots[args.plot].get_default("out")):
        die(f"--out {args.out} is a figure the checkout ships that `plots.py {args.plot}` did not make; pick another")
    check_out(args.out, "png")  # new, or a PNG this project wrote (its stamp): never a user's picture
    if args.plot != "learning":
        check_out(table, "table")
        if not shipped_by(table, f"{WRITER} {args.plot}"):
            die(f"--out {args.out}: its table {table} is one the checkout ships that `plots.py {args.plot}` did not "
                "make; pick another")
    if args.plot == "learning":
        return learning(args)
    lines = globals()[args.plot](args, table)
    save_text(table, "\n".join(lines) + "\n")
    print("\n".join(lines) + f"\n{args.plot}: wrote {args.out} and {table}")


if __name__ == "__main__":
    main()
