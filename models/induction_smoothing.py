"""Induction heads as smoothed in-context estimators on order-k Markov chains.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 12. Spec: ../shared/papers/induction_smoothing.md.

What it implements (function names in brackets):
- in-context Markov data: BOS + T tokens of a fresh order-k chain over S symbols per sequence; setting A rows
  p(.|ctx) ~ Dir(alpha 1), setting B q(.|b) ~ Dir(alpha 1), p(.|a, b) ~ Dir(c q(.|b)) [sample_chains, sample_tokens];
- in-context counts at every query position, with BOS-padded contexts: the count tensor of (context, next symbol)
  pairs seen so far, from which follow the order-0..k counts and the counts grouped by overlap with the current
  context [in_context_counts];
- count baselines: order-k maximum likelihood, add-beta (Dirichlet), Jelinek-Mercer interpolation of orders
  0..k, tuned on training sequences [mle, add_beta, jelinek_mercer, tune_grid]; the exact Bayes predictor of
  setting A, add-alpha with the true alpha [add_beta];
- the disentangled transformer, built literally: one-hot residual subspaces, layer-1 heads attending to offsets
  -1..-k by position only, a layer-2 head with logit beta * overlap and a BOS key with logit beta0 and a uniform
  value [disentangled_forward]; its count form, the overlap-weighted interpolation plus pseudo-count
  e^{beta0 - k beta}/S [soft_match]; (beta, beta0) fitted by grid search on training sequences;
- the trained 2-layer attention-only transformer (learned positions, 2 heads per layer) with and without BOS,
  three models (BOS on A, BOS on B, no-BOS on A) in lock-step in one DeepSpeed engine; training runs the
  attention fused (scaled_dot_product_attention), evaluation reads the explicit patterns [AttnOnly, train];
- attention-pattern recovery: per head of every layer from 2 up, within-query log attention regressed on overlap
  (slope beta_hat, R^2), and Spearman correlation of BOS attention mass with the exact-match count
  [attention_recovery, report_head];
- premise induction_heads_formed: the report head's R^2 >= 0.5, the spec's bar (its claim part 2): overlap explains
  at least half of the within-query variance of the head's log attention (the disentangled circuit's R^2 is 1, a
  head blind to overlap is near 0). Without it the KL comparisons test a model that has not reached the induction
  regime the paper is about, so it is a premise rather than a part; beta_hat > 0 stays a part.
- premise kl_settled_in_last_half: over the second half of training (one warm-up + cosine schedule over both
  halves) each BOS model's KL to the true transitions on the held-out fitting sequences fell by less than the
  claim's margin KL_TOL, so that "does not hold" does not read as "not trained yet" [heldout_kl]; with `ema` set it
  reads, as evaluation does, the EMA copy of the weights (half-way the raw weights carry the noise of a rate still
  near its peak, which the EMA averages out; at the end of a schedule decayed to zero the two agree). It replaces a
  premise on the training loss's plateau (relative change over the last fifth under 1 %): under a schedule that
  decays to zero that change is near zero by construction, and it was met at seed 0 both at 1,500 steps and at
  3,000, where the test KL of the method was far lower (run records, issue 40).

Deviations from the paper (choices the abstract left open):
- Training sequences are drawn on the fly in batch_fn (fresh chains, generator seeded by the step, the same
  sampler as prepare); prepare writes the fitting ("train") and test sequences and their true transitions.
- Jelinek-Mercer is the recursive form p_j = lam_j ML_j + (1 - lam_j) p_{j-1}, p_{-1} = uniform, falling back
  to p_{j-1} where an order-j context is unseen; lambdas on a 9-point grid per order.
- Keys of the disentangled head are all positions 1..t; contexts reaching before the sequence hold BOS, which
  matches no symbol (the circuit's behaviour on early positions).
- Smoke trains at the spec's smoke width 32 (not the model width 64: at these sizes a step's cost is mostly
  per-operation overhead, and the narrower model takes more steps for the same CPU), at a peak rate and for as
  many steps as the smoke budget (120 CPU-s a replicate) allows. Held-out KL curves over steps (issue 40's probe)
  show two late drops, setting A's induction head and then setting B's use of its informative lower order, each
  at a step count that a higher peak rate barely moves, then a slow tail; whether the run reaches the end of
  that tail is the premise kl_settled_in_last_half's question.
- The report head is the head with the largest R^2 among those with beta_hat > 0 over every layer from 2 up (with
  more than two layers the induction head may form above layer 2); with none, the largest beta_hat.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from scipy.stats import spearmanr
from torch import nn

from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, ScheduledParams

SETTINGS = ("A", "B")
MODELS = ("bos_A", "bos_B", "nobos_A")  # (BOS or not, data setting)


KL_TOL = 0.005  # claim part 1: the excess KL over the best count baseline the claim allows (nats)


class Params(ScheduledParams):
    S: int = Field(3, ge=2, description="Alphabet size.")
    k: int = Field(2, ge=1, description="Markov order.")
    alpha: float = Field(1.0, gt=0, description="Dirichlet concentration of the rows (setting A) / of q (B).")
    c: float = Field(4.0, gt=0, description="Setting B: p(.|a,b) ~ Dir(c q(.|b)).")
    T: int = Field(64, ge=8, description="Tokens per sequence after BOS.")
    t_min: int = Field(32, ge=1, description="KL and cross-entropy are averaged over query positions t_min..T-1.")
    n_fit: int = Field(256, ge=2, description="Training sequences per setting for grid-tuning the count baselines.")
    n_test: int = Field(512, ge=2, description="Test sequences per setting.")
    width: int = Field(64, ge=4, description="Transformer width.")
    heads: int = Field(2, ge=1, description="Heads per layer.")
    layers: int = Field(2, ge=2, description="Attention-only layers (every layer from 2 up is searched for the "
                        "induction head).")
    steps: int = Field(1500, ge=1, description="Training steps (all three models in lock-step).")
    batch_size: int = Field(32, ge=2, description="Sequences per model per step.")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate.")
    ema: float | None = Field(None, ge=0, le=1, description="EMA decay of the weights (engine's ema=); the held-out "
                              "KL half-way and at the end, and the evaluation, read the EMA copy. None: the weights.")
    grid: int = Field(12, ge=2, description="Points per axis of the (beta, beta0) grid of the disentangled model.")

    @model_validator(mode="after")
    def _positions(self):
        if not self.k - 1 <= self.t_min <= self.T - 2:
            raise ValueError("need k - 1 <= t_min <= T - 2 (queries need a full context and a next token)")
        return self


# ---- data --------------------------------------------------------------------------------------------------
def sample_chains(setting: str, n: int, p: Params, rng: np.random.Generator) -> np.ndarray:
    """Transition tables (n, S^k, S); context index = sum_j x_{t-k+1+j} S^(k-1-j) (oldest token first)."""
    rows = p.S ** p.k
    if setting == "A":
        return rng.dirichlet(np.full(p.S, p.alpha), size=(n, rows))
    q = rng.dirichlet(np.full(p.S, p.alpha), size=(n, p.S))  # (n, S, S): q(.|b), b = most recent token
    last = np.arange(rows) % p.S
    # row (i, ctx) ~ Dir(c q(.|b)): gamma variates normalised, drawn and scaled as numpy's own Dirichlet sampler
    # does (its gamma branch, taken whenever an alpha exceeds 0.1), in one call for every row
    g = rng.standard_gamma(p.c * q[:, last])  # (n, S^k, S)
    return g * (1.0 / g.sum(-1, keepdims=True))


def sample_tokens(chains: np.ndarray, T: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, T) int64 tokens: the first k uniform, then the chain."""
    n, _, s = chains.shape
    x = np.zeros((n, T), np.int64)
    x[:, :k] = rng.integers(0, s, (n, k))
    u = rng.random((n, T))
    cdf, rows = chains.cumsum(-1), np.arange(n)
    for t in range(k, T):
        ctx = sum(x[:, t - k + j] * s ** (k - 1 - j) for j in range(k))
        x[:, t] = (cdf[rows, ctx] < u[:, t, None]).sum(-1).clip(max=s - 1)
    return x


