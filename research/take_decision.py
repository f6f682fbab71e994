"""The one decision that decides most household episodes: the agent has just seen what a
receptacle holds (it arrived at it, or opened it) with empty hands. Is the object it needs
listed? Then it should `take` it; if not, it should move on. For each episode JSONL file
(02_collect.py output, or 04_gae.py output with "adv" on every step) this prints

    P(take | listed)        how often the policy takes the goal object when it is in view
    P(take | not listed)    how often it tries to take it when it is not (a perceptual mistake)

and, where the file has advantages, the mean advantage of each (source, listed?, take?) cell,
raw and in standard deviations of all the file's advantages (what 05_bppo.py's
--adv-norm center turns them into). The expert's rates are 1 and 0 by construction.

    python research/take_decision.py runs/seed0/eval/policy_0_seen.jsonl runs/seed0/eval/policy_1_seen.jsonl
    python research/take_decision.py runs/seed0/iter_1/adv.jsonl
"""
import argparse
import collections
import json
import re
import statistics


def goal_object(task):
    """'put a clean mug in shelf 1.' -> 'mug'; 'look at book under the desklamp.' -> 'book'."""
    m = re.match(r"(?:put (?:a |two )(?:clean |hot |cool )?|look at )([a-z]+)", task)
    return m.group(1) if m else None


def take_decisions(episode):
    """(t, listed, took, adv) for each step t taken right after a contents listing, hands empty."""
    obj = goal_object(episode["task"])
    out, last_obs, holding = [], episode["obs0"], False
    for t, step in enumerate(episode["steps"]):
        action = step["action"] or ""
        if not holding and " you see " in last_obs and last_obs.startswith(("You arrive at", "You open")):
            listed = re.search(rf"\b{obj} \d", last_obs.split(" you see ", 1)[1]) is not None
            out.append((t, listed, action.startswith(f"take {obj} "), step.get("adv")))
        if step["label"] == "ok" and action.startswith("take "):
            holding = True
        if step["label"] == "ok" and action.startswith("put "):
            holding = False
        last_obs = step["obs"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="episode JSONL files (household)")
    args = p.parse_args()
    print("| file | P(take \\| listed) | P(take \\| not listed) |")
    print("|---|---|---|")
    cells_by_file = {}
    for path in args.files:
        with open(path) as f:
            episodes = [json.loads(line) for line in f if line.strip()]
        rate = collections.defaultdict(list)  # (source, listed) -> [took]
        cells = collections.defaultdict(list)
        for e in episodes:
            for _, listed, took, adv in take_decisions(e):
                rate[(e.get("source", "?"), listed)].append(took)
                cells[(e.get("source", "?"), listed, took)].append(adv)
        sources = sorted({s for s, _ in rate})
        for source in sources:
            yes, no = rate[(source, True)], rate[(source, False)]
            name = path if len(sources) == 1 else f"{path} ({source} episodes)"
            print(f"| {name} | {sum(yes) / max(1, len(yes)):.2f} (n={len(yes)}) "
                  f"| {sum(no) / max(1, len(no)):.2f} (n={len(no)}) |")
        all_adv = [s["adv"] for e in episodes for s in e["steps"] if s.get("adv") is not None]
        if all_adv:
            cells_by_file[path] = (cells, statistics.mean(all_adv), statistics.pstdev(all_adv) or 1.0)
    for path, (cells, mu, sd) in cells_by_file.items():
        print(f"\n{path}: advantages, all steps mean {mu:+.3f}, std {sd:.3f}\n")
        print("| source | goal object listed | action | steps | mean advantage | in std of all steps |")
        print("|---|---|---|---|---|---|")
        for (source, listed, took), advs in sorted(cells.items(), key=lambda kv: (kv[0][0], not kv[0][1], not kv[0][2])):
            m = statistics.mean(advs)
            print(f"| {source} | {'yes' if listed else 'no'} | {'take it' if took else 'other'} | {len(advs)} "
                  f"| {m:+.3f} | {(m - mu) / sd:+.2f} |")


if __name__ == "__main__":
    main()
