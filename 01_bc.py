"""Stage 01 - behavior cloning (pi_0): imitate expert demonstrations.

Reads   episode JSONL file(s) (docs/design.md, 'The episode JSONL'), e.g. data/expert.jsonl;
        --model DIR: the model to start from (00_pretrain.py's, or a local Hugging Face causal LM)
Writes  --out DIR: a save_pretrained policy (safetensors, tokenizer, chat template, config) and
        DIR/args.json; one line per epoch to --metrics.

The paper's BC objective, the negative log-likelihood of the action tokens only:

    L_BC = - E_{tau ~ D_expert} [ sum_t sum_{tokens y of a_t} log pi(y | s_t, y_<) ]

Observations and instructions are read by the model but never trained on. `--filter success`
keeps only the trajectories that reached the goal: rejection-sampling fine-tuning (RFT).

--model tiny (default) trains a byte-level BPE tokenizer on the data and builds a small Llama from scratch
(models/tiny.py); --model DIR fine-tunes any local causal LM that has a chat template. Nothing is downloaded.

The run_all.sh way: the demonstrations of the default world (kitchen, the credit world: its careless
demonstrator's flawed choices are what the later stages unlearn), and the base 00_pretrain.py built on it:

    python 00_pretrain.py --out runs/demo/base
    python 02_collect.py --policy expert --split train --episodes 1000 \
        --out runs/demo/data/expert.jsonl
    python 01_bc.py --data runs/demo/data/expert.jsonl --model runs/demo/base --lr 1e-3 --out runs/demo/policy_0
"""
import bisect
import math
import random

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from distributed import average_info, distribute, parts
from machine import Progress, add_lora, add_machine_flags, autocast, grad_checkpointing, save_trained, start
from models.tiny import build_tiny_model, train_tiny_tokenizer
from plumbing import (by_rows, check_flags, check_tiny, die, finite, fit_context, length_batches, load_model,
                      load_tokenizer, lr_at, read_episodes, save_policy, stage_parser)


def parse_args(argv=None):
    p, a, d, m = stage_parser("Stage 01: behavior cloning on expert demonstrations.")
    d.add_argument("--data", nargs="+", required=True, help="episode JSONL file(s) to imitate")
    d.add_argument("--out", required=True, help="output policy directory (save_pretrained format)")
    d.add_argument("--model", default="tiny",
                   help="'tiny' (a new model, trained from scratch) or a local model directory to fine-tune")
    a.add_argument("--filter", choices=["all", "success"], default="all",
                   help="'success' keeps only successful trajectories (rejection-sampling fine-tuning, RFT)")
    a.add_argument("--epochs", type=int, default=10, help="passes over the training trajectories")
    a.add_argument("--batch-size", type=int, default=8, help="trajectories per optimizer step")
    a.add_argument("--lr", type=float, default=3e-3,
                   help="peak learning rate (AdamW); a pretrained LLM wants a much smaller one (~1e-5)")
    a.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    a.add_argument("--warmup", type=float, default=0.05, help="fraction of steps with linear warmup, then cosine decay")
    a.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    a.add_argument("--val-frac", type=float, default=0.05, help="fraction of trajectories held out for validation")
    d.add_argument("--d-model", type=int, default=128, help="tiny model: hidden size")
    d.add_argument("--n-layers", type=int, default=3, help="tiny model: transformer layers")
    d.add_argument("--n-heads", type=int, default=4, help="tiny model: attention heads")
    d.add_argument("--vocab-size", type=int, default=1024, help="tiny model: BPE vocabulary size")
    d.add_argument("--max-len", type=int, default=2048, help="tiny model: context length in tokens")
    a.add_argument("--seed", type=int, default=0, help="random seed")
    add_machine_flags(m, training=True, lora=True)  # --threads, --precision, --grad-accum, --fsdp, --lora
    d.add_argument("--metrics", default="", help="append per-epoch metrics to this JSONL file")
    args = p.parse_args(argv)  # every flag is checked before any work
    check_flags(args, epochs="at least 1", batch_size="at least 1", grad_accum="at least 1", lr="positive",
                weight_decay="non-negative", warmup="in [0, 1]", grad_clip="positive", val_frac="in (0, 1)",
                d_model="at least 1", n_layers="at least 1", n_heads="at least 1", vocab_size="at least 1",
                max_len="at least 1", seed="a seed in [0, 2**32)", threads="non-negative", lora="non-negative")
    if args.model == "tiny":
        check_tiny(args)  # --d-model a multiple of --n-heads, memory for the model
    if args.lora and args.model == "tiny":
        die("--lora needs a pretrained --model DIR: the tiny model starts from random weights")
    return args


