"""What the scripts of bench/ share: the stage loader - a numbered stage file (00_pretrain.py ...
05_bppo.py) as a module; its name starts with a digit, so `import` cannot name it; loading it runs
no main() (every stage guards it with `if __name__ == "__main__"`) - the check of a script's run folders, and the
worlds a run of run_all.sh was evaluated in.

    sys.path.insert(0, ROOT)  # in a script of bench/: the repo root
    from bench._stages import load_stage
    gae = load_stage("04_gae").gae
"""
import importlib.util
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the stages import envs


def load_stage(name):
    """The module of ROOT/<name>.py, e.g. load_stage("01_bc")."""
    spec = importlib.util.spec_from_file_location(f"stage_{name}", os.path.join(ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_runs(prefix, seeds, made):
    """A bench script's run folders, --prefix<seed>: the prefix names a folder; made: each is a run of run_all.sh (its
    data/expert.jsonl and eval/) - else one error line."""
    from plumbing import die
    if not prefix.strip():
        die("--prefix is empty: name the runs' folders without their seed (runs/seed: runs/seed0, runs/seed1, ...)")
    for seed in seeds if made else []:
        run = os.path.join(ROOT, f"{prefix}{seed}")
        if not (os.path.isfile(os.path.join(run, "data", "expert.jsonl")) and os.path.isdir(os.path.join(run, "eval"))):
            die(f"{prefix}{seed}: no run of run_all.sh there (its data/expert.jsonl and eval/); check --prefix and "
                "--seeds, or run it first")


def eval_worlds(run):
    """The world seeds run_all.sh evaluated RUN in (its EVAL_WORLDS: eval/world<w>/), as strings, in order."""
    return sorted((d[5:] for d in os.listdir(os.path.join(ROOT, run, "eval")) if re.fullmatch(r"world(0|[1-9]\d*)", d)),
                  key=int)
