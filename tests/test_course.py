"""The course kit (docs/course.md): course/make_exercises.py writes a self-contained folder - the stubbed
stages, the modules they import, the grading tests and one grade command (`python grade.py`), with no
reference body and no git history in it; the stubs fail with their exercises' names; with the reference
bodies put back the folder is the reference again: it grades itself green and its chain runs."""
import ast
import inspect
import os
import re
import shlex
import subprocess
import sys
import types

import pytest

from conftest import ROOT, STAGES, load_module

mx = load_module("course/make_exercises.py", "make_exercises")
MISTAKES = load_module("course/mistakes.py", "course_mistakes")
EXERCISES = {f"{stage[:-3]}.{name}" for stage, names in mx.EXERCISES.items() for name in names}
STAGE_FILES = sorted(f for f in os.listdir(ROOT) if f[:2].isdigit() and f.endswith(".py"))
PAGES = ["docs/course.md", "course/TEACHER.md"]
TABLE = re.findall(r"^\| (\d+) \| `(\w+)\.(\w+)\(.*\| `-k (\w+)` \|$", open(os.path.join(ROOT, PAGES[0])).read(), re.M)
CHECK = {f"{stage}.{name}": k for _, stage, name, k in TABLE}  # exercise -> its `grade.py -k` word


def grade(folder, *args):
    """`cd folder && python grade.py ARGS`, as a student runs it (outside the repository: nothing of it is read)."""
    return subprocess.run([sys.executable, "grade.py", *args], cwd=folder, capture_output=True, text=True,
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
    assert {"grade.py", "README.md", "run_all.sh", "plumbing.py", "machine.py", "distributed.py",
            "run_support.py", "rollout.py", "requirements.txt"} <= set(os.listdir(ex))
    assert "course" not in os.listdir(ex)  # neither the teacher's notes nor the mistakes' edits (solutions)
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
    one = grade(ex, "-k", "gae")  # a selection says what it ran and names what is left to write
    assert one.returncode != 0 and "tests selected by -k gae: 1 exercises still to write: 04_gae.gae" in one.stdout

    # The exercises in course.md's order: each check fails on the first of its listed mistakes (course/mistakes.py;
    # tests below plant every one, in process) and passes with that exercise and the ones before it written (the data
    # contract copied on into 03, 04 and 05, as course.md says). Session 2's run once 1-5 pass: the chain up to BC.
    env = {k: v for k, v in os.environ.items() if k not in ("RUN", "ENV_KWARGS", "EVAL_WORLDS", "BASE", "K")}
    env.update(SMOKE="1", EVAL_WORLDS="0", BASE_CACHE=str(tmp_path / "base"), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    for _, stage, name, k in TABLE:
        what, old, new = MISTAKES.MISTAKES[f"{stage}.{name}"][0]
        reference = open(os.path.join(ROOT, f"{stage}.py")).read()
        (ex / f"{stage}.py").write_text(put_back((ex / f"{stage}.py").read_text(),
                                                 MISTAKES.plant(reference, name, old, new), [name]))
        proc = grade(ex, "-k", k)
        assert proc.returncode != 0 and "some fail" in proc.stdout, f"{stage}.{name}: '{what}' passes"
        for f in [f"{stage}.py"] + [f for f in STAGE_FILES if name in mx.COPIES and f != f"{stage}.py"
                                    and name in mx.exercises_of(f, open(os.path.join(ROOT, f)).read())]:
            (ex / f).write_text(put_back((ex / f).read_text(), open(os.path.join(ROOT, f)).read(), [name]))
        proc = grade(ex, "-k", k)
        assert proc.returncode == 0 and f"selected by -k {k}: all pass (test_" in proc.stdout, proc.stdout[-3000:]
        if name == "take_step":  # session 2: 03-05 still stubs, K=0 runs the chain up to BC and its evaluation
            smoke = subprocess.run(["bash", "run_all.sh"], cwd=ex, env={**env, "K": "0"}, capture_output=True,
                                   text=True)
            assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-2000:]
            assert "policy_0 (BC)" in (ex / "runs" / "smoke" / "results.md").read_text()
            assert not (ex / "runs" / "smoke" / "iter_1").exists()

    # Put back, the files are the reference byte for byte; the kit grades itself green; the chain runs.
    for stage in STAGE_FILES:
        reference = open(os.path.join(ROOT, stage)).read()
        (ex / stage).write_text(put_back((ex / stage).read_text(), reference, mx.exercises_of(stage, reference)))
        assert (ex / stage).read_text() == reference
    proc = grade(ex)
    assert proc.returncode == 0 and re.search(r"grade: all \d+ tests: all pass", proc.stdout), proc.stdout[-3000:]
    one = grade(ex, "-k", "gae")
    assert one.returncode == 0 and "grade: 4 tests selected by -k gae: all pass (test_gae_lambda_one_is_return_minus" \
        "_value, test_gae_mid_episode_done_by_hand, test_gae_terminal_by_hand, test_gae_truncated_bootstraps_last" \
        "_value)" in one.stdout, one.stdout[-3000:]
    smoke = subprocess.run(["bash", "run_all.sh"], cwd=ex, env={**env, "K": "1"}, capture_output=True, text=True)
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-2000:]
    assert (ex / "runs" / "smoke" / "results.md").exists()


