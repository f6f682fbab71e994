"""Stage 02 - collect trajectories (and evaluate): run a policy on the tasks of a split, and label every step.

Reads   --policy expert (the environment's own expert) or a policy directory (01 / 05 output)
Writes  --out FILE.jsonl: one episode per line (docs/design.md, 'The episode JSONL'), every step labeled;
        FILE.json beside it: a summary (success rate, labels, speed), also printed as one line.

A rollout: reset the environment on a task; at each step the policy writes a reply
("Thought: ...\nAction: <command>"), the command after the last "Action:" steps the
environment, and the step is recorded with the next observation o_{t+1}, r_env and done,
until the environment ends the episode (done) or the step limit cuts it (truncated). Sampling with
--temperature collects data (D_self: pi_{k-1} on train tasks); --greedy evaluates.
--samples-per-task K samples K episodes on each task: they start from the same state and
share it until their actions differ, so 04 --baseline state can compare actions at one state.

Retrospective labels (paper: "retrospective reward labeling") come from the next
observation only, with precedence format > invalid > repeat > ok:
    format   the reply has no parseable `Action:` line (the env is not stepped; the agent
             reads FORMAT_ERROR_OBS instead)
    invalid  the environment says the command did nothing ("Nothing happens.")
    repeat   o_{t+1} == o_t (the step changed nothing the agent can see)
and r_aux = --r-fmt / --r-inv / --r-repeat for those labels, else 0. These auxiliary
rewards train the critic only (03); advantages use environment rewards alone (04).

    python 02_collect.py --policy expert --split train --episodes 1000 --out runs/demo/data/expert.jsonl
    python 02_collect.py --policy runs/demo/policy_0 --split seen --greedy --out runs/demo/eval/policy_0_seen.jsonl

Performance / extension (skip on a first reading; the code sits below main, in this order).

--num-envs environment slots run in lockstep: at each step the replies of all live episodes
are generated in one batch that stops at the end-of-turn token. A slot whose episode ends
starts the next task of the queue at once (episodes take 5-20 steps; waiting for the longest
one would leave finished slots idle), and all slots stay busy until the queue is empty.
One KV cache is kept across turns and episodes (class Session), so each turn feeds only the
new tokens - the observation, or a refilled slot's new task - instead of re-reading the
whole history; when hidden tokens fill the cache, the visible ones are copied into a tight
new one. Replies differ in length: once most rows of a turn have ended theirs, the rest go
on in a copy that holds only them (every row of a batch costs time at every step).

Q-guided generation (--rerank CRITIC_DIR --candidates M; QLASS-style, and the paper's
"w/o policy improvement" row: the critic from 03 steers an unchanged policy). Every live
environment gets M rows of the generation batch, and each row samples one candidate reply
at --temperature. The critic scores every candidate with Q(s_t, a), read exactly where 03 /
04 read it: the episode so far plus the candidate step is tokenized with tokenize_episode
and Q is taken at the candidate's action position (the last token of the reply). The
environment executes the candidate with the highest Q (a tie goes to the lowest-numbered
candidate); at the next turn every row of that environment continues from the chosen reply
(Session.sync drops the rest). Only executed replies step the environment (env_steps), but
generated_tokens counts the tokens of every candidate. Candidates are always sampled, so
--greedy cannot be combined with --rerank (lower --temperature for sharper candidates).

    python 02_collect.py --policy runs/demo/policy_0 --rerank runs/demo/iter_1/critic --candidates 4 --split seen
        --out runs/demo/eval/policy_0_rerank_seen.jsonl
"""
import argparse
import bisect
import json
import math
import os
import random
import shutil
import sys
import time
from collections import Counter

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, StaticCache

import envs


