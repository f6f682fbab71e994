"""--lora R in 01 and 05: peft adapters on a pretrained model, merged before saving, so the
saved policy is a plain model directory that every stage reads as before."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_stage

pytest.importorskip("peft", reason="peft is optional (requirements-smollm2.txt); CI installs it")


def weights(d):
    return load_file(os.path.join(d, "model.safetensors"))


def check_merged(before, after_dir):
    """A plain save_pretrained directory (no adapter files) with the same tensor names; the
    embedding table (not a linear layer) is untouched, attention and MLP weights moved."""
    assert not any(f.startswith("adapter") for f in os.listdir(after_dir))
    after = weights(after_dir)
    assert set(after) == set(before)
    emb = next(k for k in before if "embed_tokens" in k)
    assert torch.equal(after[emb], before[emb])
    moved = [k for k in before
             if k.endswith(("q_proj.weight", "down_proj.weight")) and not torch.equal(after[k], before[k])]
    assert moved, "no adapted weight changed"


@pytest.mark.slow  # a machine setting, end to end through three stages (~20 s)
def test_bc_and_bppo_with_lora_save_plain_merged_models(tiny_run, tmp_path):
    base = tiny_run / "policy_0"
    before = weights(base)
    proc = run_stage("01_bc", "--data", tiny_run / "expert.jsonl", "--model", base, "--out", tmp_path / "bc",
                     "--lora", 4, "--epochs", 1, "--lr", 1e-2, "--threads", 1)
    assert "M trained)" in proc.stdout
    check_merged(before, tmp_path / "bc")
    # 05 on a buffer with an advantage on every step (05 reads only "adv" beyond the episode).
    with open(tiny_run / "expert.jsonl") as f, open(tmp_path / "adv.jsonl", "w") as g:
        for i, line in enumerate(f):
            ep = json.loads(line)
            ep["steps"] = [dict(s, adv=1.0 if i % 2 else -1.0) for s in ep["steps"]]
            g.write(json.dumps(ep) + "\n")
    run_stage("05_bppo", "--data", tmp_path / "adv.jsonl", "--policy", base, "--ref", base, "--out", tmp_path / "pi",
              "--lora", 4, "--lr", 1e-2, "--threads", 1)
    check_merged(before, tmp_path / "pi")
    # The merged policy collects like any other.
    run_stage("02_collect", "--policy", tmp_path / "pi", "--split", "seen", "--episodes", 2, "--greedy",
              "--max-new-tokens", 8, "--env", "household", "--env-kwargs", '{"max_steps": 2}',
              "--out", tmp_path / "eval.jsonl",
              "--threads", 1)


def test_lora_refuses_the_tiny_model_from_scratch(stages, in_process, tiny_run, tmp_path):
    proc = in_process(stages["01_bc"], "--data", tiny_run / "expert.jsonl", "--out", tmp_path / "bc", "--lora", 4,
                      check=False)
    assert proc.returncode == 2 and "--lora needs a pretrained --model DIR" in proc.stderr
    assert not (tmp_path / "bc").exists()
