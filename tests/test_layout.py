"""docs/design.md, 'The chat layout': which tokens carry loss, and where V and Q are read."""
import pytest
import torch

EPISODE = {
    "env": "household", "task_id": "train/00000", "instruction": "Rules here.", "task": "put a mug in shelf 1.",
    "obs0": "You are in the middle of a room.", "reward": 0.0, "success": False, "truncated": True,
    "steps": [
        {"text": "Thought: find a mug.\nAction: go to cabinet 1", "action": "go to cabinet 1",
         "obs": "You arrive at cabinet 1. The cabinet 1 is closed.", "r_env": 0.0, "label": "ok", "r_aux": 0.0,
         "done": False},
        {"text": "Action: open cabinet 1", "action": "open cabinet 1",
         "obs": "Nothing happens.", "r_env": 0.0, "label": "invalid", "r_aux": -0.1, "done": False},
    ],
}

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(stages):
    texts = [m["content"] for m in stages["01_bc"].episode_messages(EPISODE)]
    return stages["01_bc"].train_tiny_tokenizer(texts, 300)


def check_layout(stages, tokenizer, end_of_turn):
    x = stages["01_bc"].tokenize_episode(tokenizer, EPISODE)
    ids = x["input_ids"]
    render = lambda m, gen: tokenizer.apply_chat_template(m, add_generation_prompt=gen, tokenize=False)  # noqa: E731
    msgs = stages["01_bc"].episode_messages(EPISODE)
    assert len(x["state_pos"]) == 3 and len(x["action_pos"]) == 2
    for t, step in enumerate(EPISODE["steps"]):
        action_ids = [i for i, s in zip(ids, x["action_step"]) if s == t]
        assert tokenizer.decode(action_ids) == step["text"] + end_of_turn
        # s_t is the last token of the generation prompt before turn t
        prefix = render(msgs[:2 + 2 * t], True)
        assert tokenizer.decode(ids[:x["state_pos"][t] + 1]) == prefix
        # the action tokens are contiguous, starting right after s_t and ending at the action position
        positions = [i for i, s in enumerate(x["action_step"]) if s == t]
        assert positions == list(range(x["state_pos"][t] + 1, x["action_pos"][t] + 1))
    # s_T is the last token: the generation prompt after the last observation
    assert x["state_pos"][-1] == len(ids) - 1
    assert tokenizer.decode(ids) == render(msgs, True)
    # observations, instruction and task carry no loss
    assert sum(s >= 0 for s in x["action_step"]) == sum(
        len(tokenizer(st["text"] + end_of_turn, add_special_tokens=False)["input_ids"]) for st in EPISODE["steps"])


def test_tiny_template_layout(stages, tokenizer):
    assert tokenizer.decode([tokenizer("<|assistant|>", add_special_tokens=False)["input_ids"][-1]]) == "<|assistant|>"
    check_layout(stages, tokenizer, "<|end|>")
    x = stages["01_bc"].tokenize_episode(tokenizer, EPISODE)
    assert all(tokenizer.convert_ids_to_tokens(x["input_ids"][p]) == "<|assistant|>" for p in x["state_pos"])
    assert all(tokenizer.convert_ids_to_tokens(x["input_ids"][p]) == "<|end|>" for p in x["action_pos"])


def test_other_chat_templates_work_too(stages, tokenizer):
    """A ChatML-style template (newlines after each turn, as many real models use)."""
    tokenizer.chat_template = CHATML
    check_layout(stages, tokenizer, "<|im_end|>\n")


def test_collate_pads_and_masks(stages, tokenizer):
    mod = stages["01_bc"]
    short = dict(EPISODE, steps=EPISODE["steps"][:1])
    xs = [mod.tokenize_episode(tokenizer, e) for e in (EPISODE, short)]
    b = mod.collate(xs, tokenizer.pad_token_id)
    assert b["input_ids"].shape == (2, len(xs[0]["input_ids"]))
    assert b["attention_mask"][1].sum() == len(xs[1]["input_ids"])
    assert b["step_mask"].tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert b["state_pos"][1].tolist() == xs[1]["state_pos"] + [0]


def test_collate_by_hand_pads_with_pad_id_minus_one_and_zero(stages):
    """Two tokenized episodes, 5 and 3 tokens, 2 and 1 steps, pad_id 7: every tensor by hand, and its dtype."""
    long = {"input_ids": [1, 2, 3, 4, 5], "action_step": [-1, 0, -1, 1, -1], "state_pos": [0, 2, 4],
            "action_pos": [1, 3]}
    short = {"input_ids": [6, 8, 9], "action_step": [-1, 0, -1], "state_pos": [0, 2], "action_pos": [1]}
    b = stages["01_bc"].collate([long, short], pad_id=7)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 8, 9, 7, 7]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert b["action_step"].tolist() == [[-1, 0, -1, 1, -1], [-1, 0, -1, -1, -1]]
    assert b["state_pos"].tolist() == [[0, 2, 4], [0, 2, 0]] and b["action_pos"].tolist() == [[1, 3], [1, 0]]
    assert b["step_mask"].tolist() == [[1.0, 1.0], [1.0, 0.0]] and b["step_mask"].dtype == torch.float
    assert all(b[k].dtype == torch.long for k in ("input_ids", "attention_mask", "action_step", "state_pos",
                                                  "action_pos"))
