"""The algorithm's pure functions against hand-computed values (the equations of the stages' docstrings),
and 04's choice of rewards end to end."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoModel


def test_expectile_at_half_is_half_the_mse(stages):
    expectile_loss = stages["03_critic"].expectile_loss
    u = torch.tensor([-2.0, -0.5, 0.0, 1.0, 3.0])
    assert torch.isclose(expectile_loss(u, 0.5), 0.5 * (u ** 2).mean())


def test_expectile_is_asymmetric(stages):
    expectile_loss = stages["03_critic"].expectile_loss
    pos, neg = torch.tensor([2.0]), torch.tensor([-2.0])
    assert torch.isclose(expectile_loss(pos, 0.7), torch.tensor(0.7 * 4))
    assert torch.isclose(expectile_loss(neg, 0.7), torch.tensor(0.3 * 4))
    assert expectile_loss(pos, 0.9) > expectile_loss(neg, 0.9)


def test_expectile_weights_are_a_weighted_mean(stages):
    expectile_loss = stages["03_critic"].expectile_loss
    u = torch.tensor([1.0, -1.0, 5.0])
    w = torch.tensor([2.0, 1.0, 0.0])  # the last entry is padding
    # (2 * 0.7 * 1 + 1 * 0.3 * 1) / 3
    assert torch.isclose(expectile_loss(u, 0.7, w), torch.tensor(1.7 / 3))


def test_weighted_mse_is_a_weighted_mean_of_squares(stages):
    weighted_mse = stages["03_critic"].weighted_mse
    u, w = torch.tensor([1.0, -2.0, 5.0]), torch.tensor([2.0, 1.0, 0.0])  # the last entry is padding
    assert torch.isclose(weighted_mse(u, w), torch.tensor((2 * 1 + 1 * 4) / 3))  # the sign does not matter
    assert weighted_mse(u, torch.zeros(3)) == 0  # no real entry: no division by zero


def test_expectile_weights_divide_by_their_sum_not_the_count(stages):
    """Weights 3 and 1 (sum 4, two entries): the mean is over the weights' sum; all-zero weights give 0, not NaN."""
    expectile_loss = stages["03_critic"].expectile_loss
    u, w = torch.tensor([1.0, -1.0]), torch.tensor([3.0, 1.0])
    assert torch.isclose(expectile_loss(u, 0.7, w), torch.tensor((3 * 0.7 * 1 + 1 * 0.3 * 1) / 4))
    assert expectile_loss(u, 0.7, torch.zeros(2)) == 0  # a batch of padding only: no division by zero


def test_weighted_mse_divides_by_the_sum_of_the_weights(stages):
    weighted_mse = stages["03_critic"].weighted_mse
    u, w = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 1.0])
    assert torch.isclose(weighted_mse(u, w), torch.tensor((3 * 1 + 1 * 4) / 4))
    assert torch.isclose(weighted_mse(u, torch.ones(2)), torch.tensor(2.5))  # equal weights: the plain mean


def test_expectile_minimizer_is_the_expectile(stages):
    """V trained by expectile regression on samples of Q goes above the mean for tau > 0.5."""
    expectile_loss = stages["03_critic"].expectile_loss
    q = torch.tensor([0.0, 0.0, 0.0, 1.0])
    v = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([v], lr=0.5)
    for _ in range(500):
        opt.zero_grad()
        expectile_loss(q - v, 0.9).backward()
        opt.step()
    # tau-expectile m solves 0.9 * (1 - m) = 0.1 * 3 * m  ->  m = 0.9 / 1.2 = 0.75
    assert abs(v.item() - 0.75) < 1e-3


def test_step_weights_by_hand(stages):
    step_weights = stages["03_critic"].step_weights
    # T = 4: t/T = .25 .5 .75 1
    assert torch.allclose(step_weights(4, 0), torch.tensor([0.625, 0.75, 0.875, 1.0]))
    assert torch.allclose(step_weights(4, 1), torch.tensor([1.125, 1.25, 1.375, 1.5]))
    assert torch.allclose(step_weights(1, 1), torch.tensor([1.5]))


def test_step_weights_grow_along_the_episode_and_with_success(stages):
    """w_t rises with t (the last step weighs most) and by 1/2 in an episode that ended with the reward (d = 1)."""
    step_weights = stages["03_critic"].step_weights
    w0, w1 = step_weights(5, 0), step_weights(5, 1.0)
    assert torch.allclose(w0, torch.tensor([0.6, 0.7, 0.8, 0.9, 1.0]))
    assert torch.allclose(w1 - w0, torch.full((5,), 0.5))
    assert torch.allclose(step_weights(2, 0), torch.tensor([0.75, 1.0]))


def loop_gae(rewards, values, dones, gamma, lam):
    """The recursion written out step by step, independently of 04's implementation."""
    T = len(rewards)
    adv = [0.0] * T
    nxt = 0.0
    for t in range(T - 1, -1, -1):
        bootstrap = 0.0 if dones[t] else values[t + 1]
        delta = rewards[t] + gamma * bootstrap - values[t]
        nxt = delta + (0.0 if dones[t] else gamma * lam * nxt)
        adv[t] = nxt
    return adv


def test_gae_terminal_by_hand(stages):
    gae = stages["04_gae"].gae
    r, v, d = [0.0, 0.0, 1.0], [0.5, 0.6, 0.8, 0.3], [0, 0, 1]
    g, lam = 0.9, 0.5
    d2 = 1.0 - 0.8                     # terminal: V(s_3) = 0.3 is not used
    d1 = 0.9 * 0.8 - 0.6
    d0 = 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + g * lam * a2
    a0 = d0 + g * lam * a1
    assert np.allclose(gae(r, v, d, g, lam), [a0, a1, a2])


def test_gae_truncated_bootstraps_last_value(stages):
    gae = stages["04_gae"].gae
    r, v, d = [0.0, 0.0], [0.2, 0.4, 0.7], [0, 0]
    g, lam = 0.9, 0.5
    a1 = 0.9 * 0.7 - 0.4              # bootstraps V(s_T) = 0.7
    a0 = (0.9 * 0.4 - 0.2) + g * lam * a1
    assert np.allclose(gae(r, v, d, g, lam), [a0, a1])


def test_gae_mid_episode_done_by_hand(stages):
    """Two trajectories back to back: step 1 ends the first (done), so neither V(s_2) nor A_2 reaches A_1,
    and A_0 carries only A_1."""
    gae = stages["04_gae"].gae
    r, v, d = [0.0, 1.0, 0.0, 0.5], [0.5, 0.6, 0.2, 0.3, 0.9], [0, 1, 0, 1]
    g, lam = 0.9, 0.5
    a3 = 0.5 - 0.3                       # terminal: V(s_4) = 0.9 is not used
    a2 = (0.9 * 0.3 - 0.2) + g * lam * a3
    a1 = 1.0 - 0.6                       # done: no V(s_2), no A_2
    a0 = (0.9 * 0.6 - 0.5) + g * lam * a1
    assert np.allclose(gae(r, v, d, g, lam), [a0, a1, a2, a3])
    assert np.allclose(gae(r, v, d, g, 0.0), [0.9 * 0.6 - 0.5, 0.4, 0.9 * 0.3 - 0.2, 0.2])  # lambda 0: the deltas


