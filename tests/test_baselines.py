"""The paper's baselines in miniature, against hand-computed values: ETO's pairs and DPO loss (eto.py), QLASS's trees,
max backup, stop signal and QNet loss (qlass.py)."""
import math

import pytest
import torch

from conftest import load_stage

eto = load_stage("eto")
qlass = load_stage("qlass")


def step(text, r_env=0.0, done=False):
    return {"text": text, "action": text, "obs": f"after {text}", "r_env": r_env, "label": "ok", "r_aux": 0.0,
            "done": done}


def episode(task, source, success):
    return {"task_id": task, "source": source, "success": success, "steps": [step("x", float(success), True)]}


def test_pairs_match_each_own_failure_with_a_success_on_its_task_the_demonstration_first():
    demo, own_win, own_loss = episode("t1", "expert", True), episode("t1", "self", True), episode("t1", "self", False)
    lone_loss, other_win = episode("t2", "self", False), episode("t3", "self", True)
    own_only_win, own_only_loss = episode("t4", "self", True), episode("t4", "self", False)
    pairs = eto.make_pairs([own_win, own_loss, lone_loss, other_win, demo, own_only_win, own_only_loss,
                            episode("t5", "expert", False)])
    assert [(w is demo, lo is own_loss) for w, lo in pairs][0] == (True, True)  # the demonstration wins t1
    assert pairs[1] == (own_only_win, own_only_loss)  # no demonstration of t4: its own success
    assert len(pairs) == 2  # t2 has no success; a demonstration's failure (t5) is never a loser


def test_dpo_loss_against_hand_computed_values():
    # margin = (logp_w - ref_w) - (logp_l - ref_l) = (-1 + 2) - (-3 + 2.5) = 1.5; loss = -log sigmoid(0.1 * 1.5)
    loss, info = eto.dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5]),
                              beta=0.1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.15)), abs=1e-6)
    assert info["accuracy"] == 1.0 and info["margin"] == pytest.approx(1.5)
    # at the reference (every log-ratio 0) the loss is log 2, whatever beta; swapping winner and loser flips the sign
    zero = torch.zeros(3)
    assert eto.dpo_loss(zero, zero, zero, zero, beta=5.0)[0].item() == pytest.approx(math.log(2))
    w, lo = torch.tensor([0.5, -1.0]), torch.tensor([-0.5, 1.0])
    a, b = eto.dpo_loss(w, lo, zero[:2], zero[:2], 1.0)[0], eto.dpo_loss(lo, w, zero[:2], zero[:2], 1.0)[0]
    by_hand = [-math.log(1 / (1 + math.exp(-m))) for m in (1.0, -2.0)]
    assert a.item() == pytest.approx(sum(by_hand) / 2) and b.item() != pytest.approx(a.item())


def test_a_trajectorys_log_likelihood_is_the_sum_over_its_reply_tokens_only():
    class Uniform(torch.nn.Module):  # log pi = -log V at every token
        def forward(self, input_ids, attention_mask, logits_to_keep):
            return type("Out", (), {"logits": torch.zeros(int(logits_to_keep.sum()), 8)})()
    batch = {"input_ids": torch.zeros((2, 6), dtype=torch.long), "attention_mask": torch.ones((2, 6)),
             "action_step": torch.tensor([[-1, 0, 0, -1, 1, -1], [-1, -1, 0, -1, -1, -1]])}
    # row 0: reply tokens at 1, 2, 4, predicted from 0, 1, 3 -> 3 tokens; row 1: one token
    assert eto.trajectory_logprobs(Uniform(), batch).tolist() == pytest.approx([-3 * math.log(8), -math.log(8)])


def tree():
    """root -> A (0) -> A1 (1, done), A -> A2 (0, done); root -> B (0, done)."""
    root = qlass.new_node()
    qlass.merge(root, [step("A"), step("A1", 1.0, True)])
    qlass.merge(root, [step("A"), step("A2", 0.0, True)])  # the same reply A: the same child
    qlass.merge(root, [step("B", 0.0, True)])
    return root


def test_max_backup_on_a_hand_made_tree():
    root = tree()
    assert list(root["children"]) == ["A", "B"] and list(root["children"]["A"]["children"]) == ["A1", "A2"]
    assert qlass.backup(root, 0.9) == pytest.approx(0.81)  # root: 0.9 * Q(A); Q(A) = 0 + 0.9 * max(1, 0)
    a = root["children"]["A"]
    assert (a["q"], a["children"]["A1"]["q"], a["children"]["A2"]["q"], root["children"]["B"]["q"]) == \
        pytest.approx((0.9, 1.0, 0.0, 0.0))


def test_branches_write_each_node_once_with_its_q():
    root = tree()
    qlass.backup(root, 0.9)
    eps = qlass.branches(root, {"task_id": "t"})
    assert [[s["text"] for s in ep["steps"]] for ep in eps] == [["A", "A1"], ["A", "A2"], ["B"]]
    assert [[s["new"] for s in ep["steps"]] for ep in eps] == [[True, True], [False, True], [True]]
    assert [[s["q"] for s in ep["steps"]] for ep in eps] == [pytest.approx([0.9, 1.0]), pytest.approx([0.9, 0.0]),
                                                               [0.0]]
    assert [ep["success"] for ep in eps] == [True, False, False] and [ep["reward"] for ep in eps] == [1.0, 0.0, 0.0]
    assert qlass.branches(qlass.new_node(), {"task_id": "t"}) == []  # a root without a step (session 11's probes)


