"""Stage 02 end to end, and the stages' handling of bad input (docs/design.md, 'Conventions')."""
import argparse
import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, StaticCache

import kv_cache
from conftest import run_stage

EPISODE_FIELDS = {"env", "task_id", "split", "source", "policy", "seed", "instruction", "task", "obs0",
                  "steps", "reward", "success", "truncated"}
STEP_FIELDS = {"text", "action", "obs", "r_env", "label", "r_aux", "done"}

HOUSEHOLD = ["--env", "household", "--env-kwargs"]  # a step limit (max_steps): household's keyword


def check_schema(path):
    eps = [json.loads(line) for line in open(path)]
    for ep in eps:
        assert set(ep) == EPISODE_FIELDS
        assert ep["steps"]
        for s in ep["steps"]:
            assert set(s) == STEP_FIELDS
            assert s["label"] in ("ok", "invalid", "repeat", "format")
        assert ep["reward"] == sum(s["r_env"] for s in ep["steps"])
        assert sum(s["done"] for s in ep["steps"]) == (0 if ep["truncated"] else 1)
        assert ep["steps"][-1]["done"] == (not ep["truncated"])
    return eps


def test_expert_through_02_scores_100_percent(stages, in_process, tmp_path):
    out = tmp_path / "seen.jsonl"
    proc = in_process(stages["02_collect"], "--policy", "expert", "--env", "household", "--split", "seen", "--out", out)
    summary = json.load(open(tmp_path / "seen.json"))  # household's own demonstrator is clean (kitchen's is careless)
    assert summary["success_rate"] == 1.0 and summary["episodes"] == 100
    assert "success 100.0%" in proc.stdout
    eps = check_schema(out)
    assert all(ep["source"] == "expert" for ep in eps)
    assert summary["labels"]["ok"] == sum(len(ep["steps"]) for ep in eps)


def test_fresh_tiny_model_collects_end_to_end(stages, in_process, tiny_run, tmp_path):
    out = tmp_path / "self.jsonl"
    proc = in_process(stages["02_collect"], "--policy", tiny_run / "policy_0", "--split", "train", "--episodes", 6,
                      "--num-envs", 3, "--max-new-tokens", 16, *HOUSEHOLD, '{"max_steps": 4}', "--out", out,
                      "--threads", 1)
    eps = check_schema(out)
    assert len(eps) == 6 and all(ep["source"] == "self" and ep["policy"] == "policy_0" for ep in eps)
    # A barely trained model rarely ends its turn within 16 tokens; 02 says how often it was cut.
    cut = [line for line in proc.stdout.splitlines() if "replies reached --max-new-tokens 16" in line]
    assert len(cut) == 1 and 0 < int(cut[0].split()[1]) <= sum(len(ep["steps"]) for ep in eps)
    summary = json.load(open(tmp_path / "self.json"))
    assert summary["episodes"] == 6 and summary["env_steps"] <= 6 * 4
    # Labels and auxiliary rewards agree with the flags' defaults.
    aux = {"ok": 0.0, "invalid": -0.1, "repeat": -0.1, "format": -0.2}
    assert all(s["r_aux"] == aux[s["label"]] for ep in eps for s in ep["steps"])


def test_collection_is_reproducible(stages, in_process, tiny_run, tmp_path):
    """The same episodes from a process of its own and from this one (another interpreter: another string
    hash seed, and this process's state after other tests)."""
    outs = []
    for name, run in (("a", run_stage), ("b", lambda name, *args: in_process(stages[name], *args))):
        out = tmp_path / f"{name}.jsonl"
        run("02_collect", "--policy", tiny_run / "policy_0", "--split", "seen", "--episodes", 5,
            "--num-envs", 2, "--max-new-tokens", 12, *HOUSEHOLD, '{"max_steps": 3}', "--out", out,
            "--seed", 5, "--threads", 1)
        outs.append(open(out).read())
    assert outs[0] == outs[1]


