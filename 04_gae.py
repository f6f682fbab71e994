"""Stage 04 - process rewards: GAE advantages from the critic's V.

Reads   the buffer (the same episode JSONL files as 03) and the critic directory from 03.
Writes  --out FILE.jsonl: the buffer with "v" (V(s_t)), "q" (Q(s_t, a_t), for inspection:
        show_credit.py) and "adv" (A_t) on every step,
        and FILE.json: the diagnostics printed at the end.

A single-step advantage Q - V is too noisy over long horizons, so the paper fills the
missing intermediate rewards with multi-step advantages (paper, Key Design 3):

    delta_t = r_t + gamma * (1 - done_t) * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}

r_t is the reward the critic learned on: r_env + r_aux (r_env alone for a critic trained with
03 --no-aux). Design choice, where this reference departs from the paper's wording: the paper
keeps the format / invalid / repeat rewards r_aux out of A_t ("environment rewards only") while
its critic learns on them. But a V that learned on r_aux already counts the penalties to come,
so without r_aux in delta_t each penalised step gets its penalty back:

    r_env_t + gamma V(s_{t+1}) - V(s_t)  =  (Q(s_t, a_t) - V(s_t)) - r_aux_t   (a critic at its fixed point)

and an invalid step whose only cost is its penalty looks *better* than the average step
(docs/policy_improvement.md, 'The advantage must use the critic's rewards'). --rewards env is the
paper's placement, kept for the ablation. A true terminal bootstraps 0; a trajectory cut by the
step limit ends there too with a critic trained with 03 --time-limit terminal (03's default), and
bootstraps from V(s_T) with one trained with --time-limit bootstrap.

With --baseline state, the advantages compare the actions taken at the same state: when
02 --samples-per-task K sampled several episodes on a task, the episodes share every state
until their actions differ, and

    A_t <- A_t - mean{ A_j : step j was taken at the same state as step t }

(the state = the task, o_0 and the actions and observations so far; a state visited once
gets A = 0). V(s_t) cancels, and with it a critic's bias at s_t: at each state the
advantages sum to zero, so the update raises some of the policy's replies and lowers others
instead of lowering nearly all of them (docs/policy_improvement.md).

The advantages are written as computed: 05's --adv-norm is the one place they are normalised.

    python 04_gae.py --critic runs/demo/iter_1/critic --out runs/demo/iter_1/adv.jsonl
        --data runs/demo/data/expert.jsonl runs/demo/iter_1/self.jsonl
"""
import argparse
import bisect
import json
import math
import os
import random
import shutil
import sys
from collections import Counter, defaultdict

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Stage 04: per-step process rewards (GAE) from the critic.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, help="episode JSONL files (the buffer the critic learned on)")
    p.add_argument("--critic", required=True, help="critic directory from 03_critic.py")
    p.add_argument("--out", required=True, help="output JSONL: the buffer with 'v' and 'adv' on every step")
    p.add_argument("--gamma", type=float, default=None, help="discount (default: the critic's)")
    p.add_argument("--lam", type=float, default=0.3,
                   help="GAE lambda (1: Monte-Carlo return - V; 0: one-step TD); small keeps the blame on the step where V drops")
    p.add_argument("--advantage", choices=["gae", "qv"], default="gae", help="'qv' = single-step Q - V (ablation 'w/o GAE')")
    p.add_argument("--rewards", choices=["critic", "env"], default="critic",
                   help="the r_t in delta_t: 'critic' = the rewards the critic learned on (r_env + r_aux, or r_env for "
                        "a critic from 03 --no-aux); 'env' = r_env only (the paper's placement, ablation)")
    p.add_argument("--baseline", choices=["critic", "state"], default="critic",
                   help="'state': subtract from A_t the mean A over the steps taken at the same state "
                        "(several samples per task, 02 --samples-per-task); a state visited once gets 0")
    p.add_argument("--batch-size", type=int, default=32, help="trajectories per forward pass")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--metrics", default="", help="append the diagnostics to this JSONL file")
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


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: generalized advantage estimation.
# ----------------------------------------------------------------------------------------
def gae(rewards, values, dones, gamma, lam):
    """Paper eq. (GAE process reward). rewards (T,), values (T+1,) = V(s_0)..V(s_T),
    dones (T,) with 1 where step t reached a true terminal state -> advantages (T,).
    The backward recursion is the algorithm's one loop over steps (docs/design.md, 'Conventions')."""
    rewards, values, dones = (np.asarray(x, dtype=np.float64) for x in (rewards, values, dones))
    not_done = 1.0 - dones
    deltas = rewards + gamma * not_done * values[1:] - values[:-1]
    adv = np.zeros_like(deltas)
    running = 0.0
    for t in reversed(range(len(deltas))):
        running = deltas[t] + gamma * lam * not_done[t] * running
        adv[t] = running
    return adv


