"""Stage 00 - the base language model: a tiny Llama pretrained on text of the environment.

Reads   nothing but the environment: its `train` worlds (never a dev / seen / unseen task)
Writes  --out DIR: a save_pretrained causal LM (safetensors, tokenizer, chat template, config),
        DIR/args.json and DIR/corpus_sample.txt (one transcript, for a human); one line per
        epoch to --metrics.

The paper fine-tunes a pretrained chat LLM. The tiny model has read nothing, so it is first
pretrained on the environment's text, as an LLM's pretraining teaches it language. The corpus
is chats laid out like the episodes (docs/design.md, 'The chat layout'), replies by an explorer
that never sees the goal (no expert action is in the corpus):

  * each step, with probability 1 - p_random an admissible command (env.admissible_actions())
    drawn by its verb's weight (VERB_WEIGHTS), else a random command of the grammar
    (env.random_action(), which mostly gets "Nothing happens.");
  * after an observation, with probability --qa, a question and its answer about what the
    agent has read (env.reading_question(rng); an environment without it gets transcripts only).

The loss is next-token prediction on every token after the system turn:

    L = - E_{x ~ corpus} [ sum_{i > |system|} log p(x_i | x_<i) ]

01_bc.py --model DIR fine-tunes the result on the demonstrations (run_all.sh builds it once per
environment and settings, under runs/base/):

    python 00_pretrain.py --out runs/demo/base
    python 02_collect.py --policy expert --split train --episodes 1000 \
        --out runs/demo/data/expert.jsonl
    python 01_bc.py --model runs/demo/base --lr 1e-3 --data runs/demo/data/expert.jsonl --out runs/demo/policy_0
"""
import math
import random
import re

import torch
from tqdm import tqdm

import envs
from distributed import average_info, parts
from machine import Progress, add_machine_flags, autocast, start
from models.tiny import build_tiny_model, train_tiny_tokenizer
from plumbing import (by_rows, check_finite, check_flags, check_tiny, die, finite, length_batches, log_metrics,
                      lr_at, parse_env_kwargs, save_policy, stage_parser)


def parse_args(argv=None):
    p, a, d, m = stage_parser("Stage 00: pretrain the tiny base language model on environment text.")
    d.add_argument("--out", required=True, help="output model directory (save_pretrained format)")
    d.add_argument("--env", default="kitchen",
                   help=f"environment name (registered: {', '.join(sorted(envs.REGISTRY))})")
    d.add_argument("--env-kwargs", default="{}", help="JSON dict of environment keyword arguments")
    d.add_argument("--env-seed", type=int, default=0, help="the environment's world seed (which tasks exist)")
    d.add_argument("--episodes", type=int, default=3000, help="exploration transcripts of `train` worlds")
    d.add_argument("--p-random", type=float, default=0.3, help="per step: probability of a random grammar command")
    d.add_argument("--qa", type=float, default=0.5, help="per observation: probability of a reading question")
    a.add_argument("--epochs", type=int, default=2, help="passes over the corpus")
    a.add_argument("--batch-size", type=int, default=8, help="transcripts per optimizer step")
    a.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    a.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    a.add_argument("--warmup", type=float, default=0.05, help="fraction of steps with linear warmup, then cosine decay")
    a.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    a.add_argument("--d-model", type=int, default=128, help="hidden size")
    a.add_argument("--n-layers", type=int, default=3, help="transformer layers")
    a.add_argument("--n-heads", type=int, default=4, help="attention heads")
    a.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    a.add_argument("--max-len", type=int, default=2048, help="context length in tokens")
    a.add_argument("--seed", type=int, default=0, help="random seed (corpus and training)")
    add_machine_flags(m)  # --threads, --precision
    d.add_argument("--metrics", default="", help="append per-epoch metrics to this JSONL file")
    args = p.parse_args(argv)  # every flag is checked before any work
    check_flags(args, episodes="at least 1", epochs="at least 1", batch_size="at least 1", lr="positive",
                weight_decay="non-negative", warmup="in [0, 1]", grad_clip="positive", p_random="in [0, 1]",
                qa="in [0, 1]", d_model="at least 1", n_layers="at least 1", n_heads="at least 1",
                vocab_size="at least 1", max_len="at least 1", seed="a seed in [0, 2**32)", threads="non-negative",
                env_seed="a seed in [0, 2**32)")
    check_tiny(args)  # --d-model a multiple of --n-heads, memory for the model
    return args


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: next-token prediction after the system turn.
# ----------------------------------------------------------------------------------------
def tokenize_transcript(tokenizer, msgs):
    """(input_ids, loss_mask): the whole chat, and 1 on every token after the system turn."""
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
    system = tokenizer.apply_chat_template(msgs[:1], tokenize=True, return_dict=False)
    return ids, [0] * len(system) + [1] * (len(ids) - len(system))


