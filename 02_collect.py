"""Stage 02 - collect trajectories (and evaluate): run a policy on the tasks of a split, and label every step.

Reads   --policy expert (the environment's own demonstrator) or a policy directory (01 / 05 output)
Writes  --out FILE.jsonl: one episode per line (docs/design.md, 'The episode JSONL'), every step labeled;
        FILE.json beside it: a summary (success rate, labels, speed), also printed as one line.

A rollout: reset the environment on a task; at each step t the policy writes a reply a_t
("Thought: ...\nAction: <command>"), the command after the last "Action:" steps the environment,
and the step is recorded with o_{t+1}, r_env and done, until the environment ends the episode
(done) or the step limit cuts it (truncated). Sampling at --temperature collects D_self (pi_{k-1}
on train tasks); --greedy evaluates.

Retrospective reward labeling (the paper), from the next observation only, with precedence
format > invalid > repeat > ok:
    format   the reply has no parseable `Action:` line (the environment is not stepped; the agent
             reads FORMAT_ERROR_OBS instead)
    invalid  the environment says the command did nothing ("Nothing happens.")
    repeat   o_{t+1} == o_t (the step changed nothing the agent can see)
    r_aux_t = --r-fmt / --r-inv / --r-repeat for those labels, else 0.
The critic learns on r_t = r_env + r_aux (03), and 04's advantages use the same rewards.

    python 02_collect.py --policy expert --split train --episodes 1000 --out runs/demo/data/expert.jsonl
    python 02_collect.py --policy runs/demo/policy_0 --split train --episodes 300 --seed 1 \
        --out runs/demo/iter_1/self.jsonl
    python 02_collect.py --policy runs/demo/policy_0 --split seen --greedy --out runs/demo/eval/policy_0_seen.jsonl

--num-envs environments run in lockstep: at each step the replies of all live episodes are
generated in one batch (ModelPolicy.generate, a plain loop); a slot whose episode ends takes the
next task at once. By default the same replies (up to float rounding) come from a faster path
(generate_cached): one KV cache kept across turns (Session), so a turn reads only its new tokens.

Q-guided generation (--rerank CRITIC_DIR --candidates M; QLASS-style, the paper's "w/o policy
improvement" row: the critic of 03 steers an unchanged policy): each environment samples M
candidate replies, the critic scores each with Q(s_t, a) read where 03 / 04 read it, and the
environment executes the argmax (a tie goes to the lowest-numbered candidate).

    python 02_collect.py --policy runs/demo/policy_0 --rerank runs/demo/iter_1/critic --candidates 4 --split seen \
        --out runs/demo/eval/policy_0_rerank_seen.jsonl
"""
import argparse
import bisect
import json
import os
import random
import time
from collections import Counter

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache, StaticCache

import envs
from plumbing import (
    ARTIFACTS,
    add_machine_flags,
    autocast,
    check_flags,
    check_out,
    die,
    finish_distributed,
    is_main,
    load_model,
    load_tokenizer,
    log_metrics,
    owned,
    parse_env_kwargs,
    pick_device,
    save_text,
    seed_everything,
    setup_distributed,
    write_atomic,
)

