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

where Qbar is a Polyak-averaged copy of the Q head. tau = 0.5 makes V the mean of Q over the
data's actions, tau > 0.5 an upper expectile (docs/design.md, 'Where this reference departs from
the paper'). The step limit is part of the task: a trajectory cut by it ends there (done = 1,
V = 0 after it), so a step that wastes time is worth less than one that makes progress.
V and Q share one transformer: one forward pass over a trajectory gives every V and every Q.

    python 03_critic.py --policy runs/demo/policy_0 --out runs/demo/iter_1/critic \
        --data runs/demo/data/expert.jsonl runs/demo/iter_1/self.jsonl
"""
import argparse
import bisect
import copy
import json
import math
import os
import random
import resource
import shutil
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Stage 03: weighted IQL critic on the hybrid buffer.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, help="episode JSONL files: expert demos + self trajectories")
    p.add_argument("--policy", required=True, help="policy directory whose transformer initialises the critic")
    p.add_argument("--out", required=True, help="output critic directory")
    p.add_argument("--tau", type=float, default=0.5,
                   help="expectile of V over Q (0.5: the mean; > 0.5 leans to the better actions)")
    p.add_argument("--gamma", type=float, default=0.95, help="discount factor of the Bellman backup")
    p.add_argument("--polyak", type=float, default=0.05, help="target rate: Qbar <- (1 - polyak) Qbar + polyak Q")
    p.add_argument("--epochs", type=int, default=4, help="passes over the buffer")
    p.add_argument("--batch-size", type=int, default=16, help="trajectories per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (heads and transformer)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (same step, less memory)")
    p.add_argument("--uniform-weights", action="store_true", help="ablation 'w/o W-IQL': w_t = 1")
    p.add_argument("--no-aux", action="store_true", help="ablation 'w/o RR': the critic sees r_aux = 0")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--metrics", default="", help="append per-epoch metrics to this JSONL file")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model (FSDP2) instead of a copy per process (DDP)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------
# The data contract (docs/design.md, 'The chat layout'): an episode as a chat, its tokens,
# and where V, Q and the loss are read. Copied byte-identical into the stages that read episodes.
# ----------------------------------------------------------------------------------------
def episode_messages(ep):
    """docs/design.md, 'The chat layout': system = instruction; user = task + o_0; then
    assistant = step text and user = observation, alternately."""
    msgs = [{"role": "system", "content": ep["instruction"]},
            {"role": "user", "content": f"Your task is to: {ep['task']}\n{ep['obs0']}"}]
    for step in ep["steps"]:
        msgs.append({"role": "assistant", "content": step["text"]})
        msgs.append({"role": "user", "content": step["obs"]})
    return msgs


def tokenize_episode(tokenizer, ep):
    """One trajectory -> token ids and where values are read (docs/design.md, 'The chat layout').

    Returns a dict of lists:
      input_ids    (L,)   the whole chat, ending with the generation prompt after o_T
      action_step  (L,)   t for the tokens of assistant turn t (incl. its end-of-turn token), else -1
      state_pos    (T+1,) last token of the generation prompt before turn t; [T] is s_T
      action_pos   (T,)   last token of turn t
    The chat template is rendered as text for growing prefixes of the conversation, and
    the full text is tokenized once; character offsets locate each turn."""
    msgs = episode_messages(ep)
    control = [s for s in tokenizer.get_added_vocab() for m in msgs if s in m["content"]]
    if control:  # text data never makes a control token: it would change the chat layout silently
        die(f"episode {ep['task_id']}: its text contains the tokenizer's control token {control[0]!r}")

    def render(m, gen):
        return tokenizer.apply_chat_template(m, add_generation_prompt=gen, tokenize=False)

    full = render(msgs, True)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, ends = enc["input_ids"], [e for _, e in enc["offset_mapping"]]
    action_step = [-1] * len(ids)
    state_pos, action_pos = [], []
    for t in range(len(ep["steps"])):
        k = 2 + 2 * t  # index of assistant message t
        prompt, after = render(msgs[:k], True), render(msgs[:k + 1], False)
        if not (full.startswith(prompt) and full.startswith(after)):
            die("the chat template does not render a conversation as a prefix of its continuation; "
                "this model's template is not supported")
        first = bisect.bisect_right(ends, len(prompt))   # first token ending after the prompt
        last = bisect.bisect_left(ends, len(after))      # token that ends turn t
        state_pos.append(first - 1)
        action_pos.append(last)
        for i in range(first, last + 1):
            action_step[i] = t
    state_pos.append(len(ids) - 1)
    return {"input_ids": ids, "action_step": action_step, "state_pos": state_pos, "action_pos": action_pos}


def collate(tokenized, pad_id):
    """Right-pad a list of tokenize_episode() dicts into tensors.
    input_ids/attention_mask/action_step (B, L); state_pos (B, T+1) and action_pos (B, T)
    padded with 0, step_mask (B, T) is 1 on real steps."""
    B = len(tokenized)
    L = max(len(x["input_ids"]) for x in tokenized)
    T = max(len(x["action_pos"]) for x in tokenized)
    batch = {
        "input_ids": torch.full((B, L), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((B, L), dtype=torch.long),
        "action_step": torch.full((B, L), -1, dtype=torch.long),
        "state_pos": torch.zeros((B, T + 1), dtype=torch.long),
        "action_pos": torch.zeros((B, T), dtype=torch.long),
        "step_mask": torch.zeros((B, T), dtype=torch.float),
    }
    for i, x in enumerate(tokenized):
        n, t = len(x["input_ids"]), len(x["action_pos"])
        batch["input_ids"][i, :n] = torch.tensor(x["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["action_step"][i, :n] = torch.tensor(x["action_step"])
        batch["state_pos"][i, :t + 1] = torch.tensor(x["state_pos"])
        batch["action_pos"][i, :t] = torch.tensor(x["action_pos"])
        batch["step_mask"][i, :t] = 1.0
    return batch


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: weighted IQL, and the critic it trains - the policy's transformer with a V head
# and a Q head (Critic is copied byte-identical into 02 for --rerank and into 04).
# ----------------------------------------------------------------------------------------
def step_weights(T, d):
    """Paper eq. (W-IQL step weight): w_t = (t/T + d) * 0.5 + 0.5 for t = 1..T -> (T,)."""
    t = torch.arange(1, T + 1, dtype=torch.float)
    return (t / T + float(d)) * 0.5 + 0.5


def expectile_loss(u, tau, weight=None):
    """Paper eq. (IQL value loss): the mean of |tau - 1(u < 0)| * u^2, weighted by weight
    (None: uniform; a zero weight drops an entry, e.g. padding)."""
    loss = torch.abs(tau - (u < 0).float()) * u ** 2
    if weight is None:
        return loss.mean()
    return (weight * loss).sum() / weight.sum().clamp(min=1e-8)


def weighted_mse(u, weight):
    """Paper eq. (IQL Q loss), weighted like expectile_loss."""
    return (weight * u ** 2).sum() / weight.sum().clamp(min=1e-8)


def trajectory_tensors(episodes, device):
    """Per-step tensors (B, T), zero on padding: r_env, r_aux, done, mask. The last step is done
    whether it reached a true terminal or the step limit: the limit ends the task, V = 0 after it."""
    T = max(len(ep["steps"]) for ep in episodes)
    out = {k: torch.zeros((len(episodes), T), device=device) for k in ("r_env", "r_aux", "done", "mask")}
    for i, ep in enumerate(episodes):
        n = len(ep["steps"])
        out["r_env"][i, :n] = torch.tensor([s["r_env"] for s in ep["steps"]])
        out["r_aux"][i, :n] = torch.tensor([s["r_aux"] for s in ep["steps"]])
        out["done"][i, :n] = torch.tensor([float(s["done"]) for s in ep["steps"]])
        out["done"][i, n - 1] = 1.0
        out["mask"][i, :n] = 1.0
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
    """One forward pass -> (L_V + L_Q, info); traj and weights are (B, T). info: L_V, L_Q and the
    mean V(s_t) and Q(s_t, a_t) over the batch's real steps."""
    h_action, v_all, q = critic(batch)                 # v_all (B, T+1), q (B, T)
    v, v_next = v_all[:, :-1], v_all[:, 1:].detach()
    with torch.no_grad():
        q_target = target_q_head(h_action.detach().float()).squeeze(-1)  # Qbar(s_t, a_t)
    reward = traj["r_env"] + (traj["r_aux"] if use_aux else 0.0)
    not_done = 1.0 - traj["done"]
    loss_v = expectile_loss(q_target - v, tau, weights)
    loss_q = weighted_mse(reward + gamma * not_done * v_next - q, weights)
    with torch.no_grad():
        n = traj["mask"].sum().clamp(min=1)
        info = {"loss_v": loss_v.item(), "loss_q": loss_q.item(),
                "v_mean": ((v * traj["mask"]).sum() / n).item(), "q_mean": ((q * traj["mask"]).sum() / n).item()}
    return loss_v + loss_q, info


