"""Stage 03 - the in-distribution critic: weighted implicit Q-learning (IQL) on a fixed buffer.

Reads   the buffer D = D_expert U D_self (episode JSONL files with labels, from 02) and the policy
        pi_{k-1} whose transformer initialises the critic (--policy).
Writes  --out DIR: the critic - its transformer (save_pretrained), heads.safetensors (the V and Q
        heads) and args.json.

IQL regresses values on the actions in the data only - no max over actions the data never took -
so the values stay in distribution (paper, Key Design 2). With the W-IQL step weights

    w_t = (t/T + d) * 0.5 + 0.5,   t = 1..T,   d = 1 if the trajectory's final env reward != 0

the two losses are

    L_V = E[ w_t * L2_tau( Qbar(s_t, a_t) - V(s_t) ) ],   L2_tau(u) = |tau - 1(u < 0)| * u^2
    L_Q = E[ w_t * ( r_t + gamma * (1 - done_t) * V(s_{t+1}) - Q(s_t, a_t) )^2 ],   r_t = r_env + r_aux

where Qbar is a Polyak-averaged copy of the Q head. tau > 0.5 (the default 0.7) makes V an upper
expectile of Q over the data's actions - IQL's implicit max over what the buffer does, never over
actions it lacks; tau = 0.5 would make V their mean. The step limit is part of the task: a trajectory
cut by it ends there (done = 1, V = 0 after it), so a step that wastes time is worth less than one that makes progress.
V and Q share one transformer: one forward pass over a trajectory gives every V and every Q.

    python 03_critic.py --policy runs/demo/policy_0 --out runs/demo/iter_1/critic \
        --data runs/demo/data/expert.jsonl runs/demo/iter_1/self.jsonl
"""
import bisect
import copy
import math
import random

import torch
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer

from distributed import average_info, distribute, parts, unsharded
from machine import Progress, add_machine_flags, autocast, grad_checkpointing, save_trained, start
from plumbing import (check_flags, die, finite, fit_context, held_out, length_batches, load_heads, load_model,
                      load_tokenizer, owned, read_episodes, same_tokenizer, save_critic, stage_parser)


def parse_args(argv=None):
    p, a, d, m = stage_parser("Stage 03: weighted IQL critic on the hybrid buffer.")
    d.add_argument("--data", nargs="+", required=True, help="episode JSONL files: expert demos + self trajectories")
    d.add_argument("--policy", required=True, help="policy directory whose transformer initialises the critic")
    d.add_argument("--out", required=True, help="output critic directory")
    d.add_argument("--init", default="",
                   help="start from this critic of 03 (its transformer and heads), e.g. iteration k-1's: a warm start "
                        "(default: --policy's transformer and fresh heads)")
    a.add_argument("--tau", type=float, default=0.7,
                   help="expectile of V over Q (0.5: the mean; > 0.5 leans to the better actions)")
    a.add_argument("--gamma", type=float, default=0.95, help="discount factor of the Bellman backup")
    a.add_argument("--polyak", type=float, default=0.05, help="target rate: Qbar <- (1 - polyak) Qbar + polyak Q")
    a.add_argument("--epochs", type=int, default=4, help="passes over the buffer")
    a.add_argument("--batch-size", type=int, default=16, help="trajectories per optimizer step")
    a.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (heads and transformer)")
    a.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    a.add_argument("--uniform-weights", action="store_true", help="ablation 'w/o W-IQL': w_t = 1")
    a.add_argument("--no-aux", action="store_true", help="ablation 'w/o RR': the critic sees r_aux = 0")
    d.add_argument("--holdout", type=float, default=0.2,
                   help="share of the self episodes kept out of training: 04 checks the critic on them")
    a.add_argument("--seed", type=int, default=0, help="random seed")
    add_machine_flags(m, training=True)  # --threads, --precision, --grad-accum, --fsdp
    d.add_argument("--metrics", default="", help="append per-epoch metrics to this JSONL file")
    return check_flags(p.parse_args(argv), tau="in (0, 1)", gamma="in [0, 1]", polyak="in (0, 1]",  # before any work
                       epochs="at least 1", batch_size="at least 1", grad_accum="at least 1", lr="positive",
                       grad_clip="positive", seed="a seed in [0, 2**32)", threads="non-negative", holdout="in [0, 1]")


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: weighted IQL, and the critic it trains - the policy's transformer with a V head
# and a Q head (Critic is copied byte-identical into 04, which reads what save_critic writes).
# ----------------------------------------------------------------------------------------
def step_weights(T, d):
    """Paper eq. (W-IQL step weight): w_t = (t/T + d) * 0.5 + 0.5 for t = 1..T -> (T,)."""
    t = torch.arange(1, T + 1, dtype=torch.float)
    return (t / T + float(d)) * 0.5 + 0.5


def expectile_loss(u, tau, weight=None):
    """Paper eq. (IQL value loss): L2_tau(u) = |tau - 1(u < 0)| * u^2, its mean weighted by weight:
    sum(weight * L2_tau(u)) / sum(weight) (None: uniform; a zero weight drops an entry, e.g. padding)."""
    loss = torch.abs(tau - (u < 0).float()) * u ** 2
    if weight is None:
        return loss.mean()
    return (weight * loss).sum() / weight.sum().clamp(min=1e-8)


