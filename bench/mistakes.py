"""Where a policy's episodes go wrong, one line per episode JSONL file (02 or 04 output). Household: the habit rate
(the share of arrivals at a closed receptacle where the policy examines it, the demonstrator's step-wasting habit,
instead of opening it; on a 04 buffer also the mean A of each (source, verb)), the first mistake of each episode and
how many episodes with one still succeed. Kitchen: how many steps are a `look`, and how many of those are needless
(labelled `repeat`: the offer was in view, the demonstrator's step-wasting habit), how many are labelled `invalid` (a
command the world refuses), how many episodes hit the step limit (on a 04 buffer also the mean A of each (source,
verb: look, use, other), and beside it the exact Bayes critic's A* = r_env + gamma V*(s') - V*(s), each source's
policy estimated from its own episodes, gamma and the world's knobs from 04's summary beside the buffer). Shop: do
product clicks name an id the results page shows, are searches a span of the instruction, how many purchases are
hasty (no option clicked since the product was opened)?

    python bench/mistakes.py runs/default/eval/world0/policy_2_dev.jsonl runs/default/iter_2/adv.jsonl   # kitchen
    python bench/mistakes.py runs/course_habit0/eval/world0/policy_1_seen.jsonl   # household
    python bench/mistakes.py runs/shop_default/eval/world0/policy_0_dev.jsonl
"""
import collections
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
from bench.runner import parser  # noqa: E402
from critic_report import env_kwargs_of  # noqa: E402
from plumbing import die, loads, read_json  # noqa: E402


def closed_arrivals(episode):
    """(verb, A) of each step taken right after arriving at a closed receptacle; verb is
    'examine', 'open' or 'other', A the step's advantage (None in a buffer without one)."""
    out, last_obs = [], episode["obs0"]
    for step in episode["steps"]:
        if last_obs.startswith("You arrive at") and last_obs.endswith("is closed."):
            verb = (step["action"] or "").split(" ")[0]
            out.append((verb if verb in ("examine", "open") else "other", step.get("adv")))
        last_obs = step["obs"]
    return out


def first_mistake(episode):
    """The kind of the first step not labelled ok or that is the habit, or None for a clean episode."""
    rooms = set(re.findall(r"\ban? ([a-z]+ \d+)", episode["obs0"]))  # the receptacles obs0 lists
    here, last_obs = None, episode["obs0"]
    for step in episode["steps"]:
        action = step["action"] or ""
        if action.startswith("examine ") and last_obs.startswith("You arrive at") and last_obs.endswith("is closed."):
            return "examine: the habit"
        if step["label"] != "ok":
            if step["label"] == "format" or not action:
                return "format"
            if action.startswith("go to "):
                target = action[len("go to "):]
                return "go: already there" if target == here else \
                    "go: receptacle not in room" if target not in rooms else "go: other"
            if action.startswith("take ") and " from " in action:
                kind = action[len("take "):].split(" from ")[0].rsplit(" ", 1)[0]
                seen = re.search(rf"\b{re.escape(kind)} \d", last_obs)
                return "take: object in last obs" if seen else "take: object not in last obs"
            return action.split()[0]
        if action.startswith("go to ") and step["obs"].startswith("You arrive"):
            here = action[len("go to "):]
        last_obs = step["obs"]
    return None


def summary(episodes):
    verbs, advs = collections.Counter(), collections.defaultdict(list)
    for ep in episodes:
        for verb, adv in closed_arrivals(ep):
            verbs[verb] += 1
            if adv is not None:
                advs[(ep.get("source", "self"), verb)].append(adv)
    firsts = [(first_mistake(ep), ep["success"]) for ep in episodes]
    mistaken = [(kind, won) for kind, won in firsts if kind is not None]
    kinds = collections.Counter(kind for kind, _ in mistaken).most_common()
    line = (f"success {sum(ep['success'] for ep in episodes)}/{len(episodes)}; at a closed receptacle: examine "
            f"{verbs['examine']}, open {verbs['open']}, other {verbs['other']} (habit rate "
            f"{verbs['examine'] / max(sum(verbs.values()), 1):.2f}); with a mistake {len(mistaken)} (recovered "
            f"{sum(won for _, won in mistaken)}), first mistake: " + (", ".join(f"{k} {n}" for k, n in kinds) or "-"))
    return line + mean_a(advs)


def mean_a(advs, stars=None):
    """'; mean A: ...' of each (source, verb) on a 04 buffer (with the Bayes critic's mean A* where stars has
    them), '' on episodes without advantages."""
    star = lambda key: f"A* {statistics.mean(stars[key]):+.3f}, " if stars else ""
    return "; mean A: " + ", ".join(f"{s} {v} {statistics.mean(a):+.3f} ({star((s, v))}n={len(a)})"
                                    for (s, v), a in sorted(advs.items())) if advs else ""