FORMAT_ERROR_OBS = "Invalid reply. End your reply with one line: Action: <command>"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Stage 02: collect labeled trajectories or evaluate a policy.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policy", required=True, help="'expert' or a policy directory (save_pretrained)")
    p.add_argument("--out", required=True,
                   help="output episode JSONL; the summary goes to the same name with .json. With several --env-seed "
                        "or --split values, one pair per (world, split): the path names them with {world} and {split}")
    p.add_argument("--env", default="household",
                   help=f"environment name (registered: {', '.join(sorted(envs.REGISTRY))})")
    p.add_argument("--env-kwargs", default="{}", help="JSON dict of environment keyword arguments")
    p.add_argument("--env-seed", type=int, nargs="+", default=[0],
                   help="the environment's world seed(s) (which tasks exist); several: one model load for all")
    p.add_argument("--split", nargs="+", default=["train"],
                   help="task split(s): train, dev (household: for tuning), seen or unseen")
    p.add_argument("--episodes", type=int, default=0,
                   help="number of tasks, drawn without replacement with --seed (0: every task of the split, in order)")
    p.add_argument("--seed", type=int, default=0, help="random seed (task draw and sampling)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (evaluation); default samples")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for collection")
    p.add_argument("--num-envs", type=int, default=64,
                   help="environment slots run in lockstep, each taking the next task when its episode ends "
                        "(the generation batch; times --candidates with --rerank)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest reply per turn, in tokens")
    p.add_argument("--r-fmt", type=float, default=-0.2, help="auxiliary reward of a 'format' step")
    p.add_argument("--r-inv", type=float, default=-0.1, help="auxiliary reward of an 'invalid' step")
    p.add_argument("--r-repeat", type=float, default=-0.1, help="auxiliary reward of a 'repeat' step")
    p.add_argument("--rerank", default="", metavar="CRITIC_DIR",
                   help="Q-guided generation: a critic directory from 03_critic.py scores --candidates sampled "
                        "replies per step and the argmax-Q reply is executed (not with --greedy or --policy expert)")
    p.add_argument("--candidates", type=int, default=4,
                   help="with --rerank: candidate replies sampled per environment and step (M >= 1)")
    p.add_argument("--critic-batch-size", type=int, default=32,
                   help="with --rerank: candidates per critic forward pass")
    p.add_argument("--plain-generate", action="store_true",
                   help="generate with the plain loop (ModelPolicy.generate: every prompt read in full each turn) "
                        "instead of the KV cache kept across turns; the same replies up to float rounding, slower")
    add_machine_flags(p)  # --threads, --precision
    p.add_argument("--metrics", default="", help="append the summary to this JSONL file")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: rollouts on many environments at once, and retrospective labels.
# ----------------------------------------------------------------------------------------
def parse_action(text):
    """The command after the last 'Action:' in a reply, or None (a format error)."""
    if "Action:" not in text:
        return None
    action = " ".join(text.rsplit("Action:", 1)[1].split("\n")[0].split())
    return action or None


def retro_label(action, prev_obs, next_obs, invalid):
    """Paper: retrospective reward labeling, from the next observation only.
    action is None for a format error; precedence format > invalid > repeat > ok."""
    if action is None:
        return "format"
    if invalid:
        return "invalid"
    if next_obs == prev_obs:
        return "repeat"
    return "ok"


