"""Plumbing every stage imports; nothing of the algorithm is here, so a first reading can skip it.

Its promises (docs/design.md, 'Conventions'): bad input is one `error:` line and exit 2 before any work (die,
check_flags, read_episodes, load_tokenizer, load_model); a stage replaces only an output of its own kind (check_out,
owned), atomically (write_atomic, save_text, log_metrics), and never saves a diverged update (check_finite).
"""
import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
import zlib

import numpy as np
import torch
import torch.utils.checkpoint
from filelock import FileLock
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from distributed import is_main

hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar: not this project's output


def die(msg):
    """One `error:` line and exit 2. Under torchrun every rank meets the same check and rank 0 says it: another
    rank first waits to be stopped by torchrun (rank 0 failed), and says it only where rank 0 did not fail."""
    if not is_main():
        time.sleep(10)
    print("error: " + " ".join(str(msg).split())[:500], file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse for every entry point, whose refusal is one `error:` line too (its usage is --help's)."""
    def error(self, message):
        die(f"{message} (see --help)")


def stage_parser(description):
    """A stage's Parser and its --help's groups, in this order: the algorithm, data and files, the machine (whose
    shared flags machine.add_machine_flags adds) -> (parser, algorithm, data, machine)."""
    p = Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return (p, *(p.add_argument_group(t) for t in ("the algorithm", "data and files", "the machine")))


def quiet_interrupt(kind, value, tb, default=sys.excepthook):
    """Ctrl-C ends a script without a traceback (still by SIGINT: 130 in a shell; run_all.sh says how to resume).
    What it was writing is left as it was (write_atomic)."""
    if not issubclass(kind, KeyboardInterrupt):
        default(kind, value, tb)


sys.excepthook = quiet_interrupt
MAX_REWARD = 100.0  # a reward or advantage larger than this is a broken buffer
RULES = {"at least 1": lambda v: v >= 1, "non-negative": lambda v: v >= 0, "positive": lambda v: v > 0,
         "in [0, 1]": lambda v: 0 <= v <= 1, "in (0, 1)": lambda v: 0 < v < 1, "in (0, 1]": lambda v: 0 < v <= 1,
         "a seed in [0, 2**32)": lambda v: 0 <= v < 2**32, "in [-100, 100]": lambda v: abs(v) <= MAX_REWARD,
         "0 (off) or greater than 1": lambda v: v == 0 or v > 1}
# Flags that size an allocation or a loop have a ceiling; every other number one of 2**32.
LIMITS = {"threads": 1024, "grad_accum": 1024, "d_model": 16384, "n_layers": 1024, "n_heads": 1024,
          "vocab_size": 10**6, "max_len": 10**6, "lora": 4096, "candidates": 1024, "episodes": 10**6, "epochs": 10**6,
          "num_envs": 10**4, "max_new_tokens": 10**5, "batch_size": 10**6, "critic_batch_size": 10**6}


def check_flags(args, **rules):
    """Each flag of rules is what its rule (RULES) says and at most its ceiling (LIMITS), else one line -> args."""
    for name, rule in rules.items():
        value, flag, most = getattr(args, name), "--" + name.replace("_", "-"), LIMITS.get(name, 2**32)
        if value is None:
            continue
        if not ((isinstance(value, int) or math.isfinite(value)) and RULES[rule](value)):
            die(f"{flag} must be {rule}, got {value}")
        if value > most:  # a huge int, not a traceback (math.isfinite) or a loop that never ends
            die(f"{flag} must be at most {most}, got {value}")
    return args


def check_memory(nbytes, flags):
    """One estimate of the memory a set of size flags asks for (bytes), refused above what this machine has
    (the GPU's memory where there is one, else RAM): one line before any work, not an allocation that fails."""
    have = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if nbytes > have:
        die(f"{flags} ask for about {nbytes / 2**30:,.1f} GiB of memory, more than this machine's "
            f"{have / 2**30:,.1f} GiB; use smaller values")


def model_bytes(vocab_size, d_model, n_layers):
    """Training the tiny Llama (models/tiny.py): fp32 weights, gradients and AdamW's two states, 16 bytes for each
    of its vocab * d embedding and 16 d^2 per layer (attention 4 d^2, the MLP of width 4 d 12 d^2)."""
    return 16 * (vocab_size * d_model + 16 * n_layers * d_model ** 2)


def check_tiny(args):
    """The tiny model's size flags (00; 01 --model tiny), before any work: --d-model a multiple of --n-heads, and the
    memory to train it (model_bytes)."""
    if args.d_model % args.n_heads:
        die(f"--d-model {args.d_model} must be a multiple of --n-heads {args.n_heads}")
    check_memory(model_bytes(args.vocab_size, args.d_model, args.n_layers),
                 f"--vocab-size {args.vocab_size} --d-model {args.d_model} --n-layers {args.n_layers}")


def unique_keys(pairs):
    """json's object_pairs_hook: a key given twice is an error, not the last one silently winning."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def loads(text):
    """json.loads for what this project reads: a duplicate key, nesting deeper than Python's stack and a
    string holding a lone surrogate (no tokenizer or UTF-8 file takes it) are a ValueError too."""
    try:
        obj = json.loads(text, object_pairs_hook=unique_keys)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone surrogate") from None
    return obj


def parse_env_kwargs(text):
    """--env-kwargs: a JSON object of environment keywords (the world seed is --env-seed's)."""
    try:
        kwargs = loads(text)
    except ValueError as e:
        die(f"--env-kwargs must be a JSON object, got {text!r} ({e})")
    if not isinstance(kwargs, dict):
        die(f"--env-kwargs must be a JSON object, got {text!r}")
    if "seed" in kwargs:
        die("--env-kwargs: pass the world seed as --env-seed, not as 'seed'")
    return kwargs


# Each kind of output: what it is, and who writes it (named in its args.json / summary / metrics record / stamp).
STAGE_NAMES = ("00_pretrain", "01_bc", "02_collect", "03_critic", "04_gae", "05_bppo", "eto", "qlass")
ARTIFACTS = {"policy": ("a policy directory written by 00_pretrain.py / 01_bc.py / 05_bppo.py / eto.py",
                        ("00_pretrain", "01_bc", "05_bppo", "eto")),
             "critic": ("a critic directory written by 03_critic.py or qlass.py (its QNet)", ("03_critic", "qlass")),
             "02_collect": ("an episode JSONL (or its .json summary) written by 02_collect.py or qlass.py (its trees)",
                            ("02_collect", "qlass")),
             "04_gae": ("a JSONL with advantages (or its .json summary) written by 04_gae.py", ("04_gae",)),
             "log": ("a metrics JSONL written by the stages", STAGE_NAMES),
             # a deleted script's name stays only while a shipped file is stamped with it (tests/test_course.py checks):
             # docs/img's learning_curve.png and sweep*.png, bench/results/model_throughput.json
             "png": ("a PNG written by this project (its Software text chunk)",
                     ("show_credit.py", "bench/plots.py", "bench/plot_learning.py", "bench/plot_sweep.py")),
             "table": ("a results table written by bench/",
                       ("bench/ablation.py", "bench/seeds.py", "bench/plots.py", "bench/gpu_report.py",
                        "bench/speed/stage_times.py", "bench/speed/model_throughput.py",
                        "bench/speed/train_memory.py")),
             "bench_json": ("a measurement JSON written by bench/ (its 'stage')",
                            ("bench/speed/model_throughput.py", "bench/model_throughput.py")),
             "run_log": ("a run log written by bench/ (seeds.py, ablation.py, gpu_lab.sh)",
                         ("bench/seeds.py", "bench/ablation.py", "bench/gpu_lab.sh")),
             "results": ("a results table written by run_all.sh", ("run_all.sh",)),
             "settings": ("a run's settings recorded by run_all.sh", ("run_all.sh",))}
STAMPED = {"run_log": "# ", "results": "<!-- "}  # a file whose first line is PREFIX + STAMP + its writer
# The files a policy / critic directory may hold: what save_pretrained (one or sharded safetensors),
# tokenizer.save_pretrained (fast or slow tokenizers), args.json, 00's corpus_sample.txt and 03's
# heads.safetensors write. A file the user added (notes.txt) makes the directory theirs.
MODEL_FILES = re.compile(r"(config|generation_config|args|tokenizer|tokenizer_config|special_tokens_map|added_tokens"
                         r"|vocab|model\.safetensors\.index)\.json|model(-\d{5}-of-\d{5})?\.safetensors|"
                         r"heads\.safetensors|chat_template\.jinja|merges\.txt|tokenizer\.model|corpus_sample\.txt")
STAMP = "q-evolve "  # + the writer: a PNG's Software text, a run log's or results table's first line (STAMPED)


def read_json(path):
    """A JSON object from a file, or None (missing, binary, not JSON, not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = loads(f.read())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def png_software(path):
    """The Software text chunk of a PNG file (savefig(metadata={"Software": ...}) writes it), or None."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)  # matplotlib writes its text chunks right after the header
    except OSError:
        return None
    pos = 8 if data[:8] == b"\x89PNG\r\n\x1a\n" else len(data)
    while pos + 8 <= len(data):
        size, kind = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8]
        if kind == b"tEXt" and data[pos + 8:pos + 8 + size].startswith(b"Software\0"):
            return data[pos + 17:pos + 8 + size].decode("latin-1")
        if kind in (b"IDAT", b"IEND"):
            return None
        pos += 12 + size
    return None


def first_line(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline()
    except (OSError, UnicodeDecodeError):
        return ""


def owned(path, kind):
    """Whether an existing path is this kind's artifact, judged from all of it: a directory holding only
    the files a stage writes (MODEL_FILES), whose args.json names a stage of the kind; a summary naming
    one; a JSONL of at least one line, every line an episode of the kind (with `adv`: 04's) or a metrics
    record of a stage; a PNG or run log with the project's stamp; a table naming its bench script."""
    writers = ARTIFACTS[kind][1]
    if kind in ("policy", "critic"):
        names = [] if os.path.islink(path) or not os.path.isdir(path) else os.listdir(path)
        return (all(MODEL_FILES.fullmatch(n) and os.path.isfile(os.path.join(path, n)) for n in names)
                and ("heads.safetensors" in names) == (kind == "critic")
                and (read_json(os.path.join(path, "args.json")) or {}).get("stage") in writers)
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    if kind == "png":
        return png_software(path) in [STAMP + w for w in writers]
    if kind in STAMPED:
        return any(first_line(path).startswith(STAMPED[kind] + STAMP + w) for w in writers)
    if kind == "table":  # 'Measured DATE on ... by `[SETTINGS] python bench/ablation.py ...`'
        line = first_line(path)
        return line.startswith("Measured ") and any(f"python {w}" in line for w in writers)
    if path.endswith(".json"):
        return (read_json(path) or {}).get("stage") in writers
    try:
        with open(path, encoding="utf-8") as f:
            rows = [loads(line) for line in f if line.strip()]
    except (UnicodeDecodeError, ValueError):
        return False
    if kind == "log":
        return bool(rows) and all(isinstance(r, dict) and r.get("stage") in writers for r in rows)
    keys = {**STEP_KEYS, "adv": float} if kind == "04_gae" else STEP_KEYS
    return bool(rows) and all(episode_error(r, keys) is None and ("adv" in r["steps"][0]) == (kind == "04_gae")
                              for r in rows)


def inside(path, top):
    """Whether path is top or lies under it (both real paths)."""
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


CHECKOUT = os.path.dirname(os.path.realpath(__file__))
SHIPPED = (".ci", ".git", "bench", "course", "docs", "envs", "models", "tests")  # the checkout's own folders


def in_checkout(path):
    """Whether path is the checkout, a file at its top or anything in one of its own folders (SHIPPED): never a
    stage's output (RUN's rule); runs/ and other new folders of the checkout are free."""
    rel = os.path.relpath(os.path.realpath(path), CHECKOUT).split(os.sep)
    return rel[0] != ".." and (len(rel) == 1 or rel[0] in SHIPPED)


def check_path(path, inputs=()):
    """The one rule of where any script may write (check_out and write_atomic ask it): never an empty
    path, a '..' after a name that is no folder or a link, the current directory or one above it, the home directory
    or one above it (the root), nor an input, a directory holding one or a path inside one."""
    if not path.strip():
        die("the output path is empty; name a file or directory to write")
    parts = path.split("/")  # a '..' after a name that is no folder, or after a link, is read one way by the OS and
    for i, part in enumerate(parts):  # another by abspath, which the writes use: refused, not guessed
        prefix = "/".join(parts[:i]) or ("/" if path.startswith("/") else ".")
        if part == ".." and not os.path.isdir(prefix):
            die(f"{path}: '..' follows {prefix}, which is no folder; name the path without it")
    real = os.path.realpath(path)
    if real != os.path.realpath(os.path.abspath(path)):
        die(f"{path}: a '..' in it follows a link; name the path without it")
    for p in map(os.path.realpath, inputs):
        if inside(real, p) or inside(p, real):
            die(f"{path} is (or holds) an input of this stage, or lies inside one; write the output elsewhere")
    for top in (os.getcwd(), os.path.expanduser("~")):
        if inside(os.path.realpath(top), real):
            die(f"{path} is the current directory, the home directory or one above them; write the output elsewhere")


TMP_MARKER = "qevolve-temporary"  # the file write_atomic puts first into each of its temporary directories


def temporaries(path):
    """The temporary directories write_atomic made beside path: named '.NAME.qevolve-tmp-*' and holding its
    marker file (a folder that only looks like one is the user's)."""
    parent, base = os.path.split(os.path.abspath(path))
    prefix = f".{base}.qevolve-tmp-"
    names = os.listdir(parent) if os.path.isdir(parent) else []
    marked = lambda t, m: not (os.path.islink(t) or os.path.islink(m)) and first_line(m) == STAMP + "write_atomic\n"
    return [os.path.join(parent, n) for n in sorted(names)
            if n.startswith(prefix) and marked(os.path.join(parent, n), os.path.join(parent, n, TMP_MARKER))]


def recover(path):
    """What a killed write_atomic left beside path: a moved-aside old artifact goes back when path is
    missing (killed between its two renames), then every temporary is removed."""
    try:
        for tmp in temporaries(path):
            if not os.path.lexists(path) and os.path.lexists(os.path.join(tmp, "old")):
                os.rename(os.path.join(tmp, "old"), path)
            shutil.rmtree(tmp)
    except OSError as e:
        die(f"cannot clear what an interrupted run left beside {path} ({e.strerror}); is its folder writable?")


def check_out(path, kind, inputs=()):
    """Before any work: an output is in a safe place (check_path; never in the checkout but the bench's tables and
    figures in bench/results and docs/img), new or owned (above), and its directory
    is writable; a killed earlier run's leftovers are cleared first (recover). JSONL outputs and --metrics
    end in .jsonl."""
    check_path(path, inputs)
    homes = ("bench/results", "docs/img") if kind in ("table", "bench_json", "png") else ()  # the bench's, shipped
    if in_checkout(path) and not any(inside(os.path.realpath(path), os.path.join(CHECKOUT, h)) for h in homes):
        die(f"{path} is the checkout, a file at its top or lies in one of its folders ({', '.join(SHIPPED)}); write "
            "the output under runs/ or outside the checkout" + (f" (a table or figure: or in {' or '.join(homes)})"
                                                                 if homes else ""))
    if kind in ("02_collect", "04_gae", "log") and not path.endswith(".jsonl"):
        die(f"{path}: {'--metrics' if kind == 'log' else 'the output'} must end in .jsonl")
    for p in [path] + ([path[:-len(".jsonl")] + ".json"] if kind in ("02_collect", "04_gae") else []):
        if is_main() and temporaries(p):  # the process that writes (under torchrun, rank 0) clears leftovers
            # beside a metrics file, which the stages of a run share, a temporary may be another stage's append in
            # progress: it is a leftover only while this stage holds the file's lock (log_metrics)
            with metrics_lock(p) if kind == "log" else contextlib.nullcontext():
                recover(p)
        if os.path.lexists(p) and not owned(p, kind):
            die(f"{p} exists and is not {ARTIFACTS[kind][0]}; refusing to replace it (pick another path)")
    if not is_main():
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):  # a file, or a link to nothing or to itself: no folder can be made there
        die(f"cannot write {path}: {parent} is not a folder")
    try:  # a real file, not os.access: that says yes to root on a read-only or special file system
        was = os.stat(parent)
        os.rmdir(tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.qevolve-tmp-", dir=parent))
        os.utime(parent, ns=(was.st_atime_ns, was.st_mtime_ns))  # the folder's times as they were
    except OSError as e:
        die(f"cannot write {path}: {parent} is not a writable directory ({e.strerror})")


def write_atomic(path, write_fn):
    """write_fn(tmp) writes the new artifact inside a fresh temporary directory beside path
    ('.NAME.qevolve-tmp-XXXXXXXX', tempfile.mkdtemp: an unpredictable name), then it takes path's place:
    a file in one rename; a directory in two (the old one into the temporary directory as 'old', then
    the new one in; killed between them, the next check_out puts the old one back: recover)."""
    check_path(path)
    path = os.path.abspath(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        box = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.qevolve-tmp-", dir=os.path.dirname(path))
    except OSError as e:  # a file where a folder should be, a read-only folder
        die(f"could not write {path}: cannot make a folder beside it ({e.strerror})")
    tmp, old = os.path.join(box, "new"), os.path.join(box, "old")
    try:
        with open(os.path.join(box, TMP_MARKER), "w", encoding="utf-8") as f:
            f.write(STAMP + "write_atomic\n")
        write_fn(tmp)
        if os.path.isdir(path) and not os.path.islink(path):
            os.rename(path, old)
            os.rename(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException as e:  # disk full (OSError, safetensors' own error), Ctrl-C: no temporary stays
        if os.path.lexists(old) and not os.path.lexists(path):
            os.rename(old, path)
        shutil.rmtree(box, ignore_errors=True)
        if isinstance(e, Exception):
            die(f"could not write {path} ({getattr(e, 'strerror', None) or e}); it was left as it was")
        raise
    shutil.rmtree(box, ignore_errors=True)


def save_text(path, text):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    write_atomic(path, write)


def save_episodes(path, episodes, summary, args, metrics=""):
    """An episode JSONL and its summary (path[:-6] + '.json', with the flags), each atomically, as a pair: the old
    summary goes first and the new one comes last, so a summary says its JSONL is complete. Then the summary to
    --metrics."""
    summary_path = path[:-len(".jsonl")] + ".json"
    if os.path.exists(summary_path):
        os.remove(summary_path)
    save_text(path, "".join(json.dumps(ep) + "\n" for ep in episodes))
    save_text(summary_path, json.dumps({**summary, "args": vars(args)}, indent=2) + "\n")
    log_metrics(metrics, summary)


def metrics_lock(path):
    """The lock of a metrics file, which the stages that run at once on one run share (bench/gpu_lab.sh): filelock's
    lock on '.NAME.lock' beside it, an OS lock that goes when its holder ends, however it ends."""
    folder, name = os.path.split(os.path.abspath(path))
    return FileLock(os.path.join(folder, f".{name}.lock"))


def log_metrics(path, *records):
    """Append records to --metrics (if given), atomically: a full disk leaves the file as it was. Stages that run
    at once on one run take turns: each holds the file's lock from read to write (and check_out while it clears)."""
    if path:
        with metrics_lock(path):
            old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
            save_text(path, old + "".join(json.dumps(r) + "\n" for r in records))


EPISODE_KEYS = {"env": str, "task_id": str, "instruction": str, "task": str, "obs0": str, "steps": list,
                "reward": float, "success": bool, "source": str}
LABELS = ("format", "invalid", "repeat", "ok")  # 02_collect.retro_label's
STEP_KEYS = {"text": str, "action": str, "obs": str, "r_env": float, "label": str, "r_aux": float, "done": bool}


def field_error(obj, types, where=""):
    """What is wrong with a JSON object given its keys' types (float: finite, at most MAX_REWARD in size), or None."""
    if not isinstance(obj, dict):
        return f"is not a JSON object{where}"
    for key, t in types.items():
        value = obj.get(key)
        if key not in obj:
            return f"lacks {key}{where}"
        if t is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                           or not abs(value) <= MAX_REWARD):
            return f"{key} must be a finite number, at most {MAX_REWARD:g} in size{where}, got {json.dumps(value)[:40]}"
        if t is not float and not isinstance(value, t):
            return f"{key} has the wrong type{where}: {json.dumps(value)[:40]}"
    return None


def episode_error(ep, step_keys):
    """What is wrong with one episode (docs/design.md, 'The episode JSONL'), or None: a field of the
    wrong type, a label retro_label does not give, an 'ok' step with an r_aux, `done` before the end,
    a reward other than its steps' r_env summed, a success that did not finish with a positive reward."""
    problem = field_error(ep, EPISODE_KEYS)
    if problem or not ep["steps"]:
        return problem or "has no steps"
    for t, s in enumerate(ep["steps"]):
        problem = field_error(s, step_keys, f" at step {t}")
        if problem:
            return problem
        if s["label"] not in LABELS:
            return f"label must be one of {', '.join(LABELS)} at step {t}, got {json.dumps(s['label'])[:40]}"
        if s["label"] == "ok" and s["r_aux"] != 0:
            return f"r_aux must be 0 for an 'ok' step at step {t}, got {s['r_aux']}"
        if s["done"] and t < len(ep["steps"]) - 1:
            return f"is done at step {t}, before its last step {len(ep['steps']) - 1}"
    total = sum(s["r_env"] for s in ep["steps"])
    if abs(ep["reward"] - total) > 1e-6:
        return f"has reward {ep['reward']}, but its steps' r_env sum to {total}"
    if ep["success"] and not (ep["steps"][-1]["done"] and ep["reward"] > 0):
        return "is a success without a finished last step of positive reward"
    return None


def held_out(ep, share):
    """Whether 03 --holdout SHARE keeps episode `ep` out of the critic's training, so that 04 can check the critic on
    episodes it never saw: a self episode whose task id and seed hash (crc32) into the first SHARE of [0, 1). Expert
    episodes always train."""
    return ep["source"] != "expert" and zlib.crc32(f"{ep['task_id']}/{ep.get('seed')}".encode()) < share * 2**32


def read_episodes(paths, step_keys=STEP_KEYS):
    """Episode JSONL files -> a list of episodes; a bad line (or a binary file) is one error naming file and
    line. One collection (an episode's policy, seed and split) gives every step of a label the same r_aux
    (02's --r-fmt / --r-inv / --r-repeat): a step that disagrees with an earlier one is refused too, and so is a file
    named twice."""
    episodes, aux, seen = [], {}, set()
    for path in paths:
        if not os.path.isfile(path):
            die(f"{path}: no such file; pass an episode JSONL written by 02_collect.py")
        file = os.stat(path)
        key = file.st_dev, file.st_ino  # one file however it is named: a link, a hard link, '..'
        if key in seen:  # its episodes would count twice in the buffer
            die(f"--data names {path} twice; name each episode file once")
        seen.add(key)
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ep = loads(line.decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as e:
                    die(f"{path}:{lineno}: not a line of JSON text ({type(e).__name__}: {e})")
                problem = episode_error(ep, step_keys)
                for t, s in enumerate([] if problem else ep["steps"]):
                    key = json.dumps([ep.get("policy"), ep.get("seed"), ep.get("split"), s["label"]])
                    if aux.setdefault(key, s["r_aux"]) != s["r_aux"]:
                        problem = (f"step {t} has r_aux {s['r_aux']} for label {s['label']!r}, but "
                                   f"{aux[key]} earlier in the same collection")
                        break
                if problem:
                    die(f"{path}:{lineno}: episode {problem}; is this an episode JSONL from 02_collect.py / 04_gae.py?")
                episodes.append(ep)
    if not episodes:
        die(f"no episodes in {', '.join(paths)}; collect some with 02_collect.py first")
    return episodes


def fit_context(pairs, config, least=1):
    """(episode, tokenize_episode) pairs -> those that fit the context of a model (its config); the others are
    dropped and counted. Fewer than `least` left is one error line."""
    max_len = config.max_position_embeddings
    kept = [(ep, x) for ep, x in pairs if len(x["input_ids"]) <= max_len]
    if len(kept) < len(pairs):
        print(f"note: dropped {len(pairs) - len(kept)} of {len(pairs)} trajectories longer than the context "
              f"({max_len})")
    if len(kept) < least:
        if len(kept) == len(pairs):
            die(f"fewer than {least} trajectories ({len(pairs)}): collect more demonstrations")
        die(f"{'no trajectory fits' if least == 1 else f'fewer than {least} trajectories fit'} the model's context of "
            f"{max_len} tokens ({len(pairs) - len(kept)} of {len(pairs)} are longer): raise it (--max-len: 00's, or "
            "01's for a tiny model)")
    return kept


def load_tokenizer(path):
    """A local tokenizer with a chat template (nothing downloaded); a broken directory is one line."""
    if not os.path.isdir(path):
        die(f"{path}: no such directory; pass a model directory from 01_bc.py / 05_bppo.py")
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        die(f"{path}: no tokenizer_config.json; pass a model directory from 01_bc.py / 05_bppo.py")
    if os.path.exists(os.path.join(path, "heads.safetensors")):
        die(f"{path} is a critic directory (03_critic.py's, or qlass.py's QNet), not a policy")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a file it cannot read, or one that needs a library not installed
        die(f"{path}: cannot load the tokenizer ({e})")
    if not tokenizer.chat_template:
        die(f"{path}: the tokenizer has no chat template (docs/design.md, 'The chat layout')")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def same_tokenizer(tokenizer, other, what, policy, why):
    """--policy's tokenizer against a second model's (05 --ref, 03 --init, 02 --rerank), which reads the same ids."""
    if other.get_vocab() != tokenizer.get_vocab() or other.chat_template != tokenizer.chat_template:
        die(f"{what} has another tokenizer than --policy {policy}; {why}")


def load_model(auto_class, path):
    """from_pretrained on a local directory in fp32 (nothing downloaded, no code run); refused when
    broken or missing a tensor (transformers would fill that in with random weights)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        die(f"{path}: no config.json; pass a model directory from 01_bc.py / 05_bppo.py")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no load report of many lines before a refusal of one
    try:
        model, info = auto_class.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                 output_loading_info=True)
    except Exception as e:  # safetensors, JSON and transformers errors all mean: this directory is broken
        why = "tensors of other shapes than its config.json gives" if "mismatch" in str(e) else e
        die(f"{path}: cannot load the model ({why})")
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        die(f"{path}: the checkpoint lacks {len(info['missing_keys'])} tensors ({min(info['missing_keys'])}, ...)")
    check_finite(model.parameters(), path, loaded=True)
    return model


CHUNK_ROWS = 512  # rows of (N, V) logits whose fp32 softmax arithmetic exists at once (by_rows): ~100 MB at 49k


def by_rows(fn, *tensors, mean=False):
    """fn(*tensors) over chunks of CHUNK_ROWS rows -> the chunks' outputs concatenated (mean=True: fn's means
    averaged by row counts): fn's numbers for a row-wise fn (log_softmax over the vocabulary), in less memory. With a
    gradient each chunk is checkpointed (its backward recomputes fn), so fn's fp32 (rows, V) temporaries exist for
    one chunk at a time, never for every reply token of the batch."""
    n = len(tensors[0])
    if n <= CHUNK_ROWS:
        return fn(*tensors)
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    outs = []
    for i in range(0, n, CHUNK_ROWS):
        part = [t[i:i + CHUNK_ROWS] for t in tensors]
        out = torch.utils.checkpoint.checkpoint(fn, *part, use_reentrant=False) if keep else fn(*part)
        outs.append(out * len(part[0]) if mean else out)
    return sum(outs) / n if mean else torch.cat(outs)


def check_finite(tensors, what, loaded=False):
    """Weights are finite: before saving (a diverged update is never written) and on loading (a broken file)."""
    if not all(torch.isfinite(t).all() for t in tensors):
        die(f"{what}: the checkpoint holds non-finite weights (NaN or inf); it is broken - pass another" if loaded
            else f"{what} has non-finite weights (the update diverged); nothing written - lower --lr")


def load_heads(critic, path):
    """03's heads.safetensors (the V and Q heads) into critic (04's load_critic, 03 --init): a cut, empty or
    non-finite file, or heads of another size than the transformer's, is one line."""
    try:
        heads = load_file(os.path.join(path, "heads.safetensors"))
    except Exception as e:
        die(f"{path}: cannot load heads.safetensors ({e})")
    check_finite(heads.values(), f"{path}/heads.safetensors", loaded=True)
    try:
        for name, head in (("v_head.", critic.v_head), ("q_head.", critic.q_head)):
            head.load_state_dict({k[len(name):]: v for k, v in heads.items() if k.startswith(name)})
    except RuntimeError as e:  # a head tensor missing (an empty file), or of another size than the transformer's
        die(f"{path}/heads.safetensors: not the heads of this transformer ({e})")
    return critic


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def finite(loss, step):
    """The loss of a training step's micro-batch, if finite; else one error line before its backward (the weights
    stay as they were: nothing is written)."""
    if not torch.isfinite(loss):
        die(f"loss became {loss.item()} at step {step}; lower --lr")
    return loss


def save_policy(path, model, tokenizer, args, stage, state=None, texts=()):
    """A policy directory, atomically: the model (save_pretrained; --lora adapters merged into the weights,
    a plain model; state: the FSDP-gathered weights or None), its tokenizer, args.json (stage's stamp) and
    texts: (name, text) files for a human (00's corpus_sample.txt)."""
    def save(tmp):
        (model.merge_and_unload() if getattr(args, "lora", 0) else model).save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump({"stage": stage, **vars(args)}, f, indent=2)
        for name, text in texts:
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
    write_atomic(path, save)


def save_critic(critic, out_dir, tokenizer, args, state=None):
    """03's critic directory, atomically: the transformer (save_pretrained), its tokenizer, heads.safetensors
    (the V and Q heads) and args.json. state: the whole state dict (--fsdp gathers it); by default the critic's."""
    state = critic.state_dict() if state is None else state

    def write(tmp):
        backbone = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
        critic.backbone.save_pretrained(tmp, state_dict=backbone)
        tokenizer.save_pretrained(tmp)
        heads = {k: v.contiguous().cpu() for k, v in state.items() if k.startswith(("v_head.", "q_head."))}
        save_file(heads, os.path.join(tmp, "heads.safetensors"))
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump({"stage": "03_critic", **args}, f, indent=2)
    write_atomic(out_dir, write)


def length_batches(lengths, batch_size, rng):
    """Batches of indices with similar lengths (little padding), in random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def lr_at(step, total, peak, warmup_frac):
    """Linear warmup then cosine decay to 10% of the peak."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

