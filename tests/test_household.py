"""The household environment against its rules (docs/design.md, 'Environments')."""
import collections
import random
import re

import pytest

import envs
from envs._common import is_unseen_pairing
from envs.household import MAX_RECEPTACLES, NOTHING, TASK_TYPES, HouseholdEnv, all_pairings


@pytest.fixture(scope="module")
def env():
    return envs.make("household", seed=0)


def run_expert(env, task_id):
    obs, info = env.reset(task_id)
    texts, terminated, truncated = [], False, False
    while not (terminated or truncated):
        texts.append(env.expert_text())
        obs, reward, terminated, truncated, _ = env.step(env.expert_action())
    return terminated, reward, env.t, texts


@pytest.mark.parametrize("split", ["train", "dev", "seen", "unseen"])
def test_expert_solves_every_task_within_the_step_limit(env, split):
    for tid in env.task_ids(split):
        won, reward, steps, _ = run_expert(env, tid)
        assert won and reward == 1.0 and steps <= env.max_steps, tid


def test_expert_writes_react_text(env):
    _, _, _, texts = run_expert(env, "train/00000")
    assert texts[0].startswith("Thought: ") and "\nAction: " in texts[0]
    assert any(t.startswith("Action: ") for t in texts)  # bare actions where the plan holds
    assert all(t.split("\n")[-1].startswith("Action: ") for t in texts)


def test_random_policy_rarely_succeeds(env):
    rng = random.Random(0)
    wins = 0
    tids = env.task_ids("seen")
    for tid in tids:
        env.reset(tid)
        terminated = truncated = False
        while not (terminated or truncated):
            _, _, terminated, truncated, _ = env.step(env.random_action(rng))
        wins += terminated
    assert wins / len(tids) < 0.05  # measured: 0 of 100 with seed 0


def test_same_task_id_gives_the_same_episode():
    a, b = envs.make("household", seed=0), envs.make("household", seed=0)
    for tid in ["train/00007", "unseen/00003"]:
        assert a.reset(tid) == b.reset(tid)
        assert run_expert(a, tid) == run_expert(b, tid)
    c = envs.make("household", seed=1)
    assert any(c.generate(t) != a.generate(t) for t in a.task_ids("seen")[:10])


def test_splits_are_disjoint_by_the_pairing_rule(env):
    def world(g):
        return (g["task"], tuple(sorted((r, tuple(o)) for r, o in g["contents"].items())))
    pairs, worlds = {}, {}
    for split in ["train", "dev", "seen", "unseen"]:
        gens = [env.generate(t) for t in env.task_ids(split)]
        pairs[split] = {(g["object"], "desklamp" if g["task_type"] == "look_at_obj_in_light" else g["target"])
                        for g in gens}
        worlds[split] = {world(g) for g in gens}
    for a, b in [("train", "dev"), ("train", "seen"), ("dev", "seen"), ("dev", "unseen")]:
        assert not worlds[a] & worlds[b], (a, b)  # no task in two splits
    assert all(not is_unseen_pairing(*p) for p in pairs["train"] | pairs["dev"] | pairs["seen"])
    assert all(is_unseen_pairing(*p) for p in pairs["unseen"])
    assert pairs["seen"] <= pairs["train"] and pairs["dev"] <= pairs["train"]


def grammar(env):
    """Every command of the grammar over this room's names, canonical forms."""
    g = env._task
    recs = g["receptacles"]
    objs = sorted(set(o for objs in g["contents"].values() for o in objs))
    cmds = ["inventory", "look"]
    for r in recs:
        cmds += [f"go to {r}", f"open {r}", f"close {r}", f"examine {r}"]
        for o in objs:
            cmds += [f"take {o} from {r}", f"put {o} in/on {r}", f"clean {o} with {r}",
                     f"heat {o} with {r}", f"cool {o} with {r}"]
    return cmds + [f"use {o}" for o in objs] + [f"examine {o}" for o in objs]


