"""Baseline - QLASS in miniature (Lin et al., 2025, "QLASS: Boosting Language Agent Inference via Q-Guided Stepwise
Search"; ../shared/seeds/qlass_paper.txt), one of the paper's three baselines: Q-values from exploration trees.

Reads   --policy: pi_0 (01_bc.py), which explores and whose transformer initialises the QNet; --data: the
        demonstrations (02), each the first branch of its task's tree (its Algorithm 3 starts from one).
Writes  --trees FILE.jsonl: every branch of every tree as an episode of 02, each step with its tree's q and `new`
        (this branch made the node); FILE.json beside it: the online samples the trees took (env_steps).
        --out DIR: the QNet, a critic directory of 03's kind that 02 --rerank reads.

1. Trees (its Algorithm 3), on --tasks train tasks: a node at fewer than --depth steps from the root is expanded by
   sampling --width continuations of pi_0 from its state, each rolled out to the end and merged into the tree (the
   same reply is the same child). A branch that ends with zero reward sends the stop signal: its new nodes are never
   expanded. The world is deterministic given the task and the actions, so a branch starts from its replayed prefix;
   only the steps it samples count as online samples (a replay is free here, not in a real simulator).
2. Q-values (its eq. 4), leaves first:  Q(s_t, a_t) = r_t + gamma * max_{a_{t+1} in C_t} Q(s_{t+1}, a_{t+1}),
   a leaf's Q its own reward. (QLASS then min-max normalises a tree's Q; the miniature's rewards are already in
   [0, 1], and a tree whose branches all fail has no range to normalise.)
3. The QNet: 03's Critic (the policy's transformer and a Q head), trained by MSE on every node once (its sec. 4.3):
       L = mean over nodes (Q_phi(s, a) - q)^2
4. Q-guided generation (its Algorithm 2, the main-table row): 02 --rerank DIR --candidates M samples M replies a
   step and executes the argmax-Q one.

    python qlass.py --policy runs/demo/policy_0 --data runs/demo/data/expert.jsonl --tasks 100 \
        --trees runs/demo/qlass/trees.jsonl --out runs/demo/qlass/qnet
    python 02_collect.py --policy runs/demo/policy_0 --rerank runs/demo/qlass/qnet --candidates 2 --split seen \
        --out runs/demo/eval/qlass_seen.jsonl
"""
import argparse
import importlib
import random

import torch
from tqdm import tqdm
from transformers import AutoModel

import envs
from machine import Progress, add_machine_flags, autocast, start
from plumbing import (check_flags, check_out, die, finite, fit_context, length_batches, load_model, load_tokenizer,
                      log_metrics, parse_env_kwargs, read_episodes, save_critic, save_episodes, stage_parser)
from rollout import run_lockstep

MAX_BRANCHES = 4096  # a tree's worst case, --width ** --depth: a bound where a typo would run for days

collect = importlib.import_module("02_collect")  # the rollout: the policy, new_episode, take_step, end_episode
critic_stage = importlib.import_module("03_critic")  # the QNet: 03's Critic, tokenize_episode and collate


