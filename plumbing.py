"""Plumbing every stage imports; nothing of the algorithm is here, so a first reading can skip it.

Its promises (docs/design.md, 'Conventions'): bad input is one `error:` line and exit 2 before any
work (die, check_flags, read_episodes, load_tokenizer, load_model); a stage replaces only an output
of its own kind (check_out, owned), atomically (write_atomic, save_text, log_metrics), and never
saves a diverged update (check_finite). The torchrun helpers at the bottom are a no-op for a plain
`python` run (docs/distributed.md).
"""
import contextlib
import json
import math
import os
import random
import resource
import shutil
import sys

import numpy as np
import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar: not this project's output


def die(msg):
    print("error: " + " ".join(str(msg).split())[:500], file=sys.stderr)
    sys.exit(2)


RULES = {"at least 1": lambda v: v >= 1, "non-negative": lambda v: v >= 0, "positive": lambda v: v > 0,
         "in [0, 1]": lambda v: 0 <= v <= 1, "in (0, 1)": lambda v: 0 < v < 1, "in (0, 1]": lambda v: 0 < v <= 1,
         "a seed in [0, 2**32)": lambda v: 0 <= v < 2**32}


def check_flags(args, **rules):
    for name, rule in rules.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and RULES[rule](value)):
            die(f"--{name.replace('_', '-')} must be {rule}, got {value}")


# Each kind of output: what it is, and the stages that write it (named in its args.json / summary).
ARTIFACTS = {"policy": ("a policy directory written by 00_pretrain.py / 01_bc.py / 05_bppo.py",
                        ("00_pretrain", "01_bc", "05_bppo")),
             "critic": ("a critic directory written by 03_critic.py", ("03_critic",)),
             "02_collect": ("an episode JSONL (or its .json summary) written by 02_collect.py", ("02_collect",)),
             "04_gae": ("a JSONL with advantages (or its .json summary) written by 04_gae.py", ("04_gae",)),
             "log": ("a metrics JSONL", ())}


