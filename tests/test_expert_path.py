"""research/expert_path.py: which expert turns greedy decoding reproduces, overall and per verb."""
import collections
import types

import torch

from conftest import load_module, load_stage

expert_path = load_module("research/expert_path.py", "expert_path")


class NextToken(torch.nn.Module):
    """A stand-in model whose argmax is the next input token (perfect teacher forcing), or,
    with wrong=True, never is."""

    def __init__(self, vocab, wrong=False):
        super().__init__()
        self.vocab, self.wrong = vocab, wrong

    def forward(self, input_ids, attention_mask, logits_to_keep):
        nxt = torch.roll(input_ids, -1, dims=1)
        if self.wrong:
            nxt = (nxt + 1) % self.vocab
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float()
        return types.SimpleNamespace(logits=logits[logits_to_keep])  # (N, V), as transformers' boolean mask keeps


def test_by_verb_counts_every_turn_once_in_any_batch_size(tiny_run):
    bc = load_stage("01_bc")
    tokenizer = bc.load_tokenizer(tiny_run / "policy_0")
    episodes = bc.read_episodes([tiny_run / "expert.jsonl"])
    data = [bc.tokenize_episode(tokenizer, ep) for ep in episodes]
    verbs = collections.Counter(s["action"].split(" ")[0] for ep in episodes for s in ep["steps"])
    vocab, pad = len(tokenizer), tokenizer.pad_token_id

    def hits(model, batch_size):
        return expert_path.turn_hits(bc, model, data, pad, batch_size)

    perfect = expert_path.by_verb(episodes, hits(NextToken(vocab), 7))
    assert perfect == {v: [n, n] for v, n in verbs.items()}
    assert hits(NextToken(vocab), 1) == hits(NextToken(vocab), 7)
    assert expert_path.by_verb(episodes, hits(NextToken(vocab, wrong=True), 7)) == {v: [0, n] for v, n in verbs.items()}
