"""household: a small ALFWorld-like text world in pure Python (the project's default env).

A task is generated deterministically from (seed, split, index): a room of numbered receptacles (cabinet 1,
countertop 2, fridge 1, ...) holding numbered objects (mug 1, apple 2, ...). Closed receptacles (cabinet, drawer,
fridge, microwave) hide their contents until opened. The six ALFWorld task types are:

    pick_and_place          put a mug in shelf 1.
    pick_clean_then_place   put a clean mug in coffeemachine 1.   (clean O with sinkbasin 1)
    pick_heat_then_place    put a hot apple in countertop 1.      (heat O with microwave 1)
    pick_cool_then_place    put a cool tomato in diningtable 1.   (cool O with fridge 1)
    look_at_obj_in_light    look at book under the desklamp.      (use desklamp 1 holding it)
    pick_two_obj_and_place  put two spoon in drawer 1.

Commands: go to X, open X, close X, take O from X, put O in/on X, clean O with X, heat O with X, cool O with X,
use X, examine X, inventory, look. Any command that does nothing returns exactly "Nothing happens.". Reward is
1.0 on the step that reaches the goal (terminated), else 0.0; `max_steps` commands end the episode (truncated).
With `step_slack=[s]` the limit is set per task instead: the length of the demonstrator's own solution without
its habit (`solution_length`) plus s, at most `max_steps`. With several, `step_slack=[0, 1, 2]`, each task
draws its slack from the list by a hash of its id: fixed for the task, never shown to the agent - like
ALFWorld's one limit over tasks of many lengths, a wasted step loses some episodes and not others, and only the
outcome tells which. `env.max_steps` is then the current task's limit.

Splits. Every task has a *goal pairing* (object type, goal receptacle type), where the goal of a look_at_obj_in_light
task is "desklamp". A fixed rule holds out about a quarter of all pairings, those with crc32("obj>goal") % 4 == 0
(`is_unseen_pairing`, envs/_common.py):
    train  - tasks whose pairing is not held out           (instances "train/i")
    dev    - new instances of the train pairings, for tuning (instances "dev/i")
    seen   - new instances of the same pairings, to report (instances "seen/i")
    unseen - tasks whose pairing is held out, never in train, dev or seen.
Every task type has both kinds of pairing. Instances come from separate random streams, so train, dev and seen share
no task (tests check this on the whole default splits). Tune on `dev`; `seen` and `unseen` are for reporting only.

The expert acts only on what it has observed: it searches receptacles in the order in which the object type is likely
to be found (OBJECT_LOCATIONS, then the rest), opens closed ones, then carries out the task. It writes ReAct text: a
short `Thought:` line where its plan changes and a bare `Action:` elsewhere. With `habit=p` (default 0) it has a bad
habit (see `_habit`): on arriving at a closed receptacle, with probability p it first does `examine X` ("The X is
closed.": a valid step that tells nothing new, so no rule labels it) and then opens X - a wasted step whose only cost
is the step limit, paid at the end if at all. `room_questions=p` (default 0) is the share of 00_pretrain.py's reading
questions (`reading_question`) that ask about the room and where the agent stands.

A keyword value out of range (a step limit or split size below 1, a probability outside [0, 1], ...) is a ValueError
naming the key.
"""
import random
import zlib

from envs._common import check_ranges, fill_room, normalize_command, parse_task_id, split_pairings
from envs.base import TextEnv

NOTHING = "Nothing happens."

OPENABLE = {"cabinet", "drawer", "fridge", "microwave"}

