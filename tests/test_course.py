"""The course kit (docs/course.md): course/make_exercises.py cuts exactly the exercises' bodies, the
math tests grade them (`--stages`), and with the reference bodies put back the folder is the
reference again: its tests pass and its chain runs."""
import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, load_module

mx = load_module("course/make_exercises.py", "make_exercises")
EXERCISES = {f"{stage[:-3]}.{name}" for stage, names in mx.EXERCISES.items() for name in names}


def grade(folder):
    """tests/test_math.py against `folder`'s stage files, as a student runs it."""
    return subprocess.run([sys.executable, "-m", "pytest", "tests/test_math.py", "--stages", str(folder), "-q",
                           "-rfE", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"})


def put_back(student, reference, names):
    """`student` with each function's body after its docstring taken from `reference`."""
    lines, ref_lines = student.splitlines(keepends=True), reference.splitlines(keepends=True)
    mine, ref = mx.functions(student, names), mx.functions(reference, names)
    for name in sorted(names, key=lambda n: mine[n].lineno, reverse=True):
        lines[mine[name].body[0].end_lineno:mine[name].end_lineno] = \
            ref_lines[ref[name].body[0].end_lineno:ref[name].end_lineno]
    return "".join(lines)


@pytest.mark.slow
def test_exercises_are_graded_and_put_back_they_are_the_reference(tmp_path):
    ex = tmp_path / "exercises"
    made = subprocess.run([sys.executable, "course/make_exercises.py", "--out", str(ex)], cwd=ROOT,
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    again = subprocess.run([sys.executable, "course/make_exercises.py", "--out", str(ex)], cwd=ROOT,
                           capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and len(again.stderr.splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["exercises"]  # no temporary left beside it

    # Each exercise keeps its signature and docstring; its body is one raise naming it.
    for stage, names in mx.EXERCISES.items():
        reference, student = open(os.path.join(ROOT, stage)).read(), (ex / stage).read_text()
        ref, mine = mx.functions(reference, names), mx.functions(student, names)
        for name in names:
            assert ast.dump(mine[name].args) == ast.dump(ref[name].args)
            assert ast.get_docstring(mine[name]) == ast.get_docstring(ref[name])
            assert [type(n) for n in mine[name].body[1:]] == [ast.Raise]
            assert f'"exercise: {stage[:-3]}.{name} (docs/course.md)"' in student

    # The stubs fail the tests of every exercise, each failure naming its exercise; nothing else fails.
    out = grade(ex).stdout
    failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
    assert failed and all("NotImplementedError: exercise: " in line for line in failed), out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("ERROR ")]  # tests whose fixture runs 02 and 01
    assert errors and all("NotImplementedError: exercise: " in line for line in errors), errors
    assert set(re.findall(r"exercise: (\w+\.\w+) \(docs/course\.md\)", out)) == EXERCISES
    assert re.search(r"\d+ passed", out)  # the tests of functions that are not exercises

    # Put back, the files are the reference byte for byte; the tests pass; the chain runs.
    for stage, names in mx.EXERCISES.items():
        reference = open(os.path.join(ROOT, stage)).read()
        (ex / stage).write_text(put_back((ex / stage).read_text(), reference, names))
        assert (ex / stage).read_text() == reference
    proc = grade(ex)
    assert proc.returncode == 0, proc.stdout[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("RUN", "ENV_KWARGS", "EVAL_WORLDS", "BASE", "K")}
    env.update(SMOKE="1", K="1", EVAL_WORLDS="0", BASE_CACHE=str(tmp_path / "base"), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    smoke = subprocess.run(["bash", "run_all.sh"], cwd=ex, env=env, capture_output=True, text=True)
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-2000:]
    assert (ex / "runs" / "smoke" / "results.md").exists()
