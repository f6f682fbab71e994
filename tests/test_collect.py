"""Stage 02 end to end, and the stages' handling of bad input (DESIGN section 8)."""
import argparse
import json
import os

import pytest

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
    run_stage("02_collect", "--policy", tiny_run / "policy_0", "--split", "train", "--episodes", 6,
              "--num-envs", 3, "--max-new-tokens", 16, "--env-kwargs", '{"max_steps": 4}', "--out", out,
              "--threads", 1)
    eps = check_schema(out)
    assert len(eps) == 6 and all(ep["source"] == "self" and ep["policy"] == "policy_0" for ep in eps)
    summary = json.load(open(tmp_path / "self.json"))
    assert summary["episodes"] == 6 and summary["env_steps"] <= 6 * 4
    # Labels and auxiliary rewards agree with the flags' defaults.
    aux = {"ok": 0.0, "invalid": -0.1, "repeat": -0.1, "format": -0.2}
    assert all(s["r_aux"] == aux[s["label"]] for ep in eps for s in ep["steps"])


def test_collection_is_reproducible(tiny_run, tmp_path):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.jsonl"
        run_stage("02_collect", "--policy", tiny_run / "policy_0", "--split", "seen", "--episodes", 3,
                  "--num-envs", 3, "--max-new-tokens", 12, "--env-kwargs", '{"max_steps": 3}', "--out", out,
                  "--seed", 5, "--threads", 1)
        outs.append(open(out).read())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("stage,args,message", [
    ("02_collect", ["--policy", "expert", "--env", "nope", "--out", "{d}/x.jsonl"], "unknown env 'nope'"),
    ("02_collect", ["--policy", "expert", "--split", "test", "--out", "{d}/x.jsonl"], "unknown split 'test'"),
    ("02_collect", ["--policy", "{d}", "--out", "{d}/x.jsonl"], "is not a model directory"),
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
