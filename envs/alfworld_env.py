"""alfworld: ALFWorld's text engine (Shridhar et al., 2021) behind the TextEnv API.

Needs `pip install alfworld` (base package: TextWorld's PDDL engine + fast-downward; no THOR, no vision). Importing
alfworld creates the folder $ALFWORLD_DATA: the env points it at the games' data (checked first), or, for the tiny
games, at a folder in the project's cache.

Engine. Each game is an ALFWorld game file (game.tw-pddl: the ALFRED PDDL domain, the text grammar and a PDDL
problem) with its traj_data.json beside it, played by TextWorld's PddlEnv wrapped with ALFWorld's AlfredDemangler
(object ids -> "mug 1") and AlfredInfos, exactly as alfworld's AlfredTWEnv does. A command that matches no applicable
action returns "Nothing happens." (that is is_invalid()).

Games (`games=`):
    "data" (default) - the official games under $ALFWORLD_DATA/json_2.1.1 (or `data_dir`), fetched with
        `alfworld-download`; the same filter as AlfredTWEnv (solvable games of the chosen task types, no
        movable/sliced trials). train = train/, seen = valid_seen/, unseen = valid_unseen/; task ids index the sorted
        game paths of a split.
    "tiny" - small games in the same format, written locally by `make_tiny_game` from (seed, split, index) and cached
        under cache_dir (default ~/.cache/qevolve or $QEVOLVE_CACHE): one room of `n_receptacles` receptacles
        (fridge, microwave, sinkbasin, countertop, cabinet, drawer, shelf, desk, ...) holding target and distractor
        objects, and one of the six ALFWorld task types with a goal from ALFWorld's own goal library (PDDL goal +
        sentence templates). Each game is checked solvable by the planner when written (its plan is stored as the
        walkthrough). Split rule, as in `household`: a goal pairing (object type, goal receptacle type; "DeskLamp"
        for look_at_obj_in_light) is held out for unseen iff crc32("Object>Goal") % 4 == 0; train and seen draw
        instances of the other pairings from separate random streams.

Observations. reset() returns the room description without the "-= Welcome to TextWorld, ALFRED! =-" banner and the
"Your task is to: ..." line; that sentence is info["task"].

Reward. 1.0 on the step that reaches the goal (terminated), else 0.0, as in ALFWorld; `max_steps` commands (default
50, ALFWorld's usual budget) end the episode (truncated).

Expert (`expert=`):
    "planner" (default) - ALFWorld's PLANNER expert: fast-downward replans from the current state each time
        expert_action() is called (what AlfredExpert computes every step as `policy_commands`; here only on demand),
        so it recovers from any detour.
    "handcoded" - ALFWorld's HandCodedTWAgent, which explores from observations and facts like the expert used for
        ALFWorld's DAgger training; it observes every step, so it must be chosen at construction.

Speed. TextWorld's PDDL engine re-parses its text-grammar snippets for every applicable action on every step (~50 ms
a step on a tiny game). With `fast_text=True` (default) the parses are memoized (`enable_parse_cache`); observations
are unchanged (a test compares them) and a step takes ~20 ms.
"""
import copy
import functools
import glob
import importlib.util
import json
import os
import random
from unittest import mock

from envs._common import build_dir_atomically, cache_root, fill_room, normalize_command, parse_task_id, split_pairings
from envs.base import TextEnv

NOTHING = "Nothing happens."

TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
DATA_SPLITS = {"train": "train", "seen": "valid_seen", "unseen": "valid_unseen"}

# ------------------------------------------------------------------ tiny games
# Receptacle types of a tiny room: always present, then optional ones up to a count.
ALWAYS = ("Fridge", "Microwave", "SinkBasin", "CounterTop", "Cabinet", "Drawer")
OPTIONAL = {"Cabinet": 4, "Drawer": 3, "CounterTop": 2, "Shelf": 2, "DiningTable": 1, "CoffeeMachine": 1,
            "GarbageCan": 1, "Desk": 1, "SideTable": 2}