def parse_args(argv=None):
    p, a, d, m = stage_parser("Baseline QLASS: exploration trees, Q by max backup, a QNet by MSE.")
    d.add_argument("--policy", required=True, help="pi_0: the policy that explores (its transformer starts the QNet)")
    d.add_argument("--data", nargs="*", default=[], help="demonstrations: each the first branch of its task's tree")
    d.add_argument("--trees", required=True, help="output JSONL of the trees' branches (and its .json summary)")
    d.add_argument("--out", required=True, help="output QNet directory (a critic of 03's kind)")
    d.add_argument("--env", default="kitchen",
                   help=f"environment name (registered: {', '.join(sorted(envs.REGISTRY))})")
    d.add_argument("--env-kwargs", default="{}", help="JSON dict of environment keyword arguments")
    a.add_argument("--tasks", type=int, default=100, help="train tasks with a tree each (drawn with --seed)")
    a.add_argument("--width", type=int, default=2, help="W: continuations sampled at each expanded node")
    a.add_argument("--depth", type=int, default=3, help="D: only nodes fewer than D steps from the root expand")
    a.add_argument("--gamma", type=float, default=0.9, help="discount of eq. 4 (QLASS's 0.9)")
    a.add_argument("--epochs", type=int, default=4, help="QNet: passes over the branches")
    a.add_argument("--batch-size", type=int, default=16, help="QNet: branches per optimizer step")
    a.add_argument("--lr", type=float, default=1e-3, help="QNet: AdamW learning rate")
    a.add_argument("--grad-clip", type=float, default=1.0, help="QNet: max global gradient norm")
    a.add_argument("--temperature", type=float, default=1.0, help="exploration's sampling temperature")
    a.add_argument("--max-new-tokens", type=int, default=48, help="longest reply per turn, in tokens")
    m.add_argument("--num-envs", type=int, default=64, help="branches rolled out in lockstep")
    a.add_argument("--seed", type=int, default=0, help="random seed (task draw, sampling, QNet)")
    add_machine_flags(m)  # --threads, --precision
    d.add_argument("--metrics", default="", help="append the trees' summary and the QNet's epochs to this JSONL")
    args = check_flags(p.parse_args(argv), tasks="at least 1", width="at least 1", depth="at least 1",
                       gamma="in [0, 1]", epochs="at least 1", batch_size="at least 1", lr="in (0, 1]",
                       grad_clip="positive", temperature="positive", max_new_tokens="at least 1",
                       num_envs="at least 1", seed="a seed in [0, 2**32)", threads="non-negative")
    if args.width ** min(args.depth, 13) > MAX_BRANCHES:  # W^D exactly (a width of 2 passes 4096 at depth 13)
        die(f"--width {args.width} --depth {args.depth}: a tree may grow to W^D branches (Algorithm 3's worst case), "
            f"more than {MAX_BRANCHES}; lower either")
    return args


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: the tree, its Q-values, and the QNet's loss.
# ----------------------------------------------------------------------------------------
def new_node(step=None, depth=0):
    """A tree node: the step that reached it (02's record; None at the root), its children by reply text, its depth
    (steps from the root), how many continuations were sampled from it, and whether it waits to be expanded."""
    return {"step": step, "children": {}, "depth": depth, "tries": 0, "queued": False, "q": 0.0}


def merge(node, steps):
    """Merge a branch's steps below `node` (the same reply text is the same child) -> the nodes it runs through."""
    path = []
    for step in steps:
        node = node["children"].setdefault(step["text"], new_node(step, node["depth"] + 1))
        path.append(node)
    return path


def enqueue(tid, path, nodes, depth):
    """The nodes a won branch made below `path` that Algorithm 3 queues: fewer than `depth` steps from the root, not
    an episode's end, not queued before -> queue entries (task, node, the nodes from the root to it)."""
    out = []
    for i, n in enumerate(nodes):
        if n["depth"] < depth and not n["step"]["done"] and not n["queued"]:
            n["queued"] = True
            out.append((tid, n, path + nodes[:i + 1]))
    return out


def grow(roots, demos, rollout, width, depth):
    """Algorithm 3 on many trees at once. roots: {task_id: root}; demos: {task_id: the nodes of its demonstration,
    merged in as the first branch}; rollout([(task_id, steps so far)]) -> for each, the steps it sampled after them
    and whether the episode was won. Each round samples one continuation of every queued node; a node stays queued
    until it has `width`; the nodes a won branch made join the queue, a lost branch's never do (the stop signal)
    -> the environment steps sampled."""
    queue, sampled = [], 0
    for tid, root in roots.items():
        root["queued"] = True
        queue += [(tid, root, [])] + enqueue(tid, [], demos.get(tid, []), depth)
    while queue:
        results = rollout([(tid, [n["step"] for n in path]) for tid, _, path in queue])
        later = []
        for (tid, node, path), (steps, won) in zip(queue, results):
            node["tries"] += 1
            sampled += sum(s["label"] != "format" for s in steps)  # a format error steps nothing (02)
            nodes = merge(node, steps)
            if node["tries"] < width:
                later.append((tid, node, path))
            if won:
                later += enqueue(tid, path, nodes, depth)
        queue = later
    return sampled


