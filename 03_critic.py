"""Stage 03 - the in-distribution critic: weighted implicit Q-learning on a fixed buffer.

Reads   the hybrid buffer D = D_expert U D_self (episode JSONL files with labels, from 02),
        and the policy whose transformer initialises the critic (--policy, pi_{k-1}).
Writes  --out DIR: the critic (backbone save_pretrained + heads.safetensors + args.json).

IQL learns values only on actions that are in the data - no max over actions the data
never took - so the values stay in distribution (paper, Key Design 2). With step weights

    w_t = (t/T + d) * 0.5 + 0.5,  t = 1..T,  d = 1 if the trajectory's final env reward != 0

the two regressions are:

    L_V = E[ w_t * L2_tau( Qbar(s_t, a_t) - V(s_t) ) ],   L2_tau(u) = |tau - 1(u < 0)| * u^2
    L_Q = E[ w_t * ( r_t + gamma * (1 - done_t) * V(s_{t+1}) - Q(s_t, a_t) )^2 ],  r_t = r_env + r_aux

With tau > 0.5, V is an upper expectile of Q over the actions in the data; the default 0.5 is
their mean, which kept V calibrated on household (docs/policy_improvement.md). Qbar is a
Polyak-averaged copy of the Q head. The step limit is part of the task (--time-limit terminal,
the default): the agent reads how many turns it has taken, a trajectory cut by the limit ends
there (done = 1, nothing after it), and a step that wastes time is worth less than one that
makes progress. With --time-limit bootstrap the cut is an artefact of collection instead and
the last step bootstraps from V(s_T).

Design choice: V and Q share one transformer body (one forward pass per trajectory gives
every V and Q); the target Qbar is the Polyak average of the Q head, applied to the
body's features with gradients stopped.

    python 03_critic.py --policy runs/demo/policy_0 --out runs/demo/iter_1/critic
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
                   help="expectile of V (0.5 = mean, calibrated on household; > 0.5 leans to the better actions)")
    p.add_argument("--gamma", type=float, default=0.95, help="discount factor of the Bellman backup")
    p.add_argument("--polyak", type=float, default=0.05, help="target update rate: Qbar <- (1 - polyak) Qbar + polyak Q")
    p.add_argument("--epochs", type=int, default=4, help="passes over the buffer (fewer leave V optimistic)")
    p.add_argument("--batch-size", type=int, default=16, help="trajectories per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (heads and body)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step: the same step in less memory (the batch is still --batch-size)")
    p.add_argument("--time-limit", choices=["bootstrap", "terminal"], default="terminal",
                   help="a trajectory cut by the step limit: 'bootstrap' from V(s_T) (the cut is an artefact), 'terminal': "
                        "V = 0 after it (the limit is part of the task)")
    p.add_argument("--uniform-weights", action="store_true", help="ablation 'w/o W-IQL': w_t = 1")
    p.add_argument("--no-aux", action="store_true", help="ablation 'w/o RR': the critic sees r_aux = 0")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--metrics", default="", help="append per-epoch metrics to this JSONL file")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model across processes (FSDP2) instead of a copy each (DDP)")
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
            raise ValueError("the chat template does not render a conversation as a prefix of its "
                             "continuation; this model's template is not supported")
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


def trajectory_tensors(episodes, device, time_limit="bootstrap"):
    """Per-step tensors (B, T), zero-padded: r_env, r_aux, done, and the step mask. With
    time_limit 'terminal' the last step of a truncated trajectory is done too."""
    T = max(len(ep["steps"]) for ep in episodes)
    out = {k: torch.zeros((len(episodes), T), device=device) for k in ("r_env", "r_aux", "done", "mask")}
    for i, ep in enumerate(episodes):
        n = len(ep["steps"])
        out["r_env"][i, :n] = torch.tensor([s["r_env"] for s in ep["steps"]])
        out["r_aux"][i, :n] = torch.tensor([s["r_aux"] for s in ep["steps"]])
        out["done"][i, :n] = torch.tensor([float(s["done"]) for s in ep["steps"]])
        if time_limit == "terminal" and not ep["steps"][-1]["done"]:  # cut by the step limit
            out["done"][i, n - 1] = 1.0
        out["mask"][i, :n] = 1.0
    return out


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: weighted IQL, and the critic it trains: the policy's transformer body
# with a V head and a Q head (the Critic class is copied in 02 and 04).
# ----------------------------------------------------------------------------------------
def step_weights(T, d):
    """Paper eq. (W-IQL step weight): w_t = (t/T + d) * 0.5 + 0.5 for t = 1..T -> (T,)."""
    t = torch.arange(1, T + 1, dtype=torch.float)
    return (t / T + float(d)) * 0.5 + 0.5


def expectile_loss(u, tau, weight=None):
    """Paper eq. (IQL value loss): weighted mean of |tau - 1(u < 0)| * u^2.
    weight None means uniform; zero weights drop entries (padding)."""
    loss = torch.abs(tau - (u < 0).float()) * u ** 2
    if weight is None:
        return loss.mean()
    return (weight * loss).sum() / weight.sum().clamp(min=1e-8)


def weighted_mse(u, weight):
    """Paper eq. (IQL Q loss), weighted like expectile_loss."""
    return (weight * u ** 2).sum() / weight.sum().clamp(min=1e-8)


def batch_weights(episodes, uniform, device):
    """(B, T) step weights, 0 on padding; d = 1 if the last env reward is non-zero."""
    T = max(len(ep["steps"]) for ep in episodes)
    w = torch.zeros((len(episodes), T), device=device)
    for i, ep in enumerate(episodes):
        n = len(ep["steps"])
        w[i, :n] = 1.0 if uniform else step_weights(n, ep["steps"][-1]["r_env"] != 0)
    return w


def iql_losses(critic, target_q_head, batch, traj, weights, tau, gamma, use_aux):
    """One forward pass -> (L_V + L_Q, info). Per-step tensors (traj, weights) are (B, T).
    info holds what the stage prints: L_V, L_Q, and the mean V(s_t) and Q(s_t, a_t) over the
    batch's real steps."""
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
    """One forward pass over a trajectory gives every V(s_t) (read at state positions,
    the last token of each generation prompt) and every Q(s_t, a_t) (read at action
    positions, the last token of each reply)."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        d = backbone.config.hidden_size

        def head():
            return torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, 1))
        self.v_head, self.q_head = head(), head()

    def forward(self, batch):
        """-> the body's features at the action positions (B, T, d) (03 applies its target Q head
        to them), V (B, T+1) at every state, Q (B, T) at every action."""
        h = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        d = h.shape[-1]
        h_state = h.gather(1, batch["state_pos"][..., None].expand(-1, -1, d))    # (B, T+1, d)
        h_action = h.gather(1, batch["action_pos"][..., None].expand(-1, -1, d))  # (B, T, d)
        return h_action, self.v_head(h_state.float()).squeeze(-1), self.q_head(h_action.float()).squeeze(-1)

    def save(self, out_dir, tokenizer, args, state=None):
        """state: the whole state dict when the critic is sharded (03 --fsdp); by default its own."""
        state = self.state_dict() if state is None else state

        def write(tmp):
            backbone = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
            self.backbone.save_pretrained(tmp, state_dict=backbone)
            tokenizer.save_pretrained(tmp)
            heads = {k: v for k, v in state.items() if k.startswith(("v_head.", "q_head."))}
            save_file({k: v.contiguous().cpu() for k, v in heads.items()}, os.path.join(tmp, "heads.safetensors"))
            with open(os.path.join(tmp, "args.json"), "w") as f:
                json.dump(args, f, indent=2)
        write_atomic(out_dir, write)

    @classmethod
    def load(cls, path, device, dtype):
        """A critic directory written by 03_critic.py (backbone + heads.safetensors)."""
        check_model_dir(path, "critic")
        critic = cls(load_pretrained(AutoModel, path, dtype))
        try:
            heads = load_file(os.path.join(path, "heads.safetensors"))
            critic.v_head.load_state_dict({k[7:]: v for k, v in heads.items() if k.startswith("v_head.")})
            critic.q_head.load_state_dict({k[7:]: v for k, v in heads.items() if k.startswith("q_head.")})
        except Exception as e:  # a truncated file, or heads of another size than the backbone's
            die(f"{path}: cannot load heads.safetensors ({' '.join(str(e).split())[:300]})")
        return critic.to(device)


def discounted_returns(rewards, gamma):
    out, g = [], 0.0
    for r in reversed(rewards):
        g = r + gamma * g
        out.append(g)
    return out[::-1]


def critic_report(critic, data, batch_size, pad_id, gamma, use_aux, device):
    """What the critic learned, for a student to read: V and Q by data source (mean and std
    over every step) and how much of the Monte-Carlo return-to-go (with the rewards the critic
    learned from) V explains: explained variance, 1 = perfectly, 0 = no better than a constant;
    and the mean return by source, which the mean V should be near (an expectile tau > 0.5 and
    the W-IQL weights lift V above it; far above, V is optimistic and GAE blames the last steps)."""
    stats = {s: {"v": [], "q": [], "ret": []} for s in ("expert", "self")}
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            eps = [ep for ep, _ in data[i:i + batch_size]]
            batch = {k: v.to(device) for k, v in collate([x for _, x in data[i:i + batch_size]], pad_id).items()}
            _, v_all, q = critic(batch)
            for j, ep in enumerate(eps):
                n = len(ep["steps"])
                rewards = [s["r_env"] + (s["r_aux"] if use_aux else 0.0) for s in ep["steps"]]
                s = stats[ep["source"] if ep["source"] in stats else "self"]
                s["v"] += v_all[j, :n].tolist()
                s["q"] += q[j, :n].tolist()
                s["ret"] += discounted_returns(rewards, gamma)
    v_all_ = np.array(stats["expert"]["v"] + stats["self"]["v"])
    ret_all = np.array(stats["expert"]["ret"] + stats["self"]["ret"])
    report = {"explained_variance": float(1 - np.var(ret_all - v_all_) / max(np.var(ret_all), 1e-8))}
    for src, s in stats.items():
        if s["v"]:
            report[f"{src}_v_mean"], report[f"{src}_v_std"] = float(np.mean(s["v"])), float(np.std(s["v"]))
            report[f"{src}_q_mean"], report[f"{src}_q_std"] = float(np.mean(s["q"])), float(np.std(s["q"]))
            report[f"{src}_ret_mean"] = float(np.mean(s["ret"]))  # calibration: V should be near this
    return report


def main(argv=None):
    args = parse_args(argv)
    # Every input is checked before any work, and --out is replaced only by a finished critic.
    check_flags(args, tau="in (0, 1)", gamma="in [0, 1]", polyak="in (0, 1]", epochs="at least 1",
                batch_size="at least 1", grad_accum="at least 1", lr="positive", grad_clip="positive",
                threads="non-negative")
    check_out(args.out, "critic", args.data + [args.policy])
    if args.metrics:
        check_out(args.metrics, "log", args.data + [args.policy, args.out])
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = setup_distributed()  # distributed (torchrun: docs/distributed.md); alone: 0, 1
    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed)
    device, dtype = pick_device()
    episodes = read_episodes(args.data)
    tokenizer = load_tokenizer(args.policy)
    critic = Critic(load_pretrained(AutoModel, args.policy, dtype)).to(device)
    data = tokenize_all(tokenizer, episodes, critic.backbone.config.max_position_embeddings)
    if not data:
        die("no trajectory fits the model's context")
    target_q_head = copy.deepcopy(critic.q_head).requires_grad_(False)
    train_critic = distribute(critic, world, args.fsdp)  # distributed: DDP or FSDP2; alone: the critic itself
    optimizer = torch.optim.AdamW(critic.parameters(), lr=args.lr, weight_decay=0.0)
    n_src = {s: sum(ep["source"] == s for ep, _ in data) for s in ("expert", "self")}
    print(f"03_critic: {len(data)} trajectories ({n_src['expert']} expert, {n_src['self']} self), "
          f"{sum(len(ep['steps']) for ep, _ in data)} steps; tau {args.tau}, gamma {args.gamma}, "
          f"weights {'uniform' if args.uniform_weights else 'W-IQL'}, aux rewards {'off' if args.no_aux else 'on'}")

    rng = random.Random(args.seed)
    lengths = [len(x["input_ids"]) for _, x in data]
    steps_total = args.epochs * ((len(data) + args.batch_size - 1) // args.batch_size)
    bar = tqdm(total=steps_total, desc="03_critic", unit="step", disable=not is_main())
    step, t0, records, n_tok = 0, time.time(), [], 0
    for epoch in range(args.epochs):
        sums = {"loss_v": 0.0, "loss_q": 0.0, "n": 0}
        for idx in length_batches(lengths, args.batch_size, rng):
            mine, keep = shard(idx, rank, world)  # distributed: this rank's part of the global batch
            parts = []
            for part, w in micro_batches(mine, args.grad_accum):
                eps = [data[j][0] for j in part]
                batch = {k: v.to(device) for k, v in collate([data[j][1] for j in part], tokenizer.pad_token_id).items()}
                parts.append((batch, trajectory_tensors(eps, device, args.time_limit), batch_weights(eps, args.uniform_weights, device),
                              keep * w))
            # L_V and L_Q are means over the step weights of the whole global batch
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
                    p_t.lerp_(whole(p), args.polyak)
            sums["loss_v"] += info["loss_v"]
            sums["loss_q"] += info["loss_q"]
            sums["n"] += 1
            step += 1
            bar.update(1)
            bar.set_postfix(L_V=f"{info['loss_v']:.4f}", L_Q=f"{info['loss_q']:.4f}", V=f"{info['v_mean']:+.3f}",
                            Q=f"{info['q_mean']:+.3f}")
        record = {"stage": "03_critic", "epoch": epoch + 1, "step": step, "loss_v": sums["loss_v"] / sums["n"],
                  "loss_q": sums["loss_q"] / sums["n"], "elapsed_s": time.time() - t0,
                  **cost(n_tok, time.time() - t0, device)}
        records.append(record)
        tqdm.write(f"epoch {epoch + 1}: L_V {record['loss_v']:.4f}  L_Q {record['loss_q']:.4f}")
    bar.close()

    critic.eval()
    summary = {"stage": "03_critic", "step": step,
               **critic_report(critic, data, args.batch_size, tokenizer.pad_token_id, args.gamma, not args.no_aux, device)}
    state = full_state(critic, args.fsdp)  # distributed --fsdp: gather the shards; else None
    if not is_main():  # distributed: rank 0 alone writes
        return finish_distributed()
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


# ----------------------------------------------------------------------------------------
# Plumbing identical in every stage; skip on a first reading. Copied on purpose (CleanRL style)
# so that each stage stands alone: every copy stays byte-identical (tests/test_stage_copies.py
# checks), and a stage carries only the helpers it calls.
# ----------------------------------------------------------------------------------------
def cost(n_tokens, seconds, device):
    """What the stage costs, for its printout and metrics: tokens through the model per second
    (this process, padding excluded) and peak memory in GB - the GPU's, else the process's
    resident set (ru_maxrss: KB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)
    return {"tokens_per_s": n_tokens / max(seconds, 1e-9), "peak_mem_gb": peak}


