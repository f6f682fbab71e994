"""bench/plots.py sweep: each method's point at a number of decisions is the mean (and std) over seeds of the runs'
iteration, each seed's value its mean over worlds."""
import pytest

from conftest import ROOT, load_module
from plumbing import png_software
from test_plot_learning import fake_run


def test_the_table_holds_each_methods_mean_and_std_over_seeds(tmp_path, in_process, monkeypatch):
    pytest.importorskip("matplotlib")
    sweep = load_module("bench/plots.py", "plots")
    monkeypatch.chdir(ROOT)
    for d, bc in ((1, 0.5), (3, 0.3)):
        for s, up in ((0, 0.1), (1, 0.3)):  # seed s: BC bc, every method bc + up at iteration 1, in one world
            run = tmp_path / f"d{d}-s{s}"
            for tag in ("", "outcome_", "rft_"):
                fake_run(run, [[bc, bc + up]], tag=tag)
    out = tmp_path / "sweep.png"
    in_process(sweep, "sweep", "--decisions", 1, 3, "--seeds", 0, 1, "--prefix", f"{tmp_path}/d{{D}}-s", "--splits",
               "seen", "--out", out)
    assert png_software(out) == "q-evolve bench/plots.py"
    rows = {line.split(" | ")[0][2:]: line for line in (tmp_path / "sweep.md").read_text().splitlines()
            if line.startswith("| ")}
    assert rows["BC"].endswith("| 50.0 +- 0.0 | 30.0 +- 0.0 |")
    assert rows["Q-Evolve iter 1"].endswith(f"| 70.0 +- {(2 * 0.1 ** 2) ** 0.5 * 100:.1f} | 50.0 +- 14.1 |")
    bad = in_process(sweep, "sweep", "--decisions", 2, "--prefix", f"{tmp_path}/d{{D}}-s", "--out", out, check=False)
    assert bad.returncode == 2 and "d2-s0/eval not found" in bad.stderr
