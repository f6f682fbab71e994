"""Stage 02 end to end, and the stages' handling of bad input (docs/design.md, 'Conventions')."""
import argparse
import json
import os
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import run_stage

EPISODE_FIELDS = {"env", "task_id", "split", "source", "policy", "seed", "instruction", "task", "obs0",
                  "steps", "reward", "success", "truncated"}
STEP_FIELDS = {"text", "action", "obs", "r_env", "label", "r_aux", "done"}


def check_schema(path):
    eps = [json.loads(line) for line in open(path)]
    for ep in eps:
        assert set(ep) == EPISODE_FIELDS
        assert ep["steps"]
        for s in ep["steps"]:
            assert set(s) == STEP_FIELDS
            assert s["label"] in ("ok", "invalid", "repeat", "format")
        assert ep["reward"] == sum(s["r_env"] for s in ep["steps"])
        assert sum(s["done"] for s in ep["steps"]) == (0 if ep["truncated"] else 1)
        assert ep["steps"][-1]["done"] == (not ep["truncated"])
    return eps


def test_expert_through_02_scores_100_percent(tmp_path):
    out = tmp_path / "seen.jsonl"
    proc = run_stage("02_collect", "--policy", "expert", "--split", "seen", "--out", out)
    summary = json.load(open(tmp_path / "seen.json"))
    assert summary["success_rate"] == 1.0 and summary["episodes"] == 100
    assert "success 100.0%" in proc.stdout
    eps = check_schema(out)
    assert all(ep["source"] == "expert" for ep in eps)
    assert summary["labels"]["ok"] == sum(len(ep["steps"]) for ep in eps)


def test_fresh_tiny_model_collects_end_to_end(tiny_run, tmp_path):
    out = tmp_path / "self.jsonl"
    proc = run_stage("02_collect", "--policy", tiny_run / "policy_0", "--split", "train", "--episodes", 6,
                     "--num-envs", 3, "--max-new-tokens", 16, "--env-kwargs", '{"max_steps": 4}', "--out", out,
                     "--threads", 1)
    eps = check_schema(out)
    assert len(eps) == 6 and all(ep["source"] == "self" and ep["policy"] == "policy_0" for ep in eps)
    # A barely trained model rarely ends its turn within 16 tokens; 02 says how often it was cut.
    cut = [line for line in proc.stdout.splitlines() if "replies reached --max-new-tokens 16" in line]
    assert len(cut) == 1 and 0 < int(cut[0].split()[1]) <= sum(len(ep["steps"]) for ep in eps)
    summary = json.load(open(tmp_path / "self.json"))
    assert summary["episodes"] == 6 and summary["env_steps"] <= 6 * 4
    # Labels and auxiliary rewards agree with the flags' defaults.
    aux = {"ok": 0.0, "invalid": -0.1, "repeat": -0.1, "format": -0.2}
    assert all(s["r_aux"] == aux[s["label"]] for ep in eps for s in ep["steps"])


def test_collection_is_reproducible(tiny_run, tmp_path):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.jsonl"
        run_stage("02_collect", "--policy", tiny_run / "policy_0", "--split", "seen", "--episodes", 5,
                  "--num-envs", 2, "--max-new-tokens", 12, "--env-kwargs", '{"max_steps": 3}', "--out", out,
                  "--seed", 5, "--threads", 1)
        outs.append(open(out).read())
    assert outs[0] == outs[1]


def test_samples_per_task_samples_each_task_k_times(tiny_run, tmp_path):
    """--samples-per-task 3 on 2 tasks: 6 episodes, each task 3 times, sampled independently
    (a barely trained model at temperature 1 does not write the same first reply three times)."""
    out = tmp_path / "self.jsonl"
    run_stage("02_collect", "--policy", tiny_run / "policy_0", "--split", "train", "--episodes", 2,
              "--samples-per-task", 3, "--num-envs", 4, "--max-new-tokens", 12,
              "--env-kwargs", '{"max_steps": 2}', "--out", out, "--threads", 1)
    eps = check_schema(out)
    ids = [ep["task_id"] for ep in eps]
    assert len(eps) == 6 and len(set(ids)) == 2 and all(ids.count(t) == 3 for t in ids)
    assert len({ep["obs0"] for ep in eps if ep["task_id"] == ids[0]}) == 1  # one start state per task
    assert len({ep["steps"][0]["text"] for ep in eps if ep["task_id"] == ids[0]}) > 1
    assert json.load(open(tmp_path / "self.json"))["episodes"] == 6