def die(msg):
    """Bad input: one clear sentence on stderr, exit code 2, nothing written."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def check_flags(args, **rules):
    """Numeric flags, checked before any work: each rule says what the flag must be."""
    tests = {"at least 1": lambda v: v >= 1, "non-negative": lambda v: v >= 0, "positive": lambda v: v > 0,
             "in [0, 1]": lambda v: 0 <= v <= 1, "in (0, 1)": lambda v: 0 < v < 1, "in (0, 1]": lambda v: 0 < v <= 1}
    for name, rule in rules.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and tests[rule](value)):
            die(f"--{name.replace('_', '-')} must be {rule}, got {value}")


ARTIFACTS = {"policy": "a policy directory written by 01_bc.py / 05_bppo.py",
             "critic": "a critic directory written by 03_critic.py",
             "02_collect": "an episode JSONL (or its .json summary) written by 02_collect.py",
             "04_gae": "a JSONL with advantages (or its .json summary) written by 04_gae.py",
             "log": "a metrics JSONL"}


def replaceable(path, kind):
    """Whether an existing path holds an artifact of this kind (ARTIFACTS) that a stage may
    replace (or, for a log, append to); a .json path is the summary of a stage's JSONL.
    A run directory, a checkout, '.' or another stage's output never is one."""
    if kind in ("policy", "critic"):
        names = [] if os.path.islink(path) or not os.path.isdir(path) else os.listdir(path)
        return ({"config.json", "args.json"} <= set(names) and ("heads.safetensors" in names) == (kind == "critic")
                and all(os.path.isfile(os.path.join(path, n)) for n in names))
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            text = f.readline() if kind == "log" or path.endswith(".jsonl") else f.read()
        obj = json.loads(text) if text.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(obj, dict) or not obj:
        return obj == {}  # an empty file holds nothing to lose
    if kind == "log":
        return "stage" in obj
    if path.endswith(".json"):
        return obj.get("stage") == kind
    steps = obj.get("steps")  # a JSONL: its first episode, with advantages if 04_gae.py wrote it
    return isinstance(steps, list) and all(isinstance(s, dict) and ("adv" in s) == (kind == "04_gae") for s in steps)


