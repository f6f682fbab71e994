"""02_collect.py --rerank (Q-guided generation) and 01_bc.py --filter success (RFT)."""
import argparse
import json

import pytest
import torch
from transformers import AutoModel

import rerank
from conftest import load_stage, run_stage
from test_collect import HOUSEHOLD, check_schema

TINY = ["--split", "seen", "--episodes", 2, "--num-envs", 2, *HOUSEHOLD, '{"max_steps": 3}', "--threads", 1]


@pytest.fixture(scope="module")
def collect():
    """02_collect.py as a module, loaded once here so monkeypatching cannot leak to other tests."""
    return load_stage("02_collect")


@pytest.fixture(scope="module")
def critic_dir(tiny_run, stages, tmp_path_factory):
    """A critic with freshly initialised (random) heads on the tiny policy's body, saved by 03's save_critic."""
    c3 = stages["03_critic"]
    torch.manual_seed(0)
    policy = str(tiny_run / "policy_0")
    critic = c3.Critic(AutoModel.from_pretrained(policy, local_files_only=True))
    out = tmp_path_factory.mktemp("rerank") / "critic"
    c3.save_critic(critic, str(out), c3.load_tokenizer(policy), {"note": "random heads, for tests"})
    return out


def test_pick_candidates_takes_argmax_q_per_environment():
    q = [0.1, 0.7, 0.3,     # env 0 -> candidate 1
         -2.0, -1.0, -3.0,  # env 1 -> candidate 1
         0.5, 0.2, 0.9]     # env 2 -> candidate 2
    assert rerank.pick_candidates(q, 3) == [1, 1, 2]
    assert rerank.pick_candidates(torch.tensor([0.4, 0.4, 0.1, 0.2, 0.9, 0.9]), 3) == [0, 1]  # ties: lowest index
    assert rerank.pick_candidates([0.3, -0.1], 1) == [0, 0]  # one candidate: always it


def test_candidate_q_is_q_of_the_step_in_the_whole_episode(collect, critic_dir, tiny_run, monkeypatch):
    """Q of a candidate, scored with an empty observation, equals Q at that step when 04 reads
    the finished episode in one pass (causal model: the observation comes after Q's position).
    Both on the CPU in fp32: the equality is of the masking, not of a device's rounding."""
    monkeypatch.setattr(rerank, "pick_device", lambda precision: (torch.device("cpu"), None))
    ep = json.loads(open(tiny_run / "expert.jsonl").readline())
    reranker = collect.Reranker(str(critic_dir), argparse.Namespace(candidates=2, critic_batch_size=2,
                                                                    precision="fp32"))
    n = len(ep["steps"])
    q = reranker.q_values([dict(ep, steps=ep["steps"][:t]) for t in range(n)], [s["text"] for s in ep["steps"]])
    x = rerank.gae.tokenize_episode(reranker.tokenizer, ep)  # as 04 reads it
    with torch.no_grad():
        _, _, q_whole = reranker.critic(rerank.gae.collate([x], reranker.tokenizer.pad_token_id))
    assert torch.allclose(torch.tensor(q), q_whole[0, :n], atol=1e-5)
    assert len(set(round(v, 4) for v in q)) > 1  # the random heads do tell the steps apart


def test_q_values_scores_each_distinct_candidate_once(collect, critic_dir, tiny_run, monkeypatch):
    """Repeated replies of one environment are scored once and get that one Q; the same reply after another
    episode is scored again (its Q depends on the episode)."""
    monkeypatch.setattr(rerank, "pick_device", lambda precision: (torch.device("cpu"), None))
    reranker = collect.Reranker(str(critic_dir), argparse.Namespace(candidates=3, critic_batch_size=2,
                                                                    precision="fp32"))
    lines = open(tiny_run / "expert.jsonl").readlines()
    a, b = (dict(json.loads(line), steps=[]) for line in lines[:2])
    scored = []
    real_score = collect.Reranker.score
    monkeypatch.setattr(collect.Reranker, "score", lambda self, eps, texts: scored.append(texts) or
                        real_score(self, eps, texts))
    q = reranker.q_values([a, a, a, b, b, b], ["go", "look", "go", "go", "go", "go"])
    assert scored == [["go", "look", "go"]]
    s = real_score(reranker, [a, a, b], ["go", "look", "go"])
    assert q == [s[0], s[1], s[0], s[2], s[2], s[2]] and s[0] != s[1]


def test_rerank_executes_the_candidate_the_critic_prefers(collect, critic_dir, tiny_run, tmp_path, monkeypatch):
    """A hand-made Q that always prefers the last of the m candidates: that reply must be the executed step."""
    seen = []
    real_q_values = collect.Reranker.q_values

    def prefer_last(self, episodes, texts):
        real_q_values(self, episodes, texts)  # the real scoring path still runs
        m = self.m
        for k in range(0, len(texts), m):
            seen.append((episodes[k]["task_id"], len(episodes[k]["steps"]), texts[k:k + m]))
        return [float(j % m) for j in range(len(texts))]
    monkeypatch.setattr(collect.Reranker, "q_values", prefer_last)
    out = tmp_path / "rerank.jsonl"
    collect.main(["--policy", str(tiny_run / "policy_0"), "--rerank", str(critic_dir), "--candidates", "3",
                  "--max-new-tokens", "12", "--out", str(out), *map(str, TINY), "--episodes", "3"])  # one refill
    eps = {ep["task_id"]: ep for ep in check_schema(out)}
    assert len(eps) == 3 and len(seen) == sum(len(ep["steps"]) for ep in eps.values())
    for task_id, t, candidates in seen:
        assert len(candidates) == 3
        assert eps[task_id]["steps"][t]["text"] == candidates[-1]
    assert any(len(set(c)) > 1 for _, _, c in seen)  # the candidates were not all the same reply


