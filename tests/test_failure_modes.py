"""bench/failure_modes.py classifies the first mistake of an episode; checked on hand-made episodes."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("failure_modes", os.path.join(ROOT, "bench", "failure_modes.py"))
fm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fm)

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