# ----------------------------------------------------------------------------------------
# ALGO LOGIC: the behavior-cloning loss, and what to watch while it trains.
# ----------------------------------------------------------------------------------------
def reply_logits(model, batch):
    """Next-token logits only where they predict a reply token -> (N, V), in the order of batch["input_ids"][reply]
    (logits_to_keep: most tokens are observations, and the full (B, L, V) logits would be the largest tensor)."""
    keep = torch.zeros_like(batch["action_step"], dtype=torch.bool)
    keep[:, :-1] = batch["action_step"][:, 1:] >= 0  # position i predicts token i + 1
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep).logits


def token_logprobs(logits, targets):
    """log pi(target | context) of each predicted token: logits (..., V), targets (...) -> (...), by chunks of rows
    (by_rows): the fp32 softmax over the vocabulary exists for one chunk at a time."""
    return by_rows(lambda x, y: torch.log_softmax(x.float(), dim=-1).gather(-1, y[..., None]).squeeze(-1),
                   logits, targets)


def bc_loss(logp):
    """L_BC = -mean over the reply tokens y of log pi(y | prefix), the NLL of the replies. logp (N,): log pi of
    each reply token of the batch -> (loss, info), info: the loss as a number (what the stage prints)."""
    loss = -logp.mean()
    return loss, {"loss": loss.item()}


def reply_matches(logits, batch):
    """(B, T) bool: greedy decoding would write turn t exactly as in the data. Teacher forcing
    on the recorded history, the argmax token must equal the data's token at every position of
    the assistant turn (Thought, Action and end-of-turn). logits (N, V) from reply_logits.
    False on padded steps."""
    reply = batch["action_step"] >= 0
    hit = logits.argmax(-1) == batch["input_ids"][reply]  # (N,) one per reply token
    B, T = batch["step_mask"].shape
    wrong = torch.zeros(B * T, dtype=torch.long, device=hit.device)  # misses per (row, step)
    wrong.scatter_add_(0, reply.nonzero()[:, 0] * T + batch["action_step"][reply], (~hit).long())
    return (wrong.view(B, T) == 0) & (batch["step_mask"] > 0)


def evaluate(model, data, pad_id, batch_size, device, amp):
    """Validation: action-token NLL, the fraction of replies greedy decoding reproduces, and the fraction of
    trajectories it reproduces at every turn - the one to watch: greedy decoding replays such a demonstration in
    the environment (same actions, same outcome), while the loss is dominated by easy tokens."""
    model.eval()
    total, count, turns, replies, episodes = 0.0, 0.0, 0, 0, 0
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            b = {k: v.to(device) for k, v in collate(data[i:i + batch_size], pad_id).items()}
            with autocast(device, amp):
                logits = reply_logits(model, b)  # (N, V) at the N reply tokens
            total += -token_logprobs(logits, b["input_ids"][b["action_step"] >= 0]).sum().item()
            count += len(logits)
            ok = reply_matches(logits, b)
            n = b["step_mask"].sum(1).long()
            turns += int(n.sum())
            replies += int(ok.sum())
            episodes += int((ok.sum(1) == n).sum())
    model.train()
    return total / max(count, 1), replies / max(turns, 1), episodes / max(len(data), 1)