OBJECTS = ("Mug", "Cup", "Plate", "Bowl", "Apple", "Potato", "Tomato", "Egg", "Bread", "Lettuce", "Knife",
           "Spoon", "Fork", "DishSponge", "SaltShaker", "Book", "CD", "CellPhone", "Pen", "Pencil", "KeyChain",
           "AlarmClock", "CreditCard", "Watch", "Vase")
LOOK_OBJECTS = ("Book", "CD", "CellPhone", "Pen", "Pencil", "KeyChain", "AlarmClock", "CreditCard", "Watch",
                "Vase", "Mug", "Bowl")
LAMP_HOLDERS = ("Desk", "SideTable")
APPLIANCE = {"pick_clean_then_place_in_recep": ("Cleanable", "SinkBasin"),
             "pick_heat_then_place_in_recep": ("Heatable", "Microwave"),
             "pick_cool_then_place_in_recep": ("Coolable", "Fridge")}
PROPERTIES = {"Heatable": "heatable", "Coolable": "coolable", "Cleanable": "cleanable", "Toggleable": "toggleable",
              "Sliceable": "sliceable"}
TINY_VERSION = 1  # bump when the generator changes: cached games live under alfworld-tiny-v<N>

def all_pairings():
    """Every (task_type, object type, goal type) a tiny game can have."""
    from alfworld.gen import constants as C
    receptacles = list(dict.fromkeys(ALWAYS + tuple(OPTIONAL)))
    out = []
    for task_type in TASK_TYPES:
        if task_type == "look_at_obj_in_light":
            out += [(task_type, o, "DeskLamp") for o in LOOK_OBJECTS]
            continue
        prop, appliance = APPLIANCE.get(task_type, (None, None))
        for o in OBJECTS:
            if prop and o not in C.VAL_ACTION_OBJECTS[prop]:
                continue
            out += [(task_type, o, r) for r in receptacles
                    if r != appliance and o in C.VAL_RECEPTACLE_OBJECTS.get(r, ())]
    return out


def _mangle(kind, number):
    """An ALFRED-style object id (Type|x|y|z), mangled like ALFWorld's PDDL files."""
    coords = f"_bar__plus_{number // 100:02d}_dot_{number % 100:02d}_bar__plus_00_dot_00_bar__plus_00_dot_00"
    if kind == "SinkBasin":  # ALFRED names sink basins Sink|x|y|z|SinkBasin
        return f"Sink{coords}_bar_SinkBasin"
    return f"{kind}{coords}"


