"""Stage 05 - behavior-proximal policy optimization (BPPO) on the same fixed buffer.

Reads   --data: the buffer with A_t on every step (04_gae.py); --policy: pi_old = pi_{k-1}, the policy
        entering this iteration (also the starting weights); --ref: pi_ref = pi_0 (01_bc.py).
Writes  --out DIR: the improved policy pi_k (save_pretrained) and DIR/args.json; one line per epoch to --metrics.

The objective (paper, Key Design 4), over the action tokens y of every step a_t in the buffer, each carrying
its step's process reward A_t from 04 (the update never leaves the data):

    eta = pi_theta(y) / pi_old(y)
    L_BPPO = - E[ min( eta * A_t, clip(eta, 1 - eps_low, 1 + eps_high) * A_t ) ]
    L = L_BPPO + alpha * KL(pi_theta || pi_ref)

- Asymmetric clipping, eps_low > eps_high: a bad action (A < 0) may lose more probability (down to
  1 - eps_low of pi_old) than a good one may gain (up to 1 + eps_high).
- Dual clip (--dual-clip c, Ye et al. 2020; not in the paper): for A < 0 the term is at least c * A (bppo_loss).
- The KL anchor is exact at every action token, from pi_ref's logits batch by batch: no sampling estimator (kl_to_ref).
- --adv-norm (not in the paper; chosen on `dev`, docs/design.md): A_t standardized over the buffer, or centred.
- --objective awr, the paper's weaker alternative (advantage-weighted regression), replaces L_BPPO by
  L_AWR = - E[ min(exp(A_t / beta), w_max) * log pi_theta(y) ], which can only raise the probability of data actions.

    python 05_bppo.py --data runs/demo/iter_1/adv.jsonl --policy runs/demo/policy_0 \
        --ref runs/demo/policy_0 --out runs/demo/policy_1
"""
import bisect
import math
import random

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from distributed import average_info, distribute, parts
from machine import Progress, add_lora, add_machine_flags, autocast, grad_checkpointing, save_trained, start
from plumbing import (STEP_KEYS, by_rows, check_flags, die, finite, fit_context, length_batches, load_model,
                      load_tokenizer, read_episodes, same_tokenizer, save_policy, stage_parser)


def parse_args(argv=None):
    p, a, d, m = stage_parser("Stage 05: BPPO policy improvement on the labeled buffer.")
    d.add_argument("--data", nargs="+", required=True, help="episode JSONL with 'adv' on every step (04 output)")
    d.add_argument("--policy", required=True, help="pi_old: the policy entering this stage (also the starting weights)")
    d.add_argument("--ref", required=True, help="pi_ref: the behavior-cloning policy anchoring the KL term")
    d.add_argument("--out", required=True, help="output policy directory")
    a.add_argument("--objective", choices=["bppo", "awr"], default="bppo", help="policy objective")
    a.add_argument("--adv-norm", choices=["none", "center", "standardize"], default="none",
                   help="A_t as 04 wrote it, minus the buffer's mean, or standardized over the buffer's steps")
    a.add_argument("--eps-low", type=float, default=0.8, help="lower clip: eta >= 1 - eps_low (suppresses bad actions)")
    a.add_argument("--eps-high", type=float, default=0.2, help="upper clip: eta <= 1 + eps_high (conservative gains)")
    a.add_argument("--dual-clip", type=float, default=3.0, help="c > 1: a token with A < 0 adds at least c * A; 0: off")
    a.add_argument("--kl-coef", type=float, default=0.05, help="alpha, weight of KL(pi_theta || pi_ref)")
    a.add_argument("--awr-beta", type=float, default=1.0, help="AWR temperature beta")
    a.add_argument("--awr-max-weight", type=float, default=20.0, help="AWR weight clip w_max")
    a.add_argument("--epochs", type=int, default=1, help="passes over the buffer")
    a.add_argument("--batch-size", type=int, default=16, help="trajectories per optimizer step")
    a.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    a.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    a.add_argument("--seed", type=int, default=0, help="random seed")
    add_machine_flags(m, training=True, lora=True)  # --threads, --precision, --grad-accum, --fsdp, --lora
    d.add_argument("--metrics", default="", help="append per-epoch metrics to this JSONL file")
    return check_flags(p.parse_args(argv), eps_low="in (0, 1]", eps_high="positive",  # every flag, before any work
                       dual_clip="0 (off) or greater than 1", kl_coef="non-negative", awr_beta="positive",
                       awr_max_weight="positive", epochs="at least 1", batch_size="at least 1", lr="in (0, 1]",
                       grad_clip="positive", grad_accum="at least 1", seed="a seed in [0, 2**32)",
                       threads="non-negative", lora="non-negative")


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: the BPPO and AWR objectives and the KL anchor, on every action token.
# ----------------------------------------------------------------------------------------
def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def bppo_loss(logp, logp_old, adv, mask, eps_low, eps_high, dual_clip=0.0):
    """L_BPPO = -masked_mean(min(eta * A, clip(eta, 1 - eps_low, 1 + eps_high) * A)), eta = exp(logp - logp_old), on
    per-token tensors; dual_clip = c > 1 (0: off): max(..., c * A) for A < 0, so no token whose eta grew far rules."""
    eta = torch.exp(logp - logp_old)
    surrogate = torch.minimum(eta * adv, torch.clamp(eta, 1.0 - eps_low, 1.0 + eps_high) * adv)
    if dual_clip:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)
    return -masked_mean(surrogate, mask)


