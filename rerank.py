"""Q-guided generation, 02_collect.py --rerank CRITIC_DIR --candidates M: an extension (QLASS-style,
the paper's "w/o policy improvement" row - the critic of 03 steers an unchanged policy).

Each environment samples M candidate replies; the critic scores each with Q(s_t, a), read where 03 and
04 read it (04_gae.py's load_critic, tokenize_episode and collate, imported from that file); the environment
executes the argmax. Only executed replies step the environment, but generated_tokens counts every
candidate's. At the next turn every row of an environment continues from the chosen reply (the KV
cache's Session.sync drops the rest).

    python 02_collect.py --policy runs/demo/policy_0 --rerank runs/demo/iter_1/critic --candidates 4 \
        --split seen --out runs/demo/eval/policy_0_rerank_seen.jsonl
"""
import importlib

import torch

from machine import autocast, pick_device
from plumbing import check_flags, die

gae = importlib.import_module("04_gae")  # the critic as 04 reads it: load_critic, tokenize_episode, collate


def add_rerank_flags(p):
    p.add_argument("--rerank", metavar="CRITIC_DIR",
                   help="Q-guided generation: a critic directory from 03_critic.py scores --candidates sampled "
                        "replies per step and the argmax-Q reply is executed (not with --greedy or --policy expert)")
    p.add_argument("--candidates", type=int, default=4,
                   help="with --rerank: candidate replies sampled per environment and step (M >= 1)")
    p.add_argument("--critic-batch-size", type=int, default=32,
                   help="with --rerank: candidates per critic forward pass")


def check_rerank(args):
    """The flags above, before any work: one error line for what cannot run."""
    check_flags(args, candidates="at least 1", critic_batch_size="at least 1")
    if args.rerank == "":
        die("--rerank needs a critic directory (03_critic.py's --out), got an empty one")
    if args.rerank and args.policy == "expert":
        die("--rerank needs a policy directory to sample candidates from, not --policy expert")
    if args.rerank and args.greedy:
        die("--rerank samples its candidates at --temperature; drop --greedy (lower --temperature instead)")


def pick_candidates(q, m):
    """q: Q(s_t, a) of every candidate, m per environment in order -> for each environment the
    index 0..m-1 of its argmax-Q candidate; a tie goes to the lowest index (torch.argmax)."""
    return torch.as_tensor(q, dtype=torch.float).view(-1, m).argmax(dim=1).tolist()


class Reranker:
    """The critic of 03 scoring candidate replies with Q(s_t, a) (QLASS-style selection)."""

    def __init__(self, path, args):
        self.device, self.amp = pick_device(args.precision)
        self.critic, self.tokenizer = gae.load_critic(path, self.device)  # in eval mode
        self.m, self.batch_size = args.candidates, args.critic_batch_size

    def q_values(self, episodes, texts):
        """Q of reply texts[k] as the next step of episodes[k] (score). A peaked policy samples the same reply
        many times: each distinct (episode, reply) is scored once."""
        first = {}
        for k, key in enumerate(zip(map(id, episodes), texts)):
            first.setdefault(key, k)
        q = dict(zip(first, self.score([episodes[k] for k in first.values()], [texts[k] for k in first.values()])))
        return [q[key] for key in zip(map(id, episodes), texts)]

    @torch.no_grad()
    def score(self, episodes, texts):
        """Q of reply texts[k] as the next step of episodes[k], at the last action position of the
        episode plus the candidate step. The candidate's observation is not known yet and is left
        empty: in a causal model Q at the action position comes before it and cannot depend on it."""
        q = []
        for i in range(0, len(texts), self.batch_size):
            xs = [gae.tokenize_episode(self.tokenizer, dict(ep, steps=ep["steps"] + [{"text": text, "obs": ""}]))
                  for ep, text in zip(episodes[i:i + self.batch_size], texts[i:i + self.batch_size])]
            batch = {k: v.to(self.device) for k, v in gae.collate(xs, self.tokenizer.pad_token_id).items()}
            with autocast(self.device, self.amp):
                _, _, q_all = self.critic(batch)                   # (B, T): Q at every action
            last = torch.tensor([len(x["action_pos"]) - 1 for x in xs], device=self.device)
            q += q_all[torch.arange(len(xs), device=self.device), last].tolist()
        return q

    def choose(self, episodes, texts):
        """The reply each environment executes: of its m candidates in a row (texts, each the next step of its
        episode in episodes), the argmax-Q one (q_values, pick_candidates)."""
        q = self.q_values(episodes, texts)
        return [texts[k * self.m + j] for k, j in enumerate(pick_candidates(q, self.m))]
