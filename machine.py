"""The machine a stage runs on, not what it computes: the flags that say how to run (add_machine_flags) and what
they set up - the device and its autocast precision (pick_device, autocast), LoRA adapters (add_lora), gradient
checkpointing, and every training stage's start (threads, torchrun's process group, the seed, the device), its
bookkeeping (Progress: the bar, the steps, the cost a stage reports) and its end (save_trained). Training under torchrun
itself is distributed.py's.
"""
import contextlib
import resource
import sys
import time

import torch
from tqdm import tqdm

from distributed import finish_distributed, full_state, is_main, setup_distributed
from plumbing import check_finite, check_out, die, log_metrics, seed_everything


def start(args, kind, inputs):
    """What every training stage does before its work -> (world, device, amp): --out (of this kind) and
    --metrics may be written (check_out), --threads, torchrun's process group (alone: world 1), the
    seed, and the device with its autocast dtype (amp: None for fp32, the CPU's default)."""
    if getattr(args, "lora", 0) and args.fsdp:
        die("--lora is not supported under --fsdp (use DDP: drop --fsdp)")
    check_out(args.out, kind, inputs)
    if args.metrics:
        check_out(args.metrics, "log", inputs + [args.out])
    if args.threads:
        torch.set_num_threads(args.threads)
    world = setup_distributed()[1]
    seed_everything(args.seed)
    return (world, *pick_device(args.precision))


def add_machine_flags(p, training=False, lora=False):
    """The flags that say how to run, not what to compute: every stage's; a training stage's; --lora (01, 05)."""
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 autocast on a GPU that has bf16, else fp32; bf16: autocast on any device "
                        "(on a CPU, the GPU's arithmetic: docs/real_model.md); fp32: no autocast. Weights and "
                        "optimizer state are fp32 in every case")
    if training:
        p.add_argument("--grad-accum", type=int, default=1,
                       help="micro-batches per optimizer step: the same step in less memory (still --batch-size)")
        p.add_argument("--grad-checkpointing", choices=["auto", "on", "off"], default="auto",
                       help="recompute each layer in the backward instead of keeping its activations (transformers' "
                            "gradient checkpointing): auto = on for a model of more than 20M parameters")
        p.add_argument("--fsdp", action="store_true",
                       help="under torchrun: shard the model across processes (FSDP2) instead of a copy each (DDP)")
    if lora:
        p.add_argument("--lora", type=int, default=0, metavar="R",
                       help="train rank-R LoRA adapters (peft) instead of every weight, merged in before saving; "
                            "0: every weight")


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
    """--lora R: rank-R LoRA adapters (peft) on every linear layer; save_policy merges them into the weights."""
    if not rank:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        die("--lora needs the peft package: pip install -r requirements-smollm2.txt")
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear"))


def grad_checkpointing(model, args):
    """--grad-checkpointing (auto: a real model, not the tiny one): each decoder layer's input kept, the layer
    recomputed in the backward - activation memory ~1/layers, ~30% more compute."""
    on = args.grad_checkpointing == "on" or (
        args.grad_checkpointing == "auto" and sum(p.numel() for p in model.parameters()) > 20e6)
    if on:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def peak_mem_gb(device):
    """Peak memory in GB: the GPU's, else the process's resident set (ru_maxrss is KB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


class Progress:
    """A training stage's bookkeeping, kept out of the loop a student reads: the progress bar (rank 0's), the optimizer
    steps, the tokens read and the infos of the epoch's steps; mean and cost give what its metrics record holds."""

    def __init__(self, stage, total_steps, device):
        self.device, self.t0, self.step, self.n_tok, self.infos = device, time.time(), 0, 0, []
        self.bar = tqdm(total=total_steps, desc=stage, unit="step", disable=not is_main())

    def update(self, info, tokens, **shown):
        """One optimizer step done: its info, the tokens it read (padding excluded); shown: what the bar shows."""
        self.step, self.n_tok = self.step + 1, self.n_tok + tokens
        self.infos.append(info)
        self.bar.update(1)
        self.bar.set_postfix(**shown)

    def mean(self, keys=None):
        """Each info key's mean over the steps since the last call (keys: those, else all)."""
        infos, self.infos = self.infos, []
        return {k: sum(i[k] for i in infos) / len(infos) for k in keys or infos[0]}

    def elapsed(self):
        return time.time() - self.t0

    def cost(self):
        """Tokens through the model per second (padding excluded) and peak memory in GB."""
        return {"tokens_per_s": self.n_tok / max(self.elapsed(), 1e-9), "peak_mem_gb": peak_mem_gb(self.device)}


def save_trained(model, args, what, save, records, whole=False):
    """A training stage's end: --fsdp gathers the whole state for rank 0 (every process helps; else state is None);
    rank 0 (or alone) checks that the weights are finite (check_finite: a diverged update is never written; whole: the
    state dict's tensors, else the parameters), writes them, save(state), and the metrics records to --metrics; then
    torchrun's processes end together."""
    state = full_state(model, args.fsdp)
    if is_main():
        check_finite(state.values() if state is not None else
                     model.state_dict().values() if whole else model.parameters(), what)
        save(state)
        log_metrics(args.metrics, *records)
    finish_distributed()