def test_refilled_slots_run_the_same_episodes(stages, in_process, tmp_path):
    """A slot whose episode ends takes the next task at once: with the (deterministic) expert,
    3 slots over 20 tasks (rollout.run_lockstep) give exactly the episodes of one environment at a
    time (--num-envs 1: 02's run_episode, the loop a student reads)."""
    outs = []
    for n in (1, 3):
        out = tmp_path / f"n{n}.jsonl"
        in_process(stages["02_collect"], "--policy", "expert", "--split", "seen", "--episodes", 20, "--num-envs", n,
                   "--out", out)
        outs.append(out.read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 20


def test_the_plain_rollout_and_the_lockstep_engine_write_the_same_episodes(stages, in_process, tiny_run, tmp_path):
    """A model policy, greedy, same seed: 02's run_episode one episode at a time (--num-envs 1) and
    rollout.run_lockstep over 3 slots with refills (generation batched, one KV cache across turns)
    write the same episodes and the same summary counts."""
    outs = []
    for n in (1, 3):
        out = tmp_path / f"n{n}.jsonl"
        in_process(stages["02_collect"], "--policy", tiny_run / "policy_0", "--split", "seen", "--episodes", 7,
                   "--num-envs", n, "--greedy", "--max-new-tokens", 12, *HOUSEHOLD, '{"max_steps": 4}',
                   "--out", out, "--threads", 1, "--precision", "fp32")
        outs.append((out.read_text(), {k: v for k, v in json.loads((tmp_path / f"n{n}.json").read_text()).items()
                                       if k in ("episodes", "env_steps", "generated_tokens", "labels")}))
    assert outs[0] == outs[1] and len(outs[0][0].splitlines()) == 7


def random_policy(tiny_run, tmp_path):
    """The tiny policy with random weights of a wide init: the one-epoch policy repeats one token, these give
    replies that differ from row to row (and clear margins between the top two logits)."""
    path = tmp_path / "random_policy"
    shutil.copytree(tiny_run / "policy_0", path)
    config = AutoConfig.from_pretrained(path)
    config.initializer_range = 0.5
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_cached_generation_gives_the_replies_of_the_plain_loop(tiny_run, stages, monkeypatch, tmp_path):
    """The KV cache kept across turns (generate_cached, the default) against the plain loop that
    re-reads every prompt (kv_cache.generate_plain): the same replies, and the same logits (up to
    float rounding) at every token of them - over rows of very different lengths, a row refilled
    with a new task (Session.sync keeps the common instruction and hides the rest), an idle row, a
    full cache (compacted), a reply hidden without a compaction, rows that end their reply early
    (the rest go on in a copy holding only them), and prompts that continue with what that copy read."""
    c = stages["02_collect"]
    # Both paths on the CPU in fp32 (on a GPU, and under bf16 autocast, the two kernels round differently).
    monkeypatch.setattr(c, "pick_device", lambda precision: (torch.device("cpu"), None))
    path = random_policy(tiny_run, tmp_path)
    eps = [json.loads(line) for line in open(tiny_run / "expert.jsonl")][:4]
    seen = []  # per next_tokens call: {batch row: the logits its next token is drawn from}
    real_next_tokens = c.next_tokens
    monkeypatch.setattr(c, "next_tokens", lambda logits, rows, n_rows, args: seen.append(
        dict(zip(rows, logits))) or real_next_tokens(logits, rows, n_rows, args))

    def policy(*flags):
        p = c.ModelPolicy(str(path), c.parse_args(["--policy", str(path), "--out", "x.jsonl", "--greedy",
                                                   "--max-new-tokens", "6", *flags]))
        p.start(4)  # row 3 stays idle
        return p
    cached, plain = policy(), policy("--plain-generate")
    subsets = []  # the rows of every compacted copy of the cache (None: all of them)
    real_compacted = kv_cache.Session.compacted
    monkeypatch.setattr(kv_cache.Session, "compacted",
                        lambda self, room, rows=None: subsets.append(rows) or real_compacted(self, room, rows))

    def prompt(k, t):  # episode k after its first t steps
        return cached.prompt_ids([dict(eps[k], steps=eps[k]["steps"][:t])])[0]

    def both(rows, prompts):
        """Both paths on one turn -> the replies as token ids; checks that they agree."""
        out = []
        for p in (cached, plain):
            n = len(seen)
            generate = kv_cache.generate_plain if p is plain else kv_cache.generate_cached
            out.append(generate(p, rows, prompts, c.next_tokens))
            out.append(seen[n:])
        (replies, steps), (plain_replies, plain_steps) = out[:2], out[2:]
        assert replies == plain_replies and len(steps) == len(plain_steps)
        for k, (got, want) in enumerate(zip(steps, plain_steps)):
            for i, r in enumerate(rows):
                if len(replies[i]) > k:  # row r drew its k-th token from these logits
                    assert torch.allclose(got[r], want[r], atol=1e-4), (k, r)
        return replies

    end = prompt(0, 1)[-5:]  # the end of a turn, an observation and the next generation prompt, as in a chat
    cached.eos_id = plain.eos_id = -1  # no end of turn: every reply is 6 tokens, and all reach the cache
    first = both([0, 1, 2], [prompt(0, 5), prompt(1, 0), prompt(2, 2)])   # very different lengths
    n_compactions = len(subsets)
    # Row 0 goes on without its reply, row 2 with half of it: the rest is hidden (the new tokens fit, no copy).
    both([0, 1, 2], [prompt(0, 5) + end, prompt(1, 0) + first[1] + end, prompt(2, 2) + first[2][:3] + end])
    assert len(subsets) == n_compactions
    both([0, 2], [prompt(3, 0), prompt(2, 3)])                             # row 0 refilled, row 1 idle
    cached.session.max_cols = 0                                            # a full cache: compact it
    prompts = [prompt(3, 1), prompt(0, 1), prompt(2, 4)]                  # row 1 back with a new task
    # row 0 now ends its reply early
    cached.eos_id = plain.eos_id = kv_cache.generate_plain(plain, [0, 1, 2], prompts, c.next_tokens)[0][1]
    replies = both([0, 1, 2], prompts)
    assert len({len(r) for r in replies}) > 1
    # Each prompt goes on with its reply: tokens that only the copy holding the rows still writing read.
    both([0, 1, 2], [p + r + end for p, r in zip(prompts, replies)])
    assert None in subsets and any(rows is not None and len(rows) < 3 for rows in subsets)
    # Rows 0 and 1 start episodes that begin as their last ones did: they have read all of these prompts already.
    both([0, 1, 2], [prompt(3, 1), prompt(0, 1), prompt(2, 4)])


def test_under_bf16_the_policy_and_its_kv_cache_are_bf16(stages, tiny_run):
    """02 trains nothing: under --precision bf16 (a GPU's default) its policy's weights are bf16, and so is its KV
    cache (whose dtype is the keys'), which every decode step reads whole; in fp32 both stay fp32."""
    c, ep = stages["02_collect"], json.loads(open(tiny_run / "expert.jsonl").readline())
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        path = str(tiny_run / "policy_0")
        p = c.ModelPolicy(path, c.parse_args(["--policy", path, "--out", "x.jsonl", "--precision", precision,
                                              "--max-new-tokens", "4"]))
        p.start(2)
        assert len(p.act([0, 1], p.prompt_ids([ep, ep]))) == 2
        assert {w.dtype for w in p.model.parameters()} == {dtype} and p.session.cache.layers[0].keys.dtype == dtype


def test_the_cuda_graph_decode_step_writes_the_eager_episodes(stages, in_process, tiny_run, tmp_path, monkeypatch):
    """02 --cuda-graph (kv_cache.GraphStep; on a CPU, no graph: the same steps over the graph's buffers): decode steps
    on every row, at cache widths in steps of GRAPH_WIDTH (128 here, so that the cache fills: it is compacted into a
    wider one, whose step gets buffers of its own, then in place) - the same greedy episodes as the plain steps, byte
    for byte, with random weights of a wide init (replies that differ from row to row)."""
    path = random_policy(tiny_run, tmp_path)
    monkeypatch.setattr(kv_cache, "GRAPH_WIDTH", 128)
    in_place, real_compacted = [], kv_cache.Session.compacted  # per compaction: into the same cache?
    caches, real_call = [], kv_cache.GraphStep.__call__  # the caches the graph's steps ran on

    def compacted(self, room, rows=None):
        new = real_compacted(self, room, rows)
        in_place.append(new.cache is self.cache)
        return new

    def call(self, cache, **inputs):
        caches.append(cache)
        return real_call(self, cache, **inputs)
    monkeypatch.setattr(kv_cache.Session, "compacted", compacted)
    monkeypatch.setattr(kv_cache.GraphStep, "__call__", call)
    common = ["--policy", path, "--split", "seen", "--episodes", 6, "--num-envs", 3, "--greedy", "--max-new-tokens",
              8, *HOUSEHOLD, '{"max_steps": 6}', "--threads", 1, "--precision", "fp32"]
    outs = []
    for name, flags in (("eager", []), ("graph", ["--cuda-graph"])):
        in_place.clear()
        in_process(stages["02_collect"], *common, *flags, "--out", tmp_path / f"{name}.jsonl")
        outs.append((tmp_path / f"{name}.jsonl").read_text())
    assert len(caches) > 10 and len({id(c) for c in caches}) >= 2  # the graph's step ran, on two caches or more
    assert True in in_place and False in in_place  # compacted in place, and into a wider cache
    assert outs[0] == outs[1] and len({len(ep["steps"][0]["text"]) for ep in map(json.loads, outs[0].splitlines())}) > 1


def test_the_decode_step_has_no_host_sync():
    """A CUDA graph records a step only if it never waits for the device (.item(), a tensor's truth value, a copy to
    the host): on the meta device, where tensors have no values, any of these fails. A decode step of a Llama with
    grouped-query attention (SmolLM2's architecture, small) on a static cache with a padding mask, as 02 feeds it."""
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    cache, mask = StaticCache(config=config, max_cache_len=16), torch.zeros((3, 16), dtype=torch.long, device="meta")
    with torch.no_grad():
        for t in range(2):
            ids = torch.full((3, 1), t, device="meta")
            out = model(input_ids=ids, attention_mask=mask, position_ids=ids, cache=cache, logits_to_keep=1)
    assert out.logits.shape == (3, 1, 64)


@pytest.mark.parametrize("stage,args,message", [
    ("02_collect", ["--policy", "expert", "--env", "nope", "--out", "{d}/x.jsonl"], "unknown env 'nope'"),
    ("02_collect", ["--policy", "expert", "--split", "test", "--out", "{d}/x.jsonl"], "unknown split 'test'"),
    ("02_collect", ["--policy", "{d}/nomodel", "--out", "{d}/y.jsonl"], "no tokenizer_config.json"),
    ("01_bc", ["--data", "{d}/missing.jsonl", "--out", "{d}/p"], "no such file"),
    ("01_bc", ["--data", "{d}/bad.jsonl", "--out", "{d}/p"], "bad.jsonl:2: not a line of JSON text"),
    ("01_bc", ["--data", "{d}/empty.jsonl", "--out", "{d}/p"], "no episodes"),
    ("03_critic", ["--data", "{d}/nolabel.jsonl", "--policy", "{d}/nomodel", "--out", "{d}/c"],
     "nolabel.jsonl:1: episode lacks label"),
    ("04_gae", ["--data", "{d}/good.jsonl", "--critic", "{d}/nomodel", "--out", "{d}/a.jsonl"],
     "is not a critic directory"),
    ("05_bppo", ["--data", "{d}/good.jsonl", "--policy", "{d}/nomodel", "--ref", "{d}/nomodel", "--out", "{d}/p"],
     "lacks adv"),
])
def test_bad_input_gives_one_line_and_exit_2(stages, in_process, tmp_path, stage, args, message):
    good = json.dumps({"env": "household", "task_id": "train/00000", "instruction": "i", "task": "t", "obs0": "o",
                       "steps": [{"text": "Action: look", "action": "look", "obs": "o", "r_env": 0.0,
                                  "label": "ok", "r_aux": 0.0, "done": False}],
                       "reward": 0.0, "success": False, "source": "self"})
    (tmp_path / "good.jsonl").write_text(good + "\n")
    (tmp_path / "nomodel").mkdir()  # a directory without a model or critic in it
    (tmp_path / "bad.jsonl").write_text(good + "\n{not json\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "nolabel.jsonl").write_text(good.replace('"label": "ok", ', "") + "\n")
    sentinel = tmp_path / "x.jsonl"
    sentinel.write_text("keep me")
    proc = in_process(stages[stage], *[a.format(d=tmp_path) for a in args], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert sentinel.read_text() == "keep me"  # nothing overwritten
    assert not (tmp_path / "p").exists() and not (tmp_path / "c").exists()


def test_every_flag_has_help(stages, monkeypatch):
    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    for module in stages.values():
        with pytest.raises(SystemExit):
            module.parse_args([])
    assert len(parsers) == len(stages)
    for parser in parsers:
        flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        assert any(a.dest == "seed" for a in flags), parser.prog
        for a in flags:
            assert a.help and len(a.help) > 8, f"{parser.prog} {a.option_strings[0]} has no help"


def test_one_batch_runs_every_world_and_split_as_runs_of_their_own(stages, in_process, tiny_run, tmp_path):
    """--env-seed 0 1 --split seen unseen: the policy loaded once, the four (world, split) runs' tasks in one
    lockstep batch (slots take the next task of any run, in another world's environment), and each run written
    as a run of its own writes it - the same greedy episodes, the same summary but for the launch's timings."""
    common = ["--policy", tiny_run / "policy_0", "--episodes", 3, "--num-envs", 2, "--max-new-tokens", 12,
              *HOUSEHOLD, '{"max_steps": 3}', "--greedy", "--threads", 1, "--precision", "fp32"]
    run_stage("02_collect", *common, "--env-seed", 0, 1, "--split", "seen", "unseen",
              "--out", tmp_path / "w{world}_{split}.jsonl")
    assert len(list(tmp_path.glob("w*_*.jsonl"))) == 4
    timing = ("wall_s", "cpu_s", "runs_in_batch", "peak_mem_gb", "args")
    for world, split in ((0, "seen"), (1, "unseen")):
        alone = tmp_path / f"alone{world}{split}.jsonl"
        in_process(stages["02_collect"], *common, "--env-seed", world, "--split", split, "--out", alone)
        pair = tmp_path / f"w{world}_{split}.jsonl"
        assert pair.read_text() == alone.read_text()
        a, b = (json.loads(p.with_suffix(".json").read_text()) for p in (pair, alone))
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
        assert (a["runs_in_batch"], b["runs_in_batch"]) == (4, 1) and a["generated_tokens"] > 0
        # the launch's peak: on a CPU the process's resident set, torch's included; on a GPU the tiny model's tensors
        assert (0 if torch.cuda.is_available() else 0.1) < a["peak_mem_gb"] < 24
        assert {**a["args"], "out": ""} == {**b["args"], "out": ""} and a["args"]["env_seed"] == world
    proc = in_process(stages["02_collect"], *common, "--env-seed", 0, 1, "--out", tmp_path / "x.jsonl", check=False)
    assert proc.returncode == 2 and "need {world} and {split} in the path" in proc.stderr
    # a field 02 does not fill (a typo) stayed in the file's name: refused, nothing written (issue 94)
    proc = in_process(stages["02_collect"], *common, "--env-seed", 0, 1, "--split", "seen", "--out",
                      tmp_path / "t{world}_{wrold}.jsonl", check=False)
    assert proc.returncode == 2 and "{wrold} is not a field" in proc.stderr and not list(tmp_path.glob("t*"))
    proc = in_process(stages["02_collect"], *common, "--out", tmp_path / "t{world.jsonl", check=False)  # session 10
    assert proc.returncode == 2 and ": { is not a field" in proc.stderr and not list(tmp_path.glob("t*"))


def test_keep_success_writes_the_successful_demonstrations_only(stages, in_process, tmp_path):
    """DEMOS=success (run_all.sh): --keep success writes the successes alone; the summary's rates are all episodes'."""
    out = tmp_path / "expert.jsonl"
    run_stage("02_collect", "--policy", "expert", "--env", "kitchen", "--env-kwargs", '{"careless": 0.85}',
              "--split", "train", "--episodes", 40, "--keep", "success", "--out", out)
    kept = [json.loads(line) for line in open(out)]
    summary = json.load(open(tmp_path / "expert.json"))
    assert kept and all(ep["success"] for ep in kept) and summary["episodes"] == 40
    assert summary["kept"] == len(kept) == round(summary["success_rate"] * 40) < 40


def test_a_compaction_where_no_row_sees_a_column(tiny_run):
    """Session 11's probes (B): rows whose columns were all hidden (first prompts that did not fit, idle rows) left
    compacted() an empty column index, which torch made a float tensor: IndexError mid-collection."""
    from transformers import AutoModelForCausalLM

    import kv_cache
    from plumbing import load_model
    model = load_model(AutoModelForCausalLM, str(tiny_run / "policy_0")).eval()
    s = kv_cache.Session(model, 2, 16, 0, model)
    s.feed([[5, 6, 7], [5, 6]])
    s.sync(0, [9, 9])  # nothing in common with what the rows see: all hidden
    s.sync(1, [8])
    new = s.compacted(4)
    assert (new.width, new.cols, new.ids) == (0, [[], []], [[], []]) and not new.mask.any()