def test_the_step_limit_ends_a_cut_trajectory(stages):
    """03 and 04: a trajectory cut by the step limit (last step not done) ends there - V(s_T) is
    not bootstrapped - like one that reached a true terminal; steps before the last keep their done."""
    ep = {"steps": [{"r_env": 0.0, "r_aux": -0.1, "done": False}, {"r_env": 0.0, "r_aux": 0.0, "done": False}]}
    v, q, g, lam = np.array([0.2, 0.4, 0.7]), np.zeros(2), 0.9, 0.5
    adv = lambda out: [s["adv"] for s in out["steps"]]
    a1 = 0.0 - 0.4                    # the cut: V(s_T) = 0.7 is not used
    a0 = (0.9 * 0.4 - 0.2) + g * lam * a1
    ea = stages["04_gae"].episode_advantages
    assert np.allclose(adv(ea(ep, v, q, g, lam, "gae", False)), [a0, a1])
    won = {"steps": [dict(ep["steps"][0]), dict(ep["steps"][1], r_env=1.0, done=True)]}
    assert np.allclose(adv(ea(won, v, q, g, lam, "gae", False)), [(0.9 * 0.4 - 0.2) + g * lam * 0.6, 1.0 - 0.4])


def test_step_limit_episode_advantages_record_v_q_and_qv_by_hand(stages):
    """04's per-step record: v = V(s_t), q = Q(s_t, a_t), adv = A_t; --advantage qv is Q(s_t, a_t) - V(s_t); with_aux
    adds r_aux to r_t; a step before the last keeps its own done (here: not done)."""
    ea = stages["04_gae"].episode_advantages
    ep = {"steps": [{"r_env": 0.0, "r_aux": -0.1, "done": False}, {"r_env": 1.0, "r_aux": 0.0, "done": True}]}
    v, q, g = np.array([0.5, 0.8, 0.3]), np.array([0.6, 0.9]), 0.9
    out = ea(ep, v, q, g, 1.0, "qv", False)
    assert [s["v"] for s in out["steps"]] == pytest.approx([0.5, 0.8])
    assert [s["q"] for s in out["steps"]] == pytest.approx([0.6, 0.9])
    assert [s["adv"] for s in out["steps"]] == pytest.approx([0.6 - 0.5, 0.9 - 0.8])
    a1 = 1.0 - 0.8
    assert [s["adv"] for s in ea(ep, v, q, g, 1.0, "gae", True)["steps"]] == \
        pytest.approx([-0.1 + 0.9 * 0.8 - 0.5 + g * a1, a1])
    assert out["steps"][0]["r_aux"] == -0.1 and ep["steps"][0] == {"r_env": 0.0, "r_aux": -0.1, "done": False}