def run_episodes(make_env, task_ids, policy, args, aux, reranker=None):
    """Every task once, on --num-envs environment slots stepped in lockstep -> (finished episodes,
    environment steps). A slot whose episode ends takes the next task of the queue at once, so
    every slot stays busy until the queue is empty. Slot i owns rows i*m .. i*m+m-1 of the
    generation batch (m candidates with --rerank, else 1)."""
    m = reranker.m if reranker else 1
    slots = [make_env() for _ in range(min(args.num_envs, len(task_ids)))]
    queue = list(reversed(task_ids))  # queue.pop() hands out the tasks in order
    live, finished, env_steps, too_long = {}, [], 0, 0  # live: slot -> its episode so far
    who = {"source": "expert" if args.policy == "expert" else "self", "policy": policy_name(args)}
    bar = tqdm(total=len(task_ids), desc=f"02_collect {args.split}", unit="ep", disable=not is_main())

    def start(i):  # slot i starts the next task of the queue
        tid = queue.pop()
        obs, info = slots[i].reset(tid)
        live[i] = {"env": args.env, "task_id": tid, "split": args.split, **who, "seed": args.seed,
                   "instruction": slots[i].instruction, "task": info["task"], "obs0": obs, "steps": []}

    for i in range(len(slots)):
        start(i)
    if policy != "expert":
        policy.start(len(slots) * m)
    while live:
        rows, ended = sorted(live), {}  # ended: slot -> whether the environment says the task is won
        if policy == "expert":
            replies = [slots[i].expert_text() for i in rows]
        else:
            prompts = {i: policy.prompt_ids(live[i]) for i in rows}
            # An episode whose next prompt would overflow the model's context ends here (truncated).
            ended = {i: False for i in rows if len(prompts[i]) > policy.max_prompt}
            too_long, rows = too_long + len(ended), [i for i in rows if i not in ended]
            replies = policy.act([i * m + j for i in rows for j in range(m)],
                                 [prompts[i] for i in rows for _ in range(m)]) if rows else []
            if reranker and rows:  # each environment executes its argmax-Q candidate
                q = reranker.q_values([live[i] for i in rows for _ in range(m)], replies)
                replies = [replies[k * m + j] for k, j in enumerate(pick_candidates(q, m))]
        for i, text in zip(rows, replies):
            env, ep = slots[i], live[i]
            prev_obs = ep["steps"][-1]["obs"] if ep["steps"] else ep["obs0"]
            action = parse_action(text)
            if action is None:  # format error: the environment is not stepped
                obs, r_env, terminated, truncated, info, invalid = FORMAT_ERROR_OBS, 0.0, False, False, {}, False
            else:
                obs, r_env, terminated, truncated, info = env.step(action)
                invalid, env_steps = env.is_invalid(obs), env_steps + 1
            label = retro_label(action, prev_obs, obs, invalid)
            ep["steps"].append({"text": text, "action": action or "", "obs": obs, "r_env": float(r_env),
                                "label": label, "r_aux": aux[label], "done": bool(terminated)})
            if terminated or truncated or len(ep["steps"]) >= env.max_steps:  # format errors count toward the limit
                ended[i] = info.get("won", True)  # graded rewards (shop): success is reward 1.0, not > 0
        for i in sorted(ended):
            ep = live.pop(i)
            if queue:  # refill: the slot starts the next task
                start(i)
            if ep["steps"]:  # else not even the first prompt fit: nothing to record
                ep["reward"] = float(sum(s["r_env"] for s in ep["steps"]))
                ep["success"] = bool(ep["steps"][-1]["done"] and ep["reward"] > 0 and ended[i])
                ep["truncated"] = not ep["steps"][-1]["done"]
                finished.append(ep)
                bar.update(1)
    bar.close()
    for env in slots:
        env.close()
    if too_long:
        print(f"note: {too_long} episodes were cut because their next prompt exceeded the model's context")
    return finished, env_steps


def policy_name(args):
    return "expert" if args.policy == "expert" else os.path.basename(os.path.normpath(args.policy))


# ----------------------------------------------------------------------------------------
# The policy: a language model writing the replies of a batch of rows at once.
# ----------------------------------------------------------------------------------------
def next_tokens(logits, rows, n_rows, args):
    """The next token of each row: the argmax with --greedy, else a draw from softmax(logits / T).
    logits (len(rows), V) are those of batch rows `rows` of n_rows; one draw is made for every row
    of the whole batch, so a seeded run samples the same replies whichever rows are computed."""
    if args.greedy:
        return logits.argmax(-1)
    probs = torch.ones((n_rows, logits.shape[1]), device=logits.device)
    probs[rows] = torch.softmax(logits / args.temperature, dim=-1)
    return torch.multinomial(probs, 1).squeeze(-1)[rows]


