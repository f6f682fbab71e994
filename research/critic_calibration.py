"""Is the critic's V calibrated? For each 04_gae.py output (episodes with 'v' and 'adv' on every
step) this compares, per data source, the mean V(s_t) with the mean Monte-Carlo return from s_t
(r_env + r_aux, discounted by gamma - what 03's V is trained toward), and reports where the
difference goes in GAE: the mean advantage of the *last* step of failed and of successful
episodes. An optimistic V (mean V far above the mean return: an expectile tau > 0.5, the W-IQL
weights that favour successful trajectories, too few passes for the terminal rewards to travel
back) turns into a large negative advantage on whatever action a failed episode happened to
take last. Run 04 on held-out episodes (e.g. the greedy `dev` evaluation) to read it out of sample.

    python research/critic_calibration.py runs/hb_s0/iter_1/adv.jsonl
    python 04_gae.py --data runs/hb_s0/eval/policy_0_dev.jsonl --critic runs/hb_s0/iter_1/critic --out /tmp/dev_adv.jsonl
    python research/critic_calibration.py /tmp/dev_adv.jsonl
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench._stages import load_stage  # noqa: E402

discounted_returns = load_stage("03_critic").discounted_returns  # the one 03's final report uses


def returns_to_go(steps, gamma):
    """Discounted return from every step of one episode, with the rewards 03 learns from."""
    return discounted_returns([s["r_env"] + s["r_aux"] for s in steps], gamma)


def calibration(episodes, gamma):
    """{source: {n_states, v_mean, ret_mean, bias, explained_variance, last_adv_failed, last_adv_success}}."""
    report = {}
    for src in sorted({ep.get("source", "self") for ep in episodes}):
        eps = [ep for ep in episodes if ep.get("source", "self") == src]
        v = np.array([s["v"] for ep in eps for s in ep["steps"]])
        ret = np.array([r for ep in eps for r in returns_to_go(ep["steps"], gamma)])
        last = {ok: [ep["steps"][-1]["adv"] for ep in eps if bool(ep["success"]) == ok] for ok in (False, True)}
        report[src] = {"n_states": len(v), "v_mean": float(v.mean()), "ret_mean": float(ret.mean()),
                       "bias": float(v.mean() - ret.mean()),
                       "explained_variance": float(1 - np.var(ret - v) / max(np.var(ret), 1e-8)),
                       "last_adv_failed": float(np.mean(last[False])) if last[False] else None,
                       "last_adv_success": float(np.mean(last[True])) if last[True] else None}
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="04_gae.py output JSONL files")
    p.add_argument("--gamma", type=float, default=0.95, help="discount (03's default)")
    args = p.parse_args(argv)
    fmt = lambda x: "-" if x is None else f"{x:+.3f}"  # noqa: E731
    for path in args.files:
        with open(path) as f:
            episodes = [json.loads(line) for line in f]
        for src, r in calibration(episodes, args.gamma).items():
            print(f"{path} {src}: {r['n_states']} states, mean V {r['v_mean']:+.3f} vs return {r['ret_mean']:+.3f} "
                  f"(bias {r['bias']:+.3f}), explained variance {r['explained_variance']:.3f}; A of the last step: "
                  f"failed episodes {fmt(r['last_adv_failed'])}, successful {fmt(r['last_adv_success'])}")


if __name__ == "__main__":
    main()
