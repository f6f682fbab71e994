"""02_collect.py's rollout engine: many episodes at once, in lockstep, the runs that 02 rolls out (one per
world and split, each with its tasks) and each run's summary. Skip it on a first reading: 02's run_episode is the
same rollout, one episode at a time, and tests/test_collect.py checks that both write the same episodes.

--num-envs environment slots step together: at each step the replies of every live episode are
generated in one batch (kv_cache.py), and a slot whose episode ends takes the next task at once (of any
of the launch's runs), so every slot stays busy until the queue is empty. With --rerank (rerank.py) each
slot owns --candidates rows of the batch, and the critic picks the reply its environment executes.
"""
import argparse
import os
import random
import re
from collections import Counter

import torch
from tqdm import tqdm

import envs
from distributed import is_main
from plumbing import check_memory, check_out, die, parse_env_kwargs, read_json, save_episodes


def kv_bytes(model_dir, rows):
    """The fp32 KV cache of `rows` sequences of a model directory's model at 1k tokens each (an episode of the
    miniatures; the model's context where shorter); 0 for a config this cannot read (loading it says why)."""
    c = read_json(os.path.join(model_dir, "config.json")) or {}
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "num_hidden_layers")
    n = {k: c.get(k, 1024 if k == "max_position_embeddings" else c.get("num_attention_heads")) for k in keys}
    if not all(type(v) is int and v > 0 for v in n.values()):
        return 0
    kv_dim = n["hidden_size"] // n["num_attention_heads"] * n["num_key_value_heads"]
    return rows * min(n["max_position_embeddings"], 1024) * n["num_hidden_layers"] * 2 * kv_dim * 4


def plan_runs(args):
    """02's runs, one per (world, split) pair of --env-seed and --split, each with args of its own (its --out
    names {world} and {split}) and its task ids (--episodes of the split drawn with --seed, sorted; 0: every
    task, in order) -> ([(args, task_ids)], make_env: a run's args -> an environment of its world). Every input
    and output is checked before any work (the memory of every slot's KV cache, --env-kwargs, the splits, each
    run's --out and --metrics: check_out): one error line."""
    if args.policy != "expert":  # every slot's KV cache (and each candidate's), one estimate before any work
        flags = f"--num-envs {args.num_envs}" + (f" --candidates {args.candidates}" if args.rerank else "")
        check_memory(kv_bytes(args.policy, args.num_envs * (args.candidates if args.rerank else 1)), flags)
    env_kwargs = parse_env_kwargs(args.env_kwargs)
    if not all(0 <= w < 2**32 for w in args.env_seed):
        die(f"--env-seed must be a seed in [0, 2**32), got {' '.join(map(str, args.env_seed))}")
    field = re.search(r"\{[^{}]*\}|[{}]", args.out.replace("{world}", "").replace("{split}", ""))
    if field:  # a typo such as {wrold}, or a lone brace, would stay in the file's name
        die(f"--out {args.out}: {field[0]} is not a field; 02's --out names {{world}} and {{split}} only")
    runs = [argparse.Namespace(**{**vars(args), "env_seed": w, "split": split,
                                  "out": args.out.replace("{world}", str(w)).replace("{split}", split)})
            for w in args.env_seed for split in args.split]
    if len({os.path.realpath(r.out) for r in runs}) < len(runs):  # the files named, not the strings
        die(f"--out {args.out}: several --env-seed / --split values need {{world}} and {{split}} in the path, "
            "naming a file of its own for each pair")
    planned = []
    for r in runs:
        try:
            probe = envs.make(args.env, seed=r.env_seed, **env_kwargs)
            all_ids = probe.task_ids(r.split)
            probe.close()
        except (ValueError, ImportError) as e:  # an unknown env, a keyword it does not take, a bad split, a package
            die(e)
        if args.episodes > len(all_ids):
            die(f"--episodes {args.episodes} exceeds the {len(all_ids)} tasks of split {r.split!r}")
        planned.append((r, sorted(random.Random(args.seed).sample(all_ids, args.episodes)) if args.episodes
                        else all_ids))
    inputs = [p for p in (args.policy, args.rerank) if p and p != "expert"]
    for r in runs:
        check_out(r.out, "02_collect", inputs)
    if args.metrics:
        check_out(args.metrics, "log", inputs + [r.out for r in runs])
    return planned, lambda r: envs.make(r.env, seed=r.env_seed, **env_kwargs)