class ModelPolicy:
    """A causal language model acting for n_rows rows (environment slots, times --candidates)."""

    def __init__(self, path, args):
        self.tokenizer = load_tokenizer(path)
        self.device, self.amp = pick_device(args.precision)
        self.model = load_model(AutoModelForCausalLM, path).to(self.device).eval()
        self.args, self.eos_id, self.pad_id = args, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.max_prompt = self.model.config.max_position_embeddings - args.max_new_tokens
        self.generated_tokens = self.cut_replies = 0  # cut: replies that reached --max-new-tokens unfinished

    def start(self, n_rows):
        self.n_rows, self.session = n_rows, None  # session: the KV cache kept across turns (Session)

    def prompt_ids(self, episode):
        text = self.tokenizer.apply_chat_template(episode_messages(episode), add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def act(self, rows, prompts):
        """One reply (a string) for each row in `rows`, given its prompt (token ids)."""
        out = []
        with autocast(self.device, self.amp):  # fp32, or bf16 matmuls on fp32 weights (--precision)
            replies = self.generate(rows, prompts) if self.args.plain_generate else generate_cached(self, rows, prompts)
        for toks in replies:
            self.generated_tokens += len(toks)
            if toks and toks[-1] == self.eos_id:
                toks = toks[:-1]
            else:
                self.cut_replies += 1
            out.append(self.tokenizer.decode(toks, skip_special_tokens=True).strip())
        return out

    @torch.no_grad()
    def generate(self, rows, prompts):
        """The plain loop -> each row's reply as token ids, up to the end-of-turn token (or
        --max-new-tokens of them). The prompts are left-padded into one batch (B, L), so every row's
        next token is predicted at the last column; the cache holds what has been read so far."""
        B, L, dev = len(prompts), max(len(p) for p in prompts), self.device
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p), 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)  # each row counts its positions from its first real token
        cache, replies, live = DynamicCache(config=self.model.config), [[] for _ in prompts], set(range(B))
        for _ in range(self.args.max_new_tokens):
            logits = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                                cache=cache).logits[:, -1].float()
            ids = next_tokens(logits, rows, self.n_rows, self.args)[:, None].cpu()  # (B, 1): what each row reads next
            for i in sorted(live):
                replies[i].append(int(ids[i]))
                if replies[i][-1] == self.eos_id:
                    live.discard(i)
            if not live:
                break
            mask, pos = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1), pos[:, -1:] + 1
        return replies


# ----------------------------------------------------------------------------------------
# Performance; skip on a first reading. ModelPolicy.generate re-reads every prompt in full at
# each turn. generate_cached gives the same replies (up to float rounding) from one KV cache kept
# across turns and episodes: each turn feeds only the new tokens - the last reply's end, the
# observation, or a refilled slot's new task. It is the default (bench/collect_speed.py measures
# both), so its arithmetic is the one every seeded run reproduces bit for bit.
# ----------------------------------------------------------------------------------------
CACHE_ROOM = 64  # free KV-cache columns beyond one turn's need


@torch.no_grad()
def generate_cached(policy, rows, prompts):
    """ModelPolicy.generate through policy.session, a Session over all n_rows rows of the batch."""
    p, max_new = policy, policy.args.max_new_tokens
    if p.session is None:  # the first turn: a cache that fits the prompts and one turn
        p.session = Session(p.model, p.n_rows, max(len(x) for x in prompts) + max_new + CACHE_ROOM, p.pad_id)
    s, prompt_of = p.session, dict(zip(rows, prompts))
    # The tokens each row must feed to see its prompt. A row without a prompt (its slot has no
    # episode left) hides everything, so the copies below can drop it.
    new = [s.sync(r, prompt_of.get(r, [])) for r in range(p.n_rows)]
    need = max(len(t) for t in new) + max_new
    if s.width + need > s.max_cols:
        # Pads and stale columns have filled the cache: copy what the rows see into a compact
        # one with room for this turn and a little more (every extra column slows every step).
        s = p.session = s.compacted(need + CACHE_ROOM)
    logits = s.feed(new)
    replies, live = {r: [] for r in rows}, set(rows)  # live: rows still writing their reply
    slot = list(range(p.n_rows))  # slot[j]: the batch row that row j of s serves
    for step in range(max_new):
        nxt = next_tokens(logits, slot, p.n_rows, p.args)
        for j, r in enumerate(slot):
            if r in live:
                replies[r].append(int(nxt[j]))
                if replies[r][-1] == p.eos_id:
                    live.discard(r)
        going = [j for j, r in enumerate(slot) if r in live]
        if not going:
            break
        if len(going) <= len(slot) // 2:
            # Most rows have ended their reply, but every row of s is computed at every step: go on
            # with a copy that holds only the rows still writing. Their last tokens never reach
            # p.session; at the next turn, sync finds them missing and feeds them with the observation.
            s, slot = s.compacted(max_new - step + 1, rows=going), [slot[j] for j in going]
        logits = s.feed([[replies[r][-1]] if r in live else [] for r in slot])
    return [replies[r] for r in rows]


