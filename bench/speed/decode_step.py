"""One decode step of a model alone (no 02, no environments), against 02's seconds per step: --batch rows of --context
random tokens, --steps greedy steps with 02's static KV cache and one host copy each, after 5 of warm-up; --random:
random weights of the config; --cuda-graph: also the step replayed from a CUDA graph (kv_cache.GraphStep); device
and precision as 02's.

    python bench/speed/decode_step.py --model models/smollm2-135m --random --batch 16 128 --cuda-graph
"""
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from bench.runner import parser  # noqa: E402
from kv_cache import GRAPH_WIDTH, GraphStep  # noqa: E402
from machine import autocast, pick_device  # noqa: E402
from plumbing import check_memory, die, load_model  # noqa: E402


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--model", required=True, help="a Hugging Face model directory (its config alone with --random)")
    p.add_argument("--random", action="store_true", help="random weights of the model's config (no weights read)")
    p.add_argument("--batch", type=int, nargs="+", default=[16, 128], help="rows decoded at once")
    p.add_argument("--context", type=int, default=400, help="tokens already in each row's cache")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed (after 5 of warm-up)")
    p.add_argument("--cuda-graph", action="store_true", help="also time the step replayed from a CUDA graph, as 02 "
                   "--cuda-graph replays it (on a CPU: run eagerly over the graph's buffers)")
    args = p.parse_args(argv)
    if min(args.batch) < 1 or args.context < 1 or args.steps < 1:
        die("--batch, --context and --steps must be at least 1")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        die(f"--model {args.model}: no config.json there (a Hugging Face model directory)")
    device, amp = pick_device("auto")
    try:
        config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    except Exception as e:  # a config.json transformers cannot read
        die(f"--model {args.model}: cannot load its config ({e})")
    # before any work: the largest batch's static KV cache (each layer's keys and values) and its prefill's logits
    # (batch x context x vocabulary), in the dtype the step runs in - not an allocation the kernel ends
    size = 2 if amp else 4
    heads = config.num_attention_heads
    kv_dim = (getattr(config, "num_key_value_heads", None) or heads) * (getattr(config, "head_dim", None) or
                                                                         config.hidden_size // heads)
    width = -(-(args.context + 5 + args.steps) // GRAPH_WIDTH) * GRAPH_WIDTH
    check_memory(max(args.batch) * size * (config.num_hidden_layers * 2 * width * kv_dim
                                           + args.context * (config.vocab_size + 4 * config.hidden_size)),
                 f"--batch {max(args.batch)} --context {args.context} --steps {args.steps}")
    torch.manual_seed(0)
    model = (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model)) if args.random
             else load_model(AutoModelForCausalLM, args.model)).to(device, amp).eval()
    steps = {"eager": model}
    if args.cuda_graph:  # as 02 --cuda-graph
        steps["cuda graph"] = GraphStep(model)
    for batch in args.batch:
        for name, step in steps.items():
            width = -(-(args.context + 5 + args.steps) // GRAPH_WIDTH) * GRAPH_WIDTH  # 02's static cache
            cache = StaticCache(config=model.config, max_cache_len=width)
            mask = torch.zeros((batch, width), dtype=torch.long, device=device)
            mask[:, :args.context] = 1
            with torch.no_grad(), autocast(device, amp):
                ids = torch.randint(0, model.config.vocab_size, (batch, args.context), device=device)
                tok = model(ids, attention_mask=mask, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
                tok.tolist()
                warm = time.time()
                for i in range(5 + args.steps):  # 5 of warm-up (and of recording the graph)
                    if i == 5:
                        t0, warm = time.time(), time.time() - warm
                    mask[:, args.context + i] = 1
                    pos = torch.full((batch, 1), args.context + i, device=device)
                    tok = step(input_ids=tok, attention_mask=mask, position_ids=pos, cache=cache).logits[:, -1].argmax(
                        -1, keepdim=True)
                    tok.tolist()  # the one host copy per step
            print(f"decode step, batch {batch}, context {args.context}, {name}: "
                  f"{(time.time() - t0) / args.steps * 1000:.1f} ms ({device.type}, {amp or 'fp32'}; its 5 warm-up "
                  f"steps{', recording the graph,' if name == 'cuda graph' else ''} {warm * 1000:.0f} ms)")


if __name__ == "__main__":
    main()
