"""research/failure_modes.py classifies the first mistake of an episode; checked on hand-made episodes."""
import json
import os
import subprocess
import sys

from conftest import ROOT, load_module

fm = load_module("research/failure_modes.py", "failure_modes")

OBS0 = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, and a fridge 1."


def step(action, obs, label="ok"):
    return {"action": action, "obs": obs, "label": label}


def episode(steps, success=False):
    return {"obs0": OBS0, "steps": steps, "success": success}


def test_first_mistake_categories():
    arrive = step("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a egg 1.")
    nothing = "Nothing happens."
    assert fm.first_mistake(episode([arrive])) is None
    assert fm.first_mistake(episode([arrive, step("take bowl 1 from countertop 1", nothing, "invalid")])) == \
        (1, "take: object not in last obs")
    assert fm.first_mistake(episode([arrive, step("take egg 2 from countertop 1", nothing, "invalid")])) == \
        (1, "take: object in last obs")
    assert fm.first_mistake(episode([step("go to garbagecan 1", nothing, "invalid")])) == \
        (0, "go: receptacle not in room")
    assert fm.first_mistake(episode([arrive, step("go to countertop 1", nothing, "invalid")])) == (1, "go: already there")
    assert fm.first_mistake(episode([step(None, "Invalid reply.", "format")])) == (0, "format")
    # only the first mistake counts; a later one does not change the category
    two = episode([arrive, step("put egg 1 in/on fridge 1", nothing, "invalid"),
                   step("go to sinkbasin 1", nothing, "invalid")])
    assert fm.first_mistake(two) == (1, "put")


def test_summary_counts_recoveries():
    arrive = step("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a egg 1.")
    bad = step("take bowl 1 from countertop 1", "Nothing happens.", "invalid")
    s = fm.summarize([episode([arrive], True), episode([arrive], False), episode([bad, arrive], True),
                      episode([bad], False), episode([bad], False)])
    assert (s["episodes"], s["success"], s["clean"], s["clean_success"], s["mistaken"], s["recovered"]) == \
        (5, 2, 2, 1, 3, 1)
    assert s["first_mistake"] == {"take: object not in last obs": 3}


td = load_module("research/take_decision.py", "take_decision")


def test_take_decisions_are_read_only_after_a_contents_listing_with_empty_hands():
    assert td.goal_object("put a clean mug in shelf 1.") == "mug"
    assert td.goal_object("put two spoon in drawer 1.") == "spoon"
    assert td.goal_object("look at book under the desklamp.") == "book"
    nothing = "Nothing happens."
    steps = [
        step("go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed."),
        step("open cabinet 1", "You open the cabinet 1. The cabinet 1 is open. In it, you see a apple 1."),
        step("take mug 1 from cabinet 1", nothing, "invalid"),            # decision: not listed, take
        step("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a mug 2."),
        step("examine countertop 1", "On the countertop 1, you see a mug 2."),  # decision: listed, other
        step("take mug 2 from countertop 1", "You pick up the mug 2 from the countertop 1."),  # after examine: none
        step("go to sinkbasin 1", "You arrive at sinkbasin 1. On the sinkbasin 1, you see a mug 3."),
        step("take mug 3 from sinkbasin 1", nothing, "invalid"),          # holding: none
    ]
    for t, s in enumerate(steps):
        s["adv"] = float(t)
    ep = dict(episode(steps), task="put a clean mug in shelf 1.")
    assert td.take_decisions(ep) == [(2, False, True, 2.0), (4, True, False, 4.0)]


