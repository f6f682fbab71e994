"""How fast 02_collect.py collects, the same policy on the same tasks: one episode at a time, then --batch environments
in lockstep with the plain generation loop (--plain-generate) and with the KV cache kept across turns; wall and CPU s.

    python bench/speed/collect_speed.py --policy runs/default/policy_0 [--episodes 96] [--batch 32] [--threads 1]
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from bench.runner import must, parser, scratch  # noqa: E402
from plumbing import LIMITS, check_flags, die  # noqa: E402


def collect(args, num_envs, out, *flags):
    must([sys.executable, "02_collect.py", "--policy", args.policy, "--split", args.split, "--episodes",
          str(args.episodes), "--num-envs", str(num_envs), "--greedy", "--threads", str(args.threads), "--out", out,
          *flags])
    return json.load(open(out[:-1])), open(out).read()  # the summary .json beside the .jsonl, the episodes


def main():
    p = parser(__doc__)
    p.add_argument("--policy", required=True, help="policy directory (01 or 05 output)")
    p.add_argument("--episodes", type=int, default=96, help="tasks of the split to run")
    p.add_argument("--batch", type=int, default=32, help="environments in lockstep for the batched runs")
    p.add_argument("--split", default="seen", help="task split")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads of each run (0: torch's default)")
    args = check_flags(p.parse_args(), episodes="at least 1", batch="at least 1", threads="non-negative")
    if args.batch > LIMITS["num_envs"]:  # 02's --num-envs: refused here, not after the first collection
        die(f"--batch must be at most {LIMITS['num_envs']} (02's --num-envs), got {args.batch}")
    with scratch("collect_speed_") as d:
        runs = {"one at a time": collect(args, 1, f"{d}/one.jsonl"),
                f"{args.batch}, plain loop": collect(args, args.batch, f"{d}/plain.jsonl", "--plain-generate"),
                f"{args.batch}, cached": collect(args, args.batch, f"{d}/cached.jsonl")}
    for name, (s, _) in runs.items():
        print(f"{name:>16}: {s['episodes'] / s['wall_s']:.2f} episodes/s, {s['wall_s']:.1f}s, "
              f"success {s['success_rate']:.1%}, "
              f"{s['env_steps']} env steps, {s['generated_tokens']} generated tokens, {s['cpu_s']:.1f} CPU s")
    (one, _), (plain, plain_eps), (cached, cached_eps) = runs.values()
    print(f"cached vs one at a time: {one['cpu_s'] / cached['cpu_s']:.1f}x, cached vs plain loop: "
          f"{plain['cpu_s'] / cached['cpu_s']:.1f}x in CPU seconds; plain and cached wrote "
          f"{'the same' if plain_eps == cached_eps else 'different'} episodes")


if __name__ == "__main__":
    main()