def test_the_critic_ends_a_cut_trajectory_too(stages):
    """03's per-step tensors: done = 1 on the last step of every trajectory, cut by the step limit or not."""
    ep = {"steps": [{"r_env": 0.0, "r_aux": -0.1, "done": False}, {"r_env": 0.0, "r_aux": 0.0, "done": False}]}
    won = {"steps": [dict(ep["steps"][0]), dict(ep["steps"][1], r_env=1.0, done=True)]}
    tt = stages["03_critic"].trajectory_tensors
    eps = [ep, won, {"steps": ep["steps"][:1]}]
    assert torch.allclose(tt(eps, "cpu")["r_aux"], torch.tensor([[-0.1, 0.0], [-0.1, 0.0], [-0.1, 0.0]]))
    assert tt(eps, "cpu")["r_env"].tolist() == [[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    assert tt(eps, "cpu")["done"].tolist() == [[0, 1], [0, 1], [1, 0]]
    assert tt(eps, "cpu")["mask"].tolist() == [[1, 1], [1, 1], [1, 0]]


def test_critic_ends_each_trajectory_of_a_batch_shortest_first(stages):
    """The batch is as wide as its longest trajectory, wherever it stands; each row is done on its own last step."""
    tt = stages["03_critic"].trajectory_tensors
    st = lambda r_env, r_aux, done: {"r_env": r_env, "r_aux": r_aux, "done": done}
    eps = [{"steps": [st(0.0, -0.2, False)]},
           {"steps": [st(0.0, 0.0, False), st(0.0, -0.1, False), st(1.0, 0.0, True)]}]
    out = tt(eps, "cpu")
    assert out["done"].tolist() == [[1, 0, 0], [0, 0, 1]] and out["mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert out["r_env"].tolist() == [[0, 0, 0], [0, 0, 1]]
    assert torch.allclose(out["r_aux"], torch.tensor([[-0.2, 0, 0], [0, -0.1, 0]]))


def test_iql_losses_by_hand(stages):
    """03's losses on one two-step episode: L_V is the weighted expectile loss of Qbar(s_t, a_t) - V(s_t)
    (Qbar from the target head), L_Q the weighted TD error with V(s_{t+1}) held fixed and cut at done."""
    h = torch.tensor([[[0.8], [2.0]]])                            # (B, T, H): the reply positions
    v_all = torch.tensor([[0.5, 0.8, 0.3]], requires_grad=True)   # V(s_0), V(s_1), V(s_2)
    q = torch.tensor([[0.6, 0.9]], requires_grad=True)            # Q(s_0, a_0), Q(s_1, a_1)
    target = torch.nn.Linear(1, 1, bias=False)
    target.weight.data.fill_(0.5)                                 # Qbar = 0.5 h = [0.4, 1.0]
    traj = {k: torch.tensor([v]) for k, v in
            {"r_env": [0.0, 1.0], "r_aux": [-0.1, 0.0], "done": [0.0, 1.0], "mask": [1.0, 1.0]}.items()}
    w, tau, g = torch.tensor([[1.0, 3.0]]), 0.7, 0.9
    iql = stages["03_critic"].iql_losses
    loss, info = iql(lambda batch: (h, v_all, q), target, None, traj, w, tau, g, True)
    # u = Qbar - V = [-0.1, 0.2]: (1 * 0.3 * 0.01 + 3 * 0.7 * 0.04) / 4
    assert info["loss_v"] == pytest.approx((0.003 + 0.084) / 4)
    # TD errors: -0.1 + 0.9 * 0.8 - 0.6 = 0.02, and 1.0 - 0.9 = 0.1 (done: no V(s_2))
    assert info["loss_q"] == pytest.approx((0.02 ** 2 + 3 * 0.1 ** 2) / 4)
    assert loss.item() == pytest.approx(info["loss_v"] + info["loss_q"])
    loss.backward()
    # V(s_0), V(s_1) get gradient from L_V only (V(s_1): 3 * 0.7 * 2 * 0.2 * -1 / 4), not from the TD target
    assert v_all.grad[0].tolist() == pytest.approx([2 * 0.3 * -0.1 * -1 / 4, -0.21, 0.0])
    assert target.weight.grad is None                             # the target head is not trained here
    _, info = iql(lambda batch: (h, v_all, q), target, None, traj, w, tau, g, False)  # without r_aux
    assert info["loss_q"] == pytest.approx((0.12 ** 2 + 3 * 0.1 ** 2) / 4)


def test_iql_losses_on_padding_and_the_q_gradient_by_hand(stages):
    """A batch of two trajectories, the second one step long (its step 1 padding, weight 0): the padding adds nothing,
    and L_Q's gradient on Q(s_t, a_t) is -2 w_t u_t / sum(w)."""
    h = torch.tensor([[[1.0], [1.0]], [[2.0], [0.0]]])            # Qbar = h (weight 1)
    v_all = torch.tensor([[0.2, 0.5, 0.0], [0.4, 0.7, 0.0]], requires_grad=True)
    q = torch.tensor([[0.3, 0.6], [0.1, 5.0]], requires_grad=True)
    target = torch.nn.Linear(1, 1, bias=False)
    target.weight.data.fill_(1.0)
    traj = {"r_env": torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "r_aux": torch.zeros(2, 2),
            "done": torch.tensor([[0.0, 1.0], [1.0, 0.0]]), "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]])}
    w = torch.tensor([[1.0, 2.0], [1.0, 0.0]])
    loss, info = stages["03_critic"].iql_losses(lambda batch: (h, v_all, q), target, None, traj, w, 0.5, 0.9, True)
    u = [0.9 * 0.5 - 0.3, 1.0 - 0.6, 0.0 - 0.1]                 # TD errors of the three real steps
    assert info["loss_q"] == pytest.approx((u[0] ** 2 + 2 * u[1] ** 2 + u[2] ** 2) / 4)
    # tau 0.5: L_V = 0.5 * the weighted mean of (Qbar - V)^2, Qbar - V = 0.8, 0.5, 1.6
    assert info["loss_v"] == pytest.approx(0.5 * (0.8 ** 2 + 2 * 0.5 ** 2 + 1.6 ** 2) / 4)
    assert (info["v_mean"], info["q_mean"]) == pytest.approx(((0.2 + 0.5 + 0.4) / 3, (0.3 + 0.6 + 0.1) / 3))
    loss.backward()
    assert q.grad.flatten().tolist() == pytest.approx([-2 * u[0] / 4, -2 * 2 * u[1] / 4, -2 * u[2] / 4, 0.0])


def test_td_error_without_the_critics_aux_rewards_gives_the_penalty_back(stages):
    """04's design choice by hand: for a critic at its fixed point on r_env + r_aux
    (Q = r_env + r_aux + gamma V(s')), the one-step advantage on those rewards is Q - V, while
    the paper's 'env rewards only' gives Q - V - r_aux: a penalised step scores |r_aux| higher."""
    g = 0.9
    ep = {"steps": [{"r_env": 0.0, "r_aux": -0.1, "done": False}, {"r_env": 1.0, "r_aux": 0.0, "done": True}]}
    v = np.array([0.5, 0.8, 0.0])
    q = np.array([0.0 - 0.1 + g * 0.8, 1.0])  # the Bellman fixed point of 03's L_Q
    ea = stages["04_gae"].episode_advantages
    adv = lambda with_aux, kind: [s["adv"] for s in ea(ep, v, q, g, 0.0, kind, with_aux)["steps"]]
    assert np.allclose(adv(True, "gae"), q - v[:2])
    assert np.allclose(adv(True, "gae"), [-0.1 + 0.72 - 0.5, 0.2])
    assert np.allclose(adv(False, "gae"), [0.72 - 0.5, 0.2])  # the invalid step gets its 0.1 back
    assert np.allclose(adv(False, "qv"), q - v[:2])  # Q - V already holds r_aux


def test_04_keeps_r_aux_out_of_the_advantage_unless_asked(stages, tiny_run, tmp_path, in_process):
    """04 end to end with lambda 0: '--rewards critic' minus the default (r_env only, the paper's placement)
    is r_aux on every step for a critic trained with r_aux, and 0 for a critic trained with 03 --no-aux."""
    c3 = stages["03_critic"]
    torch.manual_seed(0)
    critic = c3.Critic(AutoModel.from_pretrained(tiny_run / "policy_0", local_files_only=True))
    eps = [json.loads(line) for line in open(tiny_run / "expert.jsonl")][:3]
    for ep in eps:  # an invalid step and a repeat in every episode, with their r_aux
        ep["steps"][0].update(label="invalid", r_aux=-0.1)
        ep["steps"][1].update(label="repeat", r_aux=-0.1)  # as 02 labels the demonstrator's own repeats
    data = tmp_path / "buf.jsonl"
    data.write_text("".join(json.dumps(ep) + "\n" for ep in eps))

    def advantages(no_aux, *flags):
        d = tmp_path / f"critic_{no_aux}"
        if not d.exists():
            c3.save_critic(critic, str(d), c3.load_tokenizer(str(tiny_run / "policy_0")),
                           {"gamma": 0.9, "no_aux": no_aux})
        out = tmp_path / f"adv_{no_aux}_{len(flags)}.jsonl"
        in_process(stages["04_gae"], "--data", data, "--critic", d, "--out", out, "--lam", 0, "--threads", 1, *flags)
        return np.array([s["adv"] for line in open(out) for s in json.loads(line)["steps"]])

    r_aux = np.array([s["r_aux"] for ep in eps for s in ep["steps"]])
    assert np.allclose(advantages(False, "--rewards", "critic") - advantages(False), r_aux, atol=1e-5)
    assert np.allclose(advantages(True), advantages(True, "--rewards", "critic"), atol=1e-6)
    assert np.allclose(advantages(True), advantages(False), atol=1e-6)


def test_04_outcome_gives_every_step_its_return_minus_the_mean(stages, tmp_path, in_process):
    """--advantage outcome, no critic: returns 1, 0, 0.5 (mean 0.5) -> A = +0.5, -0.5, 0 on every step."""
    step = {"text": "Action: look", "action": "look", "obs": "o", "label": "ok", "r_aux": 0.0}
    eps = [{"env": "household", "task_id": f"train/0000{i}", "split": "train", "source": "self", "policy": "p",
            "seed": 0, "instruction": "i", "task": "t", "obs0": "o",
            "steps": [dict(step, r_env=0.0, done=False), dict(step, r_env=r, done=r > 0)],
            "reward": r, "success": r == 1.0, "truncated": r == 0.0} for i, r in enumerate([1.0, 0.0, 0.5])]
    eps[2]["steps"][1]["done"] = True
    (tmp_path / "buf.jsonl").write_text("".join(json.dumps(ep) + "\n" for ep in eps))
    in_process(stages["04_gae"], "--data", tmp_path / "buf.jsonl", "--advantage", "outcome",
               "--out", tmp_path / "adv.jsonl", "--threads", 1)
    out = [json.loads(line) for line in open(tmp_path / "adv.jsonl")]
    assert [[s["adv"] for s in ep["steps"]] for ep in out] == [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0]]
    assert all(s["q"] - s["v"] == s["adv"] for ep in out for s in ep["steps"])
    proc = in_process(stages["04_gae"], "--data", tmp_path / "buf.jsonl", "--out", tmp_path / "x.jsonl", check=False)
    assert proc.returncode == 2 and "--critic is required" in proc.stderr, proc.stderr


def test_04_refuses_non_finite_values_and_writes_nothing(stages, tiny_run, tmp_path, in_process):
    """A critic whose V head gives NaN: 04 stops with one error line before writing the JSONL or its summary."""
    c3 = stages["03_critic"]
    critic = c3.Critic(AutoModel.from_pretrained(tiny_run / "policy_0", local_files_only=True))
    with torch.no_grad():
        critic.v_head[-1].bias.fill_(float("nan"))
    c3.save_critic(critic, str(tmp_path / "critic"), c3.load_tokenizer(str(tiny_run / "policy_0")), {"gamma": 0.9})
    proc = in_process(stages["04_gae"], "--data", tiny_run / "expert.jsonl", "--critic", tmp_path / "critic",
                      "--out", tmp_path / "adv.jsonl", "--threads", 1, check=False)
    assert proc.returncode == 2 and "non-finite" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["critic"]


def test_gae_lambda_one_is_return_minus_value(stages):
    gae = stages["04_gae"].gae
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=6), rng.normal(size=7)
    d = [0, 0, 0, 0, 0, 1]
    g = 0.95
    returns = [sum(g ** (k - t) * r[k] for k in range(t, 6)) for t in range(6)]
    assert np.allclose(gae(r, v, d, g, 1.0), np.array(returns) - v[:6])


def test_gae_matches_plain_loop(stages):
    gae = stages["04_gae"].gae
    rng = np.random.default_rng(1)
    for T in [1, 5, 13]:
        r, v = rng.normal(size=T), rng.normal(size=T + 1)
        d = (rng.random(T) < 0.2).astype(float)
        assert np.allclose(gae(r, v, d, 0.97, 0.8), loop_gae(r, v, d, 0.97, 0.8))


def test_critic_report_by_hand():
    """04's report on V: the returns g_t on r_env (r_aux left out), their mean per source, and the explained
    variance 1 - Var(g - V) / Var(g)."""
    from critic_report import advantage_report, explained_variance
    st = lambda r_env, r_aux, v: {"r_env": r_env, "r_aux": r_aux, "v": v, "q": v + 1, "adv": 0.0, "label": "ok"}
    eps = [{"source": "self", "success": True, "steps": [st(0.0, -0.1, 0.4), st(1.0, 0.0, 1.0)]},
           {"source": "expert", "success": True, "steps": [st(1.0, 0.0, 0.0)]}]
    g = [0.5 * 1.0, 1.0, 1.0]  # gamma 0.5, without r_aux
    out = advantage_report(eps, 0.5)
    assert out["critic_by_source"]["self"]["ret_mean"] == pytest.approx((g[0] + g[1]) / 2)
    assert out["critic_by_source"]["self"]["q_mean"] == pytest.approx(1.7)
    assert out["explained_variance"] == pytest.approx(1 - np.var(np.subtract(g, [0.4, 1.0, 0.0])) / np.var(g))
    assert np.isnan(explained_variance([0.2, 0.9], [1.0, 1.0]))  # every return equal: nothing to explain


def test_the_share_of_the_bayes_critics_figure_only_where_the_bayes_critic_has_one():
    """Seed 2's held-out report printed '(-20.71 of it)' against a Bayes explained variance of -0.002."""
    from critic_report import share
    assert share(0.145, 0.410) == " (0.35 of it)" and share(-0.106, -0.336) == " (0.32 of it)"
    assert share(0.044, -0.002) == share(0.1, float("nan")) == ""


def test_auc_by_hand_and_against_pair_counting():
    from critic_report import auc
    # positives 0.9, 0.4; negatives 0.5, 0.1: pairs won 2 + 1 of 4
    assert auc([0.9, 0.5, 0.4, 0.1], [1, 0, 1, 0]) == pytest.approx(0.75)
    assert auc([0.3, 0.3], [1, 0]) == pytest.approx(0.5)          # a tie counts 1/2
    assert auc([0.1, 0.9], [1, 0]) == pytest.approx(0.0)
    assert np.isnan(auc([0.1, 0.2], [1, 1]))                      # one class only
    rng = np.random.default_rng(0)
    s, y = rng.integers(0, 5, size=60).astype(float), rng.random(60) < 0.4  # many ties
    pos, neg = s[y], s[~y]
    pairs = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    assert auc(s, y) == pytest.approx(pairs)


def test_retro_label_rules_and_precedence(stages):
    retro_label = stages["02_collect"].retro_label
    assert retro_label(None, "a", "a", True) == "format"        # format beats everything
    assert retro_label("go to x", "a", "Nothing happens.", True) == "invalid"
    assert retro_label("look", "Nothing happens.", "Nothing happens.", True) == "invalid"  # invalid beats repeat
    assert retro_label("look", "same", "same", False) == "repeat"
    assert retro_label("go to x", "a", "b", False) == "ok"


def test_retro_label_reads_the_observations_not_the_command(stages):
    """A repeat is an observation that did not change, whatever the command; a new observation is ok even for a
    command given twice; a format error is 'format' whatever the observations."""
    retro_label = stages["02_collect"].retro_label
    assert retro_label("look", "You see a pan.", "You see a pan.", False) == "repeat"
    assert retro_label("take pan", "You see a pan.", "You take the pan.", False) == "ok"
    assert retro_label("look", "look", "You see a pan.", False) == "ok"
    assert retro_label(None, "a", "b", False) == "format"
    assert retro_label("use pan", "a", "b", True) == "invalid"


def test_parse_action(stages):
    parse_action = stages["02_collect"].parse_action
    assert parse_action("Thought: hmm\nAction: go to  cabinet 1") == "go to cabinet 1"
    assert parse_action("Action: go to desk 1\nmore text") == "go to desk 1"
    assert parse_action("Thought: I will go") is None
    assert parse_action("Action:   ") is None


def bppo(stages, logp, logp_old, adv, eps_low=0.4, eps_high=0.2):
    t = lambda x: torch.tensor(x, dtype=torch.float, requires_grad=False)  # noqa: E731
    logp = torch.tensor(logp, dtype=torch.float, requires_grad=True)
    loss = stages["05_bppo"].bppo_loss(logp, t(logp_old), t(adv), torch.ones(len(adv)), eps_low, eps_high)
    loss.backward()
    return loss.item(), logp.grad


def test_bppo_loss_inside_the_clip_range_is_the_plain_surrogate(stages):
    ratio = [1.1, 0.8]
    logp = list(np.log(ratio))
    loss, grad = bppo(stages, logp, [0.0, 0.0], [2.0, -1.0])
    assert np.isclose(loss, -(1.1 * 2.0 + 0.8 * -1.0) / 2)
    assert torch.allclose(grad, torch.tensor([-1.1 * 2.0 / 2, 0.8 * 1.0 / 2]))  # d/dlogp of -eta*A/N


def test_bppo_loss_clips_asymmetrically(stages):
    # A > 0 and eta = 1.5 > 1 + eps_high: the objective is capped at 1.2 * A, zero gradient.
    loss, grad = bppo(stages, [np.log(1.5)], [0.0], [1.0])
    assert np.isclose(loss, -1.2) and grad.abs().item() == 0
    # A < 0 and eta = 0.5 < 1 - eps_low = 0.6: capped at 0.6 * A, zero gradient.
    loss, grad = bppo(stages, [np.log(0.5)], [0.0], [-1.0])
    assert np.isclose(loss, 0.6) and grad.abs().item() == 0
    # A < 0 and eta = 0.7: inside the (wider) lower range, still pushed down.
    loss, grad = bppo(stages, [np.log(0.7)], [0.0], [-1.0])
    assert np.isclose(loss, 0.7) and grad.item() > 0
    # A > 0 and eta = 0.5: the min keeps the unclipped term, gradient flows (PPO's pessimism).
    loss, grad = bppo(stages, [np.log(0.5)], [0.0], [1.0])
    assert np.isclose(loss, -0.5) and grad.item() < 0
    # Symmetric clipping would cut at 0.8 where asymmetric allows 0.7.
    loss_sym, grad_sym = bppo(stages, [np.log(0.7)], [0.0], [-1.0], eps_low=0.2, eps_high=0.2)
    assert np.isclose(loss_sym, 0.8) and grad_sym.item() == 0


def test_bppo_dual_clip_bounds_a_bad_tokens_term(stages):
    """--dual-clip c: for A < 0 the term is at least c * A however far eta has grown; A > 0 and
    eta inside the bound are unchanged."""
    loss = stages["05_bppo"].bppo_loss
    one = torch.ones(1)
    logp_old = torch.zeros(1)
    big = torch.log(torch.tensor([10.0]))          # eta = 10
    assert torch.allclose(loss(big, logp_old, -one, one, 0.4, 0.2), torch.tensor([10.0]))         # -(10 * -1)
    assert torch.allclose(loss(big, logp_old, -one, one, 0.4, 0.2, 3.0), torch.tensor([3.0]))     # -(3 * -1)
    assert torch.allclose(loss(big, logp_old, one, one, 0.4, 0.2, 3.0), torch.tensor([-1.2]))     # A > 0: clip at 1.2
    mid = torch.log(torch.tensor([2.0]))
    assert torch.allclose(loss(mid, logp_old, -one, one, 0.4, 0.2, 3.0), torch.tensor([2.0]))     # eta < c: eta * A


def test_bppo_loss_respects_the_mask(stages):
    bppo_loss = stages["05_bppo"].bppo_loss
    logp = torch.tensor([0.0, 3.0])
    loss = bppo_loss(logp, torch.zeros(2), torch.tensor([1.0, 100.0]), torch.tensor([1.0, 0.0]), 0.4, 0.2)
    assert torch.isclose(loss, torch.tensor(-1.0))


def test_kl_to_ref_is_zero_for_the_same_policy_and_positive_otherwise(stages):
    kl_to_ref = stages["05_bppo"].kl_to_ref
    logits = torch.randn(6, 7)  # (N, V): the next-token logits at 6 reply tokens
    assert kl_to_ref(logits, torch.log_softmax(logits.clone(), dim=-1)).abs().item() < 1e-6
    other = logits + torch.randn(6, 7)
    assert kl_to_ref(logits, torch.log_softmax(other, dim=-1)).item() > 0
    # by hand: p = softmax([0, 0]) = (.5, .5), r = softmax([0, log 3]) = (.25, .75), and r = p
    p = torch.zeros(2, 2)
    r = torch.log_softmax(torch.tensor([[0.0, float(np.log(3))], [0.0, 0.0]]), dim=-1)
    expected = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
    assert np.isclose(kl_to_ref(p, r).item(), expected / 2, atol=1e-6)  # the mean over the 2 tokens


def test_kl_to_ref_by_hand_the_mean_over_tokens_of_the_sum_over_the_vocabulary(stages):
    """Two tokens over a vocabulary of 3: KL(pi_theta || pi_ref) of each by hand, their mean; logits or
    log-probabilities alike."""
    kl_to_ref = stages["05_bppo"].kl_to_ref
    p = torch.tensor([[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]])
    r = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.5, 0.25, 0.25]])
    by_hand = [sum(pi * np.log(pi / ri) for pi, ri in zip(pr, rr)) for pr, rr in zip(p.tolist(), r.tolist())]
    assert kl_to_ref(p.log(), r.log()).item() == pytest.approx(np.mean(by_hand), abs=1e-6)
    assert kl_to_ref(p.log() + 3.0, r.log() - 1.0).item() == pytest.approx(np.mean(by_hand), abs=1e-6)  # logits