def test_rerank_end_to_end_counts_every_candidate(collect, critic_dir, tiny_run, tmp_path, in_process):
    """One-token replies make the count exact: every candidate of every step generates one token."""
    out = tmp_path / "rerank.jsonl"
    in_process(collect, "--policy", tiny_run / "policy_0", "--rerank", critic_dir, "--candidates", 3,
               "--max-new-tokens", 1, "--out", out, *TINY)
    eps = check_schema(out)
    summary = json.load(open(tmp_path / "rerank.json"))
    steps = sum(len(ep["steps"]) for ep in eps)
    assert summary["candidates"] == 3 and summary["episodes"] == 2
    assert summary["generated_tokens"] == 3 * steps
    assert summary["env_steps"] == sum(s["label"] != "format" for ep in eps for s in ep["steps"])
    # Without --rerank: one candidate per step, one token each.
    plain = tmp_path / "plain.jsonl"
    collect.main(["--policy", str(tiny_run / "policy_0"), "--max-new-tokens", "1", "--out", str(plain),
                  *map(str, TINY)])
    summary = json.load(open(tmp_path / "plain.json"))
    assert summary["candidates"] == 1
    assert summary["generated_tokens"] == sum(len(ep["steps"]) for ep in check_schema(plain))


@pytest.mark.parametrize("args,message", [
    (["--policy", "{policy}", "--rerank", "{policy}"], "is not a critic directory"),
    (["--policy", "{policy}", "--rerank", "{critic}", "--candidates", "0"], "--candidates must be at least 1"),
    (["--policy", "expert", "--rerank", "{critic}"], "not --policy expert"),
    (["--policy", "{policy}", "--rerank", "{critic}", "--greedy"], "drop --greedy"),
])
def test_rerank_bad_input_gives_one_line_and_exit_2(collect, critic_dir, tiny_run, tmp_path, capsys, args, message):
    out = tmp_path / "x.jsonl"
    args = [a.format(policy=tiny_run / "policy_0", critic=critic_dir) for a in args]
    with pytest.raises(SystemExit) as e:
        collect.main([*args, "--split", "seen", "--episodes", "2", "--out", str(out), "--threads", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists() and not (tmp_path / "x.json").exists()


def test_bad_rerank_directory_from_the_command_line(tiny_run, tmp_path):
    """A real process (the tests above call main()): one line, exit 2."""
    proc = run_stage("02_collect", "--policy", tiny_run / "policy_0", "--rerank", tiny_run / "policy_0",
                     "--out", tmp_path / "x.jsonl", check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a critic directory" in lines[0], proc.stderr
    assert not (tmp_path / "x.jsonl").exists()


# ---- 01_bc.py --filter success: rejection-sampling fine-tuning (RFT)
def failed(ep):
    """A copy of a demo cut after its first step: not successful."""
    return dict(ep, steps=[dict(ep["steps"][0], r_env=0.0, done=False)], reward=0.0, success=False, truncated=True)


def test_filter_success_keeps_exactly_the_successful_trajectories(stages, in_process, tiny_run, tmp_path):
    demos = [json.loads(line) for line in open(tiny_run / "expert.jsonl")][:2]
    buffer = [failed(demos[0]), demos[0], failed(demos[1]), demos[1]]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(ep) + "\n" for ep in buffer))
    proc = in_process(stages["01_bc"], "--data", tmp_path / "mixed.jsonl", "--out", tmp_path / "p",
                      "--filter", "success", "--epochs", 1, "--d-model", 16, "--n-layers", 1, "--n-heads", 2,
                      "--vocab-size", 300, "--threads", 1)
    assert "--filter success kept 2 of 4 trajectories" in proc.stdout
    assert "1 train / 1 val trajectories" in proc.stdout  # the two successes; --val-frac holds out one
    assert (tmp_path / "p" / "config.json").exists()


def test_filter_success_without_a_success_exits_2(stages, in_process, tiny_run, tmp_path):
    demo = json.loads(open(tiny_run / "expert.jsonl").readline())
    (tmp_path / "failed.jsonl").write_text(json.dumps(failed(demo)) + "\n" + json.dumps(failed(demo)) + "\n")
    proc = in_process(stages["01_bc"], "--data", tmp_path / "failed.jsonl", "--out", tmp_path / "p",
                      "--filter", "success", check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--filter success left no trajectories" in lines[0], proc.stderr
    assert not (tmp_path / "p").exists()
