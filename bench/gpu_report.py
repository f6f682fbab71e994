"""The report of bench/gpu_lab.sh as one markdown page, from LAB/<env>-s<seed>/ (run_all.sh runs), their .seconds
and LAB's tests.log, decode_step.log, mps.log and machine.log: per environment and world each policy's success and
average reward, mean +- std over the seeds that finished it (a run stopped at DEADLINE counts with what it finished);
per stage its launches, loop seconds, tokens/s, peak memory and model FLOP utilisation (runner.FLOPS_PER_N; the peak:
PEAK_TFLOPS or --peak-tflops); the machine's use; how far 05 moved the policy; the tests' outcome.

    python bench/gpu_report.py --lab runs/gpu_lab --out bench/results/gpu_lab.md
"""
import json
import os
import platform
import re
import statistics
import sys
import time

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench.runner import (ALGOS, FLOPS_PER_N, body_params, evaluations, last_epochs, parser, spread,  # noqa
                          table_out, write_table)
from plumbing import check_flags, die  # noqa: E402

PEAK_TFLOPS = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "A10": 125, "L4": 121, "T4": 65}  # dense bf16
NAMES = {**{tag: name for _, tag, _, name, _ in ALGOS}, "eto_": "ETO", "qlass_": "QLASS"}  # a policy's prefix -> method


def device_name():
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'}, " \
        f"{os.cpu_count()} cores)"


def test_summary(log):
    """Counts of a `pytest -v` log's result lines (each test once: pytest's closing summary repeats the failed)."""
    if not os.path.exists(log):
        return "not run"
    results = [re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED)\b", line) for line in open(log, errors="replace")
               if "::" in line and not re.match(r"(FAILED|ERROR) ", line)]
    results = [(m.group(1), re.search(r"tests/\S+::\S+", m.string).group()) for m in results if m]
    counts = ", ".join(f"{sum(o == k for o, _ in results)} {k.lower()}"
                       for k in ("PASSED", "FAILED", "ERROR", "SKIPPED"))
    return counts + "".join(f"\n  - {t}" for t in sorted({t for o, t in results if o in ("FAILED", "ERROR")}))


def policy_order(name):
    """policy_0 first, then each method's in runner.METHODS' order, by iteration."""
    tag, k = re.fullmatch(r"(\w*?)policy_(\d+)", name).groups()
    return list(NAMES).index(tag), int(k)


def trained(run):
    """The policies a run trained (policy_<k>, rft/policy_<k>, eto/policy_<k>, ...), by their evaluations' names."""
    return {tag + d for tag in NAMES if os.path.isdir(os.path.join(run, tag[:-1]))
            for d in os.listdir(os.path.join(run, tag[:-1])) if re.fullmatch(r"policy_\d+", d)}


def online_steps(run, pol):
    """A policy's online environment steps to date, as run_support.py's results count them: its own episodes of
    every iteration up to its own (iteration 1's shared), QLASS's trees; None where a summary is missing."""
    tag, k = re.fullmatch(r"(\w*?)policy_(\d+)", pol).groups()
    files = [os.path.join(run, "qlass", "trees.json")] if tag == "qlass_" else \
        [os.path.join(run, *([] if j == 1 or not tag else [tag[:-1]]), f"iter_{j}", "self.json")
         for j in range(1, int(k) + 1)]
    if not all(os.path.isfile(f) for f in files):
        return None
    return sum(json.load(open(f))["env_steps"] for f in files)