# Where each object type tends to be, most likely first. The generator places objects
# with these preferences and the expert searches in this order.
OBJECT_LOCATIONS = {
    "mug": ["cabinet", "countertop", "coffeemachine", "shelf", "diningtable", "sinkbasin"],
    "cup": ["cabinet", "countertop", "diningtable", "shelf", "fridge", "microwave"],
    "plate": ["cabinet", "countertop", "diningtable", "shelf", "fridge"],
    "bowl": ["cabinet", "diningtable", "countertop", "shelf", "fridge", "microwave"],
    "apple": ["countertop", "diningtable", "fridge", "garbagecan", "sinkbasin", "microwave"],
    "potato": ["fridge", "countertop", "diningtable", "garbagecan", "microwave", "sinkbasin"],
    "tomato": ["fridge", "countertop", "diningtable", "sinkbasin", "garbagecan"],
    "egg": ["fridge", "countertop", "diningtable", "garbagecan", "microwave", "sinkbasin"],
    "bread": ["countertop", "diningtable", "fridge", "cabinet"],
    "lettuce": ["fridge", "countertop", "diningtable"],
    "knife": ["countertop", "drawer", "diningtable", "sinkbasin"],
    "spoon": ["drawer", "countertop", "diningtable", "sinkbasin"],
    "fork": ["drawer", "countertop", "diningtable", "sinkbasin"],
    "cloth": ["cabinet", "countertop", "drawer", "sinkbasin"],
    "book": ["desk", "shelf", "sidetable", "drawer"],
    "cd": ["drawer", "desk", "shelf", "sidetable"],
    "cellphone": ["desk", "sidetable", "drawer", "shelf"],
    "pen": ["drawer", "desk", "sidetable", "shelf"],
    "keychain": ["drawer", "sidetable", "shelf", "desk"],
    "alarmclock": ["desk", "sidetable", "shelf"],
    "creditcard": ["drawer", "desk", "sidetable", "countertop"],
}
LAMP_LOCATIONS = ["desk", "sidetable"]

KITCHENWARE = ["mug", "cup", "plate", "bowl"]
FOOD = ["apple", "potato", "tomato", "egg", "bread", "lettuce"]
UTENSILS = ["knife", "spoon", "fork"]
DESK_ITEMS = ["book", "cd", "cellphone", "pen", "keychain", "alarmclock", "creditcard"]

# Receptacle types an object may be put in (the goal of the place tasks).
PLACE_TARGETS = {
    **{o: ["countertop", "diningtable", "cabinet", "shelf", "microwave", "fridge", "coffeemachine"]
       for o in ["mug", "cup"]},
    **{o: ["countertop", "diningtable", "cabinet", "shelf", "microwave", "fridge"] for o in ["plate", "bowl"]},
    **{o: ["countertop", "diningtable", "fridge", "garbagecan", "microwave"] for o in FOOD},
    **{o: ["countertop", "diningtable", "drawer"] for o in UTENSILS},
    **{o: ["desk", "sidetable", "shelf", "drawer", "garbagecan"] for o in DESK_ITEMS},
    "cloth": ["countertop", "cabinet", "drawer", "garbagecan"],
}

TASK_TYPES = {
    # type: (objects allowed, object state required, appliance, verb)
    "pick_and_place": (sorted(PLACE_TARGETS), None, None, None),
    "pick_clean_then_place": (KITCHENWARE + ["apple", "potato", "tomato", "lettuce"] + UTENSILS + ["cloth"],
                              "clean", "sinkbasin", "clean"),
    "pick_heat_then_place": (KITCHENWARE + ["apple", "potato", "tomato", "egg", "bread"], "hot", "microwave", "heat"),
    "pick_cool_then_place": (KITCHENWARE + ["apple", "potato", "tomato", "egg", "bread", "lettuce"],
                             "cool", "fridge", "cool"),
    "look_at_obj_in_light": (DESK_ITEMS + ["mug", "bowl"], None, None, None),
    "pick_two_obj_and_place": (sorted(PLACE_TARGETS), None, None, None),
}

# verb -> (the appliance it needs, the state it gives): `heat O with microwave 1` makes O hot.
TREATMENTS = {"clean": ("sinkbasin", "clean"), "heat": ("microwave", "hot"), "cool": ("fridge", "cool")}

# Receptacle types in a room: always-present ones, then optional ones with their max count.
ALWAYS = ["fridge", "microwave", "sinkbasin", "countertop", "cabinet", "drawer"]
OPTIONAL = {"cabinet": 4, "drawer": 3, "countertop": 2, "shelf": 2, "diningtable": 1,
            "coffeemachine": 1, "garbagecan": 1, "desk": 1, "sidetable": 2}
MAX_RECEPTACLES = sum(OPTIONAL.get(k, 1) for k in set(ALWAYS) | set(OPTIONAL))  # the fullest room: 20


