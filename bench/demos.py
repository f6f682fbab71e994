"""The demonstrations' rule (run_all.sh's DEMOS), checked by simulating kitchen's demonstrator alone, before any policy
is trained. For each `careless` of the grid, on world 0's train tasks: the demonstrator's success, and at ingredient
stations where item 1 is flawed the share of first choices that took it, among all demonstrations and among the
successful ones alone (DEMOS=success keeps those); and item 1 at every station on `dev` (what greedy BC copies, when
the flaw is the mode).

The rule (docs/design.md, 'The demonstrations'): the paper's D_expert holds successful demonstrations only. Kitchen
keeps its stated properties under it - the flawed ingredient the mode where item 1 is flawed (a share above 0.6, so
greedy BC copies it), item 1 always between 30% and 60% on dev, the outage and the tools as they are - at the smallest
`careless` of the grid that meets them, spoil unchanged.

    python bench/demos.py [--careless 0.7 0.75 0.8 0.85 0.9] [--spoil 0.6]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import envs  # noqa: E402
from bench.runner import parser  # noqa: E402
from envs.kitchen import INGREDIENTS  # noqa: E402
from plumbing import check_flags, die  # noqa: E402


def demonstrations(env, split="train"):
    """The demonstrator on every task of `split` -> [(won, [(kind, flawed item, first choice), ...])]."""
    out = []
    for tid in env.task_ids(split):
        env.reset(tid)
        first, done, info = {}, False, {}  # station -> (kind, flawed item, the item taken first)
        while not done:
            station, action = env.station, env.expert_action()
            if action.split()[-1] in ("1", "2") and station not in first:  # not a fumble (`use egg 3`), not a look
                first[station] = (env._task["kinds"][station], env._task["flawed"][station], int(action[-1]))
            _, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
        out.append((info["won"], list(first.values())))
    return out


def flawed_share(demos):
    """At ingredient stations where item 1 is flawed: the share of first choices that took item 1."""
    picks = [choice == 1 for _, stations in demos for kind, flawed, choice in stations
             if kind in INGREDIENTS and flawed == 1]
    return sum(picks) / max(len(picks), 1)


def item_one_success(env, split="dev"):
    """Item 1 at every station, the other after a tool is put back (greedy BC when the flaw is the mode), no wasted
    step -> its success on `split`."""
    wins = 0
    for tid in env.task_ids(split):
        env.reset(tid)
        done = False
        while not done:
            item = 3 - env._task["flawed"][env.station] if env.put_back else 1  # the other one after a tool's put back
            _, _, terminated, truncated, info = env.step(f"use {env._task['kinds'][env.station]} {item}")
            done = terminated or truncated
        wins += info["won"]
    return wins / len(env.task_ids(split))


def properties(careless, spoil=0.6, seed=0):
    env = envs.make("kitchen", seed=seed, careless=careless, spoil=spoil)
    demos = demonstrations(env)
    wins = [d for d in demos if d[0]]
    return {"careless": careless, "spoil": spoil, "success": len(wins) / len(demos), "kept": len(wins),
            "share_all": flawed_share(demos), "share_success": flawed_share(wins), "item1_dev": item_one_success(env)}


def main():
    p = parser(__doc__)
    p.add_argument("--careless", type=float, nargs="+", default=[0.7, 0.75, 0.8, 0.85, 0.9])
    p.add_argument("--spoil", type=float, default=0.6)
    args = check_flags(p.parse_args(), spoil="in [0, 1]")
    if not all(0 <= c <= 1 for c in args.careless):
        die(f"--careless must be probabilities in [0, 1], got {' '.join(map(str, args.careless))}")
    print("| careless / spoil | demonstrator success | successes kept (of 1000) | flawed-ingredient share, all demos "
          "| ... successes only | item 1 always on dev |")
    print("|---|---|---|---|---|---|")
    for c in args.careless:
        r = properties(c, args.spoil)
        print(f"| {c} / {args.spoil} | {r['success']:.1%} | {r['kept']} | {r['share_all']:.2f} | "
              f"{r['share_success']:.2f} | {r['item1_dev']:.1%} |")


if __name__ == "__main__":
    main()
