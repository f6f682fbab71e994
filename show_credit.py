"""Credit assignment, made visible: one episode of a 04_gae.py buffer, step by step.

Reads   the JSONL that 04_gae.py writes (every step carries "v" = V(s_t) and "adv" = A_t,
        next to 02's "label", "r_env" and "r_aux"; "q" = Q(s_t, a_t) is shown when a step has it).
Writes  a text table on stdout and, with --png FILE, a plot (needs matplotlib:
        pip install -r requirements-plot.txt).

What to look for: V(s_t) is the critic's estimate of success before reply t. When a reply is
`invalid` ("Nothing happens."), V usually drops at the next state, and GAE puts that drop on
the step that caused it. In kitchen (the credit world) a harmful step - a flawed item used, a valid step
that no rule labels - is marked too: the critic should see its consequence in the next observation:

    delta_t = r_env_t + gamma * (1 - done_t) * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}

so the bars of A_t are the per-step process rewards that 05_bppo.py trains on.

    python show_credit.py runs/default/iter_1/adv.jsonl --pick failure
    python show_credit.py runs/default/iter_1/adv.jsonl --task-id train/00421 --png runs/credit.png
    python show_credit.py runs/default/iter_1/adv.jsonl --index 0          # the first line (an expert demo)
"""
import argparse
import importlib.util
import os

from critic_report import verdicts
from envs._common import cache_root
from plumbing import STAMP, STEP_KEYS, Parser, check_out, die, field_error, in_checkout, read_episodes, write_atomic

MARKED = {"invalid": "tab:red", "format": "tab:orange", "repeat": "tab:purple"}  # labels other than "ok"
FLAW_COLOUR = {"harmful": "tab:red", "recoverable": "tab:orange"}  # envs.judge's verdicts of a mistake


def parse_args(argv=None):
    p = Parser(description="Show one episode of a 04_gae.py buffer: each step's label, rewards, V(s_t), "
                           "Q(s_t, a_t) (when the buffer has it) and advantage A_t, as a table and optionally a plot.",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("buffer", help="the JSONL written by 04_gae.py (e.g. runs/default/iter_1/adv.jsonl)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--index", type=int, help="the episode on line N of the file (0 = the first)")
    which.add_argument("--task-id", help="the first episode of this task id (and of --source)")
    which.add_argument("--pick", choices=["success", "failure"], help="the first successful / failed one of --source")
    p.add_argument("--source", choices=["self", "expert", "any"], default="self",
                   help="which episodes --task-id and --pick look at (self: the policy's own)")
    p.add_argument("--png", metavar="FILE", help="also plot the episode to this PNG (needs matplotlib)")
    p.add_argument("--dpi", type=int, default=80, help="resolution of the PNG")
    p.add_argument("--width", type=int, default=60, help="characters of each reply and observation in the table")
    return p.parse_args(argv)


def read_buffer(path):
    """Every episode of a 04 buffer (plumbing.read_episodes: its steps with "v" and "adv"; "q", where a step has
    it, a number too); a line that is not one is a one-line error."""
    if not os.path.isfile(path):
        die(f"{path}: no such file; pass the JSONL that 04_gae.py wrote (e.g. runs/default/iter_1/adv.jsonl)")
    episodes = read_episodes([path], {**STEP_KEYS, "v": float, "adv": float})
    for i, ep in enumerate(episodes):
        for t, s in enumerate(ep["steps"]):
            problem = "q" in s and field_error(s, {"q": float}, f" at step {t}")
            if problem:
                die(f"{path}: episode {i} {problem}")
    return episodes


def choose(episodes, args):
    """(line index, episode) chosen by --index, --task-id or --pick."""
    if args.index is not None:
        if not 0 <= args.index < len(episodes):
            die(f"no episode {args.index}: {args.buffer} has {len(episodes)} (0 to {len(episodes) - 1})")
        return args.index, episodes[args.index]
    of_source = [(i, ep) for i, ep in enumerate(episodes) if args.source == "any" or ep["source"] == args.source]
    if args.task_id is not None:
        found = [(i, ep) for i, ep in of_source if str(ep["task_id"]) == args.task_id]
        what = f"task id {args.task_id!r}"
    else:
        found = [(i, ep) for i, ep in of_source if bool(ep["success"]) == (args.pick == "success")]
        what = f"{'successful' if args.pick == 'success' else 'failed'} episode"
    if not found:
        hint = "; try --source any" if args.source != "any" and args.task_id is None else ""
        die(f"no {args.source + ' ' if args.source != 'any' else ''}{what} in {args.buffer}{hint}")
    return found[0]


def shorten(text, n):
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:max(n - 3, 0)] + "..."


