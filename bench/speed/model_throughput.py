"""Per-stage throughput on this machine of the default tiny model and SmolLM2-135M-Instruct: tokens/s and peak memory
of 01's BC step, 02's collection (generated tokens/s, prefill included), 03's critic step, 04's critic forward and 05's
BPPO step, each (model, stage) in its own process with the stage file's functions (a warm-up step, then --steps timed);
wall and CPU seconds both (a shared CPU), and an estimate of a whole chain at a budget from the rates. A measurement.

    python -m models.smollm2 --out models/smollm2-135m        # once
    python bench/speed/model_throughput.py --smollm2 models/smollm2-135m --threads 1
"""
import argparse
import copy
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from bench.runner import ROOT, expert_demos, load_stage, measured, must, parser, scratch, table_out, write_table  # noqa: E402
from models.tiny import build_tiny_model, train_tiny_tokenizer  # noqa: E402
from plumbing import LIMITS, check_flags, check_out, die, load_model, save_text  # noqa: E402

STAGES = ["bc", "collect", "critic", "gae", "bppo"]
NAMES = {"bc": "01 BC step", "collect": "02 collection", "critic": "03 critic step", "gae": "04 critic forward",
         "bppo": "05 BPPO step"}


def timed_steps(n_warm, n_steps, batches, step_fn):
    """Run step_fn on batches (warm-up first); -> tokens, wall s and CPU s of the timed ones."""
    tokens, wall, cpu = 0, 0.0, 0.0
    for i, b in enumerate(batches[:n_warm + n_steps]):
        t0, c0 = time.time(), time.process_time()
        step_fn(b)
        if i >= n_warm:
            wall, cpu = wall + time.time() - t0, cpu + time.process_time() - c0
            tokens += int(b["attention_mask"].sum())
    return tokens, wall, cpu


