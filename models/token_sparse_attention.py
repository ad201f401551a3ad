"""Token Sparse Attention: reversible per-head token selection for long-context prefill.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 3. Spec: ../shared/papers/token_sparse_attention.md.
Kernels: kernels/token_sparse.py (scoring, budget, Triton gather / scatter, `token_sparse_attention`).

What it implements (function names in brackets):
- data: sequences over 64 symbols for (a) multi-key associative recall and (b) variable tracking, where the
  first assignment of a chain looks unimportant to the final query [make_recall, make_tracking]; each ends in a
  tail of queries ("? k v ? k v ... ? k"), the last value being the answer;
- a decoder-only transformer with RoPE trained from scratch with dense attention, loss on every tail answer
  (teacher-forced) through DeepSpeed [LM, answer_targets];
- at prefill, without retraining, Token Sparse Attention in the sparse layers (the second half): per head, compress
  Q, K, V to the selected tokens, dense causal SDPA, decompress with zeros elsewhere [LM.forward, mode "tsa"];
- baselines at the matched budget: dense attention; token eviction (tokens selected once at the first sparse
  layer by the head-averaged attention probabilities of the observation window, as GemFilter scores them, the rest
  dropped for all later layers; GemFilter / FastKV) [eviction_scores, mode "evict"]; 4 sink tokens + sliding window
  (StreamingLLM's A-shape) [mode "sink"];
- block-sparse attention (per head and query block, the top fraction of causal key blocks by mean-pooled q . k,
  the diagonal block always; only the selected blocks are gathered and multiplied) alone in the sparse layers
  [block_sparse_attention, mode "block"], and composed with Token Sparse Attention, the block-sparse kernel taking
  the compressed Q, K, V in place of dense attention [composed_attention, mode "tsa_block"];
- accuracy over coverages c, the kept fraction and FLOP ratio sum_h n_keep^2 / (H L^2), and attention latency
  (scoring + gather + SDPA + scatter vs SDPA; block-sparse alone vs composed) at the profile's lengths, the arms
  interleaved in each repeat, on one torch thread [attention_latency]. The speed part of the claim (dense / method)
  and the composed-vs-block-sparse context are wall clock and `timed`: each repeat at the longest length is one
  paired sample (dense / method, block-sparse / composed).

Deviations from the paper (choices the abstract left open):
- scoring and budget rules are the spec's (observation window W = 16, pooling 7, coverage budget); the budget is
  computed per sequence (coverage budgets run one sequence at a time; the baselines' fixed budgets as one batch);
- CPU runs use the PyTorch gather / scatter references (`use_triton=False`); the interpreted Triton kernels run
  once on a tiny shape in evaluate and are compared with them (and in the tests);
- every pair / chain is queried in a tail (more answer targets per sequence than the spec's single query, to
  make 400 smoke steps count); accuracy is measured on the final query only;
- the block-sparse kernel is PyTorch (indexing + batched matmul), not Triton, and its block selection (a fixed
  fraction `block_keep` of the causal blocks by pooled scores) is ours, standing in for FlexPrefill's adaptive
  budget. Blocks are the spec's 64 in full; smoke uses 16 (at L = 128, blocks of 64 leave only two). On CPU this
  kernel is slower than SDPA's fused dense kernel, so the claim compares the composed path with block-sparse
  alone (the paper's "composes with sparse kernels"), not block-sparse with dense. The composed accuracy is at the
  coverage chosen on validation. Real-benchmark loaders (RULER, LongBench) and Llama-3.1-8B are not implemented.
- eviction scores with GemFilter's rule (attention probabilities, averaged over heads) but over the same W-query
  observation window and pooling as Token Sparse Attention (GemFilter uses the last query only), so the two
  methods differ in reversibility and per-head selection, not in their scoring window.
- The claim's "at some c" is chosen on a validation split (prepare's `val`, as large as the test split, drawn after
  it so train and test are unchanged): the coverage with the most pruning whose validation accuracy drop is at most
  one point (or, if none, the smallest drop) [choose_coverage]. Every reported accuracy is on the test split.

Premise (Claim.premises): `dense_above_chance`, the dense model's test accuracy exceeds chance by more than 10
points, the spec's "undertrained" bar. Chance is the in-context guess, 1 / (distinct value symbols in the sequence)
averaged over the test sequences [context_chance], stricter than 1/24 over all value symbols: a model that only
learned "answer with some value seen in the context" does not count as trained.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kernels import token_sparse as T
from models.common.tables import read_table, write_table
from models.common.threads import torch_threads
from models.contract import Claim, Compare, Paper, ScheduledParams

BOS, ASSIGN, QUERY = 0, 1, 2
KEYS = range(4, 28)  # 24 key / variable symbols
VALUES = range(28, 52)  # 24 value symbols
FILLER = range(52, 64)


class Params(ScheduledParams):
    seq_len: int = Field(128, ge=32, description="Trained (and evaluated) sequence length L.")
    n_pairs: int = Field(4, ge=1, le=12, description="Key-value pairs M of the recall task.")
    hops: int = Field(2, ge=1, le=6, description="Assignments in a variable-tracking chain.")
    chains: int = Field(3, ge=1, le=6, description="Variable-tracking chains per sequence (each queried).")
    n_train: int = Field(4000, ge=8, description="Training sequences (half per task).")
    n_test: int = Field(256, ge=4, description="Test sequences (half per task); the validation split has as many.")
    width: int = Field(64, ge=8, description="Model width.")
    n_layers: int = Field(4, ge=2, description="Transformer layers; the second half are sparse layers.")
    n_heads: int = Field(4, ge=1, description="Attention heads.")
    steps: int = Field(400, ge=1, description="Training steps.")
    batch_size: int = Field(16, ge=2)
    lr: float = Field(3e-3, gt=0)
    window: int = Field(16, ge=1, description="Observation window W (always kept).")
    pool: int = Field(7, ge=1, description="Average-pooling kernel of the scores.")
    n_min: int = Field(8, ge=1, description="Minimum kept tokens per head besides the window.")
    coverages: list[float] = Field([0.05, 0.1, 0.2, 0.3], min_length=1, description="Coverage values c.")
    latency_lengths: list[int] = Field([1024, 2048, 4096], min_length=1, description="Lengths timed.")
    latency_repeats: int = Field(5, ge=5, description="Timing repeats, interleaved across the arms; at the longest "
                                 "length each repeat's ratio is one timed sample of the claim.")
    block_size: int = Field(64, ge=2, description="Block of the block-sparse baseline (the spec's 64).")
    block_keep: float = Field(0.5, gt=0, le=1, description="Fraction of the causal key blocks each query block "
                              "keeps (top by mean-pooled q . k, the diagonal block always).")


# ---- data --------------------------------------------------------------------------------------------------
def _filler(rng, n):
    return list(rng.choice(FILLER, n))


def make_recall(rng, p: Params):
    """BOS filler with (k = v) pairs ... then a tail "? k v ? k v ... ? k" querying every pair; the last value is
    the answer. Earlier tail answers are extra training targets (teacher-forced)."""
    keys = rng.choice(KEYS, p.n_pairs, replace=False)
    vals = rng.choice(VALUES, p.n_pairs)
    order = rng.permutation(p.n_pairs)
    tail = [t for j in order for t in (QUERY, keys[j], vals[j])][:-1]
    body = p.seq_len - 1 - len(tail)
    seq = _filler(rng, body)
    slots = np.sort(rng.choice(body // 3, p.n_pairs, replace=False)) * 3
    for s, key, val in zip(slots, keys, vals, strict=True):
        seq[s : s + 3] = [key, ASSIGN, val]
    return [BOS, *seq, *tail], int(vals[order[-1]]), [int(s) + 3 for s in slots]


def make_tracking(rng, p: Params):
    """`chains` chains x1 = v ... x2 = x1 ... (interleaved in filler), then "? x_last v ..." per chain: the first
    assignment matters only through the chain, so it looks unimportant to the final query in early layers."""
    names = rng.choice(KEYS, (p.chains, p.hops), replace=False)
    vals = rng.choice(VALUES, p.chains)
    steps = [(c, h) for h in range(p.hops) for c in range(p.chains)]  # chain c's step h after its step h - 1
    tail = [t for c in range(p.chains) for t in (QUERY, names[c, -1], vals[c])][:-1]
    body = p.seq_len - 1 - len(tail)
    seq = _filler(rng, body)
    slots = np.sort(rng.choice(body // 3, len(steps), replace=False)) * 3
    for s, (c, h) in zip(slots, steps, strict=True):
        seq[s : s + 3] = [names[c, h], ASSIGN, vals[c] if h == 0 else names[c, h - 1]]
    return [BOS, *seq, *tail], int(vals[-1]), [int(s) + 3 for s, (c, h) in zip(slots, steps, strict=True) if h == 0]


def answer_targets(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t whose next-next token is a queried value ("? k | v"): (B, L) mask and targets; the last
    position (the final query) is excluded here, its target is the answer column."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 1:-1] = tokens[:, :-2] == QUERY
    target = torch.zeros_like(tokens)
    target[:, :-1] = tokens[:, 1:]
    return mask, target


def prepare(p: Params, out_dir) -> None:
    rng = np.random.default_rng(p.seed)
    cols = {c: [] for c in ("seq_id", "task", "length", "tokens", "answer", "needle_positions", "split")}
    for split, n in (("train", p.n_train), ("test", p.n_test), ("val", p.n_test)):  # val drawn last
        for i in range(n):
            task = "recall" if i % 2 == 0 else "tracking"
            tokens, answer, needles = (make_recall if task == "recall" else make_tracking)(rng, p)
            for c, v in zip(cols, (len(cols["seq_id"]), task, len(tokens), np.asarray(tokens, np.int32), answer,
                                   np.asarray(needles, np.int32), split), strict=True):
                cols[c].append(v)
    write_table(out_dir / "sequences.parquet", {k: (np.stack(v) if k == "tokens" else v) for k, v in cols.items()
                                                if k != "needle_positions"}
                | {"needle_positions": [",".join(map(str, n)) for n in cols["needle_positions"]]})


def _load(data_dir, split):
    t = read_table(data_dir / "sequences.parquet")
    sel = t["split"] == split
    return (torch.from_numpy(t["tokens"][sel].astype(np.int64)), torch.from_numpy(t["answer"][sel].astype(np.int64)),
            t["task"][sel])


def context_chance(tokens: torch.Tensor) -> float:
    """Accuracy of guessing uniformly among the distinct value symbols in each sequence, averaged (B, L) -> float."""
    values = torch.tensor(list(VALUES))
    present = (tokens[:, :, None] == values).any(1)  # (B, 24)
    return float((1.0 / present.sum(1).clamp_min(1)).mean())


# ---- the model ---------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, dh), pos (B, T) original positions (eviction keeps them after dropping tokens)."""
    half = x.shape[-1] // 2
    freq = 10_000 ** (-torch.arange(half, device=x.device) / half)
    ang = pos[:, None, :, None].float() * freq  # (B, 1, T, half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


