"""Peak memory of one SmolLM2 training step on a CPU, as the stages take it: 01_bc.py and 05_bppo.py each run
in a process of its own on --env's expert demos (run_all.sh's miniature of it), with --batch-size B trajectories
and exactly one optimizer step (01: B + 1 demos, one held out for validation; 05: B demos with an advantage
of +1 / -1 on alternate steps, pi_ref = pi_old = the model). Reported: the process's peak resident set
(model, pi_ref, AdamW's state, activations, logits) and its seconds. --stages DIR measures the stage files of
another checkout (e.g. `git archive HEAD~3 | tar -x -C /tmp/before`), so a change shows before and after
on one machine; --flags adds stage flags (e.g. "--grad-checkpointing off").

    python bench/train_memory.py --model models/smollm2-135m --label after
    python bench/train_memory.py --model models/smollm2-135m --stages /tmp/before --label before
    python bench/train_memory.py --env shop
Each call adds its rows to --out (bench/results/train_memory.md).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import Parser, check_out, save_text  # noqa: E402

KWARGS = {"household": '{"step_slack": [0, 1, 2], "n_distractors": 1, "habit": 0.8, "room_questions": 0.4}',
          "shop": '{"page_size": 3, "max_steps": 10, "hasty": 0.5}'}  # run_all.sh's miniatures
PEAK = ("import resource, runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, '.')\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "finally:\n    print('PEAK_RSS_GB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)")


def run(stages, script, args, threads):
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", PEAK, f"{script}.py", *args], cwd=stages, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    peak = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PEAK_RSS_GB")]
    if proc.returncode != 0 or not peak:
        raise SystemExit(f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return peak[0], time.time() - t0


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="household", choices=sorted(KWARGS), help="whose expert demos")
    p.add_argument("--model", default="models/smollm2-135m", help="a model directory (python -m models.smollm2)")
    p.add_argument("--stages", default=ROOT, help="the checkout whose 01_bc.py / 05_bppo.py run")
    p.add_argument("--label", default="this checkout", help="the rows' name in the table")
    p.add_argument("--flags", default="", help="extra flags for both stages")
    p.add_argument("--batch-size", type=int, default=16, help="trajectories in the step (the lab's: 16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/train_memory.md"))
    a = p.parse_args()
    check_out(a.out, "table")  # before the runs: a table a bench script wrote, or a new file
    model, B = os.path.abspath(a.model), a.batch_size
    common = ["--epochs", "1", "--batch-size", str(B), "--threads", str(a.threads), *a.flags.split()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="train_memory_") as tmp:
        expert = os.path.join(tmp, "expert.jsonl")
        subprocess.run([sys.executable, "02_collect.py", "--policy", "expert", "--env", a.env, "--env-kwargs",
                        KWARGS[a.env], "--split", "train", "--episodes", str(B + 1), "--out", expert], cwd=ROOT,
                       check=True, capture_output=True)
        eps = [json.loads(line) for line in open(expert)]
        adv = os.path.join(tmp, "adv.jsonl")
        with open(adv, "w") as f:
            for ep in eps[:B]:
                ep["steps"] = [dict(s, adv=(-1.0) ** t) for t, s in enumerate(ep["steps"])]
                f.write(json.dumps(ep) + "\n")
        for script, args in (("01_bc", ["--data", expert, "--model", model, "--lr", "1e-5"]),
                             ("05_bppo", ["--data", adv, "--policy", model, "--ref", model, "--lr", "1e-6"])):
            peak, sec = run(a.stages, script, [*args, "--out", os.path.join(tmp, script), *common], a.threads)
            stage = script if a.env == "household" else f"{script}, {a.env}"
            rows.append(f"| {a.label} | {stage} | {B} | {a.flags or '-'} | {peak:.2f} | {sec:.0f} |")
            print(rows[-1], flush=True)
    head = [f"Measured on {platform.machine()} with {os.cpu_count()} CPU cores by `python "
            "bench/train_memory.py` (its docstring: one optimizer step of SmolLM2-135M on household's expert demos, "
            "or those of the env the stage cell names (`--env`), fp32 on the CPU); each row's label says which code "
            "ran.", "",
            "| code | stage | batch | flags | peak RSS (GiB) | seconds (load, step, save) |",
            "|---|---|---|---|---|---|"]
    old = open(a.out).read().splitlines()[len(head):] if os.path.exists(a.out) else []
    save_text(a.out, "\n".join(head + [r for r in old if r.startswith("|")] + rows) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