def backup(node, gamma):
    """QLASS eq. 4, leaves first: a leaf's q is its reward; else q = r + gamma * max over its children's q."""
    for child in node["children"].values():
        backup(child, gamma)
    r = node["step"]["r_env"] if node["step"] else 0.0
    if node["children"]:
        node["q"] = r + gamma * max(c["q"] for c in node["children"].values())
    else:
        node["q"] = r
    return node["q"]


def branches(root, head):
    """Every root-to-leaf branch as an episode (head: the episode's fields but steps), each step with q and `new`:
    True the first time a node is written, so the QNet's loss counts each node once."""
    out, seen = [], set()

    def walk(node, steps):
        if not node["children"] and steps:  # (a root without a step: its first prompt did not fit, no branch)
            ep = dict(head, steps=[dict(n["step"], q=n["q"], new=id(n) not in seen) for n in steps])
            seen.update(id(n) for n in steps)
            ep["reward"] = sum(s["r_env"] for s in ep["steps"])
            ep["success"] = bool(ep["steps"][-1]["done"] and ep["reward"] > 0)
            ep["truncated"] = not ep["steps"][-1]["done"]
            out.append(ep)
        for child in node["children"].values():
            walk(child, steps + [child])
    walk(root, [])
    return out


def qnet_loss(q_pred, q_target, new):
    """QLASS sec. 4.3: the MSE between Q_phi(s, a) and the tree's q, over each node once: (B, T) tensors, new the
    mask (1 where this branch made the node, 0 on padding and on nodes an earlier branch wrote) -> (loss, info)."""
    loss = ((q_pred - q_target) ** 2 * new).sum() / new.sum().clamp(min=1)
    return loss, {"loss": loss.item()}


# ----------------------------------------------------------------------------------------
# The trees in the world: branches rolled out from replayed prefixes, many at once (rollout.run_lockstep).
# ----------------------------------------------------------------------------------------
def make_rollout(args, policy, env_kwargs):
    run = argparse.Namespace(**vars(args), env_seed=0, split="train", greedy=False, rerank="", candidates=1,
                             cuda_graph=False, plain_generate=False)
    aux = {"ok": 0.0, "invalid": -0.1, "repeat": -0.1, "format": -0.2}  # 02's defaults
    make_env = lambda r: envs.make(args.env, seed=0, **env_kwargs)

    def rollout(requests):
        def start_branch(env, k, r):  # the task reset, then the prefix replayed (a format error steps nothing)
            tid, prefix = requests[k]
            ep = collect.new_episode(env, tid, r)
            for step in prefix:
                if step["label"] != "format":
                    env.step(step["action"])
                ep["steps"].append(dict(step))
            ep["prefix"] = len(prefix)
            return ep

        [(eps, _)] = run_lockstep(make_env, [(run, list(range(len(requests))))], policy, start_branch,
                                  lambda env, text, prev: collect.take_step(env, text, prev, aux), collect.end_episode)
        by_key = {(ep["task_id"], tuple(s["text"] for s in ep["steps"][:ep["prefix"]])): ep for ep in eps}
        eps = [by_key.get((tid, tuple(s["text"] for s in prefix))) for tid, prefix in requests]
        return [(ep["steps"][ep["prefix"]:], ep["success"]) if ep else ([], False) for ep in eps]  # None: no fit
    return rollout


