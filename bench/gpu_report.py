"""The report of bench/gpu_check.sh: what the GPU check measured, as one markdown page.

Reads   CHECK/<env>/ (a run_all.sh run: metrics.jsonl, results.md, policy_0, policy_1), CHECK/<env>.seconds
        (the chain's wall-clock) and CHECK/tests.log (pytest -v)
Writes  --out: the device; the tests' outcome; per training stage its seconds (the loop, start-up
        excluded), tokens/s, peak GPU memory and model FLOP utilisation; collection's generated tokens/s;
        how far 05 moved the policy; each run's results table.

How FLOPs are counted: a token through a training step costs 6 N (forward 2 N, backward 4 N), N the
parameters outside the input embedding (a tied output head counted at every token, attention's
quadratic term left out); 05 adds pi_ref's forward (2 N): 8 N. Utilisation = tokens/s x FLOPs per token
/ the device's dense bf16 peak (PEAK_TFLOPS by name, or --peak-tflops).

    python bench/gpu_report.py --check runs/gpu_check --out bench/results/gpu.md
"""
import argparse
import json
import os
import platform
import re
import sys
import time

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from plumbing import check_out, die, save_text  # noqa: E402

PEAK_TFLOPS = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "A10": 125, "L4": 121, "T4": 65}  # dense bf16
FLOPS_PER_N = {"01_bc": 6, "03_critic": 6, "05_bppo": 8}


def device_name():
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'}, " \
        f"{os.cpu_count()} cores)"


def body_params(policy_dir):
    """N: the policy's parameters outside the input embedding table."""
    weights = load_file(os.path.join(policy_dir, "model.safetensors"))
    return sum(t.numel() for k, t in weights.items() if "embed_tokens" not in k)


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


def main(argv=None):
    p = argparse.ArgumentParser(description="Write the GPU check's report (bench/gpu_check.sh runs it).")
    p.add_argument("--check", required=True, help="the check's directory (CHECK in bench/gpu_check.sh)")
    p.add_argument("--out", required=True, help="the markdown page to write")
    p.add_argument("--peak-tflops", type=float, default=0, help="the device's dense bf16 peak (0: by its name)")
    args = p.parse_args(argv)
    check_out(args.out, "table")  # a table a bench script wrote, or a new file
    names = os.listdir(args.check) if os.path.isdir(args.check) else []
    runs = sorted(d for d in names if os.path.isfile(os.path.join(args.check, d, "results.md")))
    if not runs:
        die(f"{args.check}: no finished run (a <env>/results.md); did bench/gpu_check.sh run?")
    name = device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0)
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {name} by `bash bench/gpu_check.sh` (its last step: "
             f"`python bench/gpu_report.py --check {args.check}`), torch {torch.__version__}", "",
             "# GPU check", "", "bench/gpu_check.sh says what it runs; bench/gpu_report.py how it counts. "
             f"Peak for utilisation: {f'{peak:g} TFLOP/s (bf16, dense)' if peak else 'unknown (no MFU)'}.", "",
             f"**Tests** (`{args.check}/tests.log`): {test_summary(os.path.join(args.check, 'tests.log'))}", "",
             "| run | stage | loop seconds | tokens/s | peak memory (GB; CPU: RSS) | TFLOP/s | MFU |",
             "|---|---|---|---|---|---|---|"]
    moved = ["| run | chain wall-clock (s) | 05: KL(pi_1 \\|\\| pi_ref) per token | 05: approx KL(pi_old \\|\\| pi_1) "
             "| tensors of policy_1 that differ from policy_0 | their elements that differ | saved dtype |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        d = os.path.join(args.check, run)
        n = body_params(os.path.join(d, "policy_0"))
        records = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
        for stage in ("01_bc", "03_critic", "05_bppo"):
            last = [r for r in records if r["stage"] == stage and "epoch" in r][-1]
            tflops = last["tokens_per_s"] * FLOPS_PER_N[stage] * n / 1e12
            mfu = f"{tflops / peak:.1%}" if peak else "-"
            lines.append(f"| {run} | {stage} | {last['elapsed_s']:.0f} | {last['tokens_per_s']:,.0f} | "
                         f"{last['peak_mem_gb']:.1f} | {tflops:.3g} | {mfu} |")
        for r in [r for r in records if r["stage"] == "02_collect" and r["policy"] != "expert"]:
            rate = r["generated_tokens"] / max(r["wall_s"], 1e-9)
            lines.append(f"| {run} | 02_collect {r['policy']} {r['split']} ({r['episodes']} episodes) | "
                         f"{r['wall_s']:.0f} | {rate:,.0f} generated | - | - | - |")
        bppo = [r for r in records if r["stage"] == "05_bppo" and "epoch" in r][-1]
        a, b = (load_file(os.path.join(d, p, "model.safetensors")) for p in ("policy_0", "policy_1"))
        diff = [(a[k] != b[k]) for k in a]
        seconds = open(os.path.join(args.check, f"{run}.seconds")).read().split()[-1] \
            if os.path.exists(os.path.join(args.check, f"{run}.seconds")) else "-"
        moved.append(f"| {run} | {seconds} | {bppo['kl_ref']:.2e} | {bppo['approx_kl_old']:.2e} | "
                     f"{sum(bool(x.any()) for x in diff)} of {len(diff)} | "
                     f"{sum(int(x.sum()) for x in diff) / sum(x.numel() for x in diff):.1%} | "
                     f"{', '.join(sorted({str(t.dtype) for t in b.values()}))} |")
    lines += ["", "How far 05 (BPPO) moved the policy:", "", *moved]
    for run in runs:
        table = open(os.path.join(args.check, run, "results.md")).read().split("\n\n", 1)[-1]
        lines += ["", f"## {run}", "", table.strip()]
    save_text(args.out, "\n".join(lines) + "\n")
    print(f"gpu_report: wrote {args.out}")


if __name__ == "__main__":
    main()
