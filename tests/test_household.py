"""The household environment against its rules (docs/design.md, 'Environments')."""
import collections
import random
import re

import pytest

import envs
from envs.household import NOTHING, TASK_TYPES, all_pairings, is_unseen_pairing


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


def test_slipping_expert_makes_mistakes_and_recovers():
    """expert_slip=p: about p of the demonstrator's commands are the mistakes a learned policy
    makes (each gives "Nothing happens." and changes nothing), the next command is the plan it
    had, and the tasks are still solved; text and action agree; the slips are reproducible."""
    clean, slipping = envs.make("household", seed=0), envs.make("household", seed=0, expert_slip=0.2)
    n_steps, n_slips, n_won = 0, 0, 0
    for tid in clean.task_ids("seen"):
        plan = run_expert(clean, tid)[3]
        slipping.reset(tid)
        done, actions, slips = False, [], []
        while not done:
            text, action = slipping.expert_text(), slipping.expert_action()
            assert text.split("\n")[-1] == f"Action: {action}"
            obs, reward, terminated, truncated, _ = slipping.step(action)
            done = terminated or truncated
            (slips if obs == NOTHING else actions).append(action)
            assert not obs == NOTHING or action.startswith(("take ", "go to "))
        n_steps += len(actions) + len(slips)
        n_slips += len(slips)
        n_won += terminated
        if terminated:  # without the slips, the same commands as the clean expert
            assert actions == [t.split("Action: ")[-1] for t in plan]
    assert 0.12 < n_slips / n_steps < 0.28
    assert n_won >= 95
    assert envs.make("household", seed=0, expert_slip=0.2).generate("seen/00003") == clean.generate("seen/00003")


def test_habit_examines_closed_receptacles_before_opening_them():
    """habit=p: on arriving at a closed receptacle it means to open, the demonstrator first
    tries `examine X` (about p of the time): "Nothing happens.", then `open X`; every other
    command is the clean expert's, and habit=1 does it at every such arrival, reproducibly."""
    clean, always, some = (envs.make("household", seed=0, habit=h) for h in (0.0, 1.0, 0.6))
    n_arrivals = {1.0: 0, 0.6: 0}
    n_habit = {1.0: 0, 0.6: 0}
    for tid in clean.task_ids("seen")[:40]:
        plan = [t.split("Action: ")[-1] for t in run_expert(clean, tid)[3]]
        for h, env in ((1.0, always), (0.6, some)):
            env.reset(tid)
            done, actions, prev = False, [], None
            while not done:
                text, action = env.expert_text(), env.expert_action()
                assert text.split("\n")[-1] == f"Action: {action}"
                arrived_closed = env.last_obs.startswith("You arrive at") and env.last_obs.endswith("is closed.")
                obs, reward, terminated, truncated, _ = env.step(action)
                done = terminated or truncated
                n_arrivals[h] += arrived_closed and action.startswith(("examine ", "open "))
                if action.startswith("examine "):
                    assert arrived_closed and obs == NOTHING
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


def test_habit_steps_repeats_the_examine_then_opens():
    """habit_steps=n: the habit examines n times in a row at the same arrival, then opens; the
    other commands are the clean expert's."""
    clean, twice = envs.make("household", seed=0), envs.make("household", seed=0, habit=1.0, habit_steps=2)
    n_runs = 0
    for tid in clean.task_ids("seen")[:30]:
        plan = [t.split("Action: ")[-1] for t in run_expert(clean, tid)[3]]
        twice.reset(tid)
        done, actions, run = False, [], 0
        while not done:
            action = twice.expert_action()
            obs, reward, terminated, truncated, _ = twice.step(action)
            done = terminated or truncated
            if action.startswith("examine "):
                assert obs == NOTHING
                run += 1
            else:
                if run:
                    assert run == 2 and action.startswith("open ")
                    n_runs += 1
                run = 0
                actions.append(action)
        assert terminated and actions == plan, tid
    assert n_runs > 10
    with pytest.raises(ValueError, match="habit_steps"):
        envs.make("household", habit_steps=0)


def test_privileged_expert_goes_straight_to_the_object():
    """expert="privileged" knows where everything is, as ALFWorld's planner does: with empty
    hands it only ever goes to a receptacle that holds the object it needs, it solves every
    task, in fewer steps than the searching expert, in the same worlds; bad values are refused."""
    search, privileged = envs.make("household", seed=0), envs.make("household", seed=0, expert="privileged")
    steps = {"search": 0, "privileged": 0}
    for tid in privileged.task_ids("seen"):
        g = privileged.generate(tid)
        assert g == search.generate(tid)
        privileged.reset(tid)
        terminated = truncated = False
        while not (terminated or truncated):
            action = privileged.expert_action()
            assert privileged.expert_text().split("\n")[-1] == f"Action: {action}"
            if action.startswith("go to ") and privileged.holding is None:
                here = privileged.where
                assert any(r == action[6:] and o.rsplit(" ", 1)[0] == g["object"] for o, r in here.items()), (tid, action)
            _, _, terminated, truncated, _ = privileged.step(action)
        assert terminated, tid
        steps["privileged"] += privileged.t
        steps["search"] += run_expert(search, tid)[2]
    assert steps["privileged"] < steps["search"]
    with pytest.raises(ValueError, match="expert must be"):
        envs.make("household", expert="oracle")


