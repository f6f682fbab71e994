"""Measure an embedded environment: raw steps per second, and expert / random-command success (shop: also the average
reward) on every split; kitchen also item 1 at every station (what greedy BC copies) and the good item always (the
optimum). A measurement, not a test.

    python bench/speed/env_speed.py [--seed 0] [--env-kwargs '{"habit": 0.6}']
    python bench/speed/env_speed.py --env kitchen [--env-kwargs '{"decisions": 2}']
    python bench/speed/env_speed.py --env shop
"""
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
import envs  # noqa: E402
from bench.runner import parser  # noqa: E402
from plumbing import check_flags, die, parse_env_kwargs  # noqa: E402


def run(env, policy, task_ids, rng):
    wins = steps = total = 0
    t0 = time.perf_counter()
    for tid in task_ids:
        env.reset(tid)
        done = False
        while not done:
            action = env.expert_action() if policy == "expert" else env.random_action(rng) if policy == "random" \
                else policy(env)
            _, reward, terminated, truncated, info = env.step(action)
            steps += 1
            total += reward
            done = terminated or truncated
        wins += info["won"]
    return wins / len(task_ids), steps, time.perf_counter() - t0, total / len(task_ids)


def main():
    p = parser(__doc__)
    p.add_argument("--seed", type=int, default=0, help="world seed and random-policy seed")
    p.add_argument("--env", default="kitchen", choices=["household", "kitchen", "shop"],
                   help="the embedded environment")
    p.add_argument("--env-kwargs", default="{}", help="JSON dict of the env's keyword arguments (as in 02_collect.py)")
    args = check_flags(p.parse_args(), seed="a seed in [0, 2**32)")
    try:
        env = envs.make(args.env, seed=args.seed, **parse_env_kwargs(args.env_kwargs))
    except (ValueError, ImportError) as e:  # a keyword the environment does not take, or a value it refuses
        die(e)
    rng = random.Random(args.seed)
    graded = args.env == "shop"
    if graded:
        print(f"shop (seed {args.seed}): {len(env.products)} products, page_size {env.page_size}, "
              f"max_steps {env.max_steps}, hasty {env.hasty}")
        print("| split | tasks | expert success | expert avg reward | expert avg steps | random success "
              "| random avg reward | random steps/s |")
        print("|---|---|---|---|---|---|---|---|")
    elif args.env == "kitchen":
        print(f"kitchen (seed {args.seed}): decisions {env.decisions}, careless {env.careless}, spoil {env.spoil}, "
              f"outage {env.outage}, max_steps {env.max_steps}")
        print("| split | tasks | expert success | expert avg steps | item 1 always | the good item always "
              "| random success | random steps/s |")
        print("|---|---|---|---|---|---|---|---|")
    else:
        print(f"household (seed {args.seed}): n_receptacles {env.n_receptacles}, n_distractors {env.n_distractors}, "
              f"max_steps {env.max_steps}, step_slack {env.step_slack}, habit {env.habit}")
        print("| split | tasks | expert success | expert avg steps | random success | random steps/s |")
        print("|---|---|---|---|---|---|")
    for split in env.splits:
        ids = env.task_ids(split)
        e_succ, e_steps, _, e_rew = run(env, "expert", ids, rng)
        r_succ, r_steps, r_time, r_rew = run(env, "random", ids, rng)
        if args.env == "kitchen":  # item 1, or the other one after a tool was put back; the good item
            good = lambda e: f"use {e._task['kinds'][e.station]} {3 - e._task['flawed'][e.station]}"
            first = lambda e: good(e) if e.put_back else f"use {e._task['kinds'][e.station]} 1"
            print(f"| {split} | {len(ids)} | {e_succ:.1%} | {e_steps / len(ids):.2f} | "
                  f"{run(env, first, ids, rng)[0]:.1%} | {run(env, good, ids, rng)[0]:.1%} | {r_succ:.1%} "
                  f"| {r_steps / r_time:,.0f} |")
        elif graded:
            print(f"| {split} | {len(ids)} | {e_succ:.1%} | {e_rew:.3f} | {e_steps / len(ids):.2f} | {r_succ:.1%} "
                  f"| {r_rew:.3f} | {r_steps / r_time:,.0f} |")
        else:
            print(f"| {split} | {len(ids)} | {e_succ:.1%} | {e_steps / len(ids):.2f} | {r_succ:.1%} "
                  f"| {r_steps / r_time:,.0f} |")
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
