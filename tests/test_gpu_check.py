"""bench/gpu_check.sh's dry run: the GPU check's script, end to end on a CPU (the tiny model, SMOKE's
budgets, --precision bf16), so that it still runs when a GPU is at hand."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
from gpu_report import test_summary as summary_of  # noqa: E402  (not collected as a test under this name)


def test_the_report_counts_each_test_once(tmp_path):
    """A -v log (xdist's and plain lines): pytest's closing summary repeats each failure; counted once."""
    log = tmp_path / "tests.log"
    log.write_text("tests/test_a.py::test_x PASSED [ 33%]\n"
                   "[gw1] [ 66%] FAILED tests/test_b.py::test_y[01_bc] \n"
                   "[gw0] [100%] SKIPPED tests/test_c.py::test_z \n"
                   "=========================== short test summary info ============================\n"
                   "FAILED tests/test_b.py::test_y[01_bc] - RuntimeError: devices\n"
                   "=================== 1 failed, 1 passed, 1 skipped in 3.00s ====================\n")
    assert summary_of(str(log)) == "1 passed, 1 failed, 0 error, 1 skipped\n  - tests/test_b.py::test_y[01_bc]"
    assert summary_of(str(tmp_path / "none.log")) == "not run"


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_report(tmp_path):
    env = {**os.environ, "DRY": "1", "CHECK": str(tmp_path), "ENVS": "household", "OMP_NUM_THREADS": "1",
           "TESTS": "tests/test_precision.py::test_pick_device_on_cpu"}
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + (tmp_path / "household.log").read_text()
    report = (tmp_path / "gpu.md").read_text()
    assert "**Tests**" in report and "1 passed, 0 failed" in report
    for stage in ("01_bc", "03_critic", "05_bppo", "02_collect policy_1 seen"):
        assert f"| household | {stage}" in report, stage
    # the dry run trained under bf16 autocast, saved fp32, and 05 moved every tensor of the policy
    moved = next(line for line in report.splitlines() if line.startswith("| household | ") and "float" in line)
    cells = [c.strip() for c in moved.split("|")[1:-1]]
    n_diff, n_all = cells[4].split(" of ")
    assert n_diff == n_all and cells[6] == "torch.float32" and float(cells[2]) > 0
    assert '"precision": "bf16"' in (tmp_path / "household" / "policy_1" / "args.json").read_text()
    assert "policy_1 (Q-Evolve iter 1)" in report
