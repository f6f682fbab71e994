"""Where the expert's and the policy's advantages can be compared: at the same history.

A state here is the whole history (docs/design.md, 'The chat layout'), so an expert episode and a self episode
share states only while the policy, on the same task, has repeated the expert's actions turn
for turn. Everywhere else a critic that is right about the expert's own states gives the
expert's steps an advantage of about 0 (a policy's advantage averages to 0 under that policy),
which is what 04_gae.py's "mean advantage by source" shows. At the shared histories the
question "is the expert's action better than the policy's?" has an answer; this prints, for
a 04_gae.py output (expert + self episodes, "adv" on every step):

    expert step          mean advantage of the expert's action at each shared history
    self, same action    the policy's step where it did what the expert did
    self, other action   the policy's step where it first did something else (then the
                         histories part, and the comparison ends)

    python research/shared_histories.py runs/seed0/iter_1/adv.jsonl runs/seed1/iter_1/adv.jsonl
"""
import argparse
import json
import statistics


def shared_history_advantages(episodes):
    """-> (expert, same, other): lists of advantages at histories an expert episode and a self
    episode of the same task both reached (one expert episode per task, the first)."""
    expert = {}
    for ep in episodes:
        if ep["source"] == "expert":
            expert.setdefault(ep["task_id"], ep)
    ex, same, other = [], [], []
    for ep in episodes:
        if ep["source"] == "expert" or ep["task_id"] not in expert:
            continue
        for step, xstep in zip(ep["steps"], expert[ep["task_id"]]["steps"]):
            ex.append(xstep["adv"])
            if step["action"] != xstep["action"]:
                other.append(step["adv"])
                break
            same.append(step["adv"])
    return ex, same, other


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="04_gae.py outputs (expert + self episodes with 'adv')")
    args = p.parse_args()
    print("| file | self episodes on an expert's task | expert step | self, same action | self, other action |")
    print("|---|---|---|---|---|")
    for path in args.files:
        with open(path) as f:
            episodes = [json.loads(line) for line in f if line.strip()]
        ex, same, other = shared_history_advantages(episodes)
        tasks = {ep["task_id"] for ep in episodes if ep["source"] == "expert"}
        n = sum(ep["source"] != "expert" and ep["task_id"] in tasks for ep in episodes)
        cell = lambda xs: f"{statistics.fmean(xs):+.3f} (n={len(xs)})" if xs else "-"
        print(f"| {path} | {n} | {cell(ex)} | {cell(same)} | {cell(other)} |")


if __name__ == "__main__":
    main()
