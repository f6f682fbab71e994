"""The decision household's `habit` demonstrator gets wrong on purpose: the agent has just
arrived at a closed receptacle ("You arrive at cabinet 1. The cabinet 1 is closed."). The
right command is `open cabinet 1`; the habit is `examine cabinet 1`, which does nothing while
it is closed ("Nothing happens.", labelled invalid) and costs a step. For each episode JSONL
file (02_collect.py output, or 04_gae.py output with "adv" on every step) this prints how
often the policy examines, opens or does something else there, and, where the file has
advantages, the mean advantage of each (source, verb) - does the critic rate `open` above
`examine`?

    python research/habit_rate.py runs/hb_s0/eval/policy_0_dev.jsonl runs/hb_s0/eval/policy_1_dev.jsonl
    python research/habit_rate.py runs/hb_s0/iter_1/adv.jsonl
"""
import argparse
import collections
import json
import statistics


def closed_arrival_steps(episode):
    """(t, X) for each step t taken right after 'You arrive at X. The X is closed.'"""
    out, last_obs = [], episode["obs0"]
    for t, step in enumerate(episode["steps"]):
        if last_obs.startswith("You arrive at") and last_obs.endswith("is closed."):
            out.append((t, last_obs[len("You arrive at "):].split(".", 1)[0]))
        last_obs = step["obs"]
    return out


def closed_arrivals(episode):
    """(verb, adv) of each step taken right after arriving at a closed receptacle: verb is
    'examine', 'open' or 'other'; adv is the step's advantage (None without one)."""
    out = []
    for t, _ in closed_arrival_steps(episode):
        step = episode["steps"][t]
        verb = (step["action"] or "").split(" ")[0]
        out.append((verb if verb in ("examine", "open") else "other", step.get("adv")))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="episode JSONL files")
    args = p.parse_args(argv)
    for path in args.files:
        counts, advs, won, n = collections.Counter(), collections.defaultdict(list), 0, 0
        with open(path) as f:
            for line in f:
                ep = json.loads(line)
                n, won = n + 1, won + bool(ep["success"])
                for verb, adv in closed_arrivals(ep):
                    counts[verb] += 1
                    if adv is not None:
                        advs[(ep.get("source", "self"), verb)].append(adv)
        total = max(sum(counts.values()), 1)
        line = (f"{path}: success {won}/{n}; at a closed receptacle: examine {counts['examine']}, open "
                f"{counts['open']}, other {counts['other']} (habit rate {counts['examine'] / total:.2f})")
        if advs:
            line += "; mean A: " + ", ".join(f"{s} {v} {statistics.mean(a):+.3f} (n={len(a)})"
                                             for (s, v), a in sorted(advs.items()))
        print(line)


if __name__ == "__main__":
    main()
