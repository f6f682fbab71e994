"""kitchen, the credit world, against its rules (envs/kitchen.py's docstring)."""
import os
import random
import statistics

import pytest

import envs
from conftest import ROOT, load_module
from envs.kitchen import FLAWS, INGREDIENTS, NOTHING, TOOLS, is_unseen_pairing, judge


def play(env, task_id, choose):
    """One episode: choose(env) -> a command, until the episode ends -> (observations, reward, steps)."""
    obs, _ = env.reset(task_id)
    seen, reward = [obs], 0.0
    while not env.done:
        obs, reward, *_ = env.step(choose(env))
        seen.append(obs)
    return seen, reward, env.t


def good(env):
    g = env._task
    return f"use {g['kinds'][env.station]} {3 - g['flawed'][env.station]}"


def first(env):  # what greedy behavior cloning copies: item 1, the other one after a tool was put back
    return good(env) if env.put_back else f"use {env._task['kinds'][env.station]} 1"


def find(env, test, split="train"):
    return next(t for t in env.task_ids(split) if test(env.generate(t)))


def test_a_flawed_ingredient_shows_at_once_and_may_spoil_the_dish():
    env = envs.make("kitchen", decisions=1, outage=0.0, spoil=1.0)
    tid = find(env, lambda g: g["kinds"][0] in INGREDIENTS)
    g = env.generate(tid)
    kind, bad = g["kinds"][0], g["flawed"][0]
    obs, reward, steps = play(env, tid, lambda e: f"use {kind} {bad}")
    assert obs[0].endswith(f"You see {kind} 1 and {FLAWS[kind]} {kind} 2." if bad == 2 else
                           f"You see {FLAWS[kind]} {kind} 1 and {kind} 2.")
    assert obs[1] == f"You add the {FLAWS[kind]} {kind} {bad}. It smells bad. The {g['dish']} is ruined."
    assert (reward, steps) == (0.0, 1)
    assert play(env, tid, good)[1] == 1.0
    lucky = envs.make("kitchen", decisions=1, outage=0.0, spoil=0.0)  # a flaw that happens not to spoil it
    assert play(lucky, tid, lambda e: f"use {kind} {bad}")[1] == 1.0


def test_a_flawed_tool_is_put_back_at_the_cost_of_a_step_and_a_second_try_is_a_repeat():
    env = envs.make("kitchen", decisions=2, outage=0.0)
    tid = find(env, lambda g: g["kinds"][0] in TOOLS)
    g = env.generate(tid)
    kind, bad = g["kinds"][0], g["flawed"][0]
    obs0, _ = env.reset(tid)
    obs1, r, done, cut, _ = env.step(f"use {kind} {bad}")
    assert obs1.startswith(f"The {FLAWS[kind]} {kind} {bad} is no use; you put it back. Next: {kind}.")
    assert (r, done, cut, env.station) == (0.0, False, False, 0)
    assert env.step(f"use {kind} {bad}")[0] == obs1  # 02's retro_label: `repeat`
    assert env.expert_action() == f"use {kind} {3 - bad}"  # the demonstrator takes the other one
    nothing = env.step("use nothing 1")[0]
    assert nothing == f"{NOTHING} Next: {kind}. {obs1.split(f'Next: {kind}. ')[1]}" and env.is_invalid(nothing)
    assert env.step(good(env))[0].startswith(f"You use the {kind} {3 - bad}. Next: {g['kinds'][1]}.")


def test_the_outage_is_announced_and_ruins_the_dish_whatever_the_agent_does():
    env = envs.make("kitchen", decisions=3, outage=1.0)
    for tid in env.task_ids("dev")[:20]:
        at = env.generate(tid)["outage_at"]
        obs, reward, steps = play(env, tid, good)
        assert reward == 0.0 and steps == at and obs[-1].endswith(f"The power goes out. The "
                                                                   f"{env._task['dish']} is ruined.")
    assert all(envs.make("kitchen", outage=0.0).generate(t)["outage_at"] is None for t in env.task_ids("dev"))


