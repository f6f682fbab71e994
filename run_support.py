"""run_all.sh's and bench/'s support, the shell scripts' way through the project's rules: python run_support.py COMMAND.

run_all.sh's start (start_run): every setting checked before anything runs (check_run, check_settings: each *_ARGS by
its stage's own parse_args, in a child process, so that this module imports no stage), one run at a time in a folder
(lock), the run's settings recorded (RUN/settings.json, read_settings). Then its results table (results_table), the
torchrun of NPROC > 1 (torchrun), and for bench/ a live run log (open_log) and the write rule from a shell (save,
check). A stage never imports this module.
"""
import errno
import fcntl
import importlib.util
import itertools
import json
import logging
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile

try:  # a python without the project's packages (run_all.sh's PYTHON): one line, not a traceback
    from filelock import FileLock, Timeout

    from plumbing import (ARTIFACTS, CHECKOUT, LIMITS, SHIPPED, STAMP, STAMPED, check_out, check_path, die, inside,
                          owned, parse_env_kwargs, read_json, save_text, temporaries)
except ImportError as e:
    print(f"error: {sys.executable} lacks the project's requirements ({e}): pip install -r requirements.txt",
          file=sys.stderr)
    sys.exit(2)


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
        name = "policy_0 (BC)" if i == 0 else f"{tag}policy_{i} ({names[algo]} iter {i})" if algo != "qlass" else \
            f"qlass_policy_1 (QLASS: BC and its QNet, {e[0].get('candidates')} candidates a step)"
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {steps} |")
    demos = load("data/expert.json")
    n = demos.get("episodes", "?")
    table = "\n".join(rows) + "\n" + f"\nDemonstrations: {demos.get('kept', n)} of the demonstrator's {n} train " \
        f"episodes ({'its successes' if 'kept' in demos else 'all'}), {demos.get('env_steps', '?')} env steps (not " \
        "online).\n"
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
        args = get_args_parser().parse_args(argv)
        if not (args.module or args.no_python) and not os.path.isfile(args.training_script):  # not a line per rank
            die(f"torchrun: {args.training_script}: no such script")
        with tempfile.TemporaryDirectory(prefix="qevolve_torchrun.") as scratch:  # its log folders: gone after
            tempfile.tempdir = scratch  # (torchrun makes them with tempfile in this process and leaves them)
            run(args)
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
LOCK_STAMP = f"{STAMP}run_support.py lock\n"  # FOLDER/.lock once lock took it: a killed start's, not a stranger's


def stray_lock(folder):
    """Whether FOLDER/.lock exists and is not one lock wrote (LOCK_STAMP): another tool's; the folder is not empty."""
    try:
        with open(os.path.join(folder, ".lock"), encoding="utf-8") as f:
            return f.read(len(LOCK_STAMP) + 1) != LOCK_STAMP
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError):
        return True


def stamp_lock(fd):
    """filelock's on_acquired: the lock's file inherited by the command this process becomes, and stamped as ours."""
    os.set_inheritable(fd, True)
    if os.pread(fd, len(LOCK_STAMP) + 1, 0) != LOCK_STAMP.encode():  # a resume rewrites nothing
        os.pwrite(fd, LOCK_STAMP.encode(), 0)