def test_token_advantages_broadcast_each_step_to_its_tokens(stages):
    token_advantages = stages["05_bppo"].token_advantages
    batch = {"action_step": torch.tensor([[-1, 0, 0, -1, 1, 1, -1], [-1, 0, -1, -1, -1, -1, -1]]),
             "step_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]])}
    adv = token_advantages(batch, torch.tensor([[0.5, -2.0], [3.0, 0.0]]))
    assert torch.equal(adv, torch.tensor([0.5, 0.5, -2.0, -2.0, 3.0]))  # one per reply token, row-major


def test_token_advantages_by_hand_rows_of_different_lengths(stages):
    """Three rows: one token for step 0 of row 0, three replies of one or two tokens in row 1, padding in row 2; A of
    each reply token in row-major order (what reply_logits keeps)."""
    token_advantages = stages["05_bppo"].token_advantages
    batch = {"action_step": torch.tensor([[-1, 0, -1, -1, -1, -1], [-1, 0, 0, 1, -1, 2], [-1, -1, 0, 0, -1, -1]]),
             "step_mask": torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])}
    step_adv = torch.tensor([[1.0, 9.0, 9.0], [2.0, 3.0, 4.0], [-5.0, 9.0, 9.0]])
    assert token_advantages(batch, step_adv).tolist() == [1.0, 2.0, 2.0, 3.0, 4.0, -5.0, -5.0]