@pytest.mark.slow
def test_admissible_actions_are_exactly_the_valid_commands():
    """At states along expert and random episodes: every admissible command does something,
    and every command of the grammar that does something is admissible."""
    import copy
    env = envs.make("household", seed=0)
    rng = random.Random(0)
    checked = 0
    for tid in env.task_ids("train")[:12]:
        env.reset(tid)
        for t in range(12):
            if env.done:
                break
            admissible = env.admissible_actions()
            assert len(admissible) == len(set(admissible))
            valid = set()
            for cmd in grammar(env):
                probe = copy.deepcopy(env)
                probe.step(cmd)
                if not probe.is_invalid(probe.last_obs):
                    valid.add(cmd)
            assert set(admissible) == valid, (tid, t, set(admissible) ^ valid)
            checked += 1
            env.step(env.expert_action() if t % 2 == 0 else rng.choice(admissible))
    assert checked > 80


def test_every_task_type_occurs_in_every_split(env):
    for split in ["train", "dev", "seen", "unseen"]:
        types = collections.Counter(env.generate(t)["task_type"] for t in env.task_ids(split))
        assert set(types) == set(TASK_TYPES), (split, types)
    for task_type in TASK_TYPES:  # both kinds of pairing exist for each type
        flags = {is_unseen_pairing(o, g) for t, o, g in all_pairings() if t == task_type}
        assert flags == {True, False}, task_type


def test_invalid_commands_return_nothing_happens(env):
    obs, _ = env.reset("train/00000")
    g = env.generate("train/00000")
    closed = next(r for r in g["receptacles"] if r.startswith("cabinet"))
    for bad in ["fly to the moon", "go to spaceship 1", "take mug 9 from countertop 1",
                f"open {closed}",  # not there yet
                "put apple 1 in/on fridge 1", "use desklamp 1", "clean mug 1 with sinkbasin 1", ""]:
        obs, reward, terminated, truncated, _ = env.step(bad)
        assert obs == NOTHING and env.is_invalid(obs) and reward == 0.0, bad
    obs, *_ = env.step(f"go to {closed}")
    assert obs == f"You arrive at {closed}. The {closed} is closed."
    assert env.step(f"go to {closed}")[0] == NOTHING  # already there
    assert env.step(f"open {closed}")[0].startswith(f"You open the {closed}. The {closed} is open. In it, you see ")
    assert env.step(f"open {closed}")[0] == NOTHING  # already open
    assert not env.is_invalid("You arrive at countertop 1. On the countertop 1, you see nothing.")


def test_closed_receptacles_hide_contents_until_opened(env):
    for tid in env.task_ids("train")[:50]:
        env.reset(tid)
        g = env.generate(tid)
        full = [r for r in g["receptacles"] if r.startswith(("fridge", "cabinet", "drawer")) and g["contents"][r]]
        if full:
            rec = full[0]
            obs = env.step(f"go to {rec}")[0]
            assert g["contents"][rec][0] not in obs
            obs = env.step(f"open {rec}")[0]
            assert all(o in obs for o in g["contents"][rec])
            return
    pytest.fail("no closed receptacle with contents in 50 tasks")


def test_step_limit_truncates(env):
    env.reset("train/00001")
    for i in range(env.max_steps):
        _, reward, terminated, truncated, _ = env.step("look")
        assert not terminated and reward == 0.0
        assert truncated == (i == env.max_steps - 1)
    with pytest.raises(RuntimeError):
        env.step("look")


# A hand-made room: mug 1 waits in the closed cabinet 1; the task is to put it on shelf 1. The demonstrator
# searches the cabinet first (OBJECT_LOCATIONS["mug"]): go to cabinet 1, open cabinet 1, take mug 1 from
# cabinet 1, go to shelf 1, put mug 1 in/on shelf 1 - 5 steps; its habit adds `examine cabinet 1` - 6.
HAND_MADE = {"task_id": "train/00000", "task_type": "pick_and_place", "object": "mug", "target": "shelf",
             "task": "put a mug in shelf 1.", "contents": {"cabinet 1": ["mug 1"], "countertop 1": ["apple 1"]},
             "receptacles": ["cabinet 1", "countertop 1", "drawer 1", "fridge 1", "microwave 1", "shelf 1",
                             "sinkbasin 1"]}


def play(env, actions=()):
    """Reset to the hand-made task, play `actions`, then the demonstrator; (won, steps)."""
    env.reset("train/00000")
    info = {"won": False}
    for a in actions:
        info = env.step(a)[4]
    while not env.done:
        info = env.step(env.expert_action())[4]
    return info["won"], env.t


