"""Issue 61: one write rule for the whole repository. Every file the project writes goes through plumbing.py's
output rule (check_out / owned / check_path) and its atomic write (write_atomic, save_text, or `python run_support.py
save` for a shell script). This scans every Python and shell file of the repository: a plain open(..., "w" / "a" /
"x"), a savefig, a Path.write_text / write_bytes or a shell `>` / `>>` into a file, anywhere outside plumbing.py, must
be on the allow-list below with the reason it keeps the rule."""
import ast
import os
import re
import subprocess
import sys

from conftest import ROOT

TMP = "inside write_atomic's temporary"
# (file, the line as written, stripped of its comment) -> why it keeps the rule
ALLOWED = {
    ("run_support.py", 'f = open(path, "w", encoding="utf-8")'):
        "open_log: bench/'s live run log, after check_out(run_log); stamped on its first line",
    ("course/make_exercises.py", 'with open(os.path.join(tmp, name), "w") as f:'): TMP,
    ("course/make_exercises.py",
     'with open(os.path.join(ROOT, name)) as f, open(os.path.join(tmp, name), "w") as g:'): TMP,
    ("models/smollm2.py", 'with open(os.path.join(tmp, "source.json"), "w") as f:'): TMP,
    ("show_credit.py", 'write_atomic(args.png, lambda tmp: fig.savefig(tmp, dpi=args.dpi, format="png",'):
        "write_atomic's temporary, after check_out(png); stamped",
    ("bench/runner.py", 'write_atomic(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png", metadata={"Software": '
                        'STAMP + writer}))'): "write_atomic's temporary, after check_out(png) (plots.py); stamped",
    ("envs/alfworld_env.py", 'with open(os.path.join(tmp, "traj_data.json"), "w") as f:'):
        "a game cache built in _common.build_dir_atomically's temporary (its own cache folder, never a user's path)",
    ("envs/alfworld_env.py", 'with open(game_path, "w") as f:'):
        "a game file inside the same temporary (build_dir_atomically)",
    ("bench/speed/train_memory.py", 'with open(adv, "w") as f:'):
        "an input buffer inside its own temporary folder (bench.runner.scratch), never a user's path",
    ("bench/gpu_lab.sh", 'echo "$c" > "$verdict.new" && mv "$verdict.new" "$verdict" ) &'):
        "the decode-step check's verdict, inside the lab's own mktemp folder, never a user's path",
    ("bench/gpu_lab.sh", 'done > "$use" ) &'):
        "the machine's samples, in the lab's own mktemp file; LAB/machine.log is saved from it (run_support.py save)",
}
# whole folders, with the reason
ALLOWED_DIRS = {"tests/": "the tests write their fixtures into pytest's tmp_path, never into a user's file"}
WRITE_MODE = re.compile(r"[wax+]")


def repo_files(ext):
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", f"*{ext}"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if os.path.isfile(os.path.join(ROOT, f))]


def python_writes(path):
    """(line number, line) of each plain write in a Python file."""
    src = open(os.path.join(ROOT, path), encoding="utf-8").read()
    lines = src.splitlines()
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if name == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                  None)
            writes = mode is not None and (not isinstance(mode, ast.Constant) or WRITE_MODE.search(str(mode.value)))
        else:
            writes = name in ("savefig", "write_text", "write_bytes")
        if writes:
            yield node.lineno, lines[node.lineno - 1].split("  # ")[0].strip()  # the line without its comment


REDIRECT = re.compile(r"(?<![<>&0-9])[0-9]*>>?(?!&)\s*([^\s;|&)]+)")
INLINE_OPEN = re.compile(r"open\([^)]*,\s*(mode=)?[\"'][^\"']*[wax+]")  # Python in a heredoc: open(p, "w")


def shell_writes(path):
    """(line number, line) of each `>` / `>>` into a file (not /dev/null, not another descriptor) in a shell file."""
    for n, line in enumerate(open(os.path.join(ROOT, path), encoding="utf-8"), 1):
        code = re.sub(r"(^|\s)#.*", "", line)  # a comment
        code = re.sub(r"\[\[.*?\]\]|\$\(\(.*?\)\)", "", code)  # tests and arithmetic: > compares there
        if any(target != "/dev/null" for target in REDIRECT.findall(code)) or INLINE_OPEN.search(code):
            yield n, line.strip()


def test_every_write_keeps_the_rule():
    py, sh = repo_files(".py"), repo_files(".sh")
    assert "plumbing.py" in py and "run_all.sh" in sh and "bench/gpu_lab.sh" in sh
    found = set()
    for path in py + sh:
        if path == "plumbing.py" or any(path.startswith(d) for d in ALLOWED_DIRS):
            continue
        for n, line in (python_writes if path.endswith(".py") else shell_writes)(path):
            found.add((path, line))
            assert (path, line) in ALLOWED, f"{path}:{n} writes outside plumbing's rule: {line}"
    assert not set(ALLOWED) - found, f"allow-list entries that no longer match a line: {set(ALLOWED) - found}"


