"""show_credit.py: the table shows the buffer's own numbers, the plot is written (and replaces only a PNG),
bad input exits 2."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, load_module

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step(action, obs, label, r_env, r_aux, v, adv, done=False, **extra):
    return {"text": f"Action: {action}" if action else "take it", "action": action, "obs": obs,
            "r_env": r_env, "label": label, "r_aux": r_aux, "done": done, "v": v, "adv": adv, **extra}


EPISODES = [
    {"env": "household", "task_id": "train/00001", "source": "self", "instruction": "Rules.",
     "task": "put a mug in shelf 1.", "obs0": "You are in the middle of a room.", "reward": 0.0, "success": False,
     "truncated": True, "steps": [
         step("go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed.", "ok", 0.0, 0.0, 0.8125, -0.0625),
         step("take mug 1 from cabinet 1", "Nothing happens.", "invalid", 0.0, -0.1, 0.7031, -0.3047),
         step("", "Invalid reply. End your reply with one line: Action: <command>", "format", 0.0, -0.2, 0.4219,
              0.0156),
         step("look", "Nothing happens.", "repeat", 0.0, -0.05, 0.3984, -0.0234)]},
    {"env": "household", "task_id": "train/00002", "source": "self", "instruction": "Rules.",
     "task": "put a cup in desk 1.", "obs0": "You are in the middle of a room.", "reward": 1.0, "success": True,
     "truncated": False, "steps": [
         step("go to desk 1", "You arrive at desk 1. On it, you see a cup 1.", "ok", 0.0, 0.0, 0.6875, 0.1250,
              q=0.7500),
         step("take cup 1 from desk 1", "You pick up the cup 1.", "ok", 0.0, 0.0, 0.8125, 0.0938, q=0.9062),
         step("put cup 1 in/on desk 1", "You put the cup 1 in/on the desk 1.", "ok", 1.0, 0.0, 0.9375, 0.0625,
              done=True, q=1.0)]},
]


@pytest.fixture
def show(in_process):
    """show(*args): show_credit.py's main() in this process -> returncode, stdout, stderr
    (test_png_without_matplotlib_is_one_line_and_exit_2 runs it as a real process)."""
    credit = load_module("show_credit.py", "show_credit")
    return lambda *args: in_process(credit, *args, check=False)


def show_as_a_user(*args, env=None):
    return subprocess.run([sys.executable, "show_credit.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture
def buffer(tmp_path):
    path = tmp_path / "adv.jsonl"
    path.write_text("".join(json.dumps(ep) + "\n" for ep in EPISODES))
    return path


def rows(stdout, n_steps):
    """The table's step rows, split into cells (numbers first, then reply and observation)."""
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("t "))
    return lines[head], [line.split() for line in lines[head + 2:head + 2 + n_steps]]


@pytest.mark.parametrize("how, index", [(["--index", 0], 0), (["--pick", "failure"], 0), (["--pick", "success"], 1),
                                        (["--task-id", "train/00002"], 1)])
def test_table_shows_the_buffers_values(show, buffer, how, index):
    proc = show(buffer, *how)
    assert proc.returncode == 0, proc.stderr
    ep = EPISODES[index]
    assert f"task {ep['task_id']}" in proc.stdout and ("success" if ep["success"] else "failure") in proc.stdout
    head, cells = rows(proc.stdout, len(ep["steps"]))
    has_q = "q" in ep["steps"][0]
    assert ("Q(s_t,a_t)" in head) == has_q
    for t, (s, row) in enumerate(zip(ep["steps"], cells)):
        assert int(row[0]) == t and row[1] == s["label"]
        numbers = [float(x) for x in row[2:7 if has_q else 6]]
        expected = [s["r_env"], s["r_aux"], s["v"]] + ([s["q"]] if has_q else []) + [s["adv"]]
        assert numbers == pytest.approx(expected, abs=5e-5)
        reply = s["action"] or repr(s["text"])
        assert reply in " ".join(row)
    if not has_q:
        assert "no 'q'" in proc.stdout