def weighted_mse(u, weight):
    """Paper eq. (IQL Q loss), weighted like expectile_loss: L_Q = sum(weight * u^2) / sum(weight)."""
    return (weight * u ** 2).sum() / weight.sum().clamp(min=1e-8)


def trajectory_tensors(episodes, device):
    """Per-step tensors (B, T), zero on padding: r_env, r_aux, done, mask. done = 1 on the last step
    whether it reached a true terminal or the step limit: the limit ends the task, V = 0 after it."""
    T = max(len(ep["steps"]) for ep in episodes)
    out = {k: torch.zeros((len(episodes), T), device=device) for k in ("r_env", "r_aux", "done", "mask")}
    for i, ep in enumerate(episodes):
        n = len(ep["steps"])
        for k in ("r_env", "r_aux", "done"):
            out[k][i, :n] = torch.tensor([float(s[k]) for s in ep["steps"]])
        out["done"][i, n - 1] = out["mask"][i, :n] = 1.0
    return out


def batch_weights(episodes, uniform, device):
    """(B, T) step weights, 0 on padding; d = 1 if the last env reward is non-zero."""
    T = max(len(ep["steps"]) for ep in episodes)
    w = torch.zeros((len(episodes), T), device=device)
    for i, ep in enumerate(episodes):
        n = len(ep["steps"])
        w[i, :n] = 1.0 if uniform else step_weights(n, ep["steps"][-1]["r_env"] != 0)
    return w


def iql_losses(critic, target_q_head, batch, traj, weights, tau, gamma, use_aux):
    """One forward pass -> (L_V + L_Q, info); traj and weights are (B, T), w_t = weights:
    L_V = expectile_loss(Qbar(s_t, a_t) - V(s_t), tau, w), Qbar from target_q_head, and
    L_Q = weighted_mse(r_t + gamma * (1 - done_t) * V(s_{t+1}) - Q(s_t, a_t), w), r_t = r_env (+ r_aux if use_aux),
    with no gradient through Qbar or V(s_{t+1}). info: L_V, L_Q and the mean V(s_t) and Q(s_t, a_t) over the
    batch's real steps."""
    h_action, v_all, q = critic(batch)                 # v_all (B, T+1), q (B, T)
    v, v_next = v_all[:, :-1], v_all[:, 1:].detach()
    with torch.no_grad(), torch.autocast(h_action.device.type, enabled=False):
        q_target = target_q_head(h_action.detach()).squeeze(-1)  # Qbar(s_t, a_t), in fp32 like the heads
    reward = traj["r_env"] + (traj["r_aux"] if use_aux else 0.0)
    loss_v = expectile_loss(q_target - v, tau, weights)
    loss_q = weighted_mse(reward + gamma * (1.0 - traj["done"]) * v_next - q, weights)
    with torch.no_grad():
        n = traj["mask"].sum().clamp(min=1)
        info = {"loss_v": loss_v.item(), "loss_q": loss_q.item(),
                "v_mean": ((v * traj["mask"]).sum() / n).item(), "q_mean": ((q * traj["mask"]).sum() / n).item()}
    return loss_v + loss_q, info


def polyak_update(target, source, rate):
    """Paper: the target Q head follows the Q head slowly, Qbar <- (1 - rate) Qbar + rate Q, parameter by
    parameter (target and source: modules of one shape), in place and without gradient."""
    with torch.no_grad():
        for p_t, p in zip(target.parameters(), source.parameters()):
            p_t.lerp_(unsharded(p), rate)  # torchrun --fsdp: p is a shard, unsharded(p) the whole tensor


