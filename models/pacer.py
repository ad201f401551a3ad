"""PACER: acyclic-by-construction causal discovery from perturbation data.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 13. Spec: ../shared/papers/pacer.md.

What it implements (function names in brackets):
- data: Erdos-Renyi and scale-free DAGs, linear-Gaussian SEM with weights +-U[0.5, 2] and noise sigma ~ U[0.5, 1.5],
  observational samples, single-node perfect interventions do(x_j) ~ N(2, 1), two held-out regimes on other
  targets, all standardised by the observational std [random_dag, sample_sem, prepare];
- per-regime second moments M_r = X_r^T X_r / n_r, so a likelihood evaluation never touches samples [moments];
- the permutation model: Plackett-Luce with logits theta, orderings by Gumbel-perturbed sorting, log-probability
  [sample_orderings, plackett_luce_logp]; the edge model P_ij = sigmoid(Phi_ij) 1[pos(i) < pos(j)] [edge_probs];
- the closed-form expected interventional log-likelihood under independent Bernoulli edges
  E_A log N(x_j; sum_i A_ij W_ij x_i, s_j^2) = -1/2 log(2 pi s_j^2) - [(x_j - sum_i P_ij W_ij x_i)^2
  + sum_i P_ij (1 - P_ij) W_ij^2 x_i^2] / (2 s_j^2), summed over non-intervened j [expected_loglik];
- the objective E_pi[expected log-lik] + log prior (Bernoulli edges), the score-function gradient for theta with a
  leave-one-out baseline over S orderings, pathwise gradients for Phi, W, log s [Pacer.loss], by Adam through
  DeepSpeed; output: ordering by theta, edges with P_ij > 0.5 [Pacer.graph];
- baselines: NOTEARS-linear with the same masked Gaussian likelihood and the augmented Lagrangian on
  h(W) = tr exp(W o W) - d, thresholded at 0.3 [Notears]; sortnregress [sortnregress]; a random DAG with the true
  edge count [random_dag_like];
- exact references: the score-optimal DAG under the same objective (MLE parameters, same edge prior) by
  exact dynamic programming over variable subsets for d <= `exact_max_d` [exact_best_dag], the true DAG's score
  [node_score], and each returned graph's distance to both (score gap per sample, SHD) [evaluate].

Deviations from the paper (choices the abstract left open):
- Plackett-Luce + score function with a leave-one-out baseline, independent Bernoulli edges, and a Bernoulli edge
  prior with penalty log((1 - rho)/rho) = 1/2 log n (BIC-like, n = training samples) are our choices; the exact
  reference optimises the same penalised likelihood, so the score gap measures only the optimiser.
- No intercepts: the SEM has zero-mean noise; interventions shift means, which the regressions absorb through the
  parents as in the paper's linear-Gaussian mechanism.
- Single-node interventions, so `regimes.parquet` stores one target per regime (-1 = observational).
- Every graph's PACER runs in one lock-step module (one DeepSpeed engine), and likewise every graph's NOTEARS, so
  the wall-clock times are for all graphs together; NOTEARS stops at h < `notears_h_tol` (or at the round cap, then
  flagged as capped).
- The search starts at infinite temperature: for the first `warmup` share of the steps orderings are uniform
  (theta / T with T -> inf) and theta is frozen, so W and Phi are fitted for every pair in both directions before
  the ordering is learned. Started from theta = 0 with W = 0 instead, the first orderings' edges are the only
  ones with fitted weights, the score function keeps favouring them and the ordering locks in (a reversed pair's
  W never trains). After the warm-up the temperature is annealed geometrically from `temperature` to 1 over the
  `anneal` share of the steps [ordering_temperature] rather than dropped to 1 at once, so W and Phi follow the
  ordering as it concentrates; dropped at once, some scale-free graphs locked into a wrong ordering. Restarts
  (several chains with their own Gumbel streams, the best by the objective) were tried on the small graphs and
  left out: they converged to the same or worse orderings.
- The noise scale is profiled out: each s_j^2 sits at its maximiser given W and P (the expected residual variance),
  so the objective is the Gaussian log-likelihood at the MLE noise, as in the exact reference's score, and no
  log sigma is learned (a fixed-then-learned sigma made W's gradient depend on how far sigma lagged). NOTEARS uses
  the same profiled likelihood.
- Adam's beta2 is a parameter of each arm (`beta2`, `notears_beta2`). An edge whose
  weight has gone to zero is held only by the edge penalty, whose gradient through a near-saturated sigmoid(Phi) is
  orders of magnitude below the early gradients; with beta2 = 0.999 Adam's second moment remembers those for ~1,000
  steps, so such edges stayed at P ~ 1 with W ~ 0 (spurious edges in the returned graph). A shorter memory lets the
  penalty remove them. What remains is the ordering's own local optima, which is why the premise below can fail.
- Structural prior knowledge: `known_edges` (src, dst, present) fix those logits (sigmoid = 1 or 0 wherever the
  ordering allows the pair); smoke and full give none (synthetic node labels carry no prior knowledge).
- MLP conditional densities are not implemented: the closed-form expected log-likelihood, the part of the paper
  this pipeline tests, exists only for linear-Gaussian mechanisms (an MLP would need Monte Carlo over A), and every
  profile's data here are linear-Gaussian SEMs (the Sachs loader feeds the same linear model).
- full: the Sachs loader reads one CSV per condition and a `targets.json` naming each condition's intervened
  proteins (`load_condition_csvs`); the Perturb-seq .h5ad loader is not implemented (anndata is not installed).

Premise and timing:
- premise search_reaches_exact_optimum: on the small graphs (the claim's small d, where the exact optimum is
  computed), PACER's graph scores on average within 0.01 nats per training sample of the exact score-optimal DAG
  under the same objective. The bar is a fifth of what the weakest true edge of the spec's SEM explains (weight
  0.5 against noise sigma 1.5 on a unit-variance parent: 1/2 log(1 + 0.25 / 2.25), about 0.05 nats per sample),
  so a search within it has lost less than one true edge's worth of likelihood. Without it the SHD comparisons
  measure PACER's optimiser, not its objective.
- the speed part is wall clock, so it is `timed`: each method's optimisation steps (PACER's Adam steps, NOTEARS's
  steps over the rounds it ran) are cut into 5 equal consecutive blocks, whose wall times are the 5 samples,
  paired by block (sum: the total time); the blocks are not independent repeats, so the interval also spans how
  the cost varies over a run [timing_blocks].
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import networkx as nx
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from sklearn.linear_model import LassoLarsIC, LinearRegression
from sklearn.metrics import average_precision_score
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams

LOG2PI = float(np.log(2 * np.pi))


class GraphSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    d: int = Field(ge=2)
    kind: Literal["er", "sf"]

    @property
    def name(self) -> str:
        return f"{self.kind}{self.d}"


class Params(PaperParams):
    dataset: Literal["synthetic", "sachs"] = Field("synthetic", description="Synthetic SEMs, or Sachs CSV folder.")
    dataset_dir: str = Field("", description="sachs: folder of per-condition CSVs + targets.json + truth.csv.")
    graphs: list[GraphSpec] = Field(min_length=1, description="Synthetic graphs (d, er | sf), one each.")
    degree: float = Field(2.0, gt=0, description="Expected degree of the synthetic DAGs.")
    n_obs: int = Field(1000, ge=10, description="Observational samples.")
    regimes: int = Field(5, ge=0, description="R single-node perfect-intervention training regimes.")
    per_regime: int = Field(200, ge=5, description="Samples per intervention regime (held-out ones too).")
    held_out: int = Field(2, ge=1, description="Held-out intervention regimes on other targets.")
    orderings: int = Field(16, ge=2, description="S orderings sampled per PACER step.")
    steps: int = Field(1000, ge=1, description="PACER Adam steps.")
    lr: float = Field(0.03, gt=0, description="PACER learning rate.")
    beta2: float = Field(0.999, gt=0, lt=1, description="PACER's Adam beta2 (second-moment decay).")
    warmup: float = Field(0.25, ge=0, lt=1, description="Share of PACER's steps at infinite temperature (uniform "
                          "orderings, theta frozen) before theta is learned.")
    temperature: float = Field(10.0, ge=1, description="Ordering temperature T0 when theta starts to learn: "
                               "orderings ~ Plackett-Luce(theta / T), T annealed geometrically from T0 to 1.")
    anneal: float = Field(0.5, ge=0, le=1, description="Share of PACER's steps over which T goes from T0 to 1, "
                          "right after the warm-up (then T = 1).")
    known_edges: list[tuple[int, int, bool]] = Field([], description="Structural prior knowledge (src, dst, present): "
                                                     "fixed edge logits, for every graph with both nodes.")
    notears_rounds: int = Field(10, ge=1, description="Augmented-Lagrangian rounds at most.")
    notears_steps: int = Field(120, ge=1, description="Adam steps per augmented-Lagrangian round.")
    notears_lr: float = Field(0.03, gt=0)
    notears_beta2: float = Field(0.999, gt=0, lt=1, description="NOTEARS's Adam beta2.")
    notears_l1: float = Field(0.01, ge=0, description="L1 weight of NOTEARS (per sample-normalised loss).")
    notears_h_tol: float = Field(1e-8, gt=0, description="NOTEARS stops when h(W) falls below this.")
    threshold: float = Field(0.3, ge=0, description="NOTEARS edge threshold on |W|.")
    exact_max_d: int = Field(12, ge=0, description="Compute the exact score-optimal DAG for graphs with d <= this.")


# ---- data --------------------------------------------------------------------------------------------------
def random_dag(spec: GraphSpec, degree: float, rng: np.random.Generator) -> np.ndarray:
    """Weighted adjacency (d, d), W[i, j] != 0 iff i -> j, acyclic under a random ordering."""
    d = spec.d
    if spec.kind == "er":
        upper = np.triu(rng.random((d, d)) < degree / (d - 1), 1)
    else:  # Barabasi-Albert, m = degree / 2 edges per new node, oriented from older to newer nodes
        g = nx.barabasi_albert_graph(d, max(1, round(degree / 2)), seed=int(rng.integers(2**31)))
        upper = np.zeros((d, d), bool)
        for a, b in g.edges:
            upper[min(a, b), max(a, b)] = True
    weights = rng.uniform(0.5, 2.0, (d, d)) * rng.choice([-1.0, 1.0], (d, d))
    perm = rng.permutation(d)
    return (upper * weights)[np.ix_(perm, perm)]


def sample_sem(w: np.ndarray, sigma: np.ndarray, n: int, target: int, rng: np.random.Generator) -> np.ndarray:
    """n samples of x = W^T x + e, with do(x_target) ~ N(2, 1) when target >= 0."""
    d = len(w)
    order = list(nx.topological_sort(nx.DiGraph(w != 0)))
    order += [j for j in range(d) if j not in order]
    x = np.zeros((n, d))
    for j in order:
        x[:, j] = rng.normal(2.0, 1.0, n) if j == target else x @ w[:, j] + sigma[j] * rng.standard_normal(n)
    return x


def _targets_text(targets: list[int]) -> str:
    return ",".join(str(t) for t in targets)


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    graphs = []  # (name, blocks of samples, their targets, held-out flags, true weights)
    if p.dataset == "sachs":
        from models.inputs import input_path  # relative paths: from the project root

        blocks, targets, names = load_condition_csvs(input_path(p.dataset_dir))
        truth = np.zeros((len(names), len(names)))
        for line in (input_path(p.dataset_dir) / "truth.csv").read_text().splitlines()[1:]:
            a, b = line.split(",")[:2]
            truth[names.index(a), names.index(b)] = 1.0
        order = [i for i, t in enumerate(targets) if not t] + [i for i, t in enumerate(targets) if t]
        held = [False] * (len(order) - p.held_out) + [True] * p.held_out
        graphs.append(("sachs", [blocks[i] for i in order], [targets[i] for i in order], held, truth))
    for spec in p.graphs if p.dataset == "synthetic" else []:
        w = random_dag(spec, p.degree, rng)
        sigma = rng.uniform(0.5, 1.5, spec.d)
        chosen = rng.permutation(spec.d)[: p.regimes + p.held_out]
        plan = [(-1, p.n_obs, False)] + [(int(t), p.per_regime, i >= p.regimes) for i, t in enumerate(chosen)]
        blocks = [sample_sem(w, sigma, n, t, rng) for t, n, _ in plan]
        graphs.append((spec.name, blocks, [[t] if t >= 0 else [] for t, _, _ in plan], [h for *_, h in plan], w))
    samples: dict[str, list] = {"graph": [], "regime": [], "x": []}
    regimes: dict[str, list] = {"graph": [], "regime": [], "targets": [], "held_out": []}
    truth: dict[str, list] = {"graph": [], "src": [], "dst": [], "weight": []}
    d_max = max(len(g[4]) for g in graphs)
    for name, blocks, targets, held, w in graphs:
        d = len(w)
        scale = blocks[0].std(0)  # observational std: removes var-sortability
        for r, x in enumerate(blocks):
            padded = np.full((len(x), d_max), np.nan)
            padded[:, :d] = x / scale
            samples["x"] += list(padded)
            samples["graph"] += [name] * len(x)
            samples["regime"] += [r] * len(x)
            regimes["graph"].append(name)
            regimes["regime"].append(r)
            regimes["targets"].append(_targets_text(targets[r]))
            regimes["held_out"].append(held[r])
        src, dst = np.nonzero(w)
        truth["graph"] += [name] * len(src)
        truth["src"] += list(src)
        truth["dst"] += list(dst)
        truth["weight"] += list(w[src, dst] * scale[src] / scale[dst])  # weights in standardised units
    x = np.asarray(samples.pop("x"), np.float64)
    write_table(out_dir / "samples.parquet", {"sample_id": np.arange(len(x)), **samples,
                                              **{f"x_{j}": x[:, j] for j in range(d_max)}})
    write_table(out_dir / "regimes.parquet", regimes)
    write_table(out_dir / "truth.parquet", truth)


def load_condition_csvs(folder: Path) -> tuple[list[np.ndarray], list[list[int]], list[str]]:
    """Sachs layout: one CSV per condition (header = protein names), `targets.json` {file stem: [proteins]}."""
    targets = json.loads((folder / "targets.json").read_text())
    blocks, regime_targets, names = [], [], None
    for path in sorted(folder.glob("*.csv")):
        if path.stem == "truth":
            continue
        header = path.read_text().splitlines()[0].split(",")
        names = names or header
        blocks.append(np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)[:, [header.index(n) for n in names]])
        regime_targets.append([names.index(t) for t in targets.get(path.stem, [])])
    return blocks, regime_targets, names or []


def load_graphs(data_dir: Path) -> dict[str, dict]:
    """Per graph: training moments M (R, d, d), counts n (R,), keep (R, d) = node not intervened, the held-out
    regimes' moments likewise, and the true adjacency (d, d)."""
    t, reg, tr = (read_table(data_dir / f"{n}.parquet") for n in ("samples", "regimes", "truth"))
    out = {}
    for name in dict.fromkeys(reg["graph"]):
        rows = reg["graph"] == name
        d = int(max(tr["dst"][tr["graph"] == name].max(initial=0), tr["src"][tr["graph"] == name].max(initial=0)) + 1)
        d = max(d, sum(1 for k in t if k.startswith("x_") and not np.isnan(t[k][t["graph"] == name]).all()))
        g: dict = {"d": d, "train": [], "held": []}
        mine = t["graph"] == name
        columns, regime = np.stack([t[f"x_{j}"][mine] for j in range(d)], 1), t["regime"][mine]  # graph rows, once
        for r, targets, held in zip(reg["regime"][rows], reg["targets"][rows], reg["held_out"][rows], strict=True):
            x = columns[regime == r]  # (n_r, d)
            keep = np.ones(d, bool)
            keep[[int(v) for v in str(targets).split(",") if v != ""]] = False
            g["held" if held else "train"].append((x, keep))
        adj = np.zeros((d, d))
        sel = tr["graph"] == name
        adj[tr["src"][sel], tr["dst"][sel]] = 1.0
        g["truth"] = adj
        for split in ("train", "held"):
            xs = g.pop(split)
            moments = np.empty((len(xs), d, d))  # filled in place: a fresh (d, d) temporary per regime costs the
            for i, (x, _) in enumerate(xs):  # kernel zeroing its pages, most of a d = 2000 load
                np.matmul(x.T, x, out=moments[i])
                moments[i] /= len(x)
            g[split] = {"M": moments, "n": np.array([len(x) for x, _ in xs], float),
                        "keep": np.stack([k for _, k in xs])}
            if split == "train":
                g["obs"] = xs[0][0]
        out[name] = g
    return out