def make_tiny_game(rng, task_type, obj, goal, n_receptacles=10, n_distractors=6):
    """One tiny ALFWorld game as (game dict for game.tw-pddl, traj_data dict, sentence).
    `goal` is the goal receptacle type, or "DeskLamp" for look_at_obj_in_light."""
    from alfworld.gen import constants as C
    from alfworld.gen import goal_library
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH
    can = C.VAL_RECEPTACLE_OBJECTS
    look = task_type == "look_at_obj_in_light"
    needed = [rng.choice(LAMP_HOLDERS)] if look else [goal]
    if not any(k != goal and obj in can.get(k, ()) for k in ALWAYS):  # somewhere to find obj
        needed.append(rng.choice([k for k in OPTIONAL if k != goal and obj in can.get(k, ())]))
    counts = fill_room(rng, ALWAYS, OPTIONAL, needed, n_receptacles)
    receptacles = [(k, i) for k in sorted(counts) for i in range(1, counts[k] + 1)]
    contents = {r: [] for r in receptacles}

    def place(kind, forbid=()):
        spots = [r for r in receptacles if r[0] not in forbid and kind in can.get(r[0], ())]
        if spots:
            contents[rng.choice(spots)].append(kind)

    holders = [r for r in receptacles if r[0] in LAMP_HOLDERS]
    if holders:  # a desklamp wherever a desk or side table stands (a look task's room always has one)
        contents[rng.choice(holders)].append("DeskLamp")
    n_target = 2 if task_type == "pick_two_obj_and_place" else rng.choice([1, 1, 2])
    for _ in range(n_target):
        place(obj, forbid=() if look else (goal,))
    others = [o for o in OBJECTS if o != obj]
    for _ in range(n_distractors):
        place(rng.choice(others))

    # PDDL problem in ALFWorld's format.
    start, number = "loc_bar_0_bar_0_bar_0_bar_0", 0
    objects = ["agent1 - agent", f"{start} - location"]
    init = ["(= (total-cost) 0)", f"(atLocation agent1 {start})"]
    otypes, rtypes = set(), set()
    for j, (kind, i) in enumerate(receptacles, start=1):
        number += 1
        rid, loc = _mangle(kind, number), f"loc_bar_{j}_bar_0_bar_0_bar_0"
        objects += [f"{rid} - receptacle", f"{loc} - location"]
        init += [f"(receptacleType {rid} {kind}Type)", f"(receptacleAtLocation {rid} {loc})"]
        if kind in C.OPENABLE_CLASS_SET:
            init.append(f"(openable {rid})")
        rtypes.add(kind)
        for o in contents[(kind, i)]:
            number += 1
            oid = _mangle(o, number)
            objects.append(f"{oid} - object")
            init += [f"(objectType {oid} {o}Type)", f"(inReceptacle {oid} {rid})", f"(objectAtLocation {oid} {loc})"]
            if o != "DeskLamp":
                init.append(f"(pickupable {oid})")
            init += [f"({pred} {oid})" for prop, pred in PROPERTIES.items() if o in C.VAL_ACTION_OBJECTS[prop]]
            otypes.add(o)
    objects += [f"{t}Type - otype" for t in sorted(otypes)] + [f"{t}Type - rtype" for t in sorted(rtypes)]
    init += [f"(canContain {r}Type {o}Type)" for r in sorted(rtypes) for o in sorted(otypes) if o in can.get(r, ())]
    recep = "" if look else goal
    toggle = "DeskLamp" if look else ""
    pddl_goal = goal_library.gdict[task_type]["pddl"].replace("#", "-").format(obj=obj, recep=recep, toggle=toggle,
                                                                               mrecep="")
    problem = ("(define (problem plan_qevolve_tiny)\n(:domain alfred)\n(:objects\n" + "\n".join(objects) +
               "\n)\n(:init\n" + "\n".join(init) + "\n)\n" + pddl_goal)
    template = rng.choice(goal_library.gdict[task_type]["templates"])
    sentence = template.format(obj=obj.lower(), recep=recep.lower(), toggle=toggle.lower(), mrecep="")
    with open(ALFRED_PDDL_PATH) as f:
        domain = f.read()
    with open(ALFRED_TWL2_PATH) as f:
        grammar = f.read().replace("UNKNOWN GOAL", sentence)
    game = {"pddl_domain": domain, "grammar": grammar, "pddl_problem": problem, "solvable": None, "walkthrough": None}
    traj = {"task_type": task_type,
            "pddl_params": {"object_target": obj, "parent_target": recep, "toggle_target": toggle,
                            "mrecep_target": "", "object_sliced": False},
            "qevolve": {"generator": f"tiny-v{TINY_VERSION}", "task": sentence}}
    return game, traj, sentence


# ------------------------------------------------------------------ grammar parse cache
_PARSE_CACHE = {"on": False, "installed": False}


