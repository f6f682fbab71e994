"""The whole chain end to end on the smallest budgets, and resuming after an interruption."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

# SMOKE=1 sets these budgets' defaults in run_all.sh (the README's one-minute run); a value set
# in the caller's shell would win, so the test clears them.
SMOKE_VARS = ["RUN", "K", "N_EXPERT", "N_SELF", "N_EVAL", "EVAL", "THREADS", "ENV", "ENV_KWARGS", "EVAL_SPLITS",
              "EVAL_WORLDS", "BASE", "KEEP_OLD", "PRETRAIN_ARGS", "BC_ARGS", "COLLECT_ARGS", "CRITIC_ARGS", "GAE_ARGS",
              "BPPO_ARGS"]


def run_all(run_dir, python=sys.executable, **settings):
    env = {k: v for k, v in os.environ.items() if k not in SMOKE_VARS}
    env.update(SMOKE="1", RUN=str(run_dir), BASE_CACHE=str(run_dir.parent / "base"), PYTHON=python,
               OMP_NUM_THREADS="1", **settings)
    proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_smoke_sets_only_defaults(tmp_path):
    """PYTHON=echo prints each stage's command instead of running it: the smoke budgets, and a
    variable set by the caller winning over them."""
    out = run_all(tmp_path / "run", python="echo", N_EXPERT="99", BC_ARGS="--epochs 3")
    commands = [line for line in out.splitlines() if line.startswith("== echo")]
    expert = next(c for c in commands if "--policy expert" in c)
    assert "--episodes 99 --keep success " in expert
    assert '--env kitchen --env-kwargs {"decisions": 2, "careless": 0.85, "n_train": 20}' in expert
    assert any("01_bc.py" in c and c.endswith("--epochs 3") for c in commands)
    assert any("00_pretrain.py" in c and "--d-model 32" in c for c in commands)
    assert any("--split train --episodes 6 " in c for c in commands)
    assert any("05_bppo.py" in c and c.endswith("--epochs 1") for c in commands)
    assert os.listdir(tmp_path) == []  # the dry run writes nothing (probe 7 of session 8: it made RUN, unchecked)


def test_check_is_refused_in_the_dry_run(tmp_path):
    """Probe 7 of session 8: PYTHON=echo RUN='x{y}' bash run_all.sh --check said every setting was good: the dry run
    echoes run_support.py's check instead of running it. --check needs a python now."""
    env = {k: v for k, v in os.environ.items() if k not in SMOKE_VARS}
    env.update(SMOKE="1", RUN=str(tmp_path / "r{x}"), PYTHON="echo")
    proc = subprocess.run(["bash", "run_all.sh", "--check"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "PYTHON=echo is the dry run" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_base_cache_key_covers_the_code_that_builds_the_base(tmp_path):
    """A base cached by older 00_pretrain.py / models/tiny.py / plumbing.py / machine.py / distributed.py / envs/ code
    must not be reused: the key hashes them."""
    repo = tmp_path / "repo"
    (repo / "models").mkdir(parents=True)
    for name in ("run_all.sh", "00_pretrain.py", "plumbing.py", "machine.py", "distributed.py", "models/tiny.py"):
        shutil.copy(os.path.join(ROOT, name), repo / name)
    shutil.copytree(os.path.join(ROOT, "envs"), repo / "envs")

    def base_dir():
        env = {k: v for k, v in os.environ.items() if k not in SMOKE_VARS}
        env.update(SMOKE="1", RUN=str(tmp_path / "run"), BASE_CACHE=str(tmp_path / "base"), PYTHON="echo")
        out = subprocess.run(["bash", "run_all.sh"], cwd=repo, env=env, capture_output=True, text=True).stdout
        line = next(c for c in out.splitlines() if c.startswith("== echo run_support.py build"))
        return line.split("--out ")[1].split()[0]
    first = base_dir()
    assert base_dir() == first  # same code and settings: the same cache entry
    for edited in (repo / "envs" / "household.py", repo / "models" / "tiny.py", repo / "distributed.py"):
        with open(edited, "a") as f:
            f.write("\n# an edit\n")
        assert base_dir() != first, edited
        first = base_dir()


def test_default_run_is_the_kitchen_credit_world_with_two_iterations(tmp_path):
    """Without SMOKE, run_all.sh's defaults: kitchen (the credit world, its own defaults) for K = 2 iterations;
    household plays the habit world of docs/design.md, shop its own miniature; another environment gets '{}';
    ENV_KWARGS set by the caller wins."""
    def commands(**settings):
        env = {k: v for k, v in os.environ.items() if k not in SMOKE_VARS + ["SMOKE"]}
        env.update(RUN=str(tmp_path / "run"), BASE_CACHE=str(tmp_path / "base"), PYTHON="echo", **settings)
        proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [line for line in proc.stdout.splitlines() if line.startswith("== echo")]
    kitchen = commands()
    assert all('--env kitchen --env-kwargs {"careless": 0.85}' in c for c in kitchen if "--env " in c)
    assert sum("--policy expert" in c and "--keep success " in c for c in kitchen) == 1  # DEMOS=success, the paper's
    # every policy is evaluated greedily on dev, seen and unseen in worlds 0 (the training world) to 3, in one process
    evals = [c for c in kitchen if "--greedy" in c]
    assert len(evals) == 3
    for k in range(3):
        assert f"--policy {tmp_path / 'run' / f'policy_{k}'} " in evals[k]
        assert "--env-seed 0 1 2 3 --split dev seen unseen " in evals[k]
        assert f"--out {tmp_path / 'run' / 'eval' / 'world{world}' / f'policy_{k}_{{split}}.jsonl'} " in evals[k]
    assert all("--env-seed" not in c for c in kitchen if "--greedy" not in c)  # training stays in world 0
    assert any("05_bppo.py" in c and "--out " + str(tmp_path / "run" / "policy_2") in c for c in kitchen)
    assert not any("policy_3" in c for c in kitchen)
    # the credit world's settings chosen on dev (docs/results.md, 'Tuning on dev') reach their stages
    every = commands(ALGOS="qevolve eto qlass rft outcome")
    bppo = [c for c in every if "05_bppo.py" in c]
    assert len(bppo) == 4 and all(c.endswith("--epochs 2") for c in bppo if "/outcome/" not in c)
    assert all(c.endswith("--epochs 2 --epochs 6 --kl-coef 0.025") for c in bppo if "/outcome/" in c)  # after BPPO's
    assert [c.endswith("--epochs 8") for c in every if "03_critic.py" in c] == [True, True]
    assert [c.endswith("--beta 0.3") for c in every if " eto.py " in c] == [True, True]
    assert [c.endswith("--epochs 24 --lr 1e-3") for c in every if "01_bc.py" in c and "/rft/" in c] == [True, True]
    assert sum("--candidates 32 " in c for c in every if "--rerank" in c) == 1
    assert all(c.endswith("--epochs 3") for c in commands(BPPO_ARGS="--epochs 3") if "05_bppo.py" in c)
    household = commands(ENV="household")
    assert not any("--epochs" in c for c in household if "05_bppo.py" in c and "outcome" not in c)
    miniature = '{"step_slack": [0, 1, 2], "n_distractors": 1, "habit": 0.8, "room_questions": 0.4}'
    assert all(f"--env-kwargs {miniature}" in c for c in household if "--env " in c)
    assert all("--env-seed 0 1 2 3 --split dev seen unseen " in c for c in household if "--greedy" in c)
    # shop plays its miniature (docs/environments.md, 'The shop miniature') with its own budgets, in world 0
    shop = commands(ENV="shop")
    shop_miniature = '{"page_size": 3, "max_steps": 10, "hasty": 0.5}'
    assert all(f"--env shop --env-kwargs {shop_miniature}" in c for c in shop if "--env " in c)
    assert all("--env-seed 0 --split dev seen unseen " in c for c in shop if "--greedy" in c)
    assert len([c for c in shop if "--greedy" in c]) == 3
    assert any("01_bc.py" in c and c.endswith("--epochs 4") for c in shop)
    assert any("03_critic.py" in c and c.endswith("--epochs 2") for c in shop)
    assert all(c.endswith("--max-new-tokens 64") for c in shop if "02_collect.py" in c and "--policy expert" not in c)
    assert any("01_bc.py" in c and c.endswith("--epochs 7") for c in commands(ENV="shop", BC_ARGS="--epochs 7"))
    assert all("--env-kwargs {}" in c for c in commands(ENV_KWARGS="{}") if "--env " in c)
    assert all("--env textworld --env-kwargs {}" in c for c in commands(ENV="textworld") if "--env " in c)


def test_the_baselines_commands_and_demos(tmp_path):
    """ALGOS eto: eto.py from pi_{k-1} with pi_ref = policy_0 on the buffer, evaluated greedily; qlass once: qlass.py's
    trees and QNet from policy_0, then policy_0 evaluated with the QNet's argmax of QLASS_M sampled replies; DEMOS=all
    keeps every demonstration; a bad DEMOS or QLASS_M is one error line."""
    env = {k: v for k, v in os.environ.items() if k not in SMOKE_VARS + ["SMOKE", "ALGOS", "DEMOS"]}
    env.update(RUN=str(tmp_path / "run"), BASE_CACHE=str(tmp_path / "base"), PYTHON="echo", ALGOS="eto qlass",
               DEMOS="all", QLASS_M="3")
    out = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True).stdout
    run, cmds = tmp_path / "run", [c for c in out.splitlines() if c.startswith("== echo")]
    assert any("--policy expert" in c and "--keep all " in c for c in cmds)
    eto = [c for c in cmds if c.startswith("== echo eto.py")]
    assert len(eto) == 2 and f"--policy {run / 'eto' / 'policy_1'} --ref {run / 'policy_0'} " in eto[1]
    assert f"--data {run / 'data' / 'expert.jsonl'} {run / 'eto' / 'iter_2' / 'self.jsonl'} " in eto[1]
    qlass = [c for c in cmds if "qlass" in c]
    assert len(qlass) == 2 and qlass[0].startswith(f"== echo qlass.py --policy {run / 'policy_0'} ")
    assert f"--rerank {run / 'qlass' / 'qnet'} --candidates 3 " in qlass[1] and "--greedy" not in qlass[1]
    for name, value in (("DEMOS", "some"), ("QLASS_M", "0"), ("ALGOS", "qevolve sac")):
        proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env={**env, name: value}, capture_output=True,
                              text=True)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {name} must be") and proc.stdout == ""


