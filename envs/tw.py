"""textworld: procedurally generated TextWorld games (Cote et al., 2018) behind the TextEnv API.

Needs `pip install textworld` (it builds jericho from source; Linux or macOS). Named `tw.py` so that it does not
shadow the `textworld` package.

Games. Each task is one TextWorld "custom" game: a map of `nb_rooms` rooms, at least `nb_objects` objects, and one
quest of `quest_length` actions (take / put / open / unlock / go ...), generated with `textworld.generator.make_game`
and compiled to a Z-machine file. Generation takes 1-3 s per game, so games are built on first use and kept in a
cache directory (`cache_dir`, default ~/.cache/qevolve or $QEVOLVE_CACHE) as
`textworld-<version>/<split>-<index>-s<game seed>-r<rooms>-o<objects>-q<quest length>/` holding game.z8 and game.json
(the json must stay beside the z8: TextWorld reads the quest from it). `prepare(split)` builds a whole split ahead of
time.

Splits. A task's settings (rooms, objects, quest length) are drawn from its split's setting lists by a generator
seeded with (seed, split, index); its game seed is
    (3 * seed + {train: 0, seen: 1, unseen: 2}) * 1_000_000 + index,
so no two tasks of any splits share a game seed.
    train  - settings from `train_settings` (default: 2-4 rooms, quests of 1-3 actions)
    seen   - new games (other seeds) with the same settings as train
    unseen - settings not in train: `unseen_settings` (default 5-6 rooms, quests of 4-5)

Observations. The ASCII banner, the objective (given separately as info["task"]) and the Z-machine prompt/status line
(">  -= Room =-0/3") are stripped from the game text.

Reward. TextWorld reports a cumulative score (custom games: 1 point for the quest). The per-step reward is the score
change / max_score, so an episode's rewards sum to its final score / max_score in [0, 1]. The episode terminates when
the game is won or lost; success = won, and the winning step carries the positive reward. `max_steps` commands end
the episode (truncated).

Invalid rule. TextWorld's Inform 7 parser answers a command that did nothing with one of its library refusals
("That's not a verb I recognise.", "You can't see any such thing.", "You can't go that way.", "What do you want to
take?", ...). is_invalid() fires when the observation starts with one of the REFUSALS patterns (collected by running
random commands on generated games and keeping the answers of commands that left the game state unchanged).

Expert. expert="policy" (default): TextWorld's winning policy recomputed from the current state after every command
(extra `policy_commands`), so it recovers from any detour. expert="walkthrough": the game's fixed walkthrough,
followed with a cursor like ScienceWorld's gold path.
"""
import contextlib
import os
import random
import re
import warnings
from unittest import mock

from envs._common import build_dir_atomically, cache_root, normalize_command, parse_task_id
from envs.base import TextEnv

SPLIT_CODE = {"train": 0, "seen": 1, "unseen": 2}

DEFAULT_TRAIN_SETTINGS = {"nb_rooms": (2, 3, 4), "nb_objects": (4, 6, 8), "quest_length": (1, 2, 3)}
DEFAULT_UNSEEN_SETTINGS = {"nb_rooms": (5, 6), "nb_objects": (8, 10), "quest_length": (4, 5)}

# Inform 7 answers to a command that changed nothing (regexes matched at the start of the observation, after any
# "(the key)"-style clarification line), collected as the module docstring says (look / examine / inventory excluded).
REFUSALS = [re.compile(p) for p in (
    r"That's not a verb I recognise\.",
    r"You can't see any such thing\.",
    r"You can't go that way\.",
    r"I beg your pardon\?",
    r"I didn't understand that sentence\.",
    r"I only understood you as far as ",
    r"What do you want to .*\?",
    r"Which do you mean, ",
    r"You must name something more substantial\.",
    r"You must supply a noun\.",
    r"You have to be more specific!",
    r"You'll have to say which compass direction to go in\.",
    r"You already have that\.",
    r"That's already (open|closed)\.",
    r"(That's|It is|The .+ is) fixed in place\.",
    r"(The )?.+ is already here\.",
    r"(That's|You're) plainly inedible\.",
    r"That's not something you can .+\.",
    r"It isn't something you can .+\.",
    r"That doesn't seem to be something you can .+\.",
    r"You can't put something (inside|on top of) itself\.",
    r"You can't wear that!",
    r"You need to take the .+ first\.",
    r"You have to .+ first\.",
    r"First you would have to .+\.",
    r"That's (un)?locked at the moment\.",
    r"That doesn't seem to fit the lock\.",
    r"You can't see inside, since .+ is closed\.",
    r"But you aren't holding that\.",
    r"You haven't got that\.",
    r"The .+ is welded shut\.",
    r"Putting things on the .+ would achieve nothing\.",
    r"Little is to be achieved by that\.",
    r"Nothing obvious happens\.",
    # no-effect answers of verbs outside the TextWorld grammar
    r"You jump on the spot\.",
    r"Time passes\.",
    r"You wave( the .+)?\.",
    r"Violence isn't the answer to this one\.",
    r"Nothing is on sale\.",
    r"You (smell|hear|feel) nothing unexpected\.",
    r"You aren't feeling especially drowsy\.",
    r"You can only do that to something animate\.",
    r"You find nothing of interest\.",
)]

