"""run_all.sh's and bench/'s support, the shell scripts' way through the project's rules: python run_support.py COMMAND.

run_all.sh's start (start_run): every setting checked before anything runs (check_run, check_settings: each *_ARGS by
its stage's own parse_args, in a child process, so that this module imports no stage), one run at a time in a folder
(lock), the run's settings recorded (RUN/settings.json, read_settings). Then its results table (results_table), the
torchrun of NPROC > 1 (torchrun), and for bench/ a live run log (open_log) and the write rule from a shell (save,
check). A stage never imports this module.
"""
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys

from filelock import FileLock, Timeout

from plumbing import (ARTIFACTS, LIMITS, STAMP, STAMPED, check_out, check_path, die, owned, parse_env_kwargs, read_json,
                      save_text)


def open_log(path, writer, note=""):
    """A live log (bench/: a run's output while it runs, not atomic): the output rule first (new, or a log this
    project stamped), then opened for writing, the stamp its first line; a folder that cannot be made is one line."""
    check_out(path, "run_log")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        f = open(path, "w", encoding="utf-8")
    except OSError as e:
        die(f"cannot write {path} ({e.strerror})")
    print(f"# {STAMP}{writer}{note}", file=f, flush=True)
    return f


def results_table(run, k, worlds, algos, splits):
    """run_all.sh's RUN/results.md: one row per policy (BC, then each algorithm of ALGOS per iteration; QLASS once);
    each split's mean over the worlds, then each world's success; and each policy's online environment steps to date
    (its own episodes, QLASS's trees), the demonstrations' apart."""
    out = os.path.join(run, "results.md")
    check_out(out, "results")  # first: a user's results.md is refused before anything is read
    def load(p):
        obj = read_json(os.path.join(run, p))
        return obj if obj is not None else die(f"{os.path.join(run, p)}: missing or not a summary of 02_collect.py")
    mean = lambda xs: sum(xs) / len(xs)
    names = {"qevolve": "Q-Evolve", "rft": "iterated RFT", "outcome": "outcome-level PG", "eto": "ETO",
             "qlass": "QLASS"}
    own = lambda algo, j: load(f"iter_{j}/self.json" if j == 1 or algo == "qevolve" else f"{algo}/iter_{j}/self.json")
    rows = ["| policy | " + " | ".join(f"{s} success | {s} avg reward | {s} success in world {' / '.join(worlds)}"
                                        for s in splits) + " | online env steps |",
            "|---|" + "---|---|---|" * len(splits) + "---|"]
    policies = [("qevolve", 0)] + [(a, i) for a in algos for i in (range(1, 2) if a == "qlass" else range(1, k + 1))]
    for algo, i in policies:
        tag = "" if algo == "qevolve" else f"{algo}_"  # a baseline's iterations 2.. are in RUN/<algo>/
        steps = load("qlass/trees.json")["env_steps"] if algo == "qlass" else \
            sum(own(algo, j)["env_steps"] for j in range(1, i + 1))
        cells = []
        for s in splits:
            e = [load(f"eval/world{w}/{tag}policy_{i}_{s}.json") for w in worlds]
            per_world = " / ".join(f"{x['success_rate']:.0%}" for x in e)
            cells.append(f"{mean([x['success_rate'] for x in e]):.1%} | {mean([x['avg_reward'] for x in e]):.3f} | "
                         f"{per_world}")
        m = e[0]["candidates"]  # QLASS's replies sampled a step (1 for a greedy evaluation)
        name = "policy_0 (BC)" if i == 0 else f"{tag}policy_{i} ({names[algo]} iter {i})" if algo != "qlass" else \
            f"qlass_policy_1 (QLASS: BC and its QNet, {m} candidates a step)"
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {steps} |")
    demos = load("data/expert.json")
    kept = demos.get("kept", demos["episodes"])
    table = "\n".join(rows) + "\n" + f"\nDemonstrations: {kept} of the demonstrator's {demos['episodes']} train " \
        f"episodes ({'its successes' if 'kept' in demos else 'all'}), {demos['env_steps']} env steps (not online).\n"
    if "dev" in splits:  # the one-line check: did an iteration lose ground? (dev, where settings are tuned)
        dev = lambda tag, i: mean([load(f"eval/world{w}/{tag}policy_{i}_dev.json")["success_rate"] for w in worlds])
        for algo in algos:
            tag = "" if algo == "qevolve" else f"{algo}_"
            n = 1 if algo == "qlass" else k
            rate = [dev("", 0)] + [dev(tag, i) for i in range(1, n + 1)]  # BC, then the algorithm's iterations
            steps = [f"iter {i} {rate[i]:.1%} ({100 * (rate[i] - rate[i - 1]):+.1f}"
                     f"{': lost ground' if rate[i] < rate[i - 1] else ''})" for i in range(1, n + 1)]
            table += f"\n{names[algo]} on dev, each iteration against its predecessor (BC {rate[0]:.1%}): " \
                     f"{', '.join(steps)}\n"
    save_text(out, f"<!-- {STAMP}run_all.sh -->\n# Results: {run}\n\nSuccess and average reward: the mean over "
                   f"worlds {', '.join(worlds)}.\n\n{table}")
    print(f"(mean over worlds {', '.join(worlds)})\n{table}")