def read_json(path):
    """A JSON object from a file, or None (missing, binary, not JSON, not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def owned(path, kind):
    """Whether an existing path is this kind's artifact, judged from all of it: a directory of plain
    files whose args.json names a stage of the kind; a summary naming one; a JSONL whose every line is
    an episode of the kind (with `adv`: 04's) or a metrics record."""
    stages = ARTIFACTS[kind][1]
    if kind in ("policy", "critic"):
        names = [] if os.path.islink(path) or not os.path.isdir(path) else os.listdir(path)
        return (all(os.path.isfile(os.path.join(path, n)) for n in names) and ("heads.safetensors" in names) ==
                (kind == "critic") and (read_json(os.path.join(path, "args.json")) or {}).get("stage") in stages)
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    if path.endswith(".json"):
        return os.path.getsize(path) == 0 or (read_json(path) or {}).get("stage") in stages
    try:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (UnicodeDecodeError, ValueError):
        return False
    if kind == "log":
        return all(isinstance(r, dict) and "stage" in r for r in rows)
    keys = {**STEP_KEYS, "adv": float} if kind == "04_gae" else STEP_KEYS
    return all(episode_error(r, keys) is None and ("adv" in r["steps"][0]) == (kind == "04_gae") for r in rows)


def check_out(path, kind, inputs=()):
    """Before any work: an output is new or owned (above), never an input, nor a directory holding
    one or lying inside one, and its directory is writable. JSONL outputs and --metrics end in .jsonl."""
    real = os.path.realpath(path)
    for p in map(os.path.realpath, inputs):
        if real == p or p.startswith(real + os.sep) or real.startswith(p + os.sep):
            die(f"{path} is (or holds) an input of this stage, or lies inside one; write the output elsewhere")
    if kind in ("02_collect", "04_gae", "log") and not path.endswith(".jsonl"):
        die(f"{path}: {'--metrics' if kind == 'log' else 'the output'} must end in .jsonl")
    for p in [path] + ([path[:-len(".jsonl")] + ".json"] if kind in ("02_collect", "04_gae") else []):
        if os.path.lexists(p) and not owned(p, kind):
            die(f"{p} exists and is not {ARTIFACTS[kind][0]}; refusing to replace it (pick another path)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # a real file, not os.access: that says yes to root on a read-only or special file system
        probe = os.path.join(parent, f".write_test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        die(f"cannot write {path}: {parent} is not a writable directory ({e.strerror})")


def write_atomic(path, write_fn):
    """write_fn(tmp) writes a temporary sibling, then one rename: a killed stage leaves the old
    artifact or none (a SIGKILL may leave its path.tmpPID, which no stage deletes)."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp, old = f"{path}.tmp{os.getpid()}", f"{path}.old{os.getpid()}"
    try:
        write_fn(tmp)
        if os.path.isdir(path) and not os.path.islink(path):
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException as e:  # disk full (OSError, safetensors' own error), Ctrl-C: no temporary stays
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        elif os.path.lexists(tmp):
            os.remove(tmp)
        if isinstance(e, Exception):
            die(f"could not write {path} ({getattr(e, 'strerror', None) or e}); it was left as it was")
        raise


def save_text(path, text):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    write_atomic(path, write)


def log_metrics(path, *records):
    """Append records to --metrics (if given), atomically: a full disk leaves the file as it was."""
    if path:
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        save_text(path, old + "".join(json.dumps(r) + "\n" for r in records))


EPISODE_KEYS = {"env": str, "task_id": (str, int), "instruction": str, "task": str, "obs0": str, "steps": list,
                "reward": float, "success": bool, "source": str}
STEP_KEYS = {"text": str, "action": str, "obs": str, "r_env": float, "label": str, "r_aux": float, "done": bool}
MAX_REWARD = 100.0  # a reward or advantage larger than this is a broken buffer


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
    """What is wrong with one episode (docs/design.md, 'The episode JSONL'), or None."""
    problem = field_error(ep, EPISODE_KEYS)
    if problem or not ep["steps"]:
        return problem or "has no steps"
    return next(filter(None, (field_error(s, step_keys, f" at step {t}") for t, s in enumerate(ep["steps"]))), None)


def read_episodes(paths, step_keys=STEP_KEYS):
    """Episode JSONL files -> a list of episodes; a bad line (or a binary file) is one error naming file and line."""
    episodes = []
    for path in paths:
        if not os.path.isfile(path):
            die(f"{path}: no such file; pass an episode JSONL written by 02_collect.py")
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    ep = json.loads(line.decode("utf-8")) if line.strip() else None
                except (UnicodeDecodeError, ValueError) as e:
                    die(f"{path}:{lineno}: not a line of JSON text ({type(e).__name__})")
                problem = None if ep is None else episode_error(ep, step_keys)
                if problem:
                    die(f"{path}:{lineno}: episode {problem}; is this an episode JSONL from 02_collect.py / 04_gae.py?")
                episodes += [] if ep is None else [ep]
    if not episodes:
        die(f"no episodes in {', '.join(paths)}; collect some with 02_collect.py first")
    return episodes


def load_tokenizer(path):
    """A local tokenizer with a chat template (nothing downloaded); a broken directory is one line."""
    if not os.path.isdir(path):
        die(f"{path}: no such directory; pass a model directory from 01_bc.py / 05_bppo.py")
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        die(f"{path}: no tokenizer_config.json; pass a model directory from 01_bc.py / 05_bppo.py")
    if os.path.exists(os.path.join(path, "heads.safetensors")):
        die(f"{path} is a critic directory (03_critic.py output), not a policy")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a file it cannot read, or one that needs a library not installed
        die(f"{path}: cannot load the tokenizer ({e})")
    if not tokenizer.chat_template:
        die(f"{path}: the tokenizer has no chat template (docs/design.md, 'The chat layout')")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(auto_class, path):
    """from_pretrained on a local directory in fp32 (nothing downloaded, no code run); refused when
    broken or missing a tensor (transformers would fill that in with random weights)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        die(f"{path}: no config.json; pass a model directory from 01_bc.py / 05_bppo.py")
    try:
        model, info = auto_class.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                 output_loading_info=True)
    except Exception as e:  # safetensors, JSON and transformers errors all mean: this directory is broken
        die(f"{path}: cannot load the model ({e})")
    if info["missing_keys"]:
        die(f"{path}: the checkpoint lacks {len(info['missing_keys'])} tensors ({min(info['missing_keys'])}, ...)")
    return model


def check_finite(tensors, what):
    if not all(torch.isfinite(t).all() for t in tensors):
        die(f"{what} has non-finite weights (the update diverged); nothing written - lower --lr")


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def add_machine_flags(p):
    """The flags every stage shares that say how to run, not what to compute."""
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 autocast on a GPU that has bf16, else fp32; bf16: autocast on any device "
                        "(on a CPU, the GPU's arithmetic: docs/real_model.md); fp32: no autocast. Weights and "
                        "optimizer state are fp32 in every case")


def pick_device(precision="auto"):
    """-> (device, amp): CUDA when available, else the CPU; amp is the dtype the forward and its
    backward run in under torch.autocast (autocast below), None for plain fp32. Weights, gradients
    and optimizer state stay fp32 whatever amp is: an AdamW step of lr 1e-6 is below bf16's
    resolution for almost every weight (8 bits of mantissa), so bf16 weights would drop it."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if precision == "fp32" or (precision == "auto" and device.type == "cpu"):
        return device, None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        if precision == "bf16":
            die("--precision bf16: this GPU has no bf16 (torch.cuda.is_bf16_supported() is false); use fp32")
        print("note: this GPU has no bf16: the stage runs in fp32 (slower, as correct)")
        return device, None
    return device, torch.bfloat16


def autocast(device, amp):
    """The context a forward pass runs in: torch.autocast to amp (pick_device), or nothing."""
    return torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()


def add_lora(model, rank):
    """--lora R: train rank-R LoRA adapters (peft) on every linear layer instead of every weight;
    merged into the weights before saving (merged_for_saving), so the output is a plain model."""
    if not rank:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        die("--lora needs the peft package: pip install -r requirements-smollm2.txt")
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear"))


def merged_for_saving(model, rank):
    return model.merge_and_unload() if rank else model


def length_batches(lengths, batch_size, rng):
    """Batches of indices with similar lengths (little padding), in random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def cost(n_tokens, seconds, device):
    """Tokens through the model per second (padding excluded) and peak memory in GB (the GPU's,
    else the process's resident set: ru_maxrss is KB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)
    return {"tokens_per_s": n_tokens / max(seconds, 1e-9), "peak_mem_gb": peak}


def lr_at(step, total, peak, warmup_frac):
    """Linear warmup then cosine decay to 10% of the peak."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- DISTRIBUTED: under torchrun only; a plain `python` run is rank 0 of 1 and skips all of it
# (docs/distributed.md). Every rank builds the same global batches from the same seed and takes its part.
def setup_distributed():
    """-> (rank, world size); joins the process group (nccl on GPUs, gloo on CPU) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        per_node, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", world)), torch.cuda.device_count()
        if per_node > gpus:  # NCCL cannot share one GPU between two processes of a group
            die(f"torchrun started {per_node} processes on this machine but it has {gpus} GPU(s): one process per "
                f"GPU (--nproc-per-node {gpus}), or CUDA_VISIBLE_DEVICES= to run {per_node} processes on the CPU")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # then pick_device's "cuda" is this GPU
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return torch.distributed.get_rank(), world


def is_main():
    """Rank 0 (or alone) writes artifacts, metrics and the progress bar."""
    return int(os.environ.get("RANK", 0)) == 0


def finish_distributed():
    if torch.distributed.is_initialized():  # all ranks together: gloo aborts if one leaves mid-write
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def distribute(model, world, fsdp):
    """The module to train: the model alone; DDP (a copy per process); or with --fsdp FSDP2 (each
    decoder layer, then the root, sharded across processes, in place)."""
    if world == 1:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]:
            fully_shard(layer)
        # the root resharded after every forward too: left whole after a no_grad forward, it missed updates
        return fully_shard(model, reshard_after_forward=True)
    device = next(model.parameters()).device
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])


def full_state(model, fsdp):
    """--fsdp: the whole state dict gathered for rank 0 (every rank calls this); else None."""
    if not (fsdp and torch.distributed.is_initialized()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    own = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}  # a tied weight once
    return {k: v for k, v in state.items() if k in own}


def shard(idx, rank, world):
    """This rank's part of a global batch -> (indices, weight); a rank left with none re-reads the
    first trajectory with weight 0 (DDP needs every rank in every step)."""
    mine = idx[rank::world]
    return (mine, 1.0) if mine else (idx[:1], 0.0)


def micro_batches(idx, n):
    """--grad-accum n: always n micro-batches (indices, weight); an empty one re-reads one trajectory with weight 0."""
    return [(idx[i::n], 1.0) if idx[i::n] else (idx[:1], 0.0) for i in range(n)]


def part_shares(counts, world):
    """Each micro-batch's weight in the step, world * its count / the global batch's count (action
    tokens or steps, over all parts and ranks): with DDP's average over ranks, the gradient of the
    single-process loss on the whole batch."""
    counts = torch.stack([torch.as_tensor(c).detach().float() for c in counts])
    total = counts.sum()
    if world > 1:
        torch.distributed.all_reduce(total)
    return counts * world / total.clamp(min=1e-8)


def average_info(infos, shares, world):
    """The micro-batches' info dicts averaged with part_shares over the global batch: the single-process numbers."""
    numbers = sum(torch.tensor(list(info.values())) * share.cpu() / world for info, share in zip(infos, shares))
    if world > 1:
        numbers = numbers.to(shares.device)
        torch.distributed.all_reduce(numbers)
    return dict(zip(infos[0], numbers.tolist()))


def grad_sync(model, world, fsdp, on):
    """Reduce gradients across processes in this backward (the last micro-batch) or not."""
    if world > 1 and fsdp:
        model.set_requires_gradient_sync(on)
    elif world > 1:
        model.require_backward_grad_sync = on