# ---- the paper's mechanism -----------------------------------------------------------------------------------------
CHUNK_BYTES = 2**30  # (S, R, d, d) intermediates above this are computed a few regimes at a time


def _quad(b: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """M_jj - 2 (B^T M)_jj + (B^T M B)_jj: b (S, d, d), m (R, d, d) -> (S, R, d)."""
    btm = torch.einsum("sij,rik->srjk", b, m)  # (S, R, d, d): (B^T M_r)
    return (torch.diagonal(m, dim1=1, dim2=2)[None]  # (1, R, d): M_jj
            - 2 * torch.diagonal(btm, dim1=2, dim2=3)  # (S, R, d): 2 (B^T M)_jj
            + torch.einsum("srjk,skj->srj", btm, b))  # (S, R, d): (B^T M B)_jj


def expected_loglik(p_edge: torch.Tensor, w: torch.Tensor, log_sigma: torch.Tensor | None, m: torch.Tensor,
                    n: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Closed-form E_A[sum of log-likelihoods] with A_ij ~ Bernoulli(P_ij) independent.
    p_edge (S, d, d), w (d, d), log_sigma (d,), m (R, d, d) per-regime second moments, n (R,), keep (R, d) -> (S,).
    log_sigma None: the noise scale profiled out, each s_j^2 at its maximiser E_A[RSS_j] / n_j (the expected
    residual variance over the regimes where j is not intervened), so the value is
    sum_j -n_j / 2 (log(2 pi E_A[RSS_j] / n_j) + 1) and no sigma has to be learned.
    The (S, R, d, d) intermediate of the quadratic term is formed a block of regimes at a time once it passes
    CHUNK_BYTES (d = 2000: 8 orderings x 49 regimes would be 6 GiB, kept again for the backward pass), each block
    recomputed in the backward pass instead of kept (activation checkpointing)."""
    b = p_edge * w  # (S, d, d): E[A o W]
    per = max(1, CHUNK_BYTES // max(1, b.numel() * b.element_size()))  # regimes a block
    if per >= len(m):
        quad = _quad(b, m)
    else:
        quad = torch.cat([checkpoint(_quad, b, m[i : i + per], use_reentrant=False)
                          for i in range(0, len(m), per)], 1)  # (S, R, d)
    var = torch.einsum("sij,ri->srj", p_edge * (1 - p_edge) * w**2, torch.diagonal(m, dim1=1, dim2=2))  # (S, R, d)
    weight = (n[:, None] * keep)[None]  # (1, R, d): samples where j is not intervened
    if log_sigma is None:
        n_j = weight.sum(1)  # (1, d)
        rss = ((quad + var) * weight).sum(1)  # (S, d): E_A[RSS_j]
        return (-0.5 * n_j * (LOG2PI + torch.log(rss / n_j.clamp(min=1) + 1e-12) + 1)).sum(1)  # (S,)
    ll = -0.5 * (LOG2PI + 2 * log_sigma) - (quad + var) / (2 * torch.exp(2 * log_sigma))  # (S, R, d) per sample
    return (ll * weight).sum((1, 2))  # (S,)


def sample_orderings(theta: torch.Tensor, gumbel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-perturbed sort = Plackett-Luce samples. theta (d,), gumbel (S, d) -> order (S, d), position (S, d)."""
    order = torch.argsort(theta[None] + gumbel, dim=1, descending=True)
    return order, torch.argsort(order, dim=1)


def plackett_luce_logp(theta: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """log P(order) = sum_m [theta_{o_m} - logsumexp_{k >= m} theta_{o_k}]; order (S, d) -> (S,)."""
    th = theta[order]  # (S, d)
    tail = torch.logcumsumexp(th.flip(1), dim=1).flip(1)  # (S, d)
    return (th - tail).sum(1)


def edge_probs(phi: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """P_ij = sigmoid(Phi_ij) 1[pos(i) < pos(j)]; position (S, d) -> (S, d, d). Every support is a DAG."""
    allowed = position[:, :, None] < position[:, None, :]  # (S, d, d)
    return torch.sigmoid(phi)[None] * allowed


KNOWN_LOGIT = 30.0  # sigmoid(30) = 1 - 1e-13: a known edge is present wherever the ordering allows it


class Pacer(nn.Module):
    def __init__(self, d: int, moments: dict, edge_penalty: float,
                 known: tuple[tuple[int, int, bool], ...] = (), profile_sigma: bool = True):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(d))
        self.phi_free = nn.Parameter(torch.zeros(d, d))
        fixed = torch.full((d, d), float("nan"))  # structural prior knowledge: fixed logits, NaN = learned
        for i, j, present in known:
            fixed[i, j] = KNOWN_LOGIT if present else -KNOWN_LOGIT
        self.register_buffer("fixed", fixed)
        self.w = nn.Parameter(torch.zeros(d, d))
        self.log_sigma = None if profile_sigma else nn.Parameter(torch.zeros(d))  # None: profiled out
        for k in ("M", "n", "keep"):
            self.register_buffer(k, torch.as_tensor(moments[k], dtype=torch.float32))
        self.edge_penalty = edge_penalty
        self.temperature = 1.0  # orderings ~ Plackett-Luce(theta / temperature); set per step by train()

    @property
    def phi(self) -> torch.Tensor:
        """Edge logits: the learned ones, with known edges and non-edges fixed (no gradient reaches them)."""
        return torch.where(torch.isnan(self.fixed), self.phi_free, self.fixed)

    def objective(self, position: torch.Tensor) -> torch.Tensor:
        """Expected log-likelihood + expected log prior (up to a constant) per ordering: (S,)."""
        p = edge_probs(self.phi, position)
        ll = expected_loglik(p, self.w, self.log_sigma, self.M, self.n, self.keep)
        return ll - self.edge_penalty * p.sum((1, 2))

    def loss(self, gumbel: torch.Tensor, explore: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Negative surrogate, per training sample: pathwise for Phi, W, sigma; score function with a leave-one-out
        baseline for theta. gumbel (S, d). explore: the infinite-temperature start, orderings uniform (theta / T
        with T -> inf), so every pair's W and Phi are fitted in both directions; theta gets a zero gradient."""
        if explore:
            position = sample_orderings(torch.zeros_like(self.theta), gumbel)[1]
            f = self.objective(position)  # (S,)
            return -(f.mean() + 0.0 * self.theta.sum()) / self.n.sum(), f.detach().mean() / self.n.sum()
        theta = self.theta / self.temperature
        order, position = sample_orderings(theta.detach(), gumbel)
        f = self.objective(position)  # (S,)
        s = len(f)
        baseline = (f.sum() - f) / max(s - 1, 1)  # (S,)
        logp = plackett_luce_logp(theta, order)  # (S,)
        surrogate = f.mean() + ((f - baseline).detach() * logp).mean()
        return -surrogate / self.n.sum(), f.detach().mean() / self.n.sum()

    @torch.no_grad()
    def graph(self) -> np.ndarray:
        position = torch.argsort(torch.argsort(self.theta, descending=True))[None]  # (1, d)
        return (edge_probs(self.phi, position)[0] > 0.5).numpy().astype(float)

    @torch.no_grad()
    def edge_scores(self, samples: int = 512) -> np.ndarray:
        g = torch.Generator().manual_seed(0)
        gumbel = -torch.log(-torch.log(torch.rand(samples, len(self.theta), generator=g)))
        return edge_probs(self.phi, sample_orderings(self.theta, gumbel)[1]).mean(0).numpy()


class PacerSet(nn.Module):
    """Every graph's PACER in one module: forward(gumbel per graph) -> summed loss."""

    def __init__(self, models: dict[str, Pacer]):
        super().__init__()
        self.models = nn.ModuleDict(models)
        self.explore = False  # set per step by train(): the warm-up at infinite temperature

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        total, metrics = 0.0, {}
        for name, model in self.models.items():
            loss, ll = model.loss(batch[name][:, : len(model.theta)], self.explore)
            total = total + loss
            metrics[f"{name}_objective"] = float(ll)
        return total, metrics


# ---- baselines -------------------------------------------------------------------------------------------------
class Notears(nn.Module):
    """NOTEARS-linear with the masked Gaussian likelihood: loss = -ll/n + l1 |W| + alpha h + rho/2 h^2."""

    def __init__(self, d: int, moments: dict, l1: float, profile_sigma: bool = True):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d, d))
        self.log_sigma = None if profile_sigma else nn.Parameter(torch.zeros(d))  # None: profiled out, as PACER's
        for k in ("M", "n", "keep"):
            self.register_buffer(k, torch.as_tensor(moments[k], dtype=torch.float32))
        self.register_buffer("off_diag", 1 - torch.eye(d)[None])  # (1, d, d): deterministic edges, no self-loops
        self.l1 = l1

    def h(self) -> torch.Tensor:
        w2 = (self.w * self.off_diag[0]).double() ** 2
        return (torch.trace(torch.linalg.matrix_exp(w2)) - len(w2)).float()  # float64: h down to 1e-8 is rounding

    def loss(self, alpha: float, rho: float) -> torch.Tensor:
        ll = expected_loglik(self.off_diag, self.w, self.log_sigma, self.M, self.n, self.keep)[0] / self.n.sum()
        h = self.h()
        return -ll + self.l1 * (self.w * self.off_diag[0]).abs().sum() + alpha * h + 0.5 * rho * h**2


class NotearsSet(nn.Module):
    def __init__(self, models: dict[str, Notears]):
        super().__init__()
        self.models = nn.ModuleDict(models)

    def forward(self, lagrange: dict[str, tuple[float, float]]) -> torch.Tensor:
        return sum(m.loss(*lagrange[name]) for name, m in self.models.items())


def sortnregress(x: np.ndarray) -> np.ndarray:
    """Reisach et al. 2021: order by marginal variance, regress each node on its predecessors with LassoLarsIC
    (BIC) on OLS-rescaled inputs; returns |coefficients| (d, d) as edge scores."""
    d = x.shape[1]
    order = np.argsort(x.var(0))
    scores = np.zeros((d, d))
    for k in range(1, d):
        pred, j = order[:k], order[k]
        ols = np.abs(LinearRegression().fit(x[:, pred], x[:, j]).coef_)
        lasso = LassoLarsIC(criterion="bic").fit(x[:, pred] * ols, x[:, j])
        scores[pred, j] = np.abs(lasso.coef_ * ols)
    return scores


def random_dag_like(truth: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    d = len(truth)
    perm = rng.permutation(d)
    pairs = [(perm[a], perm[b]) for a in range(d) for b in range(a + 1, d)]
    adj = np.zeros((d, d))
    for k in rng.choice(len(pairs), int(truth.sum()), replace=False):
        adj[pairs[k]] = 1.0
    return adj


# ---- exact references: node scores and the score-optimal DAG -------------------------------------------------------
def pooled(g: dict, j: int) -> tuple[np.ndarray, float]:
    """Sum of x x^T over the training regimes where node j is not intervened, and their sample count."""
    tr = g["train"]
    w = tr["n"] * tr["keep"][:, j]  # (R,)
    return np.einsum("r,rik->ik", w, tr["M"]), float(w.sum())


def node_fit(g: dict, j: int, parents: np.ndarray) -> tuple[np.ndarray, float, float]:
    """MLE of x_j on its parents (no intercept): coefficients, noise variance, log-likelihood."""
    s, n = pooled(g, j)
    beta = np.linalg.solve(s[np.ix_(parents, parents)] + 1e-9 * np.eye(len(parents)), s[parents, j]) \
        if len(parents) else np.zeros(0)
    var = max((s[j, j] - beta @ s[parents, j]) / n, 1e-12)
    return beta, var, -0.5 * n * (LOG2PI + np.log(var) + 1)


def graph_score(adj: np.ndarray, g: dict, penalty: float) -> float:
    """Penalised log-likelihood (PACER's objective at its optimum parameters) of any parent sets, cyclic or not."""
    return sum(node_fit(g, j, np.flatnonzero(adj[:, j]))[2] - penalty * adj[:, j].sum() for j in range(len(adj)))


def exact_best_dag(g: dict, penalty: float) -> tuple[np.ndarray, float]:
    """argmax over all DAGs of graph_score: best parent set within every candidate set by a subset-max (zeta)
    transform, then the best sink order by dynamic programming over subsets (Silander & Myllymaki 2006)."""
    d = g["d"]
    full = 1 << d
    masks = np.arange(full)
    best_ps, best_arg = [], []
    for j in range(d):
        score = np.full(full, -np.inf)
        for m in masks[(masks >> j) & 1 == 0]:
            parents = np.flatnonzero((m >> np.arange(d)) & 1)
            score[m] = node_fit(g, j, parents)[2] - penalty * len(parents)
        arg = masks.copy()
        for k in range(d):  # best subset of each mask: max over masks with bit k removed
            has = masks[(masks >> k) & 1 == 1]
            better = score[has ^ (1 << k)] > score[has]
            score[has[better]] = score[has[better] ^ (1 << k)]
            arg[has[better]] = arg[has[better] ^ (1 << k)]
        best_ps.append(score)
        best_arg.append(arg)
    total, sink = np.full(full, -np.inf), np.zeros(full, int)
    total[0] = 0.0
    for m in range(1, full):
        for j in np.flatnonzero((m >> np.arange(d)) & 1):
            v = total[m ^ (1 << j)] + best_ps[j][m ^ (1 << j)]
            if v > total[m]:
                total[m], sink[m] = v, j
    adj, m = np.zeros((d, d)), full - 1
    while m:
        j = sink[m]
        m ^= 1 << j
        adj[np.flatnonzero((best_arg[j][m] >> np.arange(d)) & 1), j] = 1.0
    return adj, float(total[-1])


def heldout_nll(adj: np.ndarray, g: dict) -> float:
    """Per-sample NLL on the held-out intervention regimes, conditionals refit on training data by MLE."""
    held, total = g["held"], 0.0
    for j in range(g["d"]):
        parents = np.flatnonzero(adj[:, j])
        beta, var, _ = node_fit(g, j, parents)
        m = held["M"]  # (R, d, d)
        mse = m[:, j, j] - 2 * m[:, parents, j] @ beta + np.einsum("i,rik,k->r", beta, m[:, parents][:, :, parents],
                                                                    beta)
        total += float((held["n"] * held["keep"][:, j] * (0.5 * (LOG2PI + np.log(var)) + mse / (2 * var))).sum())
    return total / held["n"].sum()


def shd(pred: np.ndarray, truth: np.ndarray) -> float:
    """Additions + deletions + reversals: unordered pairs whose edge state differs."""
    a, b = pred > 0, truth > 0
    differs = (a != b) | (a.T != b.T)
    return float(np.triu(differs, 1).sum())


def edge_penalty(g: dict) -> float:
    return 0.5 * float(np.log(g["train"]["n"].sum()))


# ---- training: every graph's PACER in one engine, then every graph's NOTEARS in another -----------------------------
TIMING_BLOCKS = 5  # timed samples per replicate: the wall time of 5 equal consecutive shares of the steps


def _clock(state: dict[str, torch.Tensor]):
    """Accumulate wall time between optimisation steps into a checkpointed tensor (survives resume); tick(i) also
    stores the elapsed time at the start of step i in state["marks"][i]."""
    last: list[float] = []

    def tick(i: int) -> None:
        now = time.perf_counter()
        if last:
            state["elapsed"] += now - last[-1]
        last.append(now)
        state["marks"][i] = state["elapsed"][0]

    return tick


def timing_blocks(marks: np.ndarray, total: float, blocks: int = TIMING_BLOCKS) -> list[float]:
    """Wall time of `blocks` equal consecutive shares of N steps: marks (N,) the elapsed time at each step's start,
    total the elapsed time at the end."""
    edges = np.linspace(0, len(marks), blocks + 1).round().astype(int)
    return [float(v) for v in np.diff(np.append(marks, total)[edges])]


def ordering_temperature(step: int, p: Params) -> float:
    """T0 at the end of the warm-up, geometric down to 1 over the `anneal` share of the steps, then 1."""
    start, span = p.warmup * p.steps, p.anneal * p.steps
    progress = min(1.0, max(0.0, step - start) / span) if span > 0 else 1.0
    return float(p.temperature ** (1.0 - progress))


def train(ctx) -> None:
    p: Params = ctx.params
    graphs = load_graphs(ctx.data_dir)
    d_max = max(g["d"] for g in graphs.values())
    torch.manual_seed(p.seed)

    known = {n: tuple(e for e in p.known_edges if max(e[0], e[1]) < g["d"]) for n, g in graphs.items()}
    pacer = PacerSet({n: Pacer(g["d"], g["train"], edge_penalty(g), known[n]) for n, g in graphs.items()})
    p_state = {"elapsed": torch.zeros(1), "marks": torch.zeros(p.steps, dtype=torch.float64)}
    p_tick = _clock(p_state)

    def pacer_batch(step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(p.seed * 1_000_003 + step)
        u = torch.rand(len(graphs), p.orderings, d_max, generator=gen).clamp(1e-10, 1 - 1e-7)
        return {n: -torch.log(-torch.log(u[i])) for i, n in enumerate(graphs)}  # (S, d_max) Gumbel noise

    def pacer_step(engine, batch, step):
        p_tick(step)
        pacer.explore = step < p.warmup * p.steps
        for model in pacer.models.values():
            model.temperature = ordering_temperature(step, p)
        return engine(batch)

    ctx.progress(f"phase pacer: {len(graphs)} graphs, {p.orderings} orderings a step, {p.steps} steps")
    engine = ctx.engine(pacer, p.lr, arms=pacer.models, betas=(0.9, p.beta2))
    ctx.fit("pacer", engine, pacer_step, pacer_batch, p.steps, state=p_state)

    notears = NotearsSet({n: Notears(g["d"], g["train"], p.notears_l1) for n, g in graphs.items()})
    engine = ctx.engine(notears, p.notears_lr, arms=notears.models, betas=(0.9, p.notears_beta2))
    n_state = {"elapsed": torch.zeros(1), "marks": torch.zeros(p.notears_rounds * p.notears_steps, dtype=torch.float64)}
    done_rounds = [0]
    n_tick = _clock(n_state)
    lagrange = {n: (0.0, 1.0) for n in graphs}
    h_prev = {n: np.inf for n in graphs}
    stopped: dict[str, dict] = {}

    def notears_step(engine, batch, step):
        n_tick(done_rounds[0] * p.notears_steps + step)
        return engine(lagrange), {}

    for k in range(p.notears_rounds):
        ctx.fit(f"notears{k}", engine, notears_step, lambda step: {}, p.notears_steps, state=n_state)
        for name, model in notears.models.items():
            if name in stopped:
                continue
            h = float(model.h().detach())
            if h < p.notears_h_tol or k == p.notears_rounds - 1:
                stopped[name] = {"w": (model.w * model.off_diag[0]).detach().numpy().copy(), "rounds": k + 1,
                                 "capped": h >= p.notears_h_tol, "h": h, "time_s": float(n_state["elapsed"])}
            else:
                alpha, rho = lagrange[name]
                lagrange[name] = (alpha + rho * h, rho * 10 if h > 0.25 * h_prev[name] else rho)
                h_prev[name] = h
        done_rounds[0] = k + 1
        ctx.progress(f"notears round {k + 1}: {len(stopped)}/{len(graphs)} graphs stopped")
        if len(stopped) == len(graphs):
            break

    result = {"pacer_time_s": float(p_state["elapsed"]), "notears": stopped,
              "notears_time_s": max(s["time_s"] for s in stopped.values()),
              "pacer_blocks": timing_blocks(p_state["marks"].numpy(), float(p_state["elapsed"])),
              "notears_blocks": timing_blocks(n_state["marks"][: done_rounds[0] * p.notears_steps].numpy(),
                                              float(n_state["elapsed"])),
              "pacer": {n: {"graph": m.graph(), "scores": m.edge_scores(),
                            "order": torch.argsort(m.theta, descending=True).numpy()}
                        for n, m in pacer.models.items()}}
    ctx.save_record("results", result)


# ---- evaluation ----------------------------------------------------------------------------------------------------
def _edge_metrics(adj: np.ndarray, scores: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    off = ~np.eye(len(truth), dtype=bool)
    tp = float(((adj > 0) & (truth > 0)).sum())
    precision, recall = tp / max((adj > 0).sum(), 1), tp / max((truth > 0).sum(), 1)
    return {"shd": shd(adj, truth), "precision": precision, "recall": recall,
            "f1": 2 * precision * recall / max(precision + recall, 1e-12),
            "auprc": float(average_precision_score(truth[off] > 0, scores[off])),
            "cyclic": float(not nx.is_directed_acyclic_graph(nx.DiGraph(adj > 0)))}


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    res = ctx.record("results")
    graphs = load_graphs(ctx.data_dir)
    rng = np.random.default_rng(p.seed)
    per: dict[str, list[float]] = {}
    out: dict[str, float] = {}
    ds = [g["d"] for g in graphs.values()]
    add = lambda key, value: per.setdefault(key, []).append(float(value))  # noqa: E731
    for name, g in graphs.items():
        truth, penalty, n_train = g["truth"], edge_penalty(g), g["train"]["n"].sum()
        nt = res["notears"][name]
        srt = sortnregress(g["obs"])
        rand = random_dag_like(truth, rng)
        methods = {"method": (res["pacer"][name]["graph"], res["pacer"][name]["scores"]),
                   "baseline/notears": ((np.abs(nt["w"]) > p.threshold).astype(float), np.abs(nt["w"])),
                   "baseline/sortnregress": ((srt > 0).astype(float), srt),
                   "baseline/random": (rand, rand + rng.random(rand.shape) * 1e-3)}
        true_score = graph_score(truth, g, penalty)
        exact = exact_best_dag(g, penalty) if g["d"] <= p.exact_max_d else None
        out[f"detail/{name}/truth/heldout_nll"] = heldout_nll(truth, g)
        if exact is not None:
            out[f"detail/{name}/exact/shd_to_truth"] = shd(exact[0], truth)
            out[f"detail/{name}/exact/score_gap_to_truth"] = (exact[1] - true_score) / n_train
            add("detail/exact/shd_to_truth", shd(exact[0], truth))
        for prefix, (adj, scores) in methods.items():
            m = _edge_metrics(adj, scores, truth)
            m["heldout_nll"] = heldout_nll(adj, g)
            m["score_gap_to_truth"] = (true_score - graph_score(adj, g, penalty)) / n_train  # per sample
            if exact is not None:
                m["score_gap_to_exact"] = (exact[1] - graph_score(adj, g, penalty)) / n_train
                m["shd_to_exact"] = shd(adj, exact[0])
            size = (("small_d", min(ds)), ("large_d", max(ds)))  # the claim's d = 10 and d = 30 in smoke
            for key, value in m.items():
                add(f"{prefix}/{key}", value)
                add(f"detail/{prefix.split('/')[-1]}/{key}_d{g['d']}", value)
                for label, d_value in size:
                    if g["d"] == d_value:
                        add(f"{prefix}/{key}_{label}", value)
                out[f"detail/{name}/{prefix.split('/')[-1]}/{key}"] = value
        out[f"detail/{name}/notears/rounds"] = nt["rounds"]
        out[f"detail/{name}/notears/capped"] = float(nt["capped"])
        _adjacency_plot(ctx.plots_dir / f"graphs_{name}.png", name, truth, exact, res["pacer"][name]["scores"], nt["w"])
    out |= {k: float(np.mean(v)) for k, v in per.items()}
    out["method/time_s"] = res["pacer_time_s"]
    out["baseline/notears/time_s"] = res["notears_time_s"]
    for k, (t_p, t_n) in enumerate(zip(res["pacer_blocks"], res["notears_blocks"], strict=True)):
        out[f"method/time_s/k{k}"], out[f"baseline/notears/time_s/k{k}"] = t_p, t_n
    out["detail/speedup_notears_over_pacer"] = res["notears_time_s"] / max(res["pacer_time_s"], 1e-9)
    out["detail/paper_max_speedup"] = 100.0
    out["detail/notears/capped_fraction"] = float(np.mean([s["capped"] for s in res["notears"].values()]))
    return out


def _adjacency_plot(path: Path, name: str, truth, exact, pacer_scores, notears_w) -> None:
    import matplotlib.pyplot as plt

    panels = [("truth", truth), ("exact optimum", exact[0] if exact is not None else None),
              ("PACER E[P]", pacer_scores), ("NOTEARS |W|", np.abs(notears_w))]
    panels = [(t, a) for t, a in panels if a is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3.2))
    for ax, (title, a) in zip(axes, panels, strict=True):
        ax.imshow(a, cmap="Greys", vmin=0, vmax=max(1.0, float(np.max(a))))
        ax.set(title=title, xticks=[], yticks=[], xlabel="child", ylabel="parent")
    fig.suptitle(f"{name}: adjacency (row -> column)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="pacer",
    title="PACER: acyclic-by-construction causal discovery from perturbation data",
    seed="000_2dd18ae8605fb5c1.txt, abstract 13",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/shd", "min"),
    times_training=True,  # the timed samples are the training's own steps: it trains on a quiet machine
    claim=Claim(premises=(  # the bar's reason is in the docstring
        Compare("method/score_gap_to_exact_small_d", "<=", 0.01, name="search_reaches_exact_optimum"),
    ), all_of=(
        Compare("method/shd_small_d", "<=", "baseline/notears/shd_small_d"),
        Compare("method/shd_large_d", "<=", "baseline/notears/shd_large_d"),
        Compare("method/time_s", "<", "baseline/notears/time_s", timed=True),
        Compare("method/cyclic", "<=", 0.0),
    ), summary="d in {10, 30}: PACER's SHD <= NOTEARS's, PACER faster, and no cyclic graph returned",
        note="equal tuning effort: each arm's learning rate (3 values), Adam beta2 (3 values) and 4 variants of its "
             "own search knobs (PACER: temperature, anneal, warm-up, orderings; NOTEARS: L1, threshold) were chosen "
             "on one criterion, the score gap to the exact optimum on the small graphs' training data (NOTEARS: "
             "acyclic outputs only), never on SHD; PACER's edge penalty is BIC's 1/2 log n, the exact reference's; "
             "smoke: PACER 1,200 Adam steps, NOTEARS at most 10 rounds x 120 = 1,200"),
)