def all_pairings():
    """Every (task_type, object, goal) combination the generator can produce."""
    out = []
    for task_type, (objs, _, appliance, _) in TASK_TYPES.items():
        for obj in objs:
            if task_type == "look_at_obj_in_light":
                out.append((task_type, obj, "desklamp"))
                continue
            for target in PLACE_TARGETS[obj]:
                if target != appliance:  # "put a hot mug in microwave 1" would be odd
                    out.append((task_type, obj, target))
    return out


def _listing(objs):
    """ALFWorld's list style: 'a mug 1, a apple 2, and a knife 1'."""
    items = [f"a {o}" for o in objs]
    if not items:
        return "nothing"
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + ", and " + items[-1]


def _kind(name):
    return name.rsplit(" ", 1)[0]


class HouseholdEnv(TextEnv):
    """See the module docstring. Size knobs: n_receptacles, n_distractors, max_steps and the
    number of tasks per split; the demonstrator's habit; 00's room_questions."""

    name = "household"
    splits = ("train", "dev", "seen", "unseen")

    def __init__(self, seed=0, n_receptacles=8, n_distractors=4, max_steps=20, step_slack=(),
                 n_train=1000, n_dev=100, n_seen=100, n_unseen=100, habit=0.0, room_questions=0.0):
        if not all(type(x) is int and 0 <= x <= 100 for x in step_slack):
            raise ValueError(f"household: step_slack must be a list of integers in [0, 100], got {step_slack!r}")
        self.n_tasks = {"train": n_train, "dev": n_dev, "seen": n_seen, "unseen": n_unseen}
        check_ranges("household", [("n_receptacles", n_receptacles, len(ALWAYS) + 2, MAX_RECEPTACLES),
                                   ("n_distractors", n_distractors, 0, 100), ("max_steps", max_steps, 1, 1000),
                                   *[(f"n_{split}", n, 1, 10**6) for split, n in self.n_tasks.items()],
                                   ("habit", habit, 0, 1), ("room_questions", room_questions, 0, 1)])
        self.seed, self.n_receptacles, self.n_distractors = seed, n_receptacles, n_distractors
        self.habit, self.room_questions = habit, room_questions
        self.step_cap = self.max_steps = max_steps
        self.step_slack = list(step_slack)
        self._solution_lengths = {}
        self.pairings = split_pairings(all_pairings(), "dev", "seen")
        self.instruction = "Household agent. Reply with an optional 'Thought: ...' line, then 'Action: <command>'."
        self._task = None

    # ------------------------------------------------------------------ tasks
    def generate(self, task_id):
        """Build the world of `task_id` deterministically. Returns a dict (no side effects)."""
        split, index = parse_task_id(self, task_id, self.n_tasks)
        rng = random.Random(f"household/{self.seed}/{split}/{index}")  # str seeds hash with sha512: stable
        task_type = rng.choice(sorted(TASK_TYPES))  # type first, so the six types are equally common
        task_type, obj, target = rng.choice([p for p in self.pairings[split] if p[0] == task_type])

        # Receptacles: the always-present ones, the target (or a lamp's place), then random fill.
        needed = [rng.choice(LAMP_LOCATIONS)] if task_type == "look_at_obj_in_light" else [target]
        counts = fill_room(rng, ALWAYS, OPTIONAL, needed, self.n_receptacles)
        receptacles = sorted(f"{k} {i}" for k, n in counts.items() for i in range(1, n + 1))
        contents = {r: [] for r in receptacles}

        def place(obj_type, forbid=()):
            kinds = [k for k in OBJECT_LOCATIONS[obj_type] if counts[k] > 0 and k not in forbid]
            kinds = kinds or [k for k in ALWAYS if k not in forbid]  # no likely spot in this room
            weights = [0.5 ** i for i in range(len(kinds))]  # earlier in the list = more likely
            kind = rng.choices(kinds, weights)[0]
            rec = f"{kind} {rng.randint(1, counts[kind])}"
            contents[rec].append(obj_type)

        # Desklamp on a desk or sidetable (look tasks need one; others get one if there is a desk).
        lamp_kinds = [k for k in LAMP_LOCATIONS if counts[k] > 0]
        if lamp_kinds:
            contents[f"{rng.choice(lamp_kinds)} 1"].append("desklamp")

        n_target = 2 if task_type == "pick_two_obj_and_place" else rng.choice([1, 1, 2])
        for _ in range(n_target):
            place(obj, forbid=(target,))
        others = [o for o in OBJECT_LOCATIONS if o != obj]
        for _ in range(self.n_distractors):
            place(rng.choice(others))

        # Number instances per type in receptacle order, e.g. mug 1, mug 2.
        numbered, seen_count = {}, {}
        for rec in receptacles:
            rng.shuffle(contents[rec])
            numbered[rec] = []
            for o in contents[rec]:
                seen_count[o] = seen_count.get(o, 0) + 1
                numbered[rec].append(f"{o} {seen_count[o]}")

        need = TASK_TYPES[task_type][1]  # the state the object must be in: clean, hot, cool or None
        if task_type == "look_at_obj_in_light":
            sentence = f"look at {obj} under the desklamp."
        elif task_type == "pick_two_obj_and_place":
            sentence = f"put two {obj} in {target} 1."
        else:
            sentence = f"put a {need + ' ' if need else ''}{obj} in {target} 1."
        return {"task_id": task_id, "task_type": task_type, "object": obj, "target": target,
                "task": sentence, "receptacles": receptacles, "contents": numbered}

    # ------------------------------------------------------------------ episode
    def reset(self, task_id):
        g = self.generate(task_id)
        if self.step_slack:  # the task's own slack: a hash of its id picks it from the list
            slack = self.step_slack[zlib.crc32(f"slack/{self.seed}/{task_id}".encode()) % len(self.step_slack)]
            self.max_steps = min(self.step_cap, self.solution_length(task_id) + slack)
        self._task = g
        self.where = {o: r for r, objs in g["contents"].items() for o in objs}  # object -> receptacle
        self.is_open = {r: False for r in g["receptacles"] if _kind(r) in OPENABLE}
        self.state = {o: set() for o in self.where}  # object -> {"clean", "hot", "cool"}
        self.location = self.holding = self._last_phase = None
        self.t, self.done, self.lamp_on = 0, False, False
        self.known = {}  # what the agent has observed: receptacle -> the objects it saw there
        self.seen = {}  # what a reader of the transcript has seen: object -> where it was last seen (None: in hand)
        obs = f"You are in the middle of a room. Looking quickly around you, you see {_listing(g['receptacles'])}."
        self.last_obs = obs
        return obs, {"task": g["task"], "task_type": g["task_type"], "task_id": task_id}

    def _here(self, rec):
        """The objects in `rec`, by type and number (mug 2 before mug 10)."""
        return sorted((o for o, r in self.where.items() if r == rec), key=lambda o: (_kind(o), int(o.split()[-1])))

    def _describe(self, rec):
        """Contents sentence; records what the agent now knows."""
        objs = self._here(rec)
        self.known[rec] = list(objs)
        if _kind(rec) in OPENABLE:
            return f"The {rec} is open. In it, you see {_listing(objs)}."
        return f"On the {rec}, you see {_listing(objs)}."

    def _visible(self, rec):
        return _kind(rec) not in OPENABLE or self.is_open[rec]

    def _execute(self, cmd):
        """Apply one command; returns the observation (NOTHING if it did nothing)."""
        g = self._task
        recs = set(g["receptacles"])
        words = cmd.split()
        if not words:
            return NOTHING
        if cmd == "look":
            return f"You are facing the {self.location}." if self.location else "You are in the middle of a room."
        if cmd == "inventory":
            return f"You are carrying: a {self.holding}." if self.holding else "You are not carrying anything."
        if cmd.startswith("go to "):
            rec = cmd[6:]
            if rec not in recs or rec == self.location:
                return NOTHING
            self.location = rec
            if self._visible(rec):
                return f"You arrive at {rec}. " + self._describe(rec)
            return f"You arrive at {rec}. The {rec} is closed."
        if words[0] in ("open", "close"):
            rec = cmd[len(words[0]) + 1:]
            if rec != self.location or rec not in self.is_open or self.is_open[rec] == (words[0] == "open"):
                return NOTHING
            self.is_open[rec] = words[0] == "open"
            if words[0] == "open":
                return f"You open the {rec}. " + self._describe(rec)
            return f"You close the {rec}."
        if cmd.startswith("take ") and " from " in cmd[5:]:
            o, rec = cmd[5:].split(" from ", 1)
            if (self.holding or rec != self.location or self.where.get(o) != rec or not self._visible(rec)
                    or _kind(o) == "desklamp"):
                return NOTHING
            del self.where[o]
            self.holding = o
            self.known[rec] = self._here(rec)
            return f"You pick up the {o} from the {rec}."
        if cmd.startswith("put "):
            sep = next((s for s in (" in/on ", " in ", " on ") if s in cmd[4:]), None)
            if sep is None:
                return NOTHING
            o, rec = cmd[4:].split(sep, 1)
            if o != self.holding or rec != self.location or not self._visible(rec):
                return NOTHING
            self.where[o] = rec
            self.holding = None
            self.known[rec] = self._here(rec)
            return f"You put the {o} in/on the {rec}."
        for verb, (appliance, effect) in TREATMENTS.items():
            if words[0] == verb and " with " in cmd[len(verb) + 1:]:
                o, rec = cmd[len(verb) + 1:].split(" with ", 1)
                if o != self.holding or rec != self.location or _kind(rec) != appliance:
                    return NOTHING
                self.state[o].add(effect)
                return f"You {verb} the {o} using the {rec}."
        if cmd.startswith("use "):
            thing = cmd[4:]
            if _kind(thing) != "desklamp" or self.where.get(thing) != self.location:
                return NOTHING
            self.lamp_on = True
            return f"You turn on the {thing}."
        if cmd.startswith("examine "):
            thing = cmd[8:]
            if thing == self.location:
                return self._describe(thing) if self._visible(thing) else f"The {thing} is closed."
            if thing == self.holding:
                adjectives = " ".join(sorted(self.state[thing]))
                return f"This is a {adjectives + ' ' if adjectives else ''}{thing}."
            return NOTHING
        return NOTHING

    def _success(self):
        g = self._task
        obj, task_type = g["object"], g["task_type"]
        if task_type == "look_at_obj_in_light":
            return self.lamp_on and self.holding is not None and _kind(self.holding) == obj
        need = TASK_TYPES[task_type][1]
        tgt = f"{g['target']} 1"
        placed = [o for o, r in self.where.items() if r == tgt and _kind(o) == obj
                  and (need is None or need in self.state[o])]
        return len(placed) >= (2 if task_type == "pick_two_obj_and_place" else 1)

    def step(self, action):
        self._check_step(self._task is not None)
        self._last_phase = self._phase()
        cmd = normalize_command(action)
        obs = self._execute(cmd)
        if cmd == "use desklamp 1" and obs != NOTHING and not self._success():
            self.lamp_on = False  # the lamp only counts while the object is in hand
        self.t += 1
        terminated = self._success()
        truncated = not terminated and self.t >= self.max_steps
        self.done = terminated or truncated
        self.last_obs = obs
        for r, objs in self.known.items():
            for o in objs:
                self.seen[o] = r
        if self.holding is not None:
            self.seen[self.holding] = None
        info = {"task": self._task["task"], "won": terminated, "steps": self.t}
        return obs, (1.0 if terminated else 0.0), terminated, truncated, info

    def is_invalid(self, obs):
        return obs.strip() == NOTHING

    def admissible_actions(self):
        """Every command that does something in the current state (none of them returns
        "Nothing happens."), in the grammar's canonical form ("put O in/on X"). An explorer
        that picks among these never wastes a step; tests check it against the rules."""
        g, loc, held = self._task, self.location, self.holding
        cmds = ["look", "inventory"] + [f"go to {r}" for r in g["receptacles"] if r != loc]
        if loc is not None:
            if loc in self.is_open:
                cmds.append(f"{'close' if self.is_open[loc] else 'open'} {loc}")
            cmds.append(f"examine {loc}")
            if self._visible(loc):
                if held is None:
                    cmds += [f"take {o} from {loc}" for o in self._here(loc) if _kind(o) != "desklamp"]
                else:
                    cmds.append(f"put {held} in/on {loc}")
            if held is not None:
                for verb, (appliance, _) in TREATMENTS.items():
                    if _kind(loc) == appliance:
                        cmds.append(f"{verb} {held} with {loc}")
            cmds += [f"use {o}" for o in self._here(loc) if _kind(o) == "desklamp"]
        if held is not None:
            cmds.append(f"examine {held}")
        return cmds

    def reading_question(self, rng):
        """A question about what the agent has read so far and its answer, for 00_pretrain.py's reading
        comprehension. The most common one joins two things read far apart - the task's object (in the first turn)
        and the latest listing - which is the decision a household agent makes most."""
        if self.room_questions and rng.random() < self.room_questions:
            return self._room_question(rng)
        task_obj, seen = self._task["object"], self.seen
        here = [o for o, r in seen.items() if r == self.location]
        kinds = sorted({_kind(o) for o in seen} | {task_obj})
        listing = self.location is not None and self._visible(self.location)
        choice = rng.random()
        if listing and choice < 0.5:
            if choice < 0.35:
                q, asked = "Question: is the object the task names here?", task_obj
            else:
                asked = rng.choice(kinds)
                q = f"Question: is there a {asked} here?"
            found = [o for o in here if _kind(o) == asked]
            return q, f"Answer: {'Yes: ' + ', '.join(found) if found else f'No, there is no {asked} here'}."
        if listing and choice < 0.6:
            return "Question: what is here?", f"Answer: {', '.join(here) if here else 'nothing'}."
        if choice < 0.8:
            asked = task_obj if rng.random() < 0.5 else rng.choice(kinds)
            where = [f"{o} in {r}" for o, r in seen.items() if _kind(o) == asked and r is not None]
            answer = f"{'; '.join(where)}." if where else f"I have not seen a {asked} yet."
            return f"Question: where have you seen a {asked}?", f"Answer: {answer}"
        if choice < 0.85:
            return "Question: what are you carrying?", f"Answer: {self.holding or 'nothing'}."
        return "Question: which object does the task name?", f"Answer: {task_obj}."

    def _room_question(self, rng):
        """With `room_questions=p`, that share of the reading questions asks about the room
        (listed once, in the first observation) and where the agent stands - what a `go to`
        needs: a receptacle the room has, not the one the agent is at, one not yet looked into."""
        recs, choice = self._task["receptacles"], rng.random()
        if choice < 0.3:
            return "Question: where are you?", \
                f"Answer: {'at ' + self.location if self.location else 'in the middle of the room'}."
        if choice < 0.7:
            asked = f"{_kind(rng.choice(recs))} {rng.randint(1, 3)}"
            return f"Question: is there a {asked} in the room?", f"Answer: {'yes' if asked in recs else 'no'}."
        todo = [r for r in recs if r not in self.known and r != self.location]
        return "Question: which receptacles have you not looked into yet?", f"Answer: {', '.join(todo) or 'none'}."

    # ------------------------------------------------------------------ expert
    def solution_length(self, task_id):
        """Steps the demonstrator needs for `task_id` without its habit (it searches what it has not
        seen, so this is the length of a sensible solution, not of the shortest in hindsight)."""
        if task_id not in self._solution_lengths:  # a whole episode of the planner: remember it
            clean = HouseholdEnv(self.seed, self.n_receptacles, self.n_distractors, max_steps=100,
                                 **{f"n_{k}": n for k, n in self.n_tasks.items()})
            clean.reset(task_id)
            while not clean.done:
                clean.step(clean.expert_action())
            self._solution_lengths[task_id] = clean.t
        return self._solution_lengths[task_id]

    def _search_order(self, kinds_first):
        order = []
        for k in kinds_first:
            order += [r for r in self._task["receptacles"] if _kind(r) == k]
        order += [r for r in self._task["receptacles"] if r not in order]
        return order

    def _plan(self):
        """(phase, command) of the expert from the current state and what it has observed."""
        g = self._task
        obj, task_type = g["object"], g["task_type"]
        tgt = f"{g['target']} 1"
        need, appliance, verb = TASK_TYPES[task_type][1:]
        loc = self.location
        known = self.known

        def reach(rec, then):
            """Go to rec, open it if needed, then `then`."""
            if loc != rec:
                return f"go to {rec}"
            if not self._visible(rec):
                return f"open {rec}"
            return then

        def search(kinds, phase, want):
            # Receptacles not yet looked into, in search order; the target never holds the object
            # (empty only if everything was searched, which cannot happen for generated tasks).
            todo = [r for r in self._search_order(kinds) if r not in known and not (want == obj and r == tgt)]
            return phase, (reach(todo[0], None) or f"examine {todo[0]}") if todo else "look"

        if self.holding is not None and _kind(self.holding) != obj:
            return "drop", f"put {self.holding} in/on {loc}"
        if self.holding is not None:  # holding an object of the goal type
            o = self.holding
            if task_type == "look_at_obj_in_light":
                lamp = next((r for r, objs in known.items() if "desklamp 1" in objs), None)
                if lamp is None:
                    return search(LAMP_LOCATIONS, "find lamp", "desklamp")
                return "use lamp", reach(lamp, "use desklamp 1")
            if need and need not in self.state[o]:
                app = f"{appliance} 1"
                return verb, (f"go to {app}" if loc != app else f"{verb} {o} with {app}")
            return "place", reach(tgt, f"put {o} in/on {tgt}")
        # Hands empty: fetch a known instance that is not already placed, else search.
        for rec in self._search_order(OBJECT_LOCATIONS[obj]):
            if rec == tgt and task_type != "look_at_obj_in_light":
                continue
            for o in known.get(rec, []):
                if _kind(o) == obj and self.where.get(o) == rec:
                    return "take", reach(rec, f"take {o} from {rec}")
        return search(OBJECT_LOCATIONS[obj], "search", obj)

    def _phase(self):
        return self._plan()[0] if self._task is not None and not self.done else None

    def _habit(self):
        """With probability `habit` (decided per task and step, reproducibly), the demonstrator
        that has just arrived at a closed receptacle it means to open first does `examine X`
        ("The X is closed.": valid, labelled ok, and no news); its next command is the `open X` it
        meant. A bad habit that costs a step at such arrivals, which no rule can see."""
        if not self.habit or self.done or self.location is None or self._visible(self.location):
            return None
        loc = self.location
        if self._plan()[1] != f"open {loc}" or not self.last_obs.startswith("You arrive at"):
            return None
        rng = random.Random(f"habit/{self.seed}/{self._task['task_id']}/{self.t}")
        return f"examine {loc}" if rng.random() < self.habit else None

    def expert_action(self):
        return self._habit() or self._plan()[1]

    def expert_text(self):
        """ReAct text: a short thought where the plan changes, a bare action elsewhere."""
        habit = self._habit()
        if habit is not None:
            return f"Action: {habit}"
        phase, cmd = self._plan()
        if phase == self._last_phase:
            return f"Action: {cmd}"
        g, obj = self._task, self._task["object"]
        thoughts = {
            "search": f"I need to find a {obj}.",
            "take": f"I found a {obj}. Next, I take it.",
            **{verb: f"Now I {verb} the {obj} with {appliance} 1." for verb, (appliance, _) in TREATMENTS.items()},
            "place": f"Now I put the {obj} in/on {g['target']} 1.",
            "find lamp": "Now I need to find the desklamp.",
            "use lamp": "Now I use the desklamp.",
            "drop": "I am holding the wrong thing; I put it down.",
        }
        if phase == "search" and self._last_phase is None:
            thoughts["search"] = f"To solve the task, I need to find a {obj}."
        if phase == "search" and g["task_type"] == "pick_two_obj_and_place" and self._last_phase == "place":
            thoughts["search"] = f"Now I need to find the second {obj}."
        return f"Thought: {thoughts[phase]}\nAction: {cmd}"

    # ------------------------------------------------------------------ baseline
    def random_action(self, rng):
        """A uniformly random command of the grammar over this room's names (a baseline)."""
        g = self._task
        recs = g["receptacles"]
        objs = sorted(set(o for objs in g["contents"].values() for o in objs))
        r, o = rng.choice(recs), rng.choice(objs)
        return rng.choice([
            f"go to {r}", f"open {r}", f"close {r}", f"take {o} from {r}", f"put {o} in/on {r}",
            f"clean {o} with {r}", f"heat {o} with {r}", f"cool {o} with {r}", f"use {o}",
            f"examine {r}", "inventory", "look",
        ])