_BANNER_CHARS = set(" _|\\$/<>")


def clean(text, objective=""):
    """Game text without the banner, the objective and the prompt/status line."""
    lines = text.replace("\r", "").split("\n")
    while lines and set(lines[0]) <= _BANNER_CHARS:  # banner and leading blank lines
        lines.pop(0)
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith(">")):
        lines.pop()
    out = "\n".join(lines)
    if objective and objective.strip() in out:
        out = out.replace(objective.strip(), "", 1)
    out = re.sub(r"\n{3,}", "\n\n", out).strip()
    return out


class TextWorldEnv(TextEnv):
    """See the module docstring.

    Args:
        seed: picks the games (with split and index); same seed, same games.
        n_train, n_seen, n_unseen: tasks per split (games are generated lazily).
        train_settings, unseen_settings: dicts of nb_rooms / nb_objects / quest_length value lists to draw from (seen
            uses train_settings). The two must differ.
        max_steps: commands per episode before truncation (default 30).
        expert: "policy" (replanned every step, default) or "walkthrough" (fixed).
        cache_dir: where games are kept (default $QEVOLVE_CACHE or ~/.cache/qevolve).
    """

    name = "textworld"

    def __init__(self, seed=0, n_train=500, n_seen=50, n_unseen=50, train_settings=None, unseen_settings=None,
                 max_steps=30, expert="policy", cache_dir=None):
        try:
            import textworld
        except ImportError as e:
            raise ImportError("env 'textworld' needs the textworld package: "
                              "pip install -r requirements-envs.txt") from e
        if expert not in ("policy", "walkthrough"):
            raise ValueError(f"unknown expert {expert!r}; valid: policy, walkthrough")
        self._tw = textworld
        self.seed = seed
        self.n_tasks = {"train": n_train, "seen": n_seen, "unseen": n_unseen}
        if max(self.n_tasks.values()) > 1_000_000:
            raise ValueError("at most 1,000,000 tasks per split")
        train = dict(train_settings or DEFAULT_TRAIN_SETTINGS)
        unseen = dict(unseen_settings or DEFAULT_UNSEEN_SETTINGS)
        for name, s in (("train_settings", train), ("unseen_settings", unseen)):
            if set(s) != {"nb_rooms", "nb_objects", "quest_length"} or not all(s.values()):
                raise ValueError(f"{name} needs non-empty lists for nb_rooms, nb_objects, quest_length; got {s}")
        if all(set(train[k]) & set(unseen[k]) for k in ("nb_rooms", "quest_length")):
            raise ValueError("unseen_settings must differ from train_settings in nb_rooms or quest_length")
        self.settings = {"train": train, "seen": train, "unseen": unseen}
        self.max_steps = max_steps
        self.expert = expert
        self.cache_dir = os.path.join(cache_root(cache_dir), f"textworld-{textworld.__version__}")
        self.instruction = (
            "You are playing a text adventure game. Reach the objective with text commands. Each turn, write "
            "an optional line 'Thought: ...' and then one line 'Action: <command>'. Commands: look, inventory, "
            "go north/south/east/west, examine X, open X, close X, take X, take X from Y, drop X, put X on Y, "
            "insert X into Y, unlock X with Y, lock X with Y, eat X. X and Y are names from the observations. "
            "A command that does nothing gets a refusal such as \"That's not a verb I recognise.\" or "
            "\"You can't see any such thing.\""
        )
        self._env = None  # the textworld environment (one per instance)
        self._loaded = self._state = None  # the path of the game it has loaded, the game state
        self.t, self.done = 0, True

    # ------------------------------------------------------------------ tasks
    def spec(self, task_id):
        """The generation settings of `task_id`: dict with game_seed, nb_rooms, nb_objects,
        quest_length, and dir (its cache folder)."""
        split, index = parse_task_id(self, task_id, self.n_tasks)
        rng = random.Random(f"textworld/{self.seed}/{split}/{index}")
        s = self.settings[split]
        spec = {"game_seed": (3 * self.seed + SPLIT_CODE[split]) * 1_000_000 + index,
                "nb_rooms": rng.choice(s["nb_rooms"]), "nb_objects": rng.choice(s["nb_objects"]),
                "quest_length": rng.choice(s["quest_length"])}
        name = "{}-{:05d}-s{game_seed}-r{nb_rooms}-o{nb_objects}-q{quest_length}".format(split, index, **spec)
        spec["dir"] = os.path.join(self.cache_dir, name)
        return spec

    def game_file(self, task_id):
        """Path of the compiled game of `task_id` (generated and cached on first use)."""
        spec = self.spec(task_id)

        def build(tmp):
            from textworld import GameOptions
            from textworld.generator import compile_game, make_game
            opt = GameOptions()
            opt.seeds = spec["game_seed"]
            opt.nb_rooms, opt.nb_objects, opt.quest_length = spec["nb_rooms"], spec["nb_objects"], spec["quest_length"]
            opt.path = os.path.join(tmp, "game.z8")
            opt.force_recompile = True
            with mock.patch.dict(os.environ, HOME=self.cache_dir):  # Inform 7 writes ~/Inform: into the cache
                compile_game(make_game(opt), opt)

        build_dir_atomically(spec["dir"], build)
        return os.path.join(spec["dir"], "game.z8")

    def prepare(self, split, limit=None):
        """Generate (or find in the cache) the games of `split`; returns their paths."""
        return [self.game_file(t) for t in self.task_ids(split)[:limit]]

    # ------------------------------------------------------------------ episode
    def _infos(self):
        return self._tw.EnvInfos(score=True, max_score=True, won=True, lost=True, objective=True,
                                 policy_commands=self.expert == "policy", extras=["walkthrough"])

    def reset(self, task_id):
        path = self.game_file(task_id)
        with warnings.catch_warnings():
            # jericho warns that it cannot detect score changes in generated games; TextWorld
            # tracks score and win/loss itself from the quest, so the warning does not apply.
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            if self._env is None:
                self._env = self._tw.start(path, request_infos=self._infos())
            elif self._loaded != path:
                self._env.load(path)
        self._loaded = path
        gs = self._env.reset()
        self._state = gs
        self._objective = gs["objective"] or ""
        self._score = gs["score"] or 0
        self._max_score = gs["max_score"] or 1
        self._walkthrough = [normalize_command(c) for c in (gs.get("extra.walkthrough") or [])]
        self._cursor = 0
        self.t = 0
        self.done = False
        obs = clean(gs["feedback"], self._objective)
        return obs, {"task": self._objective, "task_id": task_id, "game_file": path}

    def step(self, action):
        self._check_step(self._state is not None)
        cmd = normalize_command(action)
        self.t += 1
        try:
            gs, score, _ = self._env.step(cmd)
        except Exception as err:  # the engine died; keep collecting
            return self._crash_result(self._objective, err)
        self._state = gs
        if self._cursor < len(self._walkthrough) and cmd == self._walkthrough[self._cursor]:
            self._cursor += 1
        reward = (score - self._score) / self._max_score
        self._score = score
        won, lost = bool(gs["won"]), bool(gs["lost"])
        terminated = won or lost
        truncated = not terminated and self.t >= self.max_steps
        self.done = terminated or truncated
        info = {"task": self._objective, "won": won, "lost": lost, "score": score, "steps": self.t}
        return clean(gs["feedback"], self._objective), reward, terminated, truncated, info

    def is_invalid(self, obs):
        lines = [line for line in obs.strip().split("\n") if line.strip()]
        while lines and lines[0].startswith("(") and lines[0].endswith(")"):  # "(the key)" clarification
            lines.pop(0)
        return bool(lines) and any(p.match(lines[0]) for p in REFUSALS)

    def expert_action(self):
        if self._state is None:
            raise RuntimeError("call reset(task_id) before expert_action()")
        if self.expert == "policy":
            plan = self._state["policy_commands"] or []
            return plan[0] if plan else "look"
        return self._walkthrough[self._cursor] if self._cursor < len(self._walkthrough) else "look"

    def close(self):
        if self._env is not None:
            with contextlib.suppress(Exception):
                self._env.close()
        self._env = self._loaded = None
        self.done = True
