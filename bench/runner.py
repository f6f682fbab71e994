"""What every script of bench/ and bench/speed/ shares, so that each does a thing one way: the methods (METHODS), a
stage file as a module, the flags, run_all.sh launched and checked, a run's evaluations, a measured child, expert demos,
mean +- std, and a table's first line, its checks and its writing (a script first puts the repo root on sys.path)."""
import argparse
import contextlib
import ctypes
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the stages import envs
from envs._common import cache_root  # noqa: E402
from plumbing import STAMP, Parser, check_out, die, first_line, save_text, write_atomic  # noqa: E402
from run_support import tracked  # noqa: E402

# The methods, once: key (run_all.sh's ALGOS word; bc: policy_0), the prefix of its policies' evaluations
# (eval/world<w>/<prefix>policy_<k>_<split>.json) and folder in a run, its name in every table, its colour in a plot
METHODS = [("bc", "", "", "BC", "tab:gray"), ("qevolve", "", "", "Q-Evolve", "tab:blue"),
           ("outcome", "outcome_", "outcome", "outcome-level PG", "tab:orange"),
           ("rft", "rft_", "rft", "iterated RFT", "tab:green")]
ALGOS = METHODS[1:]  # what evolves policy_0
NAME = {m[0]: m[3] for m in METHODS}
# run_all.sh's miniatures (household: the habit world; shop: its default), for a script that collects outside it
KWARGS = {"household": '{"step_slack": [0, 1, 2], "n_distractors": 1, "habit": 0.8, "room_questions": 0.4}',
          "shop": '{"page_size": 3, "max_steps": 10, "hasty": 0.5}'}
sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)