def torchrun(argv):
    """torch.distributed.run, but a stage's bad input (every rank exits 2; rank 0 printed the line) ends it with
    exit 2 and not the launcher's wall of traceback and failure tables; any other failure as torchrun reports it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(argv))
    except SignalException:  # run_all.sh's Ctrl-C stops it (SIGTERM): torchrun stopped its processes
        sys.exit(130)
    except ValueError as e:  # torchrun's own settings (--nproc_per_node abc)
        die(f"torchrun: {e}")
    except ChildFailedError as e:  # the others stopped by torchrun (SIGTERM) after a rank's error line
        if 2 in {f.exitcode for f in e.failures.values()} <= {2, -signal.SIGTERM}:
            sys.exit(2)
        print(e.format_msg(), file=sys.stderr)
        sys.exit(1)


# ---- run_all.sh's start: every setting checked, one run at a time in a folder, the run's settings recorded
LOCKS = []  # the folder locks this process holds, until it becomes its command (become)


def lock(folders):
    """One run at a time in a folder: FOLDER/.lock taken with filelock, at once or refused, its open file made
    inheritable, so that the command this process becomes (become) and every process that command starts hold it.
    The OS releases the lock when the last of them ends, however it ends (kill -9 too). A folder named in
    QEVOLVE_LOCKED is held already, by the caller (bench/gpu_lab.sh: its run_all.sh of one folder go side by side)."""
    held = [f for f in os.environ.get("QEVOLVE_LOCKED", "").split("\n") if f]
    for folder in folders:
        if os.path.realpath(folder) in held:
            continue
        held_lock = FileLock(os.path.join(folder, ".lock"), on_acquired=lambda fd: os.set_inheritable(fd, True))
        try:
            held_lock.acquire(timeout=0)
        except Timeout:
            die(f"{folder} is in use: a run holds its lock ({folder}/.lock) until it ends; wait for it to end, or "
                "pick another folder")
        except OSError as e:
            die(f"cannot lock {folder} ({e.strerror})")
        LOCKS.append(held_lock)
        held.append(os.path.realpath(folder))
    os.environ["QEVOLVE_LOCKED"] = "\n".join(held)


def become(command, **env):
    """Replace this process by command (exec), env added to its environment; the locks taken stay held."""
    os.environ.update(env)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        die(f"cannot run {' '.join(command)} ({e.strerror})")


EVAL_ONLY = ("EVAL_SPLITS", "EVAL_WORLDS", "N_EVAL")  # settings that only add evaluations: not in a run's record
COMMON = ["--seed", "--threads", "--precision", "--metrics"]  # run_all.sh's COMMON, given to every stage but 00
# each *_ARGS -> the stage that takes its flags, and the flags run_all.sh sets itself in that stage's calls: refused in
# *_ARGS (which come after them and would override them)
STAGE_FLAGS = {"PRETRAIN_ARGS": ("00_pretrain", ["--out", "--env", "--env-kwargs", "--threads"]),
               "BC_ARGS": ("01_bc", ["--data", "--out", "--model", *COMMON]),
               "RFT_ARGS": ("01_bc", ["--data", "--filter", "--model", "--out", *COMMON]),
               "COLLECT_ARGS": ("02_collect", ["--policy", "--out", "--env", "--env-kwargs", "--env-seed", "--split",
                                               "--episodes", *COMMON]),
               "CRITIC_ARGS": ("03_critic", ["--data", "--policy", "--out", *COMMON]),
               "GAE_ARGS": ("04_gae", ["--data", "--critic", "--out", *COMMON]),
               "BPPO_ARGS": ("05_bppo", ["--data", "--policy", "--ref", "--out", *COMMON]),
               "ETO_ARGS": ("eto", ["--data", "--policy", "--ref", "--out", *COMMON]),
               "QLASS_ARGS": ("qlass", ["--policy", "--data", "--trees", "--out", "--env", "--env-kwargs", *COMMON])}
STAGE_FLAGS["OUTCOME_ARGS"] = STAGE_FLAGS["LATER_ARGS"] = STAGE_FLAGS["BPPO_ARGS"]  # each after BPPO_ARGS
# two values of each of those flags (others: 1 and 2): *_ARGS set one when the stage reads the same after either
VALUES = {"--precision": ("fp32", "bf16"), "--env": ("household", "kitchen"), "--split": ("train", "dev"),
          "--filter": ("success", "all")}


# The child that runs each stage's own check of its flags: (stage, argv) -> parse_args(argv) as a dict, or the line it
# refused argv with (argparse's usage or the stage's error line); its own process, so that this module imports no stage.
PARSE = """import contextlib, importlib, io, json, sys
def parse(stage, argv):
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            return vars(importlib.import_module(stage).parse_args(argv))
    except SystemExit:  # a stage's check or argparse's (Parser): 'error: WHY'; --help: nothing on stderr
        return (said.getvalue().strip().splitlines() or ["--help prints the stage's help"])[-1].split("error: ")[-1]
