"""Where a run of run_all.sh spends its time: each launch timed by GNU time (wall, CPU), the stage's own loop from
metrics.jsonl, the rest start-up and wrap-up; training stages' model FLOP/s (runner.FLOPS_PER_N) against this machine's
matmul peak. run_all.sh's other settings come from the environment.

    python bench/speed/stage_times.py --run runs/timed              # run_all.sh with RUN=runs/timed, each launch timed
    python bench/speed/stage_times.py --run runs/timed --table-only  # the table from that run's launches.log again
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from bench.runner import (FLOPS_PER_N, ROOT, body_params, check, last_epochs, launch, measured, parser,  # noqa
                          table_out, wait, write_table)
from plumbing import check_flags, die, loads  # noqa: E402


def matmul_peak(threads, dtype, n=1024, seconds=2.0):
    """GFLOP/s of an n x n matmul on this CPU, `threads` torch threads (the best of repeated runs)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best, t_end = 0.0, time.time() + seconds
    while time.time() < t_end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0) / 1e9)
    return best


def launches(log):
    """GNU time's lines 'wall,user,sys,command' -> [(stage, command, wall, cpu)] (the results table: run_support's)."""
    out = []
    for n, line in enumerate(read_lines(log), 1):
        try:
            wall, user, system, command = line.rstrip("\n").split(",", 3)
            wall, cpu = float(wall), float(user) + float(system)
        except ValueError:
            die(f"{log}:{n}: not a line of GNU time's 'wall,user,sys,command'")
        if "run_support.py start " in command or "run_support.py build " in command:  # run_all.sh's start (the whole
            continue  # run) and the base cache's build (00_pretrain inside it, whose own line follows)
        script = next((w for w in command.split() if w.endswith(".py") or w == "-"), "?")
        stage = os.path.basename(script)[:-3]
        out.append(("results table" if script == "-" or stage == "run_support" else stage, command, wall, cpu))
    return out


def read_lines(path):
    """A text file's lines, or one error line (missing, unreadable, binary)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        die(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e}); run without --table-only first")


def main():
    p = parser(__doc__)
    p.add_argument("--run", default="runs/timed", help="the run directory (RUN)")
    p.add_argument("--out", default="runs/stage_times.md", help="the markdown table to write")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the matmul peak (run_all.sh's THREADS)")
    p.add_argument("--table-only", action="store_true", help="do not run; tabulate RUN/launches.log")
    args = p.parse_args()
    check_flags(args, threads="at least 1")
    if args.threads > (os.cpu_count() or 1):
        die(f"--threads must be at most this machine's {os.cpu_count()} cores, got {args.threads}")
    table_out(args.out, "bench/speed/stage_times.py", markdown=False)  # relative to the repository, as the defaults
    run = os.path.join(ROOT, args.run)  # so is --run: run_all.sh runs in the repository
    log = os.path.join(run, "launches.log")
    if any(c.isspace() or c in "$`'\"\\" for c in log):  # it goes into PYTHON, which run_all.sh splits into words
        die(f"{log}: the run's path must have no spaces, quotes, $ or backquotes (GNU time's -o would split)")
    t0 = time.time()
    if not args.table_only:
        if os.path.exists(log):
            die(f"{log} exists: a timed run must start from nothing (another --run, or --table-only)")
        check(run)  # every setting, before GNU time writes the log
        os.makedirs(run, exist_ok=True)
        python = os.environ.get("PYTHON", "python")
        code = wait(launch(run, {"PYTHON": f"/usr/bin/time -a -o {log} -f %e,%U,%S,%C {python}"}))[0]
        if code:
            sys.exit(code)  # run_all.sh said why
    if not os.path.exists(log):
        die(f"{log}: no such file; run without --table-only first")
    total = time.time() - t0
    try:
        records = [loads(line) for line in read_lines(os.path.join(run, "metrics.jsonl"))]
    except ValueError as e:
        die(f"{args.run}/metrics.jsonl: not a metrics JSONL of the stages ({e})")
    weights = os.path.join(run, "policy_0", "model.safetensors")
    if not os.path.isfile(weights):
        die(f"{weights}: no such file; is {args.run} a run of run_all.sh?")
    peak = {dt: matmul_peak(args.threads, getattr(torch, dt)) for dt in ("float32", "bfloat16")}
    n_body = body_params(os.path.dirname(weights))
    rows = ["| launch | wall s | CPU s | the stage's loop s | start-up and wrap-up s | tokens/s | GFLOP/s | "
            "of the fp32 peak |", "|---|---|---|---|---|---|---|---|"]
    peak_fp32, seen, timed = peak["float32"], {}, launches(log)  # seen: stage -> launches so far (02: records)
    for stage, command, wall, cpu in timed:
        mine, k = [r for r in records if r.get("stage") == stage], seen.get(stage, 0)
        loop, rate, flops = None, None, None
        if stage in FLOPS_PER_N:  # this launch's epochs: the k-th run of records starting at epoch 1
            last = last_epochs(mine, stage)[k]
            loop, rate = last["elapsed_s"], last["tokens_per_s"]
            flops = rate * FLOPS_PER_N[stage] * n_body / 1e9
            seen[stage] = k + 1
        elif stage == "02_collect":  # this launch's (world, split) pairs: one record each, the launch's wall_s
            loop, seen[stage] = mine[k]["wall_s"], k + mine[k].get("runs_in_batch", 1)
        what = stage + (" " + command.split("--policy ")[1].split()[0].split("/")[-1] if "--policy " in command else "")
        rows.append(f"| {what} | {wall:.1f} | {cpu:.1f} | {'-' if loop is None else f'{loop:.1f}'} | "
                    f"{'-' if loop is None else f'{wall - loop:.1f}'} | {'-' if rate is None else f'{rate:,.0f}'} | "
                    f"{'-' if flops is None else f'{flops:.1f}'} | "
                    f"{'-' if flops is None else f'{flops / peak_fp32:.0%}'} |")
    walls, base = [w for _, _, w, _ in timed], sum(w for stage, _, w, _ in timed if stage == "00_pretrain")
    cached = f" ({total - base:.0f} s without building the base model, which later runs find cached)" if base else ""
    write_table(args.out, [
        measured(f"python bench/speed/stage_times.py --run {args.run}") + " (run_all.sh's settings from the "
        "environment)", "", "# Where the run's time goes", "", f"{len(walls)} launches, {sum(walls):.0f} s of launches"
        + ("" if args.table_only else f", {total:.0f} s in all{cached}") + ". This machine's matmul peak with "
        f"{args.threads} threads: {peak['float32']:.0f} GFLOP/s fp32, {peak['bfloat16']:.0f} bf16 (1024 x 1024). "
        f"N = {n_body:,} parameters outside the embedding.", "", *rows])


if __name__ == "__main__":
    main()
