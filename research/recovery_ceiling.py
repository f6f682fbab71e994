"""How much could a policy gain by learning only to *recover* - never to repeat a command that
the environment already answered with "Nothing happens."? Runs a policy greedily on a split
(like `02_collect.py --greedy`), once as it is and once with one intervention: when the greedy
reply's command already failed earlier in the episode, replies are sampled (temperature 1)
until one names another command (at most --tries draws; else the greedy one is kept). The
intervention uses nothing the policy could not learn from its own self data: the failed
commands are in its context. The gap between the two success rates is the most that learning
to recover (with everything else the policy does unchanged) could add.

    python research/recovery_ceiling.py --policy runs/final_s0/policy_0 --split dev
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._stages import load_stage  # noqa: E402

collect = load_stage("02_collect")
import envs  # noqa: E402


def reply(model, tok, ep, greedy, max_new):
    ids = collect.ModelPolicy.prompt_ids(type("P", (), {"tokenizer": tok})(), ep)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=not greedy,
                         temperature=None if greedy else 1.0, top_k=None, top_p=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()


def run(model, tok, env, tid, recover, tries, max_new):
    obs, info = env.reset(tid)
    ep = {"instruction": env.instruction, "task": info["task"], "obs0": obs, "steps": []}
    failed, swaps = set(), 0
    for _ in range(env.max_steps):
        text = reply(model, tok, ep, True, max_new)
        action = collect.parse_action(text)
        if recover and action in failed:
            for _ in range(tries):
                alt = reply(model, tok, ep, False, max_new)
                if collect.parse_action(alt) not in failed:
                    text, action, swaps = alt, collect.parse_action(alt), swaps + 1
                    break
        if action is None:
            obs, done, trunc = collect.FORMAT_ERROR_OBS, False, False
        else:
            obs, r, done, trunc, info = env.step(action)
            if env.is_invalid(obs):
                failed.add(action)
        ep["steps"].append({"text": text, "obs": obs})
        if done or trunc:
            return bool(done and r > 0), swaps
    return False, swaps


def greedy_setup(p):
    """Add the flags every ceiling script shares to parser p, parse them, and load what a greedy
    household run needs -> (args, model, tokenizer, env, task ids)."""
    p.add_argument("--policy", required=True)
    p.add_argument("--split", default="dev")
    p.add_argument("--env-kwargs", default="{}")
    p.add_argument("--n", type=int, default=0, help="tasks (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = collect.load_tokenizer(args.policy)
    model = collect.load_pretrained(collect.AutoModelForCausalLM, args.policy, torch.float32).eval()
    env = envs.make("household", seed=0, **json.loads(args.env_kwargs))
    return args, model, tok, env, env.task_ids(args.split)[: args.n or None]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=20)
    args, model, tok, env, tids = greedy_setup(p)
    for recover in (False, True):
        wins, swaps = 0, 0
        for tid in tids:
            w, s = run(model, tok, env, tid, recover, args.tries, args.max_new_tokens)
            wins, swaps = wins + w, swaps + s
        print(f"{args.policy} {args.split} recover={recover}: success {wins}/{len(tids)}, swapped replies {swaps}",
              flush=True)


if __name__ == "__main__":
    main()