def test_reply_logits_are_the_full_logits_at_the_reply_tokens(stages):
    """reply_logits (01 and 05) keeps, through transformers' logits_to_keep, exactly the rows of
    the full forward pass that predict a reply token, in row-major order."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    ep1 = {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "action_step": [-1, -1, 0, 0, -1, 1, 1, -1],
           "state_pos": [1, 4, 7], "action_pos": [3, 6]}
    ep2 = {"input_ids": [5, 6, 7, 8], "action_step": [-1, -1, 0, 0], "state_pos": [1, 3], "action_pos": [3]}
    b = stages["01_bc"].collate([ep1, ep2], pad_id=0)
    with torch.no_grad():
        full = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        for stage in ("01_bc", "05_bppo"):
            kept = stages[stage].reply_logits(model, b)
            want = torch.stack([full[0, 1], full[0, 2], full[0, 4], full[0, 5], full[1, 1], full[1, 2]])
            assert torch.allclose(kept, want, atol=1e-5), stage


def test_awr_only_raises_probabilities_of_data_actions(stages):
    awr_loss = stages["05_bppo"].awr_loss
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    awr_loss(logp, torch.tensor([2.0, -2.0]), torch.ones(2), 1.0, 20.0).backward()
    assert (logp.grad < 0).all()  # descent raises log-probs even for the negative-advantage action


def test_awr_weights_are_clipped_at_the_max_weight(stages):
    awr_loss = stages["05_bppo"].awr_loss
    # weights exp(0 / 1) = 1 and min(exp(5), 20) = 20: -(1 * -1 + 20 * -2) / 2
    loss = awr_loss(torch.tensor([-1.0, -2.0]), torch.tensor([0.0, 5.0]), torch.ones(2), 1.0, 20.0)
    assert loss.item() == pytest.approx(20.5)


def test_reply_matches_by_hand(stages):
    """Turn t counts as reproduced only if the argmax is right at every token of turn t."""
    collate, reply_matches = stages["01_bc"].collate, stages["01_bc"].reply_matches
    #            prompt   turn 0   obs  turn 1     (second episode: one turn)
    ep1 = {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "action_step": [-1, -1, 0, 0, -1, 1, 1, -1],
           "state_pos": [1, 4, 7], "action_pos": [3, 6]}
    ep2 = {"input_ids": [5, 6, 7, 8], "action_step": [-1, -1, 0, 0], "state_pos": [1, 3], "action_pos": [3]}
    b = collate([ep1, ep2], pad_id=0)
    V = 16
    perfect = torch.nn.functional.one_hot(b["input_ids"].roll(-1, dims=1), V).float()  # predicts token i+1 at i
    at_replies = lambda full: full[:, :-1][b["action_step"][:, 1:] >= 0]  # noqa: E731 (what reply_logits keeps)
    assert reply_matches(at_replies(perfect), b).tolist() == [[True, True], [True, False]]  # step 1 of ep2: padding
    wrong = perfect.clone()
    wrong[0, 5, :] = 0
    wrong[0, 5, 3] = 1  # position 5 predicts token 6 (turn 1's second token): now wrong
    assert reply_matches(at_replies(wrong), b).tolist() == [[True, False], [True, False]]
    wrong2 = perfect.clone()
    wrong2[1, 1, :] = 0
    wrong2[1, 1, 3] = 1  # episode 2, position 1 predicts token 2 (its turn 0's first token)
    assert reply_matches(at_replies(wrong2), b).tolist() == [[True, True], [False, False]]


def test_bc_loss_is_the_mean_nll_of_the_reply_tokens(stages):
    """01's L_BC: every reply token of the batch weighs the same."""
    logp = torch.log(torch.tensor([0.5, 0.25, 1.0]))
    loss, info = stages["01_bc"].bc_loss(logp)
    assert loss.item() == pytest.approx(-(np.log(0.5) + np.log(0.25)) / 3)
    assert info == {"loss": pytest.approx(loss.item())}