def awr_loss(logp, adv, mask, beta, max_weight):
    """L_AWR = -masked_mean(min(exp(A / beta), w_max) * logp): advantage-weighted regression."""
    weight = torch.clamp(torch.exp(adv / beta), max=max_weight)
    return -masked_mean(weight * logp, mask)


def kl_to_ref(logits, ref_logits):
    """Exact KL(pi_theta || pi_ref) = sum_y pi_theta(y) (log pi_theta(y) - log pi_ref(y)), the mean over the reply
    tokens: logits, ref_logits (N, V) of pi_theta and pi_ref there (log-probabilities do as well), by rows (by_rows)."""
    def kl(x, r):
        logq, logr = torch.log_softmax(x.float(), dim=-1), torch.log_softmax(r.float(), dim=-1)
        return (logq.exp() * (logq - logr)).sum(-1).mean()
    return by_rows(kl, logits, ref_logits, mean=True)


def reply_logits(model, batch):
    """Next-token logits only where they predict a reply token -> (N, V), in the order of batch["input_ids"][reply]
    (logits_to_keep: most tokens are observations, and the full (B, L, V) logits would be the largest tensor)."""
    keep = torch.zeros_like(batch["action_step"], dtype=torch.bool)
    keep[:, :-1] = batch["action_step"][:, 1:] >= 0  # position i predicts token i + 1
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep).logits


def token_logprobs(logits, targets):
    """log pi(target | context) of each predicted token: logits (..., V), targets (...) -> (...), by chunks of rows
    (by_rows): the fp32 softmax over the vocabulary exists for one chunk at a time."""
    return by_rows(lambda x, y: torch.log_softmax(x.float(), dim=-1).gather(-1, y[..., None]).squeeze(-1),
                   logits, targets)


def normalize_advantages(episodes, how):
    """--adv-norm over the buffer's steps, on copies: 'center' A - mean(A), 'standardize' (A - mean(A)) / std(A)."""
    adv = torch.tensor([s["adv"] for ep in episodes for s in ep["steps"]], dtype=torch.float64)
    shift = adv.mean().item() if how != "none" else 0.0
    scale = adv.std(correction=0).clamp(min=1e-8).item() if how == "standardize" else 1.0
    return [dict(ep, steps=[dict(s, adv=(s["adv"] - shift) / scale) for s in ep["steps"]]) for ep in episodes]


def token_advantages(batch, step_adv):
    """A_y = step_adv[b, t] on each token y of reply t of row b: step_adv (B, T) -> (N,), in reply_logits' row order."""
    reply = batch["action_step"] >= 0  # (B, L)
    return step_adv[reply.nonzero()[:, 0], batch["action_step"][reply]]