def prepare(p: Params, out_dir: Path) -> None:
    seq: dict[str, list] = {"seq_id": [], "setting": [], "tokens": [], "split": []}
    ch: dict[str, list] = {"seq_id": [], "context": [], "next_token": [], "prob": []}
    sid = 0
    for si, setting in enumerate(SETTINGS):
        for split, n in (("train", p.n_fit), ("test", p.n_test)):
            rng = np.random.default_rng([p.seed, si, split == "test"])
            chains = sample_chains(setting, n, p, rng)
            tokens = sample_tokens(chains, p.T, p.k, rng)
            ids = np.arange(sid, sid + n)
            sid += n
            seq["seq_id"] += list(ids)
            seq["setting"] += [setting] * n
            seq["tokens"] += list(tokens.astype(np.int8))
            seq["split"] += [split] * n
            ctx, nxt = np.meshgrid(np.arange(p.S ** p.k), np.arange(p.S), indexing="ij")
            ch["seq_id"] += list(np.repeat(ids, ctx.size))
            ch["context"] += list(np.tile(ctx.ravel(), n))
            ch["next_token"] += list(np.tile(nxt.ravel(), n))
            ch["prob"] += list(chains.reshape(-1))
    write_table(out_dir / "sequences.parquet", {**seq, "tokens": np.stack(seq["tokens"])})
    write_table(out_dir / "chains.parquet", ch)