def prepare_bc(args, device):
    """--data and --model -> (tokenizer, model on the device, train, val): the trajectories tokenized
    (tokenize_episode), shuffled with --seed and split."""
    episodes = read_episodes(args.data)
    if args.filter == "success":  # RFT: imitate only the trajectories that reached the goal
        n_read, episodes = len(episodes), [ep for ep in episodes if ep["success"]]
        if not episodes:
            die("--filter success left no trajectories; no episode in --data succeeded")
        print(f"01_bc: --filter success kept {len(episodes)} of {n_read} trajectories")
    if args.model == "tiny":  # the instruction is the same in every episode: count it once
        texts = [episodes[0]["instruction"]] + [m["content"] for ep in episodes for m in episode_messages(ep)[1:]]
        tokenizer = train_tiny_tokenizer(texts, args.vocab_size)
        model = build_tiny_model(tokenizer, args)
    else:
        tokenizer = load_tokenizer(args.model)
        model = add_lora(grad_checkpointing(load_model(AutoModelForCausalLM, args.model), args), args.lora).train()
    data = [x for _, x in fit_context([(ep, tokenize_episode(tokenizer, ep)) for ep in episodes], model.config, 2)]
    random.Random(args.seed).shuffle(data)
    n_val = max(1, int(len(data) * args.val_frac))
    print(f"01_bc: {len(data) - n_val} train / {n_val} val trajectories, model "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
          f"({sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f}M trained) on {device}")
    return tokenizer, model.to(device), data[n_val:], data[:n_val]


def main(argv=None):
    args = parse_args(argv)
    world, device, amp = start(args, "policy", args.data + ([] if args.model == "tiny" else [args.model]))
    tokenizer, model, train, val = prepare_bc(args, device)
    train_model = distribute(model, world, args.fsdp)  # torchrun: DDP or FSDP2; alone: the model itself
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    n_loss = [sum(s >= 0 for s in x["action_step"]) for x in train]  # reply tokens: a step's loss is their mean
    total_steps = args.epochs * math.ceil(len(train) / args.batch_size)
    rng, records = random.Random(args.seed), []
    log = Progress("01_bc", total_steps, device)  # the bar, the steps, the tokens read

    def batch_loss(ids):  # forward -> loss, on trajectories `ids`
        b = {k: v.to(device) for k, v in collate([train[j] for j in ids], tokenizer.pad_token_id).items()}
        with autocast(device, amp):  # fp32, or bf16 matmuls on fp32 weights
            logits = reply_logits(train_model, b)  # (N, V) at the reply tokens
        return *bc_loss(token_logprobs(logits, b["input_ids"][b["action_step"] >= 0])), int(b["attention_mask"].sum())

    for epoch in range(args.epochs):
        for idx in length_batches([len(x["input_ids"]) for x in train], args.batch_size, rng):  # one step's batch
            for group in optimizer.param_groups:
                group["lr"] = lr_at(log.step, total_steps, args.lr, args.warmup)
            infos = []  # each micro-batch: (info, share, tokens)
            for ids, share in parts(idx, n_loss, train_model, args):  # this process's micro-batches (--grad-accum)
                loss, info, n = batch_loss(ids)  # forward -> loss
                (finite(loss, log.step) * share).backward()  # backward; share: its count / the step's count
                infos.append((info, share, n))
            info, tokens = average_info(infos)  # torchrun: over every process, the one-process numbers
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.update(info, tokens, loss=f"{info['loss']:.3f}")
        val_loss, val_replies, val_episodes = evaluate(model, val, tokenizer.pad_token_id, args.batch_size, device, amp)
        records.append(r := {"stage": "01_bc", "epoch": epoch + 1, "step": log.step, "train_loss": log.mean()["loss"],
                             "val_loss": val_loss, "val_reply_match": val_replies, "val_episode_match": val_episodes,
                             "elapsed_s": log.elapsed(), **log.cost()})
        tqdm.write(f"epoch {epoch + 1}: train loss {r['train_loss']:.4f}  val loss {val_loss:.4f}  "
                   f"greedy reproduces {val_replies:.1%} of val replies, {val_episodes:.1%} of val episodes")
    log.bar.close()

    def save(state):  # rank 0 (or alone), the weights found finite; then the records to --metrics
        save_policy(args.out, model, tokenizer, args, "01_bc", state)
        print(f"01_bc: wrote {args.out} (val loss {val_loss:.4f}, val episodes reproduced {val_episodes:.1%}, "
              f"{log.elapsed():.0f}s, {r['tokens_per_s']:.0f} tokens/s, peak memory {r['peak_mem_gb']:.2f} GB)")
    save_trained(model, args, "the policy", save, records)  # --fsdp: every process helps gather the weights


