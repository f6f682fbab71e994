"""Does LoRA (01 / 05 --lora R) pay on a CPU? One 01-like training step of SmolLM2-135M (4 x 512 tokens, logits at
the last 64 of each row, AdamW) with every weight trained vs rank-R adapters on every linear layer: s / step, tokens/s
(median of 3 after a warm-up), trainable parameters, peak RSS; each rank in its own process.

    python bench/speed/lora_speed.py --model models/smollm2-135m --threads 2 --ranks 0 16
"""
import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from bench.runner import must, parser  # noqa: E402
from machine import add_lora  # noqa: E402
from plumbing import check_flags, die, load_model  # noqa: E402


def one(model_dir, rank, threads):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = add_lora(load_model(AutoModelForCausalLM, model_dir), rank)  # 01 --lora's adapters; a broken model: one line
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randint(0, m.config.vocab_size, (4, 512))
    times = []
    for _ in range(4):
        t = time.time()
        m(input_ids=x, logits_to_keep=64).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.time() - t)
    print("RESULT " + json.dumps({"trainable_m": sum(p.numel() for p in params) / 1e6,
                                  "s_per_step": sorted(times[1:])[1]}))  # the median of 3 after the warm-up


def main():
    p = parser(__doc__)
    p.add_argument("--model", default="models/smollm2-135m", help="directory written by python -m models.smollm2")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 16], help="LoRA ranks to measure (0: full fine-tuning)")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = check_flags(p.parse_args(), threads="at least 1")
    if min(a.ranks) < 0 or max(a.ranks) > 4096:
        die(f"--ranks must be LoRA ranks in [0, 4096] (0: full fine-tuning), got {' '.join(map(str, a.ranks))}")
    if a.one is not None:
        return one(a.model, a.one, a.threads)
    if max(a.ranks) and importlib.util.find_spec("peft") is None:
        die("--ranks above 0 need the peft package: pip install -r requirements-smollm2.txt")
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        die(f"{a.model} is not a model directory; run python -m models.smollm2 --out {a.model}")
    print("| LoRA rank | trained params | s / step | tokens/s | peak RSS |\n|---|---|---|---|---|")
    for r in a.ranks:
        m = must([sys.executable, __file__, "--model", a.model, "--threads", str(a.threads), "--one", str(r)],
                 result=True)
        d = m["result"]
        print(f"| {r or 'none (full)'} | {d['trainable_m']:.2f} M | {d['s_per_step']:.2f} | "
              f"{4 * 512 / d['s_per_step']:.0f} | {m['peak_mib'] / 1024:.2f} GiB |", flush=True)


if __name__ == "__main__":
    main()