def test_bc_loss_gradient_is_minus_one_over_the_token_count(stages):
    """Descending L_BC raises every reply token's log-probability, each by the same step: dL/dlogp = -1/N."""
    logp = torch.log(torch.tensor([0.5, 0.5, 0.25, 0.125])).requires_grad_()
    loss, info = stages["01_bc"].bc_loss(logp)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.25] * 4)
    assert isinstance(info["loss"], float) and info["loss"] == pytest.approx(np.log(2) * 7 / 4)


def test_policy_loss_reports_clip_fractions_ratio_and_kl(stages):
    """05's policy_loss: the BPPO loss plus alpha * KL, and the diagnostics the stage prints, by hand."""
    pp = stages["05_bppo"]
    args = pp.parse_args(["--data", "d", "--policy", "p", "--ref", "r", "--out", "o", "--eps-low", "0.4"])  # alpha 0.05
    torch.manual_seed(0)
    logits = torch.randn(4, 3)  # (N, V) at the 4 reply tokens (positions 1-4)
    batch = {"input_ids": torch.tensor([[0, 1, 2, 0, 1]]), "action_step": torch.tensor([[-1, 0, 0, 1, 1]]),
             "step_mask": torch.tensor([[1.0, 1.0]]), "adv": torch.tensor([1.0, -1.0, 1.0, -1.0])}
    eta = torch.tensor([1.5, 0.5, 1.1, 0.7])  # token 1 is held by the upper clip, token 2 by the lower
    logp = pp.token_logprobs(logits, torch.tensor([1, 2, 0, 1]))
    loss, info = pp.policy_loss(logits, torch.log_softmax(logits, dim=-1), batch, logp - eta.log(), args)
    assert info["clip_high"] == pytest.approx(0.25) and info["clip_low"] == pytest.approx(0.25)
    assert info["ratio"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    assert info["approx_kl_old"] == pytest.approx(((eta - 1) - eta.log()).mean().item(), abs=1e-6)
    assert abs(info["kl_ref"]) < 1e-6  # pi_ref = pi_theta
    # min(eta A, clip(eta) A): 1.2 * 1, 0.6 * -1, 1.1 * 1, 0.7 * -1
    assert loss.item() == pytest.approx(-(1.2 - 0.6 + 1.1 - 0.7) / 4, abs=1e-6)
    assert info["loss"] == pytest.approx(loss.item())
    # pi_ref uniform: the same surrogate plus alpha * KL(pi_theta || pi_ref) > 0
    uniform = torch.log_softmax(torch.zeros(4, 3), dim=-1)
    loss_kl, info_kl = pp.policy_loss(logits, uniform, batch, logp - eta.log(), args)
    assert info_kl["kl_ref"] > 0 and loss_kl.item() == pytest.approx(loss.item() + 0.05 * info_kl["kl_ref"], abs=1e-6)


def test_take_step_labels_inside_the_rollout(stages):
    """02's take_step: a format error does not step the environment (FORMAT_ERROR_OBS, r_env 0); a
    command that does nothing is 'invalid'; one that changes nothing the agent sees is 'repeat'; the
    demonstrator's next command is 'ok'; r_aux is the label's."""
    import envs
    c = stages["02_collect"]
    aux = {"ok": 0.0, "invalid": -0.1, "repeat": -0.3, "format": -0.2}
    env = envs.make("household")
    obs, _ = env.reset(env.task_ids("train")[0])
    step, over, _ = c.take_step(env, "Thought: no command here", obs, aux)
    assert (step["label"], step["obs"], step["r_env"], step["r_aux"], step["action"], over) == \
        ("format", c.FORMAT_ERROR_OBS, 0.0, -0.2, "", False)
    step, _, _ = c.take_step(env, "Action: fly to the moon", obs, aux)
    assert step["label"] == "invalid" and step["r_aux"] == -0.1 and step["obs"] == "Nothing happens."
    text = env.expert_text()
    step, over, won = c.take_step(env, text, obs, aux)
    assert step["label"] == "ok" and step["text"] == text and step["action"] == c.parse_action(text)
    assert set(step) == {"text", "action", "obs", "r_env", "label", "r_aux", "done"}
    assert c.take_step(env, "Action: look", step["obs"], aux)[0]["label"] in ("repeat", "ok")
    while not over:  # the demonstrator to the end: the environment ends the episode, won, with its reward
        step, over, won = c.take_step(env, env.expert_text(), step["obs"], aux)
    assert step["done"] and step["r_env"] > 0 and won


def test_take_step_at_the_step_limit(stages):
    """The step limit ends the episode (over) but is not a terminal: done stays False, r_env 0, not won; every step
    before it goes on."""
    import envs
    c = stages["02_collect"]
    aux = {"ok": 0.0, "invalid": -0.1, "repeat": -0.3, "format": -0.2}
    env = envs.make("household", max_steps=3)
    obs, _ = env.reset(env.task_ids("train")[0])
    for t in range(3):
        step, over, won = c.take_step(env, "Action: fly to the moon", obs, aux)
        assert over == (t == 2) and not step["done"] and step["r_env"] == 0.0 and step["label"] == "invalid"
        obs = step["obs"]
    assert not won


def test_polyak_update_moves_the_target_a_fraction_of_the_way(stages):
    polyak_update = stages["03_critic"].polyak_update
    target, source = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        target.weight.fill_(1.0), target.bias.fill_(0.0), source.weight.fill_(3.0), source.bias.fill_(-1.0)
    polyak_update(target, source, 0.25)
    assert torch.allclose(target.weight, torch.full((1, 2), 1.5)) and torch.allclose(target.bias, torch.tensor([-0.25]))
    assert torch.allclose(source.weight, torch.full((1, 2), 3.0))  # the source is left as it was
    assert not target.weight.requires_grad or target.weight.grad is None


def test_polyak_update_by_hand_twice_and_at_the_ends(stages):
    """From 0 toward 4 at rate 0.5: 2, then 3; rate 1 copies the source, rate 0 leaves the target."""
    polyak_update = stages["03_critic"].polyak_update
    target, source = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        target.weight.fill_(0.0), source.weight.fill_(4.0)
    polyak_update(target, source, 0.5)
    assert target.weight.item() == pytest.approx(2.0)
    polyak_update(target, source, 0.5)
    assert target.weight.item() == pytest.approx(3.0) and source.weight.item() == 4.0
    polyak_update(target, source, 0.0)
    assert target.weight.item() == pytest.approx(3.0)
    polyak_update(target, source, 1.0)
    assert target.weight.item() == pytest.approx(4.0)


def test_old_logprobs_are_the_policys_reply_token_logprobs_per_trajectory(stages):
    """05's log pi_old: one tensor per trajectory, log pi of each of its reply tokens in order, whatever the
    batch it was computed in (three trajectories of different lengths, batches of 2); no gradient; the
    policy is left in training mode."""
    from transformers import LlamaConfig, LlamaForCausalLM
    b5 = stages["05_bppo"]
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    xs = [{"input_ids": [1, 2, 3, 4, 5, 6], "action_step": [-1, -1, 0, 0, -1, -1], "state_pos": [1, 5],
           "action_pos": [3]},
          {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "action_step": [-1, -1, 0, -1, -1, 1, 1, -1, -1],
           "state_pos": [1, 4, 8], "action_pos": [2, 6]},
          {"input_ids": [1, 7, 3, 9], "action_step": [-1, 0, -1, -1], "state_pos": [0, 3], "action_pos": [1]}]
    data = [({"steps": [{"adv": 0.5}] * len(x["action_pos"])}, x) for x in xs]
    policy.train()
    old = b5.old_logprobs(policy, data, 0, 2, torch.device("cpu"), None)
    assert policy.training and len(old) == 3
    for x, lp in zip(xs, old):
        b = b5.collate([x], 0)
        with torch.no_grad():
            want = b5.token_logprobs(policy(input_ids=b["input_ids"]).logits[0, :-1], b["input_ids"][0, 1:])
        assert not lp.requires_grad
        assert torch.allclose(lp, want[torch.tensor(x["action_step"][1:]) >= 0], atol=1e-5)


def test_old_logprobs_do_not_depend_on_the_batch_size(stages):
    """The same log pi_old per trajectory in batches of 1 and of 3 (shortest first, padded), each as long as its reply
    tokens, from a policy that starts in eval mode too."""
    from transformers import LlamaConfig, LlamaForCausalLM
    b5 = stages["05_bppo"]
    torch.manual_seed(1)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    xs = [{"input_ids": [1, 2, 3, 4, 5, 6, 7], "action_step": [-1, -1, 0, 0, 0, -1, -1], "state_pos": [1, 6],
           "action_pos": [4]},
          {"input_ids": [3, 4, 5], "action_step": [-1, 0, -1], "state_pos": [0, 2], "action_pos": [1]},
          {"input_ids": [9, 8, 7, 6, 5], "action_step": [-1, 0, -1, 1, -1], "state_pos": [0, 2, 4],
           "action_pos": [1, 3]}]
    data = [({"steps": [{"adv": 0.0}] * len(x["action_pos"])}, x) for x in xs]
    policy.eval()
    one, three = (b5.old_logprobs(policy, data, 0, n, torch.device("cpu"), None) for n in (1, 3))
    assert policy.training and [len(lp) for lp in one] == [3, 1, 2]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(one, three))
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([xs[1]["input_ids"]])).logits[0]
    assert one[1].item() == pytest.approx(torch.log_softmax(logits[0], -1)[4].item(), abs=1e-5)  # token 4 after 3