def eviction_scores(q: torch.Tensor, k: torch.Tensor, window: int, pool: int) -> torch.Tensor:
    """GemFilter's token scores: attention probabilities of the observation-window queries to each earlier key,
    summed over the window and averaged over heads (B, H, L, dh) -> (B, L - W)."""
    return T.importance_scores(q, k, window, pool).mean(1)


def eviction_indices(q: torch.Tensor, k: torch.Tensor, keep_ratio: float, window: int, pool: int) -> torch.Tensor:
    """One head-shared selection (B, n_keep + W): top keep_ratio of the earlier tokens by eviction_scores, plus
    the window, sorted (the same budget rule as T.select_tokens with keep_ratio)."""
    length = q.shape[-2]
    w = min(window, length - 1)
    if keep_ratio >= 1.0:
        return torch.arange(length, device=q.device).expand(q.shape[0], length)
    s = eviction_scores(q, k, w, pool)  # (B, L - W)
    n_keep = max(1, min(s.shape[-1], round(keep_ratio * s.shape[-1])))
    tail = torch.arange(length - w, length, device=q.device).expand(q.shape[0], w)
    return torch.cat([s.topk(n_keep, dim=-1).indices, tail], -1).sort(-1).values


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, keep: float) -> torch.Tensor:
    """Causal block-sparse attention (B, H, L, D) -> (B, H, L, D): per head and query block i, the top
    ceil(keep * (i + 1)) of its i + 1 causal key blocks by mean-pooled q . mean-pooled k, the diagonal block always
    among them; each query attends to the selected blocks' keys only (causal within the diagonal block). Only the
    selected blocks are gathered and multiplied: the work is keep of the causal blocks', not dense work masked."""
    b, h, length, d = q.shape
    nb = -(-length // block)
    pad = nb * block - length
    q, k, v = (F.pad(z, (0, 0, 0, pad)) for z in (q, k, v))
    qb, kb, vb = (z.view(b, h, nb, block, d) for z in (q, k, v))  # (B, H, nb, block, D)
    i_, j_ = torch.arange(nb, device=q.device)[:, None], torch.arange(nb, device=q.device)[None, :]
    s = qb.mean(3) @ kb.mean(3).transpose(-1, -2)  # (B, H, nb, nb) block scores
    s = s.masked_fill(j_ > i_, float("-inf")).masked_fill(j_ == i_, float("inf"))
    top = max(1, math.ceil(keep * nb))
    sel = s.topk(top, -1).indices  # (B, H, nb, top) best first
    valid = torch.arange(top, device=q.device) < (keep * (i_ + 1) - 1e-9).ceil()  # (nb, top): row i quota
    bi = torch.arange(b, device=q.device)[:, None, None, None]
    hi = torch.arange(h, device=q.device)[None, :, None, None]
    kg, vg = (z[bi, hi, sel].flatten(3, 4) for z in (kb, vb))  # (B, H, nb, top * block, D): selected blocks only
    # the diagonal block is always selected first (score +inf): only its keys need the causal triangle; the blocks
    # beyond a row's quota are masked out (their indices are arbitrary)
    bias = torch.zeros(nb, top, block, device=q.device).masked_fill(~valid[..., None], float("-inf"))
    bias = bias.flatten(1)[:, None, :].repeat(1, block, 1)  # (nb, block, top * block)
    bias[:, :, :block].masked_fill_(~torch.ones(block, block, dtype=torch.bool, device=q.device).tril(),
                                    float("-inf"))
    logits = (qb @ kg.transpose(-1, -2)).mul_(1 / math.sqrt(d)).add_(bias)  # (B, H, nb, block, top * block)
    out = logits.softmax(-1) @ vg  # (B, H, nb, block, D)
    return out.flatten(2, 3)[:, :, :length]


def composed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, block_keep: float,
                       **selection) -> tuple[torch.Tensor, torch.Tensor]:
    """Token Sparse Attention with the block-sparse kernel in place of dense attention on the compressed tensors
    (sorted indices keep causal order, so block causality on compressed positions is valid): select, gather,
    block-sparse attention, scatter. Returns the output (B, H, L, D) and the kept indices (B, H, n)."""
    idx = T.select_tokens(q, k, **selection)  # (B, H, n)
    qc, kc, vc = (T.gather_tokens_ref(z, idx) for z in (q, k, v))  # (B, H, n, D)
    return T.scatter_tokens_ref(block_sparse_attention(qc, kc, vc, block, block_keep), idx, q.shape[-2]), idx