def episode_advantages(ep, values, q, gamma, lam, advantage, with_aux, time_limit="bootstrap"):
    """Episode ep with "v" = V(s_t), "q" = Q(s_t, a_t) and "adv" = A_t on every step. values (T+1,) = V(s_0)..V(s_T),
    q (T,) = Q(s_t, a_t). A_t is GAE on the environment rewards (with_aux: plus r_aux), or
    with --advantage qv the single-step Q(s_t, a_t) - V(s_t) (the ablation 'w/o GAE')."""
    rewards = [s["r_env"] + (s["r_aux"] if with_aux else 0.0) for s in ep["steps"]]
    dones = [float(s["done"]) for s in ep["steps"]]
    if time_limit == "terminal" and not ep["steps"][-1]["done"]:
        dones[-1] = 1.0  # the step limit ends the task: nothing after it (03 --time-limit)
    adv = gae(rewards, values, dones, gamma, lam) if advantage == "gae" else q - values[:-1]
    return dict(ep, steps=[dict(s, v=float(values[t]), q=float(q[t]), adv=float(adv[t])) for t, s in enumerate(ep["steps"])])


def state_baseline(episodes):
    """--baseline state: A_t minus the mean A_t over every step of the buffer taken at the same
    state. A state is keyed by what determines it: the task, o_0, and the actions and observations
    so far (so a stochastic environment never merges two states). Returns the episodes with the
    new "adv" and the number of steps per group size."""
    groups = defaultdict(list)  # state key -> [(episode index, step index)]
    for i, ep in enumerate(episodes):
        key = (ep["env"], ep["split"], ep["task_id"], ep["obs0"])
        for t, s in enumerate(ep["steps"]):
            groups[key].append((i, t))
            key = key + (s["action"], s["obs"])
    sizes = Counter()
    for members in groups.values():  # every step is in exactly one group
        steps = [episodes[i]["steps"][t] for i, t in members]
        mean = sum(s["adv"] for s in steps) / len(steps)
        for s in steps:
            s["adv"] -= mean
        sizes[len(steps)] += len(steps)
    return episodes, dict(sorted(sizes.items()))


