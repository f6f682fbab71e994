"""Write the course kit a teacher hands out: a self-contained folder with the stage files whose functions
that carry the paper's ideas are exercises - each keeps its signature and docstring (the equation), its
body becomes `raise NotImplementedError("exercise: <stage>.<function> ...")` - beside verbatim copies of
what the chain needs to run (00_pretrain.py, plumbing.py, machine.py, distributed.py, run_support.py, the decoding
and rollout modules, envs/, models/, run_all.sh, requirements.txt), the tests that grade it, and one grade command.
No reference body, no git history and no list of mistakes (course/mistakes.py) go in; the functions are found by name
with `ast`, so the reference files carry no markers. docs/course.md is the handout (copied in); course/TEACHER.md,
with the answers, stays out. The teacher runs it and hands out the folder, which lies outside the checkout (a folder
inside it is refused: the reference's own tests and files would take it for theirs).

    python course/make_exercises.py --out ../exercises  # the teacher: the students' folder, beside the checkout
    cd ../exercises && pip install -r requirements.txt  # a student, in a fresh virtualenv: the folder installs alone
    cd ../exercises && python grade.py                  # grading: a stub fails with its exercise's name
    cd ../exercises && python grade.py -k gae           # one exercise's tests
    cd ../exercises && SMOKE=1 K=0 bash run_all.sh      # 01 and 02 written: the chain up to BC and its evaluation
    cd ../exercises && SMOKE=1 bash run_all.sh          # once every exercise passes: the whole chain
"""
import argparse
import ast
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import Parser, check_path, die, inside, write_atomic  # noqa: E402

# stage file -> the functions that become exercises, in the order docs/course.md takes them
EXERCISES = {
    "01_bc.py": ["tokenize_episode", "collate", "bc_loss"],
    "02_collect.py": ["retro_label", "take_step"],
    "03_critic.py": ["step_weights", "expectile_loss", "weighted_mse", "trajectory_tensors", "iql_losses",
                     "polyak_update"],
    "04_gae.py": ["gae", "episode_advantages"],
    "05_bppo.py": ["token_advantages", "old_logprobs", "bppo_loss", "kl_to_ref"],
}
# The data contract is copied byte-identical into the stages that read episodes: one exercise (01's),
# stubbed in every copy with 01's message; tests/test_stage_copies.py tells the student to copy it on.
COPIES = {"tokenize_episode": "01_bc.py", "collate": "01_bc.py"}
VERBATIM = ["00_pretrain.py", "plumbing.py", "machine.py", "distributed.py", "run_support.py", "critic_report.py",
            "kv_cache.py", "rerank.py", "rollout.py", "eto.py", "qlass.py", "run_all.sh", "envs", "models/__init__.py",
            "models/tiny.py", "docs/course.md", "docs/design.md", "requirements.txt"]  # copied as they are
# The grading tests: test file -> None (all of it) or the top-level names kept; DROP: never copied
# (a test's own re-implementation of an exercise would be its solution).
TESTS = {"tests/conftest.py": None, "tests/test_math.py": None, "tests/test_layout.py": None,
         "tests/test_stage_copies.py": ["top_level_sources", "test_copied_helpers_are_identical"]}
DROP = ["loop_gae", "test_gae_matches_plain_loop"]
GRADE = r'''"""Grade the exercises: python grade.py [pytest options, e.g. -k gae]. Exit 0 when all it ran pass."""
import os
import re
import shlex
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEp", "-p", "no:cacheprovider", *sys.argv[1:]],
                      cwd=here, capture_output=True, text=True)
print(proc.stdout + proc.stderr)
ran = re.findall(r"^(?:PASSED|FAILED|ERROR) \S+::(\w+)", proc.stdout, re.M)
what = f"{len(ran)} tests selected by {shlex.join(sys.argv[1:])}" if sys.argv[1:] else f"all {len(ran)} tests"
todo = sorted(set(re.findall(r"exercise: (\w+\.\w+)", proc.stdout)))
print(f"grade: {what}: {len(todo)} exercises still to write: {', '.join(todo)}" if todo else
      f"grade: no test selected by {shlex.join(sys.argv[1:])}" if not ran else
      f"grade: {what}: all pass ({', '.join(sorted(set(ran)))})" if proc.returncode == 0 and sys.argv[1:] else
      f"grade: {what}: all pass" if proc.returncode == 0 else f"grade: {what}: some fail (above)")
sys.exit(proc.returncode)
'''
README = """# Q-Evolve: the exercises

This folder installs on its own, in a fresh virtualenv (Python 3.11 or newer):

    python -m venv .venv && source .venv/bin/activate
    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # a CPU-only machine only
    pip install -r requirements.txt

Write the bodies of the functions that raise `NotImplementedError("exercise: ...")`, in the order of docs/course.md,
'The exercises'. Each keeps its docstring: the equation it computes.

    python grade.py               # every exercise's tests; a stub fails with its name
    python grade.py -k gae        # one exercise's tests
    SMOKE=1 K=0 bash run_all.sh   # exercises 1-5 pass: the chain up to BC and its evaluation (03-05 not run yet)
    SMOKE=1 bash run_all.sh       # every test passes: the whole chain on toy budgets, with your functions

tokenize_episode and collate are copied byte-identical into 03_critic.py, 04_gae.py and 05_bppo.py:
write them in 01_bc.py, then copy them (grade.py checks the copies).
"""


