"""The real environments (ScienceWorld, TextWorld, ALFWorld) through the TextEnv API.

Each test uses short episodes; the whole file takes about a minute on 2 cores. A missing
package skips its tests, except under CI=true, where CI has installed
requirements-envs.txt and a missing package is a failure.
"""
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def need(module, program=None):
    """Import `module` (and find `program` on PATH) or skip; under CI=true, fail instead."""
    try:
        mod = importlib.import_module(module)
        missing = None if program is None or shutil.which(program) else f"program {program!r} not on PATH"
    except ImportError as err:
        mod, missing = None, f"package {module!r} not installed ({err})"
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and {missing}: CI must install requirements-envs.txt (and Java for ScienceWorld)")
        pytest.skip(f"{missing}: pip install -r requirements-envs.txt")
    return mod


def run_expert(env, task_id):
    """Play the env's expert from reset; returns (rewards, last info, terminated, truncated, observations)."""
    obs, info = env.reset(task_id)
    assert info["task"] and obs
    rewards, observations = [], [obs]
    terminated = truncated = False
    while not (terminated or truncated):
        obs, reward, terminated, truncated, info = env.step(env.expert_action())
        rewards.append(reward)
        observations.append(obs)
    return rewards, info, terminated, truncated, observations


def assert_success(env, rewards, info, terminated, truncated):
    assert terminated and not truncated and rewards[-1] > 0, info
    assert info["won"] and len(rewards) <= env.max_steps
    assert sum(rewards) == pytest.approx(1.0)