@pytest.mark.parametrize("algos", ["qevolve", pytest.param("qevolve eto qlass rft outcome", marks=pytest.mark.slow)])
def test_run_all_end_to_end_then_resume(algos, tmp_path):
    """The smoke chain with one iteration of Q-Evolve (--slow: of every method), evaluated in worlds 0 and 1; then
    resume."""
    run = tmp_path / "a run"  # a space in RUN: run_all.sh quotes every path
    out = run_all(run, K="1", ALGOS=algos)
    every = algos != "qevolve"
    bases = [p for p in (tmp_path / "base").iterdir() if p.is_dir()]  # the pretrained base, cached outside the run
    assert (tmp_path / "base" / "CACHEDIR.TAG").is_file()  # the cache's stamp: a folder run_all.sh made
    assert len(bases) == 1 and (bases[0] / "model.safetensors").exists()
    assert json.load(open(run / "policy_0" / "args.json"))["model"] == str(bases[0])
    for artifact in ["data/expert.jsonl", "policy_0/model.safetensors", "iter_1/self.jsonl",
                     "iter_1/critic/heads.safetensors", "iter_1/adv.jsonl", "policy_1/model.safetensors",
                     "eval/world0/policy_1_unseen.json", "eval/world1/policy_1_unseen.json", "results.md",
                     "metrics.jsonl"]:
        assert (run / artifact).exists(), artifact
    # Every step of the advantage buffer carries v and adv; the table has one row per policy.
    adv = [json.loads(line) for line in open(run / "iter_1/adv.jsonl")]
    assert all("v" in s and "adv" in s for ep in adv for s in ep["steps"])
    assert {ep["source"] for ep in adv} == {"expert", "self"}
    table = (run / "results.md").read_text()
    assert "policy_0 (BC)" in table and "policy_1 (Q-Evolve iter 1)" in table
    assert ("eto_policy_1 (ETO iter 1)" in table) == every
    assert ("qlass_policy_1 (QLASS: BC and its QNet, 2 candidates a step)" in table) == every
    # each policy's online env steps to date, from what it wrote: its own episodes, QLASS's trees
    online = {line.split(" | ")[0][2:]: int(line.split(" | ")[-1][:-2]) for line in table.splitlines()
              if line.startswith("| ") and "policy_" in line}
    own = json.load(open(run / "iter_1/self.json"))["env_steps"]
    assert online["policy_0 (BC)"] == 0 and online["policy_1 (Q-Evolve iter 1)"] == own
    if every:
        assert online["eto_policy_1 (ETO iter 1)"] == own
        trees = json.load(open(run / "qlass/trees.json"))
        assert next(v for k, v in online.items() if k.startswith("qlass")) == trees["env_steps"]
    expert = json.load(open(run / "data/expert.json"))
    assert f"Demonstrations: {expert['kept']} of the demonstrator's 16 train episodes (its successes)" in table
    # each split's success is the mean over the worlds, then each world's
    worlds = [json.load(open(run / f"eval/world{w}/policy_1_seen.json"))["success_rate"] for w in (0, 1)]
    row = next(line for line in table.splitlines() if line.startswith("| policy_1"))
    cells = row.split(" | ")
    assert cells[1] == f"{sum(worlds) / 2:.1%}" and cells[3] == " / ".join(f"{x:.0%}" for x in worlds)
    stages_logged = {json.loads(line)["stage"] for line in open(run / "metrics.jsonl")}
    stages = {"01_bc", "02_collect", "03_critic", "04_gae", "05_bppo"}
    assert stages_logged == (stages | {"eto", "qlass"} if every else stages)
    assert "Results:" in out
    # 04 reports the mean discounted return (on r_env) per source beside V, to read V's calibration.
    summary = [r for r in map(json.loads, open(run / "metrics.jsonl")) if r["stage"] == "04_gae"][-1]
    gamma, returns = json.load(open(run / "iter_1/critic/args.json"))["gamma"], []
    for ep in map(json.loads, open(run / "iter_1/self.jsonl")):  # by hand: g_t = r_env + gamma * g_{t+1}
        g, ep_returns = 0.0, []
        for s in reversed(ep["steps"]):
            g = s["r_env"] + gamma * g
            ep_returns.append(g)
        returns += ep_returns
    assert summary["critic_by_source"]["self"]["ret_mean"] == pytest.approx(sum(returns) / len(returns), abs=1e-6)

    # Resume: delete only the last artifact; the rerun redoes that stage and nothing else.
    mtimes = {p: os.path.getmtime(p) for p in run.rglob("*") if p.is_file()}
    (run / "eval/world1/policy_1_unseen.json").unlink()
    (run / "eval/world1/policy_1_unseen.jsonl").unlink()
    out = run_all(run, K="1")
    ran = [line for line in out.splitlines() if line.startswith("== ") and "skip" not in line]
    assert len(ran) == 1 and "--env-seed 1 --split unseen" in ran[0] and "policy_1" in ran[0], ran
    for p, t in mtimes.items():
        if p.exists() and p.name not in ("results.md", "metrics.jsonl") and "policy_1_unseen" not in p.name:
            assert os.path.getmtime(p) == t, f"{p} was rewritten"


