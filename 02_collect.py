"""Stage 02 - collect trajectories (and evaluate): run a policy on the tasks of a split, and label every step.

Reads   --policy expert (the environment's own demonstrator) or a policy directory (01 / 05 output)
Writes  --out FILE.jsonl: one episode per line (docs/design.md, 'The episode JSONL'), every step labeled;
        FILE.json beside it: a summary (success rate, labels, speed, peak memory), also printed as one line.

A rollout (run_episode): reset the environment on a task; at each step t the policy writes a reply a_t
("Thought: ...\nAction: <command>"), the command after the last "Action:" steps the environment, and the
step is recorded with o_{t+1}, r_env and done, until the environment ends the episode (done) or the step
limit cuts it (truncated). Sampling at --temperature collects D_self (pi_{k-1} on train tasks); --greedy
evaluates. --num-envs > 1 (the default) runs the same rollouts in lockstep, faster (rollout.py); several
--env-seed / --split values are runs of their own (one output each) that share the lockstep batch.

Retrospective reward labeling (the paper), from the next observation only, precedence format > invalid > repeat > ok:
    format   the reply has no parseable `Action:` line (the env is not stepped; the agent reads FORMAT_ERROR_OBS)
    invalid  the environment says the command did nothing ("Nothing happens.")
    repeat   o_{t+1} == o_t (the step changed nothing the agent can see)
    r_aux_t = --r-fmt / --r-inv / --r-repeat for those labels, else 0.
The critic learns on r_t = r_env + r_aux (03); 04's advantages take r_env alone (its docstring).

    python 02_collect.py --policy expert --split train --episodes 1000 \
        --out runs/demo/data/expert.jsonl
    python 02_collect.py --policy runs/demo/policy_0 --split train --episodes 300 --seed 1 \
        --out runs/demo/iter_1/self.jsonl
    python 02_collect.py --policy runs/demo/policy_0 --split seen --greedy \
        --out runs/demo/eval/policy_0_seen.jsonl

--rerank CRITIC_DIR --candidates M (rerank.py, QLASS-style): the critic of 03 picks the argmax-Q of M sampled replies.
"""
import os
import time
from collections import Counter

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import envs
from distributed import finish_distributed, is_main, setup_distributed
from kv_cache import GraphStep, generate_cached, generate_plain
from machine import add_machine_flags, autocast, peak_mem_gb, pick_device
from plumbing import check_flags, load_model, load_tokenizer, same_tokenizer, seed_everything, stage_parser
from rerank import Reranker, add_rerank_flags, check_rerank
from rollout import plan_runs, run_lockstep, summarize

FORMAT_ERROR_OBS = "Invalid reply. End your reply with one line: Action: <command>"