@pytest.mark.slow
def test_the_kit_is_written_outside_the_checkout_only(tmp_path):
    """make_exercises.py keeps the write rule: a folder inside the checkout (whose tests and files would take the kit's
    for theirs; envs/ex would even be copied into it) is one `error:` line, exit 2, before anything is copied; so is
    an empty path or the current directory."""
    for out, cwd in (("envs/ex", ROOT), (os.path.join(ROOT, "runs", "kit"), tmp_path), ("", tmp_path),
                     (".", tmp_path)):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "course/make_exercises.py"), "--out", out], cwd=cwd,
                              capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1, \
            proc.stderr
        assert "usage:" not in proc.stderr and not proc.stdout
    assert not os.path.lexists(os.path.join(ROOT, "envs", "ex")) and os.listdir(tmp_path) == []
    assert not [f for f in os.listdir(os.path.join(ROOT, "envs")) if "qevolve-tmp" in f]
    if os.path.isdir(os.path.join(ROOT, "runs")):
        assert not [f for f in os.listdir(os.path.join(ROOT, "runs")) if f == "kit" or "kit.qevolve-tmp" in f]


def test_the_kit_holds_every_module_its_files_import():
    """Every module of the checkout that a file of the kit imports - `import X`, `from X import`, importlib's
    import_module("X"), or a module named in a string (run_support.py checks each baseline's flags by importing it by
    name) - is in the kit, so that its run_all.sh runs there (ALGOS' baselines included)."""
    local = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")} | {"envs", "models"}
    shipped = [f for f in STAGE_FILES] + [os.path.join(d, f) for v in mx.VERBATIM if v.endswith(".py") or
                                           os.path.isdir(os.path.join(ROOT, v))
                                           for d, f in ([("", v)] if v.endswith(".py") else
                                                        [(v, f) for f in os.listdir(os.path.join(ROOT, v))
                                                         if f.endswith(".py")])]
    in_kit = {os.path.splitext(f)[0].split(os.sep)[0] for f in shipped}
    missing = set()
    for f in shipped:
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read())):
            names = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else \
                [(node.module or "").split(".")[0]] if isinstance(node, ast.ImportFrom) and not node.level else \
                [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []
            missing |= {(f, n) for n in names if n in local - in_kit}
    assert not missing, sorted(missing)


def test_a_kit_with_only_the_copies_unsolved_tells_the_student_to_copy(tmp_path):
    """The data contract is one exercise in 01_bc.py and stubbed with 01's name in every copy."""
    for stage in ("03_critic.py", "04_gae.py", "05_bppo.py"):
        source = open(os.path.join(ROOT, stage)).read()
        stubbed = mx.stub(source, stage, mx.exercises_of(stage, source))
        assert stubbed.count('"exercise: 01_bc.tokenize_episode (docs/course.md)"') == 1
        assert stubbed.count('"exercise: 01_bc.collate (docs/course.md)"') == 1


def test_the_exercises_are_the_paper_equations_each_docstring_states_its_own():
    """No helper left unstubbed solves an exercise: every stage function whose docstring cites the paper is an
    exercise; and each exercise's docstring (the stub keeps it) carries its equation ('=' or '<-'), but the data
    contract's, whose docstring is its layout."""
    for stage in STAGE_FILES:
        for node in ast.parse(open(os.path.join(ROOT, stage)).read()).body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            name = f"{stage[:-3]}.{getattr(node, 'name', '')}"
            assert not (doc or "").startswith("Paper") or name in EXERCISES, f"{name} cites the paper: stub it too"
            if name in EXERCISES and node.name not in mx.COPIES:
                assert re.search(r"=|<-", doc), f"{name}'s docstring has no equation"


def test_course_md_lists_every_exercise_in_order_and_counts_them():
    text = open(os.path.join(ROOT, "docs/course.md")).read()
    assert [f"{stage}.{name}" for _, stage, name, _ in TABLE] == \
        [f"{stage[:-3]}.{name}" for stage, names in mx.EXERCISES.items() for name in names]
    assert [int(n) for n, *_ in TABLE] == list(range(1, len(EXERCISES) + 1))
    experiments = re.findall(r"^\*\*(\d+)\. [^*]+\*\* \(([^)]*)\)", text, re.M)
    assert [int(n) for n, _ in experiments] == list(range(1, len(experiments) + 1))
    words = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
            "seventeen eighteen nineteen twenty".split()
    assert f"{words[len(EXERCISES)]} exercises and {words[len(experiments)]} experiments" in text.splitlines()[0]
    for n, where in experiments:  # each names its world and its run time on 2 cores
        assert re.search(r"(credit|habit) world, (about )?(\d+(\.\d)? min|seconds)", where), \
            f"experiment {n}: ({where})"
    for page in PAGES:  # no development words on a course page
        assert not re.search(r"\bissue", open(os.path.join(ROOT, page)).read(), re.I), page


def shell_commands(text):
    """The shell commands of a markdown page: the lines of its ```bash blocks (continuations joined) and the
    inline code spans that start with a command; each split at &&, ; and |."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", rest)
              if re.match(r"(\w+=\S+ )*(python|bash|cd|grep) ", span.replace("\n", " "))]
    lines = [re.sub(r"\s#\s.*$", "", line) for line in lines]  # a comment, which may hold a ';'
    return [part.strip() for line in lines for part in re.split(r"&&|;|\|", line) if part.strip()]


def writes_into_bench_results(command):
    """Whether `command` can write into bench/results/: a redirection or a path option there, or a bench script
    whose --out default is there, called without --out."""
    argv = shlex.split(command, comments=True)
    while argv and re.match(r"\w+=", argv[0]):  # VAR=value before the command
        argv = argv[1:]
    for flag, value in zip(argv, argv[1:]):
        if (flag.startswith("--") or flag.startswith(">")) and value.startswith("bench/results"):
            return True
    if any(a.startswith(">bench/results") or a.startswith(">>bench/results") for a in argv):
        return True
    if len(argv) > 1 and argv[0].startswith("python") and os.path.isfile(os.path.join(ROOT, argv[1])) \
            and "--out" not in argv:  # not in the repository: the kit's grade.py, which writes nothing
        source = open(os.path.join(ROOT, argv[1])).read()
        if "runs_parser" in source:  # seeds.py, ablation.py: their --out is bench/runner.py's runs_parser's
            source = open(os.path.join(ROOT, "bench", "runner.py")).read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                    and getattr(node.args[0], "value", None) == "--out":
                default = [kw.value for kw in node.keywords if kw.arg == "default"]
                return bool(default) and "bench/results" in ast.get_source_segment(source, default[0])
    return False


def test_no_course_command_writes_into_bench_results():
    """Running the course leaves bench/results/ as it is: every bench command gets an --out under runs/."""
    assert writes_into_bench_results("K=1 python bench/seeds.py --seeds 0 --prefix runs/c --out bench/results/s.md")
    assert not writes_into_bench_results("K=1 python bench/seeds.py --seeds 0 --prefix runs/c")  # runs/ by default
    assert writes_into_bench_results("python bench/ablation.py --seeds 0 --out bench/results/ablation.md")
    assert writes_into_bench_results("python show_credit.py x.jsonl > bench/results/credit.txt")
    assert not writes_into_bench_results("python bench/seeds.py --seeds 0 --out runs/course_seeds.md")
    for page in PAGES:
        commands = shell_commands(open(os.path.join(ROOT, page)).read())
        assert any("bench/seeds.py" in c for c in commands) and any("bench/ablation.py" in c for c in commands)
        bad = [c for c in commands if writes_into_bench_results(c)]
        assert not bad, f"{page}: {bad}"



# ---- the kit catches the mistakes students make (course/mistakes.py), fast: in this process, on the kit's own tests

def kit_tests():
    """The kit's test functions (the test files make_exercises.py writes, each exec'd as a module): name -> function."""
    found = {}
    for path, keep in mx.TESTS.items():
        if os.path.basename(path) in ("conftest.py", "test_stage_copies.py"):
            continue
        module = types.ModuleType(f"kit_{os.path.basename(path)[:-3]}")
        module.__file__ = os.path.join(ROOT, path)
        exec(compile(mx.keep_only(open(os.path.join(ROOT, path)).read(), keep, mx.DROP), module.__file__, "exec"),
             module.__dict__)
        found.update({n: f for n, f in vars(module).items() if n.startswith("test_") and callable(f)})
    return found


KIT_TESTS = kit_tests()


def selected(exercise):
    """The kit's tests that `python grade.py -k CHECK` runs for an exercise (pytest's -k on one word: a substring of
    the test's name)."""
    return sorted(n for n in KIT_TESTS if CHECK[exercise].lower() in n.lower())