def test_a_real_model_gets_one_gpus_budgets(tmp_path):
    """BASE=smollm2: SmolLM2 converted once (a stage like the others: skipped once it exists), BC starts
    from it, and each stage gets the real model's learning rates and batches; shop keeps its longer
    replies; a variable set by the caller wins; a model directory gets the same budgets."""
    def commands(**settings):
        env = {k: v for k, v in os.environ.items() if k not in SMOKE_VARS + ["SMOKE"]}
        env.update(PYTHON="echo", SMOLLM2_DIR=str(tmp_path / "smollm2"), **settings)
        proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [line for line in proc.stdout.splitlines() if line.startswith("== ")]
    run = tmp_path / "run"
    cmds = commands(BASE="smollm2", RUN=str(run))
    assert cmds[0] == f"== echo -m models.smollm2 --out {tmp_path / 'smollm2'} --threads 2"
    flags = {s: next(c for c in cmds if f"{s}.py" in c and "--policy expert" not in c) for s in
             ("01_bc", "02_collect", "03_critic", "05_bppo")}
    assert f"--model {tmp_path / 'smollm2'} " in flags["01_bc"] and flags["01_bc"].endswith("--lr 5e-5 --batch-size 16")
    assert flags["03_critic"].endswith("--lr 1e-5 --batch-size 16")
    assert flags["05_bppo"].endswith("--lr 2e-6 --batch-size 16") and flags["02_collect"].endswith("--num-envs 128")
    (tmp_path / "smollm2").mkdir()
    assert commands(BASE="smollm2", RUN=str(run))[0] == f"== skip (exists): {tmp_path / 'smollm2'}"  # converted once
    shop = commands(BASE="smollm2", ENV="shop", RUN=str(run), BPPO_ARGS="--lr 1e-6")
    collect = [c for c in shop if "02_collect.py --policy " + str(run) in c]
    assert collect and all(c.endswith("--num-envs 128 --max-new-tokens 64") for c in collect)
    assert any("05_bppo.py" in c and c.endswith("--lr 1e-6") for c in shop)
    mine = commands(BASE=str(tmp_path / "smollm2"), RUN=str(run))
    assert any("01_bc.py" in c and c.endswith("--lr 5e-5 --batch-size 16") for c in mine)


