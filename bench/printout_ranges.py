"""The ranges docs/printout.md calls healthy, read off saved `bash run_all.sh` logs: for each number the guide
quotes, its smallest and largest value over every log given (and every iteration, epoch, world and split in it).

    RUN=runs/paperS SEED=S ALGOS="qevolve eto qlass" bash run_all.sh > runs/logs/paperS.log 2>&1   # S = 0..4
    python bench/printout_ranges.py runs/logs/paper0.log runs/logs/paper1.log ...
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench.runner import parser  # noqa: E402
from plumbing import die  # noqa: E402

N = r"([-+]?\d+\.?\d*)"
# (what the guide calls it, the printed line's pattern: each group one number of the row)
ROWS = [
    ("00 train loss at the end", rf"^00_pretrain: wrote .*train loss {N}"),
    ("02 expert: success %", rf"^02_collect: expert on .*success {N}%"),
    ("01 per epoch: val loss, val replies %, val episodes % reproduced",
     rf"^epoch \d+: train loss \S+  val loss {N}  greedy reproduces {N}% of val replies, {N}% of val episodes"),
    ("02 BC greedy success % (policy_0, each world and split)",
     rf"^02_collect: policy_0 on \S+/(?:dev|seen|unseen) .*success {N}%(?!.*reranked)"),
    ("02 QLASS: Q-reranked success % (each world and split)", rf"^02_collect: .*success {N}%.*Q-reranked"),
    ("02 sampled on train (BC, Q-Evolve): success %",
     rf"^02_collect: policy_\d on \S+/train .*success {N}%.*[0-9]/iter_"),
    ("02 sampled on train (BC, Q-Evolve): invalid / repeat / format, % of steps",
     rf"^02_collect: policy_\d on \S+/train .*labels ok {N} invalid {N} repeat {N} format {N}.*[0-9]/iter_"),
    ("02 sampled on train (ETO): invalid / repeat / format, % of steps",
     rf"^02_collect: policy_\d on \S+/train .*labels ok {N} invalid {N} repeat {N} format {N}.*/eto/iter_"),
    ("03 epoch 1: L_V, L_Q", rf"^epoch 1: L_V {N}  L_Q {N}"),
    ("03 last epoch: L_V, L_Q", rf"^03_critic: L_V {N}  L_Q {N} in the last"),
    ("04 mean A_t by source: expert, self", rf"^04_gae: mean A_t by source: expert {N}  self {N}"),
    ("04 in-sample explained variance", rf"^04_gae: in-sample, explained variance of the return {N}"),
    ("04 AUC of V at s_0", rf"^04_gae: AUC of V\(s_t\) for a self episode's success: s_0 {N}"),
    ("04 A_t at choices: harmful, recoverable, correct",
     rf"^04_gae: A_t at the self .*harmful {N} .*recoverable {N} .*correct {N}"),
    ("04 held out: explained variance, Bayes's, share; mean V, return; AUC",
     rf"^04_gae: held out \(.*explained variance {N}, the exact Bayes critic's {N} \({N} of it\); "
     rf"mean V {N} against a return of {N}; AUC {N}"),
    ("04 held out: V gap after a harmful step, Bayes's, share",
     rf"^04_gae: held out, V after .*: {N}, Bayes {N} \({N} of it\)"),
    ("04 held out: correlation with V*, spread, spread before the first step",
     rf"^04_gae: held out, V against .*correlation {N}, spread {N} \(std V / std V\*; before the first step {N}\)"),
    ("05 A_t as read: mean, % above 0", rf"^05_bppo: A_t as read: mean {N}, {N}% of steps above 0"),
    ("05 per epoch: clip low, clip high, KL(old), KL(ref), mean ratio",
     rf"^epoch \d+: loss \S+  clip low {N} high {N}  approx KL\(old\) {N}  KL\(ref\) {N}  mean ratio {N}"),
    ("eto: pairs", rf"^eto: {N} pairs"),
    ("eto per epoch: DPO loss, % ranked right", rf"^epoch \d+: DPO loss {N}  pairs ranked right {N}%"),
    ("qlass: trees' environment steps", rf"^qlass: .* {N} environment steps sampled"),
    ("qlass: QNet MSE, last epoch", rf"^qlass: wrote the QNet .*\(MSE {N};"),
]


def ranges(paths):
    """-> {row name: [[values of group 1], [values of group 2], ...]} over every matching line of every log. The
    lines under a command that writes into RUN/rft/ or RUN/outcome/ are the project's own baselines' (their 01 and 05
    print BC's and BPPO's lines): the guide is not about them, so they are skipped."""
    found = {name: None for name, _ in ROWS}
    for path in paths:
        text = open(path, errors="replace").read().replace("\r", "\n")  # tqdm's bars end in \r
        baseline = False
        for line in text.splitlines():
            if line.startswith("== "):  # run_all.sh's echo of the next command
                baseline = re.search(r" --out \S*/(rft|outcome)/", line) is not None
            if baseline:
                continue
            for name, pattern in ROWS:
                m = re.match(pattern, line)
                if m:
                    values = [float(v) for v in m.groups()]
                    if name.endswith("% of steps"):  # label counts (ok first) -> each label's share of the steps
                        values = [100 * v / sum(values) for v in values[1:]]
                    found[name] = found[name] or [[] for _ in values]
                    for col, v in zip(found[name], values):
                        col.append(v)
    return found


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("logs", nargs="+", help="saved stdout of bash run_all.sh, one file a run")
    args = p.parse_args(argv)
    for path in args.logs:
        if not os.path.isfile(path):
            die(f"no such log {path!r}")
        if not any(ranges([path]).values()):
            die(f"{path}: not a log of bash run_all.sh (none of its printouts' lines is in it)")
    print(f"Each number's range over {len(args.logs)} logs (every iteration, epoch, world and split in them):\n")
    print("| printout | range |\n|---|---|")
    for name, cols in ranges(args.logs).items():
        fmt = lambda v: f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"  # noqa: E731
        cell = "not printed" if cols is None else " / ".join(f"{fmt(min(c))} to {fmt(max(c))}" for c in cols)
        print(f"| {name} | {cell} |")


if __name__ == "__main__":
    main()
