"""Text environments behind one Gymnasium-style API (docs/design.md, 'Environments').

    env = envs.make("household", seed=0)
    obs, info = env.reset(env.task_ids("train")[0])
    obs, reward, terminated, truncated, info = env.step("go to countertop 1")

`household`, `kitchen` and `shop` (WebShop-like) are pure Python and always available. The real environments
(ScienceWorld, TextWorld, ALFWorld) import their packages only when made, so this package imports without them.
"""
import importlib
import inspect

from envs.base import TextEnv

# name -> "module:Class"; modules are imported lazily by make().
REGISTRY = {
    "household": "envs.household:HouseholdEnv",
    "shop": "envs.shop:ShopEnv",
    "kitchen": "envs.kitchen:KitchenEnv",
    # Real environments: optional packages (pip install -r requirements-envs.txt).
    "sciworld": "envs.sciworld:ScienceWorldEnv",
    "textworld": "envs.tw:TextWorldEnv",
    "alfworld": "envs.alfworld_env:ALFWorldEnv",
}


def make(name, **kwargs):
    """Build environment `name` with keyword arguments (seed=..., size knobs). A keyword the
    environment does not take, or a value of another type than its default, is a ValueError."""
    if name not in REGISTRY:
        raise ValueError(f"unknown env {name!r}; valid: {', '.join(sorted(REGISTRY))}")
    module_name, cls_name = REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    params = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    for key, value in kwargs.items():
        if key not in params:
            raise ValueError(f"env {name!r} takes no keyword {key!r}; valid: {', '.join(params)}")
        default = params[key]
        if default is None or default is inspect.Parameter.empty:
            continue
        want = {float: (int, float), tuple: (list, tuple)}.get(type(default), type(default))
        if not isinstance(value, want) or isinstance(value, bool) != isinstance(default, bool):
            raise ValueError(f"env {name!r}: {key} must be of type {type(default).__name__} like its default "
                             f"{default!r}, got {value!r}")
    return cls(**kwargs)


def judge(name, prev_obs, action):
    """Environment `name`'s verdict on one step, from the observation before it and the command: 'harmful' (a valid
    step it knows to be a lasting mistake), 'recoverable' (a mistake the world lets it undo at the cost of a step),
    'correct' (the alternative), or None (no such decision, or a world without a judge). Only kitchen has one
    (envs/kitchen.py); critic_report.py, show_credit.py and bench/seeds.py read mistakes through this."""
    module = importlib.import_module(REGISTRY[name].split(":")[0]) if name in REGISTRY else None
    return module.judge(prev_obs, action) if hasattr(module, "judge") else None


def bayes_critic(name, fit, episodes, gamma, env_kwargs):
    """The exact Bayes critic of environment `name`: V*(s_t) = E[G_t | what the agent has read], G_t the discounted
    return on r_env, for each state of each of `episodes`, under the behaviour policy estimated from the episodes
    `fit` - or None for a world without one. Only kitchen has one (envs/kitchen.py: behaviour, bayes_values)."""
    module = importlib.import_module(REGISTRY[name].split(":")[0]) if name in REGISTRY else None
    if not hasattr(module, "bayes_values"):
        return None
    make(name, **env_kwargs)  # the world's range checks (a ValueError), before any arithmetic on its knobs
    taken, wasted = module.behaviour(fit, gamma)
    return [module.bayes_values(ep, gamma, taken, wasted, **env_kwargs) for ep in episodes]


__all__ = ["TextEnv", "REGISTRY", "bayes_critic", "judge", "make"]