def holds(folder):
    """Whether this process holds folder's lock: one of its open files (inherited from the process that took the lock)
    is FOLDER/.lock, the lock is taken (a new open file cannot take it) and that file holds it (it can take it again).
    QEVOLVE_LOCKED set from outside, with no such file or with the file merely open (3<RUN/.lock), holds nothing,
    even while another process holds the lock."""
    path = os.path.join(folder, ".lock")
    try:
        want = os.stat(path)
    except OSError:
        return False
    fds = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    for fd in os.listdir(fds):
        try:
            if os.path.samestat(os.fstat(int(fd)), want) and taken(path):
                fcntl.flock(int(fd), fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError unless this file is the holder
                return True
        except (OSError, ValueError):
            continue
    return False


def taken(path):
    """Whether a process holds the lock on PATH (filelock's flock): a new open file of it cannot take it."""
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def held_folders():
    """The folders of QEVOLVE_LOCKED (real paths) whose lock this process holds (holds)."""
    return [f for f in os.environ.get("QEVOLVE_LOCKED", "").split("\n") if f and holds(f)]


def lock(folders):
    """One run at a time in a folder: FOLDER/.lock taken with filelock, at once or refused, its open file made
    inheritable, so that the command this process becomes (become) and every process that command starts hold it.
    The OS releases the lock when the last of them ends, however it ends (kill -9 too). A folder named in
    QEVOLVE_LOCKED is held already, by the caller (bench/gpu_lab.sh: its run_all.sh of one folder go side by side)."""
    held = held_folders()
    for folder in folders:
        if os.path.realpath(folder) in held:
            continue
        held_lock = FileLock(os.path.join(folder, ".lock"), on_acquired=stamp_lock)
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


def build(entry, command):
    """run_all.sh's base model, `python run_support.py build ENTRY -- COMMAND...`: one build at a time in a base cache.
    Its lock (BASE_CACHE/.lock) waited for; an ENTRY another run built meanwhile is used as it is, else this process
    becomes COMMAND (00_pretrain.py) holding the lock until it ends."""
    held = FileLock(os.path.join(os.path.dirname(entry), ".lock"), on_acquired=stamp_lock)
    try:
        held.acquire(timeout=0)
    except Timeout:
        print(f"run_support.py: waiting for another run to build {entry}", file=sys.stderr, flush=True)
        held.acquire()
    if os.path.exists(entry):
        print(f"== skip (built meanwhile by another run): {entry}", flush=True)
        sys.exit(0)
    LOCKS.append(held)
    become(command)


def become(command, **env):
    """Replace this process by command (exec), env added to its environment; the locks taken stay held."""
    os.environ.update(env)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        die(f"cannot run {' '.join(command)} ({e.strerror})")


EVAL_ONLY = ("EVAL_SPLITS", "EVAL_WORLDS", "N_EVAL")  # settings that only add evaluations: not in a run's record
# settings checked before any work but not in a run's record: how it runs (THREADS, NPROC), where its base model is
# kept (BASE_CACHE, its entry BASE_DIR for these settings, SMOLLM2_DIR) and what evolves policy_0 (ALGOS: a resume may
# add an algorithm); run_all.sh passes them, a caller may not
CHECK_ONLY = ("THREADS", "NPROC", "BASE_CACHE", "BASE_DIR", "SMOLLM2_DIR", "ALGOS")
NEEDED = ("ENV", "ENV_KWARGS", "N_EXPERT", "N_SELF", "N_EVAL", "EVAL_SPLITS", "BASE")  # check_settings reads them
INTEGERS = ("SEED", "N_EXPERT", "N_SELF", "N_EVAL", "THREADS", "NPROC", "QLASS_M")  # as run_all.sh reads them
UNRECORDED = (*EVAL_ONLY, *CHECK_ONLY)
COMMON = ["--seed", "--threads", "--precision", "--metrics"]  # run_all.sh's COMMON, given to every stage but 00
# each *_ARGS -> the stage that takes its flags, and the flags run_all.sh sets itself in that stage's calls: refused in
# *_ARGS (which come after them and would override them)
STAGE_FLAGS = {"PRETRAIN_ARGS": ("00_pretrain", ["--out", "--env", "--env-kwargs", "--threads", "--metrics"]),
               "BC_ARGS": ("01_bc", ["--data", "--out", "--model", *COMMON]),
               "RFT_ARGS": ("01_bc", ["--data", "--filter", "--model", "--out", *COMMON]),
               "COLLECT_ARGS": ("02_collect", ["--policy", "--out", "--env", "--env-kwargs", "--env-seed", "--split",
                                               "--episodes", "--candidates", "--keep", *COMMON]),  # QLASS: --candidates
               "CRITIC_ARGS": ("03_critic", ["--data", "--policy", "--out", *COMMON]),
               "GAE_ARGS": ("04_gae", ["--data", "--critic", "--out", *COMMON]),
               "BPPO_ARGS": ("05_bppo", ["--data", "--policy", "--ref", "--out", *COMMON]),
               "ETO_ARGS": ("eto", ["--data", "--policy", "--ref", "--out", *COMMON]),
               "QLASS_ARGS": ("qlass", ["--policy", "--data", "--trees", "--out", "--env", "--env-kwargs", *COMMON])}
STAGE_FLAGS["OUTCOME_ARGS"] = STAGE_FLAGS["LATER_ARGS"] = STAGE_FLAGS["BPPO_ARGS"]  # each after BPPO_ARGS
# two values of each of those flags (others: 1 and 2): *_ARGS set one when the stage reads the same after either
VALUES = {"--precision": ("fp32", "bf16"), "--env": ("household", "kitchen"), "--split": ("train", "dev"),
          "--filter": ("success", "all"), "--keep": ("success", "all")}


# The child that runs each stage's own check of its flags: (stage, argv) -> parse_args(argv) as a dict, or the line it
# refused argv with (argparse's usage or the stage's error line); its own process, so that this module imports no stage.
# Three jobs that are not a stage's: ("@model", [DIR]) -> DIR's context (its config's max_position_embeddings) once its
# config, tokenizer (with a chat template) and weights load as the stages load them, or why not; ("@gpus", []) -> the
# GPUs seen; ("@tokens", [FLAGS, CHATS]) -> each chat's tokens under the tokenizer 00_pretrain.py will train with FLAGS.
PARSE = """import contextlib, importlib, io, json, os, sys
def model(path):
    from transformers import AutoConfig, AutoTokenizer
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if not AutoTokenizer.from_pretrained(path, local_files_only=True).chat_template:
        return "its tokenizer has no chat template"
    if os.path.exists(os.path.join(path, 'heads.safetensors')):  # as plumbing.load_tokenizer refuses it
        return "it is a critic directory (03_critic.py's, or qlass.py's QNet), not a policy"
    weights = [f for f in os.listdir(path) if f.endswith('.safetensors')]
    if not weights:
        return "it holds no weights (model.safetensors)"
    from transformers import AutoModelForCausalLM
    from plumbing import load_model
    with contextlib.redirect_stderr(io.StringIO()) as said:  # as the stages load it: a missing tensor, other shapes,
        try:                                                   # a NaN refused
            load_model(AutoModelForCausalLM, path)
        except SystemExit:
            return said.getvalue().strip().split(path + ": ", 1)[-1]
    return {'context': config.max_position_embeddings}
def tokens(flags, chats):  # 00's tokenizer before it is built: on its corpus, drawn as 00 draws it (--seed, first)
    import random, envs
    from models.tiny import train_tiny_tokenizer
    from plumbing import parse_env_kwargs
    from run_support import chat_tokens
    world = envs.make(flags['env'], seed=flags['env_seed'], **parse_env_kwargs(flags['env_kwargs']))
    corpus = importlib.import_module('00_pretrain').build_corpus(world, flags['episodes'], random.Random(flags['seed']),
                                                                 flags['p_random'], flags['qa'])
    tokenizer = train_tiny_tokenizer([corpus[0][0]['content']] + [m['content'] for c in corpus for m in c[1:]],
                                     flags['vocab_size'])
    return [chat_tokens(chat, tokenizer)[0] for chat in chats]
def parse(stage, argv):
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            if stage == '@gpus':
                import torch
                return torch.cuda.device_count()
            if stage == '@tokens':
                return tokens(*argv)
            if stage == '@model':
                try:
                    return model(argv[0])
                except Exception as e:
                    return f"cannot load it ({' '.join(str(e).split())[:200]})"
            return vars(importlib.import_module(stage).parse_args(argv))
    except SystemExit:  # a stage's check or argparse's (Parser): 'error: WHY'; --help: nothing on stderr
        return (said.getvalue().strip().splitlines() or ["--help prints the stage's help"])[-1].split("error: ")[-1]
sys.path.insert(0, sys.argv[1])
print(json.dumps([parse(*job) for job in json.load(sys.stdin)]))"""


def stage_args(jobs):
    """[(stage, argv)] -> each the stage's parse_args(argv) (which checks the flags too where the stage does) as a
    dict, or the line the stage refused it with; all in one child process (PARSE)."""
    if not jobs:
        return []
    proc = subprocess.run([sys.executable, "-c", PARSE, CHECKOUT], input=json.dumps(jobs), capture_output=True,
                          text=True)  # the jobs on stdin: @tokens' chats can exceed an argument list's limit
    if proc.returncode:
        die(f"cannot check the stages' flags: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(proc.stdout.splitlines()[-1])


def bash_words(name, value):
    """An unquoted $NAME as bash splits it (on spaces, tabs and newlines: IFS) -> its words; any other whitespace (a
    no-break space, a vertical tab) is refused, which Python's split() would split on and bash would not."""
    odd = next((c for c in value if c.isspace() and c not in " \t\n"), None)
    if odd is not None:
        die(f"{name}={shlex.quote(value)} holds the whitespace character {ascii(odd)}, which bash does not split on; "
            "use plain spaces")
    return value.split()


CACHE_TAG = "CACHEDIR.TAG"  # the base cache's stamp (https://bford.info/cachedir/), its second line this project's
CACHE_STAMP = ("Signature: 8a477f597d28d172789f06886806bc55\n"
               f"# {STAMP}run_all.sh: base models built by 00_pretrain.py (BASE_CACHE), one folder ENV-KEY each\n")


def stamped(tag):
    """Whether a CACHEDIR.TAG is this project's (CACHE_STAMP)."""
    try:
        with open(tag, encoding="utf-8") as f:
            return f.read(len(CACHE_STAMP) + 1) == CACHE_STAMP
    except (OSError, UnicodeDecodeError):
        return False


def base_entry(path):
    """Whether path is a base model 00_pretrain.py wrote (a policy directory whose args.json names 00)."""
    return owned(path, "policy") and read_json(os.path.join(path, "args.json")).get("stage") == "00_pretrain"


def check_writable(said, path):
    """RUN or BASE_CACHE: a folder this user may make or write in, else a run fails later (cannot lock, cannot write):
    its nearest existing folder writable (os.access). Root passes os.access even in /proc, so as root a folder of a
    name of its own is made and removed there instead (its times kept): the folder the run names is never made by a
    check."""
    top = os.path.abspath(path)
    while not os.path.lexists(top):
        top = os.path.dirname(top)
    if not os.path.isdir(top):  # a file, or a link to nothing or to itself
        die(f"{said}: {top} is not a folder; pick a folder you may write in")
    try:
        if not os.access(top, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            was = os.stat(top)
            os.rmdir(tempfile.mkdtemp(prefix=".qevolve-check-", dir=top))
            os.utime(top, ns=(was.st_atime_ns, was.st_mtime_ns))  # the folder's times as they were
    except OSError as e:
        die(f"{said}: cannot write in {top} ({e.strerror}); pick a folder you may write in")


def check_base_cache(cache):
    """BASE_CACHE, by RUN's rule: a new folder, an empty one, or one this project made - its CACHEDIR.TAG (CACHE_STAMP),
    or (a cache of an earlier version) only base models of 00_pretrain.py and write_atomic's temporaries; never /, the
    home or current directory or one above them, the checkout or one of its folders, a file or a {...} field."""
    said = f"BASE_CACHE={cache}"
    real = os.path.realpath(cache)
    rel = os.path.relpath(real, CHECKOUT).split(os.sep)
    if re.search(r"[{}]", cache) or rel == ["."] or rel[0] in SHIPPED or any(
            inside(os.path.realpath(top), real) for top in (os.getcwd(), os.path.expanduser("~"), CHECKOUT)):
        die(f"{said} must be a folder of its own (no {{...}} field; not /, your home, the current directory or one "
            "above them, the checkout or one of its folders), e.g. runs/base")
    if os.path.lexists(cache) and not os.path.isdir(cache):
        die(f"{said} is not a folder; name a new folder, e.g. runs/base")
    check_path(cache)  # the write rule's own ('..' after a name that is no folder)
    check_writable(said, cache)
    try:
        names = set(os.listdir(cache)) - {".lock"} if os.path.isdir(cache) else set()
    except OSError as e:
        die(f"cannot read {said} ({e.strerror})")
    names |= {".lock"} if stray_lock(cache) else set()  # another tool's .lock: a file like any other
    if CACHE_TAG in names and stamped(os.path.join(cache, CACHE_TAG)):
        return
    temporary = lambda n: os.path.join(cache, n) in temporaries(os.path.join(cache, n[1:].split(".qevolve-tmp-")[0]))
    stray = sorted(n for n in names if not (base_entry(os.path.join(cache, n)) or temporary(n)))
    if stray:
        die(f"{said} holds files that run_all.sh did not make ({stray[0]}; no {CACHE_TAG} of this project): the base "
            "cache is a new folder or the one run_all.sh made; pick another BASE_CACHE, e.g. runs/base")


def make_base_cache(cache):
    """BASE_CACHE made (after check_base_cache) and stamped, before its first base model is written."""
    tag = os.path.join(cache, CACHE_TAG)
    if not os.path.exists(tag):
        save_text(tag, CACHE_STAMP)


def check_base_entry(entry, built, expected):
    """A base model reused from the cache answers for these settings only if 00_pretrain.py built it with them: its
    args.json against 00's flags for this run (but where it was written, and its threads)."""
    if not base_entry(entry):
        die(f"{entry} is in the base cache's place for this run but is not a base model of 00_pretrain.py; remove it "
            "(run_all.sh builds it again) or pick another BASE_CACHE")
    for k, v in expected.items():
        have = built.get(k)
        if k == "env_kwargs":
            have, v = (parse_env_kwargs(x) if isinstance(x, str) else x for x in (have, v))
        if k not in ("out", "threads", "metrics") and have != v:
            die(f"{entry} was built by 00_pretrain.py with --{k.replace('_', '-')} {json.dumps(built.get(k))}, not "
                f"this run's {json.dumps(expected[k])}: it is not this run's base model; remove it (run_all.sh builds "
                "it again) or pick another BASE_CACHE")


def peft_installed():
    """Whether peft is there for --lora (01, 05, eto.py: machine.add_lora, which says so only once the stage runs)."""
    return importlib.util.find_spec("peft") is not None


def cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def first_prompt(env, task_id):
    """02's chat on task_id before its first step (episode_messages): the instruction, the task, first observation."""
    obs, info = env.reset(task_id)
    return [{"role": "system", "content": env.instruction},
            {"role": "user", "content": f"Your task is to: {info['task']}\n{obs}"}]


def demonstrate(env, task_id):
    """The demonstrator (env.expert_action) on task_id of world 0 -> (whether it wins, by 02's rule for an episode's
    success: ended by the environment with a positive reward, and info's 'won' where the world grades its rewards;
    its chat as 01 renders it, 02's episode_messages: the instruction, the task and first observation, then each of
    its turns and the observation after it)."""
    chat, reward, done = first_prompt(env, task_id), 0.0, False
    while not done:
        chat.append({"role": "assistant", "content": env.expert_text()})
        obs, r, terminated, truncated, info = env.step(env.expert_action())
        reward, done = reward + r, terminated or truncated
        chat.append({"role": "user", "content": obs})
    return bool(terminated and reward > 0 and info.get("won", True)), chat


def chat_tokens(chat, tokenizer=None):
    """The tokens of a chat as 01 counts them (tokenize_episode: the chat template's text with its generation prompt)
    under a tokenizer; without one, bounds under any byte-level BPE tokenizer with the tiny model's template
    (models/tiny.py) -> (least, most): each content at least its pre-tokenizer's pieces, which no merge crosses, and at
    most its bytes, each message two more (<|role|>, <|end|>), and the prompt's <|assistant|>."""
    if tokenizer is not None:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return n, n
    from tokenizers import pre_tokenizers
    split = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    texts, fixed = [m["content"] for m in chat], 2 * len(chat) + 1
    return sum(len(split(text)) for text in texts) + fixed, sum(len(text.encode()) for text in texts) + fixed


def check_settings(s):
    """run_all.sh's settings that bash cannot check, before anything runs: ENV and ENV_KWARGS (the environment is
    made), N_EXPERT and N_SELF against the tasks of its train split (two demonstrations kept for 01: with DEMOS=success
    two tasks the demonstrator wins, demonstrate, and two wins for ALGOS=rft; two that fit the tiny model's --max-len,
    chat_tokens), EVAL_SPLITS (its splits) and N_EVAL against their tasks, THREADS and NPROC against the stages'
    ceiling and this machine, a BASE that names a directory (a model's: loaded) and SMOLLM2_DIR, the base cache
    (check_base_cache) and this run's entry in it (check_base_entry; loaded), and each *_ARGS that gives a stage flags
    by that stage (stage_args), split as bash splits it (bash_words), without a glob, a flag run_all.sh sets itself
    (STAGE_FLAGS; COLLECT_ARGS' --rerank, and --greedy with QLASS), a critic --init names that is not one or --lora
    without peft, and with replies (--max-new-tokens) that leave room in the model's context for the first prompt of
    every task of each split a run plays (first_prompt); QLASS_M within 02's --candidates, QLASS_ARGS' --tasks within
    the train split."""
    import envs
    missing = next((name for name in NEEDED if name not in s), None)  # run_all.sh passes each (its settings)
    if missing:
        die(f"{missing} is missing: python run_support.py start RUN NAME=VALUE... takes run_all.sh's settings; "
            "run bash run_all.sh --check")
    for name in INTEGERS:
        if name in s and not re.fullmatch(r"0|[1-9][0-9]{0,8}", s[name]):
            die(f"{name} must be a non-negative integer (decimal, no leading zero, at most 9 digits), got "
                f"{shlex.quote(s[name])}")
    s = {**{name: "" for name in STAGE_FLAGS}, **s}  # an *_ARGS not given: none (run_all.sh gives each)
    for name, value in s.items():
        if name != "ENV_KWARGS":
            bash_words(name, value)
    try:
        env = envs.make(s["ENV"], **parse_env_kwargs(s["ENV_KWARGS"]))
        for name, splits in (("N_EXPERT", ["train"]), ("N_SELF", ["train"]), ("N_EVAL", s["EVAL_SPLITS"].split())):
            for split in splits:
                most = min(len(env.task_ids(split)), LIMITS["episodes"])
                if int(s[name]) > most:
                    die(f"{name}={s[name]}: {s['ENV']}'s split {split!r} has {most} tasks")
        # the demonstrations kept (02 --keep DEMOS, its draw of N_EXPERT tasks with --seed SEED): 01 trains on at
        # least two (fit_context), after the base is built; played until two are kept (their lengths: below)
        train, n = env.task_ids("train"), int(s["N_EXPERT"])
        n_train, tasks = len(train), sorted(random.Random(int(s.get("SEED", "0"))).sample(train, n)) if n else train
        plays = (chat for won, chat in (demonstrate(env, t) for t in tasks) if won or s.get("DEMOS") != "success")
        first = list(itertools.islice(plays, 2))
        kept = len(first) if s.get("DEMOS") == "success" else len(tasks)
        world = f"{s['ENV']} {s['ENV_KWARGS']}".strip()
        if kept < 2:
            die(f"N_EXPERT={s['N_EXPERT']}: 01_bc.py trains on at least two demonstrations, and " + (
                f"the demonstrator wins {kept} of its {len(tasks)} train tasks of {world} (DEMOS=success keeps only "
                "those); use more tasks, DEMOS=all or another world" if s.get("DEMOS") == "success" else
                "DEMOS=all keeps one; use more tasks"))
        if "rft" in s.get("ALGOS", "").split() and s.get("DEMOS") != "success":  # RFT's 01 --filter success: two
            wins = sum(1 for _ in itertools.islice((t for t in tasks if demonstrate(env, t)[0]), 2))
            if wins < 2:
                die(f"N_EXPERT={s['N_EXPERT']}: iterated RFT (ALGOS=rft) trains on the successes, at least two, and "
                    f"the demonstrator wins {wins} of its {len(tasks)} train tasks of {world}; use more tasks")
    except (ValueError, ImportError) as e:  # an unknown env or split, a keyword it does not take, a package
        die(e)
    threads, nproc = int(s.get("THREADS", "1")), int(s.get("NPROC", "1"))
    if threads > LIMITS["threads"]:
        die(f"THREADS={threads}: the stages take at most {LIMITS['threads']} torch threads (their --threads)")
    if int(s.get("QLASS_M", "1")) > LIMITS["candidates"]:  # QLASS's evaluation: 02 --candidates QLASS_M
        die(f"QLASS_M={s['QLASS_M']}: 02_collect.py takes at most {LIMITS['candidates']} candidates a step (its "
            "--candidates)")
    base = s.get("BASE", "pretrained")  # a model directory: checked here, not by 01 after the expert demos
    if base not in ("pretrained", "tiny", "smollm2") and not all(
            os.path.isfile(os.path.join(base, f)) for f in ("config.json", "tokenizer_config.json")):
        die(f"BASE={base} is not a model directory (a Hugging Face model's, with its config.json and "
            "tokenizer_config.json); name one, or BASE=pretrained, tiny or smollm2")
    model = base if base not in ("pretrained", "tiny", "smollm2") else None
    if base == "smollm2":
        model = s.get("SMOLLM2_DIR", "models/smollm2-135m")
        if not os.path.lexists(model):  # converted first (python -m models.smollm2): its wheel installed, a new folder
            from models.smollm2 import find_gguf
            check_path(model)
            find_gguf()
            model = None
    if base == "pretrained" and "BASE_CACHE" in s:
        check_base_cache(s["BASE_CACHE"])
    pretrain = ["--out", s.get("BASE_DIR", "base"), "--env", s["ENV"], "--env-kwargs", s["ENV_KWARGS"], "--threads",
                str(threads)]
    extra = [("00_pretrain", pretrain + bash_words("PRETRAIN_ARGS", s["PRETRAIN_ARGS"]))] if base == "pretrained" else \
        [("@model", [model])] if model else []
    cached = base == "pretrained" and s.get("BASE_DIR") and os.path.lexists(s["BASE_DIR"])
    extra += [("@model", [s["BASE_DIR"]])] if cached else []  # this run's base in the cache loads, as 01 will load it
    jobs = {}  # each *_ARGS -> its stage's argv twice, run_all.sh's flags set two ways (VALUES)
    for name, (stage, sets) in STAGE_FLAGS.items():
        flags = bash_words(name, s[name])  # as bash splits an unquoted $NAME
        if name in ("OUTCOME_ARGS", "LATER_ARGS"):
            flags = bash_words("BPPO_ARGS", s["BPPO_ARGS"]) + flags
        values = lambda f: ("tiny", "2") if f == "--model" and s["BASE"] == "tiny" and name == "BC_ARGS" else \
            VALUES.get(f, ("1", "2"))
        jobs[name] = [(stage, [a for f in sets for a in (f, values(f)[i])] + flags) for i in (0, 1)]
    parsed = stage_args([job for pair in jobs.values() for job in pair] + extra + [("@gpus", [])] * (nproc > 1))
    args = {name: [parsed[2 * i], parsed[2 * i + 1]] for i, name in enumerate(jobs)}
    for name, (stage, sets) in STAGE_FLAGS.items():
        said = f"{name}={shlex.quote(s[name])}"
        if re.search(r"[*?[]", s[name]):
            die(f"{said}: no glob characters (* ? [): bash would expand them to file names")
        why = next((a for a in args[name] if isinstance(a, str)), None)
        if why is not None:
            die(f"{said}: {stage}.py refuses it: {why}")
        for f in sets:
            if args[name][0][f[2:].replace("-", "_")] == args[name][1][f[2:].replace("-", "_")]:
                die(f"{said}: run_all.sh sets {f} itself (bash run_all.sh --help names the setting for it)" if
                    f != "--metrics" else f"{said}: run_all.sh owns --metrics (a run's go to RUN/metrics.jsonl)")
        if args[name][0].get("lora") and not peft_installed():
            die(f"{said}: --lora needs the peft package: pip install -r requirements-smollm2.txt")
        if args[name][0].get("init") and not owned(args[name][0]["init"], "critic"):
            die(f"{said}: --init {args[name][0]['init']} is not {ARTIFACTS['critic'][0]}")
        # COLLECT_ARGS follow the evaluations' --greedy (which refuses --rerank) and QLASS's --rerank QNET
        if name == "COLLECT_ARGS" and args[name][0]["rerank"] is not None:
            die(f"{said}: run_all.sh sets --rerank itself (QLASS's evaluation, ALGOS=qlass; the others are greedy)")
        if name == "COLLECT_ARGS" and args[name][0]["greedy"] and "qlass" in s.get("ALGOS", "").split():
            die(f"{said}: QLASS's evaluation (ALGOS=qlass) samples QLASS_M replies a step, which --greedy refuses")
    if nproc > 1:  # one process per GPU (distributed.py), or on a CPU at most one per core
        gpus = parsed[-1]
        most, what = (gpus, f"this machine's {gpus} GPU(s): one process per GPU") if gpus else \
            (cores(), f"this machine's {cores()} CPU cores (no GPU: one process per core)")
        if nproc > most:
            die(f"NPROC={nproc}: more processes than {what}")
    if "qlass" in s.get("ALGOS", "").split() and args["QLASS_ARGS"][0]["tasks"] > n_train:  # qlass.py: after BC
        die(f"QLASS_ARGS={shlex.quote(s['QLASS_ARGS'])}: --tasks {args['QLASS_ARGS'][0]['tasks']} exceeds the "
            f"{n_train} train tasks of {s['ENV']}")
    context = None
    if extra:
        got = parsed[len(parsed) - len(extra) - (nproc > 1)]
        if isinstance(got, str):
            die(f"PRETRAIN_ARGS={shlex.quote(s['PRETRAIN_ARGS'])}: 00_pretrain.py refuses it: {got}" if
                base == "pretrained" else f"{'BASE' if model == base else 'SMOLLM2_DIR'}={model}: {got}")
        context = got["max_len"] if base == "pretrained" else got["context"]
        if cached:
            entry, loaded = s["BASE_DIR"], parsed[len(parsed) - len(extra) + 1 - (nproc > 1)]
            check_base_entry(entry, read_json(os.path.join(entry, "args.json")) or {}, got)
            if isinstance(loaded, str):  # (a hand-damaged entry: its weights removed)
                die(f"{entry} is this run's base model in the cache, but {loaded}; remove it (run_all.sh builds it "
                    "again) or pick another BASE_CACHE")
    elif base == "tiny":
        context = args["BC_ARGS"][0]["max_len"]
    made = []  # 01's tokenizer, once made

    def tokens(chats):  # each chat's tokens under 01's tokenizer: BASE=tiny's as 01 trains it, on the
        # demonstrations kept; a model's once built (a base model's entry in the cache), else as 00 will train it, on
        # its corpus (stage_args: @tokens)
        if base == "pretrained" and not os.path.isfile(os.path.join(s.get("BASE_DIR", ""), "tokenizer_config.json")):
            return stage_args([("@tokens", [got, chats])])[0] if chats else []
        if not made and base == "tiny":
            from models.tiny import train_tiny_tokenizer
            kept = [chat for won, chat in (demonstrate(env, t) for t in tasks) if won or s.get("DEMOS") != "success"]
            texts = [kept[0][0]["content"]] + [m["content"] for d in kept for m in d[1:]]
            made.append(train_tiny_tokenizer(texts, args["BC_ARGS"][0]["vocab_size"]))
        elif not made:
            from transformers import AutoTokenizer
            made.append(AutoTokenizer.from_pretrained(model or s["BASE_DIR"]))
        return [chat_tokens(chat, made[0])[0] for chat in chats]
    if context is not None and base in ("pretrained", "tiny"):  # a byte-level BPE tokenizer (models/tiny.py)
        # 01 trains on at least two demonstrations that fit the model's context (fit_context): refused if fewer do.
        # Played until two surely fit (at most their bytes); else those that may fit (at least their pre-tokenizer's
        # pieces) are counted with 01's tokenizer: BASE=tiny's as 01 trains it, on the demonstrations; a base model's
        # once built, else as 00 will train it, on its corpus (stage_args: @tokens)
        demos, bounds, sure = [], [], 0
        for chat in itertools.chain(first, plays):
            demos.append(chat)
            bounds.append(chat_tokens(chat))
            sure += bounds[-1][1] <= context
            if sure == 2:
                break
        else:
            counts = tokens([chat for chat, (least, _) in zip(demos, bounds) if least <= context])
            fit = sum(n <= context for n in counts)
            if fit < 2:
                name = "PRETRAIN_ARGS" if base == "pretrained" else "BC_ARGS"
                die(f"{name}={shlex.quote(s[name])}: --max-len {context} is too short: {fit} of the {len(demos)} "
                    "demonstrations kept fit in it, and 01_bc.py trains on at least two; raise it")
    # 02 plays a sample of a split's tasks, and cannot play one whose first prompt (the instruction, the task and its
    # first observation: first_prompt) does not fit beside the longest reply: every task of each split a run plays
    # must fit, in each world (its own episodes and QLASS's trees: train in world 0; the evaluations: EVAL_SPLITS in
    # EVAL_WORLDS), counted as the demonstrations are: at most its bytes under the tiny model's tokenizer, else exactly
    byte_level, worlds, pending = base in ("pretrained", "tiny"), {0: env}, []
    for name in ["COLLECT_ARGS"] + ["QLASS_ARGS"] * ("qlass" in s.get("ALGOS", "").split()):
        room = None if context is None else context - args[name][0]["max_new_tokens"]
        plays = [(0, "train")] + [(int(w), split) for w in s.get("EVAL_WORLDS", "0").split() for split in
                                  s["EVAL_SPLITS"].split()] * (name == "COLLECT_ARGS")
        for world, split in plays if room is not None else []:
            if world not in worlds:
                worlds[world] = envs.make(s["ENV"], seed=world, **parse_env_kwargs(s["ENV_KWARGS"]))
            chats = [first_prompt(worlds[world], task) for task in worlds[world].task_ids(split)]
            pending.append((name, room, world, split, [chat for chat in chats
                                                       if not (byte_level and chat_tokens(chat)[1] <= room)]))
    counts = iter(tokens([chat for *_, chats in pending for chat in chats]))  # one count for all (@tokens: a tokenizer)
    for name, room, world, split, chats in pending:
        longest = max((next(counts) for _ in chats), default=0)
        if longest > room:
            die(f"{name}={shlex.quote(s[name])}: replies of --max-new-tokens {args[name][0]['max_new_tokens']} leave "
                f"no room in the model's context of {context} tokens for the first prompt of every {split} task of "
                f"world {world} (the longest: {longest} tokens), and 02_collect.py plays a sample of them" +
                (f" (PRETRAIN_ARGS' --max-len {context})" if base == "pretrained" else ""))
    for world in worlds.values():
        world.close()


def tracked(path):
    """Whether path is a file the checkout ships (git ls-files: tracked), which no script's output replaces; without
    git, or outside a git clone, every file of the checkout's own folders (SHIPPED) and at its top counts as one."""
    real = os.path.realpath(path)
    if not os.path.lexists(path) or not inside(real, CHECKOUT) or real == CHECKOUT:
        return False
    rel = os.path.relpath(real, CHECKOUT)
    try:
        proc = subprocess.run(["git", "-C", CHECKOUT, "ls-files", "--error-unmatch", "--", rel], capture_output=True)
        if proc.returncode in (0, 1):  # tracked / not tracked
            return proc.returncode == 0
    except OSError:  # no git
        pass
    return os.sep not in rel or rel.split(os.sep)[0] in SHIPPED


def check_run(run, var="RUN"):
    """run_all.sh's RUN, by the write rule (check_path): a new folder, an empty one (but for the .lock of a killed start
    and bench/speed/stage_times.py's launches.log) or one a run made (its settings.json: read_settings); never the
    checkout or one of its own folders, a file, or a path with a {...} field (02 fills those in). var="LAB": bench/
    gpu_lab.sh's folder of runs, by the same rule, holding only runs and the logs and report it stamps."""
    if re.search(r"[{}]", run):
        die(f"{var}={run}: a run's folder has no {{...}} field; name a plain folder")
    check_path(run)
    rel = os.path.relpath(os.path.realpath(run), CHECKOUT).split(os.sep)
    if rel == ["."] or rel[0] in SHIPPED:
        die(f"{var}={run} is the checkout or lies in one of its folders ({', '.join(SHIPPED)}); pick a new folder, "
            "e.g. runs/NAME")
    if os.path.lexists(run) and not os.path.isdir(run):
        die(f"{var}={run} is not a folder; pick a new folder")
    check_writable(f"{var}={run}", run)
    try:
        names = set(os.listdir(run)) - {".lock", "launches.log"} if os.path.isdir(run) else set()
    except OSError as e:
        die(f"cannot read {var}={run} ({e.strerror})")
    names |= {".lock"} if stray_lock(run) else set()  # another tool's .lock: a file like any other
    if var == "LAB":  # the lab's own: its runs, and its logs and report (stamped)
        ours = lambda p: os.path.isfile(os.path.join(p, "settings.json")) or owned(p, "run_log") or owned(p, "table")
        if any(not ours(os.path.join(run, n)) for n in names):
            die(f"LAB={run} holds files that no lab of bench/gpu_lab.sh made; pick a new folder")
    elif names and "settings.json" not in names:
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
    (check_run), its settings checked (check_settings), and those that shape what the run writes (all but UNRECORDED)
    compared with RUN/settings.json, which its first start recorded: a resume with others would mix two runs. With
    COMMAND (run_all.sh again): RUN locked first (lock), the record written when new, the base cache stamped
    (make_base_cache), then this process becomes COMMAND, holding the lock. Without (run_all.sh --check) nothing is
    written. A RUN held by the caller (bench/gpu_lab.sh; held_folders) had its settings checked by the caller
    (run_all.sh --check), which starts many runs of it."""
    check_run(run)
    cache = settings.get("BASE_CACHE")
    if cache and (inside(os.path.realpath(run), os.path.realpath(cache)) or
                  inside(os.path.realpath(cache), os.path.realpath(run))):  # else a run waits on its own lock
        die(f"RUN={run} and BASE_CACHE={cache} are one folder or one holds the other; each is a folder of its own, "
            "e.g. runs/NAME and runs/base")
    if os.path.realpath(run) not in held_folders():  # else gpu_lab.sh's: checked by its run_all.sh --check
        check_settings(settings)
    path, record = os.path.join(run, "settings.json"), {k: v for k, v in settings.items() if k not in UNRECORDED}

    def same_record():  # RUN's record against this run's settings: before the lock (nothing written on a refusal)
        if not os.path.lexists(path):  # and again under it (a run that started meanwhile may have written it)
            return False
        old = read_settings(run, record)
        extra = [k for k in old if k not in record and k not in ("stage", *UNRECORDED)]
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
    if command and settings.get("BASE", "pretrained") == "pretrained" and "BASE_CACHE" in settings:
        make_base_cache(settings["BASE_CACHE"])  # stamped before its first base model (00) is written
    if command:
        become(command, QEVOLVE_STARTED=run)


def main(argv):
    """results RUN K WORLDS ALGOS SPLIT...: run_all.sh's table. save KIND PATH WRITER: stdin into PATH after check_out,
    atomically, its first line stamped. check KIND PATH...: check_out each (check lab LAB: gpu_lab.sh's, check_run).
    start RUN NAME=VALUE... [-- COMMAND...]: run_all.sh's start (start_run). build ENTRY -- COMMAND...: the base model
    (build). lock FOLDER... -- COMMAND...: COMMAND run holding each folder's lock (lock, become). holds FOLDER: exit 0
    if this process (its inherited open files) holds FOLDER's lock (holds), else 1. torchrun ARGS...: above."""
    command, *rest = argv or ["help"]
    cut = rest.index("--") if "--" in rest else len(rest)  # start / build / lock: what comes before COMMAND
    if command == "results" and len(rest) >= 5 and rest[1].isdigit():
        results_table(rest[0], int(rest[1]), rest[2].split(), rest[3].split(), rest[4:])
    elif command == "save" and len(rest) == 3 and rest[0] == "run_log":
        check_out(rest[1], rest[0])
        save_text(rest[1], f"{STAMPED[rest[0]]}{STAMP}{rest[2]}\n" + sys.stdin.read())
    elif command == "check" and rest[:1] == ["lab"] and len(rest) == 2:
        check_run(rest[1], "LAB")
    elif command == "check" and rest and rest[0] in ARTIFACTS:
        for path in rest[1:]:
            check_out(path, rest[0])
    elif command == "start" and rest and all("=" in a for a in rest[1:cut]):
        start_run(rest[0], dict(a.split("=", 1) for a in rest[1:cut]), rest[cut + 1:])
    elif command == "build" and len(rest[:cut]) == 1 and rest[cut + 1:]:
        build(rest[0], rest[cut + 1:])
    elif command == "lock" and rest[cut + 1:]:
        lock(rest[:cut])
        become(rest[cut + 1:])
    elif command == "torchrun":
        torchrun(rest)
    elif command == "holds" and len(rest) == 1:
        sys.exit(0 if holds(rest[0]) else 1)
    else:
        die(f"python run_support.py {' '.join(argv)}: not a command of {main.__doc__}")


if __name__ == "__main__":
    main(sys.argv[1:])
