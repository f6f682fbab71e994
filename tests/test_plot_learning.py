"""bench/plots.py learning: the learning curve is each iteration's success, the mean over the run's worlds."""
import json
import os

import pytest

from conftest import ROOT, load_module
from plumbing import png_software

plot = load_module("bench/plots.py", "plots")


def fake_run(run, rates, tag=""):
    """rates[world][k]: <tag>policy_k's success on `seen` in that world (policy_0: BC, without the tag)."""
    for w, per_k in enumerate(rates):
        os.makedirs(run / "eval" / f"world{w}", exist_ok=True)
        for k, r in enumerate(per_k):
            name = f"{tag if k else ''}policy_{k}_seen.json"
            json.dump({"success_rate": r}, open(run / "eval" / f"world{w}" / name, "w"))


def test_curve_is_the_mean_over_worlds_up_to_the_last_complete_iteration(tmp_path):
    fake_run(tmp_path / "s0", [[0.5, 0.7, 0.8], [0.3, 0.5]])  # world 1 lacks policy_2
    curve, n_worlds = plot.curve(str(tmp_path / "s0"), "seen")
    assert curve == pytest.approx([40.0, 60.0]) and n_worlds == 2
    assert plot.curve(str(tmp_path / "s0"), "unseen")[0] == []
    fake_run(tmp_path / "s0", [[0.5, 0.1], [0.3, 0.3]], tag="outcome_")  # a baseline: BC, then its own iterations
    assert plot.curve(str(tmp_path / "s0"), "seen", "outcome_")[0] == pytest.approx([40.0, 20.0])


def test_writes_a_png(tmp_path, in_process, monkeypatch):
    """The script's main() in this process, from the repository root as its defaults expect."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(ROOT)
    fake_run(tmp_path / "s0", [[0.5, 0.7]])
    fake_run(tmp_path / "s1", [[0.4, 0.6]])
    out = tmp_path / "curve.png"
    proc = in_process(plot, "learning", "--seeds", 0, 1, "--prefix", tmp_path / "s", "--splits", "seen", "--out", out,
                      check=False)
    assert proc.returncode == 0, proc.stderr
    assert png_software(out) == "q-evolve bench/plots.py"  # its stamp: a rerun may replace it
    in_process(plot, "learning", "--seeds", 0, 1, "--prefix", tmp_path / "s", "--splits", "seen", "--out",
               out)  # check=True
    bad = in_process(plot, "learning", "--prefix", tmp_path / "none", "--out", out, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")
    notes = tmp_path / "notes.png"  # a file that only looks like a PNG by its name: never overwritten
    notes.write_text("my notes")
    kept = in_process(plot, "learning", "--seeds", 0, "--prefix", tmp_path / "s", "--splits", "seen", "--out", notes,
                      check=False)
    assert kept.returncode == 2 and notes.read_text() == "my notes"
    photo = tmp_path / "photo.png"  # issue 61: a real PNG that is not this project's (no stamp) is kept too
    photo.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0\0\0\rIHDR" + bytes(17) + b"\0\0\0\0IEND\xaeB`\x82")
    before = photo.read_bytes()
    kept = in_process(plot, "learning", "--seeds", 0, "--prefix", tmp_path / "s", "--splits", "seen", "--out", photo,
                      check=False)
    assert kept.returncode == 2 and photo.read_bytes() == before and "not a PNG written by this project" in kept.stderr


def test_efficiency_steps_to_90_percent_and_their_ratio_by_hand(tmp_path, in_process, monkeypatch):
    """bench/plots.py efficiency: a method's online steps are its self-collections' env_steps up to policy_k
    (iteration 1's shared); per seed, the fewest steps of a point at or above 90% of the optimum; and Q-Evolve's steps
    over the outcome-level PG's, per seed and as mean +- standard error."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(ROOT)
    for s, late in ((0, False), (1, True)):  # seed 1: the outcome-level PG reaches 90% only at its iteration 2
        run = tmp_path / f"run{s}"
        for folder, steps in (("iter_1", 100), ("iter_2", 120), ("outcome/iter_2", 80), ("rft/iter_2", 90)):
            os.makedirs(run / folder)
            json.dump({"env_steps": steps}, open(run / folder / "self.json", "w"))
        json.dump({"N_SELF": "20", "ENV_KWARGS": "{}"}, open(run / "settings.json", "w"))
        fake_run(run, [[0.5, 0.95, 0.95]])
        fake_run(run, [[0.5, 0.5 if late else 0.95, 0.95]], tag="outcome_")
        fake_run(run, [[0.5, 0.5, 0.5]], tag="rft_")
    best = plot.optimum(str(tmp_path / "run0"), "seen")
    assert 85.0 < best < 95.0  # kitchen's seen tasks without an outage: 0.95 is above 90% of it, 0.5 below
    out = tmp_path / "e.png"
    in_process(plot, "efficiency", "--runs", f"{tmp_path}/run{{seed}}", "--seeds", 0, 1, "--splits", "seen",
               "--out", out)
    lines = (tmp_path / "e.md").read_text().splitlines()
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in lines if line.startswith("| ")}
    assert rows["Q-Evolve", "seen"].endswith("| 100 | 100 | 100 (2) |")
    assert rows["outcome-level PG", "seen"].endswith("| 100 | 180 | 140 (2) |")  # seed 1: 100 + its own 80
    assert rows["iterated RFT", "seen"].endswith("| >190 | >190 | - (0) |")
    ratio = (1.0 + 100 / 180) / 2, abs(1.0 - 100 / 180) / 2  # mean, std / sqrt(2) of two values
    want = f"| 1.00 | 0.56 | {ratio[0]:.2f} +- {ratio[1]:.2f} (2) |"
    assert rows["Q-Evolve / outcome-level PG", "seen"].endswith(want)


