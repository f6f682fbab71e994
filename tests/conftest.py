"""Shared fixtures: load stage files as modules (their names start with digits), run a script's main() in
the test process (in_process; run_stage starts a real process, as a user does, for one test per contract),
and a tiny expert buffer + freshly trained tiny policy that several tests reuse. `--stages DIR` grades
another folder's stage files (course/make_exercises.py): the tests then load and run DIR's 0X_*.py.
Tests marked `slow` (torchrun, SmolLM2, the real environments, the course round trip, the GPU check's
dry run, LoRA end to end, one environment sweep, the smoke chain with every method, and the checks that start
run_all.sh or its settings check many times over) run only with `--slow`, as CI does:
`python -m pytest -q --slow tests`. The default run keeps every equation, every stage's bad input, a few of
run_all.sh's refusals and the smoke chain of Q-Evolve. pyproject.toml's `-n auto` spreads a run of the suite
over pytest-xdist workers (pytest_xdist_auto_num_workers below)."""
import importlib.util
import inspect
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["00_pretrain", "01_bc", "02_collect", "03_critic", "04_gae", "05_bppo"]
STAGE_DIR = ROOT  # --stages DIR replaces it


def pytest_addoption(parser):
    parser.addoption("--stages", default=None, metavar="DIR",
                     help="load and run the stage files of DIR instead of the repository's (a course/make_exercises.py "
                          "folder: each exercise's stub fails with its name until it is solved)")
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (CI does)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--slow"):
        skip = pytest.mark.skip(reason="slow: run with --slow (CI does)")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    # The longest tests first (the slow ones when they run, then the smoke chain, a minute alone): under
    # pytest-xdist the other workers meanwhile take the many short ones, instead of waiting for it at the end.
    def longest_first(item):
        runs_slow = config.getoption("--slow") and "slow" in item.keywords
        return not runs_slow, not item.nodeid.startswith("tests/test_chain.py::test_run_all_end_to_end_then_resume")
    items.sort(key=longest_first)


def cores():
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): for a directory of tests (the suite), a worker per core, at most 4 - the
    smoke chain alone takes a minute, so more would not finish sooner, and each worker imports torch and builds
    its own session fixtures. For files or tests named one by one (grading tests/test_math.py, docs/course.md),
    none: starting workers would cost more than they save. `-n N` decides instead."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # the caller's number: pytest-xdist reads it
    where = config.invocation_params.dir
    suite = any(os.path.isdir(os.path.join(where, arg.split("::")[0])) for arg in config.args)
    return min(4, cores()) if suite else 0


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes of work; runs only with --slow")
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in each pytest-xdist worker, before torch loads
    if workers:  # N workers share the cores: each gets its share of torch threads, not all of them
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores() // int(workers))))
    global STAGE_DIR
    if config.getoption("--stages"):
        STAGE_DIR = os.path.abspath(config.getoption("--stages"))
        if not all(os.path.exists(os.path.join(STAGE_DIR, f"{s}.py")) for s in STAGES):
            raise pytest.UsageError(f"--stages {STAGE_DIR}: not every stage file {', '.join(STAGES)} is there")


def load_module(path, name):
    """A Python file of the repo (path from the root) as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_stage(name):
    return load_module(os.path.join(STAGE_DIR, f"{name}.py"), f"stage_{name}")


def run_stage(name, *args, check=True):
    """Run a stage as a subprocess from the repo root (or --stages DIR), like a user would."""
    proc = subprocess.run([sys.executable, f"{name}.py", *map(str, args)], cwd=STAGE_DIR, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def call_main(module, *args):
    """module.main() on these command-line arguments in this process -> its exit code (SystemExit's, 0 when
    main() returns); an exception other than SystemExit propagates (a real process would print a traceback).
    sys.argv (which a main() without parameters reads) and torch's thread count (which --threads sets) are
    put back afterwards."""
    import torch
    argv = list(map(str, args))
    saved_argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = [module.__file__, *argv]
    try:
        module.main(argv) if inspect.signature(module.main).parameters else module.main()
        return 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
            print(code, file=sys.stderr)
            code = 1
        return code
    finally:
        sys.argv = saved_argv
        torch.set_num_threads(threads)


@pytest.fixture
def in_process(capfd):
    """in_process(module, *args, check=True): like run_stage, but the script's main() in this process (call_main),
    without a new interpreter's seconds of imports; take a stage from the `stages` fixture or load_stage, so that
    --stages DIR is what runs. Returns a CompletedProcess: returncode, and stdout and stderr as printed."""
    def run(module, *args, check=True):
        capfd.readouterr()
        code = call_main(module, *args)
        out, err = capfd.readouterr()
        if check and code != 0:
            raise AssertionError(f"{os.path.basename(module.__file__)} failed ({code}):\n{out[-2000:]}\n{err[-3000:]}")
        return subprocess.CompletedProcess([module.__file__, *map(str, args)], code, out, err)
    return run


@pytest.fixture(scope="session")
def stages():
    return {name: load_stage(name) for name in STAGES}


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, stages):
    """20 expert demos and a 1-layer policy trained on them for one epoch (seconds; in this process)."""
    d = tmp_path_factory.mktemp("tiny_run")
    for name, *args in (["02_collect", "--policy", "expert", "--split", "train", "--episodes", 20,
                         "--out", d / "expert.jsonl"],
                        ["01_bc", "--data", d / "expert.jsonl", "--out", d / "policy_0", "--epochs", 1,
                         "--d-model", 32, "--n-layers", 1, "--n-heads", 2, "--vocab-size", 400, "--threads", 1]):
        code = call_main(stages[name], *args)
        assert code == 0, f"{name} failed ({code})"
    return d
