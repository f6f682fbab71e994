"""Measure the household environment: raw steps per second, and expert / random-command
success on every split. A measurement, not a test.

    python bench/env_speed.py [--seed 0] [--env-kwargs '{"expert": "privileged"}']
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402


def run(env, policy, task_ids, rng):
    wins = steps = 0
    t0 = time.perf_counter()
    for tid in task_ids:
        env.reset(tid)
        done = False
        while not done:
            action = env.expert_action() if policy == "expert" else env.random_action(rng)
            _, _, terminated, truncated, _ = env.step(action)
            steps += 1
            done = terminated or truncated
        wins += terminated
    return wins / len(task_ids), steps, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="world seed and random-policy seed")
    p.add_argument("--env-kwargs", default="{}", help="JSON dict of household keyword arguments (as in 02_collect.py)")
    args = p.parse_args()
    env = envs.make("household", seed=args.seed, **json.loads(args.env_kwargs))
    rng = random.Random(args.seed)
    print(f"household (seed {args.seed}): n_receptacles {env.n_receptacles}, n_distractors {env.n_distractors}, "
          f"max_steps {env.max_steps}, expert {env.expert!r}, expert_slip {env.expert_slip}")
    print("| split | tasks | expert success | expert avg steps | random success | random steps/s |")
    print("|---|---|---|---|---|---|")
    for split in ("train", "seen", "unseen"):
        ids = env.task_ids(split)
        e_succ, e_steps, _ = run(env, "expert", ids, rng)
        r_succ, r_steps, r_time = run(env, "random", ids, rng)
        print(f"| {split} | {len(ids)} | {e_succ:.1%} | {e_steps / len(ids):.2f} | {r_succ:.1%} | {r_steps / r_time:,.0f} |")
    # Raw stepping speed without the expert's planning: replay fixed command lists.
    ids = env.task_ids("train")[:200]
    plans = []
    for tid in ids:
        env.reset(tid)
        cmds, done = [], False
        while not done:
            cmds.append(env.expert_action())
            done = any(env.step(cmds[-1])[2:4])
        plans.append(cmds)
    t0, n = time.perf_counter(), 0
    for _ in range(5):
        for tid, cmds in zip(ids, plans):
            env.reset(tid)
            for c in cmds:
                env.step(c)
                n += 1
    print(f"raw env speed (reset + replayed expert commands, one core): {n / (time.perf_counter() - t0):,.0f} steps/s")


if __name__ == "__main__":
    main()