class LM(nn.Module):
    def __init__(self, p: Params):
        super().__init__()
        d, self.h = p.width, p.n_heads
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "o": nn.Linear(d, d),
            "ln2": nn.LayerNorm(d), "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)),
        }) for _ in range(p.n_layers))
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, 64)
        self.sparse_from = p.n_layers // 2

    def forward(self, tokens: torch.Tensor, mode: str = "dense", budget: dict | None = None,
                all_positions: bool = False) -> torch.Tensor:
        """(B, L) -> logits of the last position (B, 64), or of every position (B, L, 64) for training.
        mode: dense | tsa | evict | sink | block | tsa_block; `budget` holds keep_ratio / coverage, the selection
        and block settings, and collects kept fractions under "kept"."""
        b, length = tokens.shape
        pos = torch.arange(length, device=tokens.device).expand(b, length)
        x = self.emb(tokens)  # (B, L, d)
        for i, blk in enumerate(self.blocks):
            q, k, v = blk["qkv"](blk["ln1"](x)).unflatten(-1, (3, self.h, -1)).permute(2, 0, 3, 1, 4)  # (B,H,T,dh)
            q, k = rope(q, pos), rope(k, pos)
            sparse = mode != "dense" and i >= self.sparse_from
            if sparse and mode == "tsa":
                y, idx = T.token_sparse_attention(q, k, v, keep_ratio=budget.get("keep_ratio"),
                                                  coverage=budget.get("coverage"), window=budget["window"],
                                                  pool=budget["pool"], n_min=budget["n_min"], use_triton=False,
                                                  return_indices=True)
                budget.setdefault("kept", []).append(idx.shape[-1] / length)
            elif sparse and mode == "tsa_block":
                y, idx = composed_attention(q, k, v, budget["block"], budget["block_keep"],
                                            keep_ratio=budget.get("keep_ratio"), coverage=budget.get("coverage"),
                                            window=budget["window"], pool=budget["pool"], n_min=budget["n_min"])
                budget.setdefault("kept", []).append(idx.shape[-1] / length)
            elif sparse and mode == "block":
                y = block_sparse_attention(q, k, v, budget["block"], budget["block_keep"])
            elif sparse and mode == "evict" and i == self.sparse_from:
                # (B, n): one selection by head-averaged attention probabilities; dropped tokens never come back
                keep = eviction_indices(q, k, budget["keep_ratio"], budget["window"], budget["pool"])
                budget.setdefault("kept", []).append(keep.shape[-1] / length)
                x, pos = x.gather(1, keep[..., None].expand(-1, -1, x.shape[-1])), pos.gather(1, keep)
                q, k, v = (z.gather(2, keep[:, None, :, None].expand(-1, z.shape[1], -1, z.shape[-1]))
                           for z in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif sparse and mode == "sink":
                n = q.shape[-2]
                keep = budget["n_keep"]  # keys per query: 4 sinks + the most recent keep - 4
                i_, j_ = torch.arange(n)[:, None], torch.arange(n)[None, :]
                mask = (j_ <= i_) & ((j_ < 4) | (i_ - j_ < keep - 4))
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device))
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["o"](y.transpose(1, 2).flatten(2))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.out(self.ln(x if all_positions else x[:, -1]))  # (B, 64) or (B, L, 64)