FORMAT_ERROR_OBS = "Invalid reply. End your reply with one line: Action: <command>"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Stage 02: collect labeled trajectories or evaluate a policy.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policy", required=True, help="'expert' or a policy directory (save_pretrained)")
    p.add_argument("--out", required=True, help="output episode JSONL; the summary goes to the same name with .json")
    p.add_argument("--env", default="household", help=f"environment name (registered: {', '.join(sorted(envs.REGISTRY))})")
    p.add_argument("--env-kwargs", default="{}", help="JSON dict of environment keyword arguments")
    p.add_argument("--env-seed", type=int, default=0, help="the environment's world seed (which tasks exist)")
    p.add_argument("--split", default="train", help="task split: train, dev (household: for tuning), seen or unseen")
    p.add_argument("--episodes", type=int, default=0, help="number of tasks, drawn without replacement with --seed (0: every task of the split, in order)")
    p.add_argument("--samples-per-task", type=int, default=1,
                   help="episodes sampled on each task (04 --baseline state compares the replies taken at the same state)")
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
    p.add_argument("--critic-batch-size", type=int, default=32, help="with --rerank: candidates per critic forward pass")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--metrics", default="", help="append the summary to this JSONL file")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------
# The data contract (docs/design.md, 'The chat layout'): an episode as a chat, the
# policy's prompt. Copied byte-identical into the stages that read episodes.
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


def policy_source(args):
    return "expert" if args.policy == "expert" else "self"


def policy_name(args):
    return "expert" if args.policy == "expert" else os.path.basename(os.path.normpath(args.policy))


def run_episodes(make_env, task_ids, policy, args, aux, reranker=None):
    """Run every task once on args.num_envs environment slots stepped in lockstep; returns
    the finished episodes and the number of environment steps. A slot whose episode ends
    takes the next task of the queue at once, so every slot stays busy until the queue is
    empty. With a reranker, slot i owns rows i*m .. i*m+m-1 of the generation batch
    (m candidates); a refilled slot's rows all get the new episode's prompt."""
    m = reranker.m if reranker else 1
    n_slots = min(args.num_envs, len(task_ids))
    slots = [make_env() for _ in range(n_slots)]
    queue = list(reversed(task_ids))  # queue.pop() hands out the tasks in order
    live, last_obs = {}, {}           # slot -> its episode so far / its last observation
    won = {}                          # slot -> info["won"] of its last environment step
    finished, env_steps, too_long = [], 0, 0
    bar = tqdm(total=len(task_ids), desc=f"02_collect {args.split}", unit="ep", disable=not is_main())

    def start_next_task(i):
        """Slot i starts the next task of the queue."""
        tid = queue.pop()
        obs, info = slots[i].reset(tid)
        live[i] = {"env": args.env, "task_id": tid, "split": args.split, "source": policy_source(args),
                   "policy": policy_name(args), "seed": args.seed, "instruction": slots[i].instruction,
                   "task": info["task"], "obs0": obs, "steps": []}
        last_obs[i] = obs

    for i in range(n_slots):
        start_next_task(i)
    if policy != "expert":
        policy.start(n_slots * m)
    while live:
        rows = sorted(live)
        ended = set()
        if policy == "expert":
            replies = [slots[i].expert_text() for i in rows]
        else:
            prompts = [policy.prompt_ids(live[i]) for i in rows]
            # An episode whose next prompt would overflow the model's context ends here (truncated).
            ended = {i for i, p in zip(rows, prompts) if len(p) > policy.max_prompt}
            too_long += len(ended)
            keep = [(i, p) for i, p in zip(rows, prompts) if i not in ended]
            rows = [i for i, _ in keep]
            # m candidate replies per environment (m = 1 without --rerank).
            replies = policy.act([i * m + j for i in rows for j in range(m)],
                                 [p for _, p in keep for _ in range(m)]) if keep else []
            if reranker and rows:  # keep each environment's argmax-Q candidate
                q = reranker.q_values([live[i] for i in rows for _ in range(m)], replies)
                replies = [replies[k * m + j] for k, j in enumerate(pick_candidates(q, m))]
        for i, text in zip(rows, replies):
            env, ep = slots[i], live[i]
            action = parse_action(text)
            if action is None:  # format error: the environment is not stepped
                obs, r_env, terminated, truncated, invalid = FORMAT_ERROR_OBS, 0.0, False, False, False
            else:
                obs, r_env, terminated, truncated, info = env.step(action)
                won[i] = info.get("won", True)  # graded rewards (shop): success is reward 1.0, not > 0
                invalid = env.is_invalid(obs)
                env_steps += 1
            label = retro_label(action, last_obs[i], obs, invalid)
            ep["steps"].append({"text": text, "action": action or "", "obs": obs, "r_env": float(r_env),
                                "label": label, "r_aux": aux[label], "done": bool(terminated)})
            last_obs[i] = obs
            # Format errors count toward the step limit too.
            if terminated or truncated or len(ep["steps"]) >= env.max_steps:
                ended.add(i)
        for i in sorted(ended):
            ep = live.pop(i)
            if queue:  # refill: the slot starts the next task (its next prompt replaces the old one)
                start_next_task(i)
            if not ep["steps"]:  # not even the first prompt fit: nothing to record
                continue
            ep["reward"] = float(sum(s["r_env"] for s in ep["steps"]))
            ep["success"] = bool(ep["steps"][-1]["done"] and ep["reward"] > 0 and won[i])
            ep["truncated"] = not ep["steps"][-1]["done"]
            finished.append(ep)
            bar.update(1)
    bar.close()
    for env in slots:
        env.close()
    if too_long:
        print(f"note: {too_long} episodes were cut because their next prompt exceeded the model's context")
    return finished, env_steps