def token_logprobs(logits, targets):
    """log pi(target | context) of each predicted token: logits (..., V), targets (...) -> (...), by chunks of rows
    (by_rows): the fp32 softmax over the vocabulary exists for one chunk at a time."""
    return by_rows(lambda x, y: torch.log_softmax(x.float(), dim=-1).gather(-1, y[..., None]).squeeze(-1),
                   logits, targets)


def lm_loss(logp, mask):
    """L: the mean NLL of the masked tokens. logp, mask (B, L - 1): the predicted tokens 1..L-1."""
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------
# The corpus: exploration transcripts with reading questions (pure Python, no model).
# ----------------------------------------------------------------------------------------
VERB_WEIGHTS = {"go": 3, "take": 3, "open": 2, "put": 2, "clean": 1, "heat": 1, "cool": 1, "use": 1,
                "close": 0.5, "examine": 0.5, "inventory": 0.25, "look": 0.25}


def explore_command(env, rng, p_random):
    """One command of the explorer: mostly admissible (weighted by verb), sometimes random. An
    admissible command with a free argument (shop's `search[<keywords>]`) is filled in by the
    environment's random_action()."""
    if rng.random() < p_random:
        return env.random_action(rng)
    cmds = env.admissible_actions()
    cmd = rng.choices(cmds, [VERB_WEIGHTS.get(c.split()[0], 1) for c in cmds])[0]
    return env.random_action(rng) if re.search(r"\[<\w+>\]", cmd) else cmd


def transcript(env, task_id, rng, p_random, qa):
    """One chat: the episode layout with explorer replies and, where the environment asks
    them (env.reading_question(rng) -> (question, answer)), reading questions."""
    obs, info = env.reset(task_id)
    msgs = [{"role": "system", "content": env.instruction},
            {"role": "user", "content": f"Your task is to: {info['task']}\n{obs}"}]
    done = False
    while not done:
        cmd = explore_command(env, rng, p_random)
        obs, _, terminated, truncated, _ = env.step(cmd)
        done = terminated or truncated
        msgs += [{"role": "assistant", "content": f"Action: {cmd}"}, {"role": "user", "content": obs}]
        if not done and rng.random() < qa and hasattr(env, "reading_question"):
            q, a = env.reading_question(rng)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def build_corpus(env, n, rng, p_random, qa):
    """n transcripts, cycling through the `train` tasks in order."""
    ids = env.task_ids("train")
    bar = tqdm(range(n), desc="00_pretrain corpus", leave=False)  # gone when done: the next line (or a refusal) stays
    return [transcript(env, ids[i % len(ids)], rng, p_random, qa) for i in bar]