def parse_args(argv=None):
    p, a, d, m = stage_parser("Stage 02: collect labeled trajectories or evaluate a policy.")
    d.add_argument("--policy", required=True, help="'expert' or a policy directory (save_pretrained)")
    d.add_argument("--out", required=True,
                   help="output episode JSONL; the summary goes to the same name with .json. With several --env-seed "
                        "or --split values, one pair per (world, split): the path names them with {world} and {split}")
    d.add_argument("--env", default="kitchen",
                   help=f"environment name (registered: {', '.join(sorted(envs.REGISTRY))})")
    d.add_argument("--env-kwargs", default="{}", help="JSON dict of environment keyword arguments")
    d.add_argument("--env-seed", type=int, nargs="+", default=[0],
                   help="the environment's world seed(s) (which tasks exist); several: one model load for all")
    d.add_argument("--split", nargs="+", default=["train"],
                   help="task split(s): train, dev (for tuning), seen or unseen")
    d.add_argument("--episodes", type=int, default=0,
                   help="number of tasks, drawn without replacement with --seed (0: every task of the split, in order)")
    d.add_argument("--keep", choices=["all", "success"], default="all",
                   help="the episodes written: all, or the successful ones only (the paper's D_expert: successful "
                        "demonstrations); the summary's rates are those of all")
    a.add_argument("--seed", type=int, default=0, help="random seed (task draw and sampling)")
    a.add_argument("--greedy", action="store_true", help="greedy decoding (evaluation); default samples")
    a.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for collection")
    m.add_argument("--num-envs", type=int, default=64, help="environment slots run in lockstep, each taking the "
                   "next task when its episode ends (the generation batch; times --candidates with --rerank)")
    a.add_argument("--max-new-tokens", type=int, default=48, help="longest reply per turn, in tokens")
    a.add_argument("--r-fmt", type=float, default=-0.2, help="auxiliary reward of a 'format' step")
    a.add_argument("--r-inv", type=float, default=-0.1, help="auxiliary reward of an 'invalid' step")
    a.add_argument("--r-repeat", type=float, default=-0.1, help="auxiliary reward of a 'repeat' step")
    add_rerank_flags(a)  # --rerank CRITIC_DIR, --candidates, --critic-batch-size: Q-guided generation (rerank.py)
    m.add_argument("--plain-generate", action="store_true",
                   help="generate with the plain loop (kv_cache.generate_plain: every prompt read in full each turn) "
                        "instead of the KV cache kept across turns; the same replies up to float rounding, slower")
    m.add_argument("--cuda-graph", action="store_true",
                   help="decode steps replayed from a CUDA graph (kv_cache.GraphStep: a step's hundreds of kernel "
                        "launches at once), recorded once per KV cache (width a multiple of 1024: one for most runs); "
                        "on a CPU the same steps run eagerly. The replies of the plain steps up to float rounding")
    add_machine_flags(m)  # --threads, --precision
    d.add_argument("--metrics", default="", help="append the summary to this JSONL file")
    args = p.parse_args(argv)  # every flag is checked before any work
    check_flags(args, episodes="non-negative", seed="a seed in [0, 2**32)", num_envs="at least 1",
                max_new_tokens="at least 1", threads="non-negative", r_fmt="in [-100, 100]", r_inv="in [-100, 100]",
                r_repeat="in [-100, 100]")
    check_rerank(args)
    if not args.greedy:
        check_flags(args, temperature="positive")
    return args


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: retrospective labels, and the rollout of one episode.
# ----------------------------------------------------------------------------------------
def parse_action(text):
    """The command after the last 'Action:' in a reply, or None (a format error)."""
    if "Action:" not in text:
        return None
    action = " ".join(text.rsplit("Action:", 1)[1].split("\n")[0].split())
    return action or None


def retro_label(action, prev_obs, next_obs, invalid):
    """Paper: retrospective reward labeling, from the next observation only.
    action is None for a format error; precedence format > invalid > repeat (next_obs == prev_obs) > ok."""
    if action is None:
        return "format"
    if invalid:
        return "invalid"
    if next_obs == prev_obs:
        return "repeat"
    return "ok"


def take_step(env, text, prev_obs, aux):
    """One step: the action of reply `text` steps the environment (a format error does not: the agent reads
    FORMAT_ERROR_OBS), retro_label labels it from the observation it brought, r_aux = aux[label] -> (the step's record
    {text, action, obs, r_env, label, r_aux, done}, whether the episode is over, whether it was won: info["won"],
    else True)."""
    action = parse_action(text)
    if action is None:  # format error: the environment is not stepped
        obs, r_env, terminated, truncated, info, invalid = FORMAT_ERROR_OBS, 0.0, False, False, {}, False
    else:
        obs, r_env, terminated, truncated, info = env.step(action)
        invalid = env.is_invalid(obs)
    label = retro_label(action, prev_obs, obs, invalid)
    step = {"text": text, "action": action or "", "obs": obs, "r_env": float(r_env), "label": label,
            "r_aux": aux[label], "done": bool(terminated)}
    return step, terminated or truncated, info.get("won", True)  # graded rewards (shop): success is reward 1.0