def test_the_good_item_always_succeeds_without_an_outage_and_no_budget_is_hidden():
    for d in (1, 4, 6):
        env = envs.make("kitchen", decisions=d)
        for tid in env.task_ids("dev"):
            obs, reward, steps = play(env, tid, good)
            assert reward == (0.0 if env._task["outage_at"] else 1.0) and steps <= d
            assert play(env, tid, lambda e: e.expert_action())[2] < env.max_steps == 3 * d + 2  # never reached


def test_the_demonstrator_slips_at_its_known_rate_and_its_mode_is_the_flaw_where_item_1_is_flawed():
    env = envs.make("kitchen", careless=0.7)
    used = {1: [], 2: []}  # where item 1 / item 2 is flawed: did the demonstrator's first try take the flawed one?
    for tid in env.task_ids("train"):
        env.reset(tid)
        while not env.done:
            bad, first_try = env._task["flawed"][env.station], not env.put_back
            cmd = env.expert_action()
            if first_try and cmd[-1] in "12":  # its choice, after a fumble or a look if any
                used[bad].append(cmd.endswith(str(bad)))
            env.step(cmd)
    assert statistics.mean(used[1]) == pytest.approx(0.7, abs=0.03) and statistics.mean(used[2]) == 0.0
    slip = (sum(used[1]) + sum(used[2])) / (len(used[1]) + len(used[2]))
    assert slip == pytest.approx(0.35, abs=0.02)


def test_wasted_steps_are_labelled_at_their_stated_rates_and_never_cost_the_dish():
    """02's retrospective labels (format > invalid > repeat > ok, from the next observation) on the demonstrator's
    train episodes: `invalid` at about `slip` of the stations, `repeat` at about (1 - slip) * `relook`; and a
    fumble or a look changes nothing but the step count: the same choices win or lose the same way."""
    env = envs.make("kitchen")
    labels, stations = {"ok": 0, "invalid": 0, "repeat": 0}, 0
    for tid in env.task_ids("train"):
        prev = env.reset(tid)[0]
        while not env.done:
            obs = env.step(env.expert_action())[0]
            labels["invalid" if env.is_invalid(obs) else "repeat" if obs == prev else "ok"] += 1
            prev = obs
        stations += env.station + (not env._task["outage_at"] and env.station < env.decisions)
    assert labels["invalid"] / stations == pytest.approx(0.1, abs=0.02)
    assert labels["repeat"] / stations == pytest.approx(0.9 * 0.1, abs=0.02)
    clean = envs.make("kitchen", slip=0.0, relook=0.0, outage=0.0)
    for tid in clean.task_ids("dev")[:50]:
        fumbles = lambda e: f"use {e._task['kinds'][e.station]} 3" if e.tries == 0 else ("look" if e.tries == 1
                                                                                          else good(e))
        assert play(clean, tid, fumbles)[1:] == (1.0, 3 * clean.decisions)
        assert play(clean, tid, lambda e: e.expert_action())[1] == play(envs.make(
            "kitchen", outage=0.0), tid, lambda e: e.expert_action())[1]


def test_look_restates_what_is_in_view():
    env = envs.make("kitchen")
    obs0, _ = env.reset("dev/00000")
    kind = env._task["kinds"][0]
    assert env.step("look")[0] == obs0  # the offer was in view: the same text, a `repeat`
    nothing = env.step(f"use {kind} 3")[0]
    assert nothing.startswith(NOTHING) and env.step("look")[0] == nothing[len(NOTHING) + 1:]  # the offer, new text


def test_several_decisions_successes_with_recovered_mistakes_and_failures_of_mostly_good_steps():
    """The default world, as the demonstrator plays it (the expert buffer) on `train`: 4 decisions an episode;
    some successes hold a flaw (recovered tool, lucky ingredient), which success filtering copies; most failures
    are mostly good steps."""
    env = envs.make("kitchen")
    wins_with_flaw, fails_mostly_good, n_win, n_fail = 0, 0, 0, 0
    for tid in env.task_ids("train"):
        prev, kinds, reward = env.reset(tid)[0], [], 0.0
        while not env.done:
            cmd = env.expert_action()
            kinds.append(judge(prev, cmd))
            prev, reward = env.step(cmd)[:2]
        harmful = kinds.count("harmful")
        if reward:
            n_win, wins_with_flaw = n_win + 1, wins_with_flaw + (harmful > 0)
        else:
            n_fail, fails_mostly_good = n_fail + 1, fails_mostly_good + (kinds.count("correct") > harmful)
    assert env.decisions >= 3
    assert 0.1 < wins_with_flaw / n_win < 0.9 and fails_mostly_good / n_fail > 0.5


