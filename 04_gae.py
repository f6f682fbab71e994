"""Stage 04 - process rewards: GAE advantages from the critic's V.

Reads   the buffer (the episode JSONL files 03 learned on) and the critic directory from 03.
Writes  --out FILE.jsonl: the buffer with "v" (V(s_t)), "q" (Q(s_t, a_t), for show_credit.py) and "adv" (A_t)
        on every step, and FILE.json: the diagnostics it printed and its arguments.

A single-step advantage Q - V is noisy over long horizons, so the paper fills the missing intermediate
rewards with multi-step advantages (paper, Key Design 3):

    delta_t = r_t + gamma * (1 - done_t) * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}

done_t is 1 on the last step, at a true terminal or at the step limit (as in 03: the limit ends the task,
V = 0 after it). r_t is r_env alone, as in the paper: the rule-based r_aux shapes the critic (03 learns Q
on r_env + r_aux), not the advantage. For a critic at its fixed point

    r_env_t + gamma V(s_{t+1}) - V(s_t)  =  (Q(s_t, a_t) - V(s_t)) - r_aux_t

so a penalised step is judged by what it did to the rest of the episode, not by its label. --rewards
critic puts r_aux into r_t as well (an ablation row); --advantage qv is the single-step Q - V ('w/o GAE').

--advantage outcome is the outcome-level baseline (the GRPO / ETO family): no critic, no GAE, every step of
an episode gets the same credit, its return minus the buffer's mean return,

    A_t = R - mean(R),   R = sum_t r_env_t

written as q = R and v = mean(R), so the file reads like a critic's (q - v = A).

    python 04_gae.py --critic runs/demo/iter_1/critic --out runs/demo/iter_1/adv.jsonl \
        --data runs/demo/data/expert.jsonl runs/demo/iter_1/self.jsonl
    python 04_gae.py --advantage outcome --out runs/demo/iter_1/adv_outcome.jsonl \
        --data runs/demo/data/expert.jsonl runs/demo/iter_1/self.jsonl
"""
import argparse
import bisect
import math
import os

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer

import critic_report
from machine import add_machine_flags, autocast, start
from plumbing import (ARTIFACTS, MAX_REWARD, check_flags, die, fit_context, load_heads, load_model, owned,
                      read_episodes, read_json, save_episodes, stage_parser)


def parse_args(argv=None):
    p, a, d, m = stage_parser("Stage 04: per-step process rewards (GAE) from the critic.")
    d.add_argument("--data", nargs="+", required=True, help="episode JSONL files (the buffer the critic learned on)")
    d.add_argument("--critic", default="", help="critic directory from 03_critic.py (not with --advantage outcome)")
    d.add_argument("--out", required=True, help="output JSONL: the buffer with 'v', 'q' and 'adv' on every step")
    a.add_argument("--gamma", type=float, default=None, help="discount (None: the critic's)")
    a.add_argument("--lam", type=float, default=0.3, help="GAE lambda (1: Monte-Carlo return - V; 0: one-step TD)")
    a.add_argument("--advantage", choices=["gae", "qv", "outcome"], default="gae",
                   help="'qv': Q - V (ablation 'w/o GAE'); 'outcome': the episode's return - the buffer's mean")
    a.add_argument("--rewards", choices=["env", "critic"], default="env",
                   help="the r_t in delta_t: 'env' = r_env only (the paper's placement); 'critic' = the rewards the "
                        "critic learned on (r_env + r_aux, or r_env for a critic from 03 --no-aux; ablation)")
    m.add_argument("--batch-size", type=int, default=32, help="trajectories per forward pass")
    a.add_argument("--seed", type=int, default=0, help="random seed")
    add_machine_flags(m)  # --threads, --precision
    d.add_argument("--metrics", default="", help="append the diagnostics to this JSONL file")
    args = p.parse_args(argv)  # every flag is checked before any work
    check_flags(args, gamma="in [0, 1]", lam="in [0, 1]", batch_size="at least 1", seed="a seed in [0, 2**32)",
                threads="non-negative")
    given = p.parse_args(argv, argparse.Namespace(gamma=None, lam=None, rewards=None))  # None: a flag not given
    moot = [f"--{k}" for k in ("gamma", "lam", "rewards") if getattr(given, k) is not None]
    if args.advantage == "outcome" and moot:  # R - mean(R): no discount, no GAE, no critic
        die(f"--advantage outcome (R - mean(R)) has no use for {' '.join(moot)}; drop it")
    if (args.advantage == "outcome") == bool(args.critic):
        die("--advantage outcome uses no critic, and --critic names one" if args.critic else
            "--critic is required, except with --advantage outcome, which uses none")
    return args


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: generalized advantage estimation on the critic's V.
# ----------------------------------------------------------------------------------------
def gae(rewards, values, dones, gamma, lam):
    """Paper eq. (GAE process reward): delta_t = r_t + gamma * (1 - done_t) * V(s_{t+1}) - V(s_t),
    A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}. rewards (T,), values (T+1,) = V(s_0)..V(s_T), dones (T,)
    with 1 where step t ends the trajectory -> advantages (T,). The backward recursion is the
    algorithm's one loop over steps (docs/design.md, 'Conventions')."""
    rewards, values, dones = (np.asarray(x, dtype=np.float64) for x in (rewards, values, dones))
    not_done = 1.0 - dones
    deltas = rewards + gamma * not_done * values[1:] - values[:-1]
    adv, running = np.zeros_like(deltas), 0.0
    for t in reversed(range(len(deltas))):
        adv[t] = running = deltas[t] + gamma * lam * not_done[t] * running
    return adv


