"""The interface every text environment implements (docs/design.md, 'Environments')."""


class TextEnv:
    """Text in, text out. Subclasses set `name`, `instruction`, `max_steps` (the current task's step limit; reset
    may set it per task) and `n_tasks` (split -> its number of tasks) or their own task_ids, and implement reset /
    step / expert_action / is_invalid."""

    name = "base"
    instruction = ""
    max_steps = 50
    splits = ("train", "seen", "unseen")

    def task_ids(self, split):
        """All task ids of `split` (a list of strings like "train/00042"). Default: `n_tasks[split]` of them."""
        self._check_split(split)
        return [f"{split}/{i:05d}" for i in range(self.n_tasks[split])]

    def reset(self, task_id):
        """Start task `task_id`; returns (obs, info) with info["task"] the goal sentence."""
        raise NotImplementedError

    def step(self, action):
        """Execute one command; returns (obs, reward, terminated, truncated, info)."""
        raise NotImplementedError

    def expert_action(self):
        """The expert's next command from the current state."""
        raise NotImplementedError

    def expert_text(self):
        """The expert's whole turn in ReAct form. Default: the bare action."""
        return f"Action: {self.expert_action()}"

    def is_invalid(self, obs):
        """True if `obs` says the last command did nothing (retrospective 'invalid' label)."""
        raise NotImplementedError

    def close(self):
        """Release resources (subprocesses); safe to call twice."""

    def _crash_result(self, task, err, drop=True):
        """The step result of an engine that failed: with `drop` the broken engine is dropped (close(); a
        fresh one starts on next use), and the episode ends as failed (truncated, info["crashed"]) so that
        collection goes on."""
        if drop:
            self.close()
        self.done = True
        return "", 0.0, False, True, {"task": task, "crashed": True, "error": repr(err)[:500],
                                      "won": False, "steps": self.t}

    def _check_step(self, started):
        """Guard for step(): an episode must be running."""
        if not started:
            raise RuntimeError("call reset(task_id) before step()")
        if self.done:
            raise RuntimeError("episode is over; call reset(task_id)")

    def _check_split(self, split):
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r} for env {self.name!r}; valid: {', '.join(self.splits)}")
