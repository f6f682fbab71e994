"""kitchen: a short line of decisions whose consequences show at once (the credit world).

A task is a dish made at `decisions` stations, generated from (seed, split, index). At each station
two items of one kind are on offer, one of them flawed, and the observation says which:

    make an omelette.                                  (the task)
    You are in the kitchen. Next: egg. You see rotten egg 1 and egg 2.

`use egg 2` takes the good one. A flawed item is a valid command (labelled `ok`, r_aux 0) whose
consequence shows in the next observation:
  - an ingredient (egg, milk, ...) cannot be taken back: "You add the rotten egg 1. It smells bad.";
    when the dish is done, each flawed ingredient in it spoils it with probability `spoil` (drawn
    per task and station, so a task always answers the same way);
  - a tool (bowl, knife, ...) is put back and the station stays: "The dirty bowl 1 is no use; you put
    it back." - recoverable, at the cost of a step.
After the last station the dish is done: "The omelette is ready." (reward 1, terminated) or "The
omelette is ruined." (reward 0, terminated). With probability `outage` per task the power goes out
after a step drawn from 1..decisions, whatever the agent did: "The power goes out. The omelette is
ruined." (reward 0, terminated) - outcome noise, announced when it happens. There is no hidden budget:
the step limit, 3 * decisions + 2, is one the demonstrator never reaches.

Wasted steps, the ones 02's retrospective labels see (they cost a step, never the dish):
  - a command naming an item not on offer (`use egg 3`) does nothing: "Nothing happens. Next: egg.
    You see ..." (the offer restated) - labelled `invalid`;
  - `look` restates what is in view: with the offer in view the agent reads the same text again -
    labelled `repeat` (after "Nothing happens." it shows the offer alone, a new text).

The demonstrator is careless at each station with probability `careless`: it uses item 1 without
reading; else it uses the good item. After a tool is put back it uses the other one. So where item 1
is flawed its most common reply (what greedy behavior cloning copies) is the flawed one, when
careless > 0.5; the good reply is in the buffer all the same. Before its choice it fumbles at a
station with probability `slip` (`use egg 3`: one `invalid` step), else with probability `relook` it
looks again (one `repeat` step): on the default world's stations, 10% invalid and 9% repeat.

Splits: a task's pairings (dish, kind) decide them, as household's (object, goal) pairings do: a
pairing is held out iff crc32("dish>kind") % 4 == 0; unseen tasks have at least one held-out pairing,
train / dev / seen tasks none (separate random streams, so they share no task).
A keyword value out of range, or a number of decisions for which some split has no task, is a ValueError
naming the key.
"""
import math
import random

from envs._common import is_unseen_pairing, normalize_command, parse_task_id
from envs.base import TextEnv

NOTHING = "Nothing happens."
DISHES = ["omelette", "soup", "salad", "pancake", "stew", "pie", "sandwich", "curry"]
INGREDIENTS = {"egg": "rotten", "milk": "sour", "apple": "moldy", "bread": "stale", "tomato": "bruised",
               "cheese": "moldy"}  # kind -> its flaw: cannot be taken back, may spoil the dish
TOOLS = {"bowl": "dirty", "knife": "blunt", "pan": "cracked", "spoon": "bent", "cup": "chipped",
         "whisk": "broken"}      # kind -> its flaw: put back, a step lost
FLAWS = {**INGREDIENTS, **TOOLS}

# The most decisions for which every split has tasks: the largest count of kinds one dish has without a held-out
# pairing (train, dev and seen tasks hold none). Above it the generator could never draw a train task.
MAX_DECISIONS = max(sum(not is_unseen_pairing(d, k) for k in FLAWS) for d in DISHES)