class Critic(torch.nn.Module):
    """The policy's transformer with two MLP heads: V(s_t) read at each state position (the last
    token of the generation prompt before reply t), Q(s_t, a_t) at each action position (the last
    token of reply t) - docs/design.md, 'The chat layout'. One forward pass gives all of them."""

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
        h_state = h.gather(1, batch["state_pos"][..., None].expand(-1, -1, d))    # (B, T+1, d)
        h_action = h.gather(1, batch["action_pos"][..., None].expand(-1, -1, d))  # (B, T, d)
        return h_action, self.v_head(h_state.float()).squeeze(-1), self.q_head(h_action.float()).squeeze(-1)

    def save(self, out_dir, tokenizer, args, state=None):
        """Atomically: the transformer (save_pretrained), its tokenizer, heads.safetensors and args.json.
        state: the whole state dict (03 --fsdp gathers it); by default the critic's own."""
        state = self.state_dict() if state is None else state

        def write(tmp):
            backbone = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
            self.backbone.save_pretrained(tmp, state_dict=backbone)
            tokenizer.save_pretrained(tmp)
            heads = {k: v.contiguous().cpu() for k, v in state.items() if k.startswith(("v_head.", "q_head."))}
            save_file(heads, os.path.join(tmp, "heads.safetensors"))
            with open(os.path.join(tmp, "args.json"), "w") as f:
                json.dump({"stage": "03_critic", **args}, f, indent=2)
        write_atomic(out_dir, write)

    @classmethod
    def load(cls, path, device, dtype):
        """A critic directory of 03 -> (the critic in eval mode, its tokenizer); refuses a missing or cut tensor."""
        if not owned(path, "critic"):
            die(f"{path} is not {ARTIFACTS['critic'][0]}")
        try:  # the small files first: a broken one is one line before the transformer is loaded
            heads = load_file(os.path.join(path, "heads.safetensors"))
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:
            die(f"{path}: cannot load heads.safetensors or the tokenizer ({e})")
        critic = cls(load_model(AutoModel, path, dtype))
        try:
            for name, head in (("v_head.", critic.v_head), ("q_head.", critic.q_head)):
                head.load_state_dict({k[len(name):]: v for k, v in heads.items() if k.startswith(name)})
        except RuntimeError as e:  # a head tensor missing, or of another size than the transformer's
            die(f"{path}/heads.safetensors: not the heads of this transformer ({e})")
        return critic.to(device).eval(), tokenizer