def auc(scores, labels):
    """Probability that a random positive scores above a random negative, ties counting 1/2
    (the Mann-Whitney statistic, from the average ranks of the scores)."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    n_pos, n_neg = labels.sum(), (~labels).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based rank, averaged over ties
    rank_sum = avg_rank[inverse][labels].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def advantage_report(episodes):
    """What a student should look at: do the process rewards make sense? Mean A_t by data source
    and by label, and how well V separates episodes that succeed from those that fail (AUC:
    0.5 = not at all, 1 = perfectly): V(s_0), which sees only the task, on self and on all
    episodes; V(s_t) of the self episodes at s_0..s_3 and at every state."""
    by_source, by_label = defaultdict(list), defaultdict(list)
    for ep in episodes:
        for s in ep["steps"]:
            by_source[ep["source"]].append(s["adv"])
            by_label[s["label"]].append(s["adv"])
    self_eps = [ep for ep in episodes if ep["source"] != "expert"]
    return {
        "adv_mean_by_source": {k: float(np.mean(v)) for k, v in sorted(by_source.items())},
        "adv_mean_by_label": {k: float(np.mean(v)) for k, v in sorted(by_label.items())},
        "steps_by_label": {k: len(v) for k, v in sorted(by_label.items())},
        "auc_v0_self": auc([ep["steps"][0]["v"] for ep in self_eps], [ep["success"] for ep in self_eps]),
        "auc_v0_all": auc([ep["steps"][0]["v"] for ep in episodes], [ep["success"] for ep in episodes]),
        "auc_v_self_by_step": [auc([ep["steps"][t]["v"] for ep in self_eps if len(ep["steps"]) > t],
                                   [ep["success"] for ep in self_eps if len(ep["steps"]) > t]) for t in range(4)],
        "auc_v_self_every_state": auc([s["v"] for ep in self_eps for s in ep["steps"]],
                                      [ep["success"] for ep in self_eps for s in ep["steps"]]),
    }


def main(argv=None):
    args = parse_args(argv)
    # Every input is checked before any work, and --out is replaced only once all advantages are in.
    check_flags(args, gamma="in [0, 1]", lam="in [0, 1]", batch_size="at least 1", threads="non-negative")
    check_out(args.out, "04_gae", args.data + [args.critic])
    if args.metrics:
        check_out(args.metrics, "log", args.data + [args.critic, args.out])
    if args.threads:
        torch.set_num_threads(args.threads)
    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed)
    device, dtype = pick_device()
    episodes = read_episodes(args.data)
    tokenizer = load_tokenizer(args.critic, "critic")
    with open(os.path.join(args.critic, "args.json")) as f:
        critic_args = json.load(f)
    gamma = critic_args.get("gamma") if args.gamma is None else args.gamma
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
        die(f"{args.critic}/args.json: gamma must be a number in [0, 1], got {gamma!r}; or pass --gamma")
    time_limit = critic_args.get("time_limit", "bootstrap")  # as the critic learned it (older critics: bootstrap)
    if time_limit not in ("terminal", "bootstrap"):
        die(f"{args.critic}/args.json: time_limit must be 'terminal' or 'bootstrap', got {time_limit!r}")
    # delta_t uses the reward the critic learned on (the module docstring), unless --rewards env
    with_aux = args.rewards == "critic" and not critic_args.get("no_aux", False)
    critic = Critic.load(args.critic, device, dtype).eval()
    data = tokenize_all(tokenizer, episodes, critic.backbone.config.max_position_embeddings)
    if not data:
        die("no trajectory fits the model's context")

    # One batched forward pass per group of trajectories gives V at every state and Q at every action.
    out_eps = []
    with torch.no_grad():
        for i in tqdm(range(0, len(data), args.batch_size), desc="04_gae", unit="batch"):
            eps = [ep for ep, _ in data[i:i + args.batch_size]]
            batch = {k: v.to(device) for k, v in collate([x for _, x in data[i:i + args.batch_size]],
                                                         tokenizer.pad_token_id).items()}
            _, v_all, q = critic(batch)  # (B, T+1), (B, T)
            for j, ep in enumerate(eps):
                n = len(ep["steps"])
                out_eps.append(episode_advantages(ep, v_all[j, :n + 1].double().numpy(force=True),
                                                  q[j, :n].double().numpy(force=True), gamma, args.lam,
                                                  args.advantage, with_aux, time_limit))

    group_sizes = {}
    if args.baseline == "state":
        out_eps, group_sizes = state_baseline(out_eps)
    summary = {"stage": "04_gae", "advantage": args.advantage, "rewards": args.rewards, "with_aux": with_aux, "gamma": gamma,
               "time_limit": time_limit,
               "lam": args.lam, "baseline": args.baseline, **advantage_report(out_eps)}
    if args.baseline == "state":
        summary["steps_by_state_visits"] = group_sizes
    write_jsonl(args.out, out_eps)
    write_json(args.out[:-len(".jsonl")] + ".json", {**summary, "args": vars(args)})
    log_metrics(args.metrics, summary)
    src = "  ".join(f"{k} {v:+.3f}" for k, v in summary["adv_mean_by_source"].items())
    lab = "  ".join(f"{k} {v:+.3f} (n={summary['steps_by_label'][k]})" for k, v in summary["adv_mean_by_label"].items())
    if args.advantage == "qv":
        how = "Q - V"
    else:
        how = "GAE on r_env + r_aux" if with_aux else "GAE on r_env only"
        how += " (the critic's rewards)" if args.rewards == "critic" else " (--rewards env)"
    print(f"04_gae: A_t = {how}\n"
          f"04_gae: mean advantage by source: {src}\n"
          f"04_gae: mean advantage by label:  {lab}\n"
          f"04_gae: AUC of V(s_0) for success vs failure: self {summary['auc_v0_self']:.3f}, "
          f"all {summary['auc_v0_all']:.3f}\n"
          f"04_gae: AUC of V(s_t) for the episode's success (self): "
          + ", ".join(f"s_{t} {a:.3f}" for t, a in enumerate(summary["auc_v_self_by_step"]))
          + f", every state {summary['auc_v_self_every_state']:.3f} -> {args.out}")
    if args.baseline == "state":
        shared = sum(n for k, n in group_sizes.items() if k > 1)
        print(f"04_gae: --baseline state: {shared} of {sum(group_sizes.values())} steps were taken at a state "
              f"visited more than once; the other steps get A = 0")


# ----------------------------------------------------------------------------------------
# Plumbing identical in every stage; skip on a first reading. Copied on purpose (CleanRL style)
# so that each stage stands alone: every copy stays byte-identical (tests/test_stage_copies.py
# checks), and a stage carries only the helpers it calls.
# ----------------------------------------------------------------------------------------
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


def write_jsonl(path, rows):
    def write(tmp):
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    write_atomic(path, write)


def write_json(path, obj):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    write_atomic(path, write)


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


if __name__ == "__main__":
    main()
