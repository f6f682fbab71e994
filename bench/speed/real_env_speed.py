"""Time the real environments through the TextEnv API: the expert on the first --episodes train tasks of each env,
one markdown table of medians (reset, step, expert call; TextWorld / ALFWorld games generated into a fresh cache: the
one-off cost of a new game). Also ScienceWorld's own ScienceWorldEnv.step on the same commands (it builds the
valid-action list on every step), and ALFWorld's step without the grammar parse cache (fast_text=False).

    python bench/speed/real_env_speed.py                       # all three, ~2-3 min on 2 cores
    python bench/speed/real_env_speed.py --envs textworld --episodes 20
"""
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repo root
import envs  # noqa: E402
from bench.runner import parser, row, scratch  # noqa: E402
from plumbing import check_flags, die  # noqa: E402


def ms(xs):
    return f"{1000 * statistics.median(xs):.1f}" if xs else "-"


def timed(t, key, fn, *args):
    """fn(*args), its seconds appended to t[key]."""
    t0 = time.perf_counter()
    out = fn(*args)
    t[key].append(time.perf_counter() - t0)
    return out


def play(env, task_ids, generate=None):
    """Expert episodes -> ({call: seconds of each}, wins, [(task, its commands)])."""
    t, wins, commands = {"generate": [], "reset": [], "step": [], "expert": []}, 0, []
    for tid in task_ids:
        if generate is not None:
            timed(t, "generate", generate, tid)
        timed(t, "reset", env.reset, tid)
        done, cmds = False, []
        while not done:
            cmds.append(timed(t, "expert", env.expert_action))
            _, reward, terminated, truncated, _ = timed(t, "step", env.step, cmds[-1])
            done = terminated or truncated
        wins += terminated and reward > 0
        commands.append((tid, cmds))
    return t, wins, commands


def bench_sciworld(n):
    env = envs.make("sciworld")
    env.task_ids("train")  # starts the JVM, builds the index
    tids = env.task_ids("train")[:n]
    # The expert's first call per episode reloads the variation to generate the gold path;
    # time the steps of a second, expert-free replay of the same commands instead.
    _, wins, commands = play(env, tids)
    t = {"reset": [], "step": []}
    for tid, cmds in commands:
        timed(t, "reset", env.reset, tid)
        for c in cmds:
            if env.done:  # power-component may finish a step early (simulator nondeterminism)
                break
            timed(t, "step", env.step, c)
    variations = {tid: env.task_of(tid) for tid, _ in commands}
    env.close()
    rows = [("sciworld", len(tids), wins, "-", ms(t["reset"]), ms(t["step"]), "gold path (reload, 0.1-1 s once)")]
    try:  # the package's own step, for comparison
        from scienceworld import ScienceWorldEnv
        pkg = ScienceWorldEnv("", envStepLimit=1000)
        t = {"step": []}
        for tid, cmds in commands:
            pkg.load(*variations[tid], "")
            pkg.reset()
            for c in cmds:
                timed(t, "step", pkg.step, c)
        pkg.close()
        rows.append(("scienceworld.ScienceWorldEnv.step (package)", len(commands), "-", "-", "-", ms(t["step"]), "-"))
    except Exception as err:  # comparison only
        print(f"(package comparison skipped: {err!r})")
    return rows


def bench_textworld(n, cache):
    env = envs.make("textworld", cache_dir=cache)
    t, wins, _ = play(env, env.task_ids("train")[:n], generate=env.game_file)
    env.close()
    return [("textworld", n, wins, ms(t["generate"]), ms(t["reset"]), ms(t["step"]), ms(t["expert"]))]


def bench_alfworld(n, cache):
    rows = []
    for fast in (True, False):
        env = envs.make("alfworld", games="tiny", cache_dir=cache, fast_text=fast)
        if not fast:
            from envs.alfworld_env import enable_parse_cache
            enable_parse_cache(False)
        t, wins, _ = play(env, env.task_ids("train")[:n], generate=env.game_file)
        env.close()
        rows.append((f"alfworld tiny (fast_text={fast})", n, wins, ms(t["generate"]) if fast else "-",
                     ms(t["reset"]), ms(t["step"]), ms(t["expert"])))
    from envs.alfworld_env import enable_parse_cache
    enable_parse_cache(True)
    return rows


PACKAGES = {"sciworld": "scienceworld", "textworld": "textworld", "alfworld": "alfworld"}


def main():
    ap = parser(__doc__)
    ap.add_argument("--envs", nargs="+", default=["sciworld", "textworld", "alfworld"],
                    choices=["sciworld", "textworld", "alfworld"], help="which environments to time")
    ap.add_argument("--episodes", type=int, default=10, help="expert episodes per environment")
    args = check_flags(ap.parse_args(), episodes="at least 1")
    for name in args.envs:  # every env's package before the first is timed (envs.make says the same, later)
        if importlib.util.find_spec(PACKAGES[name]) is None:
            die(f"env {name!r} needs the {PACKAGES[name]} package: pip install -r requirements-envs.txt")
    with scratch("real_env_speed_") as tmp:
        os.environ.setdefault("ALFWORLD_DATA", os.path.join(tmp, "alfworld-data"))
        rows, bench = [], {"sciworld": lambda: bench_sciworld(args.episodes),
                           "textworld": lambda: bench_textworld(args.episodes, tmp),
                           "alfworld": lambda: bench_alfworld(args.episodes, tmp)}
        for name in args.envs:
            t0 = time.time()
            try:
                rows += bench[name]()
            except ImportError as e:  # its package (envs.make says which), before that env's first step
                die(e)
            print(f"{name}: {time.time() - t0:.0f}s", file=sys.stderr)
    print("| env | episodes | expert wins | generate game (ms) | reset (ms) | step (ms) | expert_action (ms) |\n"
          + "|---" * 7 + "|\n" + "\n".join(row(*r) for r in rows))


if __name__ == "__main__":
    main()
