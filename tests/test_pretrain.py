"""00_pretrain.py: the corpus reads only `train` worlds, its reading answers are true, and a
tiny pretraining run lowers the loss and writes a model that 01_bc.py fine-tunes."""
import json
import random
import re

import pytest
import torch

import envs


def test_corpus_uses_only_train_tasks_and_no_expert(stages):
    pre = stages["00_pretrain"]
    env = envs.make("household", seed=0)
    reset_ids = []
    original_reset = env.reset

    def spy(task_id):
        reset_ids.append(task_id)
        return original_reset(task_id)
    env.reset = spy
    env.expert_action = env.expert_text = None  # the explorer must never ask the expert
    corpus = pre.build_corpus(env, 30, random.Random(0), 0.3, 0.5)
    assert len(corpus) == 30 and reset_ids and all(t.startswith("train/") for t in reset_ids)
    replies = [m["content"] for msgs in corpus for m in msgs if m["role"] == "assistant"]
    assert all(r.startswith("Action: ") or r.startswith("Answer: ") for r in replies)
    assert not any(r.startswith("Thought:") for r in replies)  # no expert text


def test_reading_answers_match_the_world(stages):
    """Replay each transcript in a fresh env: every 'is there a X here?' answer is what the
    current receptacle holds."""
    pre = stages["00_pretrain"]
    env = envs.make("household", seed=0)
    rng = random.Random(1)
    checked = 0
    for task_id in env.task_ids("train")[:40]:
        msgs = pre.transcript(env, task_id, rng, 0.3, 1.0)
        replay = envs.make("household", seed=0)
        replay.reset(task_id)
        for i, m in enumerate(msgs):
            if m["role"] == "assistant" and m["content"].startswith("Action: "):
                replay.step(m["content"][len("Action: "):])
            if m["role"] == "user" and m["content"].startswith("Question: is the object the task names"):
                asked = re.match(r"Your task is to: (?:put (?:a |two )(?:clean |hot |cool )?|look at )([a-z]+)",
                                 msgs[1]["content"]).group(1)
            elif m["role"] == "user" and m["content"].startswith("Question: is there a "):
                asked = m["content"][len("Question: is there a "):-len(" here?")]
            else:
                continue
            here = [o for o in replay._here(replay.location) if o.rsplit(" ", 1)[0] == asked]  # by type and number
            answer = msgs[i + 1]["content"]
            assert answer == (f"Answer: Yes: {', '.join(here)}." if here
                              else f"Answer: No, there is no {asked} here."), (answer, here)
            checked += 1
    assert checked > 20


def test_pretrain_lowers_the_loss_and_bc_fine_tunes_it(stages, in_process, tmp_path):
    base, metrics = tmp_path / "base", tmp_path / "metrics.jsonl"
    in_process(stages["00_pretrain"], "--out", base, "--episodes", 48, "--epochs", 3, "--batch-size", 8,
               "--d-model", 32, "--n-layers", 1, "--n-heads", 2, "--vocab-size", 400, "--lr", 1e-2, "--threads", 1,
               "--metrics", metrics)
    losses = [json.loads(line)["train_loss"] for line in open(metrics)]
    assert len(losses) == 3 and losses[2] < losses[0] * 0.8, losses
    assert (base / "model.safetensors").exists() and (base / "tokenizer.json").exists()
    args = json.load(open(base / "args.json"))
    assert args["stage"] == "00_pretrain" and args["episodes"] == 48 and args["env"] == "kitchen"
    in_process(stages["02_collect"], "--policy", "expert", "--split", "train", "--episodes", 6,
               "--out", tmp_path / "e.jsonl")
    in_process(stages["01_bc"], "--model", base, "--data", tmp_path / "e.jsonl", "--out", tmp_path / "policy_0",
               "--epochs", 1, "--threads", 1)
    assert (tmp_path / "policy_0" / "model.safetensors").exists()
    assert json.load(open(tmp_path / "policy_0" / "args.json"))["stage"] == "01_bc"