class KitchenEnv(TextEnv):
    """See the module docstring. Knobs: decisions (stations per task), careless (the demonstrator's
    slip rate), spoil (a flawed ingredient's chance to spoil the dish), outage (noise per task), slip and
    relook (the demonstrator's wasted steps: an invalid command, a needless look)."""

    name = "kitchen"
    splits = ("train", "dev", "seen", "unseen")

    def __init__(self, seed=0, decisions=4, careless=0.7, spoil=0.6, outage=0.1, slip=0.1, relook=0.1,
                 n_train=1000, n_dev=100, n_seen=100, n_unseen=100):
        for key, value, low, high in [("seed", seed, 0, 2**32 - 1), ("decisions", decisions, 1, MAX_DECISIONS),
                                      ("careless", careless, 0, 1), ("spoil", spoil, 0, 1), ("outage", outage, 0, 1),
                                      ("slip", slip, 0, 1), ("relook", relook, 0, 1),
                                      ("n_train", n_train, 1, 10**6), ("n_dev", n_dev, 1, 10**6),
                                      ("n_seen", n_seen, 1, 10**6), ("n_unseen", n_unseen, 1, 10**6)]:
            counts = key == "seed" or key == "decisions" or key.startswith("n_")
            if isinstance(value, bool) or not isinstance(value, int if counts else (int, float)) \
                    or not low <= value <= high:  # NaN fails too
                why = (f" (at most {MAX_DECISIONS}: above it no dish has that many kinds without a held-out "
                       "pairing, so no train task exists)") if key == "decisions" else ""
                raise ValueError(f"kitchen: {key} must be {'an integer' if counts else 'a number'} in [{low}, {high}]"
                                 f"{why}, got {value!r}")
        self.seed, self.decisions, self.careless, self.spoil, self.outage = seed, decisions, careless, spoil, outage
        self.slip, self.relook = slip, relook
        self.n_tasks = {"train": n_train, "dev": n_dev, "seen": n_seen, "unseen": n_unseen}
        self.max_steps = 3 * decisions + 2
        self.instruction = "Kitchen agent. Reply with 'Action: <command>'."
        self._task = None

    # ------------------------------------------------------------------ tasks
    def generate(self, task_id):
        """The task of `task_id`, deterministically: the dish, each station's kind, which item (1 or 2) is
        flawed, whether a flawed ingredient there would spoil the dish, and the step after which the power
        goes out (None: it stays on)."""
        split, index = parse_task_id(self, task_id, self.n_tasks)
        rng = random.Random(f"kitchen/{self.seed}/{split}/{index}")
        for _ in range(100_000):  # rejection: unseen tasks hold a held-out pairing, the others none
            dish = rng.choice(DISHES)
            kinds = rng.sample(sorted(FLAWS), self.decisions)
            if any(is_unseen_pairing(dish, k) for k in kinds) == (split == "unseen"):
                break
        else:  # unreachable for decisions <= MAX_DECISIONS (a draw succeeds with probability > 1e-3)
            raise RuntimeError(f"kitchen: no {split} task found for {task_id}")
        flawed = [rng.choice([1, 2]) for _ in kinds]
        spoils = [rng.random() < self.spoil for _ in kinds]
        outage_at = rng.randint(1, self.decisions) if rng.random() < self.outage else None
        article = "an" if dish[0] in "aeiou" else "a"
        return {"task_id": task_id, "dish": dish, "kinds": kinds, "flawed": flawed, "spoils": spoils,
                "outage_at": outage_at, "task": f"make {article} {dish}."}

    # ------------------------------------------------------------------ episode
    def reset(self, task_id):
        self._task = g = self.generate(task_id)
        self.station, self.t, self.done, self.spoiled, self.put_back, self.tries = 0, 0, False, False, False, 0
        self.last_obs = obs = f"You are in the kitchen. {self._offer()}"
        return obs, {"task": g["task"], "task_id": task_id}

    def _item(self, n, i=None):
        """Item n (1 or 2) of station i (default: the current one), as the observation names it."""
        i = self.station if i is None else i
        kind = self._task["kinds"][i]
        return f"{FLAWS[kind]} {kind} {n}" if self._task["flawed"][i] == n else f"{kind} {n}"

    def _offer(self):
        return f"Next: {self._task['kinds'][self.station]}. You see {self._item(1)} and {self._item(2)}."

    def _execute(self, cmd):
        """Apply one command -> (what the agent reads, whether the last station is done)."""
        g, i = self._task, self.station
        if cmd == "look":  # what is in view, again: the same text (a `repeat`), or the offer after "Nothing happens."
            return (self._offer() if self.is_invalid(self.last_obs) else self.last_obs), False
        kind = g["kinds"][i]
        if cmd not in (f"use {kind} 1", f"use {kind} 2"):
            return f"{NOTHING} {self._offer()}", False
        n = int(cmd[-1])
        if n == g["flawed"][i] and kind in TOOLS:
            self.put_back = True
            return f"The {self._item(n)} is no use; you put it back. {self._offer()}", False
        said = f"You add the {self._item(n)}." if kind in INGREDIENTS else f"You use the {self._item(n)}."
        if n == g["flawed"][i]:  # a flawed ingredient: in the dish for good
            said += " It smells bad."
            self.spoiled = self.spoiled or g["spoils"][i]
        self.station, self.put_back, self.tries = i + 1, False, 0
        if self.station == self.decisions:
            return said, True
        return f"{said} {self._offer()}", False

    def step(self, action):
        self._check_step(self._task is not None)
        self.t, self.tries = self.t + 1, self.tries + 1
        obs, finished = self._execute(normalize_command(action))
        dish, won = self._task["dish"], False
        if self._task["outage_at"] == self.t:  # the noise: whatever the agent did
            obs, finished = f"{obs} The power goes out. The {dish} is ruined.", True
        elif finished:
            won = not self.spoiled
            obs = f"{obs} The {dish} is {'ready' if won else 'ruined'}."
        truncated = not finished and self.t >= self.max_steps
        self.done = finished or truncated
        self.last_obs = obs
        return obs, (1.0 if won else 0.0), finished, truncated, {"task": self._task["task"], "won": won,
                                                                 "steps": self.t}

    def is_invalid(self, obs):
        return obs.startswith(NOTHING)

    def admissible_actions(self):
        """Every command that does something now (none returns "Nothing happens.")."""
        kind = self._task["kinds"][self.station]
        return [f"use {kind} 1", f"use {kind} 2", "look"]

    def random_action(self, rng):
        """A random command of the grammar (a baseline; mostly "Nothing happens.")."""
        return rng.choice([f"use {rng.choice(sorted(FLAWS))} {rng.randint(1, 2)}", "look"])

    def reading_question(self, rng):
        """A question about the current offer and its answer, for 00_pretrain.py's reading: which item is
        flawed, which is good, what comes next."""
        i = self.station
        kind, bad = self._task["kinds"][i], self._task["flawed"][i]
        choice = rng.random()
        if choice < 0.4:
            return f"Question: which {kind} is {FLAWS[kind]}?", f"Answer: {kind} {bad}."
        if choice < 0.8:
            return f"Question: which {kind} is good?", f"Answer: {kind} {3 - bad}."
        return "Question: what is next?", f"Answer: {kind}."

    # ------------------------------------------------------------------ expert
    def expert_action(self):
        i, g = self.station, self._task
        kind, good = g["kinds"][i], 3 - g["flawed"][i]
        if self.put_back:  # it has just put a flawed tool back: it takes the other one
            return f"use {kind} {good}"
        rng = random.Random(f"careless/{self.seed}/{g['task_id']}/{i}")
        careless, slip, relook = (rng.random() < p for p in (self.careless, self.slip, self.relook))
        if self.tries == 0 and slip:  # a fumble: an item not on offer, "Nothing happens." (`invalid`)
            return f"use {kind} 3"
        if self.tries == 0 and relook:  # a needless look: the same text again (`repeat`)
            return "look"
        return f"use {kind} 1" if careless else f"use {kind} {good}"