def main(argv=None):
    args = parse_args(argv)
    env_kwargs = parse_env_kwargs(args.env_kwargs)
    check_out(args.trees, "02_collect", [args.policy] + args.data)
    _, device, amp = start(args, "critic", [args.policy, args.trees] + args.data)
    try:
        all_ids = envs.make(args.env, seed=0, **env_kwargs).task_ids("train")
    except (ValueError, ImportError) as e:  # as 02: an unknown env, a keyword it does not take, a package
        die(e)
    if args.tasks > len(all_ids):
        die(f"--tasks {args.tasks} exceeds the {len(all_ids)} train tasks")
    task_ids = sorted(random.Random(args.seed).sample(all_ids, args.tasks))
    demos = {ep["task_id"]: ep for ep in (read_episodes(args.data) if args.data else []) if ep["success"]}

    # 1. the trees: each task's demonstration (if any) is its first branch; then pi_0 explores
    policy = collect.ModelPolicy(args.policy, argparse.Namespace(**vars(args), greedy=False, cuda_graph=False,
                                                                    plain_generate=False))
    roots = {tid: new_node() for tid in task_ids}
    first = {tid: merge(roots[tid], demos[tid]["steps"]) for tid in task_ids if tid in demos}
    sampled = grow(roots, first, make_rollout(args, policy, env_kwargs), args.width, args.depth)
    # 2. Q by eq. 4, and every branch as an episode with 02's fields
    env, trees = envs.make(args.env, seed=0, **env_kwargs), []
    for tid in task_ids:
        backup(roots[tid], args.gamma)
        head = collect.new_episode(env, tid, argparse.Namespace(env=args.env, split="train", policy="qlass",
                                                                seed=args.seed))
        trees += branches(roots[tid], head)
    if not trees:
        die("no tree has a step: not even the first prompt of a task fits the model's context beside "
            f"--max-new-tokens {args.max_new_tokens}")
    nodes = sum(s["new"] for ep in trees for s in ep["steps"])
    summary = {"stage": "qlass", "tasks": args.tasks, "with_demonstration": sum(t in demos for t in task_ids),
               "branches": len(trees), "nodes": nodes, "env_steps": sampled,
               "success_rate": sum(ep["success"] for ep in trees) / len(trees),
               "root_q": sum(r["q"] for r in roots.values()) / len(roots)}
    save_episodes(args.trees, trees, summary, args, args.metrics)
    print(f"qlass: {args.tasks} trees ({summary['with_demonstration']} with a demonstration), {len(trees)} branches, "
          f"{nodes} nodes; {sampled} environment steps sampled (the online samples) -> {args.trees}")

    # 3. the QNet: 03's Critic on pi_0's transformer, its Q head fit to q by MSE
    tokenizer = load_tokenizer(args.policy)
    qnet = critic_stage.Critic(load_model(AutoModel, args.policy)).to(device).train()
    data = fit_context([(ep, critic_stage.tokenize_episode(tokenizer, ep)) for ep in trees], qnet.backbone.config)
    optimizer = torch.optim.AdamW(qnet.parameters(), lr=args.lr, weight_decay=0.0)
    rng, records = random.Random(args.seed), []
    log = Progress("qlass QNet", args.epochs * -(-len(data) // args.batch_size), device)
    for epoch in range(args.epochs):
        for idx in length_batches([len(x["input_ids"]) for _, x in data], args.batch_size, rng):
            eps = [data[j][0] for j in idx]
            batch = {k: v.to(device) for k, v in critic_stage.collate([data[j][1] for j in idx],
                                                                       tokenizer.pad_token_id).items()}
            T = batch["step_mask"].shape[1]
            q_target, new = (torch.tensor([[float(s[k]) for s in ep["steps"]] + [0.0] * (T - len(ep["steps"]))
                                           for ep in eps], device=device) for k in ("q", "new"))  # (B, T)
            with autocast(device, amp):
                _, _, q_pred = qnet(batch)  # (B, T): Q_phi at every action
            loss, info = qnet_loss(q_pred, q_target, new)  # forward -> loss
            finite(loss, log.step).backward()  # a non-finite loss stops here, one line (as the stages)
            torch.nn.utils.clip_grad_norm_(qnet.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.update(info, int(batch["attention_mask"].sum()), loss=f"{info['loss']:.4f}")
        records.append(r := {"stage": "qlass", "epoch": epoch + 1, "step": log.step, "elapsed_s": log.elapsed(),
                             **log.mean(), **log.cost()})
        tqdm.write(f"epoch {epoch + 1}: QNet MSE {r['loss']:.4f}")
    log.bar.close()
    save_critic(qnet, args.out, tokenizer, {**vars(args), "stage": "qlass"})
    log_metrics(args.metrics, *records)  # the QNet's epochs, as the stages' (--help)
    print(f"qlass: wrote the QNet {args.out} (MSE {r['loss']:.4f}; 02 --rerank {args.out} --candidates M uses it)")


if __name__ == "__main__":
    main()