@pytest.mark.parametrize("slack, habit, wasted, won, steps", [
    (0, 0.0, 0, True, 5),    # the clean demonstrator needs exactly its solution length
    (0, 1.0, 0, False, 5),   # its habit's one wasted step costs the episode at slack 0...
    (1, 1.0, 0, True, 6),    # ...and not at slack 1
    (1, 0.0, 1, True, 6),    # any wasted step counts the same: one `look` first
    (1, 1.0, 1, False, 6),   # the habit and a `look`: two wasted steps at slack 1
    (2, 1.0, 1, True, 7)])
def test_step_slack_sets_the_limit_from_the_solution_length(monkeypatch, slack, habit, wasted, won, steps):
    monkeypatch.setattr(HouseholdEnv, "generate", lambda self, task_id: {**HAND_MADE, "task_id": task_id})
    env = HouseholdEnv(step_slack=[slack], habit=habit)
    assert env.solution_length("train/00000") == 5
    assert play(env, ["look"] * wasted) == (won, steps)
    assert env.max_steps == 5 + slack  # the current task's limit
    capped = HouseholdEnv(step_slack=[slack], habit=habit, max_steps=4)  # max_steps stays the cap
    assert play(capped) == (False, 4) and capped.max_steps == 4


def test_step_slack_gives_every_task_its_own_limit():
    """On generated tasks: the limit follows each task's solution length, which varies with the search,
    plus a slack that a hash of the task id draws from the list - the same on every reset, and with
    [0, 1, 2] each value on about a third of the tasks."""
    env = HouseholdEnv(step_slack=[0, 1, 2], n_distractors=1)
    spare = collections.Counter()
    for tid in env.task_ids("dev"):
        env.reset(tid)
        limit = env.max_steps
        while not env.done:
            env.step(env.expert_action())
        assert env._success() and env.max_steps == limit  # the clean demonstrator wins within every limit
        spare[limit - env.t] += 1
        env.reset(tid)
        assert env.max_steps == limit
    assert set(spare) == {0, 1, 2} and min(spare.values()) > 20


def test_unknown_names_say_what_is_valid(env):
    with pytest.raises(ValueError, match="household"):
        envs.make("no-such-env")
    with pytest.raises(ValueError, match="train, dev, seen, unseen"):
        env.task_ids("test")
    with pytest.raises(ValueError, match="indices 0..99"):
        env.reset("seen/00100")
    with pytest.raises(ValueError, match="expected '<split>/<index>'"):
        env.reset("banana")


def test_malformed_commands_never_raise(env):
    """Fragments of the grammar in any order (what a half-trained model writes) are just invalid."""
    rng = random.Random(0)
    words = ["put", "take", "go", "to", "in/on", "in", "on", "from", "with", "clean", "heat", "cool", "use",
             "open", "close", "examine", "mug", "1", "countertop", "desklamp", "", "in/on mug 1"]
    env.reset("train/00000")
    for _ in range(3000):
        if env.done:
            env.reset("train/00000")
        cmd = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        obs, *_ = env.step(cmd)
        assert isinstance(obs, str) and obs
    for cmd in ["put in/on countertop 1", "put ", "take from countertop 1", "clean with sinkbasin 1", "heat with"]:
        env.reset("train/00000")
        assert env.step(cmd)[0] == NOTHING, cmd