def test_a_zero_reward_branch_stops_expansion_and_width_bounds_each_node():
    """A fake world: 'win' then 'end' wins, 'lose' loses at once; the rollout alternates lose, win from each node."""
    calls = []

    def rollout(requests):
        calls.append([tuple(s["text"] for s in prefix) for _, prefix in requests])
        out = []
        for _, prefix in requests:
            n = sum(c.count(tuple(s["text"] for s in prefix)) for c in calls)  # how often this node was sampled
            if n % 2 == 1:
                out.append(([step(f"lose{len(prefix)}", 0.0, True)], False))
            else:
                out.append(([step(f"win{len(prefix)}"), step("end", 1.0, True)][len(prefix) > 0:], True))
        return out
    roots = {"t": qlass.new_node()}
    sampled = qlass.grow(roots, {}, rollout, width=2, depth=2)
    root = roots["t"]
    assert calls[0] == [()]  # round 1: the root only; its branch loses, nothing queued from it
    assert root["children"]["lose0"]["tries"] == 0 and not root["children"]["lose0"]["queued"]
    assert calls[1] == [()]  # round 2: the root's second try wins: win0 (depth 1 < 2) joins the queue, its end not
    assert calls[2] == [("win0",)] and calls[3] == [("win0",)] and len(calls) == 4  # width 2 at win0, then done
    assert root["tries"] == 2 and root["children"]["win0"]["tries"] == 2
    assert sampled == 1 + 2 + 1 + 1  # lose0; win0, end; lose1; end (the reply 'end' after win0 merges)
    assert set(root["children"]["win0"]["children"]) == {"end", "lose1"}


def test_a_demonstration_is_the_first_branch_and_its_early_nodes_are_queued():
    seen = []

    def rollout(requests):
        seen.extend(tuple(s["text"] for s in prefix) for _, prefix in requests)
        return [([step("lose", 0.0, True)], False) for _ in requests]
    root = qlass.new_node()
    demo = qlass.merge(root, [step("a"), step("b"), step("c", 1.0, True)])
    qlass.grow({"t": root}, {"t": demo}, rollout, width=1, depth=2)
    assert seen == [(), ("a",)]  # the root and the node one step in; b is 2 steps from the root, c an end


def test_qnet_loss_is_the_mse_over_each_node_once():
    q_pred = torch.tensor([[0.5, 1.0], [0.2, 0.0]])
    q_target = torch.tensor([[1.0, 1.0], [0.0, 3.0]])
    new = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # the last entry: a node an earlier branch wrote (or padding)
    loss, info = qlass.qnet_loss(q_pred, q_target, new)
    assert loss.item() == pytest.approx((0.25 + 0.0 + 0.04) / 3) and info["loss"] == pytest.approx(loss.item())


def test_a_buffer_without_a_pair_keeps_the_policy_as_it_is(tiny_run, in_process, tmp_path):
    """Only demonstrations (no own failure): ETO has nothing to contrast and writes pi_{k-1} unchanged."""
    from safetensors.torch import load_file
    out = tmp_path / "policy_1"
    proc = in_process(eto, "--data", tiny_run / "expert.jsonl", "--policy", tiny_run / "policy_0",
                      "--ref", tiny_run / "policy_0", "--out", out, "--threads", 1)
    assert "no pair" in proc.stdout
    before, after = (load_file(d / "model.safetensors") for d in (tiny_run / "policy_0", out))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # --ref is checked with no pair too (session 13's probes: a missing one passed, exit 0, a policy written)
    proc = in_process(eto, "--data", tiny_run / "expert.jsonl", "--policy", tiny_run / "policy_0",
                      "--ref", tmp_path / "nosuch", "--out", tmp_path / "p2", "--threads", 1, check=False)
    assert proc.returncode == 2 and "nosuch: no such directory" in proc.stderr and not (tmp_path / "p2").exists()


def test_a_tree_whose_worst_case_exceeds_the_bound_is_refused_before_any_work(capsys):
    """Issue 94 (probe 5 of session 8): --width 1000000 --depth 1000000 passed and ran at 0 of 2 trees until killed.
    W^D branches a tree at most (4096: 16^3 passes, 16^4 does not); width 1 takes any depth (one branch a node)."""
    base = ["--policy", "p", "--trees", "t.jsonl", "--out", "q"]
    for w, d in ((16, 3), (1, 10**6), (2, 12)):
        assert (qlass.parse_args(base + ["--width", str(w), "--depth", str(d)]).width, w) == (w, w)
    for w, d in ((16, 4), (10**6, 10**6), (2, 13)):
        with pytest.raises(SystemExit) as e:
            qlass.parse_args(base + ["--width", str(w), "--depth", str(d)])
        assert e.value.code == 2 and "a tree may grow to W^D branches" in capsys.readouterr().err
