"""How 02_collect.py's policy writes the replies of a batch of rows: decoding, skip it on a first reading.

generate_plain re-reads every prompt in full at each turn. generate_cached gives the same replies (up
to float rounding) from one KV cache kept across turns and episodes: each turn feeds only the new
tokens - the last reply's end, the observation, or a refilled slot's new task. It is 02's default
(--plain-generate takes the plain loop; bench/speed/collect_speed.py measures both), so its arithmetic is
the one every seeded run reproduces bit for bit. tests/test_collect.py checks that both write the
same replies. Both take 02's ModelPolicy (model, step, n_rows, eos_id, pad_id, args) and next_tokens, 02's
choice of each row's next token (greedy or sampled).
"""
import torch
from transformers import DynamicCache, StaticCache

CACHE_ROOM = 64  # free KV-cache columns beyond one turn's need
GRAPH_WIDTH = 1024  # with 02 --cuda-graph, cache widths are multiples of this (each new cache is recorded once)


class GraphStep:
    """02 --cuda-graph's decode step (one token a row). A small model's step is launch-bound: hundreds of small kernels
    issued one by one from Python. On a GPU the step is recorded once per KV cache as a CUDA graph (torch.cuda.graph)
    and then replayed, all its kernels in one launch, over the same input buffers: each step copies its inputs into
    them, and the next replay overwrites the output. Recording runs nothing and compiles nothing (torch.compile took
    12-45 s a launch on an H200). It needs a step without host syncs: tests/test_collect.py runs one on the
    meta device, where any would fail. A CPU has no CUDA graphs: there the step runs eagerly over the same buffers."""

    def __init__(self, model):
        self.model, self.cache, self.graph = model, None, None

    def __call__(self, cache, **inputs):  # input_ids, attention_mask, position_ids (tensors), logits_to_keep
        if cache is not self.cache or inputs["attention_mask"].shape != self.inputs["attention_mask"].shape:
            # A new cache: new buffers, and this step runs eagerly (the warm-up recording needs); the next records.
            self.cache, self.graph = cache, None
            self.inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
            return self.model(cache=cache, **inputs)
        for k, v in inputs.items():
            if torch.is_tensor(v):
                self.inputs[k].copy_(v)
        if self.model.device.type != "cuda":
            return self.model(cache=cache, **self.inputs)
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records the kernels; runs nothing
                self.out = self.model(cache=cache, **self.inputs)
        self.graph.replay()
        return self.out


@torch.no_grad()
def generate_plain(policy, rows, prompts, next_tokens):
    """The plain loop -> each row's reply as token ids, up to the end-of-turn token (or
    --max-new-tokens of them). The prompts are left-padded into one batch (B, L), so every row's
    next token is predicted at the last column; the cache holds what has been read so far."""
    p, B, L, dev = policy, len(prompts), max(len(x) for x in prompts), policy.device
    ids = torch.full((B, L), p.pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, x in enumerate(prompts):
        ids[i, L - len(x):], mask[i, L - len(x):] = torch.tensor(x), 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # each row counts its positions from its first real token
    cache, replies, live = DynamicCache(config=p.model.config), [[] for _ in prompts], set(range(B))
    for _ in range(p.args.max_new_tokens):
        logits = p.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                         cache=cache, logits_to_keep=1).logits[:, -1].float()
        ids = next_tokens(logits, rows, p.n_rows, p.args)[:, None].cpu()  # (B, 1): what each row reads next
        for i in sorted(live):
            replies[i].append(int(ids[i]))
            if replies[i][-1] == p.eos_id:
                live.discard(i)
        if not live:
            break
        mask, pos = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1), pos[:, -1:] + 1
    return replies


@torch.no_grad()
def generate_cached(policy, rows, prompts, next_tokens):
    """generate_plain's replies through policy.session, a Session over all n_rows rows of the batch."""
    p, max_new = policy, policy.args.max_new_tokens
    if p.session is None:  # the first turn: a cache that fits the prompts and one turn
        p.session = Session(p.model, p.n_rows, max(len(x) for x in prompts) + max_new + CACHE_ROOM, p.pad_id, p.step)
    s, prompt_of = p.session, dict(zip(rows, prompts))
    # The tokens each row must feed to see its prompt. A row without a prompt (its slot has no
    # episode left) hides everything, so the copies below can drop it.
    new = [s.sync(r, prompt_of.get(r, [])) for r in range(p.n_rows)]
    need = max(len(t) for t in new) + max_new
    if s.width + need > s.max_cols:
        # Pads and stale columns have filled the cache: copy what the rows see into a compact
        # one with room for this turn and a little more (every extra column slows every step).
        s = p.session = s.compacted(need + CACHE_ROOM)
    logits = s.feed(new)
    replies, live = {r: [] for r in rows}, set(rows)  # live: rows still writing their reply
    slot = list(range(p.n_rows))  # slot[j]: the batch row that row j of s serves
    for step in range(max_new):
        nxt = next_tokens(logits, slot, p.n_rows, p.args).tolist()  # one device-to-host copy a step, not one a row
        for j, r in enumerate(slot):
            if r in live:
                replies[r].append(nxt[j])
                if replies[r][-1] == p.eos_id:
                    live.discard(r)
        going = [j for j, r in enumerate(slot) if r in live]
        if not going:
            break
        if len(going) <= len(slot) // 2 and p.step is p.model:  # (a CUDA graph keeps its shapes: all rows)
            # Most rows have ended their reply, but every row of s is computed at every step: go on
            # with a copy that holds only the rows still writing. Their last tokens never reach
            # p.session; at the next turn, sync finds them missing and feeds them with the observation.
            s, slot = s.compacted(max_new - step + 1, rows=going), [slot[j] for j in going]
        logits = s.feed([[replies[r][-1]] if r in live else [] for r in slot])
    return [replies[r] for r in rows]