def functions(source, names):
    """name -> the top-level `def` node of each of `names` in `source` (each must exist and open
    with a docstring)."""
    found = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name in names}
    for name in names:
        if name not in found or ast.get_docstring(found[name]) is None:
            raise ValueError(f"no top-level function {name}() with a docstring")
    return found


def stub(source, stage, names):
    """`source` with the body of each function in `names` (everything after its docstring)
    replaced by one `raise NotImplementedError("exercise: ...")` line."""
    lines = source.splitlines(keepends=True)
    nodes = functions(source, names)
    for node in sorted(nodes.values(), key=lambda n: n.lineno, reverse=True):  # bottom up: line numbers hold
        indent = " " * node.body[0].col_offset
        owner = COPIES.get(node.name, stage)
        message = f"exercise: {owner[:-3]}.{node.name} (docs/course.md)"
        lines[node.body[0].end_lineno:node.end_lineno] = [f'{indent}raise NotImplementedError("{message}")\n']
    return "".join(lines)


def exercises_of(name, source):
    """The functions of stage file `name` that are stubbed: its own exercises and the copies it holds."""
    tree = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    return EXERCISES.get(name, []) + [f for f, owner in COPIES.items() if owner != name and f in tree]


def keep_only(source, keep, drop):
    """A test file with only the imports/assignments and the top-level functions in `keep` (None: all), less `drop`."""
    lines = source.splitlines(keepends=True)
    for node in reversed(ast.parse(source).body):
        if isinstance(node, ast.FunctionDef) and (node.name in drop or (keep is not None and node.name not in keep)):
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            lines[first - 1:node.end_lineno] = []
    return "".join(lines)


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the folder to write: new, and outside the checkout")
    args = p.parse_args()
    check_path(args.out)  # the project's write rule: not empty, not the current or home directory or one above
    if inside(os.path.realpath(args.out), os.path.realpath(ROOT)):
        die(f"--out {args.out} lies inside the checkout {ROOT}; write the kit outside it, e.g. --out ../exercises "
            "(nothing was written)")
    if os.path.lexists(args.out):
        die(f"--out {args.out} exists; choose a new folder (nothing was written)")

    def write(tmp):
        os.makedirs(os.path.join(tmp, "tests"))
        for name in sorted(f for f in os.listdir(ROOT) if f[:2].isdigit() and f.endswith(".py")):
            with open(os.path.join(ROOT, name)) as f:
                source = f.read()
            with open(os.path.join(tmp, name), "w") as f:
                f.write(stub(source, name, exercises_of(name, source)))
        for name in VERBATIM:
            if os.path.isdir(os.path.join(ROOT, name)):
                shutil.copytree(os.path.join(ROOT, name), os.path.join(tmp, name),
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, name), os.path.join(tmp, name))
        for name, keep in TESTS.items():
            with open(os.path.join(ROOT, name)) as f, open(os.path.join(tmp, name), "w") as g:
                g.write(keep_only(f.read(), keep, DROP))
        for name, text in (("grade.py", GRADE), ("README.md", README),
                           ("pytest.ini", "[pytest]\ntestpaths = tests\npythonpath = .\n")):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
    write_atomic(args.out, write)  # a temporary sibling, then one rename
    n = sum(len(v) for v in EXERCISES.values())
    print(f"make_exercises: wrote {args.out} with {n} exercises:")
    for stage, names in EXERCISES.items():
        print(f"  {stage}: {', '.join(names)}")
    print(f"grade them: cd {args.out} && python grade.py")


if __name__ == "__main__":
    main()
