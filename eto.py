"""Baseline - ETO in miniature: exploration-based trajectory optimization (Song et al., 2024, "Trial and Error:
Exploration-Based Trajectory Optimization for LLM Agents"), one of the paper's three baselines.

Reads   --data: the buffer, episode JSONL files (02): the demonstrations and pi_{k-1}'s own episodes on train tasks
        (its exploration); --policy: pi_{k-1} (the starting weights); --ref: pi_ref = pi_0 (01_bc.py).
Writes  --out DIR: pi_k (save_pretrained) and DIR/args.json; one line per epoch to --metrics.

Each iteration of ETO: the agent explores on train tasks (02, as for every method); each of its failures is paired
with a success on the same task - the demonstration where there is one, else an own success - and the policy is
updated by DPO (Rafailov et al., 2023) on the trajectory pairs, the log-likelihood of a trajectory being the sum over
its reply tokens only (observations are read, never scored):

    L_DPO = - E_{(tau_w, tau_l)} log sigma( beta [ log pi/pi_ref (tau_w) - log pi/pi_ref (tau_l) ] )      (ETO eq. 5)

No critic, no step credit: the whole winning trajectory is pushed up and the whole losing one down, each of its
steps alike. A buffer without a pair (every own failure on a task nobody won) keeps the policy as it is.

    python eto.py --data runs/demo/data/expert.jsonl runs/demo/iter_1/self.jsonl --policy runs/demo/policy_0 \
        --ref runs/demo/policy_0 --out runs/demo/eto/policy_1
"""
import importlib
import math
import random

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from distributed import average_info, distribute, parts
from machine import Progress, add_lora, add_machine_flags, autocast, grad_checkpointing, save_trained, start
from plumbing import (check_flags, finite, fit_context, load_model, load_tokenizer, read_episodes, same_tokenizer,
                      save_policy, stage_parser)

bppo = importlib.import_module("05_bppo")  # the reply tokens as 05 reads them: tokenize_episode, collate, reply_logits


def parse_args(argv=None):
    p, a, d, m = stage_parser("Baseline ETO: DPO on (success, failure) trajectory pairs of the same task.")
    d.add_argument("--data", nargs="+", required=True, help="episode JSONL files: demonstrations + own episodes")
    d.add_argument("--policy", required=True, help="pi_{k-1}: the policy that explored (also the starting weights)")
    d.add_argument("--ref", required=True, help="pi_ref: the behavior-cloning policy of DPO's log-ratios")
    d.add_argument("--out", required=True, help="output policy directory")
    a.add_argument("--beta", type=float, default=0.1, help="DPO's beta: how far the log-ratios may move")
    a.add_argument("--epochs", type=int, default=3, help="passes over the pairs")
    a.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    a.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    a.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    a.add_argument("--seed", type=int, default=0, help="random seed")
    add_machine_flags(m, training=True, lora=True)  # --threads, --precision, --grad-accum, --fsdp, --lora
    d.add_argument("--metrics", default="", help="append per-epoch metrics to this JSONL file")
    return check_flags(p.parse_args(argv), beta="positive", epochs="at least 1", batch_size="at least 1",
                       lr="in (0, 1]", grad_clip="positive", grad_accum="at least 1", seed="a seed in [0, 2**32)",
                       threads="non-negative", lora="non-negative")


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: the pairs, a trajectory's log-likelihood, and the DPO loss.
# ----------------------------------------------------------------------------------------
def make_pairs(episodes):
    """ETO's contrastive pairs: every failed own episode with a success on its task (the demonstration first, else
    the first own success) -> [(winner, loser)]. A failure whose task has no success in the buffer has no pair."""
    winner = {}
    for ep in sorted(episodes, key=lambda ep: ep["source"] != "expert"):  # demonstrations first
        if ep["success"]:
            winner.setdefault(ep["task_id"], ep)
    return [(winner[ep["task_id"]], ep) for ep in episodes
            if ep["source"] == "self" and not ep["success"] and ep["task_id"] in winner]


def dpo_loss(logp_w, logp_l, ref_w, ref_l, beta):
    """ETO eq. 5 (DPO): -mean log sigmoid(beta ((logp_w - ref_w) - (logp_l - ref_l))) over pairs (P,) -> (loss, info):
    the loss, the share of pairs the policy already ranks right (a margin above 0), the mean margin."""
    margin = (logp_w - ref_w) - (logp_l - ref_l)
    loss = -F.logsigmoid(beta * margin).mean()
    return loss, {"loss": loss.item(), "accuracy": (margin > 0).float().mean().item(), "margin": margin.mean().item()}


def trajectory_logprobs(model, batch):
    """log pi(tau) = the sum of log pi(y | prefix) over each row's reply tokens -> (B,)."""
    reply = batch["action_step"] >= 0  # (B, L)
    logp = bppo.token_logprobs(bppo.reply_logits(model, batch), batch["input_ids"][reply])  # (N,) row by row
    return torch.zeros(len(reply), device=logp.device).index_add(0, reply.nonzero()[:, 0], logp)


