"""Is V(s_0)'s flatness the representation's fault or the critic training's? A linear probe on
the policy's frozen features at s_0 (the last hidden state at the last token of the first
generation prompt, where 03_critic.py reads V(s_0)).

It fits ridge regressions, on standardised features, from s_0 to the success of the episodes
of a training buffer (e.g. the self data 03 learned from) and reports their AUC on other
episodes (e.g. research/auc_ceiling.py's samples on `seen`), for a few ridge strengths - all are
printed, since picking the best one on the held-out episodes would flatter the probe. It also
checks that the task type (household's six kinds) can be read linearly from the same features.

    python research/v0_probe.py --policy runs/seed0/policy_0 --train runs/seed0/iter_1/self.jsonl \\
        --test runs/seed0/auc_ceiling/sample_*.jsonl
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import auc_ceiling  # noqa: E402  (research/ is on the path when this script runs)
from bench._stages import load_stage  # noqa: E402


def read(paths):
    return [json.loads(line) for p in paths for line in open(p) if line.strip()]


def s0_features(model, tokenizer, episodes):
    """Last hidden state at the last token of each episode's first generation prompt."""
    episode_messages, out = load_stage("01_bc").episode_messages, []
    with torch.no_grad():
        for e in episodes:
            msgs = episode_messages(dict(e, steps=[]))  # the chat up to s_0, as 03 lays it out
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt")
            out.append(model(**ids, output_hidden_states=True).hidden_states[-1][0, -1].numpy())
    return np.array(out, dtype=np.float64)


def ridge(X, Y, lam):
    return np.linalg.solve(X.T @ X + lam * np.eye(X.shape[1]), X.T @ Y)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="policy directory whose features are probed")
    p.add_argument("--train", nargs="+", required=True, help="episode JSONL files the probe is fitted on")
    p.add_argument("--test", nargs="+", required=True, help="episode JSONL files it is scored on")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    auc = load_stage("04_gae").auc  # the AUC 04_gae.py prints
    task_kind = auc_ceiling.task_kind
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    model = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    train, test = read(args.train), read(args.test)
    X_train, X_test = s0_features(model, tokenizer, train), s0_features(model, tokenizer, test)
    mu, sd = X_train.mean(0), X_train.std(0) + 1e-6
    A = np.c_[(X_train - mu) / sd, np.ones(len(train))]
    B = np.c_[(X_test - mu) / sd, np.ones(len(test))]
    y_train = np.array([e["success"] for e in train], dtype=np.float64)
    y_test = np.array([e["success"] for e in test], dtype=np.float64)
    print(f"probe from s_0 features ({A.shape[1] - 1} dims) to success: fitted on {len(train)} episodes "
          f"({y_train.mean():.1%} success), scored on {len(test)} ({y_test.mean():.1%})")
    for lam in (1, 10, 100, 1000):
        w = ridge(A, y_train, lam)
        print(f"  ridge {lam:>4}: AUC on the fitted episodes {auc(A @ w, y_train):.3f}, "
              f"on the scored ones {auc(B @ w, y_test):.3f}")
    kinds = sorted({task_kind(e["task"]) for e in train})
    W = ridge(A, np.array([[task_kind(e["task"]) == k for k in kinds] for e in train], dtype=np.float64), 10)
    guess = np.array(kinds)[(B @ W).argmax(1)]
    truth = np.array([task_kind(e["task"]) for e in test])
    print(f"task type read linearly from the same features (ridge 10): {np.mean(guess == truth):.1%} "
          f"of the scored episodes right ({len(kinds)} types)")


if __name__ == "__main__":
    main()
