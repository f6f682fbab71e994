"""The course kit (docs/course.md): course/make_exercises.py writes a self-contained folder - the stubbed
stages, the modules they import, the grading tests and one grade command (`python grade.py`), with no
reference body and no git history in it; the stubs fail with their exercises' names; with the reference
bodies put back the folder is the reference again: it grades itself green and its chain runs."""
import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, load_module

mx = load_module("course/make_exercises.py", "make_exercises")
EXERCISES = {f"{stage[:-3]}.{name}" for stage, names in mx.EXERCISES.items() for name in names}
STAGE_FILES = sorted(f for f in os.listdir(ROOT) if f[:2].isdigit() and f.endswith(".py"))


def grade(folder):
    """`cd folder && python grade.py`, as a student runs it (outside the repository: nothing of it is read)."""
    return subprocess.run([sys.executable, "grade.py"], cwd=folder, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"})


def put_back(student, reference, names):
    """`student` with each function's body after its docstring taken from `reference`."""
    lines, ref_lines = student.splitlines(keepends=True), reference.splitlines(keepends=True)
    mine, ref = mx.functions(student, names), mx.functions(reference, names)
    for name in sorted(names, key=lambda n: mine[n].lineno, reverse=True):
        lines[mine[name].body[0].end_lineno:mine[name].end_lineno] = \
            ref_lines[ref[name].body[0].end_lineno:ref[name].end_lineno]
    return "".join(lines)


def bodies(source, names):
    """The reference body (after the docstring) of each function, as text without indentation."""
    lines = source.splitlines()
    return {n: "\n".join(line.strip() for line in lines[node.body[0].end_lineno:node.end_lineno] if line.strip())
            for n, node in mx.functions(source, names).items()}


@pytest.mark.slow
def test_the_kit_grades_itself_has_no_solution_and_put_back_is_the_reference(tmp_path):
    ex = tmp_path / "exercises"
    made = subprocess.run([sys.executable, "course/make_exercises.py", "--out", str(ex)], cwd=ROOT,
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert f"cd {ex} && python grade.py" in made.stdout
    again = subprocess.run([sys.executable, "course/make_exercises.py", "--out", str(ex)], cwd=ROOT,
                           capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and len(again.stderr.splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["exercises"]  # no temporary left beside it

    # Self-contained, and no solution in it: no history, no teacher's notes, no reference body in any file.
    files = [os.path.join(d, f) for d, _, fs in os.walk(ex) for f in fs]
    assert not any(part in (".git", "TEACHER.md") for f in files for part in f.split(os.sep))
    assert {"grade.py", "README.md", "run_all.sh", "plumbing.py", "rollout.py"} <= set(os.listdir(ex))
    text = {f: open(f, errors="replace").read() for f in files}
    for stage in STAGE_FILES:
        reference = open(os.path.join(ROOT, stage)).read()
        names = mx.exercises_of(stage, reference)
        for name, body in bodies(reference, names).items():
            flat = {f: "\n".join(line.strip() for line in t.splitlines() if line.strip()) for f, t in text.items()}
            assert not [f for f, t in flat.items() if body in t], f"{stage}:{name}'s body is in the kit"
    assert "def loop_gae" not in text[str(ex / "tests" / "test_math.py")]

    # Each exercise (and each copy of the data contract) keeps its signature and docstring; its body is one raise.
    for stage in STAGE_FILES:
        reference, student = open(os.path.join(ROOT, stage)).read(), (ex / stage).read_text()
        names = mx.exercises_of(stage, reference)
        ref, mine = mx.functions(reference, names), mx.functions(student, names)
        for name in names:
            assert ast.dump(mine[name].args) == ast.dump(ref[name].args)
            assert ast.get_docstring(mine[name]) == ast.get_docstring(ref[name])
            assert [type(n) for n in mine[name].body[1:]] == [ast.Raise]
            owner = mx.COPIES.get(name, stage)[:-3]
            assert f'"exercise: {owner}.{name} (docs/course.md)"' in student

    # The stubs fail the tests of every exercise, each failure naming its exercise; nothing else fails.
    proc = grade(ex)
    out = proc.stdout
    assert proc.returncode != 0 and "exercises still to write" in out, out[-3000:]
    failed = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    assert failed and all("NotImplementedError: exercise: " in line for line in failed), out[-3000:]
    assert set(re.findall(r"exercise: (\w+\.\w+) \(docs/course\.md\)", out)) == EXERCISES
    assert re.search(r"\d+ passed", out)  # the tests of functions that are not exercises

    # Put back, the files are the reference byte for byte; the kit grades itself green; the chain runs.
    for stage in STAGE_FILES:
        reference = open(os.path.join(ROOT, stage)).read()
        (ex / stage).write_text(put_back((ex / stage).read_text(), reference, mx.exercises_of(stage, reference)))
        assert (ex / stage).read_text() == reference
    proc = grade(ex)
    assert proc.returncode == 0 and "grade: every test passes" in proc.stdout, proc.stdout[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("RUN", "ENV_KWARGS", "EVAL_WORLDS", "BASE", "K")}
    env.update(SMOKE="1", K="1", EVAL_WORLDS="0", BASE_CACHE=str(tmp_path / "base"), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    smoke = subprocess.run(["bash", "run_all.sh"], cwd=ex, env=env, capture_output=True, text=True)
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-2000:]
    assert (ex / "runs" / "smoke" / "results.md").exists()


def test_a_kit_with_only_the_copies_unsolved_tells_the_student_to_copy(tmp_path):
    """The data contract is one exercise in 01_bc.py and stubbed with 01's name in every copy."""
    for stage in ("03_critic.py", "04_gae.py", "05_bppo.py"):
        source = open(os.path.join(ROOT, stage)).read()
        stubbed = mx.stub(source, stage, mx.exercises_of(stage, source))
        assert stubbed.count('"exercise: 01_bc.tokenize_episode (docs/course.md)"') == 1
        assert stubbed.count('"exercise: 01_bc.collate (docs/course.md)"') == 1
