"""Box relaxations of penalty QUBOs whose local minimisers are binary and feasible.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 19. Spec: ../shared/papers/qubo_relax.md.

Relaxation: minimise f(x) = x^T Q x + c^T x over [0, 1]^n (Q symmetric). Nothing is learned (learns=False).
What it implements (function names in brackets):
- formulations per problem, naive and proposed [knapsack_qubo, pit_qubo, tsp_qubo]; the proposed ones set every
  diagonal to -eps and move the old diagonal into c (x_i^2 = x_i on binaries, so binary values are unchanged)
  [concave_diagonal];
- the checker: C1 (Q_ii < 0) and C2 (at every infeasible binary x some coordinate has g_i (1 - 2 x_i) < 0,
  g = 2 Q x + c) by enumeration up to `enum_max` binaries, else on sampled infeasible binaries; it returns the
  counterexample count [check_conditions];
- solvers, batched over instances x random starts: projected gradient descent with an Armijo step (at least
  1 / (2 ||Q||_2)) and projected Adam, stopped when the projected gradient ||x - clip(x - grad f)||_inf < 1e-6 (a
  stationary point; a stalled step, e.g. Adam's momentum pressing on a bound, does not count) or the step cap [pgd,
  adam, projected_gradient]; the share of runs that converged is a premise of the claim; baselines: the naive
  formulation with the same solvers, naive + rounding at 0.5, simulated annealing on the naive binary QUBO [anneal];
- exact optima as the reference for optimality gaps: dynamic programming (knapsack), a min cut with networkx
  (open-pit maximum closure), Held-Karp (TSP) [knapsack_dp, pit_mincut, held_karp].

Deviations from the paper (the abstract states neither its conditions nor its constructions):
- C1/C2 above are our sufficient conditions; the proposed formulations are labelled candidates. Knapsack's
  candidate (the binary-slack squared residual with a concave diagonal) fails C2 for any penalty, and so does a
  unary slack encoding: with the slack off and an excess r = w^T x - C smaller than half of every chosen item's
  weight, dropping an item overshoots the residual (P w_i (w_i - 2 r) > 0) and adding slack raises it, so the
  infeasible point is a single-flip local minimum (tests/test_qubo_relax.py). A quadratic penalty that meets C2 for
  general weights is the paper's construction, which the abstract does not give. The knapsack comparisons are
  therefore context (shown, not deciding): a premise "the candidate meets C1 + C2" is false by this proof, whatever
  the run, and would only hold the open-pit and TSP parts hostage; the claim is decided on open pit and TSP.
- "Feasible" is the original problem's constraint on the decision variables (knapsack: w^T x <= C; open pit: a
  closure; TSP: a permutation matrix), read from the final iterate rounded at 0.5.
- C2 for instances above `enum_max` binaries (6-city TSP, smoke's open pit) is checked on sampled infeasible
  binaries only.
- smoke's open pit is 6 x 8 blocks, not the spec's 3 x 5: on a 3-row pit the naive relaxation's runs already end
  binary and feasible almost always, so the comparison with the proposed one could not show anything.
- Full profile: a larger synthetic knapsack, MineLib's open pit [load_minelib: .upit profits + .prec precedences,
  exact optimum by min cut] and a TSPLIB EUC_2D large TSP [load_tsplib] (distances not rounded to integers;
  Held-Karp only up to `exact_tsp_max` cities, no gap above); Pisinger's generator is replaced by the same uniform
  generator at n = 1,000.
- PGD's step: the spec's fixed eta = 1 / (2 ||Q||_2) is where the Armijo backtracking stops halving, not the step
  itself; with knapsack's 2^k slack coefficients ||Q||_2 is large, the fixed step crawls along the flat concave
  directions and runs end at the step cap, not at a local minimiser (which is what the claim reads).
- Knapsack slack bits: ceil(log2(max C + 1)) over a problem's instances, so every gap 0..C is representable.
- Penalties: knapsack P = 1 + max v; open pit P = max(-p, 0) + 1 (> the spec's bound); TSP P = max d + 1 and
  conflict weight lambda = 1.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import networkx as nx
import numpy as np
import torch
from pydantic import Field

from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

PROBLEMS = ("knapsack", "pit", "tsp_small", "tsp_large")
DECIDING = ("pit", "tsp_small", "tsp_large")  # knapsack is context: our candidate fails C2 by construction
FORMULATIONS = ("proposed", "naive")
SOLVERS = ("pgd", "adam")
STATIONARY_TOL = 1e-6  # a run has converged when its projected gradient's largest entry is below this


class Params(PaperParams):
    instances: int = Field(5, ge=1, description="Instances per problem.")
    knapsack_items: int = Field(10, ge=2, description="Knapsack items (weights U{1..10}, values U{1..20}).")
    pit_rows: int = Field(3, ge=2, description="Open-pit grid depth.")
    pit_cols: int = Field(5, ge=2, description="Open-pit grid width (3 predecessors per block above).")
    tsp_small: int = Field(4, ge=3, description="Cities of the small TSP (n^2 variables, enumerable).")
    tsp_large: int = Field(6, ge=3, description="Cities of the large TSP (C2 checked on samples).")
    eps: float = Field(0.01, gt=0, description="The proposed formulations' diagonal -eps.")
    starts: int = Field(256, ge=1, description="Random starts per instance for each solver.")
    max_steps: int = Field(3000, ge=1, description="Solver step cap.")
    adam_lr: float = Field(0.05, gt=0, description="Projected Adam learning rate.")
    sa_chains: int = Field(64, ge=1, description="Simulated-annealing chains per instance.")
    sa_sweeps: int = Field(500, ge=1, description="Simulated-annealing sweeps.")
    enum_max: int = Field(65536, ge=2, description="Enumerate C2 when 2^n <= this; else sample.")
    c2_samples: int = Field(100000, ge=10, description="Sampled binaries for C2 above enum_max.")
    tsp_file: str = Field("", description="TSPLIB EUC_2D .tsp file: the large TSP becomes this one instance.")
    minelib_file: str = Field("", description="MineLib .upit file (its .prec beside it): the open pit becomes this "
                                              "one instance.")
    exact_tsp_max: int = Field(13, ge=3, description="Held-Karp only up to this many cities (else no gap).")


# ---- instances and formulations -----------------------------------------------------------------------------
def _pair(q: np.ndarray, i: int, j: int, value: float) -> None:
    """Add value * x_i x_j to x^T Q x with Q symmetric (i == j: value * x_i^2)."""
    if i == j:
        q[i, i] += value
    else:
        q[i, j] += value / 2
        q[j, i] += value / 2


def concave_diagonal(q: np.ndarray, c: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Q_ii -> -eps, c_i -> c_i + Q_ii + eps: equal on binaries (x_i^2 = x_i), strictly concave per coordinate."""
    q, c = q.copy(), c + np.diag(q) + eps
    np.fill_diagonal(q, -eps)
    return q, c