def episode_advantages(ep, values, q, gamma, lam, advantage, with_aux):
    """ep with "v" = V(s_t), "q" = Q(s_t, a_t) and "adv" = A_t on every step; values (T+1,) =
    V(s_0)..V(s_T), q (T,). A_t = gae(r, values, done) with r_t = r_env_t (with_aux: r_env_t + r_aux_t), or with
    advantage 'qv' A_t = Q(s_t, a_t) - V(s_t). done_{T-1} = 1: a true terminal or the step limit."""
    rewards = [s["r_env"] + (s["r_aux"] if with_aux else 0.0) for s in ep["steps"]]
    dones = [float(s["done"]) for s in ep["steps"][:-1]] + [1.0]
    adv = gae(rewards, values, dones, gamma, lam) if advantage == "gae" else q - values[:-1]
    steps = [dict(s, v=float(values[t]), q=float(q[t]), adv=float(adv[t])) for t, s in enumerate(ep["steps"])]
    return dict(ep, steps=steps)


def outcome_advantages(episodes):
    """--advantage outcome: A_t = R - mean(R) on every step of an episode (R = its sum of r_env), no critic."""
    returns = [sum(s["r_env"] for s in ep["steps"]) for ep in episodes]
    b = float(np.mean(returns))
    return [dict(ep, steps=[dict(s, v=b, q=R, adv=R - b) for s in ep["steps"]]) for ep, R in zip(episodes, returns)]


# ----------------------------------------------------------------------------------------
# The critic of 03 (copied byte-identical from 03_critic.py), and load_critic, which reads the directory 03 writes.
# ----------------------------------------------------------------------------------------
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


def load_critic(path, device):
    """A critic directory of 03 -> (the critic in eval mode, its tokenizer); refuses a missing or cut tensor."""
    if not owned(path, "critic"):
        die(f"{path} is not {ARTIFACTS['critic'][0]}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        die(f"{path}: cannot load the tokenizer ({e})")
    critic = load_heads(Critic(load_model(AutoModel, path)), path)  # a cut, empty or non-finite one: one line
    return critic.to(device).eval(), tokenizer


def critic_advantages(args, episodes, device, amp):
    """V and Q of every step from the critic (one forward pass per batch), then A_t -> (gamma, whether A_t uses
    r_aux, the share of self episodes 03 held out, the episodes with "v", "q" and "adv")."""
    critic, tokenizer = load_critic(args.critic, device)
    trained = read_json(os.path.join(args.critic, "args.json"))  # the flags 03 trained the critic with
    gamma = trained.get("gamma") if args.gamma is None else args.gamma
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
        die(f"{args.critic}/args.json: gamma must be a number in [0, 1], got {gamma!r}; or pass --gamma")
    with_aux = args.rewards == "critic" and not trained.get("no_aux", False)  # r_t of the advantage (03 --no-aux: none)
    holdout = trained.get("holdout", 0.0)  # 03 --holdout: these self episodes never reached its loss
    data = fit_context([(ep, tokenize_episode(tokenizer, ep)) for ep in episodes], critic.backbone.config)
    out_eps = [None] * len(data)  # in the buffer's order
    by_length = sorted(range(len(data)), key=lambda j: len(data[j][1]["input_ids"]))  # batches with little padding
    with torch.no_grad(), autocast(device, amp):  # one forward pass per batch: V at every state, Q at every action
        for i in tqdm(range(0, len(data), args.batch_size), desc="04_gae", unit="batch"):
            idx = by_length[i:i + args.batch_size]
            batch = {k: v.to(device) for k, v in collate([data[j][1] for j in idx], tokenizer.pad_token_id).items()}
            v_all, q = (x.double().numpy(force=True) for x in critic(batch)[1:])  # V (B, T+1), Q (B, T)
            for row, j in enumerate(idx):
                n = len(data[j][0]["steps"])
                out_eps[j] = episode_advantages(data[j][0], v_all[row, :n + 1], q[row, :n], gamma, args.lam,
                                                args.advantage, with_aux)
    return gamma, with_aux, holdout, out_eps


def main(argv=None):
    args = parse_args(argv)
    # Every input is checked before any work (the flags: parse_args); --out and its summary are written once every
    # advantage is in.
    _, device, amp = start(args, "04_gae", args.data + [args.critic] * bool(args.critic))  # --out, seed, device
    episodes = read_episodes(args.data)
    if args.advantage == "outcome":
        gamma, with_aux, holdout = 1.0 if args.gamma is None else args.gamma, False, 0.0
        out_eps = outcome_advantages(episodes)
        if len({ep["reward"] for ep in episodes}) == 1:  # one outcome for all: A_t = 0 everywhere
            print(f"04_gae: every episode has the return {episodes[0]['reward']:g}: nothing to compare (the outcome "
                  "advantage needs episodes of different returns, one success and one failure); every A_t is 0")
    else:
        gamma, with_aux, holdout, out_eps = critic_advantages(args, episodes, device, amp)
    if not all(math.isfinite(s["v"] + s["q"]) and abs(s["adv"]) <= MAX_REWARD for ep in out_eps for s in ep["steps"]):
        die(f"the critic gives a non-finite V or Q, or an advantage that is not a finite number of at most "
            f"{MAX_REWARD:g} in size; nothing written")

    how = {"qv": "Q - V", "outcome": "R - mean(R), the outcome-level baseline (no critic)"}.get(
        args.advantage, "GAE on r_env + r_aux" if with_aux else "GAE on r_env")
    summary = {"stage": "04_gae", "advantage": args.advantage, "rewards": args.rewards, "with_aux": with_aux,
               "how": how, "gamma": gamma, "lam": args.lam,
               **critic_report.report(out_eps, gamma, holdout, critic_report.env_kwargs_of(args.data))}
    save_episodes(args.out, out_eps, summary, args, args.metrics)  # and FILE.json, the summary
    critic_report.show(summary, args.out)


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
