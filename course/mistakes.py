"""The mistakes students make in each exercise, written as edits of the reference body: tests/test_course.py plants
each one into the reference and checks that the kit's tests of that exercise (course.md's check, `python grade.py -k
CHECK`) fail on it. course/TEACHER.md lists them (the same words) beside each exercise's hint. This file holds pieces
of the solutions: make_exercises.py never copies it into the kit.

    MISTAKES["04_gae.gae"] = [(what the student did, text of the reference body, what it becomes), ...]

Each text occurs exactly once in the body after the function's docstring (plant checks it)."""
import ast

MISTAKES = {
    "01_bc.tokenize_episode": [
        ("the reply's end-of-turn token left out of the reply",
         "last = bisect.bisect_left(ends, len(after))", "last = bisect.bisect_left(ends, len(after)) - 1"),
        ("s_t one token late: the reply's first token",
         "state_pos.append(first - 1)", "state_pos.append(first)"),
        ("s_T, the state after the last observation, left out",
         "state_pos.append(len(ids) - 1)", "pass"),
        ("the prompt's last token counted as the reply's first (off by one)",
         "action_step[first:last + 1] = [t] * (last + 1 - first)",
         "action_step[first - 1:last + 1] = [t] * (last + 2 - first)"),
        ("the prompt rendered without its generation prompt",
         "prompt, after = render(msgs[:2 + 2 * t], True)", "prompt, after = render(msgs[:2 + 2 * t], False)"),
    ],
    "01_bc.collate": [
        ("action_step padded with 0, a reply token of step 0, instead of -1",
         'pad("action_step", -1)', 'pad("action_step", 0)'),
        ("input_ids padded with 0 instead of pad_id", 'pad("input_ids", pad_id)', 'pad("input_ids", 0)'),
        ("the attention mask 1 on the padding too",
         "(torch.arange(ids.shape[1]) < n).long()", "torch.ones_like(ids)"),
        ("step_mask counted over the T+1 states instead of the T steps",
         'for k in ("input_ids", "action_pos")', 'for k in ("input_ids", "state_pos")'),
        ("step_mask left as integers, not float", "< t).float()", "< t).long()"),
    ],
    "01_bc.bc_loss": [
        ("the sum over tokens instead of the mean", "loss = -logp.mean()", "loss = -logp.sum()"),
        ("the wrong sign: the log-likelihood minimised", "loss = -logp.mean()", "loss = logp.mean()"),
        ("the probabilities' mean instead of the log-probabilities'", "loss = -logp.mean()",
         "loss = -logp.exp().mean()"),
    ],
    "02_collect.retro_label": [
        ("invalid checked before format (the precedence)",
         'if action is None:\n        return "format"\n    if invalid:\n        return "invalid"',
         'if invalid:\n        return "invalid"\n    if action is None:\n        return "format"'),
        ("repeat checked before invalid (the precedence)",
         'if invalid:\n        return "invalid"\n    if next_obs == prev_obs:\n        return "repeat"',
         'if next_obs == prev_obs:\n        return "repeat"\n    if invalid:\n        return "invalid"'),
        ("repeat when the observation changed (the comparison inverted)",
         "if next_obs == prev_obs:", "if next_obs != prev_obs:"),
        ("repeat judged from the command instead of the observations",
         "if next_obs == prev_obs:", "if next_obs == action:"),
    ],
    "02_collect.take_step": [
        ("the step labelled against the new observation twice (prev_obs lost)",
         "retro_label(action, prev_obs, obs, invalid)", "retro_label(action, obs, obs, invalid)"),
        ("done set when the step limit cuts the episode too (truncation taken for a terminal)",
         '"done": bool(terminated)', '"done": bool(terminated or truncated)'),
        ("the episode not over at the step limit", "return step, terminated or truncated,",
         "return step, terminated,"),
        ("r_aux of the wrong label (always ok's)", '"r_aux": aux[label]', '"r_aux": aux["ok"]'),
        ("a format error reads the previous observation instead of FORMAT_ERROR_OBS",
         "FORMAT_ERROR_OBS, 0.0", "prev_obs, 0.0"),
        ("the whole reply recorded as the action", '"action": action or ""', '"action": text'),
    ],
    "03_critic.step_weights": [
        ("t counted from 0 instead of 1", "torch.arange(1, T + 1,", "torch.arange(0, T,"),
        ("the outcome d left out", "(t / T + float(d))", "(t / T)"),
        ("the 0.5 scale left out", "(t / T + float(d)) * 0.5 + 0.5", "(t / T + float(d)) + 0.5"),
        ("the weights falling along the episode", "(t / T + float(d))", "((T + 1 - t) / T + float(d))"),
    ],
    "03_critic.expectile_loss": [
        ("the indicator flipped: 1(u > 0)", "(u < 0)", "(u > 0)"),
        ("tau and 1 - tau swapped", "torch.abs(tau - (u < 0).float())", "torch.abs(1 - tau - (u < 0).float())"),
        ("the weights ignored", "if weight is None:", "if True:"),
        ("divided by the count instead of the sum of the weights",
         "/ weight.sum().clamp(min=1e-8)", "/ weight.numel()"),
        ("no guard against an all-zero weight (0 / 0)", "weight.sum().clamp(min=1e-8)", "weight.sum()"),
        ("|u| instead of u^2", "* u ** 2", "* u.abs()"),
    ],
    "03_critic.weighted_mse": [
        ("the weights ignored: the plain mean", "(weight * u ** 2).sum() / weight.sum().clamp(min=1e-8)",
         "(u ** 2).mean()"),
        ("divided by the count instead of the sum of the weights",
         "/ weight.sum().clamp(min=1e-8)", "/ weight.numel()"),
        ("no guard against an all-zero weight (0 / 0)", "weight.sum().clamp(min=1e-8)", "weight.sum()"),
        ("u not squared", "(weight * u ** 2)", "(weight * u)"),
    ],
    "03_critic.trajectory_tensors": [
        ("the step limit not terminal: the last step's done left as the environment wrote it",
         'out["done"][i, n - 1] = out["mask"][i, :n] = 1.0', 'out["mask"][i, :n] = 1.0'),
        ("the mask 1 on the padding too", 'out["mask"][i, :n] = 1.0', 'out["mask"][i, :] = 1.0'),
        ("r_aux left out", 'for k in ("r_env", "r_aux", "done")', 'for k in ("r_env", "done")'),
        ("the width from the first trajectory instead of the longest",
         'T = max(len(ep["steps"]) for ep in episodes)', 'T = len(episodes[0]["steps"])'),
    ],
    "03_critic.iql_losses": [
        ("V(s_{t+1}) not detached: gradient through the TD target",
         "v_all[:, 1:].detach()", "v_all[:, 1:]"),
        ("V(s_t) and V(s_{t+1}) shifted by one",
         "v, v_next = v_all[:, :-1], v_all[:, 1:].detach()", "v, v_next = v_all[:, 1:], v_all[:, :-1].detach()"),
        ("the done mask left out of the TD target", 'gamma * (1.0 - traj["done"]) * v_next', "gamma * v_next"),
        ("L_V on V - Qbar: the sign of u flipped", "expectile_loss(q_target - v,", "expectile_loss(v - q_target,"),
        ("L_V against Q instead of the target head's Qbar", "expectile_loss(q_target - v,",
         "expectile_loss(q.detach() - v,"),
        ("r_aux added even without use_aux", '(traj["r_aux"] if use_aux else 0.0)', 'traj["r_aux"]'),
        ("L_Q without the step weights", "* v_next - q, weights)", '* v_next - q, traj["mask"])'),
        ("the target head run with gradient", "with torch.no_grad(), torch.autocast(",
         "with torch.autocast("),
    ],
    "03_critic.polyak_update": [
        ("rate and 1 - rate swapped", "lerp_(unsharded(p), rate)", "lerp_(unsharded(p), 1 - rate)"),
        ("target and source swapped: the Q head moves toward Qbar",
         "zip(target.parameters(), source.parameters())", "zip(source.parameters(), target.parameters())"),
        ("a copy: the rate ignored", "p_t.lerp_(unsharded(p), rate)", "p_t.copy_(unsharded(p))"),
    ],
    "04_gae.gae": [
        ("the done mask out of the recursion: A_t takes A_{t+1} across an episode's end",
         "gamma * lam * not_done[t] * running", "gamma * lam * running"),
        ("the done mask out of the bootstrap: V(s_{t+1}) after a terminal",
         "gamma * not_done * values[1:]", "gamma * values[1:]"),
        ("the loop run forwards", "reversed(range(len(deltas)))", "range(len(deltas))"),
        ("lambda left out of the recursion", "gamma * lam * not_done[t]", "gamma * not_done[t]"),
        ("V(s_t) and V(s_{t+1}) swapped", "values[1:] - values[:-1]", "values[:-1] - values[1:]"),
    ],
    "04_gae.episode_advantages": [
        ("the step limit not terminal: the last step's own done",
         'dones = [float(s["done"]) for s in ep["steps"][:-1]] + [1.0]',
         'dones = [float(s["done"]) for s in ep["steps"]]'),
        ("every step done", 'dones = [float(s["done"]) for s in ep["steps"][:-1]] + [1.0]',
         'dones = [1.0] * len(ep["steps"])'),
        ("r_aux added even without with_aux", '(s["r_aux"] if with_aux else 0.0)', 's["r_aux"]'),
        ("qv as Q(s_t, a_t) - V(s_{t+1})", "q - values[:-1]", "q - values[1:]"),
        ("v recorded as V(s_{t+1})", "v=float(values[t])", "v=float(values[t + 1])"),
    ],
    "05_bppo.token_advantages": [
        ("the first reply (step 0) missed: action_step > 0", 'reply = batch["action_step"] >= 0',
         'reply = batch["action_step"] > 0'),
        ("rows and steps swapped", 'step_adv[reply.nonzero()[:, 0], batch["action_step"][reply]]',
         'step_adv[batch["action_step"][reply], reply.nonzero()[:, 0]]'),
        ("one advantage per step, not per token", 'return step_adv[reply.nonzero()[:, 0], batch["action_step"][reply]]',
         'return step_adv[batch["step_mask"] > 0]'),
    ],
    "05_bppo.old_logprobs": [
        ("the policy left in eval mode", "    policy.train()\n", "    pass\n"),
        ("the trajectories stored in length order, not their own",
         'for j, lp in zip(idx,', 'for j, lp in zip(range(i, i + len(idx)),'),
        ("the tokens shifted by one: the logit's own position's token as its target",
         'b["input_ids"][b["action_step"] >= 0])', 'b["input_ids"][:, :-1][b["action_step"][:, 1:] >= 0])'),
    ],
    "05_bppo.bppo_loss": [
        ("the clip bounds swapped: 1 - eps_high and 1 + eps_low",
         "torch.clamp(eta, 1.0 - eps_low, 1.0 + eps_high)", "torch.clamp(eta, 1.0 - eps_high, 1.0 + eps_low)"),
        ("max instead of min of the two surrogates", "torch.minimum(eta * adv", "torch.maximum(eta * adv"),
        ("the ratio upside down: pi_old / pi_theta", "torch.exp(logp - logp_old)", "torch.exp(logp_old - logp)"),
        ("the dual clip on every token, not only where A < 0",
         "torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)",
         "torch.maximum(surrogate, dual_clip * adv)"),
        ("the dual clip as a min", "torch.maximum(surrogate, dual_clip * adv)",
         "torch.minimum(surrogate, dual_clip * adv)"),
        ("the mask ignored: the mean over padding too", "masked_mean(surrogate, mask)", "surrogate.mean()"),
        ("the wrong sign: the surrogate minimised", "return -masked_mean(", "return masked_mean("),
    ],
    "05_bppo.kl_to_ref": [
        ("the KL reversed: KL(pi_ref || pi_theta)", "(logq.exp() * (logq - logr))", "(logr.exp() * (logr - logq))"),
        ("the sum over tokens instead of the mean", ".sum(-1).mean()", ".sum()"),
        ("the mean over the vocabulary instead of the sum", ".sum(-1).mean()", ".mean(-1).mean()"),
        ("the logits taken for log-probabilities (no log_softmax)",
         "logq, logr = torch.log_softmax(x.float(), dim=-1), torch.log_softmax(r.float(), dim=-1)",
         "logq, logr = x.float(), r.float()"),
    ],
}


def plant(source, function, old, new):
    """`source` (a stage file's text) with `old` replaced by `new` in the body of top-level `function` (after its
    docstring), where `old` must occur exactly once."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == function)
    lines = source.splitlines(keepends=True)
    head, body, tail = (lines[:node.body[0].end_lineno], lines[node.body[0].end_lineno:node.end_lineno],
                        lines[node.end_lineno:])
    body = "".join(body)
    if body.count(old) != 1:
        raise ValueError(f"{function}: {old!r} occurs {body.count(old)} times in its body, not once")
    return "".join(head) + body.replace(old, new) + "".join(tail)
