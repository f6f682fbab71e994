"""02_collect.py's rollout engine: many episodes at once, in lockstep, and the runs that 02 rolls out (one
per world and split, each with its tasks). Skip it on a first reading: 02's run_episode is the same rollout,
one episode at a time, and tests/test_collect.py checks that both write the same episodes.

--num-envs environment slots step together: at each step the replies of every live episode are
generated in one batch (kv_cache.py), and a slot whose episode ends takes the next task at once (of any
of the launch's runs), so every slot stays busy until the queue is empty. With --rerank (rerank.py) each
slot owns --candidates rows of the batch, and the critic picks the reply its environment executes.
"""
import argparse
import os
import random
from collections import Counter

from tqdm import tqdm

import envs
from distributed import is_main
from plumbing import die
from rerank import pick_candidates


def plan_runs(args, env_kwargs):
    """02's runs, one per (world, split) pair of --env-seed and --split, each with args of its own (its --out
    names {world} and {split}) and its task ids (--episodes of the split drawn with --seed, sorted; 0: every
    task, in order) -> [(args, task_ids)]. Every input is checked before any work: one error line."""
    if not all(0 <= w < 2**32 for w in args.env_seed):
        die(f"--env-seed must be a seed in [0, 2**32), got {' '.join(map(str, args.env_seed))}")
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
    return planned


def run_lockstep(make_env, runs, policy, new_episode, take_step, end_episode, reranker=None):
    """Every task of every run once, on --num-envs slots shared by the runs -> per run, its finished episodes
    and its counts (generated tokens, replies cut at --max-new-tokens, episodes cut by the context). One batch
    for all of a launch's (world, split) runs: a slot that ends an episode takes the next task of any run, so
    the batch stays full until the last queue is empty. runs: [(args, task_ids)] (plan_runs). The stage's own
    functions do the rest: make_env(args) -> an environment of args' world; new_episode(env, task_id, args)
    resets it on a task -> the episode so far; take_step(env, text, prev_obs) -> (the step's record, the
    episode is over, it was won); end_episode(episode, won) -> the episode completed, or None (not even its
    first prompt fit). Slot i owns rows i*m .. i*m+m-1 of the generation batch (m candidates with --rerank)."""
    args, m = runs[0][0], reranker.m if reranker else 1
    queue = [(k, tid) for k, (_, task_ids) in enumerate(runs) for tid in task_ids][::-1]  # pop(): in order
    n_slots, run_of, env_of = min(args.num_envs, len(queue)), {}, {}  # slot -> its run; -> (world, environment)
    live, done = {}, [([], Counter()) for _ in runs]  # live: slot -> its episode so far; done: per run
    bar = tqdm(total=len(queue), desc="02_collect " + " ".join(dict.fromkeys(r.split for r, _ in runs)), unit="ep",
               disable=not is_main())

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
                q = reranker.q_values([live[i] for i in rows for _ in range(m)], replies)
                replies = [replies[k * m + j] for k, j in enumerate(pick_candidates(q, m))]
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