def planted_module(stage, source):
    module = types.ModuleType(f"planted_{stage}")
    module.__file__ = os.path.join(ROOT, f"{stage}.py")
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def run_here(name, stages, tmp_path):
    """Run the kit's test `name` on `stages` in this process -> None when it passed, the exception when it failed,
    'skip' when it needs a fixture built only by pytest (the real grade.py runs it: the slow test below)."""
    fn, kwargs = KIT_TESTS[name], {}
    for arg in inspect.signature(fn).parameters:
        if arg == "stages":
            kwargs[arg] = stages
        elif arg == "tokenizer":  # test_layout.py's fixture, built afresh (a test may change its chat template)
            texts = [m["content"] for m in stages["01_bc"].episode_messages(fn.__globals__["EPISODE"])]
            kwargs[arg] = stages["01_bc"].train_tiny_tokenizer(texts, 300)
        elif arg == "tmp_path":
            kwargs[arg] = tmp_path
        else:
            return "skip"
    try:
        fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of a test fails the grade
        return e
    return None


PLANTED = [(exercise, i) for exercise, mistakes in MISTAKES.MISTAKES.items() for i in range(len(mistakes))]


def test_every_exercise_has_mistakes_tests_and_a_hint():
    """Each exercise: at least two listed mistakes, at least two kit tests under its check (and one this file runs in
    process), which pass on the reference body; course/TEACHER.md gives it a hint and names each of its mistakes."""
    assert sorted(MISTAKES.MISTAKES) == sorted(CHECK)
    teacher = " ".join(open(os.path.join(ROOT, "course/TEACHER.md")).read().split())
    hints = teacher[teacher.index("### Hints and mistakes"):teacher.index("## Answer notes")]
    for n, stage, name, k in TABLE:
        exercise = f"{stage}.{name}"
        tests = selected(exercise)
        assert len(MISTAKES.MISTAKES[exercise]) >= 2 and len(tests) >= 2, (exercise, tests)
        assert re.search(rf"- \*\*{n}\. `{name}`\*\* \S", hints), f"no hint for exercise {n} ({exercise})"
        section = hints[hints.index(f"- **{n}. `{name}`**"):]
        section = section[:section.index("- **", 3)] if "- **" in section[3:] else section
        for what, *_ in MISTAKES.MISTAKES[exercise]:
            assert " ".join(what.split()) in section, f"TEACHER.md, exercise {n}: the mistake '{what}' is not listed"