class Session:
    """One KV cache shared by all rows of the generation batch. All rows share the cache's column
    index; a row sees the columns whose attention mask is 1 - pads and stale tokens are masked out.
    A row whose slot starts a new episode keeps the common prefix (the instruction) and hides the
    rest of the old episode (sync). When pads and hidden columns fill the cache, the visible
    columns are copied into a smaller one (compacted): attention reads every column at every step."""

    def __init__(self, model, n_rows, max_cols, pad_id):
        self.model, self.pad_id, self.max_cols = model, pad_id, max_cols
        self.cache = StaticCache(config=model.config, max_cache_len=max_cols)
        self.mask = torch.zeros((n_rows, max_cols), dtype=torch.long, device=model.device)
        self.width = 0                                # columns used so far
        self.ids = [[] for _ in range(n_rows)]        # visible tokens of each row
        self.cols = [[] for _ in range(n_rows)]       # their columns in the cache

    def sync(self, r, prompt):
        """Tokens row r must feed so that it sees `prompt`: the part after the longest common
        prefix with what it already sees (the rest is hidden)."""
        n = 0
        while n < min(len(prompt), len(self.ids[r])) and prompt[n] == self.ids[r][n]:
            n += 1
        self.mask[r, self.cols[r][n:]] = 0
        self.cols[r], self.ids[r] = self.cols[r][:n], self.ids[r][:n]
        return prompt[n:]

    def feed(self, new):
        """new: a token list per row (empty for idle rows) -> next-token logits (B, V)."""
        B, W = len(new), max(1, max(len(t) for t in new))
        chunk = torch.full((B, W), self.pad_id, dtype=torch.long)
        pos = torch.zeros((B, W), dtype=torch.long)
        for r, toks in enumerate(new):  # left-pad each row's chunk so its last token is in the last column
            if toks:
                n = len(toks)
                chunk[r, W - n:] = torch.tensor(toks)
                pos[r, W - n:] = torch.arange(len(self.ids[r]), len(self.ids[r]) + n)
                cols = list(range(self.width + W - n, self.width + W))
                self.mask[r, cols] = 1
                self.cols[r] += cols
                self.ids[r] += toks
        dev = self.model.device
        out = self.model(input_ids=chunk.to(dev), attention_mask=self.mask, position_ids=pos.to(dev), cache=self.cache)
        self.width += W
        return out.logits[:, -1].float()

    def compacted(self, room, rows=None):
        """A new Session holding only what the given rows (default: all) see, right-aligned (stale
        and pad columns dropped), plus `room` free columns; its row j is old row rows[j]. Keys and
        values are copied, not recomputed: each depends only on its token, its position and the
        tokens before it, none of which change."""
        rows = list(range(len(self.ids))) if rows is None else rows
        B, n = len(rows), max(len(self.cols[r]) for r in rows)
        new = Session(self.model, B, n + room, self.pad_id)
        src = torch.zeros((B, n), dtype=torch.long)  # the old column of each new column (0 under pads)
        for j, r in enumerate(rows):
            k = len(self.cols[r])
            src[j, n - k:] = torch.tensor(self.cols[r], dtype=torch.long)
            new.mask[j, n - k:n] = 1
            new.cols[j], new.ids[j] = list(range(n - k, n)), list(self.ids[r])
        src, keep = src.to(self.model.device), torch.tensor(rows, device=self.model.device)[:, None]
        for i, layer in enumerate(self.cache.layers):  # keys, values: (B, heads, columns, head_dim)
            # [rows, :, columns] -> (B, n, heads, head_dim); transpose back to the cache's layout
            new.cache.update(layer.keys[keep, :, src].transpose(1, 2), layer.values[keep, :, src].transpose(1, 2), i)
        new.width = n
        return new