def policy_loss(logits, ref_logits, batch, logp_old, args):
    """L = L_BPPO (--objective awr: L_AWR) + alpha * KL(pi_theta || pi_ref) on one batch's N reply tokens -> (loss,
    info). logits, ref_logits (N, V): pi_theta's, pi_ref's (None when alpha = 0); logp_old, batch["adv"] (N,). info:
    the loss, the share of tokens each clip holds (clip_low: A < 0, eta < 1 - eps_low; clip_high: A > 0, eta > 1 +
    eps_high), approx KL(pi_old || pi_theta) (k3: joschu.net/blog/kl-approx.html), KL(pi_theta || pi_ref), mean eta."""
    logp = token_logprobs(logits, batch["input_ids"][batch["action_step"] >= 0])  # (N,) log pi_theta
    adv, mask = batch["adv"], torch.ones_like(batch["adv"])
    pg = (bppo_loss(logp, logp_old, adv, mask, args.eps_low, args.eps_high, args.dual_clip) if args.objective == "bppo"
          else awr_loss(logp, adv, mask, args.awr_beta, args.awr_max_weight))
    kl = torch.zeros((), device=logits.device) if ref_logits is None else kl_to_ref(logits, ref_logits)
    loss = pg + args.kl_coef * kl
    with torch.no_grad():
        log_ratio = logp - logp_old
        eta, mean = log_ratio.exp(), lambda x: masked_mean(x.float(), mask).item()
        info = {"loss": loss.item(), "clip_low": mean((eta < 1 - args.eps_low) & (adv < 0)),
                "clip_high": mean((eta > 1 + args.eps_high) & (adv > 0)), "approx_kl_old": mean((eta - 1) - log_ratio),
                "kl_ref": kl.item(), "ratio": mean(eta)}
    return loss, info


def make_batch(items, pad_id, device):
    """(episode, tokens) pairs -> collate's tensors on the device, and batch["adv"] (N,): A_t on reply t."""
    batch = {k: v.to(device) for k, v in collate([x for _, x in items], pad_id).items()}
    step_adv = torch.zeros(batch["step_mask"].shape, device=device)  # (B, T)
    for i, (ep, _) in enumerate(items):
        step_adv[i, :len(ep["steps"])] = torch.tensor([s["adv"] for s in ep["steps"]])
    batch["adv"] = token_advantages(batch, step_adv)
    return batch


@torch.no_grad()
def old_logprobs(policy, data, pad_id, batch_size, device, amp):
    """logp_old(y) = log pi_old(y | prefix) of every reply token y, once before any update (eta's denominator must not
    move with pi_theta) -> one (n_j,) tensor per trajectory j (its reply tokens, in reply_logits' order), on the CPU."""
    policy.eval()
    by_length, out = sorted(range(len(data)), key=lambda j: len(data[j][1]["input_ids"])), [None] * len(data)
    for i in range(0, len(data), batch_size):
        idx = by_length[i:i + batch_size]
        b = make_batch([data[j] for j in idx], pad_id, device)
        with autocast(device, amp):
            logp = token_logprobs(reply_logits(policy, b), b["input_ids"][b["action_step"] >= 0])
        for j, lp in zip(idx, logp.cpu().split((b["action_step"] >= 0).sum(1).tolist())):
            out[j] = lp
    policy.train()
    return out


