"""Would greedy decoding reproduce the expert? For each expert trajectory of a split, feed the
expert's own history to the policy (teacher forcing) and check, turn by turn, that the argmax
token equals the expert's token at every position of the reply (Thought, Action and the
end-of-turn token). A turn where that holds is exactly a turn in which greedy decoding would
write the expert's reply. An episode in which it holds at every turn is one the greedy policy
solves along the expert's path; since the household expert never errs and the BC policy
almost never recovers from a mistake (research/failure_modes.py), this fraction should track the
greedy success rate of 02_collect.py - at the cost of one forward pass per episode instead of
a generation per step, and without the noise of sampling.

    python 02_collect.py --policy expert --split seen --out /tmp/expert_seen.jsonl
    python research/expert_path.py --policy runs/seed0/policy_0 --data /tmp/expert_seen.jsonl
    python research/expert_path.py --policy runs/seed0/policy_0 --data /tmp/expert_seen.jsonl --by-verb

--by-verb adds, per verb of the expert's action (go, open, take, ...), how many of its turns
greedy decoding reproduces: where the policy departs from the expert.

To compare policy updates without touching the evaluation splits, score them on training
tasks that none of their data came from (--exclude drops the tasks of the given files):

    python 02_collect.py --policy expert --split train --out /tmp/expert_train.jsonl
    python research/expert_path.py --policy runs/seed0/policy_1 --data /tmp/expert_train.jsonl \
        --exclude runs/seed0/data/expert.jsonl runs/seed0/iter_1/self.jsonl
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench._stages import load_stage  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="policy directory (01_bc.py / 05_bppo.py output)")
    p.add_argument("--data", required=True, help="expert episode JSONL (02_collect.py --policy expert)")
    p.add_argument("--exclude", nargs="*", default=[], help="drop tasks that occur in these episode files")
    p.add_argument("--by-verb", action="store_true",
                   help="also print the share of turns reproduced per verb of the expert's action")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    bc = load_stage("01_bc")
    torch.set_num_threads(args.threads)
    tokenizer = bc.load_tokenizer(args.policy)
    model = bc.AutoModelForCausalLM.from_pretrained(args.policy).eval()
    episodes = bc.read_episodes([args.data])
    if args.exclude:
        used = {ep["task_id"] for ep in bc.read_episodes(args.exclude)}
        episodes = [ep for ep in episodes if ep["task_id"] not in used]
    data = [bc.tokenize_episode(tokenizer, ep) for ep in episodes]
    hits = turn_hits(bc, model, data, tokenizer.pad_token_id, args.batch_size)
    turns, reproduced = sum(len(h) for h in hits), sum(sum(h) for h in hits)
    print(f"{args.policy} on {args.data}: expert turns reproduced {reproduced / turns:.1%}, "
          f"whole episodes {sum(all(h) for h in hits) / len(hits):.1%} of {len(hits)}")
    if args.by_verb:
        for verb, (hit, n) in sorted(by_verb(episodes, hits).items()):
            print(f"  {verb:8s} {hit:5d} / {n:5d} turns reproduced ({hit / n:.1%})")


def turn_hits(bc, model, data, pad_id, batch_size):
    """Per episode, per turn: would greedy decoding write the expert's reply? The check
    01_bc.py prints on its validation split each epoch (reply_matches), one forward per batch."""
    hits = []
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            batch = bc.collate(data[i:i + batch_size], pad_id)
            ok = bc.reply_matches(bc.reply_logits(model, batch), batch)
            n = batch["step_mask"].sum(1).long()
            hits += [ok[row, :n[row]].tolist() for row in range(len(n))]
    return hits


def by_verb(episodes, hits):
    """{verb of the expert's action: [turns reproduced, turns]}."""
    counts = {}
    for ep, ep_hits in zip(episodes, hits):
        for step, hit in zip(ep["steps"], ep_hits, strict=True):
            c = counts.setdefault(step["action"].split(" ")[0] or "(none)", [0, 0])
            c[0] += int(hit)
            c[1] += 1
    return counts

if __name__ == "__main__":
    sys.exit(main())