# ----------------------------------------------------------------------------------------
# Extension: Q-guided generation (--rerank). The critic of 03 scores M sampled candidates per
# environment with Q(s_t, a), read as 03 / 04 read it (tokenize_episode, collate and Critic are
# the byte-identical copies); the environment executes the argmax. Only executed replies step
# the environment, but generated_tokens counts every candidate's. At the next turn every row of
# an environment continues from the chosen reply (Session.sync drops the rest).
# ----------------------------------------------------------------------------------------
def pick_candidates(q, m):
    """q: Q(s_t, a) of every candidate, m per environment in order -> for each environment the
    index 0..m-1 of its argmax-Q candidate; a tie goes to the lowest index (torch.argmax)."""
    return torch.as_tensor(q, dtype=torch.float).view(-1, m).argmax(dim=1).tolist()


class Reranker:
    """The critic of 03 scoring candidate replies with Q(s_t, a) (QLASS-style selection)."""

    def __init__(self, path, args):
        self.device, self.amp = pick_device(args.precision)
        self.critic, self.tokenizer = Critic.load(path, self.device)  # in eval mode
        self.m, self.batch_size = args.candidates, args.critic_batch_size

    @torch.no_grad()
    def q_values(self, episodes, texts):
        """Q of reply texts[k] as the next step of episodes[k], at the last action position of the
        episode plus the candidate step. The candidate's observation is not known yet and is left
        empty: in a causal model Q at the action position comes before it and cannot depend on it."""
        q = []
        for i in range(0, len(texts), self.batch_size):
            xs = [tokenize_episode(self.tokenizer, dict(ep, steps=ep["steps"] + [{"text": text, "obs": ""}]))
                  for ep, text in zip(episodes[i:i + self.batch_size], texts[i:i + self.batch_size])]
            batch = {k: v.to(self.device) for k, v in collate(xs, self.tokenizer.pad_token_id).items()}
            with autocast(self.device, self.amp):
                _, _, q_all = self.critic(batch)                   # (B, T): Q at every action
            last = torch.tensor([len(x["action_pos"]) - 1 for x in xs], device=self.device)
            q += q_all[torch.arange(len(xs), device=self.device), last].tolist()
        return q


# ----------------------------------------------------------------------------------------
# The critic of 03 (copied byte-identical from 03_critic.py): V(s_t) and Q(s_t, a_t) of every step
# of a trajectory in one forward pass.
# ----------------------------------------------------------------------------------------
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
        h_state = h.gather(1, batch["state_pos"][..., None].expand(-1, -1, d)).float()    # (B, T+1, d)
        h_action = h.gather(1, batch["action_pos"][..., None].expand(-1, -1, d)).float()  # (B, T, d)
        with torch.autocast(h.device.type, enabled=False):  # the heads in fp32, also under bf16 autocast
            return h_action, self.v_head(h_state).squeeze(-1), self.q_head(h_action).squeeze(-1)

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
    def load(cls, path, device):
        """A critic directory of 03 -> (the critic in eval mode, its tokenizer); refuses a missing or cut tensor."""
        if not owned(path, "critic"):
            die(f"{path} is not {ARTIFACTS['critic'][0]}")
        try:  # the small files first: a broken one is one line before the transformer is loaded
            heads = load_file(os.path.join(path, "heads.safetensors"))
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:
            die(f"{path}: cannot load heads.safetensors or the tokenizer ({e})")
        critic = cls(load_model(AutoModel, path))
        try:
            for name, head in (("v_head.", critic.v_head), ("q_head.", critic.q_head)):
                head.load_state_dict({k[len(name):]: v for k, v in heads.items() if k.startswith(name)})
        except RuntimeError as e:  # a head tensor missing, or of another size than the transformer's
            die(f"{path}/heads.safetensors: not the heads of this transformer ({e})")
        return critic.to(device).eval(), tokenizer