def enable_parse_cache(on=True):
    """Memoize the text-grammar parses of TextWorld's PDDL engine (process-wide).

    PddlEnv derives the command text of every applicable action on every step, and each derivation re-parses the same
    few grammar snippets with tatsu. The parses are pure functions of the snippet, so we cache them (handing out deep
    copies, since the engine attaches a context to the parsed symbols). `on=False` turns the cache off again (the
    original functions are still called underneath)."""
    import textworld.envs.pddl.textgen as textgen
    from textworld.logic import Rule
    if not _PARSE_CACHE["installed"]:
        parse_symbols = textgen._parse_and_convert
        parse_query = Rule.parse_conjunctive_query.__func__
        cached_symbols = functools.lru_cache(maxsize=8192)(
            lambda text, rule_name: parse_symbols(text, rule_name=rule_name))
        cached_query = functools.lru_cache(maxsize=8192)(lambda cls, expr: parse_query(cls, expr))

        def symbols(text, rule_name=None, trace=False, **kwargs):
            if not _PARSE_CACHE["on"] or trace or kwargs:
                return parse_symbols(text, rule_name=rule_name, trace=trace, **kwargs)
            return copy.deepcopy(cached_symbols(text, rule_name))

        def query(cls, expr):
            return cached_query(cls, expr) if _PARSE_CACHE["on"] else parse_query(cls, expr)

        textgen._parse_and_convert = symbols
        Rule.parse_conjunctive_query = classmethod(query)
        _PARSE_CACHE["installed"] = True
    _PARSE_CACHE["on"] = bool(on)