sys.path.insert(0, sys.argv[1])
print(json.dumps([parse(*job) for job in json.loads(sys.argv[2])]))"""


def stage_args(jobs):
    """[(stage, argv)] -> each the stage's parse_args(argv) (which checks the flags too where the stage does) as a
    dict, or the line the stage refused it with; all in one child process (PARSE)."""
    if not jobs:
        return []
    proc = subprocess.run([sys.executable, "-c", PARSE, CHECKOUT, json.dumps(jobs)], capture_output=True, text=True)
    if proc.returncode:
        die(f"cannot check the stages' flags: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(proc.stdout.splitlines()[-1])


def check_settings(s):
    """run_all.sh's settings that bash cannot check, before anything runs: ENV and ENV_KWARGS (the environment is
    made), N_EXPERT and N_SELF against the tasks of its train split, EVAL_SPLITS (its splits) and N_EVAL against
    their tasks, a BASE that names a directory (a model's), and each *_ARGS that gives a stage flags by that stage
    (stage_args), without a glob, a flag run_all.sh sets itself (STAGE_FLAGS) or a critic a flag names (--init,
    --rerank) that is not one."""
    import envs
    try:
        env = envs.make(s["ENV"], **parse_env_kwargs(s["ENV_KWARGS"]))
        for name, splits in (("N_EXPERT", ["train"]), ("N_SELF", ["train"]), ("N_EVAL", s["EVAL_SPLITS"].split())):
            for split in splits:
                most = min(len(env.task_ids(split)), LIMITS["episodes"])
                if int(s[name]) > most:
                    die(f"{name}={s[name]}: {s['ENV']}'s split {split!r} has {most} tasks")
        env.close()
    except (ValueError, ImportError) as e:  # an unknown env or split, a keyword it does not take, a package
        die(e)
    base = s.get("BASE", "pretrained")  # a model directory: checked here, not by 01 after the expert demos
    if base not in ("pretrained", "tiny", "smollm2") and not all(
            os.path.isfile(os.path.join(base, f)) for f in ("config.json", "tokenizer_config.json")):
        die(f"BASE={base} is not a model directory (a Hugging Face model's, with its config.json and "
            "tokenizer_config.json); name one, or BASE=pretrained, tiny or smollm2")
    jobs = {}  # each *_ARGS that gives flags -> its stage's argv twice, run_all.sh's flags set two ways (VALUES)
    for name, (stage, sets) in STAGE_FLAGS.items():
        flags = s[name].split()  # as bash splits an unquoted $NAME
        if name in ("OUTCOME_ARGS", "LATER_ARGS"):
            flags = s["BPPO_ARGS"].split() + flags
        values = lambda f: ("tiny", "2") if f == "--model" and s["BASE"] == "tiny" and name == "BC_ARGS" else \
            VALUES.get(f, ("1", "2"))
        if flags:
            jobs[name] = [(stage, [a for f in sets for a in (f, values(f)[i])] + flags) for i in (0, 1)]
    parsed = iter(stage_args([job for pair in jobs.values() for job in pair]))
    for name, (stage, sets) in STAGE_FLAGS.items():
        said = f"{name}={shlex.quote(s[name])}"
        if re.search(r"[*?[]", s[name]):
            die(f"{said}: no glob characters (* ? [): bash would expand them to file names")
        if name not in jobs:
            continue
        args = [next(parsed), next(parsed)]
        why = next((a for a in args if isinstance(a, str)), None)
        if why is not None:
            die(f"{said}: {stage}.py refuses it: {why}")
        for f in sets:
            if args[0][f[2:].replace("-", "_")] == args[1][f[2:].replace("-", "_")]:
                die(f"{said}: run_all.sh sets {f} itself (bash run_all.sh --help names the setting for it)")
        for f in ("init", "rerank"):
            if args[0].get(f) and not owned(args[0][f], "critic"):
                die(f"{said}: --{f} {args[0][f]} is not {ARTIFACTS['critic'][0]}")


CHECKOUT = os.path.dirname(os.path.realpath(__file__))
SHIPPED = (".ci", ".git", "bench", "course", "docs", "envs", "models", "tests")  # the checkout's own folders


def check_run(run):
    """run_all.sh's RUN, by the write rule (check_path): a new folder, an empty one (but for the .lock of a killed start
    and bench/speed/stage_times.py's launches.log) or one a run made (its settings.json: read_settings); never the
    checkout or one of its own folders, a file, or a path with a {...} field (02 fills those in)."""
    if re.search(r"[{}]", run):
        die(f"RUN={run}: a run's folder has no {{...}} field; name a plain folder")
    check_path(run)
    rel = os.path.relpath(os.path.realpath(run), CHECKOUT).split(os.sep)
    if rel == ["."] or rel[0] in SHIPPED:
        die(f"RUN={run} is the checkout or lies in one of its folders ({', '.join(SHIPPED)}); pick a new folder, "
            "e.g. runs/NAME")
    if os.path.lexists(run) and not os.path.isdir(run):
        die(f"RUN={run} is not a folder; pick a new folder")
    try:
        names = set(os.listdir(run)) - {".lock", "launches.log"} if os.path.isdir(run) else set()
    except OSError as e:
        die(f"cannot read RUN={run} ({e.strerror})")
    if names and "settings.json" not in names:
        die(f"RUN={run} holds files that no run of run_all.sh made (it has no settings.json); a run writes into a new "
            "folder or its own: pick another RUN")


def read_settings(run, keys=()):
    """RUN/settings.json, read strictly: run_all.sh's record, its every value a string, each of keys there; else one
    line that says what to do."""
    path = os.path.join(run, "settings.json")
    record = read_json(path) if owned(path, "settings") else None
    if record is None:
        die(f"{path} exists and is not {ARTIFACTS['settings'][0]}; refusing to replace it (pick another RUN)")
    for k in [*keys, *record]:
        if not isinstance(record.get(k), str):
            die(f"{path}: {k} is {'not a string' if k in record else 'missing'}; run_all.sh records every setting as a "
                f"string: write the value the run was made with (\"{k}\": \"...\"), or pick another RUN")
    return record


def start_run(run, settings, command):
    """run_all.sh's first step, `python run_support.py start RUN NAME=VALUE... [-- COMMAND...]`: RUN checked
    (check_run), its settings checked (check_settings), and those that shape what the run writes (all but EVAL_ONLY)
    compared with RUN/settings.json, which its first start recorded: a resume with others would mix two runs. With
    COMMAND (run_all.sh again): RUN locked first (lock), the record written when new, then this process becomes COMMAND,
    holding the lock. Without (run_all.sh --check) nothing is written. A RUN held by the caller (bench/gpu_lab.sh) had
    its settings checked by the caller (run_all.sh --check), which starts many runs of it."""
    check_run(run)
    if os.path.realpath(run) not in os.environ.get("QEVOLVE_LOCKED", "").split("\n"):
        check_settings(settings)
    path, record = os.path.join(run, "settings.json"), {k: v for k, v in settings.items() if k not in EVAL_ONLY}

    def same_record():  # RUN's record against this run's settings: before the lock (nothing written on a refusal)
        if not os.path.lexists(path):  # and again under it (a run that started meanwhile may have written it)
            return False
        old = read_settings(run, record)
        extra = [k for k in old if k not in record and k not in ("stage", *EVAL_ONLY)]
        if extra:
            die(f"{path}: {extra[0]} is not a setting run_all.sh records; remove it from the file (or pick another "
                "RUN)")
        differ = [k for k in record if old[k] != record[k]]
        if differ:
            said = lambda r: " ".join(f"{k}={shlex.quote(r[k])}" for k in differ)
            die(f"{run} was made with {said(old)}; this run has {said(record)}: resume it with the settings it was "
                f"made with, or pick another RUN (or, if nothing in it was made with them, remove {path})")
        return True
    same_record()
    if command:
        lock([run])
    if not same_record() and command:
        check_out(path, "settings")
        save_text(path, json.dumps({"stage": "run_all.sh", **record}, indent=2) + "\n")
    if command:
        become(command, QEVOLVE_STARTED=run)


def main(argv):
    """results RUN K WORLDS ALGOS SPLIT...: run_all.sh's table. save KIND PATH WRITER: stdin into PATH after check_out,
    atomically, its first line stamped. check KIND PATH...: check_out each. start RUN NAME=VALUE... [-- COMMAND...]:
    run_all.sh's start (start_run). lock FOLDER... -- COMMAND...: COMMAND run holding each folder's lock (lock,
    become). torchrun ARGS...: above."""
    command, *rest = argv or ["help"]
    cut = rest.index("--") if "--" in rest else len(rest)  # start / lock: what comes before COMMAND
    if command == "results" and len(rest) >= 5 and rest[1].isdigit():
        results_table(rest[0], int(rest[1]), rest[2].split(), rest[3].split(), rest[4:])
    elif command == "save" and len(rest) == 3 and rest[0] == "run_log":
        check_out(rest[1], rest[0])
        save_text(rest[1], f"{STAMPED[rest[0]]}{STAMP}{rest[2]}\n" + sys.stdin.read())
    elif command == "check" and rest and rest[0] in ARTIFACTS:
        for path in rest[1:]:
            check_out(path, rest[0])
    elif command == "start" and rest and all("=" in a for a in rest[1:cut]):
        start_run(rest[0], dict(a.split("=", 1) for a in rest[1:cut]), rest[cut + 1:])
    elif command == "lock" and rest[cut + 1:]:
        lock(rest[:cut])
        become(rest[cut + 1:])
    elif command == "torchrun":
        torchrun(rest)
    else:
        die(f"python run_support.py {' '.join(argv)}: not a command of {main.__doc__}")


if __name__ == "__main__":
    main(sys.argv[1:])