def discounted_returns(rewards, gamma):
    """g_t = r_t + gamma * g_{t+1}, g_T = 0 (the step limit ends the task, as in L_Q)."""
    out, g = [], 0.0
    for r in reversed(rewards):
        g = r + gamma * g
        out.append(g)
    return out[::-1]


def critic_report(critic, data, batch_size, pad_id, gamma, use_aux, device):
    """What the critic learned, for a student to read: how much of the discounted return-to-go
    (with the critic's rewards) V explains (explained variance: 1 = all, 0 = no better than a
    constant), and V and Q (mean, std) by data source beside the mean return, which V should be
    near (far above it, V is optimistic and 04's GAE blames the last steps of failed episodes)."""
    stats = {s: {"v": [], "q": [], "ret": []} for s in ("expert", "self")}
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            chunk = data[i:i + batch_size]
            batch = {k: v.to(device) for k, v in collate([x for _, x in chunk], pad_id).items()}
            _, v_all, q = critic(batch)
            for j, (ep, _) in enumerate(chunk):
                n, s = len(ep["steps"]), stats["expert" if ep["source"] == "expert" else "self"]
                s["v"] += v_all[j, :n].tolist()
                s["q"] += q[j, :n].tolist()
                s["ret"] += discounted_returns([st["r_env"] + (st["r_aux"] if use_aux else 0.0) for st in ep["steps"]],
                                               gamma)
    v, ret = (np.array(stats["expert"][k] + stats["self"][k]) for k in ("v", "ret"))
    report = {"explained_variance": float(1 - np.var(ret - v) / max(np.var(ret), 1e-8))}
    for src, s in stats.items():
        if s["v"]:
            report.update({f"{src}_v_mean": float(np.mean(s["v"])), f"{src}_v_std": float(np.std(s["v"])),
                           f"{src}_q_mean": float(np.mean(s["q"])), f"{src}_q_std": float(np.std(s["q"])),
                           f"{src}_ret_mean": float(np.mean(s["ret"]))})
    return report


