"""The habit decision as a probability, not a greedy coin: at every state of an episode file
where the agent has just arrived at a closed receptacle X, the teacher-forced probabilities
each policy gives the two replies 'Action: open X' and 'Action: examine X' (the whole reply,
its end-of-turn token included). Prints, per policy, over the same states:

    P(open)            mean of p(open) / (p(open) + p(examine))
    open > examine     fraction of states where open is the likelier of the two (what greedy
                       decoding follows, as long as no third reply is likelier still)

Far less noisy than greedy success on 100 episodes: every policy is scored on the same states,
so a small shift of the decision shows even where it does not yet flip greedy replies
(docs/policy_improvement.md).

    python research/habit_prob.py --states runs/nd_s0/eval/policy_0_dev.jsonl \
        --policies runs/nd_s0/policy_0 runs/nd_s0/policy_1
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._stages import load_stage  # noqa: E402
from research.habit_rate import closed_arrival_steps  # noqa: E402

bppo = load_stage("05_bppo")


def reply_logprob(model, tokenizer, prefixes, texts, batch_size=32):
    """log pi(text | prefix) of the whole reply, one per (prefix, text) pair."""
    out = []
    for i in range(0, len(prefixes), batch_size):
        eps = [{**p, "steps": p["steps"] + [{"text": x, "obs": ""}]}
               for p, x in zip(prefixes[i:i + batch_size], texts[i:i + batch_size])]
        tok = [bppo.tokenize_episode(tokenizer, ep) for ep in eps]
        batch = bppo.collate(tok, tokenizer.pad_token_id)
        with torch.no_grad():
            logp = bppo.token_logprobs(bppo.reply_logits(model, batch), batch["input_ids"][batch["action_step"] >= 0])
        last = torch.tensor([len(ep["steps"]) - 1 for ep in eps])  # the candidate reply's step
        rows = (batch["action_step"] >= 0).nonzero()[:, 0]
        is_last = batch["action_step"][batch["action_step"] >= 0] == last[rows]
        out += torch.zeros(len(eps)).index_add_(0, rows[is_last], logp[is_last]).tolist()
    return torch.tensor(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", required=True, help="episode JSONL whose closed-arrival states are scored")
    p.add_argument("--policies", nargs="+", required=True, help="policy directories")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with open(args.states) as f:
        episodes = [json.loads(line) for line in f if line.strip()]
    # (the episode up to the decision, receptacle X) at every closed arrival
    states = [({**ep, "steps": ep["steps"][:t]}, x) for ep in episodes for t, x in closed_arrival_steps(ep)]
    prefixes = [s for s, _ in states]
    print(f"{len(states)} closed-arrival states from {args.states}\n")
    print("| policy | P(open) | open > examine |")
    print("|---|---|---|")
    for path in args.policies:
        tokenizer = bppo.load_tokenizer(path)
        model = bppo.load_pretrained(bppo.AutoModelForCausalLM, path, torch.float32).eval()
        lo = reply_logprob(model, tokenizer, prefixes, [f"Action: open {x}" for _, x in states])
        le = reply_logprob(model, tokenizer, prefixes, [f"Action: examine {x}" for _, x in states])
        p_open = torch.sigmoid(lo - le)  # p(open) / (p(open) + p(examine))
        print(f"| {path} | {p_open.mean():.3f} | {(lo > le).float().mean():.2f} |")


if __name__ == "__main__":
    main()
