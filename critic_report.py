"""What the critic learned, in numbers a student can read: 04_gae.py's report, in a module of its own.

Every explained variance and mean return here is of one return, the discounted return-to-go on what the task pays,

    g_t = r_env_t + gamma * g_{t+1}      (r_aux, the labels' penalties, left out; g_T = 0)

read against V(s_t): 1 - Var(g - V) / Var(g) (1 = V predicts all of it, 0 = no better than a constant). Where the
world can tell a mistake (envs.judge) the report reads V just after it; where it has an exact Bayes critic
(envs.bayes_critic: kitchen) it prints that critic's figures on the same held-out episodes, the best any critic can
do there, and the learned critic's share of them.

    python critic_report.py runs/default/iter_1/adv.jsonl     # the report of a buffer 04 wrote, again
"""
import os
from collections import defaultdict

import numpy as np

import envs
from plumbing import STEP_KEYS, Parser, die, held_out, parse_env_kwargs, read_episodes, read_json

VERDICTS = ("harmful", "recoverable", "correct")  # envs.judge's words: a lasting mistake, one undone, the good item


def returns(ep, gamma):
    """g_t for t = 0..T-1 of one episode (the docstring's return)."""
    g, out = 0.0, []
    for s in reversed(ep["steps"]):
        g = s["r_env"] + gamma * g
        out.append(g)
    return out[::-1]


def explained_variance(v, g):
    """1 - Var(g - V) / Var(g), or NaN when every return is the same (nothing to explain)."""
    v, g = np.asarray(v, dtype=np.float64), np.asarray(g, dtype=np.float64)
    return float(1 - np.var(g - v) / np.var(g)) if np.var(g) > 1e-12 else float("nan")