def test_paper_table_online_steps_paired_intervals_and_mistakes_by_hand(tmp_path, in_process, monkeypatch):
    """bench/plots.py paper: each policy's online steps from what it wrote (its own episodes; QLASS's trees), success
    with a 95% t-interval over seeds, Q-Evolve's paired gaps ('shown' where the interval excludes 0), and the flawed
    items the greedy evaluation took, ingredients and tools apart."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(ROOT)
    offer = "Next: egg. You see rotten egg 1 and egg 2."
    for s, gain in enumerate((10, 12, 14)):  # Q-Evolve beats ETO by 10, 12, 14 points: mean 12, sd 2
        run = tmp_path / f"run{s}"
        for folder, steps in (("iter_1", 100), ("iter_2", 120), ("eto/iter_2", 80)):
            os.makedirs(run / folder)
            json.dump({"env_steps": steps}, open(run / folder / "self.json", "w"))
        os.makedirs(run / "qlass")
        json.dump({"env_steps": 1000 + s}, open(run / "qlass" / "trees.json", "w"))
        json.dump({"ENV_KWARGS": "{}"}, open(run / "settings.json", "w"))
        fake_run(run, [[0.5, 0.8, 0.9]])
        fake_run(run, [[0.5, 0.8 - gain / 100, 0.9 - gain / 100]], tag="eto_")
        fake_run(run, [[0.5, 0.6]], tag="qlass_")
        for tag, k in (("", 0), ("", 1), ("", 2), ("eto_", 1), ("eto_", 2), ("qlass_", 1)):  # the episodes read
            steps = [{"action": "use egg 1", "obs": "You add the rotten egg 1. It smells bad."},  # harmful
                     {"action": "use bowl 2", "obs": "x"}] if k else [{"action": "use egg 2", "obs": "x"}]
            with open(run / "eval" / "world0" / f"{tag if k else ''}policy_{k}_seen.jsonl", "w") as f:
                f.write(json.dumps({"obs0": offer, "steps": steps}) + "\n")
        cheap = tmp_path / f"cheap{s}"  # a second budget of the same regime: 30 own steps, then 65% (> QLASS's 60)
        os.makedirs(cheap / "iter_1")
        json.dump({"env_steps": 30}, open(cheap / "iter_1" / "self.json", "w"))
        json.dump({"ENV_KWARGS": "{}"}, open(cheap / "settings.json", "w"))
        fake_run(cheap, [[0.5, 0.65]])
        for k in (0, 1):
            with open(cheap / "eval" / "world0" / f"policy_{k}_seen.jsonl", "w") as f:
                f.write(json.dumps({"obs0": offer, "steps": [{"action": "use egg 2", "obs": "x"}]}) + "\n")
    out = tmp_path / "p.png"
    in_process(plot, "paper", "--runs", f"{tmp_path}/run{{seed}}", f"{tmp_path}/cheap{{seed}}", "--seeds", 0, 1, 2,
               "--splits", "seen", "--out", out)
    lines = (tmp_path / "p.md").read_text().splitlines()
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in lines if line.startswith("| ")}
    assert rows["BC", "0"].startswith("| BC | 0 | 0 | 50.0 [50.0, 50.0] | 0.0 |")
    assert rows["Q-Evolve", "2"].startswith("| Q-Evolve | 2 | 220 | 90.0 [90.0, 90.0] | 100.0 |")  # 1 of 1 egg
    assert rows["ETO", "2"].startswith("| ETO | 2 | 180 | 78.0 [73.0, 83.0] |")  # 100 + its own 80; 4.303 * 2 / 3**.5
    assert rows["QLASS", "1"].startswith("| QLASS | 1 | 1001 | 60.0 [60.0, 60.0] |")
    assert rows["2", "ETO iteration 2"] == "| 2 | ETO iteration 2 | +12.0 [+7.0, +17.0] shown |"
    assert rows["1", "QLASS"].endswith("| +20.0 [+20.0, +20.0] shown |")
    assert rows["0", "60.0"] == "| 0 | 60.0 | 1000 | 30 | 0.03 |"  # the claim over both budgets: the cheap runs
    assert rows["ETO", ">180"] == "| ETO | >180 | >180 | >180 | - |"  # 90% of the optimum: above every fake point
    assert not any(k[0] == "iterated RFT" for k in rows)  # a method the runs lack has no row
    # --against-first (tuning): each method's later runs against its first runs', paired by seed, at the iterations
    # both have: Q-Evolve's cheap runs 65 against 80 after one iteration; ETO has no later runs
    in_process(plot, "paper", "--runs", f"{tmp_path}/run{{seed}}", f"{tmp_path}/cheap{{seed}}", "--seeds", 0, 1, 2,
               "--splits", "seen", "--against-first", "--out", out)
    paired = [line for line in (tmp_path / "p.md").read_text().splitlines() if "{seed} minus " in line]
    assert paired == [f"| Q-Evolve | {tmp_path}/cheap{{seed}} minus {tmp_path}/run{{seed}} | 1 | -15.0 [-15.0, -15.0] "
                      "shown |"]


def test_out_never_replaces_another_scripts_figure_of_the_checkout(in_process):
    """Issue 94 (probe 3 of session 8): plots.py learning --out docs/img/credit_kitchen.png replaced show_credit.py's
    figure, and paper --out docs/img/efficiency.png another plot's. A shipped figure is replaced only by the plot
    whose default --out it is, or whose table beside it names that plot's command."""
    figures = {f: open(os.path.join(ROOT, "docs/img", f), "rb").read() for f in ("credit_kitchen.png",
                                                                                   "efficiency.png")}
    img = os.path.join(ROOT, "docs/img")
    for args in (["learning", "--out", os.path.join(img, "credit_kitchen.png")],
                 ["paper", "--runs", "runs/none{seed}", "--out", os.path.join(img, "efficiency.png")]):
        proc = in_process(plot, *args, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "is a figure the checkout ships that `plots.py" in proc.stderr, proc.stderr
    assert all(open(os.path.join(img, f), "rb").read() == b for f, b in figures.items())
    assert plot.ours(os.path.join(img, "paper.png"), "paper", "docs/img/paper.png")
    assert plot.ours(os.path.join(img, "tuning_dev.png"), "paper", "docs/img/paper.png")  # its table names paper
    assert not plot.ours(os.path.join(img, "sweep.png"), "paper", "docs/img/paper.png")


def test_a_bench_table_never_replaces_another_scripts_shipped_table(in_process, tmp_path):
    """Session 10's probes: bench/seeds.py --out bench/results/stage_times.md (or docs/img/edges_dev.md) replaced
    another script's shipped table, as would plots.py paper's table beside a new figure. A table the checkout ships is
    replaced only by the script its first line names (runner.shipped_by)."""
    tables = ["bench/results/stage_times.md", "docs/img/edges_dev.md", "bench/results/kitchen_seeds.md"]
    before = {t: open(os.path.join(ROOT, t), "rb").read() for t in tables}
    seeds = load_module("bench/seeds.py", "seeds")
    os.makedirs(tmp_path / "run0" / "data")
    os.makedirs(tmp_path / "run0" / "eval")
    (tmp_path / "run0" / "data" / "expert.jsonl").write_text("")  # a run as --table-only's check sees one
    try:
        for t in tables[:2]:
            proc = in_process(seeds, "--table-only", "--seeds", 0, "--prefix", tmp_path / "run", "--out", t,
                              check=False)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
            assert f"--out {t} is a table the checkout ships that bench/seeds.py did not make" in proc.stderr
        proc = in_process(plot, "paper", "--runs", "runs/none{seed}", "--out", "bench/results/kitchen_seeds.png",
                          check=False)
        assert proc.returncode == 2 and "kitchen_seeds.md is one the checkout ships that `plots.py paper` did not " \
                                       "make" in proc.stderr, proc.stderr
        assert all(open(os.path.join(ROOT, t), "rb").read() == b for t, b in before.items())
    finally:  # (a failing check must not leave the shipped tables changed)
        for t, b in before.items():
            open(os.path.join(ROOT, t), "wb").write(b)
    assert not os.path.exists(os.path.join(ROOT, "bench/results/kitchen_seeds.png"))
    runner = load_module("bench/runner.py", "bench_runner")
    assert runner.shipped_by(os.path.join(ROOT, tables[2]), "bench/seeds.py")  # its own: the script may rerun it
    assert not runner.shipped_by(os.path.join(ROOT, tables[2]), "bench/ablation.py")
    assert runner.shipped_by(str(tmp_path / "t.md"), "bench/ablation.py")  # not the checkout's
