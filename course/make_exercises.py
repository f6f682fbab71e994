"""Write a student copy of the reference: the stage files with the functions that carry the paper's
ideas turned into exercises - each keeps its signature and docstring, its body becomes
`raise NotImplementedError("exercise: <stage>.<function> ...")` - beside verbatim copies of what
the chain needs to run (00_pretrain.py, plumbing.py, envs/, run_all.sh). The functions are found
by name with `ast`; the reference files carry no markers. docs/course.md is the handout.

    python course/make_exercises.py --out exercises            # the student's folder
    python -m pytest tests/test_math.py --stages exercises     # grading: a stub fails with its exercise's name
    cd exercises && SMOKE=1 bash run_all.sh                    # once every exercise passes: the whole chain
"""
import argparse
import ast
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import die, write_atomic  # noqa: E402

# stage file -> the functions that become exercises, in the order docs/course.md takes them
EXERCISES = {
    "01_bc.py": ["bc_loss"],
    "02_collect.py": ["retro_label"],
    "03_critic.py": ["step_weights", "expectile_loss", "iql_losses"],
    "04_gae.py": ["gae"],
    "05_bppo.py": ["bppo_loss", "kl_to_ref"],
}
VERBATIM = ["00_pretrain.py", "plumbing.py", "kv_cache.py", "rerank.py", "rollout.py", "run_all.sh", "envs",
            "models/__init__.py", "models/tiny.py"]  # copied as they are


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
        message = f"exercise: {stage[:-3]}.{node.name} (docs/course.md)"
        lines[node.body[0].end_lineno:node.end_lineno] = [f'{indent}raise NotImplementedError("{message}")\n']
    return "".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the folder to write (must not exist)")
    args = p.parse_args()
    if os.path.lexists(args.out):
        die(f"--out {args.out} exists; choose a new folder (nothing was written)")

    def write(tmp):
        os.makedirs(tmp)
        for name in sorted(f for f in os.listdir(ROOT) if f[:2].isdigit() and f.endswith(".py")):
            with open(os.path.join(ROOT, name)) as f:
                source = f.read()
            if name in EXERCISES:
                source = stub(source, name, EXERCISES[name])
            with open(os.path.join(tmp, name), "w") as f:
                f.write(source)
        for name in VERBATIM:
            if os.path.isdir(os.path.join(ROOT, name)):
                shutil.copytree(os.path.join(ROOT, name), os.path.join(tmp, name),
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, name), os.path.join(tmp, name))
    write_atomic(args.out, write)  # a temporary sibling, then one rename
    n = sum(len(v) for v in EXERCISES.values())
    print(f"make_exercises: wrote {args.out} with {n} exercises:")
    for stage, names in EXERCISES.items():
        print(f"  {stage}: {', '.join(names)}")
    print(f"grade them: python -m pytest tests/test_math.py --stages {args.out}")


if __name__ == "__main__":
    main()