def main(argv=None):
    args = parse_args(argv)
    # Every input is checked before any work, and --out is replaced only by a finished critic.
    check_flags(args, tau="in (0, 1)", gamma="in [0, 1]", polyak="in (0, 1]", epochs="at least 1",
                batch_size="at least 1", grad_accum="at least 1", lr="positive", grad_clip="positive",
                seed="a seed in [0, 2**32)", threads="non-negative")
    check_out(args.out, "critic", args.data + [args.policy])
    if args.metrics:
        check_out(args.metrics, "log", args.data + [args.policy, args.out])
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = setup_distributed()  # DISTRIBUTED (torchrun, docs/distributed.md); alone: 0, 1
    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed)
    device, dtype = pick_device()
    episodes = read_episodes(args.data)
    tokenizer = load_tokenizer(args.policy)
    critic = Critic(load_model(AutoModel, args.policy, dtype)).to(device)
    data = tokenize_all(tokenizer, episodes, critic.backbone.config.max_position_embeddings)
    if not data:
        die("no trajectory fits the model's context")
    target_q_head = copy.deepcopy(critic.q_head).requires_grad_(False)
    train_critic = distribute(critic, world, args.fsdp)  # DISTRIBUTED: DDP or FSDP2; alone: the critic itself
    optimizer = torch.optim.AdamW(critic.parameters(), lr=args.lr, weight_decay=0.0)
    n_expert = sum(ep["source"] == "expert" for ep, _ in data)
    print(f"03_critic: {len(data)} trajectories ({n_expert} expert, {len(data) - n_expert} self), "
          f"{sum(len(ep['steps']) for ep, _ in data)} steps; tau {args.tau}, gamma {args.gamma}, "
          f"weights {'uniform' if args.uniform_weights else 'W-IQL'}, aux rewards {'off' if args.no_aux else 'on'}")

    rng = random.Random(args.seed)
    lengths = [len(x["input_ids"]) for _, x in data]
    n_batches = (len(data) + args.batch_size - 1) // args.batch_size
    bar = tqdm(total=args.epochs * n_batches, desc="03_critic", unit="step", disable=not is_main())
    step, t0, records, n_tok = 0, time.time(), [], 0
    for epoch in range(args.epochs):
        sum_v = sum_q = 0.0
        for idx in length_batches(lengths, args.batch_size, rng):
            # DISTRIBUTED / --grad-accum: this rank's share of the batch in micro-batches (alone: one, all of it),
            # each weighted by its share of the step weights, so that L_V and L_Q are means over the whole batch
            mine, keep = shard(idx, rank, world)
            parts = []
            for part, w in micro_batches(mine, args.grad_accum):
                eps = [data[j][0] for j in part]
                batch = collate([data[j][1] for j in part], tokenizer.pad_token_id)
                batch = {k: v.to(device) for k, v in batch.items()}
                parts.append((batch, trajectory_tensors(eps, device), batch_weights(eps, args.uniform_weights, device),
                              keep * w))
            shares = part_shares([weights.sum() * w for _, _, weights, w in parts], world)
            optimizer.zero_grad(set_to_none=True)
            infos = []
            for i, (batch, traj, weights, _) in enumerate(parts):
                n_tok += int(batch["attention_mask"].sum())
                grad_sync(train_critic, world, args.fsdp, on=i == len(parts) - 1)
                loss, part_info = iql_losses(train_critic, target_q_head, batch, traj, weights, args.tau, args.gamma,
                                             not args.no_aux)
                if not torch.isfinite(loss):
                    die(f"critic loss became {loss.item()} at step {step}; lower --lr")
                (loss * shares[i]).backward()
                infos.append(part_info)
            info = average_info(infos, shares, world)
            torch.nn.utils.clip_grad_norm_(critic.parameters(), args.grad_clip)
            optimizer.step()
            with torch.no_grad():  # Polyak-averaged target: Qbar <- (1 - polyak) Qbar + polyak Q
                for p_t, p in zip(target_q_head.parameters(), critic.q_head.parameters()):
                    p_t.lerp_(p.full_tensor() if hasattr(p, "full_tensor") else p, args.polyak)  # --fsdp: p is a shard
            sum_v, sum_q, step = sum_v + info["loss_v"], sum_q + info["loss_q"], step + 1
            bar.update(1)
            bar.set_postfix(L_V=f"{info['loss_v']:.4f}", L_Q=f"{info['loss_q']:.4f}", V=f"{info['v_mean']:+.3f}",
                            Q=f"{info['q_mean']:+.3f}")
        record = {"stage": "03_critic", "epoch": epoch + 1, "step": step, "loss_v": sum_v / n_batches,
                  "loss_q": sum_q / n_batches, "elapsed_s": time.time() - t0, **cost(n_tok, time.time() - t0, device)}
        records.append(record)
        tqdm.write(f"epoch {epoch + 1}: L_V {record['loss_v']:.4f}  L_Q {record['loss_q']:.4f}")
    bar.close()

    critic.eval()
    report = critic_report(critic, data, args.batch_size, tokenizer.pad_token_id, args.gamma, not args.no_aux, device)
    summary = {"stage": "03_critic", "step": step, **report}
    state = full_state(critic, args.fsdp)  # DISTRIBUTED --fsdp: the shards gathered; else None
    if not is_main():  # DISTRIBUTED: rank 0 alone writes
        return finish_distributed()
    state = critic.state_dict() if state is None else state
    check_finite(state.values(), "the critic")
    critic.save(args.out, tokenizer, vars(args), state)
    log_metrics(args.metrics, *records, summary)
    by_src = "  ".join(f"{src}: V {summary[src + '_v_mean']:+.3f}+-{summary[src + '_v_std']:.3f} "
                       f"Q {summary[src + '_q_mean']:+.3f}+-{summary[src + '_q_std']:.3f} "
                       f"(return {summary[src + '_ret_mean']:+.3f})"
                       for src in ("expert", "self") if src + "_v_mean" in summary)
    print(f"03_critic: explained variance of returns {summary['explained_variance']:.3f}; {by_src}; "
          f"{time.time() - t0:.0f}s, {record['tokens_per_s']:.0f} tokens/s, peak memory {record['peak_mem_gb']:.2f} GB "
          f"-> {args.out}")
    finish_distributed()