@pytest.fixture(scope="module")
def reference_stages():
    return {s: load_module(f"{s}.py", f"reference_{s}") for s in STAGES}


@pytest.mark.parametrize("exercise", sorted(CHECK))
def test_the_kit_tests_of_each_exercise_pass_on_the_reference(exercise, reference_stages, tmp_path):
    ran = {n: run_here(n, reference_stages, tmp_path) for n in selected(exercise)}
    assert [n for n, r in ran.items() if r is None], f"{exercise}: no kit test ran in process ({ran})"
    assert not [n for n, r in ran.items() if r not in (None, "skip")], ran


@pytest.mark.parametrize("exercise, i", PLANTED, ids=[f"{e}-{i}" for e, i in PLANTED])
def test_each_listed_mistake_fails_the_kit(exercise, i, reference_stages, tmp_path):
    """The mistake planted into the reference body: some kit test of the exercise's check fails on it."""
    stage, name = exercise.split(".")
    what, old, new = MISTAKES.MISTAKES[exercise][i]
    source = MISTAKES.plant(open(os.path.join(ROOT, f"{stage}.py")).read(), name, old, new)
    stages = {**reference_stages, stage: planted_module(stage, source)}
    ran = {n: run_here(n, stages, tmp_path) for n in selected(exercise)}
    assert [n for n, r in ran.items() if r not in (None, "skip")], f"{exercise}: '{what}' passes every test: {ran}"


