"""Mixed precision (machine.pick_device, --precision): fp32 weights and optimizer state, the forward
and backward under torch.autocast. `--precision bf16` takes the GPU's path on a CPU, so CI runs it.
The failure it guards against: AdamW on bf16 weights drops a small step (0.6% of SmolLM2's
weights moved at lr 2e-6), silently."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from machine import pick_device


def test_pick_device_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine with a GPU
    assert pick_device("auto") == (torch.device("cpu"), None)  # the CPU default: plain fp32, as before
    assert pick_device("fp32") == (torch.device("cpu"), None)
    assert pick_device("bf16") == (torch.device("cpu"), torch.bfloat16)


def test_pick_device_on_a_gpu_without_bf16(monkeypatch, capsys):
    """A T4 (no bf16): auto falls back to fp32 and says so; asking for bf16 is one error line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert pick_device("auto") == (torch.device("cuda"), None)
    assert "no bf16" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        pick_device("bf16")
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --precision bf16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert pick_device("auto") == (torch.device("cuda"), torch.bfloat16)


def test_more_processes_than_gpus_is_one_error_line(monkeypatch, capsys):
    """torchrun --nproc-per-node 2 on a one-GPU machine: refused before NCCL fails on a shared GPU."""
    from distributed import setup_distributed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        setup_distributed()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "has 1 GPU(s)" in err[0] and "--nproc-per-node 1" in err[0]


class SpyAdamW(torch.optim.AdamW):
    """AdamW that records, at every step, which weights had a non-zero gradient, and its state's dtypes."""
    steps = []

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad is not None and (p.grad != 0).cpu() for p in params]  # compared with the saved file
        out = super().step(closure)
        SpyAdamW.steps.append({"grads": grads, "dtypes": {t.dtype for s in self.state.values() for t in s.values()
                                                          if t.dim() > 0}})
        return out


@pytest.fixture
def adv_buffer(tiny_run, tmp_path):
    """The expert demos with an advantage of +1 / -1 on every step (05 reads only "adv" beyond the episode)."""
    path = tmp_path / "adv.jsonl"
    with open(tiny_run / "expert.jsonl") as f, open(path, "w") as g:
        for i, line in enumerate(f):
            ep = json.loads(line)
            ep["steps"] = [dict(s, adv=1.0 if i % 2 else -1.0) for s in ep["steps"]]
            g.write(json.dumps(ep) + "\n")
    return path


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", ["01_bc", "05_bppo"])
def test_a_small_step_under_bf16_autocast_moves_every_weight_it_reaches(stages, tiny_run, adv_buffer, tmp_path,
                                                                       monkeypatch, stage, precision):
    """One optimizer step at lr 1e-6 under --precision bf16: the forward ran under autocast, the
    optimizer state is fp32, the saved policy is fp32, and nearly every weight with a non-zero
    gradient differs in the saved file (pure bf16 weights would keep almost all of them). fp32 (a GPU
    without bf16, a T4): the same step without autocast, with gradient checkpointing as a real model has it."""
    module, device = stages[stage], "cuda" if torch.cuda.is_available() else "cpu"  # where the stage computes
    autocast_on = []
    real = module.reply_logits
    monkeypatch.setattr(module, "reply_logits", lambda model, b: autocast_on.append(
        torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16) or real(model, b))
    monkeypatch.setattr(torch.optim, "AdamW", SpyAdamW)
    SpyAdamW.steps = []
    base, out = tiny_run / "policy_0", tmp_path / "out"
    common = ["--out", str(out), "--lr", "1e-6", "--batch-size", "64", "--epochs", "1", "--threads", "1",
              "--precision", precision] + (["--grad-checkpointing", "on"] if precision == "fp32" else [])
    if stage == "01_bc":  # fine-tune the tiny policy (no warmup is shorter than one step: lr 1e-6 at step 1)
        module.main(["--data", str(tiny_run / "expert.jsonl"), "--model", str(base), *common])
    else:
        module.main(["--data", str(adv_buffer), "--policy", str(base), "--ref", str(base), *common])
    assert autocast_on and all(on == (precision == "bf16") for on in autocast_on)
    assert len(SpyAdamW.steps) == 1 and SpyAdamW.steps[0]["dtypes"] == {torch.float32}
    before, after = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    assert {t.dtype for t in after.values()} == {torch.float32}
    # the optimizer's parameters in the model's order (a tied weight once), named as in the saved file
    names = [n for n, _ in AutoModelForCausalLM.from_pretrained(base, local_files_only=True).named_parameters()]
    reached = moved = 0
    for name, got_grad in zip(names, SpyAdamW.steps[0]["grads"]):
        changed = after[name] != before[name]
        reached += int(got_grad.sum())
        moved += int((changed & got_grad).sum())
        assert not (changed & ~got_grad).any(), f"{name}: a weight without a gradient moved"
    assert reached > 0.5 * sum(t.numel() for t in before.values())
    assert moved / reached > 0.99, f"only {moved / reached:.1%} of the weights with a gradient moved"