def run_episode(env, task_id, policy, args, aux):
    """The rollout of one episode (what --num-envs 1 runs; rollout.run_lockstep runs many at once): the policy
    replies, take_step steps the environment and labels the step, until the environment ends the episode or the
    step limit cuts it -> the episode, or None when not even its first prompt fits the model's context."""
    ep, won = new_episode(env, task_id, args), False
    while True:
        if policy == "expert":
            text = env.expert_text()
        else:
            prompt = policy.prompt_ids([ep])[0]  # the chat so far (episode_messages) and the generation prompt
            if len(prompt) > policy.max_prompt:  # it would overflow the model's context: the episode is cut here
                policy.counts[0]["cut_episodes"] += 1
                won = False
                break
            text = policy.act([0], [prompt])[0]
        step, over, won = take_step(env, text, ep["steps"][-1]["obs"] if ep["steps"] else ep["obs0"], aux)
        ep["steps"].append(step)
        if over or len(ep["steps"]) >= env.max_steps:  # format errors count toward the step limit
            break
    return end_episode(ep, won)


def new_episode(env, task_id, args):
    """The environment reset on a task -> the episode's record so far (no steps yet)."""
    obs, info = env.reset(task_id)
    return {"env": args.env, "task_id": task_id, "split": args.split,
            "source": "expert" if args.policy == "expert" else "self", "policy": policy_name(args), "seed": args.seed,
            "instruction": env.instruction, "task": info["task"], "obs0": obs, "steps": []}


def end_episode(ep, won):
    """The episode's reward (its env rewards' sum), success (ended by the environment with a positive reward
    and won) and truncated (cut by the step limit or the context); None without a step."""
    if not ep["steps"]:
        return None
    ep["reward"] = float(sum(s["r_env"] for s in ep["steps"]))
    ep["success"] = bool(ep["steps"][-1]["done"] and ep["reward"] > 0 and won)
    ep["truncated"] = not ep["steps"][-1]["done"]
    return ep


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
        # 02 trains nothing, so under bf16 (a GPU's default) the weights themselves are bf16, and so is the KV cache
        # (its dtype is the keys'): a decode step reads half the bytes. 01 / 03 / 05 keep theirs fp32 (pick_device).
        self.model = load_model(AutoModelForCausalLM, path).to(self.device, self.amp).eval()
        self.step = GraphStep(self.model) if args.cuda_graph else self.model  # decode steps (kv_cache.Session.feed)
        self.args, self.eos_id, self.pad_id = args, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.max_prompt = self.model.config.max_position_embeddings - args.max_new_tokens

    def start(self, n_rows):
        """A collection on n_rows rows: no KV cache yet (kv_cache.py), each row's counts at 0: generated_tokens,
        cut_replies (replies that reached --max-new-tokens unfinished), cut_episodes (prompt outgrew the context)."""
        self.n_rows, self.session = n_rows, None
        self.counts = [Counter() for _ in range(n_rows)]

    def take_counts(self, rows):
        """The counts of `rows` since they were last taken (then 0 again): an episode's, taken when it ends."""
        out = sum((self.counts[r] for r in rows), Counter())
        for r in rows:
            self.counts[r] = Counter()
        return out

    def prompt_ids(self, episodes):
        """Each episode's prompt as token ids (one tokenizer call for all: a call's overhead is most of a row's)."""
        texts = [self.tokenizer.apply_chat_template(episode_messages(ep), add_generation_prompt=True, tokenize=False)
                 for ep in episodes]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def act(self, rows, prompts):
        """One reply (a string) for each row in `rows`, given its prompt (token ids)."""
        generate = generate_plain if self.args.plain_generate else generate_cached  # kv_cache.py: the same replies
        with autocast(self.device, self.amp):  # fp32, or bf16 (--precision)
            replies = generate(self, rows, prompts, next_tokens)
        out = []
        for r, toks in zip(rows, replies):
            self.counts[r]["generated_tokens"] += len(toks)
            if toks and toks[-1] == self.eos_id:
                toks = toks[:-1]
            else:
                self.counts[r]["cut_replies"] += 1
            out.append(self.tokenizer.decode(toks, skip_special_tokens=True).strip())
        return out