# ---- the week as written: the teacher's runs, then every experiment's commands in order, on toy budgets

def page_commands(text):
    """The whole command lines of a markdown text, in order: its ```bash blocks' lines (continuations joined) and the
    inline code spans outside them that start with `python`."""
    out = []
    for i, part in enumerate(re.split(r"```bash\n(.*?)```", text, flags=re.S)):
        if i % 2:
            out += [line for line in part.replace("\\\n", " ").splitlines() if line.strip()]
        else:
            out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", part)
                    if re.match(r"python \S+\.py", " ".join(span.split()))]
    return out


def toy(command, tmp):
    """A course command on toy budgets, with its runs/ under tmp: sampled collections of 4 episodes, not 300."""
    return command.replace("runs/", f"{tmp}/runs/").replace("--episodes 300", "--episodes 4")


@pytest.mark.slow
def test_the_course_runs_as_written_on_toy_budgets(tmp_path):
    """TEACHER.md's runs before the week, then each experiment of course.md in order - its ablation row
    (`--variants NAME`) and every command it gives - as a class runs them from the repository root, with SMOKE=1's
    budgets, one world, and runs/ in a temporary folder: each exits 0. (The exercises' side, session by session, is
    the kit's test above.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("RUN", "ENV", "ENV_KWARGS", "EVAL_WORLDS", "BASE", "K")}
    env.update(SMOKE="1", EVAL_WORLDS="0", BASE_CACHE=str(tmp_path / "base"), PYTHON=sys.executable, THREADS="1",
               OMP_NUM_THREADS="1")
    teacher = open(os.path.join(ROOT, "course/TEACHER.md")).read()
    before = page_commands(teacher[teacher.index("## Before the week"):teacher.index("## The five sessions")])
    before = [c for c in before if "bench/" in c]  # the runs (the kit: the test above)
    assert len(before) == 3
    text = open(os.path.join(ROOT, "docs/course.md")).read()
    text = text[text.index("### Session 1"):text.index("## Which differences mean something")]
    experiments = re.split(r"^\*\*(?=\d+\. )", text, flags=re.M)[1:]
    assert len(experiments) == 12
    commands, mine = list(before), os.path.exists(os.path.join(ROOT, "runs", "course0"))
    for exp in experiments:
        commands += [f"python bench/ablation.py --seeds 0 --prefix runs/course --variants {v} "
                     "--out runs/course_ablation.md" for v in re.findall(r"`--variants (\w+)`", exp)]
        commands += page_commands(exp)
    for command in commands:
        proc = subprocess.run(["bash", "-c", toy(command, tmp_path)], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert (tmp_path / "runs" / "course_ablation.md").exists() and (tmp_path / "runs" / "course_habit.md").exists()
    assert os.path.exists(os.path.join(ROOT, "runs", "course0")) == mine  # nothing written into the checkout
