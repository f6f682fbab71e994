"""Does a base model read? 00_pretrain.py's reading questions (env.reading_question) on `dev` tasks, answered greedily,
exact matches per kind: a model that copies from its context gets ids right. A measurement, not a test.

    python bench/reading.py --model runs/base/household-<key> --env-kwargs '{"step_slack": 1, ...}'
    python bench/reading.py --model runs/base/shop-<key> --env shop --env-kwargs '{"page_size": 3, ...}'
"""
import argparse
import collections
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
from bench.runner import load_stage  # noqa: E402
from plumbing import Parser, check_flags, die, load_model, load_tokenizer, parse_env_kwargs  # noqa: E402


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a base model directory (00_pretrain.py's --out)")
    p.add_argument("--env", default="kitchen", help="the environment the base was pretrained on")
    p.add_argument("--env-kwargs", default="{}", help="its keyword arguments (JSON), as run_all.sh's ENV_KWARGS")
    p.add_argument("--tasks", type=int, default=40, help="dev tasks to read (one explorer transcript each)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = check_flags(p.parse_args(), tasks="at least 1", threads="at least 1")
    from transformers import AutoModelForCausalLM
    try:
        env = envs.make(args.env, **parse_env_kwargs(args.env_kwargs))
    except (ValueError, ImportError) as e:  # an unknown env, a keyword it does not take
        die(e)
    torch.set_num_threads(args.threads)
    pre = load_stage("00_pretrain")
    tok = load_tokenizer(args.model)  # a folder that is not a model's: one line
    model = load_model(AutoModelForCausalLM, args.model).eval()
    rng, right, asked, example = random.Random(0), collections.Counter(), collections.Counter(), {}
    for task_id in env.task_ids("dev")[:args.tasks]:
        msgs = pre.transcript(env, task_id, rng, 0.3, 1.0)  # a question after every observation
        for i in range(1, len(msgs) - 1):
            if not (msgs[i]["role"] == "user" and msgs[i]["content"].startswith("Question: ")):
                continue
            kind = " ".join(msgs[i]["content"].split()[1:4]).rstrip("?")
            ids = tok.apply_chat_template(msgs[:i + 1], add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)
            if ids["input_ids"].shape[1] > model.config.max_position_embeddings - 64:
                continue
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)
            answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            asked[kind] += 1
            right[kind] += answer == msgs[i + 1]["content"]
            example.setdefault(kind, (msgs[i + 1]["content"], answer))
    print(f"{args.model}: greedy answers to 00's reading questions on {args.env} dev tasks {args.tasks}\n")
    print("| question | right | asked | example: the answer / the model's |\n|---|---|---|---|")
    for kind in sorted(asked):
        want, got = example[kind]
        print(f"| {kind} ... | {right[kind]} | {asked[kind]} | `{want[:60]}` / `{got[:60]}` |")


if __name__ == "__main__":
    main()