def test_lm_loss_reads_every_token_after_the_system_turn(stages):
    """The loss mask is 0 on the system turn and 1 from the first user token on; lm_loss is the
    mean NLL of the masked tokens only."""
    pre = stages["00_pretrain"]
    msgs = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Your task is to: look."},
            {"role": "assistant", "content": "Action: look"}]
    tokenizer = pre.train_tiny_tokenizer([m["content"] for m in msgs], 300)
    ids, mask = pre.tokenize_transcript(tokenizer, msgs)
    first = mask.index(1)
    assert len(ids) == len(mask) and set(mask[first:]) == {1} and not any(mask[:first])
    assert tokenizer.decode(ids[:first]) == "<|system|>Rules.<|end|>"
    logp, m = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert pre.lm_loss(logp, m).item() == pytest.approx(1.5)


def test_lr_at_warms_up_then_decays_to_a_tenth(stages):
    lr_at = stages["00_pretrain"].lr_at
    assert lr_at(0, 100, 1.0, 0.1) == pytest.approx(0.1) and lr_at(9, 100, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 100, 1.0, 0.1) == pytest.approx(1.0) and lr_at(100, 100, 1.0, 0.1) == pytest.approx(0.1)
    assert all(lr_at(s, 100, 1.0, 0.1) >= lr_at(s + 1, 100, 1.0, 0.1) for s in range(10, 100))


@pytest.mark.parametrize("flag,value,message", [("--seed", -1, "--seed must be a seed in [0, 2**32)"),
                                                ("--n-heads", 3, "must be a multiple of --n-heads")])
def test_bad_flags_are_one_line_and_nothing_written(stages, in_process, tmp_path, flag, value, message):
    proc = in_process(stages["00_pretrain"], "--out", tmp_path / "base", flag, value, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert message in proc.stderr and not (tmp_path / "base").exists()


def test_shop_corpus_fills_searches_and_answers_from_the_page(stages):
    """00 is generic: on shop the explorer's searches get keywords (not the `<keywords>`
    placeholder) and each 'which results here are X?' answer lists exactly the results of
    type X on the page the transcript just showed."""
    pre = stages["00_pretrain"]
    env = envs.make("shop", seed=0, n_per_type=4)
    rng = random.Random(0)
    checked = 0
    for task_id in env.task_ids("train")[:25]:
        msgs = pre.transcript(env, task_id, rng, 0.3, 1.0)
        actions = [m["content"][len("Action: "):] for m in msgs if m["content"].startswith("Action: ")]
        assert actions and not any("<keywords>" in a for a in actions)
        goal = env.generate(task_id)
        for i, m in enumerate(msgs):
            if m["role"] == "user" and m["content"].startswith("Question: which results here are"):
                page = msgs[i - 1]["content"]  # the results page the question is about
                shown = [w for w in page.split(" [SEP] ") if w in env.by_asin]  # ids as the page shows them
                want = [a for a in shown if env.by_asin[a]["query"] == goal["type"]]
                assert msgs[i + 1]["content"] == f"Answer: {', '.join(want) if want else 'none'}."
                checked += 1
    assert checked >= 5


def test_shop_corpus_holds_no_evaluation_task(stages):
    """The shop corpus reads `train` goals only: every transcript's task is a `train` instruction,
    no `dev` / `seen` / `unseen` instruction appears anywhere in it, and the answers about the
    goal ('what does the instruction ask for?') are the transcript's own train request. (The
    catalogue is shared by every split, as in WebShop, so pages may show any product.)"""
    pre = stages["00_pretrain"]
    env = envs.make("shop", seed=0, page_size=3, max_steps=10, hasty=0.5)
    corpus = pre.build_corpus(env, 300, random.Random(0), 0.3, 1.0)
    train = {env.generate(t)["task"] for t in env.task_ids("train")}
    held = {env.generate(t)["task"] for s in ("dev", "seen", "unseen") for t in env.task_ids(s)}
    assert {msgs[1]["content"].split("\n")[0][len("Your task is to: "):] for msgs in corpus} <= train
    text = "\n".join(m["content"] for msgs in corpus for m in msgs)
    assert not any(h in text for h in held)
    checked = 0
    for task_id, msgs in zip(env.task_ids("train"), corpus):  # the corpus cycles through train in order
        env.reset(task_id)
        request = env.expert_query()  # the request of this train task, word for word
        assert request in env.generate(task_id)["task"]
        for i, m in enumerate(msgs[:-1]):
            if m["content"] == "Question: what does the instruction ask for?":
                assert msgs[i + 1]["content"] == f"Answer: {request}."
                checked += 1
    assert checked >= 50