def knapsack_qubo(w, v, cap, bits, eps):
    """P (w^T x + sum_k 2^k s_k - C)^2 - v^T x over z = (x, s); constant P C^2 dropped."""
    a = np.concatenate([w, 2.0 ** np.arange(bits)])
    big_p = 1.0 + v.max()
    q = big_p * np.outer(a, a)
    c = -2 * big_p * cap * a - np.concatenate([v, np.zeros(bits)])
    return {"naive": (q, c), "proposed": concave_diagonal(q, c, eps)}


def pit_precedence(rows: int, cols: int) -> nx.DiGraph:
    """Edge b -> a: block b (one row deeper) requires block a (up to 3 blocks above it)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(rows * cols))
    for r, col in itertools.product(range(1, rows), range(cols)):
        for dc in (-1, 0, 1):
            if 0 <= col + dc < cols:
                g.add_edge(r * cols + col, (r - 1) * cols + col + dc)
    return g


def pit_graph(inst: dict) -> nx.DiGraph:
    """An open-pit instance's precedences: the grid's, or a MineLib instance's own (`edges`: [b, a] = b needs a)."""
    if "edges" not in inst:
        return pit_precedence(inst["rows"], inst["cols"])
    g = nx.DiGraph()
    g.add_nodes_from(range(len(inst["profit"])))
    g.add_edges_from(map(tuple, inst["edges"]))
    return g


def pit_qubo(profit, rows, cols, eps, graph: nx.DiGraph | None = None):
    """-p^T x + P sum_{b requires a} x_b (1 - x_a): naive over immediate precedences (zero diagonal), proposed
    over the transitive closure with a concave diagonal; P = max(-p, 0) + 1."""
    g = graph if graph is not None else pit_precedence(rows, cols)
    big_p = max(-profit.min(), 0.0) + 1.0
    out = {}
    for name, edges in (("naive", g.edges), ("proposed", nx.transitive_closure_dag(g).edges)):
        q, c = np.zeros((len(profit), len(profit))), -profit.astype(float)
        for b, a in edges:
            c[b] += big_p
            _pair(q, b, a, -big_p)
        out[name] = concave_diagonal(q, c, eps) if name == "proposed" else (q, c)
    return out