def prepare_bppo(args, device):
    """--data, --policy, --ref -> (tokenizer, pi_theta (= pi_old at first), pi_ref frozen, [(episode, tokens)])."""
    episodes = read_episodes(args.data, {**STEP_KEYS, "adv": float})
    tokenizer, ref_tokenizer = load_tokenizer(args.policy), load_tokenizer(args.ref)
    same_tokenizer(tokenizer, ref_tokenizer, f"--ref {args.ref}", args.policy, "the KL anchor compares their "
                   "next-token distributions token by token, so both must share one (pass the BC policy)")
    policy = add_lora(grad_checkpointing(load_model(AutoModelForCausalLM, args.policy), args), args.lora).to(device)
    ref = load_model(AutoModelForCausalLM, args.ref).to(device).eval().requires_grad_(False)
    adv = [s["adv"] for ep in episodes for s in ep["steps"]]  # the first line, once every input has loaded
    print(f"05_bppo: A_t as read: mean {sum(adv) / len(adv):+.3f}, {sum(a > 0 for a in adv) / len(adv):.0%} of steps "
          f"above 0; --adv-norm {args.adv_norm}")
    episodes = normalize_advantages(episodes, args.adv_norm)
    data = fit_context([(ep, tokenize_episode(tokenizer, ep)) for ep in episodes], policy.config)
    print(f"05_bppo: {len(data)} trajectories ({sum(ep['source'] == 'expert' for ep, _ in data)} expert), objective "
          f"{args.objective}, eps_low {args.eps_low}, eps_high {args.eps_high}, kl_coef {args.kl_coef}")
    return tokenizer, policy, ref, data


def main(argv=None):
    args = parse_args(argv)
    world, device, amp = start(args, "policy", args.data + [args.policy, args.ref])
    tokenizer, policy, ref, data = prepare_bppo(args, device)
    logp_old = old_logprobs(policy, data, tokenizer.pad_token_id, args.batch_size, device, amp)
    train_policy = distribute(policy, world, args.fsdp)  # torchrun: DDP or FSDP2; alone: the policy itself
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    n_loss = [len(lp) for lp in logp_old]  # reply tokens: a step's loss is their mean
    rng, records = random.Random(args.seed), []
    log = Progress("05_bppo", args.epochs * math.ceil(len(data) / args.batch_size), device)  # bar, steps, tokens

    def batch_loss(ids):  # forward -> loss, on trajectories `ids`
        b = make_batch([data[j] for j in ids], tokenizer.pad_token_id, device)
        with autocast(device, amp):  # fp32, or bf16 matmuls on fp32 weights
            logits = reply_logits(train_policy, b)  # (N, V): only where a reply token is predicted
            with torch.no_grad():  # (N, V) pi_ref's logits, for the KL anchor
                ref_logits = reply_logits(ref, b) if args.kl_coef > 0 else None
        loss, info = policy_loss(logits, ref_logits, b, torch.cat([logp_old[j] for j in ids]).to(device), args)
        return loss, info, int(b["attention_mask"].sum())

    for epoch in range(args.epochs):
        for idx in length_batches([len(x["input_ids"]) for _, x in data], args.batch_size, rng):  # one step's batch
            infos = []  # each micro-batch: (info, share, tokens)
            for ids, share in parts(idx, n_loss, train_policy, args):  # this process's micro-batches (--grad-accum)
                loss, info, n = batch_loss(ids)  # forward -> loss
                (finite(loss, log.step) * share).backward()  # backward; share: its count / the step's count
                infos.append((info, share, n))
            info, tokens = average_info(infos)  # torchrun: over every process, the one-process numbers
            torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.update(info, tokens, loss=f"{info['loss']:.4f}", kl_ref=f"{info['kl_ref']:.4f}")
        records.append(r := {"stage": "05_bppo", "out": args.out, "epoch": epoch + 1, "step": log.step,
                             "elapsed_s": log.elapsed(), **log.mean(), **log.cost()})
        tqdm.write(f"epoch {epoch + 1}: loss {r['loss']:+.4f}  clip low {r['clip_low']:.3f} high {r['clip_high']:.3f}"
                   f"  approx KL(old) {r['approx_kl_old']:.4f}  KL(ref) {r['kl_ref']:.4f}  mean ratio {r['ratio']:.3f}")
    log.bar.close()

    def save(state):  # rank 0 (or alone), the weights found finite; then the records to --metrics
        save_policy(args.out, policy, tokenizer, args, "05_bppo", state)
        print(f"05_bppo: wrote {args.out} ({log.elapsed():.0f}s, {r['tokens_per_s']:.0f} tokens/s, "
              f"peak memory {r['peak_mem_gb']:.2f} GB)")
    save_trained(policy, args, "the updated policy", save, records)  # --fsdp: every process helps gather the weights


