"""Peak memory and seconds of one SmolLM2 training step on a CPU as 01_bc.py and 05_bppo.py take it, each in its own
process on --env's expert demos (B + 1 for 01, one held out; 05: B demos with advantages +1 / -1). --stages DIR runs
another checkout's stage files (before / after a change, on one machine); --flags adds stage flags. Each call adds its
rows to --out.

    python bench/speed/train_memory.py --model models/smollm2-135m --label after
    python bench/speed/train_memory.py --model models/smollm2-135m --stages /tmp/before --label before
    python bench/speed/train_memory.py --env shop
"""
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from bench.runner import KWARGS, ROOT, expert_demos, must, parser, scratch, table_out, write_table  # noqa: E402
from plumbing import check_flags, die  # noqa: E402

# the stages' flags this script sets itself: --flags may not set them again
SETS = ["--data", "--model", "--policy", "--ref", "--lr", "--out", "--epochs", "--batch-size", "--threads"]


def main():
    p = parser(__doc__)
    p.add_argument("--env", default="kitchen", choices=["kitchen", *sorted(KWARGS)],
                   help="whose expert demos (the table's rows so far: household's)")
    p.add_argument("--model", default="models/smollm2-135m", help="a model directory (python -m models.smollm2)")
    p.add_argument("--stages", default=ROOT, help="the checkout whose 01_bc.py / 05_bppo.py run")
    p.add_argument("--label", default="this checkout", help="the rows' name in the table")
    p.add_argument("--flags", default="", help="extra flags for both stages")
    p.add_argument("--batch-size", type=int, default=16, help="trajectories in the step (the lab's: 16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/train_memory.md")
    a = check_flags(p.parse_args(), batch_size="at least 1", threads="non-negative")
    missing = next((f for f in ("01_bc.py", "05_bppo.py") if not os.path.isfile(os.path.join(a.stages, f))), None)
    if missing:
        die(f"--stages {a.stages}: no {missing} there; name a checkout")
    for word in a.flags.split():  # a flag this script sets (however abbreviated): --out wrote into the checkout
        name = word.split("=")[0]
        own = next((f for f in SETS if name.startswith("--") and len(name) > 2 and f.startswith(name)), None)
        if own:
            die(f"--flags {a.flags!r}: train_memory.py sets {own} itself")
    out = table_out(a.out, "bench/speed/train_memory.py", markdown=False)  # before the runs: new, or this script's
    model, B = os.path.abspath(a.model), a.batch_size
    common = ["--epochs", "1", "--batch-size", str(B), "--threads", str(a.threads), *a.flags.split()]
    rows = []
    with scratch("train_memory_") as tmp:
        expert = expert_demos(os.path.join(tmp, "expert.jsonl"), B + 1, a.env)
        adv = os.path.join(tmp, "adv.jsonl")
        with open(adv, "w") as f:
            for line in open(expert).readlines()[:B]:
                ep = json.loads(line)
                ep["steps"] = [dict(s, adv=(-1.0) ** t) for t, s in enumerate(ep["steps"])]
                f.write(json.dumps(ep) + "\n")
        for script, args in (("01_bc", ["--data", expert, "--model", model, "--lr", "1e-5"]),
                             ("05_bppo", ["--data", adv, "--policy", model, "--ref", model, "--lr", "1e-6"])):
            m = must([sys.executable, f"{script}.py", *args, "--out", os.path.join(tmp, script), *common],
                     cwd=a.stages, threads=a.threads)
            stage = script if a.env == "household" else f"{script}, {a.env}"
            rows.append(f"| {a.label} | {stage} | {B} | {a.flags or '-'} | {m['peak_mib'] / 1024:.2f} | "
                        f"{m['wall_s']:.0f} |")
            print(rows[-1], flush=True)
    head = [f"Measured on {platform.machine()} with {os.cpu_count()} CPU cores by `python "
            "bench/speed/train_memory.py` (its docstring: one optimizer step of SmolLM2-135M on household's expert "
            "demos, or those of the env the stage cell names (`--env`), fp32 on the CPU); each row's label says which "
            "code ran.", "",
            "| code | stage | batch | flags | peak RSS (GiB) | seconds (load, step, save) |",
            "|---|---|---|---|---|---|"]
    old = open(out).read().splitlines()[len(head):] if os.path.exists(out) else []
    write_table(out, head + [r for r in old if r.startswith("|")] + rows, f"wrote {out}")


if __name__ == "__main__":
    main()