def test_the_scan_sees_what_it_looks_for(tmp_path, monkeypatch):
    """The scanners themselves: each kind of write is found, a read or a redirect to a descriptor is not."""
    import test_write_rule as me
    monkeypatch.setattr(me, "ROOT", str(tmp_path))
    (tmp_path / "a.py").write_text('open(p, "w")\nopen(p)\nopen(p, mode="a")\nfig.savefig(p)\nopen(p, "rb")\n'
                                   "Path(p).write_text(t)\nopen(p, m)\n")
    assert [n for n, _ in python_writes("a.py")] == [1, 3, 4, 6, 7]
    (tmp_path / "a.sh").write_text('echo x > "$OUT"\necho y >&2\ncmd >/dev/null 2>&1\necho z >> log  # append\n'
                                   '# a comment > file\n[[ $a > $b ]]\nx=$((a > 1))\nwith open(p, "w") as f:\n')
    assert [n for n, _ in shell_writes("a.sh")] == [1, 4, 8]


def test_every_table_writer_owns_its_table():
    """A bench script that writes a table (check_out(..., "table"), or runner.table_out, which calls it) is one of
    plumbing's table writers: else its second run refuses the table its first run wrote (bench/speed/train_memory.py
    and model_throughput.py did)."""
    import plumbing
    writes = lambda text: '"table")' in text or "table_out(" in text
    writers = {os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "bench"))
               for f in fs if f.endswith(".py") and writes(open(os.path.join(d, f)).read())} - {"bench/runner.py"}
    assert writers and writers <= set(plumbing.ARTIFACTS["table"][1]), writers - set(plumbing.ARTIFACTS["table"][1])


def test_a_lock_file_merely_open_holds_nothing(tmp_path, monkeypatch):
    """QEVOLVE_LOCKED names folders whose lock the caller holds, so their runs skip the settings' checks (gpu_lab.sh).
    The lock file open on a descriptor (`3<RUN/.lock`), not locked, once passed for holding it: THREADS=5000 passed
    --check."""
    from filelock import FileLock

    import run_support
    (tmp_path / ".lock").write_text("")
    monkeypatch.setenv("QEVOLVE_LOCKED", str(tmp_path))
    with open(tmp_path / ".lock"):
        assert not run_support.holds(str(tmp_path)) and run_support.held_folders() == []
    with FileLock(str(tmp_path / ".lock")):
        assert run_support.holds(str(tmp_path)) and run_support.held_folders() == [str(tmp_path)]
    # session 10's probes (Q5): merely open while another process holds the lock (a run on it) holds nothing either
    hold = "import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); " \
           "print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with open(tmp_path / ".lock"):
            assert run_support.taken(str(tmp_path / ".lock")) and not run_support.holds(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()


def test_the_writable_check_changes_nothing(tmp_path):
    """check_writable on a RUN not made yet, and check_out on an output: its nearest existing folder as it was, times
    too (each makes and removes a folder there, which once left the folder's mtime changed: sessions 10 and 11)."""
    import run_support
    os.utime(tmp_path, ns=(10**18, 10**18))
    run_support.check_writable("RUN=x", str(tmp_path / "new" / "run"))
    assert os.listdir(tmp_path) == [] and os.stat(tmp_path).st_mtime_ns == 10**18
    run_support.check_out(str(tmp_path / "table.md"), "table")  # every output's probe too (session 11's probes)
    assert os.listdir(tmp_path) == [] and os.stat(tmp_path).st_mtime_ns == 10**18


def test_a_climb_out_of_no_folder_or_a_link_is_refused(tmp_path, capsys):
    """Session 11's probes (D, E): RUN=<empty>/sub/../../mine passed the checks (the OS cannot resolve it) while the
    writes (abspath: <tmp>/mine) went into a user's folder; plots.py --out <none>/../../<checkout>/docs/img/paper.png
    replaced a shipped figure. A '..' after a link is read two ways too."""
    import pytest

    import plumbing
    (tmp_path / "empty").mkdir()
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "er")  # link/.. is deep to the OS, tmp_path to abspath
    for bad, why in ((f"{tmp_path}/empty/sub/../../mine", f"'..' follows {tmp_path}/empty/sub, which is no folder"),
                     (f"{tmp_path}/link/../mine", "a '..' in it follows a link"),
                     (f"{tmp_path}/link/./../mine", "a '..' in it follows a link"),  # (the second campaign's G)
                     (f"{tmp_path}/link//../mine", "a '..' in it follows a link")):
        with pytest.raises(SystemExit) as e:
            plumbing.check_path(bad)
        assert e.value.code == 2 and why in capsys.readouterr().err
    plumbing.check_path(f"{tmp_path}/empty/../new")  # after a folder: the OS and abspath agree
    plumbing.check_path(f"{tmp_path}/link/new")  # a link without a '..' after it: read one way
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")  # the third round's I: refused after the work
    with pytest.raises(SystemExit):
        plumbing.check_out(f"{tmp_path}/dangling/x.jsonl", "02_collect")
    assert f"{tmp_path}/dangling is not a folder" in capsys.readouterr().err
