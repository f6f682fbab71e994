"""The stages under torchrun with 2 processes (docs/distributed.md): the same global batch split
over 2 ranks gives the same update as 1 rank with all of it, and 02 on 2 ranks writes the same
episodes as on 1 rank. Every run in fp32 (the comparison is of the arithmetic of the split, not of
bf16's rounding), on 2 GPUs where the machine has them, else on the CPU with the gloo backend
(torchrun refuses more processes than GPUs)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, STAGE_DIR, run_stage

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                 reason="torch.distributed with the gloo backend is not available")]

TINY = ["--d-model", 32, "--n-layers", 1, "--n-heads", 2, "--vocab-size", 400, "--threads", 1]
CPU_UNLESS_2_GPUS = {} if torch.cuda.device_count() >= 2 else {"CUDA_VISIBLE_DEVICES": ""}


def run_ranks(nproc, name, *args):
    """A stage as a user runs it: `python` for one process, `torchrun --standalone` for more; in fp32."""
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                              if nproc > 1 else []) + [f"{name}.py"]
    with tempfile.TemporaryDirectory() as scratch:  # torchrun's log folders (torchelastic_*) go there, and with it
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": scratch, **CPU_UNLESS_2_GPUS}
        proc = subprocess.run(cmd + list(map(str, args)) + ["--precision", "fp32"],
                              cwd=STAGE_DIR if nproc == 1 else ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"{name} on {nproc} ranks failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def assert_same_weights(dir_a, dir_b, files=("model.safetensors",), atol=1e-5):
    for name in files:
        a, b = load_file(os.path.join(dir_a, name)), load_file(os.path.join(dir_b, name))
        assert a.keys() == b.keys(), name
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < atol, f"{name}: weights differ by up to {worst}"


def assert_same_metrics(path_a, path_b):
    """The records rank 0 logs are the single-process numbers (averaged over the global batch)."""
    rows_a, rows_b = ([json.loads(line) for line in open(p)] for p in (path_a, path_b))
    assert len(rows_a) == len(rows_b)
    for ra, rb in zip(rows_a, rows_b):
        assert ra.keys() == rb.keys()
        for k in ra:
            if k not in ("elapsed_s", "tokens_per_s", "peak_mem_gb", "out"):  # timings, memory and --out differ
                assert ra[k] == (rb[k] if isinstance(rb[k], str) else pytest.approx(rb[k], rel=1e-4, abs=1e-6)), k


@pytest.fixture(scope="module")
def bc_one_rank(tiny_run):
    """One BC step on 1 rank: 19 training trajectories (1 held out) in one global batch. A module fixture
    can run again in the same session (pytest-xdist returns to a module), and --metrics appends: start clean."""
    out = tiny_run / "dist_bc_1"
    (tiny_run / "dist_bc_1.jsonl").unlink(missing_ok=True)
    run_ranks(1, "01_bc", "--data", tiny_run / "expert.jsonl", "--out", out, "--epochs", 1, "--batch-size", 64,
              "--metrics", tiny_run / "dist_bc_1.jsonl", *TINY)
    return out


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_bc_step_on_two_ranks_matches_one_rank(tiny_run, bc_one_rank, fsdp):
    """2 ranks with 10 and 9 trajectories of the global batch (DDP, or FSDP2 with --fsdp): the loss
    is normalised over the global batch's action tokens, so the step is the 1-rank step."""
    out = tiny_run / f"dist_bc_2{'_fsdp' if fsdp else ''}"
    run_ranks(2, "01_bc", "--data", tiny_run / "expert.jsonl", "--out", out, "--epochs", 1, "--batch-size", 64,
              "--metrics", f"{out}.jsonl", *TINY, *(["--fsdp"] if fsdp else []))
    assert_same_weights(bc_one_rank, out)
    assert_same_metrics(tiny_run / "dist_bc_1.jsonl", f"{out}.jsonl")


@pytest.mark.parametrize("nproc,fsdp", [(1, False), (2, True)], ids=["1rank", "2ranks_fsdp"])
def test_bc_step_with_gradient_accumulation_matches_one_batch(tiny_run, bc_one_rank, nproc, fsdp):
    """--grad-accum 3: the global batch of 19 in micro-batches of 7, 6, 6 trajectories (2 ranks: 4, 3, 3
    and 3, 3, 3), each micro-batch's mean weighted by its share of the action tokens -> the same step."""
    out = tiny_run / f"accum_bc_{nproc}"
    run_ranks(nproc, "01_bc", "--data", tiny_run / "expert.jsonl", "--out", out, "--epochs", 1, "--batch-size", 64,
              "--grad-accum", 3, "--metrics", f"{out}.jsonl", *TINY, *(["--fsdp"] if fsdp else []))
    assert_same_weights(bc_one_rank, out)
    assert_same_metrics(tiny_run / "dist_bc_1.jsonl", f"{out}.jsonl")


@pytest.fixture(scope="module")
def critic_one_rank(tiny_run):
    out = tiny_run / "dist_critic_1"
    (tiny_run / "dist_critic_1.jsonl").unlink(missing_ok=True)  # as bc_one_rank
    run_ranks(1, "03_critic", "--data", tiny_run / "expert.jsonl", "--policy", tiny_run / "policy_0", "--out", out,
              "--epochs", 1, "--batch-size", 64, "--threads", 1, "--metrics", tiny_run / "dist_critic_1.jsonl")
    return out