# ---- train -------------------------------------------------------------------------------------------------
def train(ctx) -> None:
    p: Params = ctx.params
    tokens, answers, _ = _load(ctx.data_dir, "train")
    torch.manual_seed(p.seed)
    model = LM(p)

    def batch_fn(step):
        g = torch.Generator().manual_seed(p.seed * 100_003 + step)
        i = torch.randint(0, len(tokens), (p.batch_size,), generator=g)
        return {"tok": tokens[i], "ans": answers[i]}

    def step_fn(engine, batch, step):
        tok = batch["tok"]
        logits = engine(tok, all_positions=True)  # (B, L, 64)
        mask, target = answer_targets(tok)
        mask[:, -1], target[:, -1] = True, batch["ans"]  # every tail query, the final one included
        loss = F.cross_entropy(logits[mask], target[mask])
        acc = (logits[:, -1].argmax(-1) == batch["ans"]).float().mean()
        return loss, {"final_accuracy": float(acc)}

    # on the profile's `threads` (1 in smoke: batches of 16 x 64 tokens at width 64 are too small for intra-op
    # threads to pay their hand-offs, and their spin-waits multiply the CPU cost)
    ctx.fit("lm", ctx.engine(model, p.lr, weight_decay=0.01, steps=p.steps, warmup=p.warmup, decay=p.decay),
            step_fn, batch_fn, p.steps)


