"""sciworld: ScienceWorld (Wang et al., 2022) behind the project's TextEnv API.

Needs `pip install scienceworld` (it bundles the simulator jar) and Java 17+ on PATH. The simulator is a JVM
subprocess reached through py4j; this adapter starts it itself (`py4j.launch_gateway`, heap capped with -Xmx) and
talks to the simulator's PythonInterface directly. The package's own `ScienceWorldEnv.step` also builds an info dict
on every step (valid-action list, look, inventory: ~135 ms); the bare server step is 1-12 ms, so we call only what we
need (step, score, completion).

Tasks and splits. ScienceWorld has 30 task types, each with numbered *variations* that the simulator itself divides
into train / dev / test (test variations hold out objects and settings). Here
    train  - the train variations of the chosen task types
    seen   - their dev variations
    unseen - their test variations
of the task types in `tasks` (default DEFAULT_TASKS: the eight with the shortest gold paths, 1-16 commands, measured
over every variation). Task ids enumerate (task type, variation) pairs round-robin over the task types, so any prefix
of a split mixes all types: "train/00000" is the first train variation of tasks[0], "train/00001" that of tasks[1],
and so on.

Observations. reset() returns the text of "look around" (what ScienceWorld's reset does); info["task"] is the task
description. An ambiguous command returns a numbered menu ("Ambiguous request: Please enter the number ...") and the
next command should be that number; gold paths use this too.

Reward. ScienceWorld scores an episode 0..100 (partial credit per subgoal) and sets the score to -100 when the agent
fails for good (e.g. focuses on the wrong object), after which we end the episode. The per-step reward is the change
of max(score, 0) / 100, so the rewards of an episode sum to its final score / 100 in [0, 1], with a failure
(score < 0) counted as 0: the step that fails carries minus the progress made so far. Success = the simulator reports
the task completed (score 100): that step has terminated=True and a positive reward. `max_steps` commands end the
episode (truncated).

Invalid rule. ScienceWorld's parser answers "No known action matches that input." to a command it cannot parse, and
"Unknown action. ..." to a non-number after an ambiguity menu. is_invalid() fires on exactly these two answers.
Commands that parse but fail in the world (e.g. "The door is not open.") are ordinary observations.

Expert. The simulator's gold action sequence for the variation (generated on the first expert_action() call of an
episode, which reloads the variation; cost 0.1-1 s). The gold path is fixed: it cannot be replanned from an arbitrary
state, so expert_action() returns the next gold command not yet executed in order (a cursor that advances when the
executed command equals it). Off the gold path this is a best guess, not a guarantee.

Processes. One JVM per env instance (~256 MB heap by default). close() ends it; it is also ended when the env is
garbage-collected and at interpreter exit, and py4j's die_on_exit makes the JVM quit if this Python process dies. If
the JVM crashes or a call times out, the running episode is reported as failed (truncated=True, info["crashed"]=True,
reward 0) and the next reset() starts a fresh JVM.
"""
import contextlib
import weakref

from envs._common import normalize_command, parse_task_id
from envs.base import TextEnv

# The eight task types with the shortest gold paths. In parentheses: the most commands
# the gold path needs to complete any variation of the type (all 1595 variations of
# these types were replayed to completion with scienceworld 1.2.3 on 2026-11; the script lives in git history).
# power-component's completion step varies by one between runs (simulator nondeterminism).
DEFAULT_TASKS = (
    "find-living-thing",                             # (16)
    "find-non-living-thing",                         # (11)
    "find-animal",                                   # (16)
    "find-plant",                                    # (16)
    "lifespan-longest-lived",                        # (7)
    "lifespan-shortest-lived",                       # (7)
    "lifespan-longest-lived-then-shortest-lived",    # (8)
    "power-component",                               # (13)
)

NO_PARSE = "No known action matches that input."
UNKNOWN_ACTION = "Unknown action."
AMBIGUOUS = "Ambiguous request"

ACTIONS = [
    "look around", "look at OBJ", "look in OBJ", "read OBJ", "inventory", "task",
    "open OBJ", "close OBJ", "go to LOC", "pick up OBJ", "put down OBJ", "move OBJ to OBJ",
    "pour OBJ in OBJ", "dunk OBJ in OBJ", "mix OBJ", "use OBJ on OBJ", "activate OBJ",
    "deactivate OBJ", "connect OBJ to OBJ", "disconnect OBJ", "eat OBJ", "flush OBJ",
    "focus on OBJ", "wait", "wait1",
]