def tsp_qubo(d, eps, lam=1.0):
    """x_{u,t} (index u n + t): tour length + P (row sums - 1)^2 + P (column sums - 1)^2, P = max d + 1; the
    proposed one adds lam x_{u,t} x_{u,t'} + lam x_{u,t} x_{v,t} and a concave diagonal."""
    n = len(d)
    idx = lambda u, t: u * n + t  # noqa: E731
    big_p = d.max() + 1.0
    q, c = np.zeros((n * n, n * n)), np.zeros(n * n)
    for u, v, t in itertools.product(range(n), range(n), range(n)):
        if u != v:
            _pair(q, idx(u, t), idx(v, (t + 1) % n), d[u, v])
    conflict = np.zeros_like(q)
    for a in range(n):  # row a (city a over times) and column a (time a over cities)
        for group in ([idx(a, t) for t in range(n)], [idx(u, a) for u in range(n)]):
            for i in group:
                _pair(q, i, i, big_p)
                c[i] -= 2 * big_p
            for i, j in itertools.combinations(group, 2):
                _pair(q, i, j, 2 * big_p)
                _pair(conflict, i, j, lam)
    return {"naive": (q, c), "proposed": concave_diagonal(q + conflict, c, eps)}


# ---- exact optima ---------------------------------------------------------------------------------------------
def knapsack_dp(w, v, cap) -> float:
    best = np.zeros(int(cap) + 1)
    for wi, vi in zip(w.astype(int), v, strict=True):
        best[wi:] = np.maximum(best[wi:], best[: len(best) - wi] + vi)
    return float(best[-1])


def pit_mincut(profit, rows, cols, graph: nx.DiGraph | None = None) -> float:
    """Maximum-weight closure = sum of positive profits - min cut (Picard)."""
    g = nx.DiGraph()
    for b, p in enumerate(profit):
        g.add_edge("s", b, capacity=float(max(p, 0))) if p > 0 else g.add_edge(b, "t", capacity=float(-p))
    for b, a in (graph if graph is not None else pit_precedence(rows, cols)).edges:
        g.add_edge(b, a, capacity=float("inf"))
    g.add_nodes_from(["s", "t"])
    return float(profit[profit > 0].sum() - nx.minimum_cut_value(g, "s", "t"))


def held_karp(d) -> float:
    n = len(d)
    cost = {(1 << j, j): d[0, j] for j in range(1, n)}
    for size in range(2, n):
        for subset in itertools.combinations(range(1, n), size):
            bits = sum(1 << j for j in subset)
            for j in subset:
                cost[(bits, j)] = min(cost[(bits ^ (1 << j), i)] + d[i, j] for i in subset if i != j)
    full = sum(1 << j for j in range(1, n))
    return float(min(cost[(full, j)] + d[j, 0] for j in range(1, n)))


# ---- data ---------------------------------------------------------------------------------------------------
def make_instance(problem: str, rng: np.random.Generator, p: Params) -> dict:
    if problem == "knapsack":
        w, v = rng.integers(1, 11, p.knapsack_items), rng.integers(1, 21, p.knapsack_items)
        return {"w": w.tolist(), "v": v.tolist(), "C": int(0.4 * w.sum())}
    if problem == "pit":
        depth = np.repeat(np.arange(p.pit_rows), p.pit_cols)
        return {"rows": p.pit_rows, "cols": p.pit_cols, "profit": (rng.normal(-1, 2, depth.size) + depth).tolist()}
    n = p.tsp_small if problem == "tsp_small" else p.tsp_large
    return {"coords": rng.random((n, 2)).tolist()}


def load_tsplib(path: Path) -> np.ndarray:
    """Coordinates (n, 2) of a TSPLIB file with EDGE_WEIGHT_TYPE EUC_2D (Euclidean, not rounded to integers)."""
    lines = Path(path).read_text().splitlines()
    header = {k.strip().upper(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ":" in ln)}
    if header.get("EDGE_WEIGHT_TYPE", "EUC_2D") != "EUC_2D":
        raise ValueError(f"{path}: only EDGE_WEIGHT_TYPE EUC_2D is supported, got {header['EDGE_WEIGHT_TYPE']}")
    start = next(i for i, ln in enumerate(lines) if ln.strip().upper().startswith("NODE_COORD_SECTION")) + 1
    coords = []
    for ln in lines[start:]:
        if not ln.strip() or ln.strip().upper() == "EOF":
            break
        coords.append([float(v) for v in ln.split()[1:3]])
    if "DIMENSION" in header and int(header["DIMENSION"]) != len(coords):
        raise ValueError(f"{path}: DIMENSION {header['DIMENSION']} but {len(coords)} coordinates")
    return np.array(coords)