def judge(prev_obs, action):
    """One step of a kitchen episode, from the observation before it and its command: 'harmful' if it used the
    ingredient that observation's offer calls flawed (in the dish for good), 'recoverable' if the flawed tool (put
    back, a step lost), 'correct' if it used the other item, else None - a command the world does not accept (no
    item of the offer: `use egg 3`), `look`, or no offer in view (04's view of a mistake)."""
    words = " ".join(action.split()).split(" ")
    if len(words) != 3 or words[0] != "use" or words[2] not in ("1", "2") or "Next:" not in prev_obs:
        return None
    offer = prev_obs.rsplit("Next:", 1)[1]
    if not offer.startswith(f" {words[1]}."):  # not the kind on offer: "Nothing happens."
        return None
    if f"{FLAWS[words[1]]} {words[1]} {words[2]}" not in offer:
        return "correct"
    return "harmful" if words[1] in INGREDIENTS else "recoverable"


# ---------------------------------------------------------------------- the exact Bayes critic
def behaviour(episodes, gamma):
    """What bayes_values assumes of the policy, estimated from its episodes: the share of first choices at a station
    that took the flawed item where item 1 is flawed and where item 2 is ({1: p1, 2: p2}), and E[gamma^W], W the
    steps a station wastes before its first choice (a fumble, a look)."""
    taken, waste = {1: [], 2: []}, []
    for ep in episodes:
        prev, station, fresh = ep["obs0"], None, 0
        for s in ep["steps"]:
            if "Next:" in prev and prev.rsplit("Next:", 1)[1] != station:
                station, fresh = prev.rsplit("Next:", 1)[1], 0  # a new station's offer
            verdict = judge(prev, s["action"])
            if verdict and fresh is not None:  # its first choice: where is the flaw, was it taken?
                flawed = 1 if f"{FLAWS[s['action'].split()[1]]} " in station.split(" and ")[0] else 2
                taken[flawed].append(verdict != "correct")
                waste.append(gamma ** fresh)
                fresh = None
            elif fresh is not None:
                fresh += 1
            prev = s["obs"]
    mean = lambda x: sum(x) / len(x) if x else 0.0
    return {1: mean(taken[1]), 2: mean(taken[2])}, mean(waste) if waste else 1.0


