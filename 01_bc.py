"""Stage 01 - behavior cloning (pi_0): imitate expert demonstrations.

Reads   one or more episode JSONL files (DESIGN section 4), e.g. data/expert.jsonl
Writes  --out DIR: a save_pretrained policy (safetensors + tokenizer + chat template + config)
        and DIR/args.json; one line per epoch to --metrics.

The loss is the paper's BC objective, negative log-likelihood of the action tokens only:
    L_BC = - E_{tau ~ D_expert} [ sum_t sum_{tokens y of a_t} log pi(y | s_t, y_<) ]
Observations and instructions are read by the model but never trained on.

--model tiny (default) trains a byte-level BPE tokenizer on the data and builds a small
Llama-style transformer from scratch; --model PATH fine-tunes any local Hugging Face
causal LM that has a chat template. Nothing is downloaded.

    python 02_collect.py --policy expert --split train --episodes 600 --out runs/demo/data/expert.jsonl
    python 01_bc.py --data runs/demo/data/expert.jsonl --out runs/demo/policy_0
"""
import argparse
import bisect
import json
import math
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Stage 01: behavior cloning on expert demonstrations.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, help="episode JSONL file(s) to imitate")
    p.add_argument("--out", required=True, help="output policy directory (save_pretrained format)")
    p.add_argument("--model", default="tiny", help="'tiny' (from scratch) or a local Hugging Face model directory")
    p.add_argument("--filter", choices=["all", "success"], default="all",
                   help="'success' keeps only successful trajectories (rejection-sampling fine-tuning, RFT)")
    p.add_argument("--epochs", type=int, default=16, help="passes over the training trajectories")
    p.add_argument("--batch-size", type=int, default=8, help="trajectories per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW); use ~1e-5 for a pretrained --model PATH")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--warmup", type=float, default=0.05, help="fraction of steps with linear warmup, then cosine decay")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--val-frac", type=float, default=0.05, help="fraction of trajectories held out for validation loss")
    p.add_argument("--d-model", type=int, default=128, help="tiny model: hidden size")
    p.add_argument("--n-layers", type=int, default=3, help="tiny model: transformer layers")
    p.add_argument("--n-heads", type=int, default=4, help="tiny model: attention heads")
    p.add_argument("--vocab-size", type=int, default=1024, help="tiny model: BPE vocabulary size")
    p.add_argument("--max-len", type=int, default=2048, help="tiny model: context length in tokens")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--metrics", default="", help="append per-epoch metrics to this JSONL file")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------
# Helpers shared by the stages. Copied on purpose (CleanRL style) so each stage reads top
# to bottom; every copy must stay byte-identical - tests/test_stage_copies.py checks.
# ----------------------------------------------------------------------------------------
def die(msg):
    """Bad input: one clear sentence on stderr, exit code 2, nothing written."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


EPISODE_KEYS = ("env", "task_id", "instruction", "task", "obs0", "steps", "reward", "success")
STEP_KEYS = ("text", "action", "obs", "r_env", "label", "r_aux", "done")


def read_episodes(paths, step_keys=STEP_KEYS):
    """Read episode JSONL files (DESIGN section 4); reject a bad line with file and line number."""
    episodes = []
    for path in paths:
        if not os.path.isfile(path):
            die(f"{path}: no such file; pass an episode JSONL written by 02_collect.py")
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ep = json.loads(line)
                except json.JSONDecodeError as e:
                    die(f"{path}:{lineno}: not valid JSON ({e.msg})")
                missing = [k for k in EPISODE_KEYS if not isinstance(ep, dict) or k not in ep]
                if not missing and not isinstance(ep["steps"], list):
                    missing = ["steps (a list)"]
                if not missing:
                    missing = sorted({k for s in ep["steps"] for k in step_keys if k not in s})
                if missing:
                    die(f"{path}:{lineno}: episode lacks {', '.join(missing)}; "
                        "is this an episode JSONL from 02_collect.py (or 04_gae.py)?")
                episodes.append(ep)
    if not episodes:
        die(f"no episodes in {', '.join(paths)}; collect some with 02_collect.py first")
    return episodes


def write_atomic(path, write_fn):
    """Write a file or directory via a temporary sibling and one rename: a killed stage
    leaves the previous state or nothing, never half an artifact."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    write_fn(tmp)
    if os.path.isdir(path) and not os.path.islink(path):
        old = f"{path}.old{os.getpid()}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def write_jsonl(path, rows):
    def write(tmp):
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    write_atomic(path, write)


