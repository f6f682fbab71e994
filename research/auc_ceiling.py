"""How high can the AUC of V(s_0) go? 04_gae.py reports how well the critic's V(s_0) separates
successful from failed episodes (the project's target: AUC >= 0.75). V(s_0) sees only the task, so
no function of s_0 can beat the policy's own success probability on that task, p(task): the
rest of an episode's outcome is the luck of its sampled replies. This measures that ceiling.

It samples every task of a split N times with the policy (02_collect.py, --seed 1..N), estimates
p(task) for each episode from the task's *other* N - 1 episodes (leave one out, so an episode
does not predict itself), and prints the AUC of that estimate for success vs failure. With
--critic it also runs 04_gae.py over the same episodes and prints the AUC of the critic's
V(s_0) next to it (V(s_0) is the same for every sample of a task: the prompt is the same).

    python research/auc_ceiling.py --policy runs/seed0/policy_0 --critic runs/seed0/iter_1/critic \\
        --out-dir runs/seed0/auc_ceiling

Collections already in --out-dir are reused (the script resumes).
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench._stages import ROOT, load_stage  # noqa: E402


def leave_one_out_rates(episodes):
    """For each episode, the success rate of the other episodes of the same task (at least one)."""
    wins, count = collections.Counter(), collections.Counter()
    for e in episodes:
        wins[e["task_id"]] += int(e["success"])
        count[e["task_id"]] += 1
    return [(wins[e["task_id"]] - int(e["success"])) / (count[e["task_id"]] - 1) for e in episodes]


def task_kind(task):
    """'put a clean mug in shelf 1.' -> 'clean'; ALFWorld's six types for household tasks."""
    for prefix, kind in (("put two ", "two"), ("look at ", "look"), ("put a clean ", "clean"),
                         ("put a hot ", "heat"), ("put a cool ", "cool"), ("put a ", "place")):
        if task.startswith(prefix):
            return kind
    return "other"


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="policy directory (01_bc.py / 05_bppo.py output)")
    p.add_argument("--critic", default="", help="critic directory (03_critic.py output) to compare")
    p.add_argument("--out-dir", required=True, help="where the sampled episodes go")
    p.add_argument("--split", default="seen", help="task split; every task of it is sampled")
    p.add_argument("--samples", type=int, default=8, help="episodes per task (N >= 2)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (run_all.sh: 1.0)")
    p.add_argument("--env-kwargs", default="{}", help="JSON environment keyword arguments")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    args = p.parse_args()
    auc = load_stage("04_gae").auc  # the AUC 04_gae.py prints
    # the stages run from the repository root; paths given relative to here must still work
    args.policy, args.out_dir = os.path.abspath(args.policy), os.path.abspath(args.out_dir)
    args.critic = os.path.abspath(args.critic) if args.critic else ""
    if args.samples < 2:
        p.error("--samples must be at least 2")
    os.makedirs(args.out_dir, exist_ok=True)

    files = []
    for s in range(1, args.samples + 1):
        out = os.path.join(args.out_dir, f"sample_{s}.jsonl")
        if not os.path.exists(out):
            run([sys.executable, "02_collect.py", "--policy", args.policy, "--split", args.split,
                 "--env-kwargs", args.env_kwargs, "--seed", str(s), "--temperature", str(args.temperature),
                 "--threads", str(args.threads), "--out", out])
        files.append(out)
    episodes = [e for f in files for e in read(f)]
    success = [bool(e["success"]) for e in episodes]
    rates = leave_one_out_rates(episodes)

    per_task = collections.defaultdict(list)
    for e in episodes:
        per_task[e["task_id"]].append(bool(e["success"]))
    always = sum(all(v) for v in per_task.values())
    never = sum(not any(v) for v in per_task.values())
    print(f"\n{len(per_task)} tasks of '{args.split}' x {args.samples} samples at temperature {args.temperature}: "
          f"{len(episodes)} episodes, success {sum(success) / len(episodes):.1%}")
    print(f"tasks always solved {always}, never solved {never}, sometimes {len(per_task) - always - never}")
    print(f"ceiling - AUC of p(task) (leave one out) for success vs failure: {auc(rates, success):.3f}")

    # The part of p(task) that the task type alone explains (household task sentences).
    kind = [task_kind(e["task"]) for e in episodes]
    kinds = collections.defaultdict(list)
    for k, y in zip(kind, success):
        kinds[k].append(y)
    print("success by task type: " + ", ".join(f"{k} {sum(v) / len(v):.0%} (n={len(v)})" for k, v in sorted(kinds.items())))
    print(f"AUC of the task type's success rate for success vs failure: "
          f"{auc([sum(kinds[k]) / len(kinds[k]) for k in kind], success):.3f}")

    if args.critic:
        v_path = os.path.join(args.out_dir, "v.jsonl")
        if not os.path.exists(v_path):
            run([sys.executable, "04_gae.py", "--data", *files, "--critic", args.critic,
                 "--threads", str(args.threads), "--out", v_path])
        scored = read(v_path)
        v0 = [e["steps"][0]["v"] for e in scored]
        print(f"critic - AUC of V(s_0) for success vs failure on the same episodes: "
              f"{auc(v0, [bool(e['success']) for e in scored]):.3f}  ({args.critic})")
        print(f"critic - V(s_0) mean {statistics.mean(v0):.3f}, std {statistics.pstdev(v0):.3f}; by task type: "
              + ", ".join(f"{k} {statistics.mean(v for v, kk in zip(v0, kind) if kk == k):.3f}" for k in sorted(kinds)))
        task_v = {e["task_id"]: e["steps"][0]["v"] for e in scored}
        ids = sorted(per_task)
        rate = {t: sum(per_task[t]) / len(per_task[t]) for t in ids}
        # Does V(s_0) rank the tasks like their success rates do? (pairs of tasks with different rates)
        pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:] if rate[a] != rate[b]]
        agree = sum((task_v[a] - task_v[b]) * (rate[a] - rate[b]) > 0 for a, b in pairs)
        print(f"critic - task pairs with different success rates ordered the same way by V(s_0): "
              f"{agree}/{len(pairs)} ({agree / max(len(pairs), 1):.1%}; 50% is chance)")


if __name__ == "__main__":
    main()