# ========================================================================================
# Plumbing, copied byte-identical into every stage that needs it (tests/test_stage_copies.py);
# skip it on a first reading. The promises (docs/design.md, 'Conventions'): bad input is one
# `error:` line and exit 2 before any work; a stage writes only its own output, atomically.
# ========================================================================================
def die(msg):
    """Bad input: one line on stderr, exit code 2, nothing written."""
    print("error: " + " ".join(str(msg).split())[:500], file=sys.stderr)
    sys.exit(2)


RULES = {"at least 1": lambda v: v >= 1, "non-negative": lambda v: v >= 0, "positive": lambda v: v > 0,
         "in [0, 1]": lambda v: 0 <= v <= 1, "in (0, 1)": lambda v: 0 < v < 1, "in (0, 1]": lambda v: 0 < v <= 1,
         "a seed in [0, 2**32)": lambda v: 0 <= v < 2**32}


def check_flags(args, **rules):
    """Numeric flags, before any work: each rule (RULES) says what the flag must be."""
    for name, rule in rules.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and RULES[rule](value)):
            die(f"--{name.replace('_', '-')} must be {rule}, got {value}")


# What each kind of output is, and which stages write it (their name is in args.json / the summary).
ARTIFACTS = {"policy": ("a policy directory written by 00_pretrain.py / 01_bc.py / 05_bppo.py",
                        ("00_pretrain", "01_bc", "05_bppo")),
             "critic": ("a critic directory written by 03_critic.py", ("03_critic",)),
             "02_collect": ("an episode JSONL (or its .json summary) written by 02_collect.py", ("02_collect",)),
             "04_gae": ("a JSONL with advantages (or its .json summary) written by 04_gae.py", ("04_gae",)),
             "log": ("a metrics JSONL", ())}