def test_refilled_slots_run_the_same_episodes(tmp_path):
    """A slot whose episode ends takes the next task at once: with the (deterministic) expert,
    3 slots over 20 tasks give exactly the episodes of one environment at a time."""
    outs = []
    for n in (1, 3):
        out = tmp_path / f"n{n}.jsonl"
        run_stage("02_collect", "--policy", "expert", "--split", "seen", "--episodes", 20, "--num-envs", n, "--out", out)
        outs.append(out.read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 20


def test_shared_cache_reads_like_a_fresh_one(tiny_run, stages, monkeypatch):
    """The shared KV cache gives every row the next-token logits of a fresh one-row cache:
    rows of very different lengths, a row refilled with a new task (Session.sync keeps the
    common instruction and hides the rest of the old episode), an idle row, a compacted cache."""
    c = stages["02_collect"]
    path = str(tiny_run / "policy_0")
    args = c.parse_args(["--policy", path, "--out", "x.jsonl", "--greedy", "--max-new-tokens", "4"])
    policy, fresh = c.ModelPolicy(path, args), c.ModelPolicy(path, args)
    eps = [json.loads(line) for line in open(tiny_run / "expert.jsonl")][:4]
    logits = []  # every Session.feed output; the first feed of an act call reads the prompts
    real_feed = c.Session.feed
    monkeypatch.setattr(c.Session, "feed", lambda self, new: logits.append(real_feed(self, new)) or logits[-1])

    def prompt(k, t):  # episode k after its first t steps
        return policy.prompt_ids(dict(eps[k], steps=eps[k]["steps"][:t]))

    def first_logits(p, rows, prompts):
        n = len(logits)
        p.act(rows, prompts)
        return logits[n][rows]

    def check(rows, prompts):
        got = first_logits(policy, rows, prompts)
        for row_logits, p in zip(got, prompts):
            fresh.start(1)
            assert torch.allclose(row_logits, first_logits(fresh, [0], [p])[0], atol=1e-4)
    policy.start(3)
    check([0, 1, 2], [prompt(0, 5), prompt(1, 0), prompt(2, 2)])    # very different lengths
    check([0, 2], [prompt(3, 0), prompt(2, 3)])                     # row 0 refilled, row 1 idle
    policy.session.max_cols = 0                                     # a full cache: compact it
    check([0, 2], [prompt(3, 1), prompt(2, 4)])
    check([0, 1, 2], [prompt(3, 2), prompt(0, 1), prompt(2, 5)])    # and on: row 1 back with a new task


def test_rows_that_finish_early_leave_the_batch(tiny_run, stages, monkeypatch, tmp_path):
    """When most rows have ended their reply, act() goes on with a copy of the cache that holds
    only the rows still generating (Session.compacted with rows=...). The replies must be those
    of one row at a time, and at the next turn the rows whose last tokens never reached the
    shared cache must read their prompt exactly as a fresh cache does."""
    c = stages["02_collect"]
    # The one-epoch tiny policy repeats one token; random weights with a wide init give replies
    # that differ from row to row (and clear margins between the top two logits).
    path = tmp_path / "random_policy"
    shutil.copytree(tiny_run / "policy_0", path)
    config = AutoConfig.from_pretrained(path)
    config.initializer_range = 0.5
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    args = c.parse_args(["--policy", str(path), "--out", "x.jsonl", "--greedy", "--max-new-tokens", "6"])
    policy, fresh = c.ModelPolicy(str(path), args), c.ModelPolicy(str(path), args)
    eps = [json.loads(line) for line in open(tiny_run / "expert.jsonl")][:3]
    prompts = [policy.prompt_ids(dict(ep, steps=ep["steps"][:t])) for ep, t in zip(eps, (0, 2, 4))]
    fed = []  # every Session.feed input and output
    real_feed, real_compacted = c.Session.feed, c.Session.compacted
    monkeypatch.setattr(c.Session, "feed", lambda self, new: fed.append((new, real_feed(self, new))) or fed[-1][1])
    subsets = []
    monkeypatch.setattr(c.Session, "compacted",
                        lambda self, room, rows=None: subsets.append(rows) or real_compacted(self, room, rows))

    def alone(p):  # a fresh one-row cache: the reply as token ids (the feeds after the first)
        fresh.start(1)
        n = len(fed)
        fresh.act([0], [p])
        return [new[0][0] for new, _ in fed[n + 1:]]

    fresh.eos_id = policy.eos_id = -1  # never ends: every reply is 6 tokens
    eos = alone(prompts[0])[3]         # now make row 0 end at its 4th token (the others wherever it comes)
    fresh.eos_id = policy.eos_id = eos
    want, fed_ids = [], []  # each reply, and the tokens of it that were fed (all but the last)
    for p in prompts:
        fresh.start(1)
        n = len(fed)
        want.append(fresh.act([0], [p])[0])
        fed_ids.append([new[0][0] for new, _ in fed[n + 1:]])
    policy.start(4)  # row 3 stays idle
    assert policy.act([0, 1, 2], prompts) == want
    assert subsets and all(rows is not None and len(rows) <= 2 for rows in subsets)
    # The next turn: each prompt continues with its reply and more tokens; the first feed reads
    # the prompts, including the reply tokens that only the copy saw.
    nxt = [p + ids + prompts[0][-5:] for p, ids in zip(prompts, fed_ids)]
    n = len(fed)
    policy.act([0, 1, 2], nxt)
    got = fed[n][1]
    for r, p in enumerate(nxt):
        fresh.start(1)
        k = len(fed)
        fresh.act([0], [p])
        assert torch.allclose(got[r], fed[k][1][0], atol=1e-4)


@pytest.mark.parametrize("stage,args,message", [
    ("02_collect", ["--policy", "expert", "--env", "nope", "--out", "{d}/x.jsonl"], "unknown env 'nope'"),
    ("02_collect", ["--policy", "expert", "--split", "test", "--out", "{d}/x.jsonl"], "unknown split 'test'"),
    ("02_collect", ["--policy", "{d}", "--out", "{d}/x.jsonl"], "is not a model directory"),
    ("02_collect", ["--policy", "expert", "--samples-per-task", "2", "--out", "{d}/x.jsonl"],
     "--samples-per-task > 1 needs a sampling policy"),
    ("01_bc", ["--data", "{d}/missing.jsonl", "--out", "{d}/p"], "no such file"),
    ("01_bc", ["--data", "{d}/bad.jsonl", "--out", "{d}/p"], "bad.jsonl:2: not valid JSON"),
    ("01_bc", ["--data", "{d}/empty.jsonl", "--out", "{d}/p"], "no episodes"),
    ("03_critic", ["--data", "{d}/nolabel.jsonl", "--policy", "{d}", "--out", "{d}/c"], "nolabel.jsonl:1: episode lacks label"),
    ("04_gae", ["--data", "{d}/good.jsonl", "--critic", "{d}", "--out", "{d}/a.jsonl"], "is not a critic directory"),
    ("05_bppo", ["--data", "{d}/good.jsonl", "--policy", "{d}", "--ref", "{d}", "--out", "{d}/p"], "lacks adv"),
])
def test_bad_input_gives_one_line_and_exit_2(tmp_path, stage, args, message):
    good = json.dumps({"env": "household", "task_id": "train/00000", "instruction": "i", "task": "t", "obs0": "o",
                       "steps": [{"text": "Action: look", "action": "look", "obs": "o", "r_env": 0.0,
                                  "label": "ok", "r_aux": 0.0, "done": False}],
                       "reward": 0.0, "success": False, "source": "self"})
    (tmp_path / "good.jsonl").write_text(good + "\n")
    (tmp_path / "bad.jsonl").write_text(good + "\n{not json\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "nolabel.jsonl").write_text(good.replace('"label": "ok", ', "") + "\n")
    sentinel = tmp_path / "x.jsonl"
    sentinel.write_text("keep me")
    proc = run_stage(stage, *[a.format(d=tmp_path) for a in args], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert sentinel.read_text() == "keep me"  # nothing overwritten
    assert not (tmp_path / "p").exists() and not (tmp_path / "c").exists()


def test_every_flag_has_help(stages, monkeypatch):
    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    for module in stages.values():
        with pytest.raises(SystemExit):
            module.parse_args([])
    assert len(parsers) == len(stages)
    for parser in parsers:
        flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        assert any(a.dest == "seed" for a in flags), parser.prog
        for a in flags:
            assert a.help and len(a.help) > 8, f"{parser.prog} {a.option_strings[0]} has no help"
