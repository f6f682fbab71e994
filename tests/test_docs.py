"""The pages point at what exists: every relative link of README.md and docs/ names a file of the
repository (and, with #anchor, a heading of it), and every "<page>.md, '<section>'" reference in the code,
the scripts and the pages names a heading of that page; README's file table and reading order name functions that
exist."""
import ast
import glob
import json
import os
import re

from conftest import ROOT, load_module

PAGES = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))


def headings(page):
    """A page's headings, as written and as GitHub's anchors (lower case, punctuation dropped, '-' for spaces)."""
    names = [m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", open(os.path.join(ROOT, page)).read(), re.M)]
    return set(names), {re.sub(r"[^\w\- ]", "", n.lower()).replace(" ", "-") for n in names}


def test_every_link_names_a_file_and_heading_that_exist():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", open(os.path.join(ROOT, page)).read()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.exists(os.path.join(ROOT, path)), f"{page} links {target}: no such file"
            if anchor:
                assert anchor in headings(path)[1], f"{page} links {target}: no such heading in {path}"


def test_the_readme_file_table_and_reading_order_name_functions_that_exist():
    """README's 'The algorithm, file by file' and 'The order to read the files': each `file.py:name`, and each
    identifier after a `file.py` in a row or item (`parse_action`, ...), is a function or class of that file."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## The algorithm, file by file"):text.index("## A real language model")]
    defs = {}  # file -> the names of its functions and classes, each file parsed once
    defined = lambda f: defs.setdefault(f, {n.name for n in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read()))
                                            if isinstance(n, (ast.FunctionDef, ast.ClassDef))})
    missing, named = [], 0
    for line in re.split(r"\n(?=\||\d+\. )", section):  # a table row or a numbered item
        where = None
        for token in re.findall(r"`([^`]+)`", line):
            m = re.fullmatch(r"([\w/]+\.py)(?::(\w+))?", token)
            if m:
                where = m[1]
                names = [m[2]] if m[2] else []
            elif where and re.fullmatch(r"[a-z]+_[a-z_]+|[A-Z][a-z]+[A-Za-z]*", token):  # a function or class name
                names = [token]
            else:
                continue
            named += len(names)
            missing += [f"{where}:{n}" for n in names if n not in defined(where)]
    assert named >= 20 and not missing, (named, missing)


def test_every_named_section_exists():
    missing = []
    files = [f for pattern in ("*.py", "*.sh", "*.md", "*/*.py", "*/*.md", "*/*.sh")
             for f in glob.glob(pattern, root_dir=ROOT) if not f.startswith((".venv", "runs"))]
    for f in files:
        text = open(os.path.join(ROOT, f), errors="replace").read()
        for page, section in re.findall(r"((?:docs/|bench/results/)?\w+\.md)[,:]? '([^']+)'", text):
            path = page if page.startswith(("docs/", "bench/")) or page == "README.md" else f"docs/{page}"
            section = re.sub(r"\s*\n\s*#?\s*", " ", section)  # a name that wraps onto the next line
            if not os.path.exists(os.path.join(ROOT, path)) or section not in headings(path)[0]:
                missing.append(f"{f}: {page}, '{section}'")
    assert not missing, "sections named that do not exist:\n" + "\n".join(missing)


def docstring_commands():
    """(file, command) for each `python 0X_*.py ...` example in a stage's (or rerank.py's) docstring, lines joined
    and the shell variables the docstring sets (KW='...') put in."""
    import ast
    import shlex
    out = []
    for f in sorted(glob.glob("0[0-5]_*.py", root_dir=ROOT)) + ["rerank.py"]:
        doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, f)).read()))
        text = re.sub(r"\\\n\s*", " ", doc)
        env = dict(re.findall(r"^\s*(\w+)=('[^']*')", text, re.M))
        for line in re.findall(r"^\s*(python 0[0-5]_\w+\.py .*)$", text, re.M):
            for name, value in env.items():
                line = line.replace(f'"${name}"', value)
            out.append((f, shlex.split(line)))
    return out


def test_every_docstring_command_parses_and_writes_outside_its_inputs(stages):
    """The stages' example commands run as written: their flags parse (every check in parse_args), the
    environment ones run the default miniature (kitchen with its own defaults, run_all.sh's), and no --out lies
    inside an input (the stages refuse that: exit 2)."""
    commands = docstring_commands()
    assert {f for f, _ in commands} == {f"{s}.py" for s in ("00_pretrain", "01_bc", "02_collect", "03_critic",
                                                            "04_gae", "05_bppo", "rerank")}
    for f, argv in commands:
        stage = stages[argv[1][:-3]]
        args = stage.parse_args(argv[2:])
        if "--env-kwargs" in argv or argv[1] in ("00_pretrain.py", "02_collect.py"):
            assert (args.env, json.loads(args.env_kwargs)) == ("kitchen", {}), (f, argv)
        inputs = [v for k in ("policy", "model", "ref", "critic", "rerank") for v in [getattr(args, k, None)]
                  if isinstance(v, str) and v not in ("", "tiny", "expert")]
        assert not any(os.path.normpath(args.out).startswith(os.path.normpath(i) + os.sep) for i in inputs), (f, argv)


def test_one_default_world_every_stage_and_page():
    """run_all.sh's ENV default is every stage's --env default, and no page or --help calls the control world
    (household) the default."""
    import subprocess
    import sys
    default = re.search(r"^ENV=\$\{ENV:-(\w+)\}$", open(os.path.join(ROOT, "run_all.sh")).read(), re.M).group(1)
    assert default == "kitchen"
    for stage in ("00_pretrain", "02_collect"):
        usage = subprocess.run([sys.executable, f"{stage}.py", "--help"], cwd=ROOT, capture_output=True, text=True)
        assert re.search(r"--env ENV\s.*?\(default: (\w+)\)", usage.stdout, re.S).group(1) == default, stage
    for page in PAGES + ["course/TEACHER.md"]:
        text = " ".join(open(os.path.join(ROOT, page)).read().split())
        called = re.search(r"household`?\s*\(default|household[^.]{0,30}\bthe default\b|\bthe default (world|"
                           r"environment|env)\b[^.]{0,30}household", text, re.I)
        assert not called, (page, called and called.group(0))


def guide_lines(readme):
    """The printout lines the printout guide (docs/printout.md) quotes: its ```text blocks."""
    guide = readme
    return [line for block in re.findall(r"```text\n(.*?)```", guide, re.S) for line in block.splitlines()]


def quoted_fragments(line):
    """The literal text of a quoted printout line: its runs of three words or more between numbers, '...',
    punctuation, paths and the names a stage fills in (worlds, splits, sources, labels, verdicts): what a stage's
    f-string writes as it is."""
    names = (r"\b(?:kitchen|household|train|dev|seen|unseen|expert|self|policy_\d+|ok|invalid|repeat|format|harmful|"
             r"recoverable|correct|cpu|cuda|bppo|none|on|off|GAE on r_env)\b")
    parts = re.split(r"\S*/\S*|[-+]?\d[\d.,]*%?|\.\.\.|[=:;()|,]| {2,}|" + names, line)
    return [" ".join(p.split()) for p in parts if len(p.split()) >= 3]


def test_the_printout_guide_quotes_what_the_stages_print():
    sources = " ".join(" ".join(open(os.path.join(ROOT, f)).read().split()) for f in
                       glob.glob("0*.py", root_dir=ROOT) + ["critic_report.py", "plumbing.py", "rollout.py", "eto.py",
                                                            "qlass.py"])
    sources = re.sub(r"[\"']\s*f?[\"']", "", sources)  # "a " f"b": the implicit concatenation of two literals
    lines = guide_lines(open(os.path.join(ROOT, "docs", "printout.md")).read())
    assert len(lines) >= 20
    for line in lines:
        for fragment in quoted_fragments(line):
            assert fragment in sources, f"docs/printout.md quotes {line!r}: no stage prints {fragment!r}"
    made_up = quoted_fragments("epoch 3: train loss 0.12  greedy reproduces no replies at all")
    assert made_up == ["greedy reproduces no replies at all"] and made_up[0] not in sources  # the check can fail


def test_the_readme_is_read_in_one_sitting():
    """At most 200 lines, and the lesson opens README and lessons.md with the same paragraph."""
    readme, lessons = (open(os.path.join(ROOT, f)).read() for f in ("README.md", "docs/lessons.md"))
    assert len(readme.splitlines()) <= 200
    lesson = re.search(r"^\*\*The lesson\.\*\*.*?\n\n", readme, re.S | re.M)
    assert lesson and lesson[0] in lessons


def test_the_printout_ranges_read_the_lines_the_guide_quotes():
    """bench/printout_ranges.py gives the guide its ranges: each of its rows reads one line the guide quotes (a row
    that reads none would print 'not printed'; a line format the stages change breaks the row and this test)."""
    rows = load_module("bench/printout_ranges.py", "printout_ranges").ROWS
    lines = guide_lines(open(os.path.join(ROOT, "docs", "printout.md")).read())
    unread = [name for name, pattern in rows if not any(re.match(pattern, line) for line in lines)]
    assert not unread, unread


def test_the_printout_ranges_skip_the_projects_own_baselines(tmp_path):
    """RFT's 01 and the outcome-level PG's 05 print BC's and BPPO's lines; the guide's ranges are BC's, Q-Evolve's."""
    log = tmp_path / "run.log"
    log.write_text("== python 01_bc.py --data e.jsonl --out runs/r/policy_0\n"
                   "epoch 1: train loss 0.2  val loss 0.1000  greedy reproduces 80.0% of val replies, 25.0% of val "
                   "episodes\n"
                   "== python 01_bc.py --data e.jsonl --filter success --out runs/r/rft/policy_1\n"
                   "epoch 1: train loss 0.2  val loss 0.0100  greedy reproduces 99.0% of val replies, 90.0% of val "
                   "episodes\n"
                   "== python 05_bppo.py --data x --out runs/r/outcome/policy_1\n"
                   "epoch 1: loss +0.1  clip low 0.500 high 0.500  approx KL(old) 0.5  KL(ref) 0.5  mean ratio 1.5\n")
    found = load_module("bench/printout_ranges.py", "printout_ranges").ranges([log])
    assert found["01 per epoch: val loss, val replies %, val episodes % reproduced"] == [[0.1], [80.0], [25.0]]
    assert found["05 per epoch: clip low, clip high, KL(old), KL(ref), mean ratio"] is None


def test_the_printout_ranges_refuse_a_file_that_is_no_run_log(in_process):
    """A probe: bench/printout_ranges.py README.md printed a table of 'not printed' rows and exit 0."""
    proc = in_process(load_module("bench/printout_ranges.py", "printout_ranges"), "README.md", check=False)
    assert proc.returncode == 2 and proc.stderr == "error: README.md: not a log of bash run_all.sh (none of its " \
        "printouts' lines is in it)\n", proc.stderr


def test_every_results_file_cites_scripts_that_exist():
    """The first line of each table in bench/results/ and docs/img/ says how it was measured: every `python X.py` in
    it names a script of the current code (a script since moved or deleted is cited by name and commit, without
    `python`), and every `python X.py SUBCOMMAND` of bench/plots.py names one of its plots."""
    missing = []
    for f in sorted(glob.glob("bench/results/*.md", root_dir=ROOT) + glob.glob("docs/img/*.md", root_dir=ROOT)):
        line = open(os.path.join(ROOT, f)).readline()
        for script, rest in re.findall(r"\bpython3? (?:-m cProfile -o \S+ )?([\w/]+\.py)\b(.{0,20})", line):
            if not os.path.isfile(os.path.join(ROOT, script)):
                missing.append(f"{f}: {script}")
            elif script == "bench/plots.py" and rest.split()[:1] not in (["learning"], ["sweep"], ["efficiency"],
                                                                                 ["paper"]):
                missing.append(f"{f}: bench/plots.py {rest}")
    assert not missing, missing


def test_no_bench_script_writes_into_bench_results_by_default():
    """Every --out default of bench/ (and bench/speed/) lies under runs/ or docs/img/: a reference table in
    bench/results/ is replaced only when a command names it."""
    found = []
    for f in glob.glob("bench/**/*.py", root_dir=ROOT, recursive=True):
        source = open(os.path.join(ROOT, f)).read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                    and getattr(node.args[0], "value", None) == "--out":
                for kw in node.keywords:
                    if kw.arg == "default":
                        found.append((f, ast.get_source_segment(source, kw.value)))
    assert len(found) >= 5 and not [x for x in found if "bench/results" in x[1]], found


def test_the_writers_of_old_artifacts_are_named_only_while_a_shipped_file_needs_them():
    """plumbing.ARTIFACTS names the scripts whose tables, PNGs and measurement JSONs a stage may replace (owned): each
    is a script of the checkout, or a deleted one that a shipped file is still stamped with."""
    import plumbing
    shipped = [os.path.join(ROOT, f) for f in glob.glob("bench/results/*", root_dir=ROOT) +
               glob.glob("docs/img/*", root_dir=ROOT)]
    for kind in ("png", "table", "bench_json"):
        for writer in plumbing.ARTIFACTS[kind][1]:
            if os.path.isfile(os.path.join(ROOT, writer)):
                continue
            stamped = [f for f in shipped if f.endswith({"png": ".png", "table": ".md", "bench_json": ".json"}[kind])
                       and (plumbing.png_software(f) == plumbing.STAMP + writer if kind == "png" else
                            f"python {writer}" in plumbing.first_line(f) if kind == "table" else
                            (plumbing.read_json(f) or {}).get("stage") == writer)]
            assert stamped, f"ARTIFACTS[{kind!r}] names {writer}, which is gone and stamps no shipped file"
