"""How much could a policy gain by learning only *where to look first*? Runs a policy greedily on
a split (like `02_collect.py --greedy`), once as it is and once with its first reply replaced by
"go to" the first receptacle of the task object's most likely kind in the room (the kind
research/first_search.py counts; the target's kind left out), everything after it the policy's
own greedy replies. With a demonstrator that starts its search anywhere (expert="sweep"), this
is the decision its demonstrations leave to chance and its own outcomes can teach; the gap
between the two success rates is the most that learning it (and nothing else) could add.

    python research/start_ceiling.py --policy runs/sw_s0/policy_0 \
        --env-kwargs '{"expert": "sweep", "thoughts": "restate", "max_steps": 12}'
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._stages import load_stage  # noqa: E402
from research.first_search import likely_kind  # noqa: E402
from research.recovery_ceiling import greedy_setup, reply  # noqa: E402

collect = load_stage("02_collect")


def likely_receptacle(task, obs0):
    """The first receptacle of the likely kind in the room's listing, e.g. 'fridge 1'."""
    kind = likely_kind({"task": task, "obs0": obs0})
    found = re.search(rf"\b({kind} \d+)", obs0) if kind else None
    return found.group(1) if found else None


def run(model, tok, env, tid, force, max_new):
    obs, info = env.reset(tid)
    ep = {"instruction": env.instruction, "task": info["task"], "obs0": obs, "steps": []}
    start = likely_receptacle(info["task"], obs)
    r = 0.0
    for t in range(env.max_steps):
        text = reply(model, tok, ep, True, max_new)
        if t == 0 and force and start is not None:
            text = re.sub(r"Action: .*", f"Action: go to {start}", text) if "Action: " in text \
                else f"Action: go to {start}"
        action = collect.parse_action(text)
        if action is None:
            obs, done, trunc = collect.FORMAT_ERROR_OBS, False, False
        else:
            obs, r, done, trunc, info = env.step(action)
        ep["steps"].append({"text": text, "obs": obs})
        if done or trunc:
            return bool(done and r > 0)
    return False


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args, model, tok, env, tids = greedy_setup(p)
    for force in (False, True):
        wins = sum(run(model, tok, env, tid, force, args.max_new_tokens) for tid in tids)
        print(f"{args.policy} {args.split} {'first go to forced to the likely kind' if force else 'greedy'}: "
              f"success {wins}/{len(tids)}", flush=True)


if __name__ == "__main__":
    main()