def run_lockstep(make_env, runs, policy, new_episode, take_step, end_episode, reranker=None):
    """Every task of every run once, on --num-envs slots shared by the runs (plan_runs' [(args, task_ids)]) -> per
    run, its finished episodes and its counts (generated tokens, replies cut at --max-new-tokens, episodes cut by the
    context). The stage's own functions do the rest: make_env(args) -> an environment of args' world;
    new_episode(env, task_id, args) -> the episode so far; take_step(env, text, prev_obs) -> (the step's record, the
    episode is over, it was won); end_episode(episode, won) -> the episode completed, or None (not even its first
    prompt fit). Slot i owns rows i*m .. i*m+m-1 of the generation batch (m candidates with --rerank)."""
    args, m = runs[0][0], reranker.m if reranker else 1
    queue = [(k, tid) for k, (_, task_ids) in enumerate(runs) for tid in task_ids][::-1]  # pop(): in order
    n_slots, run_of, env_of = min(args.num_envs, len(queue)), {}, {}  # slot -> its run; -> (world, environment)
    live, done = {}, [([], Counter()) for _ in runs]  # live: slot -> its episode so far; done: per run
    bar = tqdm(total=len(queue), desc="02_collect " + " ".join(dict.fromkeys(r.split for r, _ in runs)), unit="ep",
               leave=False, disable=not is_main())  # gone when done: the summary line (or a refusal) is what stays

    def start(i):  # slot i takes the next task, in an environment of the task's world
        k, tid = queue.pop()
        r = runs[k][0]
        if i in env_of and env_of[i][0] != r.env_seed:  # its environment is another world's
            env_of.pop(i)[1].close()
        if i not in env_of:
            env_of[i] = (r.env_seed, make_env(r))
        run_of[i], live[i] = k, new_episode(env_of[i][1], tid, r)

    for i in range(n_slots):
        start(i)
    if policy != "expert":
        policy.start(n_slots * m)
    while live:
        rows, outcome = sorted(live), {}  # slot -> won (True / False), for each episode that ends at this step
        if policy == "expert":
            replies = [env_of[i][1].expert_text() for i in rows]
        else:
            prompts = dict(zip(rows, policy.prompt_ids([live[i] for i in rows])))
            # An episode whose next prompt would overflow the model's context ends here (cut).
            outcome = {i: False for i in rows if len(prompts[i]) > policy.max_prompt}
            for i in outcome:
                policy.counts[i * m]["cut_episodes"] += 1
            rows = [i for i in rows if i not in outcome]
            replies = policy.act([i * m + j for i in rows for j in range(m)],
                                 [prompts[i] for i in rows for _ in range(m)]) if rows else []
            if reranker and rows:  # each environment executes its argmax-Q candidate
                replies = reranker.choose([live[i] for i in rows for _ in range(m)], replies)
        for i, text in zip(rows, replies):
            ep, env = live[i], env_of[i][1]
            step, over, won = take_step(env, text, ep["steps"][-1]["obs"] if ep["steps"] else ep["obs0"])
            ep["steps"].append(step)
            if over or len(ep["steps"]) >= env.max_steps:  # format errors count toward the limit
                outcome[i] = won
        for i in sorted(outcome):
            episodes, counts = done[run_of[i]]
            if policy != "expert":  # what the slot's rows counted for this episode
                counts.update(policy.take_counts(range(i * m, i * m + m)))
            ep = end_episode(live.pop(i), outcome[i])
            if queue:  # refill: the slot starts the next task
                start(i)
            if ep is not None:
                episodes.append(ep)
                bar.update(1)
    bar.close()
    for _, env in env_of.values():
        env.close()
    return done


def summarize(args, episodes, counts, timing, rank, world):
    """One of 02's runs (a world and split): its episodes -> args.out (JSONL) and its summary (.json, printed as one
    line), one record to --metrics. wall_s, cpu_s and peak_mem_gb are the launch's, whose runs_in_batch runs were
    rolled out together."""
    env_steps = sum(s["label"] != "format" for ep in episodes for s in ep["steps"])  # a format error steps nothing
    if world > 1:  # distributed: rank 0 gathers every rank's episodes and sums the counts; the others are done
        gathered = [None] * world if rank == 0 else None
        torch.distributed.gather_object((episodes, counts, env_steps), gathered, dst=0)
        if rank != 0:
            return
        episodes = [ep for eps, _, _ in gathered for ep in eps]
        counts, env_steps = sum((c for _, c, _ in gathered), Counter()), sum(n for _, _, n in gathered)
    episodes.sort(key=lambda ep: ep["task_id"])
    if not episodes:
        die("no episode was recorded: not even the first prompt fits the model's context")
    n, labels = len(episodes), Counter(s["label"] for ep in episodes for s in ep["steps"])
    if counts["cut_episodes"]:
        print(f"note: {counts['cut_episodes']} episodes were cut because their next prompt exceeded the model's "
              "context")
    summary = {"stage": "02_collect", "policy": episodes[0]["policy"], "env": args.env, "split": args.split,
               "greedy": args.greedy, "candidates": args.candidates if args.rerank else 1, "episodes": n,
               "success_rate": sum(ep["success"] for ep in episodes) / n,
               "avg_reward": sum(ep["reward"] for ep in episodes) / n,
               "avg_steps": sum(len(ep["steps"]) for ep in episodes) / n,
               "labels": {k: labels.get(k, 0) for k in ("ok", "invalid", "repeat", "format")},
               "env_steps": env_steps, "generated_tokens": counts["generated_tokens"], **timing}
    if args.keep == "success":  # the paper's D_expert: the successful demonstrations alone are written
        episodes = [ep for ep in episodes if ep["success"]]
        summary["kept"] = len(episodes)
        if not episodes:
            die(f"--keep success: none of the {n} episodes succeeded, so there is nothing to write")
    if counts["cut_replies"]:
        print(f"note: {counts['cut_replies']} replies reached --max-new-tokens {args.max_new_tokens} before the "
              f"end-of-turn token and were cut (raise --max-new-tokens if the policy writes long thoughts)")
    save_episodes(args.out, episodes, summary, args, args.metrics)  # and FILE.json, the summary
    lab = summary["labels"]
    rerank = f"(Q-reranked from {args.candidates} candidates per step) " if args.rerank else ""
    batch = f" of {timing['runs_in_batch']} runs in one batch" if timing["runs_in_batch"] > 1 else ""
    print(f"02_collect: {summary['policy']} on {args.env}/{args.split} (world {args.env_seed}): success "
          f"{summary['success_rate']:.1%}, avg reward {summary['avg_reward']:.3f}, "
          f"avg steps {summary['avg_steps']:.1f}, labels ok {lab['ok']} invalid {lab['invalid']} "
          f"repeat {lab['repeat']} format {lab['format']}, {n} episodes "
          f"{'(the ' + str(len(episodes)) + ' successes written) ' if args.keep == 'success' else ''}"
          f"{rerank}in {summary['wall_s']:.1f}s{batch} -> {args.out}")
