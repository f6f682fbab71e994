"""bench/gpu_lab.sh's dry run: the lab's script, end to end on a CPU (a one-layer tiny model, SMOKE's budgets,
two seeds, BC then Q-Evolve and the four baselines, --precision bf16), so that it runs at once when a GPU is lent."""
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
from transformers import LlamaConfig

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
from gpu_report import spread  # noqa: E402
from gpu_report import test_summary as summary_of  # noqa: E402  (not collected as a test under this name)

from plumbing import log_metrics  # noqa: E402


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
    assert spread([1.0, 2.0, 3.0], "{:.1f}") == "2.0 ± 1.0" and spread([0.5], "{:.2f}") == "0.50"


def _log_many(path, who):
    for i in range(40):
        log_metrics(path, {"who": who, "i": i})


def test_stages_running_at_once_lose_no_metrics(tmp_path):
    """The lab runs Q-Evolve and both baselines of one run at once, all appending to its metrics.jsonl: four
    writers, 40 records each, every record kept (read, add, write back would lose some without the lock)."""
    path = str(tmp_path / "metrics.jsonl")
    writers = [multiprocessing.get_context("fork").Process(target=_log_many, args=(path, w)) for w in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    records = [json.loads(line) for line in open(path)]
    assert sorted((r["who"], r["i"]) for r in records) == [(w, i) for w in range(4) for i in range(40)]


def _mps_stub(folder):
    """A stand-in for NVIDIA's MPS control program (no GPU here): it logs each call to $MPS_LOG and names a server."""
    stub = folder / "nvidia-cuda-mps-control"
    folder.mkdir(exist_ok=True)
    stub.write_text('#!/bin/sh\nif [ "$1" = -d ]; then echo "-d $CUDA_MPS_PIPE_DIRECTORY" >> "$MPS_LOG"; exit 0; fi\n'
                    'read -r cmd; echo "$cmd" >> "$MPS_LOG"; [ "$cmd" != get_server_list ] || echo 4242\n')
    stub.chmod(0o755)
    return stub


@pytest.mark.slow
def test_the_lab_runs_without_mps_where_a_cuda_program_fails_under_it(tmp_path):
    """MPS=1: the daemon starts, a first CUDA program under it fails (here a python that refuses the lab's probe), so
    the daemon is stopped before any run and the lab says it ran without MPS (the same python fails every run's start,
    which ends the lab right after)."""
    _mps_stub(tmp_path / "bin")
    python = tmp_path / "bin" / "python_without_mps"
    python.write_text(f'#!/bin/sh\ncase "$*" in *"512, 512"*|*"-- bash run_all.sh") exit 1 ;; esac\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "DRY": "1", "MPS": "1", "SEEDS": "0", "ENVS": "household", "LAB": str(tmp_path / "lab"),
           "MPS_LOG": str(tmp_path / "mps_calls"), "PYTHON": str(python),
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run(["bash", "bench/gpu_lab.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "no run got as far as its BC policy" in proc.stderr, proc.stderr  # the report
    assert not list((tmp_path / "tmp").glob("gpu_lab_*"))  # issue 94: the graph verdict's and MPS's folders stayed
    assert "MPS: off: a first CUDA program failed under MPS" in (tmp_path / "lab/mps.log").read_text()
    assert [c.split()[0] for c in open(env["MPS_LOG"]).read().splitlines()] == ["-d", "quit"]


@pytest.mark.slow
def test_gpu_lab_dry_run_writes_its_report(tmp_path):
    stub = _mps_stub(tmp_path / "bin")  # MPS=1
    smi = stub.parent / "nvidia-smi"  # and for nvidia-smi: one sample of the GPU's memory (MiB) and utilisation (%)
    smi.write_text('#!/bin/sh\necho "1536, 81559, 37"\n')
    smi.chmod(0o755)
    # CUDA_GRAPH=1: the lab times a decode step of SMOLLM2_DIR's shape (here a one-layer config) eager and from a CUDA
    # graph (on a CPU: no graph, the same step over the graph's buffers) and gives 02 --cuda-graph if that was faster
    LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path / "shape")
    env = {**os.environ, "DRY": "1", "K": "2", "LAB": str(tmp_path / "lab"), "OMP_NUM_THREADS": "1", "MPS": "1",
           "TESTS": "tests/test_precision.py::test_pick_device_on_cpu", "MPS_LOG": str(tmp_path / "mps_calls"),
           "PATH": f"{stub.parent}:{os.environ['PATH']}", "CUDA_GRAPH": "1", "SMOLLM2_DIR": str(tmp_path / "shape"),
           "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run(["bash", "bench/gpu_lab.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert not list((tmp_path / "tmp").glob("gpu_lab_*"))  # the daemon's pipe folder too (session 10)
    tmp_path = tmp_path / "lab"
    logs = "".join(p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs
    report = (tmp_path / "gpu_lab.md").read_text()
    assert report.startswith("Measured ") and f"`DRY=1 MPS=1 CUDA_GRAPH=1 K=2 TESTS={env['TESTS']} bash" in report
    # the daemon started with the lab's own pipe folder, asked for its server after a CUDA program, stopped at the end
    calls = open(env["MPS_LOG"]).read().splitlines()
    assert [c.split()[0] for c in calls] == ["-d", "get_server_list", "quit"] and "/gpu_lab_mps." in calls[0], calls
    assert f"**NVIDIA's MPS** (`{tmp_path}/mps.log`): on (server 4242)" in report
    assert (f"**The machine** (`{tmp_path}/machine.log`, each second, " in report
            and "memory in use peaked at 1.5 GB of 79.6 (every process" in report
            and "utilisation 37% on average" in report
            and re.search(r"runnable threads [\d.]+ on average, at most \d+, on \d+ CPU cores", report))
    graphs = "02 ran with CUDA graphs): decode step, batch 128, context 400, eager: " in report
    assert graphs or "02 ran eager: the CUDA-graph step was not faster): decode step, batch 128" in report
    collects = [line for log in tmp_path.glob("*.log") for line in log.read_text().splitlines()
                if line.startswith("== python 02_collect.py") and "--policy expert" not in line]  # (BC's demos)
    assert len(collects) > 10 and all(("--cuda-graph" in c) == graphs for c in collects), (graphs, collects)
    assert "**Tests**" in report and "1 passed, 0 failed" in report and "## kitchen: seeds 0, 1" in report
    steps = lambda *files: statistics.mean(sum(json.load(open(tmp_path / f"kitchen-s{seed}" / f))["env_steps"]
                                               for f in files) for seed in (0, 1))
    for policy, online in (("policy_0 (BC)", 0), ("policy_1 (Q-Evolve iter 1)", steps("iter_1/self.json")),
                           ("rft_policy_1 (iterated RFT iter 1)", steps("iter_1/self.json")),
                           ("outcome_policy_1 (outcome-level PG iter 1)", None), ("eto_policy_1 (ETO iter 1)", None),
                           ("policy_2 (Q-Evolve iter 2)", steps("iter_1/self.json", "iter_2/self.json")),
                           ("rft_policy_2 (iterated RFT iter 2)", None), ("outcome_policy_2 (outcome-level PG iter 2)",
                                                                          None),
                           ("eto_policy_2 (ETO iter 2)", steps("iter_1/self.json", "eto/iter_2/self.json")),
                           ("qlass_policy_1 (QLASS: BC and its QNet)", steps("qlass/trees.json"))):
        row = next(line for line in report.splitlines() if line.startswith(f"| {policy} |"))
        assert row.count("±") == 4, row  # success and reward on seen and unseen, mean ± std over the 2 seeds
        if online is not None:  # and its online environment steps to date, the mean over the seeds
            assert row.split("|")[-2].strip() == f"{online:,.0f}", (row, online)
    for stage in ("01_bc | 3 |", "03_critic | 2 |", "05_bppo | 4 |", "02_collect, greedy (evaluation)"):
        assert f"| {stage}" in report, stage  # 01: BC and RFT's two; 05: Q-Evolve's and the outcome-level PG's
    for what in ("sampled (train)", "greedy (evaluation)"):  # 02's peak memory too: on a CPU its resident set (on a
        peak = float(next(line for line in report.splitlines() if f"02_collect, {what}" in line).split("|")[5])
        assert peak > (-1 if torch.cuda.is_available() else 0.1)  # GPU the one-layer model's tensors: 0.0 GB)
    for seed in (0, 1):  # iteration by iteration: no algorithm's iteration 2 began before every iteration 1 ended
        run = tmp_path / f"kitchen-s{seed}"
        mtimes = lambda pattern: [f.stat().st_mtime for f in run.glob(pattern)]
        assert min(mtimes("**/iter_2/*")) >= max(mtimes("**/policy_1/*"))
        assert min(mtimes("eval/world*/*policy_2_*.json")) >= max(mtimes("eval/world*/*policy_1_*.json"))
        # the evaluations ran off the training's path, each policy's in its own launch: the training logs hold no
        # evaluation, and an evaluation log no training
        for log in tmp_path.glob(f"kitchen-s{seed}.*.log"):
            commands = [line for line in log.read_text().splitlines() if line.startswith("== python")]
            evaluations = [c for c in commands if "--greedy" in c or "--rerank" in c]  # (QLASS's: Q-guided)
            assert evaluations == commands if log.name.endswith(".eval.log") else not evaluations, (log, commands)
        assert "01_bc.py" in (tmp_path / f"kitchen-s{seed}.qevolve.it0.log").read_text()  # BC alone, first
        assert "policy_0 --env" in (tmp_path / f"kitchen-s{seed}.qevolve.it0.eval.log").read_text()
    # the dry run trained under bf16 autocast, saved fp32, and 05 moved every tensor of the policy
    for seed in (0, 1):
        moved = next(line for line in report.splitlines() if line.startswith(f"| kitchen-s{seed} | "))
        cells = [c.strip() for c in moved.split("|")[1:-1]]
        n_diff, n_all = cells[3].split(" of ")
        assert n_diff == n_all and cells[5] == "torch.float32" and float(cells[1]) > 0
        assert '"precision": "bf16"' in (tmp_path / f"kitchen-s{seed}" / "policy_1" / "args.json").read_text()
    # the report quotes the decode-step check and says which step 02 ran: three logs of a GPU's check
    steps = ["decode step, batch 128, context 400, eager: 70.1 ms (cuda, bf16)",
             "decode step, batch 128, context 400, cuda graph: 4.2 ms (cuda, bf16)"]
    slower = steps[1].replace("4.2", "80.5")

    def rewritten():  # the report, written again from the lab's files
        subprocess.run([sys.executable, "bench/gpu_report.py", "--lab", tmp_path, "--out", tmp_path / "gpu_lab.md"],
                       cwd=ROOT, check=True, capture_output=True)
        return (tmp_path / "gpu_lab.md").read_text()
    for lines, said in ((steps, "02 ran with CUDA graphs): " + "; ".join(steps)),
                        (steps[:1], "the CUDA-graph step failed"),
                        ([steps[0], slower], "the CUDA-graph step was not faster")):
        (tmp_path / "decode_step.log").write_text("\n".join(["a stamp line", *lines, "Traceback ..."]) + "\n")
        assert said in rewritten()
    # the machine's samples: the peak of GPU memory in use, the mean and the peak of utilisation and of runnable
    # threads; lines not a sample skipped
    (tmp_path / "machine.log").write_text("a stamp line\n1024, 81559, 10, 12\n3072, 81559, 50, 30\n"
                                          "[N/A], 81559, 7, 3\n2048, 81559, 30, 3\n")
    assert ("3 samples): GPU memory in use peaked at 3.0 GB of 79.6 (every process of the lab together); GPU "
            "utilisation 30% on average, at most 50% (the share of each second in which a kernel ran); runnable "
            f"threads 15.0 on average, at most 30, on {os.cpu_count()} CPU cores") in rewritten()
    # runs that DEADLINE stopped before Q-Evolve's evaluation: its trained policy keeps its row, with what finished
    for seed, said in ((0, "(1 of 2 seeds)"), (1, "| policy_1 (Q-Evolve iter 1) | - | - | - | - |")):
        for f in (tmp_path / f"kitchen-s{seed}" / "eval").glob("world*/policy_1_*"):
            f.unlink()
        assert said in rewritten()


@pytest.mark.slow
def test_an_interrupted_lab_stops_its_runs_and_leaves_no_temporary_folder(tmp_path):
    """Session 10's probes (Q7): Ctrl-C did not stop the lab (its runs are background jobs, which ignore SIGINT), and
    a lab stopped by TERM left its CUDA-graph verdict's folder in /tmp. Any end now stops every process it started and
    removes its temporary folders (finish)."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "DRY": "1", "SEEDS": "0", "ENVS": "household", "LAB": str(tmp_path / "lab"),
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    # SIGINT as a terminal's shell leaves it: a test run started in the background of a shell without job control
    # (`bash .ci/run &`) inherits it ignored, and bash cannot trap a signal ignored when it starts
    lab = subprocess.Popen(["bash", "bench/gpu_lab.sh"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                                               signal.SIG_DFL))
    try:
        for _ in range(600):  # its BC run has started (its log), the verdict's folder is there
            if list((tmp_path / "lab").glob("household-s0.qevolve.it0.log")) and list((tmp_path / "tmp").glob("*")):
                break
            time.sleep(0.5)
        assert list((tmp_path / "tmp").glob("gpu_lab_graph.*")), lab.stderr.read() if lab.poll() is not None else ""
        lab.send_signal(signal.SIGINT)
        assert lab.wait(timeout=60) == 130
    finally:
        lab.kill()
    time.sleep(2)
    assert not list((tmp_path / "tmp").glob("gpu_lab_*"))
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "lab") not in ps, [line for line in ps.splitlines() if str(tmp_path / "lab") in line]