def load_split(data_dir: Path, p: Params, setting: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (n, T), chains (n, S^k, S)) of one setting and split."""
    s, c = read_table(data_dir / "sequences.parquet"), read_table(data_dir / "chains.parquet")
    sel = (s["setting"] == setting) & (s["split"] == split)
    ids = s["seq_id"][sel]
    order = np.argsort(c["seq_id"], kind="stable")
    probs = c["prob"][order].reshape(-1, p.S ** p.k, p.S)  # rows of chains.parquet are (seq, context, next)
    first = int(c["seq_id"][order][0])
    return s["tokens"][sel].astype(np.int64), probs[ids - first]


# ---- in-context counts and the count-based estimators ----------------------------------------------------------
def in_context_counts(tokens: np.ndarray, S: int, k: int, t_min: int) -> dict[str, np.ndarray]:
    """For every query t in t_min..T-1 (0-based index of the last seen token; it predicts tokens[:, t+1]):
    order-j counts (Q, k+1, S) of the last j tokens' context, counts grouped by overlap o = 0..k with the current
    context (Q, k+1, S), the current context index (Q,), the number of exact matches (Q,), and the next token."""
    n, T = tokens.shape
    pad = np.concatenate([np.full((n, k), S), tokens], 1)  # BOS = S pads contexts before the sequence
    all_ctx = np.array(list(itertools.product(range(S + 1), repeat=k)))  # (C, k) padded contexts, oldest first
    counts = np.zeros((n, len(all_ctx), S))
    index = lambda win: (win * (S + 1) ** np.arange(k - 1, -1, -1)).sum(-1)  # noqa: E731
    out = {key: [] for key in ("order", "overlap", "ctx", "matches", "next")}
    for t in range(T - 1):
        counts[np.arange(n), index(pad[:, t : t + k]), tokens[:, t]] += 1  # transition into token t
        if t < t_min:
            continue
        q = pad[:, t + 1 : t + 1 + k]  # (n, k): the current context x_{t-k+1..t}
        same = all_ctx[None] == q[:, None]  # (n, C, k) slot-wise matches
        ov = same.sum(-1)  # (n, C)
        out["overlap"].append(np.stack([np.einsum("nc,ncs->ns", ov == o, counts) for o in range(k + 1)], 1))
        # order j: the last j slots match (j = 0 counts every transition)
        suffix = np.stack([same[:, :, k - j :].all(-1) for j in range(k + 1)], 1)  # (n, k+1, C)
        out["order"].append(np.einsum("njc,ncs->njs", suffix, counts))
        out["ctx"].append((q * S ** np.arange(k - 1, -1, -1)).sum(-1))
        out["matches"].append(out["order"][-1][:, k].sum(-1))
        out["next"].append(tokens[:, t + 1])
    return {key: np.stack(v, 1).reshape(n * len(v), *np.shape(v[0])[1:]) for key, v in out.items()}


def add_beta(order_counts: np.ndarray, beta: float) -> np.ndarray:
    """(n_ctx,s + beta) / (n_ctx + S beta) at order k; beta -> 0 is the MLE (uniform when unseen)."""
    c = order_counts[:, -1]
    return (c + beta) / (c.sum(-1, keepdims=True) + c.shape[-1] * beta)


def mle(order_counts: np.ndarray) -> np.ndarray:
    c = order_counts[:, -1]
    tot = c.sum(-1, keepdims=True)
    return np.where(tot > 0, c / np.maximum(tot, 1), 1.0 / c.shape[-1])


def jelinek_mercer(order_counts: np.ndarray, lams: tuple[float, ...]) -> np.ndarray:
    """p_j = lam_j ML_j + (1 - lam_j) p_{j-1} from p_{-1} = uniform; p_j = p_{j-1} where order j is unseen."""
    S = order_counts.shape[-1]
    prob = np.full(order_counts.shape[::2], 1.0 / S)  # (Q, S)
    for j, lam in enumerate(lams):
        tot = order_counts[:, j].sum(-1, keepdims=True)
        ml = order_counts[:, j] / np.maximum(tot, 1)
        prob = np.where(tot > 0, lam * ml + (1 - lam) * prob, prob)
    return prob


def soft_match(overlap_counts: np.ndarray, beta: float, beta0: float) -> np.ndarray:
    """The disentangled head in count form: p(s) ~ sum_o e^{beta o} N_o(s) + e^{beta0} / S."""
    k = overlap_counts.shape[1] - 1
    w = np.exp(beta * (np.arange(k + 1) - k))  # in units of exact matches (numerically safe)
    mass = np.einsum("o,qos->qs", w, overlap_counts) + np.exp(beta0 - k * beta) / overlap_counts.shape[-1]
    return mass / mass.sum(-1, keepdims=True)


def overlap_matrix(tokens: torch.Tensor, S: int, k: int) -> torch.Tensor:
    """The disentangled circuit up to layer 2's scores: (n, T) tokens -> overlap(query, key) (n, L, L), L = T+1
    with BOS at position 0. Residual stream = [one-hot(x_t) | one-hot(x_{t-1}) | ... | one-hot(x_{t-k})], each
    S-dim with BOS as the zero vector (it matches nothing); layer-1 head j attends by position to offset -j."""
    n, T = tokens.shape
    x = torch.cat([torch.full((n, 1), S), tokens], 1)  # (n, L)
    pos = torch.arange(T + 1)
    stream = [F.one_hot(x, S + 1)[..., :S].double()]  # subspace 0: the token itself, (n, L, S)
    for j in range(1, k + 1):
        logits = torch.full((T + 1, T + 1), -torch.inf, dtype=torch.double)
        logits[pos[j:], pos[j:] - j] = 0.0  # (L, L): offset -j only, by position
        stream.append(torch.nan_to_num(logits.softmax(-1)) @ stream[0])  # (n, L, S) = one-hot(x_{t-j}), 0 early
    query = torch.cat(stream[:k], -1)  # (n, L, kS): offsets 0..-(k-1) of the query
    key = torch.cat(stream[1 : k + 1], -1)  # (n, L, kS): offsets -1..-k of the key
    return query @ key.transpose(1, 2)  # (n, L, L): number of matching context slots


def disentangled_forward(tokens: torch.Tensor, S: int, k: int, beta: float, beta0: float) -> torch.Tensor:
    """The disentangled transformer run as attention: (n, T) tokens -> (n, T, S); entry t is the distribution of
    token t+1 after tokens 0..t. Layer-2 logit beta * overlap, BOS key logit beta0 with a uniform value."""
    n, T = tokens.shape
    x = torch.cat([torch.full((n, 1), S), tokens], 1)
    pos = torch.arange(T + 1)
    logits = (beta * overlap_matrix(tokens, S, k)).masked_fill(pos[None, :] > pos[:, None], -torch.inf)
    logits[:, :, 0] = beta0  # the BOS key
    value = F.one_hot(x, S + 1)[..., :S].double()  # (n, L, S)
    value[:, 0] = 1.0 / S
    return (logits.softmax(-1) @ value)[:, 1:]  # (n, T, S)


def tune_grid(candidates: list, predict, target: np.ndarray) -> tuple:
    """The candidate with the lowest mean cross-entropy of the observed next tokens."""
    ce = [-np.log(np.maximum(predict(c)[np.arange(len(target)), target], 1e-12)).mean() for c in candidates]
    return candidates[int(np.argmin(ce))]
# ---- the trained transformer ----------------------------------------------------------------------------------
class AttnOnly(nn.Module):
    """Attention-only transformer: token + learned position embeddings, pre-LN multi-head causal attention,
    unembedding. `forward` also returns every layer's attention probabilities (layers, n, H, L, L)."""

    def __init__(self, vocab: int, S: int, length: int, width: int, heads: int, layers: int):
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.unembed = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, S))

    def forward(self, x: torch.Tensor, patterns: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x (n, L) -> logits (n, L, S) and, with `patterns`, every layer's attention (n, H, L, L); without, the
        same attention runs fused (scaled_dot_product_attention, causal), which training uses."""
        n, L = x.shape
        h = self.tok(x) + self.pos(torch.arange(L, device=x.device))  # (n, L, W)
        kept = []
        for norm, qkv, out in zip(self.norms, self.qkv, self.out, strict=True):
            q, k, v = qkv(norm(h)).view(n, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # (n, H, L, W/H) each
            if patterns:
                causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
                att = ((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).masked_fill(~causal, -torch.inf).softmax(-1)
                kept.append(att)  # (n, H, L, L)
                mixed = att @ v
            else:
                mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + out(mixed.transpose(1, 2).reshape(n, L, -1))
        return self.unembed(h), kept  # logits (n, L, S)


class Trio(nn.Module):
    """BOS on setting A, BOS on setting B, no BOS on setting A: one module, one engine."""

    def __init__(self, p: Params):
        super().__init__()
        self.S = p.S
        self.nets = nn.ModuleDict({m: AttnOnly(p.S + 1, p.S, p.T + 1, p.width, p.heads, p.layers) for m in MODELS})

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        """a, b (n, T) -> per model the logits (n, T, S), entry t predicting token t+1 (the no-BOS model's last
        entry and every model's entry T-1 predict past the sequence)."""
        bos = torch.full_like(a[:, :1], self.S)
        return {"bos_A": self.nets["bos_A"](torch.cat([bos, a], 1), patterns=False)[0][:, 1:],
                "bos_B": self.nets["bos_B"](torch.cat([bos, b], 1), patterns=False)[0][:, 1:],
                "nobos_A": self.nets["nobos_A"](a, patterns=False)[0]}


def train(ctx) -> None:
    p: Params = ctx.params
    model = Trio(p)

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([p.seed, 7, step])  # fresh chains every step
        return {s.lower(): torch.from_numpy(sample_tokens(sample_chains(s, p.batch_size, p, rng), p.T, p.k, rng))
                for s in SETTINGS}

    def step_fn(engine, batch, step):
        logits = engine(batch["a"], batch["b"])
        target = {"bos_A": batch["a"], "bos_B": batch["b"], "nobos_A": batch["a"]}
        losses = {m: F.cross_entropy(logits[m][:, :-1].reshape(-1, p.S), target[m][:, 1:].reshape(-1))
                  for m in MODELS}
        return sum(losses.values()), {f"ce_{m}": float(v.detach()) for m, v in losses.items()}

    half = p.steps // 2
    ctx.progress(f"phase markov: {len(MODELS)} attention-only transformers in lock-step, {p.steps} steps "
                 f"(held-out KL read at step {half} and at the end)")
    engine = ctx.engine(model, p.lr, arms=model.nets, steps=p.steps, warmup=p.warmup, decay=p.decay, ema=p.ema)
    ctx.fit("markov_half", engine, step_fn, batch_fn, half, log_every=50)  # one schedule over both phases
    read = ctx.ema_network(engine) if p.ema is not None else model  # what evaluate reads at the end
    ctx.save_record("heldout_kl_half", heldout_kl(read, ctx.data_dir, p))
    ctx.fit("markov", engine, step_fn, lambda s: batch_fn(half + s), p.steps - half, log_every=50)


def heldout_kl(model: Trio, data_dir: Path, p: Params) -> dict[str, float]:
    """Each BOS model's KL to the true transitions on the held-out fitting sequences of its own setting (no model
    trains on them: training draws fresh chains), queries t_min..T-2; read half-way and at the end of training."""
    out = {}
    with torch.no_grad():
        for setting in SETTINGS:
            tokens, chains = load_split(data_dir, p, setting, "train")
            c = in_context_counts(tokens, p.S, p.k, p.t_min)
            true = chains[np.repeat(np.arange(len(tokens)), p.T - 1 - p.t_min), c["ctx"]]  # (Q, S)
            t = torch.from_numpy(tokens)
            logits = model(t, t)[f"bos_{setting}"][:, p.t_min : p.T - 1]  # (n, Q/n, S)
            out[f"kl_{setting}"] = kl_ce(logits.softmax(-1).reshape(-1, p.S).double().numpy(), true, c["next"])[0]
    return out


# ---- evaluation ------------------------------------------------------------------------------------------------
def kl_ce(pred: np.ndarray, true: np.ndarray, nxt: np.ndarray) -> tuple[float, float]:
    """Mean KL(true || pred) and cross-entropy of the observed next token, over query positions."""
    pred = np.maximum(pred, 1e-12)
    kl = (true * (np.log(np.maximum(true, 1e-300)) - np.log(pred))).sum(-1)
    return float(kl.mean()), float(-np.log(pred[np.arange(len(nxt)), nxt]).mean())


def attention_recovery(patterns: torch.Tensor, tokens: np.ndarray, p: Params) -> dict[str, float]:
    """Per head of one layer >= 2 (patterns (n, H, L, L) of a BOS model): within-query OLS of log attention on
    overlap over keys 1..t+1 for queries t = t_min..T-2, and Spearman(BOS mass, exact-match count)."""
    ov = overlap_matrix(torch.from_numpy(tokens), p.S, p.k).numpy()  # (n, L, L)
    qpos = np.arange(p.t_min, p.T - 1) + 1  # BOS-indexed query positions
    out = {}
    for h in range(patterns.shape[1]):
        xs, ys, bos, matches = [], [], [], []
        for q in qpos:
            la = np.log(np.maximum(patterns[:, h, q, 1 : q + 1].numpy(), 1e-30))  # (n, q) keys 1..q
            o = ov[:, q, 1 : q + 1]
            xs.append(o - o.mean(1, keepdims=True))
            ys.append(la - la.mean(1, keepdims=True))
            bos.append(patterns[:, h, q, 0].numpy())
            matches.append((o == p.k).sum(1))
        x, y = np.concatenate([a.ravel() for a in xs]), np.concatenate([a.ravel() for a in ys])
        slope = float((x * y).sum() / max((x * x).sum(), 1e-12))
        r2 = float(1 - ((y - slope * x) ** 2).sum() / max((y * y).sum(), 1e-12))
        rho = spearmanr(np.concatenate(bos), np.concatenate(matches)).statistic
        out |= {f"head{h}/beta_hat": slope, f"head{h}/r2": r2, f"head{h}/bos_spearman": float(np.nan_to_num(rho))}
    return out


def report_head(recs: dict[int, dict[str, float]]) -> tuple[int, int]:
    """(layer index, head) to report from attention_recovery per layer index (1 = layer 2, ...): the largest R^2
    among heads with beta_hat > 0, else the largest beta_hat."""
    cands = [(li, int(key.split("/")[0].removeprefix("head"))) for li, rec in recs.items() for key in rec
             if key.endswith("/beta_hat")]
    good = [(li, h) for li, h in cands if recs[li][f"head{h}/beta_hat"] > 0]
    if good:
        return max(good, key=lambda c: recs[c[0]][f"head{c[1]}/r2"])
    return max(cands, key=lambda c: recs[c[0]][f"head{c[1]}/beta_hat"])


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    model = ctx.network("markov", ema=p.ema is not None)
    lam_grid = list(itertools.product(np.linspace(0.1, 0.9, 9), repeat=p.k + 1))
    beta_grid = np.logspace(-2, 1, 20)
    # beta0 on a grid of the pseudo-count it implies, e^{beta0 - k beta} / S in [e^-4, e^3] per symbol
    soft_grid = [(b, g + np.log(p.S) + p.k * b) for b in np.linspace(0, 6, p.grid) for g in np.linspace(-4, 3, p.grid)]
    out: dict[str, float] = {}
    curves = {}
    for setting in SETTINGS:
        fit_tokens, _ = load_split(ctx.data_dir, p, setting, "train")
        fit = in_context_counts(fit_tokens, p.S, p.k, p.t_min)
        beta = tune_grid(list(beta_grid), lambda b: add_beta(fit["order"], b), fit["next"])  # noqa: B023
        lams = tune_grid(lam_grid, lambda lam: jelinek_mercer(fit["order"], lam), fit["next"])  # noqa: B023
        b_soft, beta0 = tune_grid(soft_grid, lambda bg: soft_match(fit["overlap"], *bg), fit["next"])  # noqa: B023
        tokens, chains = load_split(ctx.data_dir, p, setting, "test")
        c = in_context_counts(tokens, p.S, p.k, p.t_min)
        true = chains[np.repeat(np.arange(len(tokens)), p.T - 1 - p.t_min), c["ctx"]]  # (Q, S)
        literal = disentangled_forward(torch.from_numpy(tokens), p.S, p.k, b_soft, beta0)[:, p.t_min : p.T - 1]
        preds = {"mle": mle(c["order"]), "add_beta": add_beta(c["order"], beta),
                 "jm": jelinek_mercer(c["order"], lams), "disentangled": soft_match(c["overlap"], b_soft, beta0)}
        if setting == "A":
            preds["bayes"] = add_beta(c["order"], p.alpha)
        with torch.no_grad():
            t = torch.from_numpy(tokens)
            logits = model(t, t)
        key = "bos_A" if setting == "A" else "bos_B"
        preds["method"] = logits[key][:, p.t_min : p.T - 1].softmax(-1).reshape(-1, p.S).double().numpy()
        if setting == "A":
            preds["no_bos"] = logits["nobos_A"][:, p.t_min : p.T - 1].softmax(-1).reshape(-1, p.S).double().numpy()
        for name, pred in preds.items():
            kl, ce = kl_ce(pred, true, c["next"])
            prefix = "method/" if name == "method" else f"baseline/{name}/"
            out[f"{prefix}kl_{setting}"], out[f"{prefix}ce_{setting}"] = kl, ce
        out[f"detail/{setting}/add_beta_beta"] = float(beta)
        out |= {f"detail/{setting}/jm_lambda{j}": float(v) for j, v in enumerate(lams)}
        out[f"detail/{setting}/disentangled_beta"], out[f"detail/{setting}/disentangled_beta0"] = b_soft, beta0
        out[f"detail/{setting}/disentangled_pseudo_count"] = float(np.exp(beta0 - p.k * b_soft) / p.S)
        out[f"detail/{setting}/disentangled_attention_vs_count_form_maxdiff"] = float(
            np.abs(literal.reshape(-1, p.S).numpy() - preds["disentangled"]).max())
        best = min(out[f"baseline/{b}/kl_{setting}"] for b in ("mle", "add_beta", "jm"))
        out[f"detail/{setting}/best_count_kl"] = best
        curves[setting] = {name: _kl_by_matches(pred, true, c["matches"]) for name, pred in preds.items()}
    out["method/excess_kl_over_bayes_A"] = out["method/kl_A"] - out["baseline/bayes/kl_A"]
    half, end = ctx.record("heldout_kl_half"), heldout_kl(model, ctx.data_dir, p)
    for setting in SETTINGS:
        out[f"detail/convergence/heldout_kl_{setting}_half"] = half[f"kl_{setting}"]
        out[f"detail/convergence/heldout_kl_{setting}_end"] = end[f"kl_{setting}"]
    out["detail/convergence/kl_drop_last_half"] = max(half[f"kl_{s_}"] - end[f"kl_{s_}"] for s_ in SETTINGS)
    tokens, _ = load_split(ctx.data_dir, p, "A", "test")
    with torch.no_grad():
        t = torch.from_numpy(tokens)
        _, patterns = model.nets["bos_A"](torch.cat([torch.full_like(t[:, :1], p.S), t], 1))
    recs = {li: attention_recovery(patterns[li], tokens, p) for li in range(1, p.layers)}  # layers 2 .. L
    for li, rec in recs.items():
        out |= {f"detail/attention/layer{li + 1}/{k_}": v for k_, v in rec.items()}
    li, h = report_head(recs)
    rec = recs[li]
    out |= {"method/attn_beta_hat": rec[f"head{h}/beta_hat"], "method/attn_r2": rec[f"head{h}/r2"],
            "method/bos_match_spearman": rec[f"head{h}/bos_spearman"], "detail/attention/report_head": float(h),
            "detail/attention/report_layer": float(li + 1)}
    _plots(ctx, p, curves, patterns[li], tokens, h, out)
    return out


def _kl_by_matches(pred, true, matches, cap: int = 12) -> np.ndarray:
    kl = (true * (np.log(np.maximum(true, 1e-300)) - np.log(np.maximum(pred, 1e-12)))).sum(-1)
    m = np.minimum(matches, cap).astype(int)
    return np.array([kl[m == i].mean() if (m == i).any() else np.nan for i in range(cap + 1)])


def _plots(ctx, p: Params, curves: dict, pattern: torch.Tensor, tokens: np.ndarray, head: int, out: dict) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, setting in zip(axes, SETTINGS, strict=True):
        for name, kl in curves[setting].items():
            ax.plot(kl, "o-" if name == "method" else ".--", ms=3, lw=2 if name == "method" else 1, label=name)
        ax.set(xlabel="exact context matches so far (capped at 12)", ylabel="KL(true || predicted)",
               title=f"Setting {setting}", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ctx.plots_dir / "kl_by_matches.png", dpi=110)
    plt.close(fig)

    q = p.T - 1  # last query position, first test sequence
    ov = overlap_matrix(torch.from_numpy(tokens[:1]), p.S, p.k)[0, q, 1 : q + 1].numpy()
    att = pattern[0, head, q, 1 : q + 1].numpy()
    fig, ax = plt.subplots(figsize=(5, 3.8))
    jitter = np.random.default_rng(0).uniform(-0.1, 0.1, len(ov))
    ax.scatter(ov + jitter, np.log(att), s=8)
    ax.set(xlabel="overlap with the current context", ylabel="log attention",
           title=f"Layer {int(out['detail/attention/report_layer'])} head {head}: "
                 f"beta_hat {out['method/attn_beta_hat']:.2f}, R^2 {out['method/attn_r2']:.2f}")
    fig.tight_layout()
    fig.savefig(ctx.plots_dir / "attention_vs_overlap.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="induction_smoothing",
    title="Induction heads as smoothed in-context estimators on order-k Markov chains",
    seed="000_2dd18ae8605fb5c1.txt, abstract 12",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/kl_A", "min"),
    claim=Claim(premises=(  # the bar's reason is in the docstring
        Compare("method/attn_r2", ">=", 0.5, name="induction_heads_formed"),
        # trained to the claim's resolution, not stopped mid-descent: over the second half of training each BOS
        # model's held-out KL fell by less than the claim's margin (the docstring says why not the loss plateau)
        Compare("detail/convergence/kl_drop_last_half", "<", KL_TOL, name="kl_settled_in_last_half"),
    ), all_of=(
        Compare("method/kl_A", "<=", ("baseline/mle/kl_A", "baseline/add_beta/kl_A", "baseline/jm/kl_A"),
                margin=KL_TOL),
        Compare("method/kl_B", "<=", ("baseline/mle/kl_B", "baseline/add_beta/kl_B", "baseline/jm/kl_B"),
                margin=KL_TOL),
        Compare("method/kl_B", "<", ("baseline/mle/kl_B", "baseline/add_beta/kl_B")),
        Compare("method/attn_beta_hat", ">", 0.0),
        Compare("method/bos_match_spearman", "<", 0.0),
        Compare("baseline/no_bos/kl_A", ">", "method/kl_A"),
    ), summary="the trained transformer's KL is within 0.005 nats of the best count baseline in A and B and below "
               "MLE and add-beta in B; a head of layer 2 or above weights keys by overlap and its BOS mass falls "
               "with matches; removing BOS hurts in A"),
)
