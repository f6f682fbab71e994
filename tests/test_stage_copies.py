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
    allowed = {"argparse", "bisect", "copy", "json", "math", "os", "random", "shutil", "sys", "time",
               "collections", "numpy", "torch", "tqdm", "transformers", "safetensors", "tokenizers", "envs"}
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