# ---- evaluate ----------------------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(model: LM, tokens, answers, mode="dense", **budget) -> tuple[float, float]:
    """Exact-match accuracy and mean kept fraction. A coverage budget is per sequence, so those run one sequence
    at a time; a fixed budget (keep_ratio, n_keep) is the same for every sequence and runs as one batch."""
    if mode == "dense":
        return float((model(tokens).argmax(-1) == answers).float().mean()), 1.0
    if budget.get("coverage") is None:
        b = dict(budget)
        hits = (model(tokens, mode, b).argmax(-1) == answers).float().mean()
        return float(hits), float(np.mean(b.get("kept", [budget.get("n_keep", 0) / tokens.shape[1]])))
    hits, kept = 0, []
    for i in range(len(tokens)):
        b = dict(budget)
        hits += int(model(tokens[i : i + 1], mode, b).argmax(-1).item() == answers[i].item())
        kept.append(np.mean(b.get("kept", [budget.get("n_keep", 0) / tokens.shape[1]])))
    return hits / len(tokens), float(np.mean(kept))


def choose_coverage(rows: list[dict], dense_val: float) -> dict:
    """The row (one per coverage c) with the most pruning whose validation accuracy drop from dense is at most one
    point, or else the smallest validation drop. Reads only `val_acc`, never a test accuracy."""
    ok = [r for r in rows if dense_val - r["val_acc"] <= 0.01]
    return max(ok, key=lambda r: r["c"]) if ok else min(rows, key=lambda r: dense_val - r["val_acc"])