def _shutdown(gateway, proc):
    """End one JVM (safe to call twice; used by close() and the finalizer). We own the
    process, so we kill it rather than ask it to shut down (which fails on a dead JVM)."""
    with contextlib.suppress(Exception):
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    client = getattr(gateway, "_gateway_client", None)
    if client is not None:
        # Mark the client disconnected, so py4j's finalizers of leftover Java objects do not
        # try (and log failing) to reach the dead JVM; then close its sockets.
        client.is_connected = False
        with contextlib.suppress(Exception):
            client.close()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.close()


class ScienceWorldEnv(TextEnv):
    """See the module docstring.

    Args:
        seed: accepted for API uniformity; ScienceWorld variations are deterministic.
        tasks: ScienceWorld task names (see `scienceworld.constants.ID2TASK`); default DEFAULT_TASKS, the eight
            shortest.
        max_steps: commands per episode before truncation (default 30; the default tasks need at most 16).
        max_per_task: if set, use at most this many variations of each task per split.
        simplifications: ScienceWorld simplification string, e.g. "easy" or "openDoors,selfWateringFlowerPots"
            ("" = the full game).
        java_heap: JVM -Xmx value (default "256m"; long tasks such as mendelian-genetics may need more).
        call_timeout: seconds before a simulator call counts as a crash (default 120; generating a long gold path
            takes up to ~15 s).
        jar_path: simulator jar (default: the one bundled with the package).
    """

    name = "sciworld"

    def __init__(self, seed=0, tasks=DEFAULT_TASKS, max_steps=30, max_per_task=None, simplifications="",
                 java_heap="256m", call_timeout=120, jar_path=None):
        try:
            import scienceworld.constants as sw_constants
            from py4j.protocol import Py4JError, Py4JJavaError, Py4JNetworkError  # noqa: F401
        except ImportError as e:
            raise ImportError("env 'sciworld' needs the scienceworld package and Java 17+: "
                              "pip install -r requirements-envs.txt") from e
        from scienceworld.utils import infer_task
        self._constants = sw_constants
        self.seed = seed
        known = set(sw_constants.ID2TASK.values())
        self.tasks = [infer_task(t) for t in tasks]
        bad = [t for t in self.tasks if t not in known]
        if bad or not self.tasks:
            raise ValueError(f"unknown ScienceWorld task(s) {bad}; valid: {', '.join(sorted(known))}")
        self.max_steps = max_steps
        self.max_per_task = max_per_task
        self.simplifications = simplifications
        self.java_heap = java_heap
        self.call_timeout = call_timeout
        self.jar_path = jar_path or sw_constants.JAR_PATH
        self.instruction = (
            "You are an agent in ScienceWorld, a text simulation of a house with rooms, objects, "
            "substances, living things and electrical parts. Complete the science task with text commands. "
            "Each turn, write an optional line 'Thought: ...' and then one line 'Action: <command>'. "
            "Commands (OBJ/LOC are names from the observations): " + "; ".join(ACTIONS) + ". "
            "If a command is ambiguous, the game lists numbered options; answer with the number alone. "
            "'focus on OBJ' marks the object the task is about: focusing on a wrong object fails the task. "
            f"A command the game cannot parse returns '{NO_PARSE}'"
        )
        self._gateway = self._proc = self._server = self._finalizer = None
        self._index = None      # split -> list of (task, variation)
        self._episode = None    # (task, variation) of the running episode
        self._task = None
        self.t, self.done = 0, True

    # ------------------------------------------------------------------ JVM
    def _start(self):
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
        port, proc = launch_gateway(classpath=self.jar_path, die_on_exit=True, cwd=self._constants.BASEPATH,
                                    javaopts=[f"-Xmx{self.java_heap}"], return_proc=True)
        gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port,
                                                                   read_timeout=self.call_timeout),
                              java_process=proc)
        self._gateway, self._proc = gateway, proc
        self._finalizer = weakref.finalize(self, _shutdown, gateway, proc)  # also runs at exit
        self._server = gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()

    @property
    def server(self):
        """The simulator's PythonInterface (starts the JVM on first use)."""
        if self._server is None:
            self._start()
        return self._server

    def close(self):
        if self._finalizer is not None:
            self._finalizer()  # runs _shutdown once; later calls are no-ops
        self._gateway = self._proc = self._server = self._finalizer = None
        self.done = True

    # ------------------------------------------------------------------ tasks
    def _build_index(self):
        per_task = {}
        for task in self.tasks:
            self.server.load(task, 0, self.simplifications, False)
            lists = {"train": list(self.server.getVariationsTrain()), "seen": list(self.server.getVariationsDev()),
                     "unseen": list(self.server.getVariationsTest())}
            if self.max_per_task is not None:
                lists = {s: v[:self.max_per_task] for s, v in lists.items()}
            per_task[task] = lists
        index = {}
        for split in self.splits:  # round-robin over the task types
            rows, depth = [], max(len(per_task[t][split]) for t in self.tasks)
            for i in range(depth):
                rows += [(t, per_task[t][split][i]) for t in self.tasks if i < len(per_task[t][split])]
            index[split] = rows
        self._index = index

    def task_ids(self, split):
        self._check_split(split)
        if self._index is None:
            self._build_index()
        return [f"{split}/{i:05d}" for i in range(len(self._index[split]))]

    def task_of(self, task_id):
        """(ScienceWorld task name, variation index) behind `task_id`."""
        if self._index is None:
            self._build_index()
        split, index = parse_task_id(self, task_id, {s: len(v) for s, v in self._index.items()})
        return self._index[split][index]

    # ------------------------------------------------------------------ episode
    def _load(self, gold):
        task, variation = self._episode
        self.server.load(task, variation, self.simplifications, gold)
        return self.server.step("look around")

    def reset(self, task_id):
        import py4j.protocol
        self._episode = self.task_of(task_id)
        self._gold = None
        self._cursor = 0
        self.t = 0
        self._score = 0  # max(score, 0) on the 0..100 scale
        self._actions = []
        for attempt in (0, 1):  # one retry on a fresh JVM
            try:
                obs = self._load(gold=False)
                self._task = self.server.getTaskDescription()
                break
            except py4j.protocol.Py4JError:
                self.close()
                if attempt:
                    raise
        self.done = False
        task, variation = self._episode
        return obs, {"task": self._task, "task_id": task_id, "sw_task": task, "variation": variation}

    def step(self, action):
        self._check_step(self._episode is not None)
        import py4j.protocol
        cmd = normalize_command(action)
        self.t += 1
        try:
            obs = self.server.step(cmd)
            raw = int(round(100 * self.server.getScore()))
            completed = bool(self.server.getCompleted())
        except py4j.protocol.Py4JError as err:
            # A Java exception leaves the JVM usable; anything else drops it.
            return self._crash_result(self._task, err, drop=not isinstance(err, py4j.protocol.Py4JJavaError))
        self._actions.append(cmd)
        if self._gold is not None and self._cursor < len(self._gold) and cmd == self._gold[self._cursor]:
            self._cursor += 1
        score = max(raw, 0)
        reward = (score - self._score) / 100.0
        self._score = score
        failed = raw < 0
        terminated = completed or failed
        truncated = not terminated and self.t >= self.max_steps
        self.done = terminated or truncated
        info = {"task": self._task, "score": raw, "won": completed and not failed, "failed": failed,
                "steps": self.t}
        return obs, reward, terminated, truncated, info

    def is_invalid(self, obs):
        obs = obs.strip()
        return obs.startswith(NO_PARSE) or obs.startswith(UNKNOWN_ACTION)

    # ------------------------------------------------------------------ expert
    def gold_path(self):
        """The simulator's gold command sequence for the running episode's variation."""
        if self._gold is None:
            # Generating the gold path needs a reload; replay this episode's commands after it.
            self._load(gold=True)
            self._gold = [normalize_command(a) for a in self.server.getGoldActionSequence()]
            self._cursor = 0
            for cmd in self._actions:
                self.server.step(cmd)
                if self._cursor < len(self._gold) and cmd == self._gold[self._cursor]:
                    self._cursor += 1
        return list(self._gold)

    def expert_action(self):
        if self._episode is None:
            raise RuntimeError("call reset(task_id) before expert_action()")
        gold = self.gold_path()
        return gold[self._cursor] if self._cursor < len(gold) else "look around"