class Critic(torch.nn.Module):
    """The policy's transformer with two MLP heads, read in one forward pass (docs/design.md, 'The chat layout'):
    V(s_t) at the last token of the generation prompt before reply t, Q(s_t, a_t) at the last token of reply t."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        d = backbone.config.hidden_size
        self.v_head, self.q_head = (torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, 1))
                                    for _ in range(2))

    def forward(self, batch):
        """-> the features at the action positions (B, T, d) (for 03's target Q head), V (B, T+1), Q (B, T)."""
        h = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        d = h.shape[-1]
        h_state = h.gather(1, batch["state_pos"][..., None].expand(-1, -1, d)).float()    # (B, T+1, d)
        h_action = h.gather(1, batch["action_pos"][..., None].expand(-1, -1, d)).float()  # (B, T, d)
        with torch.autocast(h.device.type, enabled=False):  # the heads in fp32, also under bf16 autocast
            return h_action, self.v_head(h_state).squeeze(-1), self.q_head(h_action).squeeze(-1)


def prepare_critic(args, device):
    """--data and --policy -> (tokenizer, the critic on the device, [(episode, tokenize_episode)])."""
    episodes, tokenizer = read_episodes(args.data), load_tokenizer(args.policy)
    if args.init and not owned(args.init, "critic"):
        die(f"--init {args.init} is not a critic directory of 03_critic.py")
    kept = [ep for ep in episodes if not held_out(ep, args.holdout)]  # 04 reports the critic on the others
    if not kept:
        die(f"--holdout {args.holdout} leaves no episode to train on")
    critic = Critic(grad_checkpointing(load_model(AutoModel, args.init or args.policy), args))
    if args.init:  # the V and Q heads too (checked as 04 checks them); the transformer came from --init above
        load_heads(critic, args.init)
        same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(args.init, local_files_only=True),
                       f"--init {args.init}", args.policy, "its transformer reads other token ids (pass this policy's)")
    critic = critic.to(device).train()
    data = fit_context([(ep, tokenize_episode(tokenizer, ep)) for ep in kept], critic.backbone.config)
    print(f"03_critic: {len(episodes) - len(kept)} self episodes held out of training (--holdout {args.holdout})")
    n_expert = sum(ep["source"] == "expert" for ep, _ in data)
    print(f"03_critic: {len(data)} trajectories ({n_expert} expert, {len(data) - n_expert} self), "
          f"{sum(len(ep['steps']) for ep, _ in data)} steps; tau {args.tau}, gamma {args.gamma}, "
          f"weights {'uniform' if args.uniform_weights else 'W-IQL'}, aux rewards {'off' if args.no_aux else 'on'}")
    return tokenizer, critic, data


def main(argv=None):
    args = parse_args(argv)
    world, device, amp = start(args, "critic", args.data + [args.policy] + [args.init] * bool(args.init))
    tokenizer, critic, data = prepare_critic(args, device)
    target_q_head = copy.deepcopy(critic.q_head).requires_grad_(False)  # Qbar
    train_critic = distribute(critic, world, args.fsdp)  # torchrun: DDP or FSDP2; alone: the critic itself
    optimizer = torch.optim.AdamW(critic.parameters(), lr=args.lr, weight_decay=0.0)
    n_loss = [batch_weights([ep], args.uniform_weights, "cpu").sum().item() for ep, _ in data]  # sum of each one's w_t
    rng, records = random.Random(args.seed), []
    log = Progress("03_critic", args.epochs * math.ceil(len(data) / args.batch_size), device)  # bar, steps, tokens

    def batch_loss(ids):  # forward -> loss, on trajectories `ids`
        eps = [data[j][0] for j in ids]
        batch = {k: v.to(device) for k, v in collate([data[j][1] for j in ids], tokenizer.pad_token_id).items()}
        traj, weights = trajectory_tensors(eps, device), batch_weights(eps, args.uniform_weights, device)
        with autocast(device, amp):  # fp32, or bf16 matmuls on fp32 weights (the heads stay fp32)
            loss, info = iql_losses(train_critic, target_q_head, batch, traj, weights, args.tau, args.gamma,
                                    not args.no_aux)
        return loss, info, int(batch["attention_mask"].sum())

    for epoch in range(args.epochs):
        for idx in length_batches([len(x["input_ids"]) for _, x in data], args.batch_size, rng):  # one step's batch
            infos = []  # each micro-batch: (info, share, tokens)
            for ids, share in parts(idx, n_loss, train_critic, args):  # this process's micro-batches (--grad-accum)
                loss, info, n = batch_loss(ids)  # forward -> loss
                (finite(loss, log.step) * share).backward()  # backward; share: its count / the step's count
                infos.append((info, share, n))
            info, tokens = average_info(infos)  # torchrun: over every process, the one-process numbers
            torch.nn.utils.clip_grad_norm_(critic.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            polyak_update(target_q_head, critic.q_head, args.polyak)
            log.update(info, tokens, L_V=f"{info['loss_v']:.4f}", L_Q=f"{info['loss_q']:.4f}",
                       V=f"{info['v_mean']:+.3f}", Q=f"{info['q_mean']:+.3f}")
        records.append(r := {"stage": "03_critic", "epoch": epoch + 1, "step": log.step, "elapsed_s": log.elapsed(),
                             **log.mean(("loss_v", "loss_q")), **log.cost()})
        tqdm.write(f"epoch {epoch + 1}: L_V {r['loss_v']:.4f}  L_Q {r['loss_q']:.4f}")
    log.bar.close()
    summary = {"stage": "03_critic", "step": log.step, "loss_v": r["loss_v"], "loss_q": r["loss_q"]}

    def save(state):  # rank 0 (or alone), the weights found finite; then the records and summary to --metrics
        save_critic(critic, args.out, tokenizer, vars(args), state)
        print(f"03_critic: L_V {summary['loss_v']:.4f}  L_Q {summary['loss_q']:.4f} in the last epoch (what V and Q "
              f"learned: 04_gae's report); {log.elapsed():.0f}s, {r['tokens_per_s']:.0f} tokens/s, "
              f"peak memory {r['peak_mem_gb']:.2f} GB -> {args.out}")
    save_trained(critic, args, "the critic", save, records + [summary], whole=True)  # --fsdp: every process gathers


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