def attention_latency(length: int, keep_ratio: float, p: Params, repeats: int) -> dict[str, list[float]]:
    """Seconds of one layer's attention call on random (1, H, L, dh) tensors, `repeats` times per arm, the arms
    interleaved within each repeat (so a repeat's ratios share the machine's state): dense SDPA, Token Sparse
    Attention (scoring + gather + SDPA + scatter), block-sparse alone, and the two composed."""
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, p.n_heads, length, p.width // p.n_heads, generator=g) for _ in range(3))
    arms = {
        "dense": lambda: T.dense_attention_ref(q, k, v),
        "tsa": lambda: T.token_sparse_attention(q, k, v, keep_ratio=keep_ratio, window=p.window, pool=p.pool,
                                                use_triton=False),
        "block": lambda: block_sparse_attention(q, k, v, p.block_size, p.block_keep),
        "composed": lambda: composed_attention(q, k, v, p.block_size, p.block_keep, keep_ratio=keep_ratio,
                                               window=p.window, pool=p.pool),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for fn in arms.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    model = ctx.network("lm")
    tokens, answers, tasks = _load(ctx.data_dir, "test")
    val_tokens, val_answers, _ = _load(ctx.data_dir, "val")
    sel = {"window": p.window, "pool": p.pool, "n_min": p.n_min}
    m: dict[str, float] = {}
    dense_acc, _ = accuracy(model, tokens, answers)
    dense_val, _ = accuracy(model, val_tokens, val_answers)
    m["baseline/dense/accuracy"], m["detail/dense/chance_accuracy"] = dense_acc, context_chance(tokens)
    m["detail/val/dense_accuracy"] = dense_val
    rows = []
    for c in p.coverages:
        val_acc, _ = accuracy(model, val_tokens, val_answers, "tsa", coverage=c, **sel)
        acc, kept = accuracy(model, tokens, answers, "tsa", coverage=c, **sel)
        n_keep = max(p.window + 1, round(kept * p.seq_len))
        ev_acc, _ = accuracy(model, tokens, answers, "evict", keep_ratio=(n_keep - p.window) / (p.seq_len - p.window),
                             **sel)
        sink_acc, _ = accuracy(model, tokens, answers, "sink", n_keep=n_keep)
        rows.append({"c": c, "val_acc": val_acc, "acc": acc, "kept": kept, "evict": ev_acc, "sink": sink_acc})
        for k_, v_ in rows[-1].items():
            m[f"detail/c{c:g}/{k_}"] = float(v_)
        ctx.progress(f"c={c}: tsa {acc:.3f} (kept {kept:.2f}), evict {ev_acc:.3f}, sink {sink_acc:.3f}, "
                     f"dense {dense_acc:.3f}")
    best = choose_coverage(rows, dense_val)  # on the validation split; the test split only reports
    blk = {"block": p.block_size, "block_keep": p.block_keep}
    block_acc, _ = accuracy(model, tokens, answers, "block", **blk)
    composed_acc, _ = accuracy(model, tokens, answers, "tsa_block", coverage=best["c"], **sel, **blk)
    # wall-clock timings are measured once per run and kept beside its outputs, so re-evaluating gives the same
    # numbers (the registry test re-runs evaluate and expects identical metrics)
    cache = ctx.out_dir / "latency.json"
    key = f"{best['kept']:.6f}/{p.block_size}/{p.block_keep:g}"
    timings = json.loads(cache.read_text()) if cache.exists() else {}
    if key not in timings:
        # one thread: no hand-offs or spin-waits between threads in the timings or the CPU cost; nothing else of
        # paperline runs while it times
        with torch_threads(1), ctx.timing():
            timings[key] = {str(n): attention_latency(n, best["kept"], p, p.latency_repeats)
                            for n in p.latency_lengths}
        cache.write_text(json.dumps(timings))
    for length in p.latency_lengths:
        t = {arm: statistics.median(v) for arm, v in timings[key][str(length)].items()}
        for arm, sec in t.items():
            m[f"detail/latency/L{length}/{arm}_ms"] = 1e3 * sec
        m[f"detail/latency/L{length}/speedup"] = t["dense"] / t["tsa"]
        m[f"detail/latency/L{length}/composed_vs_block_speedup"] = t["block"] / t["composed"]
    longest = timings[key][str(max(p.latency_lengths))]  # the timed samples: one ratio per interleaved repeat
    speedup = [d_ / s_ for d_, s_ in zip(longest["dense"], longest["tsa"], strict=True)]
    composed = [b_ / c_ for b_, c_ in zip(longest["block"], longest["composed"], strict=True)]
    m |= {f"method/speedup_longest/k{i}": v_ for i, v_ in enumerate(speedup)}
    m |= {f"method/composed/speedup_vs_block/k{i}": v_ for i, v_ in enumerate(composed)}
    m |= {"method/accuracy": best["acc"], "method/accuracy_drop": dense_acc - best["acc"],
          "method/coverage": best["c"], "method/kept_fraction": best["kept"],
          "method/flop_ratio": best["kept"] ** 2,  # sum_h n_keep^2 / (H L^2), equal budgets per head
          "method/speedup_longest": statistics.median(speedup),
          "method/composed/speedup_vs_block": statistics.median(composed),
          "method/composed/accuracy": composed_acc, "baseline/block_sparse/accuracy": block_acc,
          "baseline/eviction/accuracy": best["evict"], "baseline/sink_window/accuracy": best["sink"]}
    for task in ("recall", "tracking"):
        s = tasks == task
        m[f"detail/{task}/dense_accuracy"] = accuracy(model, tokens[s], answers[s])[0]
    # the Triton kernels (interpreted on CPU) against the PyTorch path the pipeline used, on one tiny shape
    g = torch.Generator().manual_seed(p.seed)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    a = T.token_sparse_attention(q, k, v, keep_ratio=0.3, window=8, use_triton=True)
    b = T.token_sparse_attention(q, k, v, keep_ratio=0.3, window=8, use_triton=False)
    m["detail/kernels/triton_vs_torch_max_abs"] = float((a - b).abs().max())
    _plot(ctx.plots_dir / "accuracy_vs_kept.png", rows, dense_acc)
    return m


def _plot(path, rows, dense_acc) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    kept = [r["kept"] for r in rows]
    for key, label in (("acc", "Token Sparse Attention"), ("evict", "eviction"), ("sink", "sink + window")):
        ax.plot(kept, [r[key] for r in rows], "o-", label=label)
    for r in rows:
        ax.annotate(f"c={r['c']:g}", (r["kept"], r["acc"]), fontsize=7)
    ax.axhline(dense_acc, color="k", ls=":", label="dense")
    ax.set(xlabel="kept fraction of tokens per head", ylabel="exact-match accuracy", title="accuracy vs budget")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="token_sparse_attention",
    title="Token Sparse Attention: reversible per-head token selection for long-context prefill",
    seed="000_2dd18ae8605fb5c1.txt, abstract 3",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/speedup_longest", "max"),
    claim=Claim(
        premises=(  # the spec's "undertrained" bar: dense within 10 points of (in-context) chance is inconclusive
            Compare("baseline/dense/accuracy", ">", "detail/dense/chance_accuracy", margin=0.10,
                    name="dense_above_chance"),
        ),
        all_of=(
            Compare("method/speedup_longest", ">", 1.0, timed=True),
            Compare("method/accuracy_drop", "<=", 0.01),
            Compare("method/accuracy", ">=", "baseline/eviction/accuracy"),
            Compare("method/accuracy", ">=", "baseline/sink_window/accuracy"),
            # composes with sparse-attention kernels: within a point of block-sparse alone's accuracy
            Compare("method/composed/accuracy", ">=", "baseline/block_sparse/accuracy", margin=-0.01),
        ),
        context=(  # nearly by construction: the same block-sparse kernel on fewer tokens (see the note)
            Compare("method/composed/speedup_vs_block", ">", 1.0, timed=True),
        ),
        summary="at a coverage chosen on a validation split: attention faster at the longest length (timed), test "
                "accuracy within 1 point of dense, and at least eviction's and sink+window's at the same budget; "
                "composed with block-sparse attention: within 1 point of its accuracy; context: the composed path "
                "faster than block-sparse alone (timed)",
        note="the composed-vs-block-sparse speed-up is context, not a part: it nearly holds by construction (the "
             "composed path runs the same block-sparse kernel on fewer tokens), so it reads whether the scoring, "
             "gather and scatter cost less than the tokens they remove, not whether the two methods compose well; "
             "timings on one thread"),
)