def load_stage(name):
    """The module of ROOT/<name>.py, e.g. load_stage("01_bc"); loading it runs no main()."""
    spec = importlib.util.spec_from_file_location(f"stage_{name}", os.path.join(ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parser(doc):
    """plumbing's Parser whose --help is the script's docstring as written."""
    return Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def runs_parser(doc, table):
    """seeds.py's and ablation.py's flags: the runs (--seeds, --prefix), how (--parallel, --table-only) and the table
    (--out, runs/<ENV>_<table>.md: a reference table in bench/results/ is written only when named); -> the parser,
    for a script's own flags."""
    p = parser(doc)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (run directories --prefix<seed>)")
    p.add_argument("--prefix", default="runs/seed", help="run directory prefix (seed number appended)")
    p.add_argument("--out", default=f"runs/{os.environ.get('ENV', 'kitchen')}_{table}.md",
                   help="markdown table to write (named by the world: run_all.sh's ENV)")
    p.add_argument("--parallel", action="store_true", help="run the seeds at once, one torch thread each")
    p.add_argument("--table-only", action="store_true",
                   help="run nothing: write the table from the runs as they are (what is not done: 'not run')")
    return p


def distinct(flag, xs, least=0):
    """A list flag of distinct integers of at least `least` (two runs of one seed share a folder), else one error."""
    if min(xs) < least or len(set(xs)) < len(xs):
        die(f"{flag} must be distinct integers of at least {least}, got {' '.join(map(str, xs))}")


def table_out(out, writer, markdown=True):
    """--out of a table (relative to the repo): new or a table of bench/ (check_out), its name ending in .md (markdown),
    and one the checkout ships only if writer (this script) made it (shipped_by) - else one error line; -> its path."""
    if markdown and not out.endswith(".md"):
        die(f"--out {out}: the table is markdown, its name must end in .md")
    check_out(os.path.join(ROOT, out), "table")
    if not shipped_by(os.path.join(ROOT, out), writer):
        die(f"--out {out} is a table the checkout ships that {writer} did not make; pick another")
    return os.path.join(ROOT, out)


def shipped_by(path, writer):
    """Whether a bench script may replace path: not a file the checkout ships (tracked), or its first line names the
    script (`python WRITER ...`, measured): never another script's table (bench/seeds.py's onto stage_times.md)."""
    return not tracked(path) or f"python {writer} " in first_line(path)


def write_table(out, lines, said=None):
    """The lines into out (save_text, relative to the repo), then printed: the table itself, or `said`."""
    text = "\n".join(lines) + "\n"
    save_text(os.path.join(ROOT, out), text)
    print(text if said is None else said)


def pm(xs, spec=".1f"):
    """mean +- std (n - 1; one value: 0) of xs, as the tables of seeds.py, ablation.py and plots.py print it."""
    return f"{statistics.mean(xs):{spec}} +- {sd(xs):{spec}}"


def row(*cells):
    """One markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def spread(xs, fmt):
    """mean +- std (n - 1) of xs, or the one value."""
    return fmt.format(statistics.mean(xs)) + (f" ± {fmt.format(statistics.stdev(xs))}" if len(xs) > 1 else "")


def command(script, env_keys=()):
    """This call as a table quotes it: the settings of env_keys that are set, python SCRIPT and its arguments."""
    settings = [f"{k}={shlex.quote(os.environ[k])}" for k in env_keys if os.environ.get(k)]
    return " ".join(settings + ["python", script] + [shlex.quote(a) for a in sys.argv[1:]])


def measured(by, machine=True):
    """A table's first line: when, on what and by which command (plumbing.owned reads the command's script)."""
    where = f" on {platform.machine()} with {os.cpu_count()} CPU cores" if machine else ""
    return f"Measured {datetime.date.today()}{where} by `{by}`"


def check_runs(prefix, seeds, made):
    """A bench script's run folders, --prefix<seed>: the prefix names a folder; made: each is a run of run_all.sh (its
    data/expert.jsonl and eval/) - else one error line."""
    if not prefix.strip():
        die("--prefix is empty: name the runs' folders without their seed (runs/seed: runs/seed0, runs/seed1, ...)")
    for seed in seeds if made else []:
        run = os.path.join(ROOT, f"{prefix}{seed}")
        if not (os.path.isfile(os.path.join(run, "data", "expert.jsonl")) and os.path.isdir(os.path.join(run, "eval"))):
            die(f"{prefix}{seed}: no run of run_all.sh there (its data/expert.jsonl and eval/); check --prefix and "
                "--seeds, or run it first")


def eval_worlds(run):
    """The world seeds run_all.sh evaluated RUN in (its EVAL_WORLDS: eval/world<w>/), as strings, in order."""
    return sorted((d[5:] for d in os.listdir(os.path.join(ROOT, run, "eval")) if re.fullmatch(r"world(0|[1-9]\d*)", d)),
                  key=int)


def evaluations(run):
    """{(policy, world, split): 02's summary} of every evaluation RUN finished (world: its seed, a string)."""
    found, root = {}, os.path.join(ROOT, run, "eval")
    for world in eval_worlds(run) if os.path.isdir(root) else []:
        for f in os.listdir(os.path.join(root, f"world{world}")):
            m = re.fullmatch(r"(\w*?policy_\d+)_(\w+)\.json", f)
            if m:
                found[m[1], world, m[2]] = json.load(open(os.path.join(root, f"world{world}", f)))
    return found


def curve(run, split, tag=""):
    """Success in % of policy_0 (BC), <tag>policy_1, ... on `split`, each the mean over the run's worlds; and the
    number of worlds."""
    worlds, found = eval_worlds(run), evaluations(run)
    out, k = [], 0
    while all((f"{tag if k else ''}policy_{k}", w, split) in found for w in worlds):
        out.append(statistics.mean(found[f"{tag if k else ''}policy_{k}", w, split]["success_rate"] for w in worlds)
                   * 100)
        k += 1
    return out, len(worlds)


def check(run, settings=None, who=""):
    """bash run_all.sh --check with RUN and these settings (over the environment's): else its one error line."""
    proc = subprocess.run(["bash", "run_all.sh", "--check"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(settings or {}), "RUN": run})
    if proc.returncode:
        die(who + proc.stderr.strip().removeprefix("error: "))


def with_parent():
    """A child's preexec_fn: on Linux it is killed when this script dies, kill -9 too (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def launch(run, settings=None, log=None):
    """bash run_all.sh with RUN and these settings (over the environment's), its output into the open file `log` (None:
    this process's); -> the running Popen."""
    return subprocess.Popen(["bash", "run_all.sh"], cwd=ROOT, env={**os.environ, **(settings or {}), "RUN": run},
                            stdout=log, stderr=subprocess.STDOUT if log else None, preexec_fn=with_parent)


def running(proc):
    """Whether a child of this process runs yet, without reaping it (wait: its account)."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def wait(proc, t0=None):
    """Wait for a child of this process -> (exit code, wall s since t0, CPU s, peak resident MiB of it and the
    children it waited for) from the kernel's account of that child alone (wait4)."""
    _, status, use = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.time() - (t0 or 0), use.ru_utime + use.ru_stime, use.ru_maxrss / 1024


@contextlib.contextmanager
def scratch(prefix):
    """A temporary folder that goes however this script ends: a SIGTERM (a timeout's, a kill's) raises SystemExit,
    which stops a running child (must) and removes the folder, as Ctrl-C or an error does."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def must(argv, result=False, cwd=ROOT, env=None, threads=None):
    """Run argv to its end, measured (wait) -> {rc, wall_s, cpu_s, peak_mib, out (its stdout and stderr), result (the
    JSON of its last 'RESULT {...}' line, or None)}; threads: its OMP_NUM_THREADS. A failed child (result: one without
    a RESULT line) ends this script with its last output."""
    env = {**os.environ, **(env or {}), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.time()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=with_parent)
        try:
            rc, wall, cpu, peak = wait(proc, t0)
        except BaseException:  # Ctrl-C, or a SIGTERM (scratch): the child stops with this script
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        text = out.read()
    results = [line[7:] for line in text.splitlines() if line.startswith("RESULT ")]
    said = [line for line in text.splitlines() if line.startswith("error: ")]
    if rc == 2 and said:  # the child refused its input (one error line, exit 2): its line, as this script's
        die(said[-1][len("error: "):])
    if rc or (result and not results):
        sys.exit(f"{' '.join(map(str, argv[:3]))} failed:\n{text[-4000:]}")
    return {"rc": rc, "wall_s": wall, "cpu_s": cpu, "peak_mib": peak, "out": text,
            "result": json.loads(results[-1]) if results else None}


def expert_demos(out, n, env=None, seed=None):
    """02's expert on n train tasks -> out (a JSONL; its summary beside it); env: an environment whose kwargs are
    run_all.sh's miniature (KWARGS), None: 02's default."""
    envargs = ["--env", env, "--env-kwargs", KWARGS.get(env, "{}")] if env else []
    must([sys.executable, "02_collect.py", "--policy", "expert", *envargs, "--split", "train", "--episodes", str(n),
          *(["--seed", str(seed)] if seed is not None else []), "--out", out])
    return out


def pyplot():
    """matplotlib's pyplot without a display, or one error line that says what to install. Its config and font cache
    go into the project's cache (envs/_common.py), not the home's ~/.config and ~/.cache; MPLCONFIGDIR set wins."""
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(cache_root(), "matplotlib"))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        die("matplotlib is not installed: pip install -r requirements-plot.txt")
    return plt


def save_png(fig, out, writer):
    """The figure into out, atomically, stamped with its writer (a rerun may replace it, never a user's picture)."""
    write_atomic(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png", metadata={"Software": STAMP + writer}))
    import matplotlib.pyplot as plt
    plt.close(fig)


# model FLOPs per token and parameter N (outside the input embedding) of a training step: forward 2 N, backward 4 N;
# 05 adds pi_ref's forward (log pi_old is computed before its loop). Attention's quadratic term is left out.
FLOPS_PER_N = {"01_bc": 6, "03_critic": 6, "05_bppo": 8}


def last_epochs(records, stage):
    """The last record (epoch) of each launch of a training stage in a run's metrics, in order (epochs count from 1)."""
    rows = [r for r in records if r["stage"] == stage and "epoch" in r]
    return [r for i, r in enumerate(rows) if i + 1 == len(rows) or rows[i + 1]["epoch"] == 1]


def body_params(policy_dir):
    """N: the policy's parameters outside the input embedding table."""
    from safetensors.torch import load_file
    return sum(t.numel() for k, t in load_file(os.path.join(policy_dir, "model.safetensors")).items()
               if "embed_tokens" not in k)