def prepare_eto(args, device, amp):
    """--data, --policy, --ref -> (tokenizer, pi_theta, the pairs that fit the context, batch_of(pair indices): the
    winners' rows then the losers', log pi_ref(tau) of every pair (2, P): winners and losers)."""
    pairs = make_pairs(read_episodes(args.data))
    tokenizer = load_tokenizer(args.policy)
    same_tokenizer(tokenizer, load_tokenizer(args.ref), f"--ref {args.ref}", args.policy, "DPO's log-ratios compare "
                   "their log-probabilities of the same tokens, so both must share one (pass the BC policy)")
    policy = add_lora(grad_checkpointing(load_model(AutoModelForCausalLM, args.policy), args), args.lora).to(device)
    ref = load_model(AutoModelForCausalLM, args.ref).to(device).eval().requires_grad_(False)  # checked with or without
    if not pairs:  # every own failure is on a task nobody won: nothing to contrast
        print(f"eto: no pair (no failed own episode in --data has a success on its task): the policy is written "
              f"unchanged to {args.out}")
        return tokenizer, policy, [], None, None
    tokens = {id(ep): x for ep, x in fit_context([(ep, bppo.tokenize_episode(tokenizer, ep))
                                                  for pair in pairs for ep in pair], policy.config)}
    pairs = [(w, lo) for w, lo in pairs if id(w) in tokens and id(lo) in tokens]  # both fit the context
    print(f"eto: {len(pairs)} pairs ({sum(w['source'] == 'expert' for w, _ in pairs)} with a demonstration as the "
          f"winner), beta {args.beta}, lr {args.lr}")
    batch_of = lambda ids: {k: v.to(device) for k, v in bppo.collate(  # rows: the winners, then the losers
        [tokens[id(pairs[j][w])] for w in (0, 1) for j in ids], tokenizer.pad_token_id).items()}
    with torch.no_grad(), autocast(device, amp):  # log pi_ref(tau) of every pair, once: (P,) winners and losers
        ref_lp = torch.cat([trajectory_logprobs(ref, batch_of(range(i, min(i + args.batch_size, len(pairs)))))
                            .view(2, -1) for i in range(0, len(pairs), args.batch_size)], dim=1)
    return tokenizer, policy, pairs, batch_of, ref_lp


def main(argv=None):
    args = parse_args(argv)
    world, device, amp = start(args, "policy", args.data + [args.policy, args.ref])
    tokenizer, policy, pairs, batch_of, ref_lp = prepare_eto(args, device, amp)
    if not pairs:  # nothing to contrast: pi_k = pi_{k-1}
        return save_trained(policy, args, "the policy",
                            lambda state: save_policy(args.out, policy, tokenizer, args, "eto", state), [])
    train_policy = distribute(policy, world, args.fsdp)  # torchrun: DDP or FSDP2; alone: the policy itself
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    rng, records = random.Random(args.seed), []
    log = Progress("eto", args.epochs * math.ceil(len(pairs) / args.batch_size), device)

    def batch_loss(ids):  # forward -> loss, on pairs `ids`
        b = batch_of(ids)
        with autocast(device, amp):
            logp = trajectory_logprobs(train_policy, b).view(2, -1)  # (2, P): winners, losers
        loss, info = dpo_loss(logp[0], logp[1], ref_lp[0, ids], ref_lp[1, ids], args.beta)
        return loss, info, int(b["attention_mask"].sum())

    for epoch in range(args.epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for i in range(0, len(order), args.batch_size):
            idx = order[i:i + args.batch_size]
            infos = []  # each micro-batch: (info, share, tokens)
            for ids, share in parts(idx, [1] * len(pairs), train_policy, args):  # this process's micro-batches
                loss, info, n = batch_loss(ids)  # forward -> loss
                (finite(loss, log.step) * share).backward()  # backward; share: its count / the step's count
                infos.append((info, share, n))
            info, n_tokens = average_info(infos)  # torchrun: over every process, the one-process numbers
            torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.update(info, n_tokens, loss=f"{info['loss']:.4f}", acc=f"{info['accuracy']:.2f}")
        records.append(r := {"stage": "eto", "out": args.out, "epoch": epoch + 1, "step": log.step,
                             "elapsed_s": log.elapsed(), **log.mean(), **log.cost()})
        tqdm.write(f"epoch {epoch + 1}: DPO loss {r['loss']:.4f}  pairs ranked right {r['accuracy']:.1%}  "
                   f"mean margin {r['margin']:+.3f}")
    log.bar.close()

    def save(state):
        save_policy(args.out, policy, tokenizer, args, "eto", state)
        print(f"eto: wrote {args.out} ({log.elapsed():.0f}s)")
    save_trained(policy, args, "the updated policy", save, records)


if __name__ == "__main__":
    main()