# ----------------------------------------------------------------------------------------
# The data contract (docs/design.md, 'The chat layout'): an episode as a chat, its tokens, and where V, Q
# and the loss are read. Copied byte-identical into every stage that reads episodes (tests/test_stage_copies.py).
# ----------------------------------------------------------------------------------------
def episode_messages(ep):
    """system = instruction; user = task + o_0; then assistant = step text and user = observation, alternately."""
    msgs = [{"role": "system", "content": ep["instruction"]},
            {"role": "user", "content": f"Your task is to: {ep['task']}\n{ep['obs0']}"}]
    for step in ep["steps"]:
        msgs += [{"role": "assistant", "content": step["text"]}, {"role": "user", "content": step["obs"]}]
    return msgs


def tokenize_episode(tokenizer, ep):
    """One trajectory -> a dict of lists (docs/design.md, 'The chat layout'):
      input_ids    (L,)   the whole chat, ending with the generation prompt after o_T
      action_step  (L,)   t for the tokens of assistant turn t (incl. its end-of-turn token), else -1
      state_pos    (T+1,) last token of the generation prompt before turn t; [T] is s_T
      action_pos   (T,)   last token of turn t
    Growing prefixes of the chat are rendered as text, the full text is tokenized once: offsets locate each turn."""
    msgs = episode_messages(ep)
    control = [s for s in tokenizer.get_added_vocab() for m in msgs if s in m["content"]]
    if control:  # text data never makes a control token: it would change the chat layout silently
        die(f"episode {ep['task_id']}: its text contains the tokenizer's control token {control[0]!r}")
    render = lambda m, gen: tokenizer.apply_chat_template(m, add_generation_prompt=gen, tokenize=False)
    full = render(msgs, True)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, ends = enc["input_ids"], [e for _, e in enc["offset_mapping"]]
    action_step, state_pos, action_pos = [-1] * len(ids), [], []
    for t in range(len(ep["steps"])):
        prompt, after = render(msgs[:2 + 2 * t], True), render(msgs[:3 + 2 * t], False)  # msgs[2 + 2t]: reply t
        if not (full.startswith(prompt) and full.startswith(after)):
            die("the chat template does not render a conversation as a prefix of its continuation; "
                "this model's template is not supported")
        first = bisect.bisect_right(ends, len(prompt))   # first token ending after the prompt
        last = bisect.bisect_left(ends, len(after))      # token that ends turn t
        state_pos.append(first - 1)
        action_pos.append(last)
        action_step[first:last + 1] = [t] * (last + 1 - first)
    state_pos.append(len(ids) - 1)
    return {"input_ids": ids, "action_step": action_step, "state_pos": state_pos, "action_pos": action_pos}


def collate(tokenized, pad_id):
    """Right-pad tokenize_episode() dicts into long tensors: input_ids (B, L) padded with pad_id, attention_mask (B, L),
    action_step (B, L) padded with -1, state_pos (B, T+1) and action_pos (B, T) with 0; step_mask (B, T) float."""
    def pad(key, value):  # (B, the longest list): each row's list, then `value`
        out = torch.full((len(tokenized), max(len(x[key]) for x in tokenized)), value, dtype=torch.long)
        for i, x in enumerate(tokenized):
            out[i, :len(x[key])] = torch.tensor(x[key], dtype=torch.long)
        return out

    ids, action_pos = pad("input_ids", pad_id), pad("action_pos", 0)
    n, t = (torch.tensor([len(x[k]) for x in tokenized])[:, None] for k in ("input_ids", "action_pos"))
    return {"input_ids": ids, "attention_mask": (torch.arange(ids.shape[1]) < n).long(),
            "action_step": pad("action_step", -1), "state_pos": pad("state_pos", 0), "action_pos": action_pos,
            "step_mask": (torch.arange(action_pos.shape[1]) < t).float()}


if __name__ == "__main__":
    main()