def bayes_values(ep, gamma, taken, wasted, decisions=4, spoil=0.6, outage=0.1, **policy_knobs):
    """V*(s_t) = E[G_t | what the agent has read before step t], for t = 0..T-1 of a kitchen episode on a train, dev or
    seen task, G_t = sum_k gamma^(k-t) r_env_k: the best any critic can do on this return. Read: the dish, the kinds
    and offers so far, the flawed ingredients taken ("It smells bad."; each spoils the dish with probability
    `spoil`), a tool put back, that the power has not gone out yet. Unread: the rest, drawn as the generator draws it
    (the dish's kinds without a held-out pairing, uniformly without replacement; the flaw on item 1 or 2 alike). The
    policy (behaviour()): at a fresh station E[gamma^W] = wasted, then the flawed item with probability taken[n]
    where item n is flawed, the good one after a tool is put back (the world's other knobs shape the policy alone).
        V*(s_t) = (1 - P(outage pending)) (1 - spoil)^bad / gamma * E[gamma^(steps left) * no spoil from now on]"""
    dish = ep["task"].split()[-1].rstrip(".")
    allowed = [k for k in FLAWS if not is_unseen_pairing(dish, k)]
    g = lambda kind, n: (1 - taken[n] * spoil) if kind in INGREDIENTS else (1 - taken[n] + taken[n] * gamma)
    station_factor = {kind: wasted * gamma * (g(kind, 1) + g(kind, 2)) / 2 for kind in FLAWS}
    values, prev, seen, bad, env_steps, tries, put_back, flawed = [], ep["obs0"], [], 0, 0, 0, False, 1
    for s in ep["steps"]:
        if "Next: " in prev:  # an offer in view (not after a format error): its kind, and which item is flawed
            offer = prev.rsplit("Next: ", 1)[1]
            kind = offer.split(".")[0]
            flawed = 1 if f"{FLAWS[kind]} {kind} 1" in offer else 2
            if not seen or kind != seen[-1]:
                seen, tries, put_back = seen + [kind], 0, False
        kind = seen[-1]
        now = gamma if put_back else (wasted if tries == 0 else 1.0) * gamma * g(kind, flawed)
        rest = [k for k in allowed if k not in seen]  # the kinds still to come are drawn from these
        m, n_ing = decisions - len(seen), sum(k in INGREDIENTS for k in rest)
        f_ing = sum(station_factor[k] for k in rest if k in INGREDIENTS) / max(n_ing, 1)
        f_tool = sum(station_factor[k] for k in rest if k in TOOLS) / max(len(rest) - n_ing, 1)
        future = sum(math.comb(n_ing, a) * math.comb(len(rest) - n_ing, m - a) / math.comb(len(rest), m)
                     * f_ing ** a * f_tool ** (m - a) for a in range(m + 1)) if m > 0 else 1.0
        done = min(env_steps, decisions) / decisions  # the outage's step is uniform on 1..decisions
        pending = outage * (1 - done) / (1 - outage * done)
        values.append((1 - pending) * (1 - spoil) ** bad / gamma * now * future)
        if s["label"] != "format":  # a format error does not step the world (02)
            env_steps += 1
        bad += "It smells bad." in s["obs"]
        put_back = put_back or "you put it back" in s["obs"]
        tries, prev = tries + 1, s["obs"]
    return values
