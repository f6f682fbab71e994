"""bench/mistakes.py: the habit rate and the first mistake of each episode, on hand-made episodes; kitchen's looks and
its Bayes A*."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, load_module

mistakes = load_module("bench/mistakes.py", "mistakes")

OBS0 = ("You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, "
        "and a fridge 1.")
ARRIVE = {"action": "go to countertop 1", "obs": "You arrive at countertop 1. On the countertop 1, you see a egg 1.",
          "label": "ok"}
NOTHING = "Nothing happens."


def episode(steps, success=False):
    return {"obs0": OBS0, "steps": steps, "success": success}


def bad(action, label="invalid"):
    return {"action": action, "obs": NOTHING, "label": label}


def printed(tmp_path, episodes):
    """(path, stdout) of `bench/mistakes.py path` on these episodes written as a JSONL file."""
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path, subprocess.run([sys.executable, "bench/mistakes.py", str(path)], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout


def test_closed_arrivals_read_only_the_step_after_arriving_at_a_closed_receptacle():
    def s(action, obs, adv):
        return {"action": action, "obs": obs, "adv": adv}
    ep = {"obs0": "You are in the middle of a room.", "steps": [
        s("go to cabinet 1", "You arrive at cabinet 1. The cabinet 1 is closed.", 0.1),
        s("examine cabinet 1", NOTHING, -0.2),
        s("open cabinet 1", "You open the cabinet 1. The cabinet 1 is open. In it, you see nothing.", 0.0),
        s("go to drawer 1", "You arrive at drawer 1. The drawer 1 is closed.", 0.0),
        s("open drawer 1", "You open the drawer 1. The drawer 1 is open. In it, you see a mug 1.", 0.3),
        s("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see nothing.", 0.0),
        s("go to fridge 1", "You arrive at fridge 1. The fridge 1 is closed.", 0.0),
        s("", "Your reply had no 'Action:' line.", -0.5)]}
    assert mistakes.closed_arrivals(ep) == [("examine", -0.2), ("open", 0.3), ("other", -0.5)]


def test_first_mistake_kinds():
    fm = mistakes.first_mistake
    assert fm(episode([ARRIVE])) is None
    assert fm(episode([ARRIVE, bad("take bowl 1 from countertop 1")])) == "take: object not in last obs"
    assert fm(episode([ARRIVE, bad("take egg 2 from countertop 1")])) == "take: object in last obs"
    assert fm(episode([bad("go to garbagecan 1")])) == "go: receptacle not in room"
    assert fm(episode([ARRIVE, bad("go to countertop 1")])) == "go: already there"
    assert fm(episode([bad(None, "format")])) == "format"
    assert fm(episode([bad("examine cabinet 1")])) == "examine"
    # only the first mistake counts
    assert fm(episode([ARRIVE, bad("put egg 1 in/on fridge 1"), bad("go to sinkbasin 1")])) == "put"


def test_the_printed_line_counts_habit_mistakes_and_recoveries(tmp_path):
    closed = {"action": "go to cabinet 1", "obs": "You arrive at cabinet 1. The cabinet 1 is closed.", "label": "ok"}
    take = bad("take bowl 1 from countertop 1")
    eps = [episode([closed, bad("examine cabinet 1"), ARRIVE], True), episode([closed, ARRIVE], True),
           episode([ARRIVE], False), episode([take, ARRIVE], True), episode([take], False)]
    path, out = printed(tmp_path, eps)
    assert out == (f"{path}: success 3/5; at a closed receptacle: examine 1, open 0, other 1 (habit rate 0.50); "
                   "with a mistake 3 (recovered 2), first mistake: take: object not in last obs 2, "
                   "examine: the habit 1\n")


def test_shop_line_counts_copies_and_hasty_purchases(tmp_path):
    """On shop episodes: product clicks naming an id of the results page just read, searches that are
    a span of the instruction, and purchases with no option clicked since the product was opened."""
    task = "i need a face serum that is argan oil with size: 4 fl oz, and price lower than 50.00 dollars"
    page = "Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] B0GBQYYBTV [SEP] Face Serum [SEP] $35.99"
    item = "Back to Search [SEP] < Prev [SEP] size [SEP] 4 fl oz [SEP] Face Serum [SEP] Buy Now"
    done = "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 0.67"

    def s(action, obs, label="ok"):
        return {"action": action, "obs": obs, "label": label}
    search = s("search[a face serum that is argan oil with size: 4 fl oz]", page)
    hasty = [search, s("click[B0GBQYYBTV]", item), s("click[features]", "Back to Search [SEP] < Prev [SEP] x"),
             s("click[< prev]", item), s("click[buy now]", done)]
    careful = [s("search[face serum lavender]", page), s("click[b0gbqyybtv]", item),
               s("click[4 fl oz]", "You have clicked 4 fl oz. [SEP] " + item), s("click[buy now]", done)]
    invalid = "Invalid action."
    lost = [search, s("click[B0XXXXXXXX]", invalid, "invalid"), s("click[buy now]", invalid, "invalid")]
    eps = [{"env": "shop", "task": task, "obs0": "WebShop [SEP] Instruction: [SEP] " + task, "steps": steps,
            "reward": r, "success": r == 1.0} for steps, r in [(hasty, 2 / 3), (careful, 1.0), (lost, 0.0)]]
    path, out = printed(tmp_path, eps)
    assert out == (f"{path}: success 1/3, avg reward 0.556; product clicks on a results page 3, of an id that page "
                   "shows 2; searches 3, a span of the instruction 2; purchases 2, hasty 1\n")


def test_kitchen_line_counts_needless_looks_the_step_limit_and_mean_a(tmp_path):
    """On kitchen episodes: the looks, those labelled repeat (the offer was in view), the invalid steps, the episodes
    cut by the step limit, and on a 04 buffer the mean A of each (source, verb)."""
    def s(action, label="ok", adv=None):
        return {"action": action, "obs": "You use the cup 1. Next: apple.", "label": label, "adv": adv}
    eps = [{"env": "kitchen", "source": "expert", "success": True, "truncated": False,
            "steps": [s("use cup 1", adv=0.25), s("look", "repeat", adv=0.5), s("use apple 1", adv=-0.75)]},
           {"env": "kitchen", "source": "self", "success": False, "truncated": True,
            "steps": [s("use pan 3", "invalid", adv=-1.0), s("look", adv=0.0), s("look", "repeat", adv=0.5)]}]
    path, out = printed(tmp_path, eps)
    assert out == (f"{path}: success 1/2; steps 6, look 3 (needless, labelled repeat: 2, 0.33 of the steps), "
                   "invalid 1; at the step limit 1 episodes; mean A: expert look +0.500 (n=1), expert use -0.250 "
                   "(n=2), self look +0.250 (n=2), self use -1.000 (n=1)\n")
    no_adv = [dict(e, steps=[dict(st, adv=None) for st in e["steps"]]) for e in eps]
    assert printed(tmp_path, no_adv)[1].endswith("at the step limit 1 episodes\n")


def test_kitchen_bayes_advantages_telescope_and_charge_a_needless_look_one_discounted_step(tmp_path):
    """A*_t = r_env + gamma V*(s_{t+1}) - V*(s_t) from the exact Bayes critic, on the demonstrator's episodes with 04's
    summary beside them: sum_t gamma^t A*_t = G_0 - V*(s_0) in every episode, and a needless look costs about
    (1 - gamma) V*, where the other steps average about 0."""
    import envs
    env, gamma, eps = envs.make("kitchen"), 0.95, []
    for tid in env.task_ids("train")[:300]:
        obs0, prev, steps = env.reset(tid)[0], None, []
        while not env.done:
            cmd = env.expert_action()
            obs, r, *_ = env.step(cmd)
            steps.append({"action": cmd, "obs": obs, "r_env": r, "adv": 0.0, "label": "repeat" if obs == (
                prev or obs0) else "ok", "done": env.done})
            prev = obs
        eps.append({"env": "kitchen", "source": "expert", "task": env._task["task"], "obs0": obs0, "steps": steps,
                    "success": r == 1.0})
    (tmp_path / "self.json").write_text(json.dumps({"args": {"policy": "p", "env_kwargs": "{}"}}))
    (tmp_path / "adv.json").write_text(json.dumps({"stage": "04_gae", "gamma": gamma,
                                                   "args": {"data": [str(tmp_path / "self.jsonl")]}}))
    star = mistakes.bayes_advantages(eps, str(tmp_path / "adv.jsonl"))
    v0 = envs.bayes_critic("kitchen", eps, eps, gamma, {})
    for ep, v in zip(eps, v0):
        g0 = sum(gamma ** t * s["r_env"] for t, s in enumerate(ep["steps"]))
        assert sum(gamma ** t * a for t, a in enumerate(star[id(ep)])) == pytest.approx(g0 - v[0], abs=1e-9)
    look = [star[id(ep)][t] for ep in eps for t, s in enumerate(ep["steps"]) if s["action"] == "look"]
    use = [star[id(ep)][t] for ep in eps for t, s in enumerate(ep["steps"]) if s["action"] != "look"]
    assert len(look) > 10 and -0.05 < sum(look) / len(look) < -0.015 and abs(sum(use) / len(use)) < 0.01
    assert mistakes.bayes_advantages(eps, str(tmp_path / "other.jsonl")) is None  # no 04 summary beside it
