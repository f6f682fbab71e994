"""Training in less memory, the same math: 01/05's log-probabilities and 05's KL to pi_ref in chunks of rows
(plumbing.by_rows, checkpointed), and transformers' gradient checkpointing (--grad-checkpointing), against
the plain computation on the full logits of the tiny policy: the same loss and gradients to 1e-5.
bench/speed/train_memory.py measures what they save on SmolLM2."""
import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import machine
import plumbing


@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_chunked_logprobs_and_kl_give_the_plain_loss_and_gradients(stages, tiny_run, monkeypatch, checkpointing):
    pp = stages["05_bppo"]
    tok = plumbing.load_tokenizer(str(tiny_run / "policy_0"))
    episodes = [json.loads(line) for line in open(tiny_run / "expert.jsonl")][:3]
    for i, ep in enumerate(episodes):
        ep["steps"] = [dict(s, adv=(-1.0) ** (i + t)) for t, s in enumerate(ep["steps"])]
    b = pp.make_batch([(ep, pp.tokenize_episode(tok, ep)) for ep in episodes], tok.pad_token_id, "cpu")
    args = pp.parse_args(["--data", "d", "--policy", "p", "--ref", "r", "--out", "o", "--kl-coef", "0.5"])
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_run / "policy_0", local_files_only=True)  # noqa: E731
    ref = load().eval()
    with torch.no_grad():  # pi_ref != pi_theta: a KL that is not zero
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    targets = b["input_ids"][b["action_step"] >= 0]
    logp_old = None

    def run(chunked):
        nonlocal logp_old
        model = load().train()
        if chunked:  # 05's path: reply_logits, token_logprobs and the KL in chunks of 7 rows, checkpointing
            monkeypatch.setattr(plumbing, "CHUNK_ROWS", 7)
            machine.grad_checkpointing(model, argparse.Namespace(grad_checkpointing=checkpointing))
            assert model.is_activation_checkpointing == (checkpointing == "on")
            logits = pp.reply_logits(model, b)
            with torch.no_grad():
                ref_logits = pp.reply_logits(ref, b)
            assert len(logits) > 3 * plumbing.CHUNK_ROWS  # several chunks
            if logp_old is None:
                logp_old = pp.token_logprobs(logits, targets).detach() - 0.1
            loss, _ = pp.policy_loss(logits, ref_logits, b, logp_old, args)
        else:  # by hand: the full (B, L, V) logits, rows that predict a reply token, one fp32 log-softmax
            at = lambda m: m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1][  # noqa
                b["action_step"][:, 1:] >= 0]
            logq = torch.log_softmax(at(model).float(), -1)
            with torch.no_grad():
                logr = torch.log_softmax(at(ref).float(), -1)
            logp = logq.gather(-1, targets[:, None]).squeeze(-1)
            kl = (logq.exp() * (logq - logr)).sum(-1).mean()
            loss = pp.bppo_loss(logp, logp_old, b["adv"], torch.ones_like(logp), args.eps_low, args.eps_high,
                                args.dual_clip) + args.kl_coef * kl
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_chunked, grads_chunked = run(True)
    loss_plain, grads_plain = run(False)
    assert torch.allclose(loss_chunked, loss_plain, atol=1e-5, rtol=0), (loss_chunked, loss_plain)
    for g1, g2 in zip(grads_chunked, grads_plain):
        assert torch.allclose(g1, g2, atol=1e-5, rtol=1e-4)


def test_by_rows_is_the_whole_computation(monkeypatch):
    """Row chunks: the concatenation, or (mean=True) the row-weighted mean of the chunks' means, and gradients."""
    monkeypatch.setattr(plumbing, "CHUNK_ROWS", 4)
    x = torch.randn(10, 6, requires_grad=True)
    y = torch.randint(0, 6, (10,))
    logp = lambda a, t: torch.log_softmax(a, -1).gather(-1, t[:, None]).squeeze(-1)  # noqa: E731
    assert torch.allclose(plumbing.by_rows(logp, x, y), logp(x, y), atol=1e-6)
    mean = plumbing.by_rows(lambda a: (a.exp() * a).sum(-1).mean(), x, mean=True)
    assert torch.allclose(mean, (x.exp() * x).sum(-1).mean(), atol=1e-6)
    mean.backward()
    want = torch.autograd.grad((x.exp() * x).sum(-1).mean(), x)[0]
    assert torch.allclose(x.grad, want, atol=1e-6)


def test_grad_checkpointing_auto_is_on_for_a_real_model_only(tiny_run):
    """auto: the tiny policy (well under 20M parameters) trains as before; 'on' turns it on for any model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_run / "policy_0", local_files_only=True)
    machine.grad_checkpointing(model, argparse.Namespace(grad_checkpointing="auto"))
    assert not model.is_activation_checkpointing
    machine.grad_checkpointing(model, argparse.Namespace(grad_checkpointing="on"))
    assert model.is_activation_checkpointing


def test_bc_trains_in_train_mode(stages, tiny_run, tmp_path):
    """from_pretrained returns a model in eval mode, where transformers skips gradient checkpointing: 01's
    model must come out of prepare_bc in train mode (it did not, and one SmolLM2 step took 19 GiB)."""
    bc = stages["01_bc"]
    args = bc.parse_args(["--data", str(tiny_run / "expert.jsonl"), "--out", str(tmp_path / "p"),
                          "--model", str(tiny_run / "policy_0"), "--grad-checkpointing", "on"])
    model = bc.prepare_bc(args, torch.device("cpu"))[1]
    assert model.is_activation_checkpointing and all(m.training for m in model.modules())


def test_critic_trains_in_train_mode(stages, tiny_run, tmp_path):
    """The same for 03: the critic's backbone comes from from_pretrained, and must train in train mode."""
    cr = stages["03_critic"]
    args = cr.parse_args(["--data", str(tiny_run / "expert.jsonl"), "--policy", str(tiny_run / "policy_0"),
                          "--out", str(tmp_path / "c"), "--grad-checkpointing", "on"])
    critic = cr.prepare_critic(args, torch.device("cpu"))[1]
    assert critic.backbone.is_activation_checkpointing and all(m.training for m in critic.modules())