def test_critic_step_on_two_ranks_matches_one_rank(tiny_run, critic_one_rank):
    """One IQL step (and the Polyak target) with the global batch split over 2 ranks: L_V and L_Q
    are normalised over the global batch's step weights."""
    out = tiny_run / "dist_critic_2"
    run_ranks(2, "03_critic", "--data", tiny_run / "expert.jsonl", "--policy", tiny_run / "policy_0", "--out", out,
              "--epochs", 1, "--batch-size", 64, "--threads", 1, "--metrics", f"{out}.jsonl")
    assert_same_weights(critic_one_rank, out, ("model.safetensors", "heads.safetensors"))
    assert_same_metrics(tiny_run / "dist_critic_1.jsonl", f"{out}.jsonl")


def test_critic_step_with_gradient_accumulation_matches_one_batch(tiny_run, critic_one_rank):
    """One IQL step in 4 micro-batches, weighted by their step weights: the one-batch step."""
    out = tiny_run / "accum_critic"
    run_ranks(1, "03_critic", "--data", tiny_run / "expert.jsonl", "--policy", tiny_run / "policy_0", "--out", out,
              "--epochs", 1, "--batch-size", 64, "--grad-accum", 4, "--threads", 1, "--metrics", f"{out}.jsonl")
    assert_same_weights(critic_one_rank, out, ("model.safetensors", "heads.safetensors"))
    assert_same_metrics(tiny_run / "dist_critic_1.jsonl", f"{out}.jsonl")


@pytest.fixture(scope="module")
def bppo_adv(tiny_run, critic_one_rank):
    adv = tiny_run / "dist_adv.jsonl"
    run_stage("04_gae", "--data", tiny_run / "expert.jsonl", "--critic", critic_one_rank, "--out", adv)
    return adv


def bppo_args(tiny_run, bppo_adv, bc_one_rank, out, batch_size=19, epochs=1):
    """05 with the KL anchor to another policy (the BC policy trained here, not policy_0)."""
    return ["--data", bppo_adv, "--policy", tiny_run / "policy_0", "--ref", bc_one_rank, "--out", out,
            "--epochs", epochs, "--batch-size", batch_size, "--lr", 1e-3, "--threads", 1, "--metrics", f"{out}.jsonl"]


@pytest.fixture(scope="module")
def bppo_one_rank(tiny_run, bppo_adv, bc_one_rank):
    out = tiny_run / "dist_bppo_1"
    run_ranks(1, "05_bppo", *bppo_args(tiny_run, bppo_adv, bc_one_rank, out))
    return out


def test_bppo_steps_on_two_ranks_match_one_rank(tiny_run, bppo_adv, bc_one_rank, bppo_one_rank):
    """BPPO with the KL anchor (pi_ref in every process), 20 trajectories in global batches of 19 and
    1: the first step splits 10 / 9 over 2 ranks, the second leaves rank 1 without a trajectory (it
    joins with weight 0)."""
    out = tiny_run / "dist_bppo_2"
    run_ranks(2, "05_bppo", *bppo_args(tiny_run, bppo_adv, bc_one_rank, out))
    assert_same_weights(bppo_one_rank, out)
    assert_same_metrics(f"{bppo_one_rank}.jsonl", f"{out}.jsonl")


def test_bppo_steps_with_gradient_accumulation_on_two_ranks_match_one_rank(tiny_run, bppo_adv, bc_one_rank,
                                                                         bppo_one_rank):
    """DDP with --grad-accum 2: gradients reduced once per step, after the second micro-batch; in the
    second step (1 trajectory) each rank runs one micro-batch (capped at the largest rank's trajectories), rank 1's
    of weight 0."""
    out = tiny_run / "accum_bppo_2"
    run_ranks(2, "05_bppo", *bppo_args(tiny_run, bppo_adv, bc_one_rank, out), "--grad-accum", 2)
    assert_same_weights(bppo_one_rank, out)
    assert_same_metrics(f"{bppo_one_rank}.jsonl", f"{out}.jsonl")


def test_collect_on_two_ranks_writes_the_same_episodes(tmp_path):
    """02 shards the tasks by rank; rank 0 gathers the episodes, writes them in task order, and
    nothing else is written."""
    args = ["--policy", "expert", "--split", "train", "--episodes", 9, "--threads", 1]
    run_ranks(1, "02_collect", *args, "--out", tmp_path / "one.jsonl")
    run_ranks(2, "02_collect", *args, "--out", tmp_path / "two.jsonl")
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (one["episodes"], one["env_steps"]) == (two["episodes"], two["env_steps"])
    assert sorted(os.listdir(tmp_path)) == ["one.json", "one.jsonl", "two.json", "two.jsonl"]


def test_grad_accum_beyond_the_batch_adds_no_empty_micro_batches(monkeypatch):
    """Issue 94 (probe 6 of session 8): --grad-accum 1024 --batch-size 1 ran 1023 weight-0 forward/backward passes a
    step. The micro-batches are capped at the largest rank's trajectories: 1 trajectory, 1 part of share 1; 5 in
    --grad-accum 8 on two ranks (3 and 2): 3 parts a rank, rank 1's third re-reading one with weight 0."""
    from distributed import parts
    args = argparse.Namespace(grad_accum=1024)
    model = argparse.Namespace()  # grad_sync sets its require_backward_grad_sync on two ranks
    assert list(parts([4], {4: 7}, model, args)) == [([4], 1.0)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    args.grad_accum = 8
    for rank, want in ((0, [[0], [4], [8]]), (1, [[2], [6], [2]])):
        monkeypatch.setenv("RANK", str(rank))
        got = list(parts([0, 2, 4, 6, 8], dict.fromkeys([0, 2, 4, 6, 8], 1), model, args))
        assert [ids for ids, _ in got] == want and got[-1][1] == (2 * 1 / 5 if rank == 0 else 0.0)
