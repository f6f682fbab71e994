"""Where does a policy look first? For household episode JSONL files (02_collect.py output), per
file: the share of episodes whose first `go to` is the most likely receptacle kind for the
task's object among the kinds in the room, the target's left out (envs/household.py
OBJECT_LOCATIONS, the prior the generator places objects with), the success rate of those episodes and of the others, and the
mean number of steps of a success. A demonstrator that starts its search anywhere (expert="sweep")
scores about 1 / 8 on the first number; the likely-places-first search, 1.

    python research/first_search.py runs/sw/s0/eval/policy_0_dev.jsonl runs/sw/s0/eval/policy_1_dev.jsonl
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from envs.household import LAMP_LOCATIONS, OBJECT_LOCATIONS  # noqa: E402
from research.take_decision import goal_object  # noqa: E402


def first_go(episode):
    for step in episode["steps"]:
        if step["action"].startswith("go to "):
            return step["action"][len("go to "):]
    return None


def likely_kind(episode):
    """The most likely kind for the goal object among the receptacle kinds the room lists (the
    task's target kind left out: the generator never places the object there)."""
    obj = goal_object(episode["task"])
    kinds = set(re.findall(r"\ban? ([a-z]+) \d+", episode["obs0"]))
    target = re.search(r" in ([a-z]+) 1\.$", episode["task"])
    kinds.discard(target.group(1) if target else None)
    prior = OBJECT_LOCATIONS.get(obj, LAMP_LOCATIONS)
    return next((k for k in prior if k in kinds), None)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    args = p.parse_args()
    print("| file | first `go to` is the likely kind | success then | success otherwise | steps of a success |")
    print("|---|---|---|---|---|")
    for path in args.files:
        with open(path) as f:
            eps = [json.loads(line) for line in f if line.strip()]
        hit = [e for e in eps if (first_go(e) or "").rsplit(" ", 1)[0] == likely_kind(e)]
        miss = [e for e in eps if e not in hit]
        wins = [len(e["steps"]) for e in eps if e["success"]]
        rate = lambda es: f"{sum(e['success'] for e in es)}/{len(es)}"
        print(f"| {path} | {len(hit)}/{len(eps)} | {rate(hit)} | {rate(miss)} | "
              f"{sum(wins) / max(len(wins), 1):.1f} |")


if __name__ == "__main__":
    main()
