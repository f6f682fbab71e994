"""The stage files share their plumbing through three modules (plumbing.py; machine.py and distributed.py: how they
run) and copy, byte-identical, only what a reader should see in each: the data contract and the Critic. No support
module imports a stage."""
import ast
import os

import pytest

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
    assert {"episode_messages", "tokenize_episode", "collate", "Critic"} <= set(copies)
    for name in ("tokenize_episode", "collate", "Critic"):  # 03 writes a critic, 04 reads it
        assert {"03_critic", "04_gae"} <= set(copies[name]), name
    for name, by_file in copies.items():
        first = next(iter(by_file.values()))
        drifted = [f for f, s in by_file.items() if s != first]
        assert not drifted, f"{name} differs between {', '.join(by_file)}"


def test_stages_import_no_other_stage():
    allowed = {"argparse", "bisect", "copy", "json", "math", "os", "random", "re", "resource", "shutil", "sys", "time",
               "collections", "numpy", "torch", "tqdm", "transformers", "safetensors", "tokenizers", "envs",
               "peft",  # peft: optional, imported only under --lora (01, 05)
               "plumbing", "machine", "distributed",  # the shared plumbing, the machine, torchrun: no algorithm
               "kv_cache", "rerank", "rollout",  # 02's speed-ups and its --rerank extension, off the reading path
               "critic_report",  # 04's printout: diagnostics, off the reading path
               "models"}  # models/tiny.py: the tiny model's tokenizer and Llama (00, 01)
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
        called = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for cls in (d for d in defs.values() if isinstance(d, ast.ClassDef)):  # a copied class: only the methods called
            unused = [m.name for m in cls.body if isinstance(m, ast.FunctionDef)
                      and not m.name.startswith("__") and m.name != "forward" and m.name not in called]
            assert not unused, f"{name}: {cls.name} carries methods the stage never calls: {unused}"


def test_no_stage_redefines_the_plumbing():
    """What plumbing.py, machine.py and distributed.py define, a stage imports instead of copying."""
    for module in ("plumbing.py", "machine.py", "distributed.py"):
        tree = ast.parse(open(os.path.join(ROOT, module)).read())
        shared = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for name, by_file in top_level_sources().items():
            assert name not in shared, f"{name} is in {module} and copied into {', '.join(by_file)}"


def stages_imported(path):
    """The stages a file imports: by an import statement or by importlib.import_module("NAME")."""
    names = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return names & set(STAGES)


def test_no_support_module_imports_a_stage():
    """The stages import the support modules, never the other way round: run_support.py checks run_all.sh's *_ARGS by
    the stages' parse_args in a child process. The one exception is an extension: rerank.py (02 --rerank) reads the
    critic with 04's own code."""
    for path in ("plumbing.py", "machine.py", "distributed.py", "run_support.py", "critic_report.py", "rollout.py",
                 "kv_cache.py"):
        assert not stages_imported(path), f"{path} imports {stages_imported(path)}"
    assert stages_imported("rerank.py") == {"04_gae"}  # the check sees an import_module too


LOSS = {"00_pretrain": "lm_loss", "01_bc": "bc_loss", "02_collect": "retro_label", "03_critic": "expectile_loss",
        "04_gae": "gae", "05_bppo": "bppo_loss"}


def test_the_algorithm_comes_first():
    """A reader meets the stage's equation within ~the first 120 lines, then main(); the copied data
    contract comes after main()."""
    for name in STAGES:
        tree = ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())
        line = {n.name: n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert line[LOSS[name]] <= 130 and line[LOSS[name]] < line["main"], name
        for contract in ("episode_messages", "tokenize_episode", "collate"):
            assert line.get(contract, line["main"] + 1) > line["main"], f"{name}: {contract} comes before main()"


def test_help_leads_with_the_algorithm(stages, capsys):
    """Each stage's --help: the algorithm's flags first, then data and files, then the machine's (argparse groups)."""
    for name, module in stages.items():
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        out = capsys.readouterr().out
        starts = [out.index(f"\n{group}:\n") for group in ("the algorithm", "data and files", "the machine")]
        assert starts == sorted(starts), name
        assert "--seed" in out[starts[0]:starts[1]] and "--out" in out[starts[1]:starts[2]], name
        assert "--threads" in out[starts[2]:], name


def test_the_import_graph_has_no_cycle():
    """No module of the checkout imports a module that imports it, directly or through others (distributed.py once
    took plumbing.die inside a function while plumbing imported it): every `import`, at the top or inside a function,
    and importlib.import_module("NAME"), between the checkout's modules (its .py files and packages)."""
    import glob
    files = [f for f in glob.glob("**/*.py", root_dir=ROOT, recursive=True)
             if not f.startswith((".venv", "tests", "runs", ".git"))]
    name = {f: f[:-3].replace(os.sep, ".").removesuffix(".__init__") for f in files}
    modules = set(name.values())

    def local(mod):  # the checkout's module a dotted import names, if any ("envs.kitchen" -> itself, "torch" -> None)
        while mod and mod not in modules:
            mod = mod.rpartition(".")[0]
        return mod or None

    graph = {}
    for f in files:
        edges = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read())):
            if isinstance(node, ast.Import):
                edges |= {local(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                edges |= {local(node.module)} | {local(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                edges.add(local(node.args[0].value))
        graph[name[f]] = edges - {None, name[f]}
    assert graph["plumbing"] >= {"distributed"} and "rerank" in graph and graph["rerank"] >= {"04_gae"}

    def cycle_from(start):  # a path start -> ... -> start, or None (depth first)
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None
    cycles = [c for c in map(cycle_from, sorted(graph)) if c]
    assert not cycles, cycles


def test_each_training_step_reads_forward_loss_backward_clip_step_in_its_stage():
    """In every stage that trains (and ETO's), main() holds the step in this order: parts() (torchrun's bookkeeping
    and --grad-accum's micro-batches, behind one call), the forward and loss (batch_loss), backward(), the clip, the
    optimizer's step. Stage files stay at most 300 lines, each main() at most 50."""
    for name in STAGES + ["eto"]:
        src = open(os.path.join(ROOT, f"{name}.py")).read()
        main = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "main")
        assert main.end_lineno - main.lineno + 1 <= 50, f"{name}: main() has {main.end_lineno - main.lineno + 1} lines"
        assert name == "eto" or len(src.splitlines()) <= 300, f"{name}.py has {len(src.splitlines())} lines"
        if name in ("02_collect", "04_gae"):
            continue
        calls = sorted((n.lineno, n.col_offset, ast.get_source_segment(src, n.func)) for n in ast.walk(main)
                       if isinstance(n, ast.Call))
        order = [c for _, _, c in calls if c in ("parts", "batch_loss", "torch.nn.utils.clip_grad_norm_",
                                                 "optimizer.step") or c.endswith(".backward")]
        assert [c if not c.endswith(".backward") else "backward" for c in order] == \
            ["parts", "batch_loss", "backward", "torch.nn.utils.clip_grad_norm_", "optimizer.step"], (name, order)