def prepare_pretrain(args, rng, device):
    """The environment's train worlds -> (the corpus, the tokenizer trained on it, the model on the device, the
    transcripts tokenized and cut to --max-len); the corpus is drawn with rng."""
    try:
        env = envs.make(args.env, seed=args.env_seed, **parse_env_kwargs(args.env_kwargs))
    except (ValueError, ImportError) as e:  # a keyword the env does not take, a missing package
        die(e)
    if not hasattr(env, "admissible_actions"):
        die(f"env {args.env!r} has no admissible_actions(); the explorer needs it")
    corpus = build_corpus(env, args.episodes, rng, args.p_random, args.qa)
    env.close()
    # The instruction is the same in every transcript: count it once.
    texts = [corpus[0][0]["content"]] + [m["content"] for msgs in corpus for m in msgs[1:]]
    tokenizer = train_tiny_tokenizer(texts, args.vocab_size)
    model = build_tiny_model(tokenizer, args).to(device)
    data = [tokenize_transcript(tokenizer, msgs) for msgs in corpus]
    data = [(ids[:args.max_len], mask[:args.max_len]) for ids, mask in data]
    n_tokens = sum(sum(m[1:]) for _, m in data)  # position i predicts i + 1: the first token trains nothing
    if not n_tokens:
        die(f"--max-len {args.max_len} cuts every transcript before its first trained token; raise it")
    print(f"00_pretrain: {len(data)} transcripts of {args.env}/train, {n_tokens} trained tokens/epoch, "
          f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params on {device}")
    return corpus, tokenizer, model.train(), data


def pad_transcripts(data, pad_id, device):
    """(ids, loss_mask) pairs -> input_ids (B, L) right-padded with pad_id, attention_mask (B, L), mask (B, L)."""
    L = max(len(ids) for ids, _ in data)
    input_ids = torch.full((len(data), L), pad_id, dtype=torch.long)
    attention_mask, mask = torch.zeros((len(data), L), dtype=torch.long), torch.zeros((len(data), L))
    for r, (ids, m) in enumerate(data):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        attention_mask[r, :len(ids)] = 1
        mask[r, :len(ids)] = torch.tensor(m, dtype=torch.float)
    return input_ids.to(device), attention_mask.to(device), mask.to(device)


def main(argv=None):
    args = parse_args(argv)
    _, device, amp = start(args, "policy", [])  # --out and --metrics writable, --threads, the seed, the device
    rng = random.Random(args.seed)  # the corpus, then the batches
    corpus, tokenizer, model, data = prepare_pretrain(args, rng, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    n_loss = [sum(m[1:]) for _, m in data]  # trained tokens: a step's loss is their mean
    total_steps = args.epochs * math.ceil(len(data) / args.batch_size)
    log, records = Progress("00_pretrain", total_steps, device), []  # the bar, the steps

    def batch_loss(ids):  # forward -> loss, on transcripts `ids`
        input_ids, attention_mask, mask = pad_transcripts([data[j] for j in ids], tokenizer.pad_token_id, device)
        with autocast(device, amp):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, L, V)
        loss = lm_loss(token_logprobs(logits[:, :-1], input_ids[:, 1:]), mask[:, 1:])  # position i predicts i + 1
        return loss, {"loss": loss.item()}, int(attention_mask.sum())

    for epoch in range(args.epochs):
        for idx in length_batches([len(ids) for ids, _ in data], args.batch_size, rng):  # one step's batch
            for group in optimizer.param_groups:
                group["lr"] = lr_at(log.step, total_steps, args.lr, args.warmup)
            infos = []  # each micro-batch: (info, share, tokens)
            for ids, share in parts(idx, n_loss, model, args):  # this process's micro-batches (--grad-accum)
                loss, info, n = batch_loss(ids)  # forward -> loss
                (finite(loss, log.step) * share).backward()  # backward; share: its count / the step's count
                infos.append((info, share, n))
            info, tokens = average_info(infos)  # torchrun: over every process, the one-process numbers
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.update(info, tokens, loss=f"{info['loss']:.3f}")
        records.append(r := {"stage": "00_pretrain", "epoch": epoch + 1, "step": log.step,
                             "train_loss": log.mean()["loss"], "elapsed_s": log.elapsed()})
        tqdm.write(f"epoch {epoch + 1}: train loss {r['train_loss']:.4f}")
    log.bar.close()
    check_finite(model.parameters(), "the base model")
    sample = tokenizer.apply_chat_template(corpus[0], tokenize=False)  # what the model read, for a human
    save_policy(args.out, model, tokenizer, args, "00_pretrain", texts=[("corpus_sample.txt", sample)])
    log_metrics(args.metrics, *records)
    print(f"00_pretrain: wrote {args.out} (train loss {r['train_loss']:.4f}, {log.elapsed():.0f}s)")


if __name__ == "__main__":
    main()