def load_minelib(upit: Path) -> dict:
    """A MineLib UPIT instance (Espinoza et al. 2013): block profits from `<name>.upit` (OBJECTIVE_FUNCTION
    section, `<block> <profit>` lines) and precedences from `<name>.prec` beside it (`<block> <k> <pred 1..k>`:
    the block needs its k predecessors). '%' starts a comment. -> {"profit": [...], "edges": [[b, a], ...]}."""
    def rows(path: Path) -> list[list[str]]:
        return [ln.split() for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.startswith("%")]

    head = {r[0].rstrip(":").upper(): r[1:] for r in rows(upit) if r[0].endswith(":")}
    if head.get("TYPE", ["UPIT"])[0].upper() != "UPIT":
        raise ValueError(f"{upit}: only TYPE UPIT instances are supported, got {head['TYPE'][0]}")
    n = int(head["NBLOCKS"][0])
    profit = np.full(n, np.nan)
    for r in rows(upit):
        if not r[0].endswith(":") and r[0].upper() != "EOF":
            profit[int(r[0])] = float(r[1])
    if np.isnan(profit).any():
        raise ValueError(f"{upit}: {int(np.isnan(profit).sum())} of {n} blocks have no profit")
    edges = [[int(r[0]), int(a)] for r in rows(Path(upit).with_suffix(".prec")) for a in r[2 : 2 + int(r[1])]]
    return {"profit": profit.tolist(), "edges": edges}


def formulations(problem: str, inst: dict, p: Params, bits: int = 0) -> dict:
    if problem == "knapsack":
        return knapsack_qubo(np.array(inst["w"], float), np.array(inst["v"], float), inst["C"], bits, p.eps)
    if problem == "pit":
        return pit_qubo(np.array(inst["profit"]), inst.get("rows"), inst.get("cols"), p.eps, pit_graph(inst))
    xy = np.array(inst["coords"])
    return tsp_qubo(np.linalg.norm(xy[:, None] - xy[None], axis=-1), p.eps)


def optimum(problem: str, inst: dict, exact_max: int = 13) -> float:
    if problem == "knapsack":
        return knapsack_dp(np.array(inst["w"]), np.array(inst["v"], float), inst["C"])
    if problem == "pit":
        return pit_mincut(np.array(inst["profit"]), inst.get("rows"), inst.get("cols"), pit_graph(inst))
    xy = np.array(inst["coords"])
    return held_karp(np.linalg.norm(xy[:, None] - xy[None], axis=-1)) if len(xy) <= exact_max else float("nan")


def prepare(p: Params, out_dir: Path) -> None:
    inst_cols = {k: [] for k in ("instance_id", "problem", "n_vars", "params", "optimum")}
    qcols = {k: [] for k in ("instance_id", "formulation", "i", "j", "q_ij")}
    lcols = {k: [] for k in ("instance_id", "formulation", "i", "c_i")}
    for pi, problem in enumerate(PROBLEMS):
        rng = np.random.default_rng([p.seed, pi])
        insts = [make_instance(problem, rng, p) for _ in range(p.instances)]
        if problem == "tsp_large" and p.tsp_file:
            insts = [{"coords": load_tsplib(input_path(p.tsp_file)).tolist()}]
        if problem == "pit" and p.minelib_file:
            insts = [load_minelib(input_path(p.minelib_file))]
        bits = int(np.ceil(np.log2(max(i.get("C", 0) for i in insts) + 1)))  # slack covers every gap 0..C
        for inst in insts:
            iid = len(inst_cols["instance_id"])
            forms = formulations(problem, {**inst, "bits": bits}, p, bits)
            inst_cols["instance_id"].append(iid)
            inst_cols["problem"].append(problem)
            inst_cols["n_vars"].append(len(forms["naive"][1]))
            inst_cols["params"].append(json.dumps({**inst, "bits": bits}))
            inst_cols["optimum"].append(optimum(problem, inst, p.exact_tsp_max))
            for name, (q, c) in forms.items():
                i, j = np.nonzero(q)
                qcols["instance_id"] += [iid] * len(i)
                qcols["formulation"] += [name] * len(i)
                qcols["i"] += i.tolist()
                qcols["j"] += j.tolist()
                qcols["q_ij"] += q[i, j].tolist()
                lcols["instance_id"] += [iid] * len(c)
                lcols["formulation"] += [name] * len(c)
                lcols["i"] += list(range(len(c)))
                lcols["c_i"] += c.tolist()
    write_table(out_dir / "instances.parquet", inst_cols)
    write_table(out_dir / "qubo.parquet", qcols)
    write_table(out_dir / "linear.parquet", lcols)


