"""Batched collection (many environments in lockstep, one KV-cached generation batch) against
one episode at a time, with the same policy and the same tasks. A measurement, not a test.
Use more episodes than --batch so that refilling slots (a finished slot starts the next
task) is part of what is measured. On a shared CPU the wall time depends on the other load,
so the CPU seconds of each collection (02's summary) are compared too.

    python bench/collect_speed.py --policy runs/default/policy_0 [--episodes 96] [--batch 32] [--threads 1]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def collect(policy, episodes, num_envs, out_dir, split, threads):
    out = os.path.join(out_dir, f"n{num_envs}.jsonl")
    subprocess.run([sys.executable, "02_collect.py", "--policy", policy, "--split", split, "--episodes", str(episodes),
                    "--num-envs", str(num_envs), "--greedy", "--threads", str(threads), "--out", out], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(out[:-1]))  # the summary .json beside the .jsonl


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="policy directory (01 or 05 output)")
    p.add_argument("--episodes", type=int, default=96, help="tasks of the split to run")
    p.add_argument("--batch", type=int, default=32, help="environments in lockstep for the batched run")
    p.add_argument("--split", default="seen", help="task split")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads of each run (0: torch's default)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        one = collect(args.policy, args.episodes, 1, d, args.split, args.threads)
        many = collect(args.policy, args.episodes, args.batch, d, args.split, args.threads)
    for name, s in (("one at a time", one), (f"{args.batch} in lockstep", many)):
        print(f"{name:>16}: {s['episodes_per_s']:.2f} episodes/s, {s['wall_s']:.1f}s, success {s['success_rate']:.1%}, "
              f"{s['env_steps']} env steps, {s['generated_tokens']} generated tokens, {s['cpu_s']:.1f} CPU s")
    print(f"speed-up: {many['episodes_per_s'] / one['episodes_per_s']:.1f}x in episodes/s, "
          f"{one['cpu_s'] / many['cpu_s']:.1f}x in CPU seconds")


if __name__ == "__main__":
    main()