def test_oracle_decision_advantages_mark_only_the_self_take_decisions(tmp_path):
    """research/oracle_adv.py --kind decision: +1 on a right take decision, -1 on a wrong one, 0 on
    every other step and on every expert step."""
    nothing = "Nothing happens."
    steps = [
        step("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a egg 1."),
        step("take mug 1 from countertop 1", nothing, "invalid"),               # wrong: -1
        step("go to cabinet 1", "You arrive at cabinet 1. On the cabinet 1, you see a mug 2."),
        step("take mug 2 from cabinet 1", "You pick up the mug 2 from the cabinet 1."),  # right: +1
        step("go to shelf 1", "You arrive at shelf 1. On the shelf 1, you see nothing."),  # holding: 0
    ]
    self_ep = dict(episode(steps), task="put a mug in shelf 1.", source="self")
    expert_ep = dict(episode([dict(s) for s in steps[2:]]), task="put a mug in shelf 1.", source="expert")
    buf, out = tmp_path / "adv.jsonl", tmp_path / "oracle.jsonl"
    buf.write_text(json.dumps(self_ep) + "\n" + json.dumps(expert_ep) + "\n")
    subprocess.run([sys.executable, os.path.join(ROOT, "research", "oracle_adv.py"), "--data", str(buf),
                    "--kind", "decision", "--out", str(out)], check=True, capture_output=True)
    got = [[s["adv"] for s in json.loads(line)["steps"]] for line in out.read_text().splitlines()]
    assert got == [[0.0, -1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_auc_ceiling_leave_one_out_and_task_kind():
    ac = load_module("research/auc_ceiling.py", "auc_ceiling")
    eps = [{"task_id": "a", "success": s} for s in (True, True, False)] + \
          [{"task_id": "b", "success": s} for s in (False, True)]
    # each episode is predicted by the other episodes of its task only
    assert ac.leave_one_out_rates(eps) == [0.5, 0.5, 1.0, 1.0, 0.0]
    assert ac.task_kind("put a clean mug in shelf 1.") == "clean"
    assert ac.task_kind("put two spoon in drawer 1.") == "two"
    assert ac.task_kind("look at book under the desklamp.") == "look"
    assert ac.task_kind("put a mug in shelf 1.") == "place"


def test_shared_histories_stop_where_the_policy_leaves_the_expert():
    """research/shared_histories.py: the comparison runs while the self episode repeats the expert's
    actions on the same task, takes the first other action, and stops there; a self episode on
    a task without an expert episode, and --self-only style data, give nothing."""
    sh = load_module("research/shared_histories.py", "shared_histories")

    def ep(task_id, source, actions, advs):
        return {"task_id": task_id, "source": source,
                "steps": [{"action": a, "adv": v} for a, v in zip(actions, advs)]}
    buf = [ep("t1", "expert", ["go a", "take x", "go b", "put x"], [0.1, 0.2, 0.3, 0.4]),
           ep("t1", "self", ["go a", "take y", "go c"], [-0.1, -0.5, 0.9]),    # parts at step 1
           ep("t1", "self", ["go a", "take x"], [0.0, 0.05]),                  # never parts
           ep("t2", "self", ["go a"], [7.0])]                                  # no expert on t2
    assert sh.shared_history_advantages(buf) == ([0.1, 0.2, 0.1, 0.2], [-0.1, 0.0, 0.05], [-0.5])
    assert sh.shared_history_advantages([b for b in buf if b["source"] == "self"]) == ([], [], [])


def test_oracle_start_marks_only_the_first_go_of_self_episodes(tmp_path):
    """research/oracle_adv.py --kind start: +1 when a self episode's first `go to` is the object's
    most likely receptacle kind in the room (OBJECT_LOCATIONS: a tomato is likeliest in a fridge),
    -1 when it is another kind, 0 on every later step and on every expert step; the target's kind
    is never the likely one (the generator never places the object there)."""
    go = lambda r: step(f"go to {r}", f"You arrive at {r}. On the {r}, you see nothing.")  # noqa: E731
    eps = [dict(episode([go("fridge 1"), go("cabinet 1")]), task="put a tomato in cabinet 1.", source="self"),
           dict(episode([go("countertop 1"), go("fridge 1")]), task="put a tomato in cabinet 1.", source="self"),
           dict(episode([go("countertop 1")]), task="put a tomato in fridge 1.", source="self"),  # fridge = target
           dict(episode([go("countertop 1")]), task="put a tomato in cabinet 1.", source="expert")]
    buf, out = tmp_path / "adv.jsonl", tmp_path / "oracle.jsonl"
    buf.write_text("".join(json.dumps(e) + "\n" for e in eps))
    subprocess.run([sys.executable, os.path.join(ROOT, "research", "oracle_adv.py"), "--data", str(buf),
                    "--kind", "start", "--out", str(out)], check=True, capture_output=True)
    got = [[s["adv"] for s in json.loads(line)["steps"]] for line in out.read_text().splitlines()]
    assert got == [[1.0, 0.0], [-1.0, 0.0], [1.0], [0.0]]
    sc = load_module("research/start_ceiling.py", "start_ceiling")
    assert sc.likely_receptacle("put a tomato in cabinet 1.", OBS0) == "fridge 1"
    assert sc.likely_receptacle("put a tomato in fridge 1.", OBS0) == "countertop 1"


def test_habit_rate_reads_only_the_step_after_arriving_at_a_closed_receptacle():
    hr = load_module("research/habit_rate.py", "habit_rate")
    ep = {"obs0": "You are in the middle of a room.", "steps": [
        {"action": "go to cabinet 1", "obs": "You arrive at cabinet 1. The cabinet 1 is closed.", "adv": 0.1},
        {"action": "examine cabinet 1", "obs": "Nothing happens.", "adv": -0.2},
        {"action": "open cabinet 1", "obs": "You open the cabinet 1. The cabinet 1 is open. In it, you see nothing.", "adv": 0.0},
        {"action": "go to drawer 1", "obs": "You arrive at drawer 1. The drawer 1 is closed.", "adv": 0.0},
        {"action": "open drawer 1", "obs": "You open the drawer 1. The drawer 1 is open. In it, you see a mug 1.", "adv": 0.3},
        {"action": "go to countertop 1", "obs": "You arrive at countertop 1. On the countertop 1, you see nothing.", "adv": 0.0},
        {"action": "go to fridge 1", "obs": "You arrive at fridge 1. The fridge 1 is closed.", "adv": 0.0},
        {"action": "", "obs": "Your reply had no 'Action:' line.", "adv": -0.5}]}
    assert hr.closed_arrivals(ep) == [("examine", -0.2), ("open", 0.3), ("other", -0.5)]


def test_critic_calibration_against_hand_computed_returns():
    cc = load_module("research/critic_calibration.py", "critic_calibration")

    def st(r_env, r_aux, v, adv):
        return {"r_env": r_env, "r_aux": r_aux, "v": v, "adv": adv}
    won = {"source": "self", "success": True, "steps": [st(0.0, -0.1, 0.9, 0.1), st(1.0, 0.0, 0.9, 0.1)]}
    lost = {"source": "self", "success": False, "steps": [st(0.0, 0.0, 0.8, 0.0), st(0.0, 0.0, 0.7, -0.7)]}
    expert = {"source": "expert", "success": True, "steps": [st(1.0, 0.0, 1.0, 0.0)]}
    assert cc.returns_to_go(won["steps"], 0.5) == [-0.1 + 0.5 * 1.0, 1.0]
    r = cc.calibration([won, lost, expert], gamma=0.5)
    # self returns: 0.4, 1.0, 0, 0 (mean 0.35); self V: 0.9, 0.9, 0.8, 0.7 (mean 0.825)
    assert r["self"]["n_states"] == 4 and abs(r["self"]["ret_mean"] - 0.35) < 1e-9
    assert abs(r["self"]["bias"] - 0.475) < 1e-9
    assert r["self"]["last_adv_failed"] == -0.7 and r["self"]["last_adv_success"] == 0.1
    assert r["expert"]["bias"] == 0.0 and r["expert"]["last_adv_failed"] is None


def test_habit_ceiling_replaces_the_habit_and_nothing_else(monkeypatch):
    """The demonstrator with habit=1 as the 'policy': forced, it must do exactly what the clean
    demonstrator does (same success on every task, no examine left); unforced it keeps the habit."""
    import envs
    hc = load_module("research/habit_ceiling.py", "habit_ceiling")
    kw = {"max_steps": 9, "n_distractors": 1}
    env, clean = envs.make("household", seed=0, habit=1.0, **kw), envs.make("household", seed=0, **kw)
    monkeypatch.setattr(hc, "reply", lambda *a: f"Action: {env.expert_action()}")
    tids = env.task_ids("dev")[:30]
    wins = {}
    for force in (False, True):
        mistakes, episodes = hc.Counter(), []
        wins[force] = [hc.run(None, None, env, tid, force, 48, mistakes, episodes) for tid in tids]
        assert (mistakes["examine at a closed receptacle"] > 10) == (not force)
        assert mistakes["go: receptacle not in room"] == mistakes["go: already there"] == 0
        steps = [s for e in episodes for s in e["steps"]]
        assert [e["success"] for e in episodes] == wins[force]
        assert all(s["label"] == ("invalid" if s["action"].startswith("examine") else "ok") for s in steps)
        forced = [s for s in steps if s["forced"]]
        assert all(s["action"].startswith("open ") and s["text"] == f"Action: {s['action']}" for s in forced)
        assert (len(forced) > 10) == force
    expected = []
    for tid in tids:
        clean.reset(tid)
        done = r = 0
        while not done and clean.t < clean.max_steps:
            _, r, done, _, _ = clean.step(clean.expert_action())
        expected.append(bool(done and r > 0))
    assert wins[True] == expected and sum(wins[True]) > sum(wins[False])