def policy_tables(evals, n_seeds, policies=(), steps=None):
    """Markdown lines: one table per evaluation world, each policy's success and average reward on each split,
    mean +- std over the seeds that finished that evaluation (fewer than all: their count in brackets), and its
    online environment steps (steps: {policy: each seed's}, their mean). Policies also lists those trained: one
    that no seed evaluated (stopped by DEADLINE) has a row of '-'."""
    steps = steps or {}
    lines = []
    for world in sorted({w for e in evals for _, w, _ in e}, key=lambda w: int(w.removeprefix("world"))):
        splits = sorted({s for e in evals for _, w, s in e if w == world}, key=lambda s: (s != "seen", s))
        lines += ["", f"{world}:", "", "| policy | " + " | ".join(f"{s} success | {s} avg reward" for s in splits)
                  + " | online env steps |", "|---|" + "---|---|" * len(splits) + "---|"]
        for pol in sorted({p for e in evals for p, w, _ in e if w == world} | set(policies), key=policy_order):
            tag, k = re.fullmatch(r"(\w*?)policy_(\d+)", pol).groups()
            cells = []
            for s in splits:
                done = [e[pol, world, s] for e in evals if (pol, world, s) in e]
                n = f" ({len(done)} of {n_seeds} seeds)" if len(done) < n_seeds else ""
                cells.append(f"{spread([100 * d[0] for d in done], '{:.1f}')}%{n} | "
                             f"{spread([d[1] for d in done], '{:.3f}')}" if done else "- | -")
            label = "policy_0 (BC)" if k == "0" else f"{pol} ({NAMES[tag]}: BC and its QNet)" if tag == "qlass_" \
                else f"{pol} ({NAMES[tag]} iter {k})"
            n_steps = f"{statistics.mean(steps[pol]):,.0f}" if steps.get(pol) else "-"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {n_steps} |")
    return lines


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--lab", required=True, help="the lab's directory (LAB in bench/gpu_lab.sh)")
    p.add_argument("--out", required=True, help="the markdown page to write")
    p.add_argument("--command", default="bash bench/gpu_lab.sh", help="the command the page says it measured")
    p.add_argument("--peak-tflops", type=float, default=0, help="the device's dense bf16 peak (0: by its name)")
    args = check_flags(p.parse_args(argv), peak_tflops="non-negative")
    if not os.path.isdir(args.lab):
        die(f"--lab {args.lab}: no such directory (bench/gpu_lab.sh's LAB)")
    table_out(args.out, "bench/gpu_report.py", markdown=False)  # a table a bench script wrote, or a new file
    runs = sorted(d for d in os.listdir(args.lab) if re.fullmatch(r"\w+-s\d+", d)  # finished or not (DEADLINE)
                  and os.path.isfile(os.path.join(args.lab, d, "policy_0", "model.safetensors")))
    if not runs:
        die(f"{args.lab}: no run got as far as its BC policy (<env>-s<seed>/policy_0); did bench/gpu_lab.sh run?")
    name = device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0)
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {name} by `{args.command}` (its last step: "
             f"`python bench/gpu_report.py --lab {args.lab}`), torch {torch.__version__}", "",
             "# The real-model lab", "", "bench/gpu_lab.sh says what it runs and its budgets; bench/gpu_report.py how "
             f"it counts. Peak for utilisation: {f'{peak:g} TFLOP/s (bf16, dense)' if peak else 'unknown (no MFU)'}.",
             "", f"**Tests** (`{args.lab}/tests.log`): {test_summary(os.path.join(args.lab, 'tests.log'))}"]
    step_log = os.path.join(args.lab, "decode_step.log")  # the CUDA-graph decode step's check, where it ran
    if os.path.isfile(step_log):
        timed = [line.strip() for line in open(step_log) if line.startswith("decode step")]
        ms = [float(line.split(": ")[1].split()[0]) for line in timed]  # eager, then CUDA graph (gpu_lab.sh's rule)
        ran = ("eager: the CUDA-graph step failed" if len(ms) < 2 else "with CUDA graphs" if ms[1] < ms[0]
               else "eager: the CUDA-graph step was not faster")
        lines += ["", f"**One decode step** (`{step_log}`, random weights; 02 ran {ran}): " +
                  ("; ".join(timed) or "no timing")]
    mps_log = os.path.join(args.lab, "mps.log")  # whether the processes shared the GPU through NVIDIA's MPS
    if os.path.isfile(mps_log):
        said = [line.strip()[5:] for line in open(mps_log) if line.startswith("MPS: ")]
        lines += ["", f"**NVIDIA's MPS** (`{mps_log}`): {said[-1] if said else '-'}"]
    use_log = os.path.join(args.lab, "machine.log")  # each second: GPU MiB in use, in all, utilisation %, runnable
    if os.path.isfile(use_log):
        samples = [[float(x) for x in line.split(",")] for line in open(use_log)
                   if re.fullmatch(r"\s*\d+(\.\d+)?(,\s*\d+(\.\d+)?){3}\s*", line)]
        if samples:
            mem, total, util, threads = zip(*samples)
            lines += ["", f"**The machine** (`{use_log}`, each second, {len(samples)} samples): GPU memory in use "
                      f"peaked at {max(mem) / 1024:.1f} GB of {total[0] / 1024:.1f} (every process of the lab "
                      f"together); GPU utilisation {statistics.mean(util):.0f}% on average, at most {max(util):.0f}% "
                      f"(the share of each second in which a kernel ran); runnable threads "
                      f"{statistics.mean(threads):.1f} on average, at most {max(threads):.0f}, on {os.cpu_count()} CPU "
                      "cores (more: threads waiting for a core)"]
    by_env = {}
    for run in runs:
        by_env.setdefault(run.rsplit("-s", 1)[0], []).append(run)
    for env, env_runs in by_env.items():
        seeds = [r.rsplit("-s", 1)[1] for r in env_runs]
        evals = [{(p, f"world{w}", s): (e["success_rate"], e["avg_reward"])
                  for (p, w, s), e in evaluations(os.path.abspath(os.path.join(args.lab, r))).items()}
                 for r in env_runs]
        walls = [open(os.path.join(args.lab, f"{r}.seconds")).read().split()[-1]  # after the writer's stamp line
                 for r in env_runs if os.path.exists(os.path.join(args.lab, f"{r}.seconds"))]
        lines += ["", f"## {env}: seeds {', '.join(seeds)}", "",
                  f"Each cell: mean ± std over the seeds. Each run's wall-clock: {', '.join(walls) or '-'} s."]
        policies = {p for r in env_runs for p in trained(os.path.join(args.lab, r))} | {p for e in evals for p, *_ in e}
        steps = {p: [n for r in env_runs if (n := online_steps(os.path.join(args.lab, r), p)) is not None]
                 for p in policies}  # the demonstrations' steps apart: not online
        lines += policy_tables(evals, len(seeds), policies, steps)
        lines += ["", "| stage | launches per run (02: one per world and split) | loop seconds per run | tokens/s "
                  "| peak memory (GB; CPU: RSS) | TFLOP/s | MFU |", "|---|---|---|---|---|---|---|"]
        records = [[json.loads(line) for line in open(os.path.join(args.lab, r, "metrics.jsonl"))] for r in env_runs]
        n = body_params(os.path.join(args.lab, env_runs[0], "policy_0"))
        for stage in ("01_bc", "03_critic", "05_bppo", "eto", "qlass"):  # eto: DPO; qlass: its QNet
            done = [last_epochs(rs, stage) for rs in records]
            if not any(done):
                continue
            rate = statistics.mean(r["tokens_per_s"] for d in done for r in d)
            tflops = rate * {**FLOPS_PER_N, "eto": 8, "qlass": 6}[stage] * n / 1e12  # eto: pi's 6, pi_ref's 2
            lines.append(f"| {stage} | {statistics.mean(len(d) for d in done):g} | "
                         f"{spread([sum(r['elapsed_s'] for r in d) for d in done], '{:.0f}')} | {rate:,.0f} | "
                         f"{max(r['peak_mem_gb'] for d in done for r in d):.1f} | {tflops:.3g} | "
                         f"{f'{tflops / peak:.1%}' if peak else '-'} |")
        for what, greedy in (("sampled (train)", False), ("greedy (evaluation)", True)):
            cs = [[r for r in rs if r["stage"] == "02_collect" and r["policy"] != "expert" and r["greedy"] == greedy]
                  for rs in records]
            if any(cs):
                walls = [sum(r["wall_s"] / r.get("runs_in_batch", 1) for r in c) for c in cs]  # a batch's wall once
                tokens = sum(r["generated_tokens"] for c in cs for r in c)
                lines.append(f"| 02_collect, {what} | {statistics.mean(len(c) for c in cs):g} | "
                             f"{spread(walls, '{:.0f}')} | {tokens / max(sum(walls), 1e-9):,.0f} generated | "
                             f"{max(r['peak_mem_gb'] for c in cs for r in c):.1f} | - | - |")
        lines += ["", "How far Q-Evolve's first 05 (BPPO) moved the policy:", "",
                  "| run | 05: KL(pi_1 \\|\\| pi_ref) per token | 05: approx KL(pi_old \\|\\| pi_1) "
                  "| tensors of policy_1 that differ from policy_0 | their elements that differ | saved dtype |",
                  "|---|---|---|---|---|---|"]
        for run, rs in zip(env_runs, records):
            if not os.path.isdir(os.path.join(args.lab, run, "policy_1")):
                continue  # stopped before (DEADLINE)
            bppo = next(r for r in last_epochs(rs, "05_bppo") if r["out"].endswith(f"{run}/policy_1"))  # Q-Evolve's
            a, b = (load_file(os.path.join(args.lab, run, p, "model.safetensors")) for p in ("policy_0", "policy_1"))
            diff = [(a[k] != b[k]) for k in a]
            lines.append(f"| {run} | {bppo['kl_ref']:.2e} | {bppo['approx_kl_old']:.2e} | "
                         f"{sum(bool(x.any()) for x in diff)} of {len(diff)} | "
                         f"{sum(int(x.sum()) for x in diff) / sum(x.numel() for x in diff):.1%} | "
                         f"{', '.join(sorted({str(t.dtype) for t in b.values()}))} |")
    write_table(args.out, lines, f"gpu_report: wrote {args.out}")


if __name__ == "__main__":
    main()