def test_greedy_copying_of_the_demonstrators_mode_lands_between_30_and_60_percent_on_dev():
    """What the default world asks of BC: its demonstrator's most common reply succeeds on 30-60% of `dev` tasks
    in each of the four worlds (the optimum, the good item always, loses only the outages)."""
    for world in range(4):
        env = envs.make("kitchen", seed=world)
        mode = statistics.mean(play(env, t, first)[1] for t in env.task_ids("dev"))
        best = statistics.mean(play(env, t, good)[1] for t in env.task_ids("dev"))
        assert 0.3 <= mode <= 0.6 and best >= 0.85, (world, mode, best)


def record(env, task_id, choose):
    """One episode in 02's format (the keys bayes_values and behaviour read), and its discounted returns G_t."""
    obs0, _ = env.reset(task_id)
    steps = []
    while not env.done:
        cmd = choose(env)
        obs, r, *_ = env.step(cmd)
        steps.append({"action": cmd, "obs": obs, "r_env": r, "label": "ok"})
    returns, g = [], 0.0
    for s in reversed(steps):
        g = s["r_env"] + 0.95 * g
        returns.insert(0, g)
    return {"task": env._task["task"], "obs0": obs0, "steps": steps}, returns


def test_the_bayes_critic_by_hand_and_against_monte_carlo_returns():
    from envs.kitchen import bayes_values, behaviour
    one = envs.make("kitchen", decisions=1, outage=0.0, spoil=1.0)
    tid = find(one, lambda g: g["kinds"][0] in INGREDIENTS and g["flawed"][0] == 1)
    ep, _ = record(one, tid, good)
    assert bayes_values(ep, 0.95, {1: 0.7, 2: 0.2}, 1.0, decisions=1, spoil=1.0, outage=0.0) == [
        pytest.approx(1 - 0.7)]  # the flawed egg 1 taken 70% of the time spoils the dish: V = 0.3
    gamma, p, rng = 0.95, {1: 0.7, 2: 0.2}, random.Random(0)

    def policy(e):  # at a fresh station a fumble 10% of the time, then the flawed item with probability p[n]
        g, i = e._task, e.station
        if e.tries == 0 and rng.random() < 0.1:
            return f"use {g['kinds'][i]} 3"
        return good(e) if e.put_back or rng.random() >= p[g["flawed"][i]] else f"use {g['kinds'][i]} {g['flawed'][i]}"
    data = [record(env, t, policy) for world in range(4) for env in [envs.make("kitchen", seed=world)]
            for t in env.task_ids("train")]
    taken, wasted = behaviour([ep for ep, _ in data], gamma)
    assert taken[1] == pytest.approx(0.7, abs=0.02) and taken[2] == pytest.approx(0.2, abs=0.02)
    assert wasted == pytest.approx(0.9 + 0.1 * gamma, abs=0.003)
    groups = {}  # states the agent cannot tell apart in these features: mean G_t - V*(s_t) is 0 in each
    for ep, returns in data:
        v = bayes_values(ep, gamma, p, 0.9 + 0.1 * gamma)
        bad = 0
        for t, s in enumerate(ep["steps"]):
            groups.setdefault((min(t, 5), bad), []).append(returns[t] - v[t])
            bad += "It smells bad." in s["obs"]
    for key, diff in groups.items():
        if len(diff) > 200:
            assert abs(statistics.mean(diff)) < 3 * statistics.stdev(diff) / len(diff) ** 0.5 + 0.005, key
    alls = [d for diff in groups.values() for d in diff]
    assert abs(statistics.mean(alls)) < 0.01


def test_splits_share_no_task_and_unseen_holds_out_pairings():
    env = envs.make("kitchen")
    tasks = {s: {(g["dish"], tuple(g["kinds"]), tuple(g["flawed"])) for g in map(env.generate, env.task_ids(s))}
             for s in env.splits}
    assert not tasks["train"] & tasks["dev"] and not tasks["train"] & tasks["seen"]
    for s, ts in tasks.items():
        held = [any(is_unseen_pairing(dish, k) for k in kinds) for dish, kinds, _ in ts]
        assert all(held) if s == "unseen" else not any(held)


