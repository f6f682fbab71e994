"""The whole chain end to end on the smallest budgets, and resuming after an interruption."""
import json
import os
import subprocess
import sys

from conftest import ROOT

TINY = {
    "K": "1", "N_EXPERT": "16", "N_SELF": "6", "N_EVAL": "4", "THREADS": "1",
    "ENV_KWARGS": '{"max_steps": 5}',
    "PRETRAIN_ARGS": "--episodes 16 --epochs 1 --d-model 32 --n-layers 1 --n-heads 2 --vocab-size 400",
    "BC_ARGS": "--epochs 1",
    "COLLECT_ARGS": "--max-new-tokens 16 --num-envs 6",
    "CRITIC_ARGS": "--epochs 1", "BPPO_ARGS": "--epochs 1",
}


def run_all(run_dir):
    env = {**os.environ, **TINY, "RUN": str(run_dir), "BASE_CACHE": str(run_dir.parent / "base"),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_run_all_end_to_end_then_resume(tmp_path):
    run = tmp_path / "a run"  # a space in RUN: run_all.sh quotes every path
    out = run_all(run)
    bases = list((tmp_path / "base").iterdir())  # the pretrained base, cached outside the run
    assert len(bases) == 1 and (bases[0] / "model.safetensors").exists()
    assert json.load(open(run / "policy_0" / "args.json"))["model"] == str(bases[0])
    for artifact in ["data/expert.jsonl", "policy_0/model.safetensors", "iter_1/self.jsonl",
                     "iter_1/critic/heads.safetensors", "iter_1/adv.jsonl", "policy_1/model.safetensors",
                     "eval/policy_1_unseen.json", "results.md", "metrics.jsonl"]:
        assert (run / artifact).exists(), artifact
    # Every step of the advantage buffer carries v and adv; the table has one row per policy.
    adv = [json.loads(line) for line in open(run / "iter_1/adv.jsonl")]
    assert all("v" in s and "adv" in s for ep in adv for s in ep["steps"])
    assert {ep["source"] for ep in adv} == {"expert", "self"}
    table = (run / "results.md").read_text()
    assert "policy_0 (BC)" in table and "policy_1 (Q-Evolve iter 1)" in table
    stages_logged = {json.loads(line)["stage"] for line in open(run / "metrics.jsonl")}
    assert stages_logged == {"01_bc", "02_collect", "03_critic", "04_gae", "05_bppo"}
    assert "Results:" in out

    # Resume: delete only the last artifact; the rerun redoes that stage and nothing else.
    mtimes = {p: os.path.getmtime(p) for p in run.rglob("*") if p.is_file()}
    (run / "eval/policy_1_unseen.json").unlink()
    (run / "eval/policy_1_unseen.jsonl").unlink()
    out = run_all(run)
    ran = [line for line in out.splitlines() if line.startswith("== ") and "skip" not in line]
    assert len(ran) == 1 and "--split unseen" in ran[0] and "policy_1" in ran[0], ran
    for p, t in mtimes.items():
        if p.exists() and p.name not in ("results.md", "metrics.jsonl") and "policy_1_unseen" not in p.name:
            assert os.path.getmtime(p) == t, f"{p} was rewritten"