def read_json(path):
    """A JSON object from a file, or None when the file is not one (missing, binary, not JSON, not a dict)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def owned(path, kind):
    """Whether an existing path is an artifact of this kind that a stage may replace (a log: append
    to). Judged from all of it: a directory holds only plain files and an args.json naming its stage;
    a summary names its stage; every line of a JSONL is an episode of the kind (or a metrics record)."""
    what, stages = ARTIFACTS[kind]
    if kind in ("policy", "critic"):
        names = [] if os.path.islink(path) or not os.path.isdir(path) else os.listdir(path)
        return (bool(names) and all(os.path.isfile(os.path.join(path, n)) for n in names)
                and ("heads.safetensors" in names) == (kind == "critic")
                and (read_json(os.path.join(path, "args.json")) or {}).get("stage") in stages)
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    if path.endswith(".json"):
        return os.path.getsize(path) == 0 or (read_json(path) or {}).get("stage") in stages
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (UnicodeDecodeError, ValueError):
        return False
    if kind == "log":
        return all(isinstance(r, dict) and "stage" in r for r in rows)
    keys = {**STEP_KEYS, "adv": float} if kind == "04_gae" else STEP_KEYS
    return all(episode_error(r, keys) is None and ("adv" in r["steps"][0]) == (kind == "04_gae") for r in rows)


def check_out(path, kind, inputs=()):
    """Before any work: an output names nothing yet or an artifact of the stage's own kind (owned),
    never an input, nor a directory that holds one or lies inside one; its parent must be writable.
    A JSONL (02, 04, metrics) ends in .jsonl; 02 and 04 write their summary beside it as .json."""
    real = os.path.realpath(path)
    for p in map(os.path.realpath, inputs):
        if real == p or p.startswith(real + os.sep) or real.startswith(p + os.sep):
            die(f"{path} is (or holds) an input of this stage, or lies inside one; write the output elsewhere")
    if kind in ("02_collect", "04_gae", "log") and not path.endswith(".jsonl"):
        die(f"{path}: {'--metrics' if kind == 'log' else 'the output'} must end in .jsonl"
            + ("" if kind == "log" else " (the summary goes beside it with .json)"))
    for p in [path] + ([path[:-len(".jsonl")] + ".json"] if kind in ("02_collect", "04_gae") else []):
        if os.path.lexists(p) and not owned(p, kind):
            die(f"{p} exists and is not {ARTIFACTS[kind][0]}; refusing to replace it (pick another path)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # a real file, not os.access: that says yes to root on a read-only or special file system
        probe = os.path.join(parent, f".write_test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        die(f"cannot write {path}: {parent} is not a writable directory ({e.strerror})")


def write_atomic(path, write_fn):
    """Write a file or directory through a temporary sibling and one rename: a killed stage leaves
    the old artifact or none, never half of one (a SIGKILL may leave its path.tmpPID behind)."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp, old = f"{path}.tmp{os.getpid()}", f"{path}.old{os.getpid()}"
    try:
        write_fn(tmp)
        if os.path.isdir(path) and not os.path.islink(path):
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException as e:  # disk full (OSError, safetensors' own error), Ctrl-C: no temporary stays
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        elif os.path.lexists(tmp):
            os.remove(tmp)
        if isinstance(e, Exception):
            die(f"could not write {path} ({getattr(e, 'strerror', None) or e}); it was left as it was")
        raise


