"""Where do a policy's episodes go wrong? Reads episode JSONL files written by 02_collect.py
(household) and prints, per file: how many episodes stayed clean (every step labelled "ok")
and how many of those succeeded; how many made at least one mistake and how many of those
still succeeded (recovered); and what the *first* mistake of each episode was.

First-mistake categories (household; other envs fall back to the command's first word):
    take: object not in last obs   take O from X, and no O of that type was in the last observation
    take: object in last obs       take O from X with that object type in view (wrong number / place)
    go: receptacle not in room     go to X, X is not among the receptacles listed at the start
    go: already there              go to X while standing at X
    format                         no parsable "Action:" line
    <verb>                         any other invalid / repeated command, by its first word

    python research/failure_modes.py runs/seed0/eval/policy_0_seen.jsonl runs/seed0/iter_1/self.jsonl
"""
import argparse
import collections
import json
import re


def first_mistake(episode):
    """(step index, category) of the first step not labelled "ok", or None for a clean episode."""
    rooms = set(re.findall(r"\ban? ([a-z]+ \d+)", episode["obs0"]))
    location, last_obs = None, episode["obs0"]
    for t, step in enumerate(episode["steps"]):
        action = step["action"] or ""
        if step["label"] != "ok":
            if step["label"] == "format" or not action:
                return t, "format"
            if action.startswith("go to "):
                target = action[len("go to "):]
                if target == location:
                    return t, "go: already there"
                return t, "go: receptacle not in room" if target not in rooms else "go: other"
            if action.startswith("take ") and " from " in action:
                kind = action[len("take "):].split(" from ")[0].rsplit(" ", 1)[0]
                return t, "take: object in last obs" if re.search(rf"\b{re.escape(kind)} \d", last_obs) \
                    else "take: object not in last obs"
            return t, action.split()[0]
        if action.startswith("go to ") and step["obs"].startswith("You arrive"):
            location = action[len("go to "):]
        last_obs = step["obs"]
    return None


def summarize(episodes):
    firsts = [first_mistake(e) for e in episodes]
    clean = [e for e, f in zip(episodes, firsts) if f is None]
    mistaken = [e for e, f in zip(episodes, firsts) if f is not None]
    kinds = collections.Counter(f[1] for f in firsts if f is not None)
    return {
        "episodes": len(episodes), "success": sum(e["success"] for e in episodes),
        "clean": len(clean), "clean_success": sum(e["success"] for e in clean),
        "mistaken": len(mistaken), "recovered": sum(e["success"] for e in mistaken),
        "first_mistake": dict(kinds.most_common()),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="episode JSONL files (02_collect.py output)")
    args = p.parse_args()
    print("| file | success | clean episodes: success | with a mistake: success (recovered) | first mistake |")
    print("|---|---|---|---|---|")
    for path in args.files:
        with open(path) as f:
            s = summarize([json.loads(line) for line in f if line.strip()])
        kinds = ", ".join(f"{k} {n}" for k, n in s["first_mistake"].items())
        print(f"| {path} | {s['success']}/{s['episodes']} | {s['clean_success']}/{s['clean']} "
              f"| {s['recovered']}/{s['mistaken']} | {kinds} |")


if __name__ == "__main__":
    main()