def reply_of(step):
    """The executed command, or the raw reply in quotes when it had none (a format error)."""
    return step["action"] if step["action"] else repr(" ".join(step["text"].split()))


def harmful(ep):
    """The steps the environment judges a mistake -> {t: verdict} (critic_report.verdicts; kitchen: the item the
    observation before called flawed, a lasting 'harmful' ingredient or a 'recoverable' tool)."""
    return {t: v for t, v in enumerate(verdicts(ep)) if v in ("harmful", "recoverable")}


# What the marks mean, under the table and the picture: why a flaw's credit can be small or land on a neighbour.
FLAW_NOTE = ("harmful: a flawed ingredient used (kitchen), a valid step no rule labels; V falls after it. "
             "recoverable: a flawed tool, put back - it costs one discounted step, about (1 - gamma) V, so its A_t "
             "is small. GAE spreads blame backwards (A_t = delta_t + gamma lambda A_{t+1}): a good step just "
             "before a harmful one can get a negative A_t too.")


def outcome(ep):
    return "success" if ep["success"] else "failure (cut by the step limit)" if ep.get("truncated") else "failure"


def table(ep, index, args):
    """The text table: one row per step, numbers first, then the reply and what it got back."""
    steps = ep["steps"]
    has_q = all("q" in s for s in steps)
    lines = [f"episode {index} of {args.buffer}: task {ep['task_id']} ({ep['source']}), {outcome(ep)}, "
             f"reward {ep.get('reward', 0.0):g}, {len(steps)} steps",
             f"task:  {shorten(ep['task'], 2 * args.width)}",
             f"start: {shorten(ep.get('obs0', ''), 2 * args.width)}", ""]
    replies = [shorten(reply_of(s), args.width) for s in steps]
    w = max(len(r) for r in replies + ["reply"])
    head = f"{'t':>3}  {'label':<7} {'r_env':>6} {'r_aux':>6} {'V(s_t)':>8} " + \
        (f"{'Q(s_t,a_t)':>10} " if has_q else "") + f"{'A_t':>8}  {'reply':<{w}}  observation"
    lines += [head, "-" * len(head)]
    bad = harmful(ep)
    for t, (s, reply) in enumerate(zip(steps, replies)):
        lines.append(f"{t:>3}  {s['label']:<7} {s['r_env']:>6.3f} {s['r_aux']:>6.3f} {s['v']:>8.4f} "
                     + (f"{s['q']:>10.4f} " if has_q else "")
                     + f"{s['adv']:>+8.4f}  {reply:<{w}}  {shorten(s['obs'], args.width)}"
                     + (f" <- {bad[t]}" if t in bad else ""))
    note = "; Q(s_t,a_t): the critic's value of reply t." if has_q else ". No Q column: this buffer has no 'q'."
    if bad:
        note += f"\n<- {FLAW_NOTE}"
    lines += ["", "V(s_t): the critic's value before reply t; A_t: the GAE advantage 05_bppo.py trains on" + note]
    return "\n".join(lines)