class Session:
    """One KV cache shared by all rows of the generation batch. All rows share the cache's column
    index; a row sees the columns whose attention mask is 1 - pads and stale tokens are masked out.
    A row whose slot starts a new episode keeps the common prefix (the instruction) and hides the
    rest of the old episode (sync). When pads and hidden columns fill the cache, the visible
    columns are copied into a smaller one (compacted): attention reads every column at every step."""

    def __init__(self, model, n_rows, max_cols, pad_id, step, cache=None):
        if step is not model:  # 02 --cuda-graph records a graph per cache: widths in steps of GRAPH_WIDTH
            max_cols = -(-max_cols // GRAPH_WIDTH) * GRAPH_WIDTH
        self.model, self.step, self.pad_id, self.max_cols = model, step, pad_id, max_cols
        self.cache = StaticCache(config=model.config, max_cache_len=max_cols) if cache is None else cache
        self.mask = torch.zeros((n_rows, max_cols), dtype=torch.long, device=model.device)
        self.width = 0                                # columns used so far
        self.ids = [[] for _ in range(n_rows)]        # visible tokens of each row
        self.cols = [[] for _ in range(n_rows)]       # their columns in the cache

    def sync(self, r, prompt):
        """Tokens row r must feed so that it sees `prompt`: the part after the longest common
        prefix with what it already sees (the rest is hidden), and at least the prompt's last token,
        whose logits the reply starts from (a new episode may begin as the row's last one did)."""
        ids, m = self.ids[r], max(0, min(len(prompt) - 1, len(self.ids[r])))
        n = m if prompt[:m] == ids[:m] else next(i for i in range(m) if prompt[i] != ids[i])
        if n < len(ids):  # hide the rest
            self.mask[r, self.cols[r][n:]] = 0
            self.cols[r], self.ids[r] = self.cols[r][:n], ids[:n]
        return prompt[n:]

    def feed(self, new):
        """new: a token list per row (empty for idle rows) -> next-token logits (B, V). Each row's tokens are
        left-padded into W new columns, so that its last token is in the last one."""
        W = max(1, max(len(t) for t in new))
        pads = [W - len(t) for t in new]
        chunk = torch.tensor([[self.pad_id] * p + t for p, t in zip(pads, new)])
        pos = torch.tensor([[0] * p + list(range(len(ids), len(ids) + W - p)) for p, ids in zip(pads, self.ids)])
        seen = torch.tensor([[0] * p + [1] * (W - p) for p in pads])  # the mask of the W new columns
        for r, (p, toks) in enumerate(zip(pads, new)):
            self.cols[r] += range(self.width + p, self.width + W)
            self.ids[r] += toks
        dev = self.model.device
        self.mask[:, self.width:self.width + W] = seen.to(dev)  # one copy to the device for all rows
        forward = self.step if W == 1 else self.model  # decode steps through the CUDA graph, if any
        out = forward(input_ids=chunk.to(dev), attention_mask=self.mask, position_ids=pos.to(dev), cache=self.cache,
                      logits_to_keep=1)  # onto the vocabulary at the last column only: all a row's next token needs
        self.width += W
        return out.logits[:, -1].to(torch.float32, copy=True)  # a copy: a CUDA graph's next replay overwrites out

    def compacted(self, room, rows=None):
        """A new Session holding only what the given rows (default: all) see, right-aligned (stale
        and pad columns dropped), plus `room` free columns; its row j is old row rows[j]. Keys and
        values are copied, not recomputed: each depends only on its token, its position and the
        tokens before it, none of which change."""
        rows = list(range(len(self.ids))) if rows is None else rows
        B, n = len(rows), max(len(self.cols[r]) for r in rows)
        # A CUDA-graph step keeps its width and, where the rows fit, its cache: the columns are rewritten in place, so
        # its graph still points at the cache it recorded (a new cache is recorded again).
        graphed = self.step is not self.model
        in_place = graphed and n + room <= self.max_cols
        width = max(n + room, self.max_cols) if graphed else n + room
        new = Session(self.model, B, width, self.pad_id, self.step, self.cache if in_place else None)
        pads = [n - len(self.cols[r]) for r in rows]
        src = torch.tensor([[0] * p + self.cols[r] for p, r in zip(pads, rows)],  # each new column's old one (0: pad)
                           dtype=torch.long)  # (an index even where no row has a column yet)
        new.mask[:, :n] = torch.tensor([[0] * p + [1] * (n - p) for p in pads])
        for j, (p, r) in enumerate(zip(pads, rows)):
            new.cols[j], new.ids[j] = list(range(p, n)), list(self.ids[r])
        src, keep = src.to(self.model.device), torch.tensor(rows, device=self.model.device)[:, None]
        for i, layer in enumerate(self.cache.layers):  # keys, values: (B, heads, columns, head_dim)
            # [rows, :, columns] -> (B, n, heads, head_dim) (a copy); transpose back to the cache's layout
            keys, values = layer.keys[keep, :, src].transpose(1, 2), layer.values[keep, :, src].transpose(1, 2)
            if in_place:
                layer.reset()  # written again from column 0
            new.cache.update(keys, values, i)
        new.width = n
        return new
