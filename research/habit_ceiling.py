"""How much could a policy gain by unlearning only its demonstrator's habit (household `habit=p`)?
Runs a policy greedily on a split (like `02_collect.py --greedy`), once as it is and once with
every `examine X` at a closed receptacle X it stands at replaced by `open X` (its thought kept,
everything else the policy's own greedy replies). The gap between the two success rates is the
most that fixing the habit, and nothing else, could add; the counts of the other `go` mistakes
say whether the habit-free episodes, which the demonstrations rarely show whole, lead the policy
into mistakes it did not make before (docs/policy_improvement.md).

    python research/habit_ceiling.py --policy runs/hb_s0/policy_0 \
        --env-kwargs '{"max_steps": 9, "n_distractors": 1, "habit": 0.6}' [--out runs/hb_s0/ceiling]

With --out PREFIX the episodes go to PREFIX_greedy.jsonl and PREFIX_forced.jsonl, labelled as
02_collect.py labels them ("ok" / "invalid" / "format"; no "repeat"), each step marked
"forced" where its action was replaced - readable by research/failure_modes.py.
"""
import argparse
import json
import os
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._stages import load_stage  # noqa: E402
from research.recovery_ceiling import greedy_setup, reply  # noqa: E402

collect = load_stage("02_collect")


def run(model, tok, env, tid, force, max_new, mistakes, episodes=None):
    obs, info = env.reset(tid)
    ep = {"instruction": env.instruction, "task": info["task"], "obs0": obs, "steps": []}
    if episodes is not None:
        episodes.append(ep)
    room = set(re.findall(r"\ban? ([a-z]+ \d+)", obs))  # the receptacles the first observation lists
    here, r = None, 0.0
    for _ in range(env.max_steps):
        text = reply(model, tok, ep, True, max_new)
        action = collect.parse_action(text)
        closed = here is not None and f"The {here} is closed." in obs
        forced = force and closed and action == f"examine {here}"
        if forced:
            action = f"open {here}"
            text = re.sub(r"Action: .*", f"Action: {action}", text)
        label = "ok"
        if action is None:
            obs, done, trunc, label = collect.FORMAT_ERROR_OBS, False, False, "format"
        else:
            if action.startswith("go to "):
                target = action[len("go to "):]
                if target == here:
                    mistakes["go: already there"] += 1
                elif target not in room:
                    mistakes["go: receptacle not in room"] += 1
                else:
                    here = target
            elif closed and action == f"examine {here}":
                mistakes["examine at a closed receptacle"] += 1
            obs, r, done, trunc, info = env.step(action)
            label = "invalid" if env.is_invalid(obs) else "ok"
        ep["steps"].append({"text": text, "action": action, "obs": obs, "label": label, "forced": forced})
        if done or trunc:
            ep["success"] = bool(done and r > 0)
            return ep["success"]
    ep["success"] = False
    return False


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", help="write the episodes to OUT_greedy.jsonl and OUT_forced.jsonl")
    args, model, tok, env, tids = greedy_setup(p)
    for force in (False, True):
        mistakes, episodes = Counter(), []
        wins = sum(run(model, tok, env, tid, force, args.max_new_tokens, mistakes, episodes) for tid in tids)
        if args.out:
            with open(f"{args.out}_{'forced' if force else 'greedy'}.jsonl", "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in episodes)
        print(f"{args.policy} {args.split} {'examine at a closed receptacle -> open' if force else 'greedy'}: "
              f"success {wins}/{len(tids)}; steps: {dict(mistakes)}", flush=True)


if __name__ == "__main__":
    main()