def bayes_advantages(episodes, path):
    """{id(episode): [A*_t per step]} from the exact Bayes critic (r_env + gamma V*(s_{t+1}) - V*(s_t), V* = 0 after
    the last step), each source's policy estimated from its own episodes; None without 04's summary beside path."""
    summary = read_json(path[:-1]) if path.endswith(".jsonl") else None
    world = env_kwargs_of(summary["args"]["data"]) if summary and summary.get("stage") == "04_gae" else None
    if world is None:
        return None
    gamma, out = summary["gamma"], {}
    for source in {ep.get("source", "self") for ep in episodes}:
        own = [ep for ep in episodes if ep.get("source", "self") == source]
        for ep, v in zip(own, envs.bayes_critic("kitchen", own, own, gamma, world)):
            out[id(ep)] = [s["r_env"] + gamma * nxt - now for s, now, nxt in zip(ep["steps"], v, v[1:] + [0.0])]
    return out


def kitchen_summary(episodes, path):
    steps = [s for ep in episodes for s in ep["steps"]]
    needless = sum(s["action"] == "look" and s["label"] == "repeat" for s in steps)
    bayes = bayes_advantages(episodes, path) if any(s.get("adv") is not None for s in steps) else None
    advs, stars = collections.defaultdict(list), collections.defaultdict(list)
    for ep in episodes:
        for t, s in enumerate(ep["steps"]):
            if s.get("adv") is not None:
                key = (ep.get("source", "self"), next((v for v in ("look", "use") if (s["action"] or "").startswith(v)),
                                                       "other"))
                advs[key].append(s["adv"])
                if bayes:
                    stars[key].append(bayes[id(ep)][t])
    return (f"success {sum(ep['success'] for ep in episodes)}/{len(episodes)}; steps {len(steps)}, look "
            f"{sum(s['action'] == 'look' for s in steps)} (needless, labelled repeat: {needless}, "
            f"{needless / max(len(steps), 1):.2f} of the steps), invalid {sum(s['label'] == 'invalid' for s in steps)}"
            f"; at the step limit {sum(bool(ep.get('truncated')) for ep in episodes)} episodes" + mean_a(advs, stars))


VIEWS = ("click[description]", "click[features]", "click[attributes]", "click[< prev]")  # item sub-pages


def shop_summary(episodes):
    clicks = on_page = searches = spans = bought = hasty = 0
    for ep in episodes:
        last_obs, opened = ep["obs0"], False
        for step in ep["steps"]:
            action = step["action"] or ""
            product = re.fullmatch(r"click\[(b0[0-9a-z]{8})\]", action, re.IGNORECASE)
            if product and last_obs.startswith("Back to Search [SEP] Page "):
                clicks += 1
                on_page += product.group(1).upper() in last_obs.split(" [SEP] ")
            if action.startswith("search["):
                searches += 1
                spans += action[len("search["):-1] in ep["task"]
            if step["label"] == "ok" and action.lower() == "click[buy now]":
                bought += 1
                hasty += opened  # nothing clicked between opening the product and buying it
            elif step["label"] == "ok" and action.lower() not in VIEWS:
                opened = bool(product)  # an option, a search, a page turn: no longer just opened
            last_obs = step["obs"]
    reward = sum(ep["reward"] for ep in episodes) / len(episodes)
    return (f"success {sum(ep['success'] for ep in episodes)}/{len(episodes)}, avg reward {reward:.3f}; product "
            f"clicks on a results page {clicks}, of an id that page shows {on_page}; searches {searches}, a span of "
            f"the instruction {spans}; purchases {bought}, hasty {hasty}")


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("files", nargs="+", help="episode JSONL files (02_collect.py or 04_gae.py output)")
    for path in p.parse_args(argv).files:
        try:
            with open(path, encoding="utf-8") as f:
                episodes = [loads(line) for line in f if line.strip()]
            if not episodes:
                die(f"{path}: no episodes in it; pass an episode JSONL of 02_collect.py or 04_gae.py")
            line = {"kitchen": lambda eps: kitchen_summary(eps, path), "shop": shop_summary}.get(
                episodes[0].get("env"), summary)(episodes)
        except (OSError, UnicodeDecodeError, ValueError, LookupError, TypeError, AttributeError) as e:  # not episodes
            die(f"{path}: not an episode JSONL of 02_collect.py or 04_gae.py ({getattr(e, 'strerror', None) or e})")
        print(f"{path}: {line}")


if __name__ == "__main__":
    main()