def plot(ep, index, args):
    """V(s_t) as a line (Q as dots when present), A_t as bars; non-ok steps marked by colour."""
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(cache_root(), "matplotlib"))  # not ~/.config, ~/.cache
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    steps, bad = ep["steps"], harmful(ep)
    t = list(range(len(steps)))
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 4.2), gridspec_kw={"height_ratios": [3, 2]})
    top.plot(t, [s["v"] for s in steps], "-o", color="tab:blue", markersize=4, label="V(s_t)")
    if all("q" in s for s in steps):
        top.plot(t, [s["q"] for s in steps], "s", color="tab:green", markersize=4, label="Q(s_t, a_t)")
    paid = [x for x, s in zip(t, steps) if s["r_env"] != 0]
    if paid:
        top.plot(paid, [steps[x]["v"] for x in paid], "*", color="gold", markeredgecolor="black", markersize=14,
                 label=f"r_env {'>' if all(steps[x]['r_env'] > 0 for x in paid) else '!='} 0 at this step")
    for x, s in zip(t, steps):
        if s["label"] in MARKED:
            for ax in (top, bottom):
                ax.axvspan(x - 0.5, x + 0.5, color=MARKED[s["label"]], alpha=0.15, linewidth=0)
    for x, verdict in bad.items():  # harmful: red; recoverable: orange
        for ax in (top, bottom):
            ax.axvspan(x - 0.5, x + 0.5, facecolor="none", edgecolor=FLAW_COLOUR[verdict], hatch="//", linewidth=0)
    bottom.bar(t, [s["adv"] for s in steps], color=[MARKED.get(s["label"], "tab:gray") for s in steps])
    bottom.axhline(0, color="black", linewidth=0.8)
    top.set(ylabel="value")
    bottom.set(ylabel="A_t", xlabel="step t")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    here = [lab for lab in MARKED if any(s["label"] == lab for s in steps)]
    handles, names = top.get_legend_handles_labels()
    handles += [Patch(color=MARKED[lab], alpha=0.5) for lab in here]
    names += [f"{lab} step" for lab in here]
    for verdict in sorted(set(bad.values())):
        handles.append(Patch(facecolor="none", edgecolor=FLAW_COLOUR[verdict], hatch="//"))
        names.append({"harmful": "harmful: a flawed ingredient (V falls)",
                      "recoverable": "recoverable: a flawed tool (one step lost: small A_t)"}[verdict])
    top.legend(handles, names, fontsize=7, loc="best")
    if bad:
        fig.text(0.01, 0.005, "GAE spreads blame backwards (A_t = delta_t + gamma lambda A_t+1): a step just before a "
                 "harmful one can get a negative A_t too.", fontsize=6.5)
    title = f"{ep['source']} episode {ep['task_id']}: {outcome(ep).upper()} - {shorten(ep['task'], 50)}"
    top.set_title(title, fontsize=10, color="tab:green" if ep["success"] else "tab:red")
    fig.tight_layout()
    try:  # stamped (its Software text) so that a later --png may replace it
        write_atomic(args.png, lambda tmp: fig.savefig(tmp, dpi=args.dpi, format="png",
                                                       metadata={"Software": STAMP + "show_credit.py"}))
    finally:
        plt.close(fig)


def check_png(path, buffer):
    """--png, before any work: a new .png or a PNG this script wrote (its Software text chunk), never in the checkout
    (its top, docs/img/ or another of its folders: in_checkout), never the buffer nor any other file (a model's
    weights, a JSONL, someone's picture) that a mistyped path would destroy."""
    if importlib.util.find_spec("matplotlib") is None:  # found, not imported: a refusal leaves no matplotlib config
        die("--png needs matplotlib: pip install -r requirements-plot.txt")
    if not path.endswith(".png") or not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        die(f"--png {path}: " + ("its directory does not exist" if path.endswith(".png") else "must end in .png"))
    if in_checkout(path):  # the checkout's own figures (docs/img/) and folders: never replaced, never added to
        die(f"--png {path} is a file at the checkout's top or in one of its folders; write the plot under runs/ or "
            "outside the checkout, e.g. runs/credit.png")
    check_out(path, "png", [buffer])


def main(argv=None):
    args = parse_args(argv)
    if not (10 <= args.dpi <= 1000 and 10 <= args.width <= 10000):  # a huge --dpi allocates a huge picture
        die(f"--dpi must be in [10, 1000] and --width in [10, 10000], got {args.dpi} and {args.width}")
    if args.png:
        check_png(args.png, args.buffer)
    index, ep = choose(read_buffer(args.buffer), args)
    print(table(ep, index, args))
    if args.png:
        plot(ep, index, args)
        print(f"plot -> {args.png}")


if __name__ == "__main__":
    main()
