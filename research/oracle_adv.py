"""Replace the critic's advantages in a 04 buffer with hand-made ones from the labels, to test
the policy step (05) apart from the critic: "what would BPPO do if the process rewards were
exactly right?" A diagnostic, not part of the algorithm.

    --kind success   A = +1 on every step of a successful episode, else 0 (RFT through BPPO)
    --kind unlike    A = -1 on every invalid / repeat / format step, else 0 (suppress mistakes only)
    --kind contrast  A = +1 on every expert step, -1 on every bad self step, else 0
    --kind first     A = -1 on the first mistake of each episode only, else 0 (what GAE blames most)
    --kind decision  only at self steps right after a contents listing with empty hands
                     (research/take_decision.py): +1 for taking the goal object when it is listed
                     or not taking it when it is not, -1 for the opposite, else 0
    --kind start     only at the first step of each self episode, if it is a `go to`: +1 when it
                     goes to the object's most likely receptacle kind in the room
                     (research/first_search.py), else -1; 0 elsewhere
    --self-only      drop the expert episodes; with --kind success and 05's --adv-norm center
                     this is REINFORCE with a mean baseline on the self data (the
                     Monte-Carlo outcome in place of the critic)

    python research/oracle_adv.py --data runs/seed0/iter_1/adv.jsonl --kind unlike --out /tmp/adv_unlike.jsonl
    python 05_bppo.py --data /tmp/adv_unlike.jsonl --policy runs/seed0/policy_0 --ref runs/seed0/policy_0 \
        --adv-norm none --out /tmp/unlike_policy
    python 02_collect.py --policy /tmp/unlike_policy --split seen --greedy --out /tmp/unlike_seen.jsonl
"""
import argparse
import json

from first_search import likely_kind  # research/ is on sys.path when this script runs
from take_decision import take_decisions


def oracle_advantage(kind, episode, step):
    bad = step["label"] != "ok"
    if kind == "first":
        return -1.0 if bad and step is next(s for s in episode["steps"] if s["label"] != "ok") else 0.0
    if kind == "success":
        return 1.0 if episode["success"] else 0.0
    if kind == "unlike":
        return -1.0 if bad else 0.0
    if episode["source"] == "expert":  # contrast
        return 1.0
    return -1.0 if bad else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a 04_gae.py output buffer")
    p.add_argument("--kind", required=True, choices=["success", "unlike", "contrast", "first", "decision", "start"])
    p.add_argument("--out", required=True, help="buffer to write, with the hand-made 'adv'")
    p.add_argument("--self-only", action="store_true", help="leave the expert episodes out")
    args = p.parse_args()
    with open(args.data) as f:
        episodes = [json.loads(line) for line in f if line.strip()]
    if args.self_only:
        episodes = [ep for ep in episodes if ep["source"] != "expert"]
    for ep in episodes:
        if args.kind == "decision":
            for step in ep["steps"]:
                step["adv"] = 0.0
            if ep["source"] != "expert":
                for t, listed, took, _ in take_decisions(ep):
                    ep["steps"][t]["adv"] = 1.0 if listed == took else -1.0
            continue
        if args.kind == "start":
            for step in ep["steps"]:
                step["adv"] = 0.0
            first = ep["steps"][0]
            if ep["source"] != "expert" and first["action"].startswith("go to "):
                first["adv"] = 1.0 if first["action"][len("go to "):].rsplit(" ", 1)[0] == likely_kind(ep) else -1.0
            continue
        for step in ep["steps"]:
            step["adv"] = oracle_advantage(args.kind, ep, step)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(ep) + "\n" for ep in episodes)
    print(f"wrote {len(episodes)} episodes with --kind {args.kind} advantages to {args.out}")


if __name__ == "__main__":
    main()