class ALFWorldEnv(TextEnv):
    """See the module docstring.

    Args:
        seed: picks the tiny games (with split and index); unused for games="data".
        games: "data" (official games under $ALFWORLD_DATA, default) or "tiny".
        data_dir: ALFWorld data root (default $ALFWORLD_DATA, then ~/.cache/alfworld).
        task_types: ALFWorld task types to keep (default: all six).
        max_steps: commands per episode before truncation (default 50).
        expert: "planner" (fast-downward replanning, default) or "handcoded".
        n_train, n_seen, n_unseen: tiny games per split (generated lazily).
        n_receptacles, n_distractors: size of a tiny room.
        cache_dir: where tiny games are kept (default $QEVOLVE_CACHE or ~/.cache/qevolve).
        fast_text: memoize the engine's grammar parses (see enable_parse_cache).
    """

    name = "alfworld"

    def __init__(self, seed=0, games="data", data_dir=None, task_types=TASK_TYPES, max_steps=50, expert="planner",
                 n_train=500, n_seen=50, n_unseen=50, n_receptacles=10, n_distractors=6, cache_dir=None,
                 fast_text=True):
        if importlib.util.find_spec("alfworld") is None:
            raise ImportError("env 'alfworld' needs the alfworld package: pip install -r requirements-envs.txt")
        if games not in ("data", "tiny"):
            raise ValueError(f"unknown games {games!r}; valid: data, tiny")
        # Importing alfworld creates $ALFWORLD_DATA: the data folder, checked first, or one in the project's cache.
        if games == "data":
            root = data_dir or os.environ.get("ALFWORLD_DATA") or os.path.expanduser("~/.cache/alfworld")
            if not os.path.isdir(os.path.join(root, "json_2.1.1")):
                raise ValueError(f"ALFWorld data not found at {os.path.join(root, 'json_2.1.1')}; download it with "
                                 "`alfworld-download` (sets up $ALFWORLD_DATA) or use envs.make('alfworld', "
                                 "games='tiny')")
        else:
            root = os.environ.get("ALFWORLD_DATA") or os.path.join(cache_root(cache_dir), "alfworld-data")
        try:
            with mock.patch.dict(os.environ, ALFWORLD_DATA=root):
                import alfworld.info  # noqa: F401
            import textworld
            from textworld.envs import PddlEnv  # noqa: F401
        except ImportError as e:
            raise ImportError("env 'alfworld' needs the alfworld package: pip install -r requirements-envs.txt") from e
        if expert not in ("planner", "handcoded"):
            raise ValueError(f"unknown expert {expert!r}; valid: planner, handcoded")
        bad = [t for t in task_types if t not in TASK_TYPES]
        if bad or not task_types:
            raise ValueError(f"unknown task type(s) {bad}; valid: {', '.join(TASK_TYPES)}")
        if n_receptacles < len(ALWAYS) + 2:
            raise ValueError(f"n_receptacles must be at least {len(ALWAYS) + 2}")
        self._tw = textworld
        self.seed = seed
        self.games = games
        self.task_types = tuple(task_types)
        self.max_steps = max_steps
        self.expert = expert
        self.n_receptacles, self.n_distractors = n_receptacles, n_distractors
        self.fast_text = fast_text
        if fast_text:
            enable_parse_cache(True)
        if games == "data":
            self.data_dir = os.path.join(root, "json_2.1.1")
            self._files = {}
        else:
            self.n_tasks = {"train": n_train, "seen": n_seen, "unseen": n_unseen}
            self.cache_dir = os.path.join(cache_root(cache_dir), f"alfworld-tiny-v{TINY_VERSION}")
            self.pairings = split_pairings([p for p in all_pairings() if p[0] in self.task_types], "seen")
        self.instruction = (
            "You are a household agent in ALFWorld. Reach the goal with text commands. Each turn, write an "
            "optional line 'Thought: ...' and then one line 'Action: <command>'. Commands: go to X, open X, "
            "close X, take O from X, move O to X, clean O with X, heat O with X, cool O with X, use X, "
            f"examine X, inventory, look. A command that does nothing returns '{NOTHING}'"
        )
        self._env = None  # the engine (TextWorld PddlEnv + ALFWorld wrappers)
        self._loaded = self._state = self._task = None
        self.t, self.done = 0, True

    # ------------------------------------------------------------------ tasks
    def _data_files(self, split):
        """Solvable official games of `split` (AlfredTWEnv's filter), sorted."""
        if split not in self._files:
            root = os.path.join(self.data_dir, DATA_SPLITS[split])
            files = []
            for traj_path in sorted(glob.glob(os.path.join(root, "**", "traj_data.json"), recursive=True)):
                folder = os.path.dirname(traj_path)
                game_path = os.path.join(folder, "game.tw-pddl")
                if "movable" in folder or "Sliced" in folder or not os.path.isfile(game_path):
                    continue
                with open(traj_path) as f:
                    if json.load(f).get("task_type") not in self.task_types:
                        continue
                with open(game_path) as f:
                    if not json.load(f).get("solvable"):
                        continue
                files.append(game_path)
            self._files[split] = files
        return self._files[split]

    def task_ids(self, split):
        if self.games == "tiny":
            return super().task_ids(split)
        self._check_split(split)
        return [f"{split}/{i:05d}" for i in range(len(self._data_files(split)))]

    def tiny_spec(self, task_id):
        """(task_type, object type, goal type, folder) of a tiny game."""
        split, index = parse_task_id(self, task_id, self.n_tasks)
        rng = random.Random(f"alfworld-tiny/{self.seed}/{split}/{index}")
        task_type = rng.choice(sorted({p[0] for p in self.pairings[split]}))
        task_type, obj, goal = rng.choice([p for p in self.pairings[split] if p[0] == task_type])
        folder = os.path.join(self.cache_dir, f"{split}-{index:05d}-s{self.seed}-n{self.n_receptacles}"
                                              f"-d{self.n_distractors}")
        return task_type, obj, goal, folder, rng

    def game_file(self, task_id):
        """Path of the game.tw-pddl of `task_id` (a tiny game is generated on first use)."""
        if self.games == "data":
            split, index = parse_task_id(self, task_id, {s: len(self._data_files(s)) for s in self.splits})
            return self._data_files(split)[index]
        task_type, obj, goal, folder, rng = self.tiny_spec(task_id)

        def build(tmp):
            game, traj, _ = make_tiny_game(rng, task_type, obj, goal, self.n_receptacles, self.n_distractors)
            game_path = os.path.join(tmp, "game.tw-pddl")
            with open(os.path.join(tmp, "traj_data.json"), "w") as f:
                json.dump(traj, f, indent=1)
            with open(game_path, "w") as f:
                json.dump(game, f)
            plan = self._solve(game_path)  # the planner's check, as alfworld-generate does
            if plan is None:
                raise RuntimeError(f"generated tiny game {task_id} ({task_type}, {obj}, {goal}) is not solvable")
            game["walkthrough"], game["solvable"] = plan, True
            with open(game_path, "w") as f:
                json.dump(game, f)

        build_dir_atomically(folder, build)
        return os.path.join(folder, "game.tw-pddl")

    def _solve(self, game_path):
        """The planner's plan from the start of a game if following it wins, else None."""
        if self._env is None:
            self._env = self._make_engine()
        env = self._env  # one engine per instance (see _make_engine); this ends any running episode
        self._state, self.done = None, True
        env.load(game_path)
        self._loaded = game_path
        env.reset()
        u = env.unwrapped
        plan = u._pddl_state.replan(u._entity_infos)
        won = False
        for cmd in plan:
            gs, _, _ = env.step(cmd)
            won = bool(gs["won"])
        return plan if won and plan else None

    def prepare(self, split, limit=None):
        """Generate (or find) the games of `split`; returns their paths. Ends a running episode."""
        return [self.game_file(t) for t in self.task_ids(split)[:limit]]

    # ------------------------------------------------------------------ engine
    def _make_engine(self):
        """PddlEnv + ALFWorld's wrappers. Each PddlEnv loads its own copy of fast-downward's shared library (so
        instances do not share planner state); the copy stays loaded until the process exits (unloading it with
        dlclose crashes a later load)."""
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs import PddlEnv
        handcoded = self.expert == "handcoded"
        infos = self._tw.EnvInfos(won=True, admissible_commands=handcoded, facts=handcoded, extras=["gamefile"])
        return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))

    def close(self):
        """Drop the engines (in-process; nothing to kill). Safe to call twice."""
        self._env = self._loaded = self._state = None
        self.done = True

    # ------------------------------------------------------------------ episode
    def reset(self, task_id):
        path = self.game_file(task_id)
        if self._env is None:
            self._env = self._make_engine()
        if self._loaded != path:
            self._env.load(path)
            self._loaded = path
        gs = self._env.reset()
        self._state = gs
        intro = gs["feedback"]
        body, _, task = intro.partition("Your task is to: ")
        body = body.replace("-= Welcome to TextWorld, ALFRED! =-", "").strip()
        self._task = task.strip()
        self._handcoded = None
        self._next_handcoded = "look"
        if self.expert == "handcoded":
            from alfworld.agents.expert import HandCodedTWAgent
            self._handcoded = HandCodedTWAgent(max_steps=200)
            self._handcoded.reset(path)
            self._handcoded.observe(intro)
        self.t = 0
        self.done = False
        return body, {"task": self._task, "task_id": task_id, "game_file": path}

    def step(self, action):
        self._check_step(self._state is not None)
        cmd = normalize_command(action)
        self.t += 1
        try:
            gs, _, _ = self._env.step(cmd)
        except Exception as err:  # the engine failed; keep collecting
            return self._crash_result(self._task, err)
        self._state = gs
        won = bool(gs["won"])
        if self._handcoded is not None:
            self._next_handcoded = self._handcoded_next(gs, won, cmd)
        terminated = won
        truncated = not terminated and self.t >= self.max_steps
        self.done = terminated or truncated
        info = {"task": self._task, "won": won, "steps": self.t}
        return gs["feedback"], (1.0 if won else 0.0), terminated, truncated, info

    def _handcoded_next(self, gs, won, cmd):
        """The hand-coded expert's next command (AlfredExpert's rule: its choice if admissible, else look)."""
        try:
            nxt = self._handcoded.act(gs, 0, won, cmd)
        except Exception:  # timeout / gave up
            return "look"
        return nxt if nxt in gs["admissible_commands"] else "look"

    def is_invalid(self, obs):
        return obs.strip() == NOTHING

    def expert_action(self):
        if self._state is None:
            raise RuntimeError("call reset(task_id) before expert_action()")
        if self.expert == "handcoded":
            return self._next_handcoded
        u = self._env.unwrapped
        plan = u._pddl_state.replan(u._entity_infos)
        return plan[0] if plan else "look"