def summarize(episodes, env_steps, wall, cpu, args, generated_tokens):
    labels = Counter(s["label"] for ep in episodes for s in ep["steps"])
    n = len(episodes)
    return {
        "stage": "02_collect", "policy": policy_name(args), "env": args.env, "split": args.split,
        "greedy": args.greedy, "candidates": args.candidates if args.rerank else 1, "episodes": n,
        "success_rate": sum(ep["success"] for ep in episodes) / n,
        "avg_reward": sum(ep["reward"] for ep in episodes) / n,
        "avg_steps": sum(len(ep["steps"]) for ep in episodes) / n,
        "labels": {k: labels.get(k, 0) for k in ("ok", "invalid", "repeat", "format")},
        "env_steps": env_steps, "generated_tokens": generated_tokens,
        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "episodes_per_s": round(n / max(wall, 1e-9), 2),
    }


def main(argv=None):
    args = parse_args(argv)
    # Validate every input before anything is written.
    check_flags(args, episodes="non-negative", samples_per_task="at least 1", num_envs="at least 1",
                max_new_tokens="at least 1", candidates="at least 1", critic_batch_size="at least 1",
                threads="non-negative")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.env not in envs.REGISTRY:
        die(f"unknown env {args.env!r}; valid: {', '.join(sorted(envs.REGISTRY))}")
    try:
        env_kwargs = json.loads(args.env_kwargs)
        assert isinstance(env_kwargs, dict)
    except (json.JSONDecodeError, AssertionError):
        die(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
    make_env = lambda: envs.make(args.env, seed=args.env_seed, **env_kwargs)  # noqa: E731
    try:
        probe = make_env()
        all_ids = probe.task_ids(args.split)
        probe.close()
    except (ValueError, ImportError) as e:  # a keyword the env does not take, a bad split, a missing package
        die(" ".join(str(e).split()))
    if args.episodes > len(all_ids):
        die(f"--episodes {args.episodes} exceeds the {len(all_ids)} tasks of split {args.split!r}")
    if not args.greedy:
        check_flags(args, temperature="positive")
    if args.samples_per_task > 1 and (args.greedy or args.policy == "expert"):
        die("--samples-per-task > 1 needs a sampling policy: greedy decoding and the expert repeat the same episode")
    if args.rerank and args.policy == "expert":
        die("--rerank needs a policy directory to sample candidates from, not --policy expert")
    if args.rerank and args.greedy:
        die("--rerank samples its candidates at --temperature; drop --greedy (lower --temperature instead)")
    inputs = [p for p in (args.policy, args.rerank) if p and p != "expert"]
    if args.policy != "expert":
        check_model_dir(args.policy, "policy")
    if args.rerank:
        check_model_dir(args.rerank, "critic")
    check_out(args.out, "02_collect", inputs)
    if args.metrics:
        check_out(args.metrics, "log", inputs + [args.out])
    rank, world = setup_distributed()  # distributed (torchrun: docs/distributed.md); alone: 0, 1
    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed)
    task_ids = sorted(random.Random(args.seed).sample(all_ids, args.episodes)) if args.episodes else all_ids
    task_ids = [tid for tid in task_ids for _ in range(args.samples_per_task)]
    if world > 1:  # distributed: every rank its share of the tasks, sampled with its own random stream
        task_ids = task_ids[rank::world]
        torch.manual_seed(args.seed + rank)
    reranker = Reranker(args.rerank, args) if args.rerank else None  # first: a bad CRITIC_DIR fails fast
    policy = "expert" if args.policy == "expert" else ModelPolicy(args.policy, args)
    aux = {"ok": 0.0, "invalid": args.r_inv, "repeat": args.r_repeat, "format": args.r_fmt}

    t0, cpu0 = time.time(), time.process_time()  # CPU time: less sensitive than wall time to other load
    episodes, env_steps = run_episodes(make_env, task_ids, policy, args, aux, reranker)
    generated, cut = (0, 0) if policy == "expert" else (policy.generated_tokens, policy.cut_replies)
    if world > 1:  # distributed: rank 0 gathers every rank's episodes
        episodes, (env_steps, generated, cut) = merge_ranks(rank, world, episodes, [env_steps, generated, cut])
        if not is_main():
            return finish_distributed()
    episodes.sort(key=lambda ep: ep["task_id"])
    if not episodes:
        die("no episode was recorded: not even the first prompt fits the model's context")
    summary = summarize(episodes, env_steps, time.time() - t0, time.process_time() - cpu0, args, generated)
    if cut:
        print(f"note: {cut} replies reached --max-new-tokens {args.max_new_tokens} before the "
              f"end-of-turn token and were cut (raise --max-new-tokens if the policy writes long thoughts)")
    write_jsonl(args.out, episodes)
    write_json(args.out[:-len(".jsonl")] + ".json", {**summary, "args": vars(args)})
    log_metrics(args.metrics, summary)
    lab = summary["labels"]
    rerank = f"(Q-reranked from {args.candidates} candidates per step) " if args.rerank else ""
    print(f"02_collect: {summary['policy']} on {args.env}/{args.split}: success {summary['success_rate']:.1%}, "
          f"avg reward {summary['avg_reward']:.3f}, avg steps {summary['avg_steps']:.1f}, labels ok {lab['ok']} "
          f"invalid {lab['invalid']} repeat {lab['repeat']} format {lab['format']}, {summary['episodes']} episodes "
          f"{rerank}in {summary['wall_s']:.1f}s ({summary['episodes_per_s']:.2f} ep/s) -> {args.out}")
    finish_distributed()