def test_05_adv_norm_centres_and_standardizes_over_the_buffer_by_hand(stages):
    """A = 1, -1 (episode 1), 0, 2 (episode 2): mean 0.5, population std sqrt(1.25)."""
    norm = stages["05_bppo"].normalize_advantages
    eps = [{"steps": [{"adv": 1.0, "x": 1}, {"adv": -1.0}]}, {"steps": [{"adv": 0.0}, {"adv": 2.0}]}]
    flat = lambda how: [s["adv"] for ep in norm(eps, how) for s in ep["steps"]]
    assert flat("none") == [1.0, -1.0, 0.0, 2.0]
    assert flat("center") == [0.5, -1.5, -0.5, 1.5]
    assert flat("standardize") == pytest.approx([x / 1.25 ** 0.5 for x in (0.5, -1.5, -0.5, 1.5)])
    assert norm(eps, "center")[0]["steps"][0]["x"] == 1 and eps[0]["steps"][0]["adv"] == 1.0  # a copy, fields kept


def test_held_out_episodes_never_reach_the_critics_loss(stages, tiny_run, tmp_path, in_process, monkeypatch):
    """03 --holdout 0.5: the episodes plumbing.held_out names are in no batch of the loss, every other one is."""
    from plumbing import held_out
    c3 = stages["03_critic"]
    eps = [json.loads(line) for line in open(tiny_run / "expert.jsonl")]
    for i, ep in enumerate(eps[:12]):
        ep.update(source="self", policy="p", seed=i)
    assert 0 < sum(held_out(ep, 0.5) for ep in eps) < 12 and not any(held_out(ep, 0.5) for ep in eps[12:])
    (tmp_path / "buf.jsonl").write_text("".join(json.dumps(ep) + "\n" for ep in eps))
    seen = []
    real = c3.trajectory_tensors
    monkeypatch.setattr(c3, "trajectory_tensors", lambda batch, device: seen.extend(batch) or real(batch, device))
    in_process(c3, "--data", tmp_path / "buf.jsonl", "--policy", tiny_run / "policy_0", "--out", tmp_path / "critic",
               "--epochs", 1, "--holdout", 0.5, "--threads", 1)
    key = lambda ep: (ep["task_id"], ep["seed"], ep["source"])
    assert {key(ep) for ep in seen} == {key(ep) for ep in eps if not held_out(ep, 0.5)}


