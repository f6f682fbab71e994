"""Small helpers shared by the environments (the generated worlds and the real-environment adapters).

Pure standard library, so `import envs` never needs the optional packages.
"""
import os
import re
import shutil
import sys
import tempfile
import zlib

CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
KEPT = re.compile(r"matplotlib|textworld-.+|alfworld-.+|\.tmp-.+")  # what this project keeps in its cache


def cache_root(cache_dir=None):
    """Where generated games are kept: `cache_dir` if given, else $QEVOLVE_CACHE, else
    ~/.cache/qevolve. Created if missing. $QEVOLVE_CACHE by RUN's rule: an absolute path outside the checkout, a new
    folder or one holding only what this project keeps there (KEPT); else one error line, exit 2."""
    root = cache_dir or os.environ.get("QEVOLVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qevolve")
    if not cache_dir and os.environ.get("QEVOLVE_CACHE"):
        real = os.path.realpath(root)
        why = ("is not an absolute path" if not os.path.isabs(root) else
               "lies in the checkout" if real == CHECKOUT or real.startswith(CHECKOUT + os.sep) else
               "is not a folder" if os.path.lexists(root) and not os.path.isdir(root) else
               "holds files this project did not put there" if os.path.isdir(root) and not all(
                   KEPT.fullmatch(n) for n in os.listdir(root)) else None)
        if why:
            print(f"error: QEVOLVE_CACHE={root} {why}; name a new folder of its own", file=sys.stderr)
            sys.exit(2)
    os.makedirs(root, exist_ok=True)
    return root


def build_dir_atomically(final_dir, build):
    """Create `final_dir` by calling build(tmp_dir) on a fresh sibling temp dir, then renaming it into place. A crash
    leaves no half-built `final_dir`; when several processes build the same dir at once, the first rename wins and
    the others drop their copy. Returns `final_dir`."""
    if os.path.isdir(final_dir):
        return final_dir
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        build(tmp)
        try:
            os.rename(tmp, final_dir)
        except OSError:  # another process finished first
            if not os.path.isdir(final_dir):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final_dir


def parse_task_id(env, task_id, sizes):
    """Split "train/00042" into ("train", 42) and check it against `sizes` (split -> count).
    Raises ValueError naming what is valid."""
    try:
        split, index = task_id.split("/")
        if not index.isdigit() or not index.isascii():  # int() would take ' 5', '+5' and '5_0'
            raise ValueError
        index = int(index)
    except (AttributeError, ValueError):
        raise ValueError(f"bad task id {task_id!r}; expected '<split>/<index>' like 'train/00042'") from None
    env._check_split(split)
    if not 0 <= index < sizes[split]:
        raise ValueError(f"task id {task_id!r} out of range; split {split!r} of env {env.name!r} "
                         f"has indices 0..{sizes[split] - 1}")
    return split, index


def normalize_command(action):
    """One line, single spaces: the form every adapter sends to its engine."""
    return " ".join(str(action).strip().split())


def check_ranges(env_name, bounds):
    """Raise a ValueError naming the first (key, value, low, high) of `bounds` whose value is not in
    [low, high] (NaN is not)."""
    for key, value, low, high in bounds:
        if not low <= value <= high:
            raise ValueError(f"{env_name}: {key} must be in [{low}, {high}], got {value!r}")


def is_unseen_pairing(a, b):
    """The split rule of the generated worlds: a pairing (household's object and goal type, kitchen's dish and
    kind, ...) is held out for the unseen split iff crc32("a>b") % 4 == 0. Stable across Python versions."""
    return zlib.crc32(f"{a}>{b}".encode()) % 4 == 0


def split_pairings(pairings, *like_train):
    """{split: the (task type, object, goal) pairings its tasks draw from}: `unseen` the held-out ones, `train`
    and each split of `like_train` the others."""
    train = [p for p in pairings if not is_unseen_pairing(p[1], p[2])]
    return {"train": train, "unseen": [p for p in pairings if is_unseen_pairing(p[1], p[2])],
            **{split: train for split in like_train}}


def fill_room(rng, always, optional, needed, n):
    """Receptacle type -> count in a generated room: one of each type of `always` and of `needed`, then, in an
    order drawn by `rng`, one more of an optional type (up to its count in `optional`) while the room holds
    fewer than `n`."""
    counts = {k: int(k in always) for k in [*optional, *always]}
    for k in needed:
        counts[k] = max(counts[k], 1)
    pool = [k for k, m in optional.items() for _ in range(m)]
    rng.shuffle(pool)
    for k in pool:
        if sum(counts.values()) >= n:
            break
        if counts[k] < optional[k]:
            counts[k] += 1
    return counts