def write_json(path, obj):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    write_atomic(path, write)


def log_metrics(path, record):
    """Append one JSON object to <run>/metrics.jsonl (no-op without --metrics)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device():
    """CUDA with bf16 when available, else CPU with fp32 (bf16 is ~20x slower on CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def episode_messages(ep):
    """DESIGN section 6: system = instruction; user = task + o_0; then assistant = step
    text and user = observation, alternately."""
    msgs = [{"role": "system", "content": ep["instruction"]},
            {"role": "user", "content": f"Your task is to: {ep['task']}\n{ep['obs0']}"}]
    for step in ep["steps"]:
        msgs.append({"role": "assistant", "content": step["text"]})
        msgs.append({"role": "user", "content": step["obs"]})
    return msgs


def tokenize_episode(tokenizer, ep):
    """One trajectory -> token ids and where values are read (DESIGN section 6).

    Returns a dict of lists:
      input_ids    (L,)   the whole chat, ending with the generation prompt after o_T
      action_step  (L,)   t for the tokens of assistant turn t (incl. its end-of-turn token), else -1
      state_pos    (T+1,) last token of the generation prompt before turn t; [T] is s_T
      action_pos   (T,)   last token of turn t
    The chat template is rendered as text for growing prefixes of the conversation, and
    the full text is tokenized once; character offsets locate each turn."""
    msgs = episode_messages(ep)

    def render(m, gen):
        return tokenizer.apply_chat_template(m, add_generation_prompt=gen, tokenize=False)

    full = render(msgs, True)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, ends = enc["input_ids"], [e for _, e in enc["offset_mapping"]]
    action_step = [-1] * len(ids)
    state_pos, action_pos = [], []
    for t in range(len(ep["steps"])):
        k = 2 + 2 * t  # index of assistant message t
        prompt, after = render(msgs[:k], True), render(msgs[:k + 1], False)
        if not (full.startswith(prompt) and full.startswith(after)):
            raise ValueError("the chat template does not render a conversation as a prefix of its "
                             "continuation; this model's template is not supported")
        first = bisect.bisect_right(ends, len(prompt))   # first token ending after the prompt
        last = bisect.bisect_left(ends, len(after))      # token that ends turn t
        state_pos.append(first - 1)
        action_pos.append(last)
        for i in range(first, last + 1):
            action_step[i] = t
    state_pos.append(len(ids) - 1)
    return {"input_ids": ids, "action_step": action_step, "state_pos": state_pos, "action_pos": action_pos}


def collate(tokenized, pad_id):
    """Right-pad a list of tokenize_episode() dicts into tensors.
    input_ids/attention_mask/action_step (B, L); state_pos (B, T+1) and action_pos (B, T)
    padded with 0, step_mask (B, T) is 1 on real steps."""
    B = len(tokenized)
    L = max(len(x["input_ids"]) for x in tokenized)
    T = max(len(x["action_pos"]) for x in tokenized)
    batch = {
        "input_ids": torch.full((B, L), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((B, L), dtype=torch.long),
        "action_step": torch.full((B, L), -1, dtype=torch.long),
        "state_pos": torch.zeros((B, T + 1), dtype=torch.long),
        "action_pos": torch.zeros((B, T), dtype=torch.long),
        "step_mask": torch.zeros((B, T), dtype=torch.float),
    }
    for i, x in enumerate(tokenized):
        n, t = len(x["input_ids"]), len(x["action_pos"])
        batch["input_ids"][i, :n] = torch.tensor(x["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["action_step"][i, :n] = torch.tensor(x["action_step"])
        batch["state_pos"][i, :t + 1] = torch.tensor(x["state_pos"])
        batch["action_pos"][i, :t] = torch.tensor(x["action_pos"])
        batch["step_mask"][i, :t] = 1.0
    return batch


def token_logprobs(logits, input_ids):
    """log pi(token_i | tokens_<i) for every position i >= 1; position 0 gets 0.
    logits (B, L, V), input_ids (B, L) -> (B, L)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, L-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def load_tokenizer(path):
    """A local Hugging Face tokenizer with a chat template (nothing is downloaded)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        die(f"{path} is not a model directory (no config.json); pass a directory written by "
            "01_bc.py / 05_bppo.py or a local Hugging Face model")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not tokenizer.chat_template:
        die(f"{path}: the tokenizer has no chat template; this project needs one (DESIGN section 6)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenize_all(tokenizer, episodes, max_len):
    """Tokenize every episode; drop (and count) those longer than the model's context."""
    kept, dropped = [], 0
    for ep in episodes:
        x = tokenize_episode(tokenizer, ep)
        if len(x["input_ids"]) > max_len:
            dropped += 1
            continue
        kept.append((ep, x))
    if dropped:
        print(f"note: dropped {dropped} of {len(episodes)} trajectories longer than the context ({max_len} tokens)")
    return kept


def length_batches(lengths, batch_size, rng):
    """Batches of indices with similar lengths (little padding), in random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


# ----------------------------------------------------------------------------------------
# The tiny model: a byte-level BPE tokenizer trained on the data, and a small Llama.
# ----------------------------------------------------------------------------------------
SPECIAL = {"pad": "<|pad|>", "end": "<|end|>", "system": "<|system|>", "user": "<|user|>",
           "assistant": "<|assistant|>"}
# A chat template without whitespace between turns: each turn is <|role|>content<|end|>,
# so the action tokens of turn t are its content tokens plus <|end|>, and the state
# position s_t is the <|assistant|> token of the generation prompt.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tiny_tokenizer(texts, vocab_size):
    """Byte-level BPE on `texts` (message contents; pass a repeated instruction once, so it
    does not dominate the merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL["end"], pad_token=SPECIAL["pad"],
                                   padding_side="left", chat_template=TINY_CHAT_TEMPLATE)


def build_tiny_model(tokenizer, args):
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
        max_position_embeddings=args.max_len, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: the behavior-cloning loss.
# ----------------------------------------------------------------------------------------
def bc_loss(logp, action_mask):
    """Masked NLL of action tokens (paper: BC warm start). logp, action_mask (B, L)."""
    return -(logp * action_mask).sum() / action_mask.sum().clamp(min=1)


def lr_at(step, total, peak, warmup_frac):
    """Linear warmup then cosine decay to 10% of the peak."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def reply_matches(logits, batch):
    """(B, T) bool: greedy decoding would write turn t exactly as in the data. Teacher forcing
    on the recorded history, the argmax token must equal the data's token at every position of
    the assistant turn (Thought, Action and end-of-turn). False on padded steps."""
    hit = logits[:, :-1].argmax(-1) == batch["input_ids"][:, 1:]  # prediction of token i+1
    step = batch["action_step"][:, 1:]
    B, T = batch["step_mask"].shape
    wrong = torch.zeros(B, T + 1, dtype=torch.long, device=hit.device)  # column T: non-action tokens
    wrong.scatter_add_(1, torch.where(step >= 0, step, T), (~hit).long())
    return (wrong[:, :T] == 0) & (batch["step_mask"] > 0)


def evaluate(model, data, pad_id, batch_size, device):
    """Validation: action-token NLL, the fraction of replies greedy decoding reproduces, and the
    fraction of trajectories it reproduces at every turn. The last is the one to watch: the
    household expert never errs and a BC policy rarely recovers from a mistake, so it tracks
    greedy success closely (bench/expert_path.py), while the loss is dominated by easy tokens."""
    model.eval()
    total, count, turns, replies, episodes = 0.0, 0.0, 0, 0, 0
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            b = {k: v.to(device) for k, v in collate(data[i:i + batch_size], pad_id).items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            mask = (b["action_step"] >= 0).float()
            total += -(token_logprobs(logits, b["input_ids"]) * mask).sum().item()
            count += mask.sum().item()
            ok = reply_matches(logits, b)
            n = b["step_mask"].sum(1).long()
            turns += int(n.sum())
            replies += int(ok.sum())
            episodes += int((ok.sum(1) == n).sum())
    model.train()
    return total / max(count, 1), replies / max(turns, 1), episodes / max(len(data), 1)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed)
    device, dtype = pick_device()

    episodes = read_episodes(args.data)
    if args.filter == "success":  # RFT: imitate only the trajectories that reached the goal
        n_read = len(episodes)
        episodes = [ep for ep in episodes if ep["success"]]
        if not episodes:
            die("--filter success left no trajectories; no episode in --data succeeded")
        print(f"01_bc: --filter success kept {len(episodes)} of {n_read} trajectories")

    if args.model == "tiny":
        # The instruction is the same in every episode: count it once.
        texts = [episodes[0]["instruction"]] + [m["content"] for ep in episodes for m in episode_messages(ep)[1:]]
        tokenizer = train_tiny_tokenizer(texts, args.vocab_size)
        model = build_tiny_model(tokenizer, args)
    else:
        tokenizer = load_tokenizer(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype)
    model.to(device)
    max_len = model.config.max_position_embeddings
    data = [x for _, x in tokenize_all(tokenizer, episodes, max_len)]
    if len(data) < 2:
        die("fewer than 2 trajectories fit the context; collect more demonstrations")
    random.Random(args.seed).shuffle(data)
    n_val = max(1, int(len(data) * args.val_frac))
    val, train = data[:n_val], data[n_val:]
    n_tokens = sum(sum(1 for s in x["action_step"] if s >= 0) for x in train)
    print(f"01_bc: {len(train)} train / {len(val)} val trajectories, {n_tokens} action tokens/epoch, "
          f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params on {device}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total_steps = args.epochs * steps_per_epoch
    step, t0 = 0, time.time()
    model.train()
    rng = random.Random(args.seed)
    bar = tqdm(total=total_steps, desc="01_bc", unit="step")
    for epoch in range(args.epochs):
        epoch_loss = 0.0
        for idx in length_batches([len(x["input_ids"]) for x in train], args.batch_size, rng):
            b = {k: v.to(device) for k, v in collate([train[j] for j in idx], tokenizer.pad_token_id).items()}
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, args.lr, args.warmup)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            loss = bc_loss(token_logprobs(logits, b["input_ids"]), (b["action_step"] >= 0).float())
            if not torch.isfinite(loss):
                die(f"loss became {loss.item()} at step {step}; lower --lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            epoch_loss += loss.item()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        val_loss, val_replies, val_episodes = evaluate(model, val, tokenizer.pad_token_id, args.batch_size, device)
        record = {"stage": "01_bc", "epoch": epoch + 1, "step": step, "train_loss": epoch_loss / steps_per_epoch,
                  "val_loss": val_loss, "val_reply_match": val_replies, "val_episode_match": val_episodes,
                  "elapsed_s": time.time() - t0}
        log_metrics(args.metrics, record)
        tqdm.write(f"epoch {epoch + 1}: train loss {record['train_loss']:.4f}  val loss {val_loss:.4f}  "
                   f"greedy reproduces {val_replies:.1%} of val replies, {val_episodes:.1%} of val episodes")
    bar.close()

    def save(tmp):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    write_atomic(args.out, save)
    print(f"01_bc: wrote {args.out} (val loss {val_loss:.4f}, val episodes reproduced {val_episodes:.1%}, "
          f"{time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