def check_out(path, kind, inputs=()):
    """Before any work: an output may name nothing yet or an artifact of the stage's own kind,
    never an input (or a directory holding one) nor anything else; its parent must be writable.
    The JSONL of 02 / 04 must end in .jsonl: its summary goes beside it as .json."""
    real = os.path.realpath(path)
    for p in inputs:
        if os.path.realpath(p) == real or os.path.realpath(p).startswith(real + os.sep):
            die(f"{path} is (or holds) an input of this stage; write the output elsewhere")
    if kind in ("02_collect", "04_gae") and not path.endswith(".jsonl"):
        die(f"{path}: the output must end in .jsonl (the summary goes beside it with .json)")
    for p in [path] + ([path[:-len(".jsonl")] + ".json"] if kind in ("02_collect", "04_gae") else []):
        if os.path.lexists(p) and not replaceable(p, kind):
            die(f"{p} exists and is not {ARTIFACTS[kind]}; refusing to replace it (pick another path)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # a real file, not os.access: that says yes to root on a read-only or special file system
        probe = os.path.join(parent, f".write_test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        die(f"cannot write {path}: {parent} is not a writable directory ({e.strerror})")


def check_model_dir(path, kind):
    """Before any work: path is a 'policy' (01 / 05 output, or a local Hugging Face causal LM)
    or a 'critic' (03 output) directory with the files that kind needs, its JSON readable."""
    what = "a model directory from 01_bc.py / 05_bppo.py (or a local Hugging Face model)" \
        if kind == "policy" else "a critic directory from 03_critic.py"
    if not os.path.isdir(path):
        die(f"{path}: no such directory; pass {what}")
    need = ["config.json", "tokenizer_config.json"] + (["heads.safetensors", "args.json"] if kind == "critic" else [])
    missing = [name for name in need if not os.path.isfile(os.path.join(path, name))]
    if missing:
        die(f"{path} is not {what} (no {', '.join(missing)})")
    if kind == "policy" and os.path.exists(os.path.join(path, "heads.safetensors")):
        die(f"{path} is a critic directory (03_critic.py output), not a policy")
    for name in ("config.json", "args.json"):
        if os.path.isfile(os.path.join(path, name)):
            try:
                with open(os.path.join(path, name)) as f:
                    assert isinstance(json.load(f), dict)
            except (UnicodeDecodeError, json.JSONDecodeError, AssertionError):
                die(f"{os.path.join(path, name)}: not a valid JSON object")
    with open(os.path.join(path, "config.json")) as f:
        if "model_type" not in json.load(f):
            die(f"{os.path.join(path, 'config.json')}: no model_type; this is not a Hugging Face model config")
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors") and not complete_safetensors(os.path.join(path, name)):
            die(f"{os.path.join(path, name)}: truncated, or not a safetensors file")


def complete_safetensors(path):
    """Whether a .safetensors file is whole: an 8-byte header size, a JSON header, and the
    bytes of every tensor it lists (read before loading anything, so nothing is half loaded)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 8 + n <= size else None
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        return 8 + n + max(ends, default=0) <= size
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return False


def load_pretrained(auto_class, path, dtype):
    """auto_class.from_pretrained on a local directory (nothing downloaded, no code run); a
    broken directory (truncated weights, a config it cannot use) is one error line."""
    try:
        return auto_class.from_pretrained(path, local_files_only=True, dtype=dtype)
    except Exception as e:  # safetensors, JSON and transformers errors all mean: this directory is broken
        die(f"{path}: cannot load the model ({' '.join(str(e).split())[:300]})")


def load_tokenizer(path, kind="policy"):
    """A local Hugging Face tokenizer with a chat template (nothing is downloaded)."""
    check_model_dir(path, kind)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a tokenizer file it cannot read, or one that needs a library not installed
        die(f"{path}: cannot load the tokenizer ({' '.join(str(e).split())[:300]})")
    if not tokenizer.chat_template:
        die(f"{path}: the tokenizer has no chat template; this project needs one (docs/design.md, 'The chat layout')")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


EPISODE_KEYS = {"env": str, "task_id": (str, int), "instruction": str, "task": str, "obs0": str, "steps": list,
                "reward": float, "success": bool, "source": str}


STEP_KEYS = {"text": str, "action": str, "obs": str, "r_env": float, "label": str, "r_aux": float, "done": bool}


def field_error(obj, types):
    """What is wrong with a JSON object given the types of its keys (float: a finite number,
    at most 1e6 in size, so that no loss overflows), or None when nothing is."""
    if not isinstance(obj, dict):
        return f"not a JSON object but {json.dumps(obj)[:40]}"
    for key, t in types.items():
        if key not in obj:
            return f"lacks {key}"
        value = obj[key]
        if t is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= 1e6):
            return f"{key} must be a finite number (at most 1e6 in size), got {json.dumps(value)[:40]}"
        if t is not float and not isinstance(value, t):
            return f"{key} has the wrong type: {json.dumps(value)[:40]}"
    return None


def episode_error(ep, step_keys):
    """What is wrong with one episode (docs/design.md, 'The episode JSONL'), or None when nothing is."""
    problem = field_error(ep, EPISODE_KEYS)
    if problem or not ep["steps"]:
        return problem or "has no steps"
    for t, step in enumerate(ep["steps"]):
        problem = field_error(step, step_keys)
        if problem:
            return f"{problem} at step {t}"
    return None


def read_episodes(paths, step_keys=STEP_KEYS):
    """Read episode JSONL files (docs/design.md, 'The episode JSONL'); reject a bad line with file and line number."""
    episodes = []
    for path in paths:
        if not os.path.isfile(path):
            die(f"{path}: no such file; pass an episode JSONL written by 02_collect.py")
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ep = json.loads(line)
                except json.JSONDecodeError as e:
                    die(f"{path}:{lineno}: not valid JSON ({e.msg})")
                problem = episode_error(ep, step_keys)
                if problem:
                    die(f"{path}:{lineno}: episode {problem}; is this an episode JSONL from 02_collect.py (or 04_gae.py)?")
                episodes.append(ep)
    if not episodes:
        die(f"no episodes in {', '.join(paths)}; collect some with 02_collect.py first")
    return episodes


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


def stale(pid):
    """Whether no process has this id any more (its temporary files are leftovers)."""
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove(path):
    """Delete a file or a directory tree, if it is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def write_atomic(path, write_fn):
    """Write a file or directory via a temporary sibling and one rename: a killed stage
    leaves the previous state or nothing, never half an artifact. The temporaries of a
    killed stage (path.tmpPID, path.oldPID) are removed here; a failed write leaves none."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    for entry in os.listdir(parent):
        pid = entry[len(name) + 4:]
        if entry[:len(name) + 4] in (name + ".tmp", name + ".old") and pid.isdigit() and stale(int(pid)):
            remove(os.path.join(parent, entry))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write_fn(tmp)
    except BaseException as e:  # disk full, killed by Ctrl-C, ...: no half-written temporary stays
        remove(tmp)
        if isinstance(e, OSError):
            die(f"could not write {path} ({e.strerror or e}); it was left as it was")
        raise
    if os.path.isdir(path) and not os.path.islink(path):
        old = f"{path}.old{os.getpid()}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def log_metrics(path, *records):
    """Append JSON objects to <run>/metrics.jsonl (no-op without --metrics). A stage logs once
    its artifact is written, so a killed and rerun stage leaves no duplicate records."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device():
    """CUDA with bf16 when available, else CPU with fp32 (bf16 is ~20x slower on CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


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


def whole(p):
    """A parameter as one tensor: with --fsdp each process holds a shard (a DTensor), gathered here."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


if __name__ == "__main__":
    main()
