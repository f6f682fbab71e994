"""Where does the agent look first? For each household episode JSONL (02_collect.py or 04_gae.py
output) this prints, over the `go to` commands an agent issues while searching for the task's
object (hands empty, object not yet seen):

    likely-first   the fraction of searches whose first `go to` is a receptacle of the type
                   where that object is most often found (OBJECT_LOCATIONS[obj][0])
    mean rank      the mean position of each searched receptacle's type in OBJECT_LOCATIONS[obj]
                   (0 = the likeliest; types not in the list count as its length)
    visits         mean `go to`s before the object is first seen (or the episode ends)

and success. With `expert="random"` the demonstrator searches in a random order, so a BC policy
starts near chance; a policy that learns where things are from its own outcomes moves toward
the likely places. A diagnostic, not part of the algorithm.

    python bench/search_order.py runs/default/data/expert.jsonl runs/default/eval/policy_0_dev.jsonl \
        runs/default/eval/policy_1_dev.jsonl
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from envs.household import OBJECT_LOCATIONS  # noqa: E402
from take_decision import goal_object  # noqa: E402  (bench/ is on sys.path when this script runs)


def search_visits(episode):
    """Receptacle types visited by `go to` before the goal object first appears in an observation."""
    obj = goal_object(episode["task"])
    kinds = []
    for step in episode["steps"]:
        if f"a {obj} " in step["obs"] and not step["action"].startswith("go to"):
            break
        if step["action"].startswith("go to "):
            kinds.append(step["action"][6:].rsplit(" ", 1)[0])
            if f"a {obj} " in step["obs"]:
                break
    return obj, kinds


def summary(path):
    episodes = [json.loads(line) for line in open(path) if line.strip()]
    first, ranks, visits = [], [], []
    for ep in episodes:
        obj, kinds = search_visits(ep)
        if obj not in OBJECT_LOCATIONS or not kinds:
            continue
        order = OBJECT_LOCATIONS[obj]
        rank = [order.index(k) if k in order else len(order) for k in kinds]
        first.append(rank[0] == 0)
        ranks += rank
        visits.append(len(kinds))
    success = statistics.mean(ep["success"] for ep in episodes)
    return len(episodes), statistics.mean(first), statistics.mean(ranks), statistics.mean(visits), success


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="household episode JSONL files")
    args = p.parse_args()
    print("| file | episodes | likely-first | mean rank | visits | success |")
    print("|---|---|---|---|---|---|")
    for path in args.files:
        n, first, rank, visits, success = summary(path)
        print(f"| {path} | {n} | {first:.2f} | {rank:.2f} | {visits:.2f} | {success:.1%} |")


if __name__ == "__main__":
    main()
