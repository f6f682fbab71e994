"""Replay ScienceWorld's gold path on every variation of some task types; print, per task
type and split, how many commands the gold path needs to complete the task and whether
it always reaches score 100. Backs the DEFAULT_TASKS table in envs/sciworld.py.

    python research/sciworld_gold_lengths.py                     # the default tasks (~10 min)
    python research/sciworld_gold_lengths.py --tasks power-component --limit 5
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from envs.sciworld import DEFAULT_TASKS, ScienceWorldEnv  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help="ScienceWorld task names")
    ap.add_argument("--limit", type=int, default=None, help="at most this many variations per task and split")
    ap.add_argument("--out", default=None, help="also write the per-variation rows to this JSON file")
    args = ap.parse_args()
    rows = []
    for task in args.tasks:
        env = ScienceWorldEnv(tasks=[task], max_steps=1000, max_per_task=args.limit)
        for split in env.splits:
            t0, lens, fails = time.time(), [], []
            for tid in env.task_ids(split):
                env.reset(tid)
                gold, done, won = env.gold_path(), False, False
                for cmd in gold:
                    _, _, terminated, truncated, info = env.step(cmd)
                    if terminated or truncated:
                        won = info["won"]
                        break
                lens.append(env.t)
                rows.append({"task": task, "split": split, "variation": env.task_of(tid)[1], "gold_len": len(gold),
                             "steps": env.t, "won": won})
                if not won:
                    fails.append(tid)
            print(f"{task:45s} {split:6s} variations {len(lens):4d}  steps max {max(lens):3d} "
                  f"mean {sum(lens) / len(lens):5.1f}  failed {len(fails)}  ({time.time() - t0:.0f}s)", flush=True)
        env.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