def test_png_is_written(show, buffer, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is optional (pip install -r requirements-plot.txt)")
    for pick in ("failure", "success"):
        png = tmp_path / f"{pick}.png"
        proc = show(buffer, "--pick", pick, "--png", png)
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adv.jsonl", "failure.png", "success.png"]
    old = (tmp_path / "success.png").read_bytes()  # an existing PNG (an earlier plot) is replaced
    proc = show(buffer, "--pick", "failure", "--png", tmp_path / "success.png")
    assert proc.returncode == 0, proc.stderr
    new = (tmp_path / "success.png").read_bytes()
    assert new[:8] == PNG_SIGNATURE and new != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adv.jsonl", "failure.png", "success.png"]


def test_png_never_replaces_another_file(show, buffer, tmp_path):
    """--png names a new .png or an existing PNG: never the buffer, a model's weights, a text file, a directory
    (each refused with one line before any work, the file unchanged)."""
    pytest.importorskip("matplotlib", reason="matplotlib is optional (pip install -r requirements-plot.txt)")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "notes.png").write_text("not a picture\n")  # the right name, not a PNG
    (tmp_path / "weights.png").write_bytes(weights.read_bytes())
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "link.png").symlink_to(buffer)  # a link to the buffer is the buffer
    (tmp_path / "dangling.png").symlink_to(tmp_path / "nowhere")
    buffer_png = tmp_path / "buffer.png"  # a buffer whose name ends in .png
    buffer_png.write_text(buffer.read_text())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    names = sorted(os.listdir(tmp_path))
    cases = [(buffer, buffer), (buffer, weights), (buffer, tmp_path / "notes.txt"), (buffer, tmp_path / "notes.png"),
             (buffer, tmp_path / "weights.png"), (buffer, tmp_path / "dir.png"), (buffer, tmp_path / "link.png"),
             (buffer, tmp_path / "dangling.png"), (buffer_png, buffer_png)]
    for buf, png in cases:
        proc = show(buf, "--index", 0, "--png", png)
        assert proc.returncode == 2 and proc.stdout == "", (png, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, (png, proc.stderr)
    assert sorted(os.listdir(tmp_path)) == names
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_png_never_replaces_a_picture_it_did_not_write(show, buffer, tmp_path):
    """Issue 52: a PNG is replaced only when this project wrote it (the Software text chunk it stamps)."""
    matplotlib = pytest.importorskip("matplotlib",
                                     reason="matplotlib is optional (pip install -r requirements-plot.txt)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    theirs = tmp_path / "holiday.png"
    plt.figure(figsize=(1, 1)).savefig(theirs)  # matplotlib's own Software text: not this project's stamp
    plt.close("all")
    before = theirs.read_bytes()
    proc = show(buffer, "--index", 0, "--png", theirs)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert "is not a PNG written by this project" in proc.stderr
    assert theirs.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["adv.jsonl", "holiday.png"]


def test_png_without_matplotlib_is_one_line_and_exit_2(buffer, tmp_path):
    """A sitecustomize that hides matplotlib, whether or not it is installed. A real process: the contract
    (exit 2, one line, no traceback) as a user sees it."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    png = tmp_path / "x.png"
    proc = show_as_a_user(buffer, "--index", 0, "--png", png, env={"PYTHONPATH": str(tmp_path / "hide")})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "requirements-plot.txt" in proc.stderr
    assert not png.exists()


def test_bad_input_exits_2_with_one_line(show, buffer, tmp_path):
    not_04 = tmp_path / "self.jsonl"  # an 02 buffer: no v / adv
    not_04.write_text(json.dumps({**EPISODES[0], "steps": [{k: v for k, v in s.items() if k not in ("v", "adv")}
                                                           for s in EPISODES[0]["steps"]]}) + "\n")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("{not json\n")
    only_failures = tmp_path / "failures.jsonl"
    only_failures.write_text(json.dumps(EPISODES[0]) + "\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps(EPISODES[0]).replace("mug", "m\u00fcg").encode("latin-1") + b"\n")
    bad_label = tmp_path / "bad_label.jsonl"
    bad_label.write_text(json.dumps({**EPISODES[0], "steps": [{**EPISODES[0]["steps"][0], "label": None}]}) + "\n")
    deep = tmp_path / "deep.jsonl"  # issue 52: a RecursionError, not one line
    deep.write_text("[" * 10**6 + "]" * 10**6 + "\n")
    odd = {}  # issue 83: a TypeError, not one line
    for name, change in (("env_list", {"env": ["kitchen"]}), ("obs0_null", {"obs0": None}),
                         ("reward_string", {"reward": "1"})):
        odd[name] = tmp_path / f"{name}.jsonl"
        odd[name].write_text(json.dumps({**EPISODES[0], **change}) + "\n")
    png = tmp_path / "out.png"
    cases = [
        [deep, "--index", 0],
        [buffer, "--index", 0, "--dpi", 100000],  # issue 52: a picture of 10^10 x 10^10 pixels

        [tmp_path / "missing.jsonl", "--index", 0],
        [buffer, "--index", 2],
        [buffer, "--index", -1],
        [buffer, "--task-id", "train/99999"],
        [buffer, "--task-id", "train/00001", "--source", "expert"],
        [only_failures, "--pick", "success"],
        [not_04, "--index", 0],
        [garbage, "--index", 0],
        [binary, "--index", 0],
        [latin1, "--index", 0],
        [bad_label, "--index", 0],
        *[[path, "--index", 0] for path in odd.values()],
        [tmp_path, "--index", 0],  # a directory
        [buffer],  # no episode chosen
        [buffer, "--index", 0, "--pick", "success"],
        [buffer, "--index", 0, "--png", tmp_path / "no_dir" / "x.png"],
    ]
    before = sorted(os.listdir(tmp_path))
    for args in cases:
        proc = show(*args, "--png", png) if "--png" not in args else show(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert proc.stdout == "", args
        if args[1:] == ["--pick", "success"]:  # the smoke run's case: its self episodes all fail (without --png,
            assert "try --source any" in show(*args).stderr  # which needs matplotlib first)
    assert sorted(os.listdir(tmp_path)) == before


def test_help(show):
    proc = show("--help")
    assert proc.returncode == 0
    for flag in ("--index", "--task-id", "--pick", "--source", "--png"):
        assert flag in proc.stdout


def test_a_flaw_is_marked_by_its_kind_and_the_legend_says_why_its_credit_is_small():
    """kitchen: a flawed tool (put back, one step lost) is 'recoverable', a flawed ingredient 'harmful'; the note
    under the table says why the first gets little credit and how lambda spreads blame backwards."""
    import argparse
    credit = load_module("show_credit.py", "show_credit")
    step = lambda action, obs: {"text": f"Action: {action}", "action": action, "obs": obs, "r_env": 0.0,
                                "label": "ok", "r_aux": 0.0, "v": 0.5, "q": 0.5, "adv": 0.0}
    ep = {"env": "kitchen", "task_id": "train/00001", "source": "self", "task": "make a stew.", "success": False,
          "reward": 0.0, "obs0": "You are in the kitchen. Next: bowl. You see dirty bowl 1 and bowl 2.",
          "steps": [step("use bowl 1", "The dirty bowl 1 is no use; you put it back. Next: bowl. You see dirty bowl "
                         "1 and bowl 2."), step("use bowl 2", "You use the bowl 2. Next: egg. You see rotten egg 1 "
                                                "and egg 2."), step("use egg 1", "You add the rotten egg 1. It "
                                                                    "smells bad. The stew is ruined.")]}
    assert credit.harmful(ep) == {0: "recoverable", 2: "harmful"}
    text = credit.table(ep, 0, argparse.Namespace(buffer="b.jsonl", width=60))
    rows = text.splitlines()[6:9]
    assert rows[0].endswith("<- recoverable") and not rows[1].endswith("ful") and rows[2].endswith("<- harmful")
    assert "one discounted step" in text and "spreads blame backwards" in text


def test_png_never_writes_into_the_checkout(buffer, tmp_path):
    """Issue 94: --png docs/img/credit_kitchen.png replaced the checkout's own figure (this script stamped it); the
    refusal made matplotlib's config folder in the home first. Then --png docs/img/new.png added a file to the
    checkout's folders: refused too, as is one at its top (RUN's rule, plumbing.in_checkout)."""
    pytest.importorskip("matplotlib", reason="matplotlib is optional (pip install -r requirements-plot.txt)")
    figure = os.path.join(ROOT, "docs/img/credit_kitchen.png")
    before = open(figure, "rb").read()
    (tmp_path / "home").mkdir()
    for out in (figure, os.path.join(ROOT, "docs/img/new.png"), os.path.join(ROOT, "new.png")):
        proc = show_as_a_user(buffer, "--index", 0, "--png", out, env={"HOME": str(tmp_path / "home")})
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "in one of its folders" in proc.stderr and (out == figure or not os.path.exists(out))
    assert open(figure, "rb").read() == before and os.listdir(tmp_path / "home") == []


def test_png_leaves_matplotlib_in_the_projects_cache(buffer, tmp_path):
    """Issue 94: a plot made matplotlib's config and font cache in the home (~/.config/matplotlib, ~/.cache/matplotlib).
    They now go into the project's cache folder ($QEVOLVE_CACHE, else ~/.cache/qevolve), as the games do."""
    pytest.importorskip("matplotlib", reason="matplotlib is optional (pip install -r requirements-plot.txt)")
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    env.update(HOME=str(tmp_path / "home"), QEVOLVE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    for command in (["show_credit.py", buffer, "--index", "0", "--png", tmp_path / "credit.png"],
                    ["-c", "import bench.runner; bench.runner.pyplot().figure()"]):  # bench/plots.py's pyplot
        proc = subprocess.run([sys.executable, *map(str, command)], cwd=ROOT, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        assert os.listdir(tmp_path / "home") == [] and os.listdir(tmp_path / "cache") == ["matplotlib"]
    assert (tmp_path / "credit.png").stat().st_size > 0