def load(data_dir: Path) -> dict[str, list[dict]]:
    """problem -> instances, each with its params, optimum and dense (Q, c) per formulation."""
    inst, qt, lt = (read_table(data_dir / f"{t}.parquet") for t in ("instances", "qubo", "linear"))
    out: dict[str, list[dict]] = {}
    for k, iid in enumerate(inst["instance_id"]):
        n = int(inst["n_vars"][k])
        rec = {"params": json.loads(inst["params"][k]), "optimum": float(inst["optimum"][k])}
        for f in FORMULATIONS:
            q, c = np.zeros((n, n)), np.zeros(n)
            sel = (qt["instance_id"] == iid) & (qt["formulation"] == f)
            q[qt["i"][sel], qt["j"][sel]] = qt["q_ij"][sel]
            sel = (lt["instance_id"] == iid) & (lt["formulation"] == f)
            c[lt["i"][sel]] = lt["c_i"][sel]
            rec[f] = (q, c)
        out.setdefault(str(inst["problem"][k]), []).append(rec)
    return out


# ---- feasibility and decoding ---------------------------------------------------------------------------------
def feasible(problem: str, inst: dict, z: np.ndarray) -> np.ndarray:
    """The original problem's constraint on binary z (..., n_vars) -> bool (...)."""
    if problem == "knapsack":
        k = len(inst["w"])
        return z[..., :k] @ np.array(inst["w"]) <= inst["C"]
    if problem == "pit":
        edges = np.array(list(pit_graph(inst).edges)).reshape(-1, 2)
        return (z[..., edges[:, 0]] <= z[..., edges[:, 1]]).all(-1)
    n = len(inst["coords"])
    x = z.reshape(*z.shape[:-1], n, n)
    return (x.sum(-1) == 1).all(-1) & (x.sum(-2) == 1).all(-1)


def gap(problem: str, inst: dict, z: np.ndarray, opt: float) -> np.ndarray:
    """Relative optimality gap of feasible binary z (..., n_vars) against the exact optimum."""
    if problem == "knapsack":
        return (opt - z[..., : len(inst["w"])] @ np.array(inst["v"], float)) / abs(opt)
    if problem == "pit":
        return (opt - z @ np.array(inst["profit"])) / max(abs(opt), 1e-9)
    xy = np.array(inst["coords"])
    n, d = len(xy), np.linalg.norm(xy[:, None] - xy[None], axis=-1)
    order = z.reshape(*z.shape[:-1], n, n).argmax(-2)  # (..., n): city at each time
    return (d[order, np.roll(order, -1, -1)].sum(-1) - opt) / opt


# ---- the checker ----------------------------------------------------------------------------------------------
def check_conditions(problem: str, inst: dict, q: np.ndarray, c: np.ndarray, p: Params,
                     rng: np.random.Generator) -> dict[str, float]:
    """C1: every Q_ii < 0. C2: at every infeasible binary some coordinate descends, g_i (1 - 2 z_i) < 0."""
    n = len(c)
    if 2 ** n <= p.enum_max:
        z = ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1).astype(float)  # (2^n, n): every binary
        how = "enumerated"
    else:
        z = (rng.random((p.c2_samples, n)) < 0.5).astype(float)
        if problem.startswith("tsp"):  # half of them near-feasible: permutation matrices with 1-3 flips
            m, half = int(round(np.sqrt(n))), p.c2_samples // 2
            perms = np.eye(m)[np.argsort(rng.random((half, m)), 1)].reshape(half, n)
            for _ in range(3):
                hit = rng.integers(0, n, half)
                perms[np.arange(half), hit] = 1 - perms[np.arange(half), hit]
            z[:half] = perms
        how = "sampled"
    bad = ~feasible(problem, inst, z)
    g = 2 * z @ q + c  # (B, n)
    descends = (g * (1 - 2 * z) < -1e-12).any(-1)
    return {"c1": float((np.diag(q) < 0).all()), "c2_counterexamples": float((bad & ~descends).sum()),
            "c2_checked": float(bad.sum()), "c2_enumerated": float(how == "enumerated")}