def test_random_order_expert_searches_without_the_prior():
    """expert="random" visits receptacles in a random order: it still solves every task, its
    first receptacle is the search expert's first much less often, and it needs more steps."""
    search, rand = envs.make("household", seed=0), envs.make("household", seed=0, expert="random")
    same_first, steps = 0, {"search": 0, "random": 0}
    for tid in rand.task_ids("seen"):
        won, _, n, texts = run_expert(rand, tid)
        assert won, tid
        plan = run_expert(search, tid)[3]
        same_first += texts[0].split("Action: ")[-1] == plan[0].split("Action: ")[-1]
        steps["random"] += n
        steps["search"] += len(plan)
    assert same_first < 40
    assert steps["random"] > 1.2 * steps["search"]


def test_plan_thoughts_list_the_receptacles_the_search_visits():
    """thoughts="plan" writes the search order out, as ReAct's ALFWorld prompts do: every `go to`
    of a search visits the next receptacle of the last plan, the actions are the default
    expert's, and the default text has no plan."""
    short, plan = envs.make("household", seed=0), envs.make("household", seed=0, thoughts="plan")
    n_plans = 0
    for tid in plan.task_ids("seen"):
        won, _, _, texts = run_expert(plan, tid)
        default = run_expert(short, tid)[3]
        assert won, tid
        assert [t.split("Action: ")[-1] for t in texts] == [t.split("Action: ")[-1] for t in default]
        assert not any(" in turn, starting with " in t for t in default)
        todo = None  # the current plan while a search lasts
        for text in texts:
            action = text.split("Action: ")[-1]
            if " I check " in text:
                todo = text.split(" I check ")[1].split(" in turn, starting with ")[0].split(", ")
                assert text.split(" in turn, starting with ")[1].startswith(f"{todo[0]}.\n")
                n_plans += 1
            elif text.startswith("Thought: "):
                todo = None  # a new phase ends the search
            if todo is not None and action.startswith("go to "):
                assert action == f"go to {todo.pop(0)}", (tid, text)
    assert n_plans >= 100  # every task opens with a search
    with pytest.raises(ValueError, match="thoughts must be"):
        envs.make("household", thoughts="long")


def test_ground_thoughts_restate_the_listing_against_the_goal():
    """thoughts="ground" adds, at every receptacle the search has looked into, a thought that
    names the goal object and says whether the last observation holds one - "I look for a mug:
    not here." or "... mug 2 is here. Next, I take it." - on top of the plan; the actions are
    the default expert's."""
    short, ground = envs.make("household", seed=0), envs.make("household", seed=0, thoughts="ground")
    n_not, n_here = 0, 0
    for tid in ground.task_ids("dev"):
        obs, info = ground.reset(tid)
        default = run_expert(short, tid)[3]
        texts, done = [], False
        while not done:
            text = ground.expert_text()
            texts.append(text)
            if ": not here." in text or " is here. Next, I " in text:
                want = text.split("I look for a ")[1].split(":")[0]
                listed = [o.rsplit(" ", 1)[0] for o in re.findall(r"\ban? ([a-z]+ \d+)", obs)]
                if ": not here." in text:
                    assert want not in listed, (tid, obs, text)
                    n_not += 1
                else:
                    name = text.split(f"a {want}: ")[1].split(" is here")[0]
                    assert name.rsplit(" ", 1)[0] == want and name in obs, (tid, obs, text)
                    n_here += 1
            obs, _, terminated, truncated, _ = ground.step(text.split("Action: ")[-1])
            done = terminated or truncated
        assert [t.split("Action: ")[-1] for t in texts] == [t.split("Action: ")[-1] for t in default]
    assert n_not >= 50 and n_here >= 80


def test_sweep_expert_walks_the_room_listing_from_a_random_start():
    """expert="sweep" searches the receptacles in the order the room lists them, from a start
    drawn per task, wrapping around (and skipping the place the object must go to): every `go
    to` of the first search is the next listed receptacle after the last one. It solves every
    task within the default limit, and its first receptacle varies across tasks."""
    sweep = envs.make("household", seed=0, expert="sweep")
    starts = collections.Counter()
    for tid in sweep.task_ids("seen"):
        obs0, info = sweep.reset(tid)
        won, _, _, texts = run_expert(sweep, tid)
        assert won, tid
        g = sweep.generate(tid)
        order = [r for r in g["receptacles"] if not (g["task_type"] != "look_at_obj_in_light"
                                                     and r == f"{g['target']} 1")]
        goes = []
        for text in texts:
            if text.startswith("Thought: ") and "I need to find" not in text and ": not here." not in text:
                break  # the first search is over
            if " go to " in f" {text.split('Action: ')[-1]}":
                goes.append(text.split("Action: go to ")[-1])
        starts[g["receptacles"].index(goes[0])] += 1
        for a, b in zip(goes, goes[1:]):
            assert order[(order.index(a) + 1) % len(order)] == b, (tid, goes)
    assert len(starts) >= 6 and max(starts.values()) < 40


def test_restate_thoughts_are_the_ground_thoughts_without_the_plan():
    """thoughts="restate": the same restatements as "ground" ("I look for a mug: not here."),
    no search plan; the actions are unchanged."""
    ground, restate = (envs.make("household", seed=0, thoughts=t) for t in ("ground", "restate"))
    n_restated = 0
    for tid in restate.task_ids("dev"):
        with_plan, texts = run_expert(ground, tid)[3], run_expert(restate, tid)[3]
        assert [re.sub(r" I check .* in turn, starting with [a-z]+ \d+\.", "", t) for t in with_plan] == texts
        assert not any(" I check " in t for t in texts)
        n_restated += sum(": not here." in t or " is here. Next, I " in t for t in texts)
    assert n_restated >= 150


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