def test_judge_and_the_grammar():
    assert judge("Next: egg. You see rotten egg 1 and egg 2.", "use egg 1") == "harmful"
    assert judge("The dirty bowl 1 is no use; you put it back. Next: bowl. You see dirty bowl 1 and bowl 2.",
                 "use bowl 2") == "correct"
    assert judge("Next: bowl. You see dirty bowl 1 and bowl 2.", "use bowl 1") == "recoverable"  # put back
    assert judge("Next: egg. You see rotten egg 1 and egg 2.", "look") is None
    assert judge("Next: egg. You see rotten egg 1 and egg 2.", "use milk 1") is None
    for cmd in ("use egg 3", "use egg 0", "use egg one", "use egg -1", "use egg", "use  egg 1 2"):
        assert judge("Next: egg. You see rotten egg 1 and egg 2.", cmd) is None, cmd  # "Nothing happens."
    assert judge("Nothing happens. Next: egg. You see rotten egg 1 and egg 2.", "use egg  2") == "correct"
    assert judge("Nothing happens.", "use egg 2") is None
    # envs.judge, what 04, show_credit.py and bench/seeds.py call: kitchen's judge, None for a world without one
    assert envs.judge("kitchen", "Next: egg. You see rotten egg 1 and egg 2.", "use egg 1") == "harmful"
    assert envs.judge("household", "Next: egg. You see rotten egg 1 and egg 2.", "use egg 1") is None
    assert envs.judge(None, "Next: egg. You see rotten egg 1 and egg 2.", "use egg 1") is None
    env = envs.make("kitchen")
    env.reset("train/00000")
    assert all(env.step(c)[0] != NOTHING or c == "look" for c in env.admissible_actions()[:1])
    rng = random.Random(0)
    assert all(isinstance(env.random_action(rng), str) for _ in range(10))
    with pytest.raises(ValueError, match="decisions"):
        envs.make("kitchen", decisions=0)


@pytest.mark.parametrize("kwargs", [{"decisions": 12}, {"decisions": 2.5}, {"decisions": True}, {"seed": "abc"},
                                    {"slip": 1.5}, {"relook": float("nan")}])
def test_a_value_no_split_can_be_made_with_is_refused_at_construction(kwargs):
    from envs.kitchen import MAX_DECISIONS, KitchenEnv
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        KitchenEnv(**kwargs)
    env = KitchenEnv(decisions=MAX_DECISIONS)  # the largest value: every split has its tasks, drawn in finite time
    assert all(len(env.generate(env.task_ids(s)[0])["kinds"]) == MAX_DECISIONS for s in env.splits)
    with pytest.raises(ValueError, match="bad task id"):
        env.reset("train/ 5")


def test_under_the_papers_demonstrations_the_flaw_stays_the_mode_at_the_chosen_careless():
    """DEMOS=success keeps the demonstrator's successes alone (the paper's D_expert). Simulating the demonstrator
    (bench/demos.py): at the environment's own careless 0.7 the flawed ingredient is no longer the kept demonstrations'
    mode where item 1 is flawed (the successes mostly took the good one), at run_all.sh's 0.85 it is (the rule: the
    smallest careless of the grid with a share of at least 0.65), while greedy copying of the mode still lands between
    30% and 60% on dev and the outage and the recoverable tools stay."""
    demos = load_module(os.path.join(ROOT, "bench", "demos.py"), "bench_demos")
    flipped, kept = demos.properties(0.7), demos.properties(0.85)
    assert flipped["share_all"] > 0.5 > flipped["share_success"]
    assert kept["share_success"] >= 0.65 and 0.3 <= kept["item1_dev"] <= 0.6 and 400 < kept["kept"] < 600
    assert all(demos.properties(c)["share_success"] < 0.65 for c in (0.75, 0.8))  # 0.85 is the smallest that holds
    env = envs.make("kitchen", careless=0.85)
    assert env.outage == 0.1 and any(env.generate(t)["outage_at"] for t in env.task_ids("train"))
    wins = [ep for ep in demos.demonstrations(env) if ep[0]]
    assert any(kind in TOOLS and flawed == choice for _, stations in wins for kind, flawed, choice in stations)