def main(argv=None):
    args = parse_args(argv)
    # Every input is checked before any work; --out and its summary are written once every episode is in.
    check_flags(args, episodes="non-negative", seed="a seed in [0, 2**32)", num_envs="at least 1",
                max_new_tokens="at least 1", candidates="at least 1", critic_batch_size="at least 1",
                threads="non-negative", r_fmt="in [-100, 100]",
                r_inv="in [-100, 100]", r_repeat="in [-100, 100]")
    if not args.greedy:
        check_flags(args, temperature="positive")
    env_kwargs = parse_env_kwargs(args.env_kwargs)
    if not all(0 <= w < 2**32 for w in args.env_seed):
        die(f"--env-seed must be a seed in [0, 2**32), got {' '.join(map(str, args.env_seed))}")
    # One run per (world, split) pair, each as a run of its own (its args, its output pair); the policy is loaded once.
    runs = [argparse.Namespace(**{**vars(args), "env_seed": w, "split": split,
                                  "out": args.out.replace("{world}", str(w)).replace("{split}", split)})
            for w in args.env_seed for split in args.split]
    if len({r.out for r in runs}) < len(runs):
        die(f"--out {args.out}: several --env-seed / --split values need {{world}} and {{split}} in the path")
    task_lists = []
    for r in runs:
        try:
            probe = envs.make(args.env, seed=r.env_seed, **env_kwargs)
            all_ids = probe.task_ids(r.split)
            probe.close()
        except (ValueError, ImportError) as e:  # an unknown env, a keyword it does not take, a bad split, a package
            die(e)
        if args.episodes > len(all_ids):
            die(f"--episodes {args.episodes} exceeds the {len(all_ids)} tasks of split {r.split!r}")
        task_lists.append(sorted(random.Random(args.seed).sample(all_ids, args.episodes)) if args.episodes else all_ids)
    if args.rerank and args.policy == "expert":
        die("--rerank needs a policy directory to sample candidates from, not --policy expert")
    if args.rerank and args.greedy:
        die("--rerank samples its candidates at --temperature; drop --greedy (lower --temperature instead)")
    inputs = [p for p in (args.policy, args.rerank) if p and p != "expert"]
    for r in runs:
        check_out(r.out, "02_collect", inputs)
    if args.metrics:
        check_out(args.metrics, "log", inputs + [r.out for r in runs])
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = setup_distributed()  # distributed (torchrun: docs/distributed.md); alone: 0, 1
    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed)
    reranker = Reranker(args.rerank, args) if args.rerank else None  # first: a bad CRITIC_DIR fails fast
    policy = "expert" if args.policy == "expert" else ModelPolicy(args.policy, args)
    aux = {"ok": 0.0, "invalid": args.r_inv, "repeat": args.r_repeat, "format": args.r_fmt}
    for i, (r, task_ids) in enumerate(zip(runs, task_lists)):
        if i > 0:  # each pair after the first starts from --seed again
            seed_everything(args.seed)
        collect(r, task_ids, policy, aux, reranker, env_kwargs, rank, world)
    finish_distributed()


