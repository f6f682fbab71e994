"""Helpers copied between stage files (CleanRL style) must stay byte-identical."""
import ast
import os

from conftest import ROOT, STAGES


def top_level_sources():
    out = {}
    for name in STAGES:
        src = open(os.path.join(ROOT, f"{name}.py")).read()
        for node in ast.parse(src).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in ("main", "parse_args"):
                out.setdefault(node.name, {})[name] = ast.get_source_segment(src, node)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                out.setdefault(node.targets[0].id, {})[name] = ast.get_source_segment(src, node)
    return out


def test_copied_helpers_are_identical():
    copies = {k: v for k, v in top_level_sources().items() if len(v) > 1}
    assert {"die", "read_episodes", "tokenize_episode", "collate", "Critic"} <= set(copies)
    for name in ("tokenize_episode", "collate", "Critic"):  # 02 copies them for --rerank
        assert {"02_collect", "03_critic", "04_gae"} <= set(copies[name]), name
    for name, by_file in copies.items():
        first = next(iter(by_file.values()))
        drifted = [f for f, s in by_file.items() if s != first]
        assert not drifted, f"{name} differs between {', '.join(by_file)}"


def test_stages_import_no_other_stage():
    allowed = {"argparse", "bisect", "copy", "json", "math", "os", "random", "re", "resource", "shutil", "sys", "time",
               "collections", "numpy", "torch", "tqdm", "transformers", "safetensors", "tokenizers", "envs",
               "peft"}  # peft: optional, imported only under --lora (01, 05)
    for name in STAGES:
        tree = ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module]
            else:
                continue
            for m in mods:
                assert m.split(".")[0] in allowed, f"{name} imports {m}"


def test_stages_carry_only_the_helpers_they_call():
    """Every top-level function, class and constant of a stage is reachable from its main()."""
    for name in STAGES:
        tree = ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())
        defs = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defs[node.name] = node
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                defs[node.targets[0].id] = node
        reached, todo = set(), ["main"]
        while todo:
            d = todo.pop()
            if d in reached or d not in defs:
                continue
            reached.add(d)
            todo += [n.id for n in ast.walk(defs[d]) if isinstance(n, ast.Name) and n.id in defs]
        assert not set(defs) - reached, f"{name} defines what it never calls: {sorted(set(defs) - reached)}"


def test_the_algorithm_comes_before_the_plumbing():
    """main() comes before the plumbing banner, and every copied helper other than the data
    contract (and the Critic, which 03 trains) comes after it."""
    copies = {k for k, v in top_level_sources().items() if len(v) > 1}
    above = {"episode_messages", "tokenize_episode", "collate", "reply_logits", "token_logprobs", "Critic"}
    for name in STAGES:
        src = open(os.path.join(ROOT, f"{name}.py")).read()
        banner = [i for i, line in enumerate(src.splitlines(), 1)
                  if line.startswith("# Plumbing identical in every stage")]
        assert len(banner) == 1, name
        for node in ast.parse(src).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for n in names:
                if n == "main":
                    assert node.lineno < banner[0], name
                elif n in copies and n not in above:
                    assert node.lineno > banner[0], f"{name}: {n} is copied plumbing, above the banner"