def save_text(path, text):
    """Write a text file atomically (write_atomic)."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    write_atomic(path, write)


def log_metrics(path, *records):
    """Append JSON objects to <run>/metrics.jsonl (no-op without --metrics), atomically: a full disk
    leaves the file as it was. A stage logs once its artifact is written, so a rerun adds no duplicates."""
    if path:
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        save_text(path, old + "".join(json.dumps(r) + "\n" for r in records))


EPISODE_KEYS = {"env": str, "task_id": (str, int), "instruction": str, "task": str, "obs0": str, "steps": list,
                "reward": float, "success": bool, "source": str}
STEP_KEYS = {"text": str, "action": str, "obs": str, "r_env": float, "label": str, "r_aux": float, "done": bool}
MAX_REWARD = 100.0  # |r_env|, |r_aux|, |reward|, |adv| above this is a broken buffer, not a reward


def field_error(obj, types):
    """What is wrong with a JSON object given the types of its keys (float: a finite number of at
    most MAX_REWARD in size), or None."""
    if not isinstance(obj, dict):
        return f"not a JSON object but {json.dumps(obj)[:40]}"
    for key, t in types.items():
        value = obj.get(key)
        if key not in obj:
            return f"lacks {key}"
        if t is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= MAX_REWARD):
            return f"{key} must be a finite number of at most {MAX_REWARD:g} in size, got {json.dumps(value)[:40]}"
        if t is not float and not isinstance(value, t):
            return f"{key} has the wrong type: {json.dumps(value)[:40]}"
    return None


def episode_error(ep, step_keys):
    """What is wrong with one episode (docs/design.md, 'The episode JSONL'), or None."""
    problem = field_error(ep, EPISODE_KEYS)
    if problem or not ep["steps"]:
        return problem or "has no steps"
    for t, step in enumerate(ep["steps"]):
        problem = field_error(step, step_keys)
        if problem:
            return f"{problem} at step {t}"
    return None


def read_episodes(paths, step_keys=STEP_KEYS):
    """Read episode JSONL files; reject a bad line (or a binary file) with its file and line number."""
    episodes = []
    for path in paths:
        if not os.path.isfile(path):
            die(f"{path}: no such file; pass an episode JSONL written by 02_collect.py")
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    ep = json.loads(line.decode("utf-8")) if line.strip() else None
                except (UnicodeDecodeError, ValueError) as e:
                    die(f"{path}:{lineno}: not a line of JSON text ({type(e).__name__})")
                problem = None if ep is None else episode_error(ep, step_keys)
                if problem:
                    die(f"{path}:{lineno}: episode {problem}; is this an episode JSONL from 02_collect.py (or 04_gae.py)?")
                episodes += [ep] if ep is not None else []
    if not episodes:
        die(f"no episodes in {', '.join(paths)}; collect some with 02_collect.py first")
    return episodes


def load_tokenizer(path):
    """A local Hugging Face tokenizer with a chat template (nothing is downloaded)."""
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        die(f"{path}: no tokenizer_config.json; pass a model directory from 01_bc.py / 05_bppo.py")
    if os.path.exists(os.path.join(path, "heads.safetensors")):
        die(f"{path} is a critic directory (03_critic.py output), not a policy")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a file it cannot read, or one that needs a library not installed
        die(f"{path}: cannot load the tokenizer ({e})")
    if not tokenizer.chat_template:
        die(f"{path}: the tokenizer has no chat template (docs/design.md, 'The chat layout')")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(auto_class, path, dtype):
    """auto_class.from_pretrained on a local directory (nothing downloaded, no code run), refused
    when it is broken or lacks a tensor (transformers would fill that in with random weights)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        die(f"{path}: no config.json; pass a model directory from 01_bc.py / 05_bppo.py")
    try:
        model, info = auto_class.from_pretrained(path, local_files_only=True, dtype=dtype, output_loading_info=True)
    except Exception as e:  # safetensors, JSON and transformers errors all mean: this directory is broken
        die(f"{path}: cannot load the model ({e})")
    if info["missing_keys"]:
        die(f"{path}: the checkpoint lacks {len(info['missing_keys'])} tensors ({sorted(info['missing_keys'])[0]}, ...)")
    return model


def check_finite(tensors, what):
    """A diverged update (non-finite weights) is refused instead of saved."""
    if not all(torch.isfinite(t).all() for t in tensors):
        die(f"{what} has non-finite weights (the update diverged); nothing written - lower --lr")


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device():
    """CUDA with bf16 when available, else CPU with fp32 (bf16 is ~20x slower on CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def tokenize_all(tokenizer, episodes, max_len):
    """Tokenize every episode; drop (and count) those longer than the model's context."""
    kept, dropped = [], 0
    for ep in episodes:
        x = tokenize_episode(tokenizer, ep)
        if len(x["input_ids"]) > max_len:
            dropped += 1
            continue
        kept.append((ep, x))
    if dropped:
        print(f"note: dropped {dropped} of {len(episodes)} trajectories longer than the context ({max_len} tokens)")
    return kept