def collect(args, task_ids, policy, aux, reranker, env_kwargs, rank, world):
    """One (world, split): its episodes -> args.out (JSONL) and its summary (.json), one record to --metrics."""
    make_env = lambda: envs.make(args.env, seed=args.env_seed, **env_kwargs)
    if world > 1:  # distributed: every rank its share of the tasks, sampled with its own random stream
        task_ids = task_ids[rank::world]
        torch.manual_seed(args.seed + rank)
    if policy != "expert":
        policy.generated_tokens = policy.cut_replies = 0
    t0, cpu0 = time.time(), time.process_time()  # CPU time: less sensitive than wall time to other load
    episodes, env_steps = run_episodes(make_env, task_ids, policy, args, aux, reranker)
    generated, cut = (0, 0) if policy == "expert" else (policy.generated_tokens, policy.cut_replies)
    if world > 1:  # distributed: rank 0 gathers every rank's episodes and sums the counts; the others are done
        gathered = [None] * world if rank == 0 else None
        torch.distributed.gather_object((episodes, [env_steps, generated, cut]), gathered, dst=0)
        if rank != 0:
            return
        episodes = [ep for eps, _ in gathered for ep in eps]
        env_steps, generated, cut = (sum(c) for c in zip(*(counts for _, counts in gathered)))
    episodes.sort(key=lambda ep: ep["task_id"])
    if not episodes:
        die("no episode was recorded: not even the first prompt fits the model's context")
    wall, n, labels = time.time() - t0, len(episodes), Counter(s["label"] for ep in episodes for s in ep["steps"])
    summary = {"stage": "02_collect", "policy": policy_name(args), "env": args.env, "split": args.split,
               "greedy": args.greedy, "candidates": args.candidates if args.rerank else 1, "episodes": n,
               "success_rate": sum(ep["success"] for ep in episodes) / n,
               "avg_reward": sum(ep["reward"] for ep in episodes) / n,
               "avg_steps": sum(len(ep["steps"]) for ep in episodes) / n,
               "labels": {k: labels.get(k, 0) for k in ("ok", "invalid", "repeat", "format")},
               "env_steps": env_steps, "generated_tokens": generated, "wall_s": round(wall, 2),
               "cpu_s": round(time.process_time() - cpu0, 2), "episodes_per_s": round(n / max(wall, 1e-9), 2)}
    if cut:
        print(f"note: {cut} replies reached --max-new-tokens {args.max_new_tokens} before the "
              f"end-of-turn token and were cut (raise --max-new-tokens if the policy writes long thoughts)")
    summary_path = args.out[:-len(".jsonl")] + ".json"
    if os.path.exists(summary_path):  # JSONL and summary are a pair: the summary ("done") goes first, comes last
        os.remove(summary_path)
    save_text(args.out, "".join(json.dumps(ep) + "\n" for ep in episodes))
    save_text(summary_path, json.dumps({**summary, "args": vars(args)}, indent=2) + "\n")
    log_metrics(args.metrics, summary)
    lab = summary["labels"]
    rerank = f"(Q-reranked from {args.candidates} candidates per step) " if args.rerank else ""
    print(f"02_collect: {summary['policy']} on {args.env}/{args.split}: success {summary['success_rate']:.1%}, "
          f"avg reward {summary['avg_reward']:.3f}, avg steps {summary['avg_steps']:.1f}, labels ok {lab['ok']} "
          f"invalid {lab['invalid']} repeat {lab['repeat']} format {lab['format']}, {n} episodes "
          f"{rerank}in {summary['wall_s']:.1f}s ({summary['episodes_per_s']:.2f} ep/s) -> {args.out}")


# ----------------------------------------------------------------------------------------
# The data contract (docs/design.md, 'The chat layout'): an episode as a chat, its tokens,
# and where V, Q and the loss are read. Copied byte-identical into every stage that reads
# episodes (tests/test_stage_copies.py).
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


if __name__ == "__main__":
    main()