# ----------------------------------------------------------------------------------------
# The data contract (docs/design.md, 'The chat layout'): an episode as a chat, its tokens, and where V, Q
# and the loss are read. Copied byte-identical into every stage that reads episodes (tests/test_stage_copies.py).
# ----------------------------------------------------------------------------------------
def episode_messages(ep):
    """system = instruction; user = task + o_0; then assistant = step text and user = observation, alternately."""
    msgs = [{"role": "system", "content": ep["instruction"]},
            {"role": "user", "content": f"Your task is to: {ep['task']}\n{ep['obs0']}"}]
    for step in ep["steps"]:
        msgs += [{"role": "assistant", "content": step["text"]}, {"role": "user", "content": step["obs"]}]
    return msgs


def tokenize_episode(tokenizer, ep):
    """One trajectory -> a dict of lists (docs/design.md, 'The chat layout'):
      input_ids    (L,)   the whole chat, ending with the generation prompt after o_T
      action_step  (L,)   t for the tokens of assistant turn t (incl. its end-of-turn token), else -1
      state_pos    (T+1,) last token of the generation prompt before turn t; [T] is s_T
      action_pos   (T,)   last token of turn t
    Growing prefixes of the chat are rendered as text, the full text is tokenized once: offsets locate each turn."""
    msgs = episode_messages(ep)
    control = [s for s in tokenizer.get_added_vocab() for m in msgs if s in m["content"]]
    if control:  # text data never makes a control token: it would change the chat layout silently
        die(f"episode {ep['task_id']}: its text contains the tokenizer's control token {control[0]!r}")
    render = lambda m, gen: tokenizer.apply_chat_template(m, add_generation_prompt=gen, tokenize=False)
    full = render(msgs, True)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, ends = enc["input_ids"], [e for _, e in enc["offset_mapping"]]
    action_step, state_pos, action_pos = [-1] * len(ids), [], []
    for t in range(len(ep["steps"])):
        prompt, after = render(msgs[:2 + 2 * t], True), render(msgs[:3 + 2 * t], False)  # msgs[2 + 2t]: reply t
        if not (full.startswith(prompt) and full.startswith(after)):
            die("the chat template does not render a conversation as a prefix of its continuation; "
                "this model's template is not supported")
        first = bisect.bisect_right(ends, len(prompt))   # first token ending after the prompt
        last = bisect.bisect_left(ends, len(after))      # token that ends turn t
        state_pos.append(first - 1)
        action_pos.append(last)
        action_step[first:last + 1] = [t] * (last + 1 - first)
    state_pos.append(len(ids) - 1)
    return {"input_ids": ids, "action_step": action_step, "state_pos": state_pos, "action_pos": action_pos}


def collate(tokenized, pad_id):
    """Right-pad tokenize_episode() dicts into long tensors: input_ids (B, L) padded with pad_id, attention_mask (B, L),
    action_step (B, L) padded with -1, state_pos (B, T+1) and action_pos (B, T) with 0; step_mask (B, T) float."""
    def pad(key, value):  # (B, the longest list): each row's list, then `value`
        out = torch.full((len(tokenized), max(len(x[key]) for x in tokenized)), value, dtype=torch.long)
        for i, x in enumerate(tokenized):
            out[i, :len(x[key])] = torch.tensor(x[key], dtype=torch.long)
        return out

    ids, action_pos = pad("input_ids", pad_id), pad("action_pos", 0)
    n, t = (torch.tensor([len(x[k]) for x in tokenized])[:, None] for k in ("input_ids", "action_pos"))
    return {"input_ids": ids, "attention_mask": (torch.arange(ids.shape[1]) < n).long(),
            "action_step": pad("action_step", -1), "state_pos": pad("state_pos", 0), "action_pos": action_pos,
            "step_mask": (torch.arange(action_pos.shape[1]) < t).float()}


if __name__ == "__main__":
    main()