def length_batches(lengths, batch_size, rng):
    """Batches of indices with similar lengths (little padding), in random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def cost(n_tokens, seconds, device):
    """What the stage costs, for its printout and metrics: tokens through the model per second
    (this process, padding excluded) and peak memory in GB - the GPU's, else the process's
    resident set (ru_maxrss: KB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)
    return {"tokens_per_s": n_tokens / max(seconds, 1e-9), "peak_mem_gb": peak}


# Several processes (torchrun); skip unless you launch a stage with torchrun (docs/distributed.md).
def setup_distributed():
    """Under torchrun (WORLD_SIZE > 1): join the process group (nccl on GPUs, one per process;
    gloo on CPU) -> (rank, world size). A plain `python` run gets (0, 1) and nothing happens."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # then pick_device's "cuda" is this GPU
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return torch.distributed.get_rank(), world


def is_main():
    """Whether this process writes artifacts, metrics and the progress bar (rank 0, or alone)."""
    return int(os.environ.get("RANK", 0)) == 0


def finish_distributed():
    """Tear the process group down on every rank together: a rank that left while another was
    still writing the output could abort in gloo's teardown ("terminate called without an
    active exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def distribute(model, world, fsdp):
    """The module to train: the model itself when alone; under torchrun DDP (a whole copy per
    process, gradients averaged over processes) or, with --fsdp, FSDP2 (each decoder layer,
    then the rest, sharded across processes, for a model one device cannot hold; in place)."""
    if world == 1:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]:
            fully_shard(layer)
        # The root is resharded after every forward too: left whole after a no_grad forward
        # (evaluation), its weights missed the next updates (seen with torch 2.13 on gloo).
        return fully_shard(model, reshard_after_forward=True)
    device = next(model.parameters()).device
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def full_state(model, fsdp):
    """With --fsdp under torchrun, the whole state dict gathered on rank 0 (every rank must call
    this); otherwise None: the model saves its own weights."""
    if not (fsdp and torch.distributed.is_initialized()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    own = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}  # a tied weight once
    return {k: v for k, v in state.items() if k in own}


def shard(idx, rank, world):
    """This rank's part of a global batch (every rank builds the same batches from the same
    seed) -> (indices, weight). A rank left with none (a last batch smaller than the world)
    re-reads the first trajectory with weight 0: DDP needs every rank in every step."""
    mine = idx[rank::world]
    return (mine, 1.0) if mine else (idx[:1], 0.0)


def micro_batches(idx, n):
    """This rank's part of the global batch as n micro-batches of indices -> [(indices, weight)],
    always n of them: an empty one re-reads the first trajectory with weight 0, so every rank runs
    the same number of forward passes (FSDP2 gathers the weights in each)."""
    return [(idx[i::n], 1.0) if idx[i::n] else (idx[:1], 0.0) for i in range(n)]


def part_shares(counts, world):
    """The weight of each micro-batch's mean loss in the step: counts (this rank's micro-batches:
    action tokens, step weights; 0 for a part with weight 0) -> world * count / (the count of the
    whole global batch, over every micro-batch and rank). Summed over this rank's parts, the
    weighted means give this rank's share of the global batch's mean loss, and DDP's gradient
    average over ranks (1/world) gives the gradient of the single-process, single-batch loss."""
    counts = torch.stack([torch.as_tensor(c).detach().float() for c in counts])
    total = counts.sum()
    if world > 1:
        torch.distributed.all_reduce(total)
    return counts * world / total.clamp(min=1e-8)


def average_info(infos, shares, world):
    """The numbers of each micro-batch's info (means over its count), averaged over the global batch
    with part_shares: the single-process numbers."""
    numbers = sum(torch.tensor(list(info.values())) * share.cpu() / world for info, share in zip(infos, shares))
    if world > 1:
        numbers = numbers.to(shares.device)
        torch.distributed.all_reduce(numbers)
    return dict(zip(infos[0], numbers.tolist()))


def grad_sync(model, world, fsdp, on):
    """Distributed: reduce gradients across processes in this backward or not. Off for every micro-batch
    but the last, so each optimizer step communicates once, as without accumulation."""
    if world > 1 and fsdp:
        model.set_requires_gradient_sync(on)
    elif world > 1:
        model.require_backward_grad_sync = on


if __name__ == "__main__":
    main()