def test_habit_examines_closed_receptacles_before_opening_them():
    """habit=p: on arriving at a closed receptacle it means to open, the demonstrator first
    does `examine X` (about p of the time): "The X is closed." - a valid step, not "Nothing happens." -
    then `open X`; every other command is the clean expert's, and habit=1 does it at every such
    arrival, reproducibly."""
    clean, always, some = (envs.make("household", seed=0, habit=h) for h in (0.0, 1.0, 0.6))
    n_arrivals = {1.0: 0, 0.6: 0}
    n_habit = {1.0: 0, 0.6: 0}
    for tid in clean.task_ids("seen")[:40]:
        plan = [t.split("Action: ")[-1] for t in run_expert(clean, tid)[3]]
        for h, env in ((1.0, always), (0.6, some)):
            env.reset(tid)
            done, actions = False, []
            while not done:
                text, action = env.expert_text(), env.expert_action()
                assert text.split("\n")[-1] == f"Action: {action}"
                arrived_closed = env.last_obs.startswith("You arrive at") and env.last_obs.endswith("is closed.")
                obs, reward, terminated, truncated, _ = env.step(action)
                done = terminated or truncated
                n_arrivals[h] += arrived_closed and action.startswith(("examine ", "open "))
                if action.startswith("examine "):
                    assert arrived_closed and obs == f"The {action[8:]} is closed." and not env.is_invalid(obs)
                    n_habit[h] += 1
                    assert env.expert_action() == f"open {action[8:]}"  # then it opens it
                else:
                    actions.append(action)
            assert terminated and actions == plan, (h, tid)
    assert n_habit[1.0] == n_arrivals[1.0] > 20  # habit 1: every time
    assert 0.4 < n_habit[0.6] / n_arrivals[0.6] < 0.8
    again = envs.make("household", seed=0, habit=0.6)
    assert [run_expert(again, t)[3] for t in clean.task_ids("seen")[:5]] == \
           [run_expert(some, t)[3] for t in clean.task_ids("seen")[:5]]


def test_room_questions_answer_from_the_room_and_the_position():
    """room_questions=1: every reading question is about the room or where the agent stands, and
    its answer is right; room_questions=0 (the default) asks none of them."""
    env, plain = envs.make("household", seed=0, room_questions=1.0), envs.make("household", seed=0)
    rng, kinds = random.Random(0), collections.Counter()
    for tid in env.task_ids("train")[:20]:
        obs0, _ = env.reset(tid)
        recs = set(re.findall(r"\ban? ([a-z]+ \d+)", obs0))
        here, looked, done = None, set(), False
        while not done:
            for _ in range(3):
                q, a = env.reading_question(rng)
                if q == "Question: where are you?":
                    assert a == (f"Answer: at {here}." if here else "Answer: in the middle of the room.")
                elif q.startswith("Question: is there a "):
                    asked = q[len("Question: is there a "):-len(" in the room?")]
                    assert a == f"Answer: {'yes' if asked in recs else 'no'}."
                else:
                    assert q == "Question: which receptacles have you not looked into yet?"
                    todo = sorted(recs - looked - {here})
                    assert sorted(a[len("Answer: "):-1].split(", ")) == (todo or ["none"])
                kinds[q.split()[1]] += 1
            action = env.expert_action()
            obs, _, term, trunc, _ = env.step(action)
            done = term or trunc
            if action.startswith("go to ") and obs.startswith("You arrive"):
                here = action[len("go to "):]
            if "you see" in obs and here is not None:
                looked.add(here)
    assert len(kinds) == 3 and min(kinds.values()) > 20
    plain.reset(plain.task_ids("train")[0])
    asked = {plain.reading_question(rng)[0] for _ in range(200)}
    assert not any("room" in q or q == "Question: where are you?" for q in asked)


@pytest.mark.parametrize("key, value", [
    ("max_steps", 0), ("max_steps", -5), ("n_distractors", -1), ("n_receptacles", 7), ("n_receptacles", 21),
    ("n_train", 0), ("n_dev", 0), ("n_seen", -1), ("n_unseen", 0),
    ("habit", -0.1), ("habit", 1.5), ("habit", float("nan")), ("room_questions", -1), ("room_questions", 2.0),
    ("step_slack", [-1]), ("step_slack", [101]), ("step_slack", [1.5]), ("step_slack", [True])])
def test_nonsense_keyword_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"household: {key} must be"):
        envs.make("household", **{key: value})


def test_the_edges_of_every_range_are_accepted():
    env = envs.make("household", n_receptacles=MAX_RECEPTACLES, n_distractors=0, max_steps=1, n_train=1, n_dev=1,
                    n_seen=1, n_unseen=1, habit=1, room_questions=1.0)
    assert len(env.generate("train/00000")["receptacles"]) == MAX_RECEPTACLES == 20  # the fullest room
    assert [len(env.task_ids(s)) for s in env.splits] == [1, 1, 1, 1]
    env.reset("unseen/00000")
    assert env.step(env.expert_action())[3]  # truncated after one step
    assert len(envs.make("household", n_receptacles=8).generate("train/00000")["receptacles"]) >= 8