# ---- solvers: every instance x start as one batched tensor -------------------------------------------------------
def pgd(q: torch.Tensor, c: torch.Tensor, x0: torch.Tensor, max_steps: int, sigma: float = 1e-4,
        grow: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Projected gradient descent with an Armijo backtracking step along the projection arc, per run:
    x(eta) = clip(x - eta (2 Q x + c)), accepted when f(x(eta)) <= f(x) + sigma g^T (x(eta) - x); a rejected eta is
    halved, but never below 1 / L (L = 2 ||Q||_2, the gradient's Lipschitz constant, where Armijo always holds), and
    an accepted one grows by `grow` for the next step. q (I, n, n), c (I, n), x0 (I, R, n). Returns the final x and
    the steps each run took (max_steps = stopped by the cap)."""
    floor = (1.0 / (2 * torch.linalg.matrix_norm(q, ord=2)))[:, None].expand(x0.shape[:2])  # (I, R): 1 / L
    eta = floor.clone()

    def update(x, g, step):
        nonlocal eta
        trial = eta.clone()
        pending = torch.ones_like(eta, dtype=torch.bool)
        new = x
        while pending.any():
            cand = (x - trial[..., None] * g).clamp(0, 1)  # (I, R, n)
            d = cand - x
            change = (g * d).sum(-1) + ((d @ q) * d).sum(-1)  # exact for a quadratic: f(x + d) - f(x)
            ok = pending & ((change <= sigma * (g * d).sum(-1)) | (trial <= floor))
            new = torch.where(ok[..., None], cand, new)
            eta = torch.where(ok, trial, eta)
            pending &= ~ok
            trial = torch.where(pending, torch.maximum(trial / 2, floor), trial)
        eta = eta * grow
        return new

    return _projected(update, q, c, x0, max_steps)


def adam(q, c, x0, max_steps: int, lr: float, betas=(0.9, 0.999), eps=1e-8):
    state = {"m": torch.zeros_like(x0), "v": torch.zeros_like(x0)}

    def update(x, g, step):
        state["m"] = betas[0] * state["m"] + (1 - betas[0]) * g
        state["v"] = betas[1] * state["v"] + (1 - betas[1]) * g * g
        m_hat, v_hat = state["m"] / (1 - betas[0] ** step), state["v"] / (1 - betas[1] ** step)
        return x - lr * m_hat / (v_hat.sqrt() + eps)

    return _projected(update, q, c, x0, max_steps)


def gradient(q: torch.Tensor, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad f(x) = 2 Q x + c per run, (I, R, n); q symmetric."""
    return 2 * x @ q + c[:, None]


def projected_gradient(q: torch.Tensor, c: torch.Tensor, x: torch.Tensor,
                       g: torch.Tensor | None = None) -> torch.Tensor:
    """First-order stationarity on the box: ||x - clip(x - grad f(x))||_inf per run (I, R); zero exactly at a KKT
    point of min f over [0, 1]^n. `g`: grad f(x), when the caller has it already."""
    g = gradient(q, c, x) if g is None else g
    return (x - (x - g).clamp(0, 1)).abs().amax(-1)


def _projected(update, q, c, x0, max_steps, tol: float = STATIONARY_TOL):
    """Iterate until the projected gradient is below `tol` (a stationary point: a step that merely stalls, such as
    Adam's momentum pressing against a bound, does not count) or the step cap."""
    x, steps = x0.clone(), torch.full(x0.shape[:2], max_steps)
    active = torch.ones(x0.shape[:2], dtype=torch.bool)
    g = gradient(q, c, x)
    for step in range(1, max_steps + 1):
        new = update(x, g, step).clamp(0, 1)
        x = torch.where(active[..., None], new, x)
        g = gradient(q, c, x)  # the stopping test's and the next step's: one product a step, not two
        stopped = active & (projected_gradient(q, c, x, g) < tol)
        steps[stopped] = step
        active &= ~stopped
        if not active.any():
            break
    return x, steps


def anneal(q: np.ndarray, c: np.ndarray, chains: int, sweeps: int, rng: np.random.Generator) -> np.ndarray:
    """Single-flip Metropolis on the binary QUBO, geometric temperatures; q (I, n, n), c (I, n) -> (I, chains, n).
    Flip i: delta f = (1 - 2 z_i)(2 (Q z)_i + c_i) + Q_ii (Q symmetric)."""
    q, c = torch.from_numpy(q), torch.from_numpy(c)
    i_n, n = c.shape
    z = torch.from_numpy((rng.random((i_n, chains, n)) < 0.5).astype(np.float64))
    qz = z @ q  # (I, chains, n)
    t_hi = (c.abs() + 2 * q.abs().sum(-1)).amax(-1)[:, None]  # (I, 1): the largest single-flip change
    temps = t_hi * torch.logspace(0, -3, sweeps, dtype=torch.float64)[None]  # (I, sweeps)
    u = torch.from_numpy(rng.random((sweeps, n, i_n, chains)))
    diag = torch.diagonal(q, dim1=1, dim2=2)  # (I, n)
    for s in range(sweeps):
        for i in range(n):
            sign = 1 - 2 * z[..., i]  # (I, chains)
            delta = sign * (2 * qz[..., i] + c[:, None, i]) + diag[:, None, i]
            accept = (delta <= 0) | (u[s, i] < torch.exp(-delta / temps[:, s, None]))
            step = torch.where(accept, sign, torch.zeros_like(sign))
            z[..., i] += step
            qz += step[..., None] * q[:, None, i, :]
    return z.numpy()


# ---- pipeline ---------------------------------------------------------------------------------------------------
def train(ctx) -> None:
    ctx.progress("nothing to learn: the solvers run in evaluate")


def _run_stats(problem, insts, x: np.ndarray, steps: np.ndarray, max_steps: int,
               converged: np.ndarray | None = None) -> dict[str, float]:
    binary = np.minimum(x, 1 - x).max(-1) < 1e-3  # (I, R)
    z = (x > 0.5).astype(float)
    feas = np.stack([feasible(problem, r["params"], z[i]) for i, r in enumerate(insts)])
    gaps = np.stack([gap(problem, r["params"], z[i], r["optimum"]) for i, r in enumerate(insts)])
    out = {"binary": binary.mean(), "feasible": feas.mean(), "bin_feas": (binary & feas).mean(),
           "capped": (steps >= max_steps).mean()}
    if converged is not None:  # the projected gradient below STATIONARY_TOL at the final iterate
        out["converged"] = converged.mean()
    if feas.any() and np.isfinite(gaps[feas]).all():  # no gap where the optimum is unknown (large TSPLIB)
        out["gap"] = gaps[feas].mean()
    return out


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    data = load(ctx.data_dir)
    out: dict[str, float] = {}
    for pi, problem in enumerate(PROBLEMS):
        insts, rng = data[problem], np.random.default_rng([p.seed, 100 + pi])
        n = len(insts[0]["naive"][1])
        x0 = torch.from_numpy(rng.random((len(insts), p.starts, n)))  # the same starts for every solver
        for f in FORMULATIONS:
            prefix = f"method/{problem}/" if f == "proposed" else f"baseline/naive/{problem}/"
            q = np.stack([r[f][0] for r in insts])
            c = np.stack([r[f][1] for r in insts])
            checks = [check_conditions(problem, r["params"], r[f][0], r[f][1], p, rng) for r in insts]
            out[prefix + "c1"] = min(ch["c1"] for ch in checks)
            out[prefix + "c2_counterexamples"] = sum(ch["c2_counterexamples"] for ch in checks)
            out[prefix + "conditions_ok"] = float(out[prefix + "c1"] == 1 and out[prefix + "c2_counterexamples"] == 0)
            out[f"detail/{problem}/{f}/c2_checked"] = sum(ch["c2_checked"] for ch in checks)
            out[f"detail/{problem}/c2_enumerated"] = checks[0]["c2_enumerated"]
            qt, ct = torch.from_numpy(q), torch.from_numpy(c)
            ctx.progress(f"{problem} ({n} variables), {f}: PGD and Adam from {p.starts} starts x {len(insts)}")
            runs = {"pgd": pgd(qt, ct, x0, p.max_steps), "adam": adam(qt, ct, x0, p.max_steps, p.adam_lr)}
            for solver, (x, steps) in runs.items():
                converged = (projected_gradient(qt, ct, x) < STATIONARY_TOL).numpy()
                stats = _run_stats(problem, insts, x.numpy(), steps.numpy(), p.max_steps, converged)
                out |= {f"{prefix}{solver}_{k}": float(v) for k, v in stats.items()}
                if f == "naive":
                    z = (x.numpy() > 0.5).astype(float)  # rounding baseline: binary by construction
                    r_stats = _run_stats(problem, insts, z, steps.numpy(), p.max_steps)
                    out |= {f"baseline/naive_round/{problem}/{solver}_{k}": float(r_stats[k])
                            for k in ("feasible", "gap") if k in r_stats}
            out[prefix + "bin_feas"] = (out[prefix + "pgd_bin_feas"] + out[prefix + "adam_bin_feas"]) / 2
        ctx.progress(f"{problem}: simulated annealing, {p.sa_chains} chains x {p.sa_sweeps} sweeps")
        z = anneal(np.stack([r["naive"][0] for r in insts]), np.stack([r["naive"][1] for r in insts]),
                   p.sa_chains, p.sa_sweeps, rng)
        sa = _run_stats(problem, insts, z, np.zeros(z.shape[:2]), 1)
        out |= {f"baseline/anneal/{problem}/{k}": float(sa[k]) for k in ("feasible", "gap") if k in sa}
        optima = [r["optimum"] for r in insts]
        if np.isfinite(optima).all():  # unknown above exact_tsp_max cities (a TSPLIB instance): no such metric
            out[f"detail/{problem}/optimum_mean"] = float(np.mean(optima))
    for solver in SOLVERS:  # the share of runs that reached a stationary point, worst deciding problem x formulation
        out[f"detail/{solver}_converged_min"] = min(
            out[f"{pre}{pr}/{solver}_converged"] for pr in DECIDING for pre in ("method/", "baseline/naive/"))
    out["method/bin_feas"] = float(np.mean([out[f"method/{pr}/bin_feas"] for pr in PROBLEMS]))
    out["baseline/naive/bin_feas"] = float(np.mean([out[f"baseline/naive/{pr}/bin_feas"] for pr in PROBLEMS]))
    _plot(ctx.plots_dir / "binary_feasible_rates.png", out)
    return out


def _plot(path: Path, out: dict) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = [("proposed", "method/{}/"), ("naive", "baseline/naive/{}/")]
    width = 0.2
    for k, ((name, pre), solver) in enumerate(itertools.product(bars, SOLVERS)):
        vals = [out[pre.format(pr) + f"{solver}_bin_feas"] for pr in PROBLEMS]
        ax.bar(np.arange(len(PROBLEMS)) + (k - 1.5) * width, vals, width, label=f"{name}, {solver}")
    ax.axhline(0.99, color="k", ls=":", lw=0.8)
    ax.set(xticks=range(len(PROBLEMS)), xticklabels=PROBLEMS, ylabel="runs ending binary and feasible",
           title="Box relaxation: local solvers from random starts")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parts(pr: str) -> tuple[Compare, ...]:
    return (Compare(f"method/{pr}/conditions_ok", ">=", 1.0),
            Compare(f"method/{pr}/pgd_bin_feas", ">=", 0.99),
            Compare(f"method/{pr}/adam_bin_feas", ">=", 0.99),
            Compare(f"method/{pr}/bin_feas", ">", f"baseline/naive/{pr}/bin_feas"))


PAPER = Paper(
    id="qubo_relax",
    title="Box relaxations of QUBOs whose local minimisers are binary and feasible",
    seed="000_2dd18ae8605fb5c1.txt, abstract 19",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/bin_feas", "max"),
    claim=Claim(
        premises=(  # a rate read off runs stopped by the step cap measures the cap, not the local minima
            Compare("detail/pgd_converged_min", ">=", 0.99, name="pgd_converged"),
            Compare("detail/adam_converged_min", ">=", 0.99, name="adam_converged"),
        ),
        all_of=tuple(itertools.chain.from_iterable(_parts(pr) for pr in DECIDING)),
        context=_parts("knapsack"),  # our candidate fails C2 for any penalty (proved in the docstring and tests)
        summary="per problem (open pit, small and large TSP): the proposed relaxation passes C1 + C2, >= 99% of PGD "
                "and Adam runs end binary and feasible, and the naive relaxation's rate is lower; premise: the solvers "
                "reached stationary points; knapsack (our candidate, not the paper's construction) as context",
        note="knapsack is context: the squared slack residual fails C2 for any penalty, and the paper's knapsack "
             "construction is not in the abstract"),
    learns=False,
)