def main(argv=None):
    args = parse_args(argv)  # every input and output is checked before any work: the flags, then plan_runs
    runs, make_env = plan_runs(args)  # one (args, task ids) per (world, split) pair (rollout.py); one policy load
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = setup_distributed()  # distributed (torchrun: docs/distributed.md); alone: 0, 1
    seed_everything(args.seed)
    reranker = Reranker(args.rerank, args) if args.rerank else None  # first: a bad CRITIC_DIR fails fast
    policy = "expert" if args.policy == "expert" else ModelPolicy(args.policy, args)
    if reranker and policy != "expert":  # the critic scores --policy's replies as its own tokenizer reads them
        same_tokenizer(policy.tokenizer, reranker.tokenizer, f"--rerank {args.rerank}", args.policy,
                       "the critic was trained on another policy's tokens (pass this policy's 03 critic)")
    aux = {"ok": 0.0, "invalid": args.r_inv, "repeat": args.r_repeat, "format": args.r_fmt}
    if world > 1:  # distributed: every rank its share of each run's tasks, sampled with its own random stream
        runs = [(r, task_ids[rank::world]) for r, task_ids in runs]
        torch.manual_seed(args.seed + rank)
    t0, cpu0 = time.time(), time.process_time()  # CPU time: less sensitive than wall time to other load
    if args.num_envs == 1 and not reranker:  # one episode at a time, run after run: run_episode, the loop to read
        done = [one_by_one(make_env(r), task_ids, policy, r, aux) for r, task_ids in runs]
    else:  # the same rollouts, every run's at once on --num-envs slots in lockstep (rollout.py)
        done = run_lockstep(make_env, runs, policy, new_episode,
                            lambda env, text, prev: take_step(env, text, prev, aux), end_episode, reranker)
    device = torch.device("cpu") if policy == "expert" else policy.device  # peak memory: the GPU's, else RSS
    timing = {"wall_s": round(time.time() - t0, 2), "cpu_s": round(time.process_time() - cpu0, 2),
              "runs_in_batch": len(runs), "peak_mem_gb": round(peak_mem_gb(device), 2)}  # the launch's: one batch
    for (r, _), (episodes, counts) in zip(runs, done):
        summarize(r, episodes, counts, timing, rank, world)
    finish_distributed()


def one_by_one(env, task_ids, policy, args, aux):
    """One run's episodes, one at a time (run_episode) -> (its episodes, its counts)."""
    if policy != "expert":
        policy.start(1)
    bar = tqdm(task_ids, desc=f"02_collect {args.split}", unit="ep", leave=False, disable=not is_main())
    episodes = [ep for ep in (run_episode(env, tid, policy, args, aux) for tid in bar) if ep is not None]
    env.close()
    return episodes, Counter() if policy == "expert" else policy.take_counts([0])


# ----------------------------------------------------------------------------------------
# The data contract (docs/design.md, 'The chat layout'): the part 02 uses, an episode as a chat (its prompt);
# copied byte-identical from the stages that read episodes (tests/test_stage_copies.py).
# ----------------------------------------------------------------------------------------
def episode_messages(ep):
    """system = instruction; user = task + o_0; then assistant = step text and user = observation, alternately."""
    msgs = [{"role": "system", "content": ep["instruction"]},
            {"role": "user", "content": f"Your task is to: {ep['task']}\n{ep['obs0']}"}]
    for step in ep["steps"]:
        msgs += [{"role": "assistant", "content": step["text"]}, {"role": "user", "content": step["obs"]}]
    return msgs


if __name__ == "__main__":
    main()