def test_registry_is_lazy():
    assert {"sciworld", "textworld", "alfworld"} <= set(envs.REGISTRY)
    code = ("import sys, envs; "
            "bad = [m for m in ('scienceworld', 'textworld', 'alfworld', 'py4j') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ---------------------------------------------------------------- ScienceWorld
SW_TASKS = ["lifespan-longest-lived", "find-living-thing", "power-component"]  # ids go round-robin over these


@pytest.fixture(scope="module")
def sw():
    need("scienceworld", "java")
    env = envs.make("sciworld", tasks=SW_TASKS, max_per_task=4)
    yield env
    env.close()


def test_sciworld_expert_succeeds(sw):
    for tid in ["train/00000", "train/00001", "seen/00000", "unseen/00002"]:
        rewards, info, terminated, truncated, _ = run_expert(sw, tid)
        assert_success(sw, rewards, info, terminated, truncated)
        assert info["score"] == 100
    assert [sw.task_of(t)[0] for t in ["train/00000", "train/00001", "train/00002"]] == SW_TASKS


def test_sciworld_splits_are_the_simulator_variations(sw):
    for task in SW_TASKS:
        per_split = [{v for t, v in (sw.task_of(i) for i in sw.task_ids(s)) if t == task} for s in sw.splits]
        assert all(per_split) and not (per_split[0] & per_split[1] or per_split[0] & per_split[2]
                                       or per_split[1] & per_split[2])
    with pytest.raises(ValueError, match="train, seen, unseen"):
        sw.task_ids("test")
    with pytest.raises(ValueError, match="indices 0..11"):
        sw.reset("train/00012")
    with pytest.raises(ValueError, match="find-animal"):
        envs.make("sciworld", tasks=["no-such-task"])


def test_sciworld_invalid_rule_and_failure(sw):
    sw.reset("train/00001")  # find a living thing, variation 0
    obs, reward, terminated, truncated, _ = sw.step("dance wildly")
    assert obs == "No known action matches that input." and sw.is_invalid(obs)
    assert reward == 0 and not (terminated or truncated)
    assert sw.is_invalid("Unknown action.  Type 'help' for a list of actions, and 'objects' for a list of ...")
    assert not sw.is_invalid("Ambiguous request: Please enter the number for the action you intended "
                             "(or blank to cancel):")
    obs, reward, terminated, _, info = sw.step("open door to greenhouse")  # partial credit
    assert not sw.is_invalid(obs) and reward == pytest.approx(info["score"] / 100) and reward > 0 and not terminated
    # Focusing on a non-living thing fails the task for good (score -100): the episode ends,
    # and its last reward takes back the partial credit, so the episode is worth 0.
    obs, reward2, terminated, truncated, info = sw.step("focus on door to greenhouse")
    assert terminated and info["failed"] and not info["won"] and info["score"] == -100
    assert reward2 == pytest.approx(-reward)


def test_sciworld_crashed_jvm_fails_the_episode_and_restarts(sw):
    sw.reset("train/00000")
    pid = sw._proc.pid
    os.kill(pid, signal.SIGKILL)
    sw._proc.wait(timeout=10)
    obs, reward, terminated, truncated, info = sw.step("look around")
    assert info["crashed"] and truncated and not terminated and reward == 0
    rewards, info, terminated, truncated, _ = run_expert(sw, "train/00000")  # a fresh JVM
    assert_success(sw, rewards, info, terminated, truncated)
    assert sw._proc.pid != pid


def test_sciworld_close_ends_the_jvm():
    need("scienceworld", "java")
    env = envs.make("sciworld", tasks=["lifespan-longest-lived"], max_per_task=1)
    env.reset("train/00000")
    proc = env._proc
    env.close()
    env.close()  # safe twice
    assert proc.poll() is not None


# ---------------------------------------------------------------- TextWorld
TW_SMALL = dict(train_settings={"nb_rooms": (1, 2), "nb_objects": (2, 4), "quest_length": (1, 2)},
                unseen_settings={"nb_rooms": (3,), "nb_objects": (4,), "quest_length": (3,)},
                n_train=3, n_seen=2, n_unseen=2)


@pytest.fixture(scope="module")
def tw_cache(tmp_path_factory):
    need("textworld")
    return str(tmp_path_factory.mktemp("tw-cache"))


@pytest.fixture(scope="module")
def tw(tw_cache):
    env = envs.make("textworld", cache_dir=tw_cache, **TW_SMALL)
    yield env
    env.close()


def test_textworld_expert_succeeds(tw, tw_cache):
    for split in tw.splits:
        for tid in tw.task_ids(split):
            rewards, info, terminated, truncated, observations = run_expert(tw, tid)
            assert_success(tw, rewards, info, terminated, truncated)
            assert not any("$$$$" in o for o in observations)  # banner stripped
    walk = envs.make("textworld", cache_dir=tw_cache, expert="walkthrough", **TW_SMALL)
    assert_success(walk, *run_expert(walk, "unseen/00001")[:4])
    walk.close()


def test_textworld_games_are_cached_beside_their_json(tw, tw_cache):
    path = tw.game_file("train/00000")
    assert os.path.isfile(path[:-3] + ".json")
    stamp = os.path.getmtime(path)
    other = envs.make("textworld", cache_dir=tw_cache, **TW_SMALL)
    t0 = time.time()
    assert other.game_file("train/00000") == path and time.time() - t0 < 0.5
    assert os.path.getmtime(path) == stamp
    assert not [d for d in os.listdir(os.path.dirname(os.path.dirname(path))) if d.startswith(".tmp")]


def test_textworld_splits(tw):
    specs = {s: [tw.spec(t) for t in tw.task_ids(s)] for s in tw.splits}
    seeds = [sp["game_seed"] for s in specs for sp in specs[s]]
    assert len(seeds) == len(set(seeds))
    assert all(sp["quest_length"] in (1, 2) for sp in specs["train"] + specs["seen"])
    assert all(sp["quest_length"] == 3 and sp["nb_rooms"] == 3 for sp in specs["unseen"])
    with pytest.raises(ValueError, match="must differ"):
        envs.make("textworld", train_settings=TW_SMALL["train_settings"],
                  unseen_settings=TW_SMALL["train_settings"])


def test_textworld_invalid_rule(tw):
    obs, info = tw.reset("train/00000")
    assert info["task"] not in obs
    for bad, answer in [("dance", "That's not a verb I recognise."), ("take unicorn", "You can't see any such thing."),
                        ("", "I beg your pardon?")]:
        obs, reward, terminated, truncated, _ = tw.step(bad)
        assert obs == answer and tw.is_invalid(obs) and reward == 0 and not terminated, bad
    obs, *_ = tw.step("look")
    assert not tw.is_invalid(obs)
    obs, *_ = tw.step(tw.expert_action())
    assert not tw.is_invalid(obs)


# ---------------------------------------------------------------- ALFWorld
@pytest.fixture(scope="module")
def alf_dirs(tmp_path_factory):
    data = tmp_path_factory.mktemp("alfworld-data")
    old = os.environ.get("ALFWORLD_DATA")
    os.environ["ALFWORLD_DATA"] = str(data)  # importing alfworld creates this folder
    try:
        need("alfworld")
        yield str(data), str(tmp_path_factory.mktemp("alf-cache"))
    finally:
        if old is None:
            os.environ.pop("ALFWORLD_DATA", None)
        else:
            os.environ["ALFWORLD_DATA"] = old


@pytest.fixture(scope="module")
def alf(alf_dirs):
    env = envs.make("alfworld", games="tiny", cache_dir=alf_dirs[1], n_train=3, n_seen=2, n_unseen=2)
    yield env
    env.close()


def test_alfworld_tiny_games_run_on_the_real_engine(alf):
    for split in alf.splits:
        for tid in alf.task_ids(split):
            rewards, info, terminated, truncated, observations = run_expert(alf, tid)
            assert_success(alf, rewards, info, terminated, truncated)
            assert rewards[:-1] == [0.0] * (len(rewards) - 1) and rewards[-1] == 1.0
            assert observations[0].startswith("You are in the middle of a room.")
    with open(alf.game_file("train/00000")) as f:
        game = json.load(f)
    assert game["solvable"] and game["walkthrough"] and "(:domain alfred)" in game["pddl_problem"]


def test_alfworld_tiny_splits_hold_out_pairings(alf):
    from envs._common import is_unseen_pairing
    for split in alf.splits:
        for tid in alf.task_ids(split):
            _, obj, goal, _, _ = alf.tiny_spec(tid)
            assert is_unseen_pairing(obj, goal) == (split == "unseen")


def test_alfworld_invalid_rule(alf):
    alf.reset("train/00001")
    obs, reward, terminated, truncated, _ = alf.step("fly to the moon")
    assert obs == "Nothing happens." and alf.is_invalid(obs) and reward == 0 and not terminated
    obs, *_ = alf.step("look")
    assert not alf.is_invalid(obs)


def test_alfworld_parse_cache_keeps_observations(alf):
    from envs.alfworld_env import enable_parse_cache
    try:
        enable_parse_cache(False)
        slow = run_expert(alf, "seen/00000")[4]
    finally:
        enable_parse_cache(True)
    assert run_expert(alf, "seen/00000")[4] == slow


def test_alfworld_handcoded_expert(alf_dirs):
    env = envs.make("alfworld", games="tiny", cache_dir=alf_dirs[1], expert="handcoded", n_train=40)
    tid = next(t for t in env.task_ids("train") if env.tiny_spec(t)[0] == "pick_and_place_simple")
    rewards, info, terminated, truncated, _ = run_expert(env, tid)
    assert_success(env, rewards, info, terminated, truncated)
    env.close()


def test_alfworld_data_layout(alf, alf_dirs, tmp_path):
    with pytest.raises(ValueError, match="games='tiny'"):
        envs.make("alfworld", data_dir=str(tmp_path))
    # Lay tiny games out like the official data: json_2.1.1/<split>/<task>/<trial>/.
    root = tmp_path / "json_2.1.1"
    layout = {"train/00000": "train", "train/00001": "train", "seen/00000": "valid_seen", "seen/00001": "valid_unseen"}
    for i, (tid, folder) in enumerate(layout.items()):
        dest = root / folder / f"{alf.tiny_spec(tid)[0]}-x-{i}" / "trial_1"
        shutil.copytree(os.path.dirname(alf.game_file(tid)), dest)
    game_path = dest / "game.tw-pddl"  # mark the valid_unseen game unsolvable: it must be skipped
    game = json.loads(game_path.read_text())
    game["solvable"] = False
    game_path.write_text(json.dumps(game))
    env = envs.make("alfworld", data_dir=str(tmp_path))
    assert [len(env.task_ids(s)) for s in env.splits] == [2, 1, 0]
    rewards, info, terminated, truncated, _ = run_expert(env, "seen/00000")
    assert_success(env, rewards, info, terminated, truncated)
    env.close()


def test_real_envs_leave_home_alone(tmp_path):
    """TextWorld's Inform 7 writes ~/Inform, and importing alfworld creates ~/.cache/alfworld: a game built, the
    missing data refused and a tiny game played under a fresh HOME leave it empty (all goes into the cache)."""
    need("textworld")
    need("alfworld")
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    code = ("import envs\n"
            f"envs.make('textworld', cache_dir={str(cache)!r}, n_train=1).game_file('train/00000')\n"
            "try:\n    envs.make('alfworld')\nexcept ValueError as e:\n    assert 'not found' in str(e), e\n"
            f"envs.make('alfworld', games='tiny', cache_dir={str(cache)!r}, n_train=1).reset('train/00000')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ALFWORLD_DATA", "QEVOLVE_CACHE", "XDG_CACHE_HOME")}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**env, "HOME": str(home)})
    assert list(home.iterdir()) == []


def run_lockstep(pool, task_ids):
    """Step several instances alternately (as the collector does); returns how many won."""
    for env, tid in zip(pool, task_ids):
        env.reset(tid)
    live, wins = list(pool), 0
    while live:
        for env in list(live):
            _, reward, terminated, truncated, _ = env.step(env.expert_action())
            if terminated or truncated:
                wins += terminated and reward > 0
                live.remove(env)
    return wins


def test_instances_in_lockstep_are_independent(tw_cache, alf_dirs):
    pool = [envs.make("textworld", cache_dir=tw_cache, **TW_SMALL) for _ in range(3)]
    assert run_lockstep(pool, ["train/00000", "train/00001", "unseen/00000"]) == 3
    pool = [envs.make("alfworld", games="tiny", cache_dir=alf_dirs[1], n_train=3, n_seen=2, n_unseen=2)
            for _ in range(3)]
    assert run_lockstep(pool, ["train/00000", "train/00001", "unseen/00000"]) == 3