def descend(opt, loss):
    """One optimizer step on loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def worker(a):
    """One stage with one model, in this process (a: run_worker's settings); prints one JSON line."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    s = {n: load_stage(n) for n in ("01_bc", "02_collect", "03_critic", "05_bppo")}
    bc, cr, pp = s["01_bc"], s["03_critic"], s["05_bppo"]
    episodes = bc.read_episodes(a.data)
    out = {}

    if a.stage == "collect":
        argv = ["--policy", a.model, "--split", "train", "--episodes", str(a.episodes), "--num-envs", str(a.episodes),
                "--seed", "1", "--threads", str(a.threads), "--out", a.out]
        s["02_collect"].main(argv)
        summ = json.load(open(os.path.splitext(a.out)[0] + ".json"))
        out = {"tokens": summ["generated_tokens"], "wall_s": summ["wall_s"], "cpu_s": summ["cpu_s"],
               "shape": f"{a.episodes} episodes in lockstep, {sum(summ['labels'].values())} replies"}
    else:
        if a.model == "tiny":  # 01's default tiny model, exactly as `01_bc.py --model tiny` builds it
            texts = [episodes[0]["instruction"]] + [m["content"] for ep in episodes
                                                    for m in bc.episode_messages(ep)[1:]]
            tokenizer = train_tiny_tokenizer(texts, 1024)  # on the messages' text, as 01 trains it
            model = build_tiny_model(tokenizer, bc.parse_args(["--data", "x", "--out", "x"]))
        else:
            tokenizer = bc.load_tokenizer(a.model)
            model = load_model(AutoModelForCausalLM, a.model)  # a broken checkpoint: one line
        pairs = bc.fit_context([(ep, bc.tokenize_episode(tokenizer, ep)) for ep in episodes], model.config)
        random.Random(0).shuffle(pairs)
        need = (1 + a.steps) * a.batch_size
        pairs = (pairs * need)[:need]
        data = [x for _, x in pairs]
        batches = [bc.collate(data[i:i + a.batch_size], tokenizer.pad_token_id) for i in range(0, need, a.batch_size)]
        ep_batches = [[ep for ep, _ in pairs[i:i + a.batch_size]] for i in range(0, need, a.batch_size)]
        out["shape"] = f"batch {a.batch_size} x {sum(len(x['input_ids']) for x in data) / len(data):.0f} tokens"

        if a.stage == "bc":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step(b):
                logits = bc.reply_logits(model, b)  # (N, V) at the reply tokens, as 01 computes them
                loss, _ = bc.bc_loss(bc.token_logprobs(logits, b["input_ids"][b["action_step"] >= 0]))
                descend(opt, loss)
        elif a.stage in ("critic", "gae"):
            critic = cr.Critic(load_model(AutoModel, a.model))
            target = copy.deepcopy(critic.q_head).requires_grad_(False)
            opt = torch.optim.AdamW(critic.parameters(), lr=1e-5)
            by_id = {id(b): e for b, e in zip(batches, ep_batches)}

            def step(b):
                e = by_id[id(b)]
                if a.stage == "gae":
                    with torch.no_grad():
                        critic(b)
                    return
                loss, _ = cr.iql_losses(critic, target, b, cr.trajectory_tensors(e, "cpu"),
                                        cr.batch_weights(e, False, "cpu"), 0.7, 0.95, True)
                descend(opt, loss)
        elif a.stage == "bppo":
            ref = load_model(AutoModelForCausalLM, a.model).eval()
            ref.requires_grad_(False)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

            def step(b):
                targets = b["input_ids"][b["action_step"] >= 0]  # the N reply tokens, as 05 computes them
                adv, mask = torch.randn(len(targets)), torch.ones(len(targets))
                with torch.no_grad():  # 05 computes log pi_old once per trajectory before training
                    model.eval()
                    old = pp.token_logprobs(pp.reply_logits(model, b), targets)
                    model.train()
                logits = pp.reply_logits(model, b)
                loss = pp.bppo_loss(pp.token_logprobs(logits, targets), old, adv, mask, 0.4, 0.2)
                with torch.no_grad():
                    logr = torch.log_softmax(pp.reply_logits(ref, b).float(), -1)
                descend(opt, loss + 0.05 * pp.kl_to_ref(logits, logr))
        out["tokens"], out["wall_s"], out["cpu_s"] = timed_steps(1, a.steps, batches, step)
        if a.save:  # BC's policy, for the other stages
            model.save_pretrained(a.save)
            tokenizer.save_pretrained(a.save)
        out["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        out["tokens_per_episode"] = sum(len(x["input_ids"]) for x in data) / len(data)
        out["reply_tokens_per_episode"] = sum(sum(t >= 0 for t in x["action_step"]) for x in data) / len(data)
    print("RESULT " + json.dumps(out))


def run_worker(**kw):
    """One (model, stage) in a process of its own (its settings as JSON), measured: its RESULT and peak resident set."""
    m = must([sys.executable, __file__, "--worker", json.dumps(kw)], result=True, threads=kw["threads"])
    return {**m["result"], "peak_rss_gb": m["peak_mib"] / 1024}


# run_all.sh's defaults: demonstrations, BC epochs, self episodes, eval tasks per split, critic epochs
DEFAULT_CHAIN = (1000, 10, 300, 100, 4)


def chain_minutes(res, demos, bc_epochs, n_self, n_eval, critic_epochs, val_frac=0.05):
    """Minutes per stage of one run_all.sh iteration (K=1) at the measured one-thread rates.
    A trajectory (expert or self) is taken to be as long as the expert demos, and a policy to
    write as many reply tokens per episode as the expert (a BC policy that works)."""
    L, A = res["bc"]["tokens_per_episode"], res["bc"]["reply_tokens_per_episode"]
    rate = {k: r["tokens"] / r["wall_s"] for k, r in res.items()}
    buffer = demos + n_self
    sec = {
        "01 BC (+ validation)": demos * bc_epochs * L * ((1 - val_frac) / rate["bc"] + val_frac / rate["gae"]),
        "02 collection (self + 4 evaluations)": (n_self + 4 * n_eval) * A / rate["collect"],
        "03 critic": buffer * L * critic_epochs / rate["critic"],
        "04 GAE": buffer * L / rate["gae"],
        "05 BPPO (1 epoch)": buffer * L / rate["bppo"],
    }
    return {k: v / 60 for k, v in sec.items()}


def measure(a, models, tmp):
    """Every stage of every model, each in its own process; -> table rows, raw results."""
    rows, results = [], {}
    expert = expert_demos(os.path.join(tmp, "expert.jsonl"), a.demos)
    common = dict(steps=a.steps, batch_size=a.batch_size, threads=a.threads)
    for name in models:
        d = os.path.join(tmp, name)
        policy = os.path.join(d, "policy")
        res = {}
        # tiny: BC from scratch, then its policy for the rest; smollm2: fine-tuned from the converted model
        res["bc"] = run_worker(stage="bc", model="tiny" if name == "tiny" else a.smollm2, data=[expert],
                               save=policy, **common)
        self_eps = os.path.join(d, "self.jsonl")
        res["collect"] = run_worker(stage="collect", model=policy, data=[expert], episodes=a.episodes,
                                    out=self_eps, **common)
        for stage in ("critic", "gae", "bppo"):
            res[stage] = run_worker(stage=stage, model=policy, data=[expert, self_eps], **common)
        results[name] = res
        for stage in STAGES:
            r = res[stage]
            rows.append((name, res["bc"]["params_m"], NAMES[stage], r["shape"], r["tokens"], r["tokens"] / r["wall_s"],
                         r["tokens"] / r["cpu_s"], r["peak_rss_gb"], res["bc"]["tokens_per_episode"]))
            print(f"{name:8s} {NAMES[stage]:18s} {rows[-1][5]:8.1f} tokens/s wall, {rows[-1][6]:8.1f} per CPU s, "
                  f"peak {r['peak_rss_gb']:.2f} GiB ({r['shape']})", flush=True)
    return rows, results


def main():
    p = parser(__doc__)
    p.add_argument("--smollm2", default="models/smollm2-135m", help="directory written by python -m models.smollm2")
    p.add_argument("--models", default="tiny,smollm2", help="which models to measure, comma-separated")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per training stage (after 1 warm-up)")
    p.add_argument("--batch-size", type=int, default=2, help="trajectories per step")
    p.add_argument("--episodes", type=int, default=8, help="collection: episodes, all in lockstep")
    p.add_argument("--demos", type=int, default=16, help="expert demonstrations to train on")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default="runs/model_throughput.md", help="markdown output")
    p.add_argument("--budget", default="100,2,40,20,1",
                   help="the reduced chain to estimate: demos, BC epochs, self episodes, eval tasks per split, "
                        "critic epochs (the default chain's first iteration, %s, is estimated too)"
                        % ",".join(map(str, DEFAULT_CHAIN)))
    p.add_argument("--worker", help=argparse.SUPPRESS)  # run_worker's settings (JSON): one stage of one model
    a = p.parse_args()
    if a.worker:
        return worker(argparse.Namespace(**{"out": "", "save": "", **json.loads(a.worker)}))

    check_flags(a, steps="at least 1", batch_size="at least 1", episodes="at least 1", demos="at least 1",
                threads="at least 1")
    if a.episodes > LIMITS["num_envs"]:  # all in lockstep: 02's --num-envs, refused here, not after the demos
        die(f"--episodes must be at most {LIMITS['num_envs']} (all in lockstep: 02's --num-envs), got {a.episodes}")
    budget = a.budget.split(",")  # before measuring: five counts, each at least 1 (the critic's epochs too)
    if len(budget) != 5 or not all(x.isdigit() and 1 <= int(x) <= 10**6 for x in budget):
        die(f"--budget must be five counts in [1, 1000000], comma-separated (demos, BC epochs, self episodes, eval "
            f"tasks per split, critic epochs), got {a.budget!r}")
    models = a.models.split(",")
    if not models or not set(models) <= {"tiny", "smollm2"}:
        die(f"--models must be tiny, smollm2 or both, comma-separated, got {a.models!r}")
    if "smollm2" in models and not os.path.isfile(os.path.join(a.smollm2, "config.json")):
        die(f"{a.smollm2} is not a model directory; run python -m models.smollm2 --out {a.smollm2}")
    summary = os.path.splitext(os.path.join(ROOT, a.out))[0] + ".json"
    table_out(a.out, "bench/speed/model_throughput.py", markdown=False)  # before any work: new, or this script's
    check_out(summary, "bench_json")
    with scratch("model_throughput_") as tmp:
        rows, results = measure(a, models, tmp)

    lines = [measured(f"python bench/speed/model_throughput.py --threads {a.threads} --steps {a.steps} --batch-size "
                      f"{a.batch_size} --episodes {a.episodes}")
             + f"; torch threads {a.threads}, fp32.",
             "",
             "| model | params | stage | shape | tokens timed | tokens/s (wall) | tokens per CPU s | peak RSS |",
             "|---|---|---|---|---|---|---|---|"]
    for name, params, stage, shape, tokens, wall, cpu, rss, _ in rows:
        lines.append(f"| {name} | {params:.1f}M | {stage} | {shape} | {tokens} | {wall:,.0f} | {cpu:,.0f} "
                     f"| {rss:.1f} GiB |")
    lines += ["", "Tokens: real tokens of the trajectories a step trains on (01, 03, 05) or reads (04); for 02, "
              "the generated tokens (the prefill of prompts and observations is in the time). Expert demos average "
              + ", ".join(f"{n} {next(r[8] for r in rows if r[0] == n):.0f}" for n in models)
              + " tokens per trajectory (mixed with the model's own episodes for 03-05)."]
    d = DEFAULT_CHAIN
    budgets = {f"default ({d[0]} demos, {d[1]} BC epochs, {d[2]} self, {d[3]} eval tasks per split, {d[4]} critic "
               "epochs)": d}
    b = tuple(int(x) for x in budget)
    budgets[f"reduced ({b[0]} demos, {b[1]} BC epochs, {b[2]} self, {b[3]} eval tasks per split, {b[4]} critic "
            "epoch(s))"] = b
    lines += ["", "## What a chain would cost at these rates (one iteration, K=1, one thread)", "",
              "Estimated from the rates above (`chain_minutes`): every trajectory as long as an expert demo, "
              "replies as long as the expert's (a working BC policy), collection at the measured "
              "generated-tokens rate. Minutes:", ""]
    for label, budget in budgets.items():
        est = {n: chain_minutes(results[n], *budget) for n in models}
        lines += [f"**{label}**", "", "| stage | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
        for stage in next(iter(est.values())):
            lines.append(f"| {stage} | " + " | ".join(f"{est[n][stage]:,.1f}" for n in models) + " |")
        lines += ["| **total** | " + " | ".join(f"**{sum(est[n].values()):,.0f}**" for n in models) + " |", ""]
    lines += ["Check against a measured run: for the tiny model, the default chain is estimated at "
              + (f"{sum(chain_minutes(results['tiny'], *DEFAULT_CHAIN).values()):.0f} min"
                 if "tiny" in results else "(tiny not measured)")
              + " for one iteration; bench/results/stage_times.md times every launch of a real run "
              "(`python bench/speed/stage_times.py --run RUN`). The estimate leaves out loading the model in every "
              "stage (seconds) and "
              "the expert demos. Collection here ran policies after 3 BC steps, whose replies run to "
              "`--max-new-tokens`; a trained policy's shorter replies make the prefill a larger share, "
              "so expect fewer generated tokens/s from it.", ""]
    keep = {k: v for k, v in vars(a).items() if k not in ("out", "worker")}
    save_text(summary, json.dumps({"stage": "bench/speed/model_throughput.py", "args": keep, "results": results},
                                  indent=1) + "\n")
    write_table(a.out, lines, f"wrote {a.out}")


if __name__ == "__main__":
    main()