def auc(scores, labels):
    """Probability that a random positive scores above a random negative, ties counting 1/2
    (the Mann-Whitney statistic, from the average ranks of the scores)."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    n_pos, n_neg = labels.sum(), (~labels).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based rank, averaged over ties
    rank_sum = avg_rank[inverse][labels].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def verdicts(ep):
    """envs.judge of each step of an episode, on the observation before it: a verdict or None (nothing to tell)."""
    prev = [ep["obs0"]] + [s["obs"] for s in ep["steps"]]
    return [envs.judge(ep["env"], prev[t], s["action"]) for t, s in enumerate(ep["steps"])]


def mistake_view(episodes, values=None):
    """Where the world can tell a mistake (verdicts): per verdict, V just after the step (values: each episode's V
    list, else the critic's "v"), the mean A_t there and its spread, how many steps."""
    after, adv = defaultdict(list), defaultdict(list)
    for i, ep in enumerate(episodes):
        v = values[i] if values is not None else [s["v"] for s in ep["steps"]]
        for t, (s, verdict) in enumerate(zip(ep["steps"], verdicts(ep))):
            if verdict:
                adv[verdict].append(s.get("adv", float("nan")))
                if t + 1 < len(ep["steps"]):  # V(s_{t+1}); the last step's next state is terminal
                    after[verdict].append(v[t + 1])
    mean = lambda x: float(np.mean(x)) if len(x) else float("nan")
    return {**{f"v_after_{k}": mean(after[k]) for k in VERDICTS}, **{f"adv_{k}": mean(adv[k]) for k in VERDICTS},
            **{f"adv_{k}_std": float(np.std(adv[k])) if adv[k] else float("nan") for k in VERDICTS},
            **{f"steps_{k}": len(adv[k]) for k in VERDICTS}}


def heldout_report(episodes, gamma, bayes=None):
    """The critic on self episodes it never trained on (03 --holdout), where it can fail as it would on the policy's
    next states: the explained variance of g_t by V(s_t), mean V against mean g_t (V far above it: GAE blames most
    steps), the AUC of V(s_t) for the episode's success over every state, its view of a mistake (mistake_view) and
    the V gap after one (V after a harmful step - after a correct one); with bayes (each episode's V*), the same two
    figures of the exact Bayes critic, and V's correlation with V* and its spread (std V / std V*; also at s_0)."""
    v = np.array([s["v"] for ep in episodes for s in ep["steps"]])
    g = np.concatenate([returns(ep, gamma) for ep in episodes])
    won = np.array([ep["success"] for ep in episodes for _ in ep["steps"]], dtype=bool)
    view = mistake_view(episodes)
    out = {"episodes": len(episodes), "explained_variance": explained_variance(v, g), "v_mean": float(v.mean()),
           "ret_mean": float(g.mean()), "auc_v": auc(v, won), **view,
           "v_gap": view["v_after_harmful"] - view["v_after_correct"]}
    if bayes is not None:
        best = mistake_view(episodes, bayes)
        b = np.concatenate(bayes)  # does V order the states as V* does (corr), and how far apart (spread)?
        out["bayes"] = {"explained_variance": explained_variance(b, g),
                        "v_gap": best["v_after_harmful"] - best["v_after_correct"]}
        spread = lambda x, y: float(np.std(x) / np.std(y)) if np.std(y) > 1e-12 else float("nan")  # V* flat: NaN
        out["corr_bayes"], out["spread_bayes"] = float(np.corrcoef(v, b)[0, 1]), spread(v, b)
        out["spread_bayes_s0"] = spread([ep["steps"][0]["v"] for ep in episodes], [vs[0] for vs in bayes])
    return out


def advantage_report(episodes, gamma):
    """Do V and the process rewards make sense, on the episodes the critic trained on? The explained variance of g_t
    by V; V, Q and g_t by source (V far above the return is optimistic: GAE then blames the last steps of failed
    episodes); the mean A_t by source and by label (invalid, format, repeat below ok; self below expert); the AUC
    of V(s_t) for the self episodes' success at s_0..s_3 and over every state (0.5 = none, 1 = perfect)."""
    by_source, by_label, critic = defaultdict(list), defaultdict(list), defaultdict(list)
    for ep in episodes:
        for s, g in zip(ep["steps"], returns(ep, gamma)):
            critic[ep["source"]].append((s["v"], s["q"], g))
            by_source[ep["source"]].append(s["adv"])
            by_label[s["label"]].append(s["adv"])
    vqg = {src: np.array(rows) for src, rows in sorted(critic.items())}  # (steps, 3): V, Q, g_t
    v, g = np.concatenate(list(vqg.values()))[:, [0, 2]].T
    own = [ep for ep in episodes if ep["source"] != "expert"]
    return {"explained_variance": explained_variance(v, g),
            "critic_by_source": {src: {"v_mean": float(np.mean(x[:, 0])), "v_std": float(np.std(x[:, 0])),
                                       "q_mean": float(np.mean(x[:, 1])), "q_std": float(np.std(x[:, 1])),
                                       "ret_mean": float(np.mean(x[:, 2]))} for src, x in vqg.items()},
            "adv_mean_by_source": {k: float(np.mean(v)) for k, v in sorted(by_source.items())},
            "adv_mean_by_label": {k: float(np.mean(v)) for k, v in sorted(by_label.items())},
            "steps_by_label": {k: len(v) for k, v in sorted(by_label.items())},
            "auc_v_self_by_step": [auc([ep["steps"][t]["v"] for ep in own if len(ep["steps"]) > t],
                                       [ep["success"] for ep in own if len(ep["steps"]) > t]) for t in range(4)],
            "auc_v_self_every_state": auc([s["v"] for ep in own for s in ep["steps"]],
                                          [ep["success"] for ep in own for s in ep["steps"]])}


def report(episodes, gamma, holdout, env_kwargs):
    """04's summary of a critic's buffer (every step with "v", "q" and "adv"): advantage_report on the episodes the
    critic trained on, heldout_report on the self episodes 03 --holdout kept out (None if none), with the exact
    Bayes critic where the world has one (its policy estimated from every self episode; env_kwargs: the world's
    knobs, None: unknown), and the view of a mistake over every self episode."""
    own = [ep for ep in episodes if ep["source"] == "self"]
    unseen = [ep for ep in own if held_out(ep, holdout)]
    try:  # a hand-edited summary's world out of range is one line (in 04 too), not a division by zero
        bayes = envs.bayes_critic(own[0]["env"], own, unseen, gamma, env_kwargs) if unseen and env_kwargs is not None \
            else None
    except ValueError as e:
        die(f"the self episodes' summary names a world that cannot be made ({e}); it may have been edited")
    return {**advantage_report([ep for ep in episodes if not held_out(ep, holdout)], gamma),
            "heldout": heldout_report(unseen, gamma, bayes) if unseen else None, "mistakes_self": mistake_view(own)}


def show(summary, out):
    """Print the report in a few lines, the figures docs/printout.md explains."""
    f = lambda x, spec="+.3f": "n/a" if x != x else format(x, spec)  # NaN: no such step, or one class only
    evf = lambda x: "n/a (every return equal)" if x != x else f"{x:.3f}"  # explained_variance: nothing to explain
    lab = "  ".join(f"{k} {v:+.3f} (n={summary['steps_by_label'][k]})" for k, v in summary["adv_mean_by_label"].items())
    ret = "" if summary["advantage"] == "outcome" else (f"; return = the discounted return-to-go on r_env (gamma "
                                                        f"{summary['gamma']:g})")
    print(f"04_gae: A_t = {summary['how']}{ret}\n"
          f"04_gae: mean A_t by source: " + "  ".join(f"{k} {v:+.3f}" for k, v in summary["adv_mean_by_source"].items())
          + f"\n04_gae: mean A_t by label:  {lab}")
    view = summary["mistakes_self"]
    if view["steps_correct"]:  # the credit world's verdicts: the outcome's A_t too (course experiment 7)
        print("04_gae: A_t at the self episodes' choices (mean +- std): " + ", ".join(
            f"{k} {f(view[f'adv_{k}'])} +- {f(view[f'adv_{k}_std'], '.3f')} (n={view[f'steps_{k}']})"
            for k in VERDICTS))
    if summary["advantage"] == "outcome":
        return print(f"04_gae: -> {out}")
    crit = "  ".join(f"{k} V {c['v_mean']:+.3f}+-{c['v_std']:.3f} Q {c['q_mean']:+.3f}+-{c['q_std']:.3f} (return "
                     f"{c['ret_mean']:+.3f})" for k, c in summary["critic_by_source"].items())
    aucs = ", ".join(f"s_{t} {f(a, '.3f')}" for t, a in enumerate(summary["auc_v_self_by_step"]))
    print(f"04_gae: in-sample, explained variance of the return {evf(summary['explained_variance'])}; {crit}\n"
          f"04_gae: AUC of V(s_t) for a self episode's success: {aucs}, every state "
          f"{f(summary['auc_v_self_every_state'], '.3f')} (n/a: one class only)")
    h = summary["heldout"]
    if h:
        best = h.get("bayes") or {}
        ev, gap = evf(h["explained_variance"]), f(h["v_gap"])
        if best:
            ev += f", the exact Bayes critic's {evf(best['explained_variance'])}" + share(
                h["explained_variance"], best["explained_variance"])
            gap += f", Bayes {f(best['v_gap'])}" + share(h["v_gap"], best["v_gap"])
        print(f"04_gae: held out ({h['episodes']} self episodes 03 never trained on): explained variance {ev}; "
              f"mean V {h['v_mean']:+.3f} against a return of {h['ret_mean']:+.3f}; AUC {f(h['auc_v'], '.3f')}")
        if h["steps_harmful"] and h["steps_correct"]:
            print(f"04_gae: held out, V after a harmful step - after a correct one: {gap}")
        if best:
            print(f"04_gae: held out, V against the Bayes critic's V*: correlation {h['corr_bayes']:.2f}, spread "
                  f"{h['spread_bayes']:.2f} (std V / std V*; before the first step {h['spread_bayes_s0']:.2f})")
        if not h["explained_variance"] >= 0.1 or not h["auc_v"] > 0.6:
            print("04_gae: warning: on episodes it never saw the critic barely beats a constant (explained variance "
                  "< 0.1 or AUC <= 0.6): its step credit here is mostly noise")
    print(f"04_gae: -> {out}")


def share(mine, best):
    """' (mine / best of it)': the critic's figure as a share of the exact Bayes critic's; '' where the Bayes
    figure is NaN or under 0.01 in size (a world whose held-out returns the Bayes critic barely explains: a share of
    nearly nothing is noise, e.g. -20.71)."""
    return f" ({mine / best:.2f} of it)" if best == best and abs(best) >= 0.01 else ""


def env_kwargs_of(paths):
    """The world's knobs that 02 wrote the self episodes in (the .json summary beside a buffer file), or None."""
    for path in paths:
        args = (read_json(path[:-1] if path.endswith(".jsonl") else path + ".json") or {}).get("args") or {}
        if args.get("policy") not in (None, "expert") and isinstance(args.get("env_kwargs"), str):
            return parse_env_kwargs(args["env_kwargs"])
    return None


def in_run(buffer, out):
    """Where a path 04's summary names lies now. 04 named its paths as given, from the folder it ran in, and --out
    among them: a relative path lies where it lay beside --out, so beside the buffer, which is read in place, through a
    link, moved or copied with its run. An absolute path stays."""
    here = os.path.dirname(os.path.realpath(buffer))
    there = os.path.dirname(os.path.abspath(out)) if isinstance(out, str) and out and not os.path.isabs(out) else None
    return lambda path: os.path.join(here, os.path.relpath(path, there)) if there and not os.path.isabs(path) else path


def report_of(buffer):
    """The summary 04 wrote beside `buffer` (its FILE.json), its report computed anew from the buffer's steps (the
    figures this module computes today, the exact Bayes critic included): what `python critic_report.py` prints.
    Paths the summary names are found beside the buffer (in_run). A summary that is not 04's (a hand edit: no args,
    a gamma that is not a number, a world out of range) is one line."""
    summary = read_json(buffer[:-1]) if buffer.endswith(".jsonl") else None
    if not summary or summary.get("stage") != "04_gae":
        die(f"{buffer}: not a buffer of 04_gae.py " + (f"(its summary {buffer[:-1]} is missing or not 04's)"
                                                       if buffer.endswith(".jsonl") else
                                                       "(the .jsonl 04 wrote, its summary FILE.json beside it)"))
    args = summary.get("args")
    gamma = summary.get("gamma")
    if not (isinstance(args, dict) and isinstance(args.get("data"), list) and all(isinstance(p, str) for p in args[
            "data"]) and isinstance(args.get("critic"), (str, type(None))) and isinstance(gamma, (int, float)) and
            not isinstance(gamma, bool) and 0 <= gamma <= 1 and isinstance(summary.get("advantage"), str)):
        die(f"{buffer[:-1]}: not a summary of 04_gae.py as it writes one (its args with data and critic, a gamma in "
            "[0, 1], its advantage); run 04_gae.py again to write it")
    where = in_run(buffer, args.get("out"))
    critic = args["critic"]
    holdout = (read_json(os.path.join(where(critic), "args.json")) or {}).get("holdout", 0.0) if critic else 0.0
    episodes = read_episodes([buffer], {**STEP_KEYS, "v": float, "q": float, "adv": float})
    world = env_kwargs_of([where(p) for p in args["data"]])
    how = {"qv": "Q - V", "outcome": "R - mean(R)"}.get(summary["advantage"], "GAE on r_env" + " + r_aux" * bool(
        summary.get("with_aux")))  # a summary 04 wrote before it named it
    try:
        return {"how": how, **summary, **report(episodes, gamma, holdout, world)}
    except (ValueError, TypeError, KeyError) as e:  # a world its self episodes' summary names that cannot be made
        die(f"{buffer}: cannot report on it ({e}); its summaries may have been edited")


def main():
    p = Parser(description="04_gae.py's report of a buffer it wrote, printed again (with the exact "
                                            "Bayes critic where the world has one).")
    p.add_argument("buffer", help="the JSONL 04_gae.py wrote (e.g. runs/default/iter_1/adv.jsonl)")
    buffer = p.parse_args().buffer
    show(report_of(buffer), buffer)


if __name__ == "__main__":
    main()