# ----------------------------------------------------------------------------------------
# Performance / extension; skip on a first reading.
# ModelPolicy writes the replies of every live environment in one batch, with one KV
# cache kept across turns and episodes (Session). Reranker is Q-guided generation
# (--rerank): the critic of 03 picks one of M sampled candidates; tokenize_episode,
# collate and Critic are the byte-identical copies from 03 / 04.
# ----------------------------------------------------------------------------------------
CACHE_ROOM = 64  # free KV-cache columns beyond one turn's need (ModelPolicy.act)


class ModelPolicy:
    """A language model acting for many environments at once (batched, KV-cached)."""

    def __init__(self, path, args):
        self.tokenizer = load_tokenizer(path)
        self.device, dtype = pick_device()
        self.model = load_pretrained(AutoModelForCausalLM, path, dtype).to(self.device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.max_prompt = self.model.config.max_position_embeddings - args.max_new_tokens
        self.greedy, self.temperature, self.max_new = args.greedy, args.temperature, args.max_new_tokens
        self.generated_tokens = 0
        self.cut_replies = 0  # replies that reached --max-new-tokens before the end-of-turn token

    def prompt_ids(self, episode):
        text = self.tokenizer.apply_chat_template(episode_messages(episode), add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def start(self, n_rows):
        """A batch of n_rows rows (environment slots, times m candidates with --rerank)."""
        self.session, self.n_rows = None, n_rows

    @torch.no_grad()
    def act(self, rows, prompts):
        """Generate one reply for each row in `rows` given its prompt (token ids) -> strings."""
        if self.session is None:  # the first turn: a cache that fits the prompts and one turn
            self.session = Session(self.model, self.n_rows, max(len(p) for p in prompts) + self.max_new + CACHE_ROOM,
                                   self.tokenizer.pad_token_id)
        s, prompt_of = self.session, dict(zip(rows, prompts))
        # The tokens each row must feed to see its prompt. A row without a prompt (its slot
        # has no episode left) hides everything, so the copy below can drop it.
        new = [s.sync(r, prompt_of.get(r, [])) for r in range(self.n_rows)]
        need = max(len(t) for t in new) + self.max_new
        if s.width + need > s.max_cols:
            # Pads and stale columns have filled the cache: copy what the rows see into a
            # compact one with room for this turn and a little more. (Copying is cheap, and
            # every extra column slows every step: more room would only cost time.)
            s = self.session = s.compacted(need + CACHE_ROOM)
        logits = s.feed(new)
        replies, live = {r: [] for r in rows}, set(rows)  # live: rows still writing their reply
        slot = list(range(self.n_rows))  # slot[j]: the batch row (of act's `rows`) that row j of s serves
        for step in range(self.max_new):
            if self.greedy:
                nxt = logits.argmax(-1)
            else:  # one draw per row of the whole batch, as if no row had been dropped, so that a
                # seeded run samples the same replies whatever rows the copies below leave out
                probs = torch.ones((self.n_rows, logits.shape[1]), device=logits.device)
                probs[slot] = torch.softmax(logits / self.temperature, dim=-1)
                nxt = torch.multinomial(probs, 1).squeeze(-1)[slot]
            for j, r in enumerate(slot):
                if r in live:
                    replies[r].append(int(nxt[j]))
                    if replies[r][-1] == self.eos_id:
                        live.discard(r)
            going = [j for j, r in enumerate(slot) if r in live]
            if not going:
                break
            if len(going) <= len(slot) // 2:
                # Most rows have finished their reply, but every row of s is computed at every
                # step: go on with a copy that holds only the rows still generating. Their
                # last tokens never reach self.session; at the next turn, sync finds that
                # they are missing and feeds them with the observation.
                s, slot = s.compacted(self.max_new - step + 1, rows=going), [slot[j] for j in going]
            logits = s.feed([[replies[r][-1]] if r in live else [] for r in slot])
        out = []
        for r in rows:
            toks = replies[r]
            self.generated_tokens += len(toks)
            if toks and toks[-1] == self.eos_id:
                toks = toks[:-1]
            else:
                self.cut_replies += 1
            out.append(self.tokenizer.decode(toks, skip_special_tokens=True).strip())
        return out


class Session:
    """One KV cache shared by all rows of the generation batch, so each turn feeds only the
    new tokens (the last reply's end, the observation, the next generation prompt) instead
    of the whole history. All rows share the cache's column index; a row's visible tokens
    are the columns whose attention mask is 1 - pads and stale tokens are masked out. A row
    whose slot starts a new episode keeps the common prefix (the instruction) and hides
    the rest of the old episode (sync). When pads and hidden columns fill the cache, the
    visible columns are copied into a smaller one (compacted): attention reads every
    column of the cache at every step, so a tight cache is a fast one."""

    def __init__(self, model, n_rows, max_cols, pad_id):
        self.model, self.pad_id, self.max_cols = model, pad_id, max_cols
        self.cache = StaticCache(config=model.config, max_cache_len=max_cols)
        self.mask = torch.zeros((n_rows, max_cols), dtype=torch.long, device=model.device)
        self.width = 0                                # columns used so far
        self.ids = [[] for _ in range(n_rows)]        # visible tokens of each row
        self.cols = [[] for _ in range(n_rows)]       # their columns in the cache

    def sync(self, r, prompt):
        """Tokens row r must feed so that it sees `prompt`: the part after the longest
        common prefix with what it already sees (the rest is hidden)."""
        n = 0
        while n < min(len(prompt), len(self.ids[r])) and prompt[n] == self.ids[r][n]:
            n += 1
        self.mask[r, self.cols[r][n:]] = 0
        self.cols[r], self.ids[r] = self.cols[r][:n], self.ids[r][:n]
        return prompt[n:]

    @torch.no_grad()
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
        out = self.model(input_ids=chunk.to(dev), attention_mask=self.mask, position_ids=pos.to(dev),
                         past_key_values=self.cache, cache_position=torch.arange(self.width, self.width + W, device=dev),
                         use_cache=True)
        self.width += W
        return out.logits[:, -1].float()

    def compacted(self, room, rows=None):
        """A new Session holding only what the given rows (default: all) see, right-aligned
        (stale and pad columns dropped), plus `room` free columns; its row j is old row
        rows[j]. Keys and values are copied, not recomputed: each depends only on its token,
        its position and the tokens before it, none of which change."""
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


def pick_candidates(q, m):
    """q: Q(s_t, a) of every candidate, m per environment in order (environment 0's m, then
    environment 1's, ...) -> for each environment the index 0..m-1 of its argmax-Q candidate.
    A tie goes to the lowest index (torch.argmax returns the first maximum)."""
    return torch.as_tensor(q, dtype=torch.float).view(-1, m).argmax(dim=1).tolist()


class Reranker:
    """The critic of 03 scoring candidate replies with Q(s_t, a) (QLASS-style selection)."""

    def __init__(self, path, args):
        self.device, dtype = pick_device()
        self.tokenizer = load_tokenizer(path, "critic")
        self.critic = Critic.load(path, self.device, dtype).eval()
        self.m, self.batch_size = args.candidates, args.critic_batch_size

    @torch.no_grad()
    def q_values(self, episodes, texts):
        """Q of reply texts[k] as the next step of episodes[k], read as 03 / 04 read it: the
        episode plus the candidate step is tokenized with tokenize_episode, and Q is taken at
        the last action position. The candidate's observation is not known yet and is left
        empty; Q at the action position comes before it in a causal model, so it cannot
        depend on it."""
        q = []
        for i in range(0, len(texts), self.batch_size):
            xs = [tokenize_episode(self.tokenizer, dict(ep, steps=ep["steps"] + [{"text": text, "obs": ""}]))
                  for ep, text in zip(episodes[i:i + self.batch_size], texts[i:i + self.batch_size])]
            batch = {k: v.to(self.device) for k, v in collate(xs, self.tokenizer.pad_token_id).items()}
            _, _, q_all = self.critic(batch)                       # (B, T): Q at every action
            last = torch.tensor([len(x["action_pos"]) - 1 for x in xs], device=self.device)
            q += q_all[torch.arange(len(xs), device=self.device), last].tolist()
        return q


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


def merge_ranks(rank, world, episodes, counts):
    """Under torchrun: rank 0 gathers every rank's episodes and sums the counts (env steps,
    generated tokens, cut replies) -> (episodes, counts). Other ranks get no episodes."""
    gathered = [None] * world if rank == 0 else None
    torch.distributed.gather_object((episodes, counts), gathered, dst=0)
    if rank != 0:
        return [], counts
    return [ep for eps, _ in gathered for ep in eps], [sum(c) for c in zip(*(c for _, c in gathered))]

if __name__ == "__main__":
    main()
