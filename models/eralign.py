"""ERAlign: energy-based, layer-wise alignment of GNN structure and text embeddings on text-attributed graphs.

Seed: 003_9a806cafa3d919df.txt, abstract 10. Spec: ../shared/papers/eralign.md.

What it implements (function names in brackets):
- text side: frozen all-MiniLM-L6-v2 embeddings t_v (384-d, computed in prepare; a small sentence encoder standing in
  for the LLM) and a trainable projector P_t (2-layer MLP) into the shared space (d_z = 64, L2-normalised)
  [Aligner.text];
- graph side: a 2-layer GCN (hidden 128) on t_v with a linear projector P_g^l per layer (L2-normalised)
  [Aligner.graph];
- layer-wise energy E_l(h, t) = ||P_g^l h_v^l - P_t t||^2 / tau, tau learnable [Aligner.energy];
- Energy Discrepancy (Schroeder et al., 2023) on p(t | h) ~ exp(-E): y = t_v + sqrt(s) xi, negatives
  t'_j = y + sqrt(s) xi_j (j = 1..M), L_ED^l = mean_v log(w/M + 1/M sum_j exp(E_l(h_v, t_v) - E_l(h_v, t'_j)))
  [energy_discrepancy]; L = CE + lambda sum_l L_ED^l, the classifier reads [h^L; P_t t_v] [Aligner.loss];
- baselines in the same engine: GCN without alignment, MLP on text, InfoNCE and MSE alignment at the final layer,
  the same energy trained by contrastive divergence with Langevin negatives [langevin_negatives], ERAlign at the
  final layer only (ablation);
- cross-task transfer: frozen encoders of graph 1 -> logistic-regression link prediction on held-out edges of
  graph 1 and node classification on graph 2 (shifted homophily and text informativeness) [_transfer];
- alignment: test-node energy gap E(h, t') - E(h, t) and linear CKA of the projected views [linear_cka].

Deviations from the paper (choices the abstract left open):
- "Wall-clock per training step" is reported as counted work, not seconds: the matmul FLOPs one full-batch training
  step executes per node (forward and backward, counted on the executed ops with torch's flop formulas, so ED's
  repetition over layers and CD's Langevin chain count as run) in `cost_per_step` [step_flops]. It depends only on
  M, L and the Langevin steps, so ED-vs-CD cost is claim context, not evidence.
- Smoke holds out half of graph 1 as test nodes; the labelled nodes are rate x n either way. Its world is harder
  than the spec's (graph 1: homophily 0.6, q 0.4, mean degree 4, text noise 0.3): at the spec's world the best
  baseline sat at the accuracy ceiling, so the premises `room_to_improve_r*` (best baseline <= ROOM_BAR) now guard
  the accuracy parts. `word_noise` (topic-word overlap between classes) is a further world knob, off by default.
- The ED/CD accuracy condition "ED.acc >= CD.acc - 1 point" is a comparison with a margin of -0.01.
- The claim covers the label rates both smoke and full run (5 % and 20 %); 60 % (full) is reported beside it.
- The CD baseline adds the energy-magnitude penalty cd_reg (E+^2 + E-^2) of Du & Mordatch (2019): without it
  E+ - E- falls without bound by shrinking tau.
- GCN without alignment reads the same [h^L; P_t t_v] as ERAlign (lambda = 0), so only the alignment differs.
- Link prediction: held-out edges (10 %) are removed from graph 1 before training; the probe is a logistic
  regression on Hadamard products of [h^L; P_t t] with as many sampled non-edges, fit on half and scored on half.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from torch import nn

from models.common import graphs as G
from models.common.lm import info_nce
from models.common.similarity import linear_cka
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

TOPIC_ORDER = ("music", "law", "cooking", "astronomy", "sports", "medicine", "finance", "botany", "computing", "ocean")
ALIGNED = ("eralign", "gcn", "infonce", "mse")  # read [h^L; P_t t]
EVERY_RATE = ("eralign", "gcn", "mlp", "infonce", "mse")
AT_ABLATION_RATE = ("cd", "final_only")
BASELINES = ("gcn", "mlp", "infonce", "mse", "cd")  # final_only is ERAlign's own ablation, not a baseline
ROOM_BAR = 0.85  # premise: the best baseline leaves room to improve (the old world had GCN at ~0.93, ceiling-bound)


class GraphSpec(PaperParams):
    n: int = Field(500, ge=10, description="Nodes.")
    homophily: float = Field(0.8, gt=0, lt=1, description="Intra-class edge share (p_in / p_out).")
    q: float = Field(0.5, gt=0, le=1, description="Text informativeness: share of topic words in a sentence.")


class Params(PaperParams):
    dataset: Literal["synthetic", "folder"] = Field("synthetic", description="SBM TAGs, or two TAG folders.")
    folders: list[str] = Field(default_factory=list, description="folder dataset: graph 1 and graph 2 TAG folders.")
    graph1: GraphSpec = Field(default_factory=GraphSpec, description="The training graph.")
    graph2: GraphSpec = Field(default_factory=lambda: GraphSpec(n=300, homophily=0.65, q=0.4),
                              description="The transfer graph (shifted parameters).")
    n_classes: int = Field(5, ge=2, le=10, description="Classes C.")
    mean_degree: float = Field(6.0, gt=0, description="Mean degree of both SBMs.")
    words: int = Field(10, ge=2, description="Words per node sentence.")
    text_noise: float = Field(0.2, ge=0, lt=1, description="Share of nodes whose text comes from another class.")
    word_noise: float = Field(0.0, ge=0, lt=1, description="Topic overlap: share of a text's topic words drawn "
                              "from another class's topic.")
    heldout_edges: float = Field(0.1, gt=0, lt=1, description="Share of graph-1 edges held out for link prediction.")
    text_encoder: Literal["minilm", "hashed"] = Field("minilm", description="Node text embeddings.")
    label_rates: list[float] = Field([0.05, 0.2], min_length=1, description="Label rates (train share of graph 1).")
    ablation_rate: float = Field(0.2, description="Rate at which CD and the final-only ablation run (and transfer).")
    test_share: float = Field(0.2, gt=0, lt=1, description="Test nodes of graph 1 (fixed across rates).")
    hidden: int = Field(128, ge=4, description="GCN hidden size.")
    dim: int = Field(64, ge=4, description="Shared space size d_z.")
    negatives: int = Field(8, ge=1, description="ED negatives M per node.")
    s: float = Field(0.1, gt=0, description="ED perturbation variance s.")
    w: float = Field(1.0, gt=0, description="ED stabiliser w.")
    lam: float = Field(0.5, ge=0, description="Weight lambda of the alignment loss.")
    langevin_steps: int = Field(20, ge=1, description="Langevin steps of the CD baseline.")
    langevin_step_size: float = Field(0.01, gt=0, description="Langevin step size of the CD baseline.")
    cd_reg: float = Field(0.1, ge=0, description="Energy-magnitude penalty of CD (Du & Mordatch 2019).")
    epochs: int = Field(100, ge=1, description="Full-batch training epochs of every model.")
    lr: float = Field(1e-2, gt=0, description="Learning rate.")
    weight_decay: float = Field(5e-4, ge=0, description="AdamW weight decay.")


# ---- data --------------------------------------------------------------------------------------------------
def _synthetic(spec: GraphSpec, p: Params, rng: np.random.Generator):
    sizes = np.diff(np.round(np.linspace(0, spec.n, p.n_classes + 1)).astype(int)).tolist()
    labels, edges = G.sbm_graph(sizes, G.sbm_probs(sizes, spec.homophily, p.mean_degree), int(rng.integers(1 << 31)))
    noisy = rng.random(spec.n) < p.text_noise
    text_class = np.where(noisy, (labels + rng.integers(1, p.n_classes, spec.n)) % p.n_classes, labels)
    texts = G.node_texts(text_class, [G.TOPICS[t] for t in TOPIC_ORDER[: p.n_classes]], p.words, rng,
                         word_noise=p.word_noise, topic_share=spec.q)
    return labels, texts, edges


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    if p.dataset == "synthetic":
        graphs = [_synthetic(spec, p, rng) for spec in (p.graph1, p.graph2)]
    else:
        tags = [G.load_tag_folder(input_path(f)) for f in p.folders[:2]]
        graphs = [(t.label, t.text, t.edges) for t in tags]
    n_cols = {c: [] for c in ("node_id", "graph_id", "label", "text", "split", "order")}
    e_cols = {c: [] for c in ("graph_id", "src", "dst", "heldout")}
    for gid, (labels, texts, edges) in enumerate(graphs):
        n = len(labels)
        order = np.empty(n, dtype=np.int64)
        order[rng.permutation(n)] = np.arange(n)  # a node's rank in a seeded permutation: train = lowest ranks
        split = np.where(order >= n - round(p.test_share * n), "test", "pool")
        heldout = np.zeros(len(edges), bool)
        if gid == 0:
            heldout[rng.permutation(len(edges))[: round(p.heldout_edges * len(edges))]] = True
        for c, v in zip(n_cols, (np.arange(n), np.full(n, gid), labels, texts, split, order), strict=True):
            n_cols[c] += list(v)
        for c, v in zip(e_cols, (np.full(len(edges), gid), edges[:, 0], edges[:, 1], heldout), strict=True):
            e_cols[c] += list(v)
    emb = G.text_embeddings(n_cols["text"], p.text_encoder)  # (N, 384)
    write_table(out_dir / "nodes.parquet", n_cols)
    write_table(out_dir / "edges.parquet", e_cols)
    write_table(out_dir / "text_emb.parquet", {"node_id": n_cols["node_id"], "graph_id": n_cols["graph_id"],
                                                **{f"e_{i}": emb[:, i] for i in range(emb.shape[1])}})


def _load(data_dir: Path) -> list[dict]:
    n, e, t = (read_table(data_dir / f) for f in ("nodes.parquet", "edges.parquet", "text_emb.parquet"))
    emb = np.stack([t[f"e_{i}"] for i in range(len([c for c in t if c.startswith("e_")]))], 1)
    out = []
    for gid in (0, 1):
        rows, erows = n["graph_id"] == gid, e["graph_id"] == gid
        edges = np.stack([e["src"][erows], e["dst"][erows]], 1)
        held = e["heldout"][erows]
        out.append({"x": torch.from_numpy(emb[rows].astype(np.float32)), "y": torch.from_numpy(n["label"][rows]),
                    "split": n["split"][rows], "order": n["order"][rows], "n": int(rows.sum()),
                    "ei": G.edge_index(edges[~held], int(rows.sum())), "heldout": edges[held]})
    return out


def train_nodes(g: dict, rate: float) -> np.ndarray:
    return np.flatnonzero((g["split"] == "pool") & (g["order"] < round(rate * g["n"])))


# ---- the mechanism -----------------------------------------------------------------------------------------
class Aligner(nn.Module):
    """GCN + per-layer projectors, text projector, learnable tau, classifier on [h^L; P_t t] (or text only)."""

    def __init__(self, p: Params, in_dim: int, k: int, kind: str):
        super().__init__()
        self.p, self.kind = p, kind
        self.gcn = G.GNN("gcn", in_dim, p.hidden, p.hidden, layers=2)
        self.p_g = nn.ModuleList(nn.Linear(p.hidden, p.dim) for _ in range(2))
        self.p_t = nn.Sequential(nn.Linear(in_dim, p.hidden), nn.ReLU(), nn.Linear(p.hidden, p.dim))
        self.log_tau = nn.Parameter(torch.zeros(1))  # (1,): DeepSpeed cannot broadcast 0-d
        self.mlp = nn.Sequential(nn.Linear(in_dim, p.hidden), nn.ReLU(), nn.Linear(p.hidden, k))
        self.cls = nn.Linear(p.hidden + p.dim, k)

    def text(self, t: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.p_t(t), dim=-1)  # (..., d_z)

    def graph(self, x, ei) -> list[torch.Tensor]:
        """[P_g^l h^l] per layer, normalised, and the raw last layer h^L."""
        hs = self.gcn(x, ei, all_layers=True)
        return [F.normalize(proj(h), dim=-1) for proj, h in zip(self.p_g, hs, strict=True)], hs[-1]

    def energy(self, zg: torch.Tensor, zt: torch.Tensor) -> torch.Tensor:
        """E(h, t) = ||P_g h - P_t t||^2 / tau; zg (n, d) broadcasts against zt (n, d) or (n, M, d)."""
        if zt.dim() == 3:
            zg = zg[:, None]
        return ((zg - zt) ** 2).sum(-1) / self.log_tau.exp()

    def forward(self, x, ei):
        """-> logits (n, K), per-layer graph views, text view, raw h^L."""
        if self.kind == "mlp":
            return self.mlp(x), None, None, None
        zg, h = self.graph(x, ei)
        zt = self.text(x)
        return self.cls(torch.cat([h, zt], 1)), zg, zt, h

    def loss(self, x, ei, y, labelled, nodes):
        logits, zg, zt, _ = self(x, ei)
        ce = F.cross_entropy(logits[labelled], y[labelled])
        if self.kind in ("mlp", "gcn"):
            return ce
        if self.kind == "infonce":
            return ce + self.p.lam * info_nce(zg[-1][nodes], zt[nodes], self.log_tau.exp())
        if self.kind == "mse":
            return ce + self.p.lam * ((zg[-1] - zt)[nodes] ** 2).sum(-1).mean()
        layers = zg[-1:] if self.kind == "final_only" else zg
        if self.kind == "cd":
            neg = langevin_negatives(self, layers, x[nodes], nodes, self.p)
            align = 0.0
            for z in layers:
                e_pos, e_neg = self.energy(z[nodes], zt[nodes]), self.energy(z[nodes], self.text(neg))
                # CD's E+ - E- is unbounded below (shrinking tau wins); the usual energy-magnitude penalty
                align = align + (e_pos - e_neg).mean() + self.p.cd_reg * (e_pos**2 + e_neg**2).mean()
        else:  # eralign, final_only: energy discrepancy
            align = sum(energy_discrepancy(self, z[nodes], x[nodes], self.p) for z in layers)
        return ce + self.p.lam * align


def energy_discrepancy(net: Aligner, zg: torch.Tensor, t: torch.Tensor, p: Params) -> torch.Tensor:
    """L_ED = mean_v log(w/M + 1/M sum_j exp(E(h_v, t_v) - E(h_v, t'_j))), t' = t + sqrt(s) xi + sqrt(s) xi_j."""
    y = t + math.sqrt(p.s) * torch.randn_like(t)  # (n, 384)
    neg = y[:, None] + math.sqrt(p.s) * torch.randn(len(t), p.negatives, t.shape[1])  # (n, M, 384)
    diff = net.energy(zg, net.text(t))[:, None] - net.energy(zg, net.text(neg))  # (n, M)
    stab = torch.full((len(t), 1), math.log(p.w / p.negatives))
    return torch.logsumexp(torch.cat([stab, diff - math.log(p.negatives)], 1), 1).mean()


def langevin_negatives(net: Aligner, layers: list[torch.Tensor], t: torch.Tensor, nodes, p: Params) -> torch.Tensor:
    """Contrastive divergence negatives: Langevin on t under sum_l E_l(h, .), started from the data, detached."""
    neg = t.detach().clone()
    targets = [z[nodes].detach() for z in layers]
    for _ in range(p.langevin_steps):
        neg.requires_grad_(True)
        e = sum(net.energy(z, net.text(neg)).sum() for z in targets)
        (grad,) = torch.autograd.grad(e, neg)
        neg = (neg - p.langevin_step_size * grad + math.sqrt(2 * p.langevin_step_size) * torch.randn_like(neg))
        neg = neg.detach()
    return neg


class _Flops:
    """Matmul FLOPs of the aten ops that run inside it (torch's flop formulas). FlopCounterMode itself hooks modules
    for its per-module table, and those hooks break autograd.grad (CD's Langevin chain), so the dispatch mode here
    only counts."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                formula = flop_registry.get(func._overloadpacket)
                if formula is not None:
                    counter.total += int(formula(*args, **kwargs, out_val=out))
                return out

        self.total, self.mode = 0, Mode()

    def __enter__(self) -> _Flops:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


def step_flops(net: Aligner, g: dict, labelled: torch.Tensor, nodes: torch.Tensor) -> float:
    """Matmul FLOPs one full-batch training step (loss forward + backward) executed, per node: counted on the ops
    that ran, so ED's per-layer repetition (L x (1 + M) text-projector passes) and CD's Langevin chain (its input
    gradients included) count as executed. Message passing (scatter) is not a matmul and is not counted; it is the
    same for every arm."""
    was = net.training
    net.train()
    net.zero_grad(set_to_none=True)
    with _Flops() as counter:
        net.loss(g["x"], g["ei"], g["y"], labelled, nodes).backward()
    net.zero_grad(set_to_none=True)
    net.train(was)
    return counter.total / len(nodes)


# ---- training ----------------------------------------------------------------------------------------------
def _runs(p: Params) -> list[tuple[str, float]]:
    runs = [(k, r) for r in p.label_rates for k in EVERY_RATE]
    return runs + [(k, p.ablation_rate) for k in AT_ABLATION_RATE]


def _name(kind: str, rate: float) -> str:
    return f"{kind}_r{round(rate * 100)}"


class AllRuns(nn.Module):
    def __init__(self, p: Params, in_dim: int, k: int):
        super().__init__()
        nets = {}
        for i, (kind, rate) in enumerate(_runs(p)):
            torch.manual_seed(p.seed * 1000 + i)
            nets[_name(kind, rate)] = Aligner(p, in_dim, k, kind)
        self.nets = nn.ModuleDict(nets)

    def forward(self, g: dict, labelled: dict[str, torch.Tensor], nodes: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: net.loss(g["x"], g["ei"], g["y"], labelled[name], nodes) for name, net in self.nets.items()}


def train(ctx) -> None:
    p: Params = ctx.params
    g = _load(ctx.data_dir)[0]
    k = int(g["y"].max()) + 1
    model = AllRuns(p, g["x"].shape[1], k)
    rates = sorted({r for _, r in _runs(p)})
    mask_of = {r: torch.zeros(g["n"], dtype=torch.bool) for r in rates}
    for r in rates:
        mask_of[r][train_nodes(g, r)] = True

    def batch_fn(step: int) -> dict[str, torch.Tensor]:  # full batch; ranks split the nodes
        return {"nodes": torch.arange(g["n"])}

    def step_fn(engine, batch, step):
        nodes = batch["nodes"].cpu()
        labelled = {_name(kd, r): nodes[mask_of[r][nodes]] for kd, r in _runs(p)}
        losses = engine(g, labelled, nodes)
        return sum(losses.values()), {f"{n}_loss": float(v.detach()) for n, v in losses.items()}

    ctx.progress(f"phase align: {len(model.nets)} models in lock-step, {p.epochs} full-batch epochs")
    engine = ctx.engine(model, p.lr, p.weight_decay, arms=model.nets)  # each run clipped alone, as if trained alone
    ctx.fit("align", engine, step_fn, batch_fn, p.epochs, log_every=20)


# ---- evaluation --------------------------------------------------------------------------------------------
def _features(net: Aligner, g: dict) -> np.ndarray:
    with torch.no_grad():
        if net.kind == "mlp":
            return net.mlp[:2](g["x"]).numpy()  # the MLP's hidden layer
        return torch.cat(net(g["x"], g["ei"])[3:] + (net.text(g["x"]),), 1).numpy()


def _transfer(net: Aligner, g1: dict, g2: dict, seed: int) -> tuple[float, float]:
    """Link-prediction AUC on graph 1's held-out edges; node accuracy of a linear probe on graph 2."""
    f1 = _features(net, g1)
    rng = np.random.default_rng(seed)
    pos = g1["heldout"]
    neg = rng.integers(0, g1["n"], size=(len(pos), 2))
    pairs = np.concatenate([pos, neg])
    x, y = f1[pairs[:, 0]] * f1[pairs[:, 1]], np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    half = rng.permutation(len(pairs)) < len(pairs) // 2
    auc = roc_auc_score(y[~half], LogisticRegression(max_iter=2000).fit(x[half], y[half]).predict_proba(x[~half])[:, 1])
    f2, y2 = _features(net, g2), g2["y"].numpy()
    tr = train_nodes(g2, 0.2)
    te = np.flatnonzero(g2["split"] == "test")
    acc = LogisticRegression(max_iter=2000).fit(f2[tr], y2[tr]).score(f2[te], y2[te])
    return float(auc), float(acc)


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    g1, g2 = _load(ctx.data_dir)
    model = ctx.network("align")
    test = np.flatnonzero(g1["split"] == "test")
    out, accs = {}, {}
    for kind, rate in _runs(p):
        net = model.nets[_name(kind, rate)]
        prefix = "method" if kind == "eralign" else f"baseline/{kind}"
        with torch.no_grad():
            logits, zg, zt, _ = net(g1["x"], g1["ei"])
        acc = float((logits.argmax(-1)[test] == g1["y"][test]).float().mean())
        out[f"{prefix}/acc_r{round(rate * 100)}"] = acc
        accs.setdefault(kind, {})[rate] = acc
        if rate == p.ablation_rate:
            torch.manual_seed(p.seed)
            labelled = torch.from_numpy(train_nodes(g1, rate))
            out[f"{prefix}/cost_per_step"] = step_flops(net, g1, labelled, torch.arange(g1["n"]))
            out[f"{prefix}/transfer_auc"], out[f"{prefix}/transfer_acc"] = _transfer(net, g1, g2, p.seed)
            if zg is not None:
                torch.manual_seed(p.seed)
                t = g1["x"][test]
                neg = t + math.sqrt(2 * p.s) * torch.randn_like(t)
                with torch.no_grad():
                    gap = net.energy(zg[-1][test], net.text(neg)) - net.energy(zg[-1][test], zt[test])
                out[f"detail/{kind}/energy_gap"] = float(gap.mean())
                out[f"detail/{kind}/cka"] = linear_cka(zg[-1][test].numpy(), zt[test].numpy())
    for rate in p.label_rates:  # the best baseline at each rate (the room-to-improve premise reads it)
        out[f"detail/best_baseline_acc_r{round(rate * 100)}"] = max(
            by_rate[rate] for kind, by_rate in accs.items() if kind in BASELINES and rate in by_rate)
    _plot(ctx.plots_dir / "accuracy_by_label_rate.png", accs)
    return out


def _plot(path: Path, accs: dict) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for kind, by_rate in accs.items():
        rates = sorted(by_rate)
        lw = 2 if kind == "eralign" else 1
        ax.plot([100 * r for r in rates], [by_rate[r] for r in rates], "o-", label=kind, lw=lw)
    ax.set(xlabel="label rate (%)", ylabel="test accuracy", title="ERAlign vs baselines on graph 1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _claim() -> Claim:
    base = tuple(k for k in EVERY_RATE if k != "eralign")
    return Claim(premises=(  # the experiment tests alignment only if the encoders learn the task (chance 1/5) ...
        Compare("baseline/gcn/acc_r5", ">", 0.2, name="gcn_above_chance_r5"),
        Compare("baseline/mlp/acc_r5", ">", 0.2, name="mlp_above_chance_r5"),
        # ... and only if the best baseline is below the ceiling: at ~0.93 on 200 test nodes, one node was the effect
        *(Compare(f"detail/best_baseline_acc_r{r}", "<=", ROOM_BAR, name=f"room_to_improve_r{r}",
                  guards=(f"method/acc_r{r}",)) for r in (5, 20)),
    ), all_of=(
        Compare("method/acc_r5", ">", tuple(f"baseline/{k}/acc_r5" for k in base)),
        Compare("method/acc_r20", ">", tuple(f"baseline/{k}/acc_r20" for k in (*base, "cd"))),
        Compare("method/transfer_auc", ">", tuple(f"baseline/{k}/transfer_auc" for k in (*base, "cd"))),
        Compare("method/acc_r20", ">=", "baseline/cd/acc_r20", margin=-0.01),
        Compare("method/acc_r20", ">", "baseline/final_only/acc_r20"),
    ), context=(  # counted work, deterministic given M, L and the Langevin steps: shown, not evidence
        Compare("method/cost_per_step", "<", "baseline/cd/cost_per_step"),
    ), summary="ERAlign beats every baseline at 5% and 20% labels and on link-prediction transfer; ED is cheaper "
               "than CD at no more than 1 point of accuracy; layer-wise beats final-only")


PAPER = Paper(
    id="eralign",
    title="ERAlign: energy-based representation alignment for text-attributed graphs",
    seed="003_9a806cafa3d919df.txt, abstract 10",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/acc_r20", "max"),
    claim=_claim(),
)