def test_03_init_starts_from_the_given_critic_its_heads_too(stages, tiny_run, tmp_path, in_process):
    """03 --init CRITIC: the transformer and both heads start as CRITIC's (a learning rate of ~0 keeps them there);
    without it the heads start fresh; a policy directory as --init is refused in one line, exit 2."""
    from safetensors.torch import load_file
    c3 = stages["03_critic"]
    run = lambda out, *more, check=True: in_process(
        c3, "--data", tiny_run / "expert.jsonl", "--policy", tiny_run / "policy_0", "--out", tmp_path / out,
        "--epochs", 1, "--threads", 1, *more, check=check)
    run("first")
    run("warm", "--init", tmp_path / "first", "--lr", 1e-12)
    run("fresh", "--lr", 1e-12)
    w = {n: {**load_file(tmp_path / n / "heads.safetensors"), **load_file(tmp_path / n / "model.safetensors")}
         for n in ("first", "warm", "fresh")}
    same = lambda a, b: all(torch.allclose(w[a][k], w[b][k], atol=1e-6) for k in w["first"])
    assert same("warm", "first") and not same("fresh", "first")
    bad = run("bad", "--init", tiny_run / "policy_0", check=False)
    assert bad.returncode == 2 and "is not a critic directory" in bad.stderr and not (tmp_path / "bad").exists()


def test_heldout_report_and_the_view_of_a_mistake_by_hand():
    """04 on held-out kitchen episodes: explained variance on r_env returns, mean V and return, AUC, and V just after
    a harmful step (a flawed ingredient used) against just after a correct one, with the mean A at each; beside them
    the same figures of a given V* (the exact Bayes critic's place)."""
    from critic_report import heldout_report as report
    st = lambda action, r, v, adv, obs="Next: egg. You see egg 1 and rotten egg 2.": {
        "action": action, "r_env": r, "v": v, "adv": adv, "obs": obs}
    offer = "You are in the kitchen. Next: egg. You see egg 1 and rotten egg 2."
    eps = [{"env": "kitchen", "success": True, "obs0": offer,   # correct, then correct: success
            "steps": [st("use egg 1", 0.0, 0.5, 0.2), st("use egg 1", 1.0, 0.8, 0.1)]},
           {"env": "kitchen", "success": False, "obs0": offer,  # harmful, then correct: failure
            "steps": [st("use egg 2", 0.0, 0.4, -0.3), st("use egg 1", 0.0, 0.1, -0.1)]}]
    out = report(eps, 0.5)
    g, v = np.array([0.5, 1.0, 0.0, 0.0]), np.array([0.5, 0.8, 0.4, 0.1])
    assert out["explained_variance"] == pytest.approx(1 - np.var(g - v) / np.var(g))
    assert (out["v_mean"], out["ret_mean"], out["auc_v"]) == pytest.approx((0.45, 0.375, 1.0))
    assert (out["v_after_harmful"], out["v_after_correct"]) == pytest.approx((0.1, 0.8))  # last steps: terminal
    assert (out["adv_harmful"], out["adv_correct"], out["steps_harmful"], out["steps_correct"]) == \
        pytest.approx((-0.3, (0.2 + 0.1 - 0.1) / 3, 1, 3))
    assert (out["adv_harmful_std"], out["adv_correct_std"]) == pytest.approx((0.0, np.std([0.2, 0.1, -0.1])))
    assert out["v_gap"] == pytest.approx(0.1 - 0.8) and "bayes" not in out
    best = report(eps, 0.5, bayes=[[0.5, 1.0], [0.2, 0.0]])["bayes"]  # V* = g on the success: a gap of 0.0 - 1.0
    assert best["v_gap"] == pytest.approx(-1.0)
    assert best["explained_variance"] == pytest.approx(1 - np.var(g - [0.5, 1.0, 0.2, 0.0]) / np.var(g))
    double = report(eps, 0.5, bayes=[[1.0, 1.6], [0.8, 0.2]])  # V* = 2 V: the same order, twice the spread
    assert (double["corr_bayes"], double["spread_bayes"], double["spread_bayes_s0"]) == pytest.approx((1.0, 0.5, 0.5))
    flipped = report(eps, 0.5, bayes=[[-0.5, -0.8], [-0.4, -0.1]])  # V* = -V: the opposite order
    assert (flipped["corr_bayes"], flipped["spread_bayes"]) == pytest.approx((-1.0, 1.0))


def test_the_outcome_report_shows_its_credit_at_the_choices_too(capsys):
    """Course experiment 7 reads 04's `A_t at the self episodes' choices` for R - mean(R) beside the critic's: the
    outcome's report prints it as well (it once returned before it)."""
    from critic_report import show
    view = {f"{p}{k}{q}": x for k, (m, s, n) in {"harmful": (-0.5, 0.4, 2), "recoverable": (-0.2, 0.1, 1),
                                                 "correct": (0.1, 0.3, 5)}.items()
            for p, q, x in (("adv_", "", m), ("adv_", "_std", s), ("steps_", "", n))}
    show({"how": "R - mean(R)", "advantage": "outcome", "adv_mean_by_source": {"self": -0.1},
          "adv_mean_by_label": {"ok": 0.0}, "steps_by_label": {"ok": 8}, "mistakes_self": view}, "x.jsonl")
    assert ("A_t at the self episodes' choices (mean +- std): harmful -0.500 +- 0.400 (n=2), recoverable -0.200 +- "
            "0.100 (n=1), correct +0.100 +- 0.300 (n=5)") in capsys.readouterr().out