@pytest.mark.parametrize("name", ["SEED", "K", "N_EXPERT", "N_SELF", "N_EVAL", "THREADS", "NPROC", "KEEP_OLD", "SMOKE",
                                  "EVAL", "EVAL_WORLDS", "ENV"])
def test_a_setting_carrying_shell_code_is_refused_before_anything_runs(name, tmp_path):
    """Issue 52: bash evaluates $(...) inside $((...)): SEED='K[$(touch FILE)0]' ran the command. Every setting
    that reaches arithmetic or a command is checked first: one error line, exit 2, no command run, nothing made."""
    planted = tmp_path / "planted"
    env = {k: v for k, v in os.environ.items() if k not in SMOKE_VARS + ["SMOKE"]}
    env.update({"RUN": str(tmp_path / "run"), "BASE_CACHE": str(tmp_path / "base"), "PYTHON": "echo", "SMOKE": "1",
                name: f"K[$(touch {planted})0]"})
    proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:]
    assert proc.stderr.startswith(f"error: {name} must be") and proc.stderr.count("\n") == 1, proc.stderr
    assert not planted.exists() and os.listdir(tmp_path) == []


def test_ref_and_later_args_reach_05_from_the_second_iteration(tmp_path):
    """REF=prev anchors 05's KL to pi_{k-1}; LATER_ARGS are 05's extra flags at k > 1 only, for Q-Evolve and the
    outcome-level PG alike; a bad REF is one error line."""
    env = {k: v for k, v in os.environ.items() if k not in SMOKE_VARS + ["SMOKE", "ALGOS", "REF", "LATER_ARGS"]}
    env.update(RUN=str(tmp_path / "run"), BASE_CACHE=str(tmp_path / "base"), PYTHON="echo", REF="prev",
               LATER_ARGS="--lr 1e-4", ALGOS="qevolve outcome")
    out = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True).stdout
    bppo = [c for c in out.splitlines() if c.startswith("== echo 05_bppo.py")]
    run = tmp_path / "run"
    assert len(bppo) == 4
    for c in bppo:
        k = int(c.split("--out ")[1].split()[0][-1])
        prev = run / "policy_0" if k == 1 else (run if "outcome" not in c else run / "outcome") / "policy_1"
        assert f"--policy {prev} --ref {prev} " in c and c.endswith("--lr 1e-4") == (k == 2), c
    # household's default from iteration 2 on (chosen on dev), and LATER_ARGS= for none
    del env["LATER_ARGS"], env["REF"]
    for later, want in ((None, "--lr 1.5e-4 --kl-coef 0.1"), ("", None)):
        env.update(ENV="household", **({} if later is None else {"LATER_ARGS": later}))
        out = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True).stdout
        bppo = [c for c in out.splitlines() if c.startswith("== echo 05_bppo.py")]
        assert len(bppo) == 4, out[-2000:]
        later = [c.count(" --lr 1.5e-4 --kl-coef 0.1") for c in bppo]  # once, at iteration 2 only
        assert later == [int(bool(want) and "policy_2 " in c) for c in bppo], bppo
    env["REF"] = "pi0"
    proc = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: REF must be bc") and "== " not in proc.stdout
