"""PerturbedVAE: separating sparse perturbation effects from the dominant invariant cell state.

Seed: 003_9a806cafa3d919df.txt, abstract 11. Spec: ../shared/papers/perturbed_vae.md.

What it implements (function names in brackets):
- a synthetic single-cell generator whose invariant latent carries a share `rho_inv` of the log-expression variance
  (the dominance knob) and whose perturbations shift 1-`max_targets` of 8 causal latents of a linear SCM on a random
  DAG; negative-binomial counts with log-normal library sizes [simulate, prepare];
- PerturbedVAE [PerturbedVAE]: Gaussian encoders q(z_inv|x) (16-d) and q(z_p|x) (8-d) from log1p-normalised counts;
  the sparse perturbation model z_p = (I - A)^-1 (z_base + sum_{g in P} m_g e_g) with hard-concrete gates m_g and
  an L0 penalty [hard_concrete, l0_penalty], A strictly upper-triangular with an L1 penalty; the ELBO's prior on z_p
  is the Gaussian N((I - A)^-1 shift, (I - A)^-1 (I - A)^-T), its KL in closed form [kl_scm_prior]; z_inv has the
  prior N(0, I) and an adversary with gradient reversal keeps perturbation identity out of it [GradReverse];
  a negative-binomial decoder with mean library x softmax(MLP([z_inv, z_p])) and gene-wise dispersion [nb_log_prob];
- prediction for a perturbation set P, unseen doubles included: encode control cells, keep z_inv and z_base, apply
  the summed masked effects, decode means [PerturbedVAE.predict];
- baselines: additive shifts in log space, a CPA-style compositional autoencoder [CPAStyle], a conditional VAE with
  a multi-hot perturbation input [CondVAE], and the ablations no masks / no adversary (flags of PerturbedVAE);
- every network is trained on the ELBO per gene [elbo_per_gene]: the summed NB likelihood (hundreds of nats a cell)
  would otherwise swamp the adversary, and the sum would make every lambda's weight depend on the panel's size;
- metrics: Pearson-delta and MSE on each held-out double's top-20 DE genes [de20_scores], MCC of latents after
  Hungarian matching [mcc], F1 of the learned mask supports after that matching [mask_f1];
- the dominance sweep [sweep_worlds]: the same synthetic draw at rho_inv = 0.5 (`sweep_rho`), on which PerturbedVAE
  and the cVAE are trained again; the part compares their drops in Pearson-delta-DE20 from 0.5 to rho_inv;
- premise: z_p carries the perturbation, read by a logistic probe from PerturbedVAE's posterior means of z_p on the
  training conditions' cells, in every world, against the majority-class rate [probe_accuracy]; the same probe on
  z_inv (what the adversary works against) is shown beside it.

Turning the phenomenon off: `rho_inv` near 0 removes the dominant invariant variation (every model sees the
perturbation signal), and `max_targets` = 8 makes the effects dense, so the sparse-mask prior has nothing to find.

Deviations from the paper (choices the abstract left open):
- Every encoder (PerturbedVAE's two, CPA-style's, the cVAE's) reads the log1p-normalised counts standardised per
  gene with a mean and std fixed from its world's training cells [GeneScaler]. Fed the raw log1p values (~4 +- 0.5 a
  gene), PerturbedVAE's encoders caught the dominant invariant variation but not the perturbation signal within the
  smoke budget (at rho_inv 0.9, one replicate in three had a z_p no better than chance at reading the condition).
- The generator's decoder is additive in log space over two random MLPs (one of z_inv, one of z_p), each scaled so
  that z_inv's share of control log-rate variance is exactly rho_inv; the model's decoder is a full MLP of both.
- Predicted changes are the model's decoded perturbed means minus its own decoded control means (log1p-normalised),
  which cancels the decoder's bias common to both; true changes come from the held-out cells.
- The cVAE's MCC matches the 8 true causal latents against its whole 24-d latent (a choice that favours it).
- The spec runs the rho_inv sweep in the full profile only; here it runs in every profile (the claim is the same in
  each), always on synthetic worlds (the full profile's Norman data has no dominance knob), with only the two arms
  it compares. The smoke profile leaves out the two ablations (no part reads them) to train the rest longer.
- Loss scaling: the ELBO of every arm (PerturbedVAE, ablations, CPA-style, cVAE) is divided by G; the L0 and L1
  penalties, log-priors on global parameters, are divided with it (they trade against the KL, which is per cell);
  the adversary is not, so lambda_adv is relative to a per-gene ELBO. With lambda_adv = 1 on this scale the
  gradient reversal empties z_inv altogether (posterior = prior) and the invariant variation moves into z_p, so the
  default is 0.1 (chosen by the z_p premise, for every adversarial arm).
- The full profile reads Norman et al. 2019 from an .h5ad file [load_norman_h5ad] (AnnData's HDF5 layout read
  with h5py: anndata is not installed; raw counts from `layers/counts`, else `X`, refused unless integer-valued:
  the decoders are negative-binomial) or from a Matrix Market export (`matrix.mtx` cells x genes, `obs.csv`)
  [load_norman_mtx]; both with a `condition` column "A+B" / "A+ctrl" / "ctrl". MCC and mask F1 need the synthetic
  truth (0 on real data).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from scipy.optimize import linear_sum_assignment
from torch import nn

from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

D_INV, D_P = 16, 8


class Params(PaperParams):
    dataset: Literal["synthetic", "norman_h5ad", "norman_mtx"] = Field("synthetic", description="Generator, or "
                                                                     "Norman et al. 2019 (.h5ad or mtx export).")
    dataset_dir: str = Field("", description="norman_h5ad: the .h5ad file; norman_mtx: folder with matrix.mtx and "
                                             "obs.csv.")
    genes: int = Field(200, ge=10, description="Genes G.")
    singles: int = Field(12, ge=2, description="Single perturbations K.")
    doubles: int = Field(20, ge=2, description="Double perturbations (half held out, OOD combinatorial).")
    cells: int = Field(6000, ge=100, description="Cells in all (controls get a double share).")
    rho_inv: float = Field(0.9, ge=0.0, lt=1.0, description="Invariant latent's share of log-expression variance.")
    max_targets: int = Field(2, ge=1, le=D_P, description="A single perturbation shifts 1..max_targets latents.")
    effect_size: float = Field(2.0, gt=0, description="Magnitude of a perturbation's latent shift.")
    signal_scale: float = Field(1.0, gt=0, description="Std of the log-rate signal per gene.")
    library_mean: float = Field(3000.0, gt=0, description="Median library size (log-normal, sigma 0.3).")
    nb_theta: float = Field(10.0, gt=0, description="Generator's negative-binomial inverse dispersion.")
    steps: int = Field(400, ge=1, description="Training steps of every network (all in lock-step).")
    batch_size: int = Field(256, ge=2)
    lr: float = Field(2e-3, gt=0)
    hidden: int = Field(128, ge=8, description="Hidden width of encoders and decoders.")
    lambda_adv: float = Field(0.1, ge=0, description="Adversary weight (gradient reversal strength) against the "
                                                     "ELBO per gene (elbo_per_gene), in every adversarial arm.")
    lambda_l0: float = Field(0.05, ge=0, description="L0 penalty on the hard-concrete masks, in the ELBO's nats "
                                                     "per cell (a log-prior, scaled by 1/G with the ELBO).")
    lambda_a: float = Field(0.01, ge=0, description="L1 penalty on the SCM matrix A (as lambda_l0).")
    kl_warmup: int = Field(100, ge=0, description="Steps of linear KL warm-up.")
    gate_warmup: int = Field(0, ge=0, description="Steps for which the gate logits stay frozen open and the L0 "
                                                  "penalty is off, so the effects grow before the gates can close.")
    effect_init: float = Field(0.1, gt=0, description="Std of the effects' initial N(0, std^2) entries.")
    sweep_rho: list[float] = Field([0.5], description="rho_inv of the sweep's further synthetic worlds (the same "
                                   "draw but for rho_inv); PerturbedVAE and the cVAE also train on each.")
    ablations: bool = Field(True, description="Train the two ablations (no masks, no adversary); no claim reads "
                                              "them.")


# ---- data --------------------------------------------------------------------------------------------------
def _random_mlp(rng: np.random.Generator, d_in: int, genes: int, hidden: int = 32):
    w1, b1 = rng.normal(0, 1 / np.sqrt(d_in), (d_in, hidden)), rng.normal(0, 0.5, hidden)
    w2 = rng.normal(0, 1 / np.sqrt(hidden), (hidden, genes))
    return lambda z: np.tanh(z @ w1 + b1) @ w2  # (N, d_in) -> (N, G)


def simulate(p: Params) -> dict:
    """Cells of controls, singles and doubles; see the module docstring for the generative model."""
    rng = np.random.default_rng(p.seed)
    a_true = np.triu(rng.uniform(0.5, 1.0, (D_P, D_P)) * rng.choice([-1, 1], (D_P, D_P)), 1)
    a_true *= rng.random((D_P, D_P)) < 0.3  # random DAG in the fixed order 0 < 1 < ... < 7
    mask = np.zeros((p.singles, D_P), bool)
    for g in range(p.singles):
        mask[g, rng.choice(D_P, size=rng.integers(1, p.max_targets + 1), replace=False)] = True
    shift = mask * rng.choice([-1, 1], mask.shape) * p.effect_size * rng.uniform(0.75, 1.25, mask.shape)
    pairs = [tuple(sorted(rng.choice(p.singles, 2, replace=False))) for _ in range(4 * p.doubles)]
    pairs = list(dict.fromkeys(pairs))[: p.doubles]
    conds = [()] + [(g,) for g in range(p.singles)] + pairs
    share = np.array([2.0] + [1.0] * (len(conds) - 1))
    n_per = np.maximum((share / share.sum() * p.cells).astype(int), 10)
    cond_id = np.repeat(np.arange(len(conds)), n_per)
    n = len(cond_id)
    multi = np.zeros((n, p.singles), np.float32)
    for c, members in enumerate(conds):
        multi[np.ix_(np.flatnonzero(cond_id == c), list(members))] = 1.0
    b_true = np.linalg.inv(np.eye(D_P) - a_true)
    z_inv = rng.standard_normal((n, D_INV))
    z_p = (rng.standard_normal((n, D_P)) + multi @ shift) @ b_true.T  # (N, 8): SCM solved for every cell
    f_inv, f_p = _random_mlp(rng, D_INV, p.genes), _random_mlp(rng, D_P, p.genes)
    ctrl = cond_id == 0
    u, v = f_inv(z_inv), f_p(z_p)
    u = (u - u[ctrl].mean(0)) / u[ctrl].std(0)  # unit variance per gene on controls
    v = (v - v[ctrl].mean(0)) / v[ctrl].std(0)
    log_rate = rng.normal(0, 1, p.genes) + p.signal_scale * (np.sqrt(p.rho_inv) * u + np.sqrt(1 - p.rho_inv) * v)
    library = np.exp(rng.normal(np.log(p.library_mean), 0.3, n))
    mu = library[:, None] * np.exp(log_rate) / np.exp(log_rate).sum(1, keepdims=True)
    counts = rng.poisson(rng.gamma(p.nb_theta, mu / p.nb_theta))  # NB(mean mu, inverse dispersion theta)
    held = set(range(1 + p.singles + len(pairs) // 2, len(conds)))  # the second half of the doubles
    split = np.where(np.isin(cond_id, list(held)), "test", "train")
    names = ["ctrl" if not c else "+".join(f"g{g:02d}" for g in c) for c in conds]
    return {"counts": counts, "cond": np.array(names)[cond_id], "split": split, "library": library, "z_p": z_p,
            "shift": shift, "mask": mask, "a": a_true}


def load_norman_mtx(folder: Path) -> dict:
    """Norman et al. 2019 as a Matrix Market export: matrix.mtx (cells x genes) and obs.csv with `condition`."""
    from scipy.io import mmread

    counts = np.asarray(mmread(str(folder / "matrix.mtx")).todense()).astype(np.int64)
    with open(folder / "obs.csv") as f:
        cond = [r["condition"] for r in csv.DictReader(f)]
    return _norman(counts, cond)


def _h5ad_matrix(node) -> np.ndarray:
    """An AnnData matrix: a dense dataset, or a csr/csc group (data, indices, indptr, attrs shape) -> dense."""
    if not hasattr(node, "keys"):
        return node[()]
    from scipy.sparse import csc_matrix, csr_matrix

    kind = node.attrs.get("encoding-type", node.attrs.get("h5sparse_format", "csr"))
    kind = kind.decode() if isinstance(kind, bytes) else kind
    make = csc_matrix if kind.startswith("csc") else csr_matrix
    return make((node["data"][()], node["indices"][()], node["indptr"][()]), shape=tuple(node.attrs["shape"])).toarray()


def _h5ad_column(obs, name: str) -> list[str]:
    """An obs column: plain strings, a categorical group (codes, categories; anndata >= 0.8), or codes with
    obs/__categories/<name> (anndata 0.7)."""
    col = obs[name]
    if hasattr(col, "keys"):
        codes, cats = col["codes"][()], col["categories"][()]
    elif "__categories" in obs and name in obs["__categories"]:
        codes, cats = col[()], obs["__categories"][name][()]
    else:
        return [v.decode() if isinstance(v, bytes) else str(v) for v in col[()]]
    cats = [c.decode() if isinstance(c, bytes) else str(c) for c in cats]
    return [cats[c] for c in codes]


def load_norman_h5ad(path: Path) -> dict:
    """Norman et al. 2019 as an .h5ad file (GEARS' `perturb_processed.h5ad` or a scanpy export): raw counts from
    `layers/counts` if present, else `X`; obs `condition` ("A+B", "A+ctrl", "ctrl")."""
    import h5py

    with h5py.File(path, "r") as f:
        x = _h5ad_matrix(f["layers"]["counts"] if "layers" in f and "counts" in f["layers"] else f["X"])
        cond = _h5ad_column(f["obs"], "condition")
    if not np.allclose(x, np.round(x)) or x.min() < 0:
        raise ValueError(f"{path}: expression is not raw counts (normalised?); the decoders are negative-binomial: "
                         "give an .h5ad with counts in X or layers/counts")
    return _norman(np.round(x).astype(np.int64), cond)


def _norman(counts: np.ndarray, cond: list[str]) -> dict:
    """Conditions as sorted gene sets ("ctrl", "A", "A+B"); the second half of the doubles (sorted) held out."""
    cond = ["ctrl" if c == "ctrl" else "+".join(sorted(x for x in c.split("+") if x != "ctrl")) for c in cond]
    doubles = sorted({c for c in cond if "+" in c})
    held = set(doubles[len(doubles) // 2 :])
    split = np.array(["test" if c in held else "train" for c in cond])
    return {"counts": counts, "cond": np.array(cond), "split": split, "library": counts.sum(1).astype(float)}


def sweep_worlds(p: Params) -> dict[float, str]:
    """rho_inv -> the folder (under the data folder) of each synthetic world of the dominance sweep: the main one
    when it is synthetic, and one per `sweep_rho` (plus one at `rho_inv` when the main data set is real)."""
    rhos = sorted({*p.sweep_rho, p.rho_inv})
    return {r: "" if p.dataset == "synthetic" and r == p.rho_inv else f"rho_{r:g}" for r in rhos}


def prepare(p: Params, out_dir: Path) -> None:
    if p.dataset == "synthetic":
        _write(simulate(p), out_dir)
    else:
        _write((load_norman_h5ad if p.dataset == "norman_h5ad" else load_norman_mtx)(input_path(p.dataset_dir)),
               out_dir)
    for rho, sub in sweep_worlds(p).items():
        if sub:  # the same seed: the same DAG, programs and decoders, only the dominance differs
            (out_dir / sub).mkdir(parents=True, exist_ok=True)
            _write(simulate(p.model_copy(update={"rho_inv": rho})), out_dir / sub)


def _write(d: dict, out_dir: Path) -> None:
    cell, gene = np.nonzero(d["counts"])
    write_table(out_dir / "counts.parquet", {"cell_id": cell, "gene_id": gene, "count": d["counts"][cell, gene]})
    obs = {"cell_id": np.arange(len(d["cond"])), "perturbation": d["cond"], "split": d["split"],
           "library": d["library"], "genes": np.full(len(d["cond"]), d["counts"].shape[1])}
    if "z_p" in d:
        obs["z_causal"] = d["z_p"].astype(np.float32)  # the true causal latents (synthetic only), for MCC
    write_table(out_dir / "obs.parquet", obs)
    if "shift" in d:
        singles = [f"g{g:02d}" for g in range(len(d["shift"]))]
        write_table(out_dir / "truth.parquet", {"perturbation": singles, "shift": d["shift"].astype(np.float32),
                                                "mask": d["mask"].astype(np.float32)})


# ---- networks ----------------------------------------------------------------------------------------------
def _mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, d_out))


def log_normalise(x: torch.Tensor) -> torch.Tensor:
    """log1p of counts per 10^4 (the encoders' input and the evaluation's expression scale). (B, G) -> (B, G)."""
    return torch.log1p(x / x.sum(-1, keepdim=True).clamp(min=1) * 1e4)


class GeneScaler(nn.Module):
    """Every encoder's input: log1p-normalised counts standardised per gene, with a mean and std fixed from a world's
    training cells [fit]. Raw log1p values sit at ~4 +- 0.5 per gene, and a first layer fed them spends its early
    steps on the per-gene offsets: then within the smoke budget the encoders capture the dominant invariant
    variation but not the weak perturbation signal (see the module docstring). Identity until fitted."""

    def __init__(self, genes: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(genes))
        self.register_buffer("std", torch.ones(genes))

    @torch.no_grad()
    def fit(self, x: torch.Tensor) -> GeneScaler:
        xl = log_normalise(x)  # (N, G)
        self.mean.copy_(xl.mean(0))
        self.std.copy_(xl.std(0).clamp(min=1e-3))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (log_normalise(x) - self.mean) / self.std  # (B, G)


def nb_log_prob(x: torch.Tensor, mean: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Negative-binomial log-likelihood with mean `mean` and inverse dispersion `theta` (per gene). (B, G)."""
    log_t_mu = torch.log(theta + mean + 1e-8)
    return (torch.lgamma(x + theta) - torch.lgamma(theta) - torch.lgamma(x + 1)
            + theta * (torch.log(theta + 1e-8) - log_t_mu) + x * (torch.log(mean + 1e-8) - log_t_mu))


class GradReverse(torch.autograd.Function):
    """Identity forward; gradient multiplied by -scale backward (the adversary's min-max in one loss)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


HC_BETA, HC_GAMMA, HC_ZETA = 2 / 3, -0.1, 1.1  # hard-concrete constants (Louizos et al. 2018)


def hard_concrete(log_alpha: torch.Tensor, training: bool) -> torch.Tensor:
    """Gates in [0, 1] with exact zeros: a stretched, clipped concrete sample (training) or its median (eval)."""
    if training:
        u = torch.rand_like(log_alpha).clamp(1e-6, 1 - 1e-6)
        s = torch.sigmoid((u.log() - (1 - u).log() + log_alpha) / HC_BETA)
    else:
        s = torch.sigmoid(log_alpha)
    return (s * (HC_ZETA - HC_GAMMA) + HC_GAMMA).clamp(0.0, 1.0)


def l0_penalty(log_alpha: torch.Tensor) -> torch.Tensor:
    """Expected number of non-zero gates, sum P(m > 0)."""
    return torch.sigmoid(log_alpha - HC_BETA * np.log(-HC_GAMMA / HC_ZETA)).sum()


def kl_scm_prior(mu: torch.Tensor, logvar: torch.Tensor, shift: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, diag e^logvar) || N(B shift, B B^T)), B = (I - A)^-1, A strictly upper-triangular (det B = 1).

    With M = I - A: tr(M^T M S) = sum_j s_j ||M[:, j]||^2 and the Mahalanobis term is ||M mu - shift||^2."""
    m = torch.eye(a.shape[0], device=a.device) - a  # (8, 8)
    var = logvar.exp()  # (B, 8)
    trace = (var * (m**2).sum(0)).sum(-1)
    maha = ((mu @ m.T - shift) ** 2).sum(-1)
    return 0.5 * (trace + maha - a.shape[0] - logvar.sum(-1))  # (B,)


def elbo_per_gene(nll: torch.Tensor, kl: torch.Tensor, warm: float = 1.0, prior: torch.Tensor | float = 0.0
                  ) -> torch.Tensor:
    """The negative ELBO per cell and gene: (batch mean of sum_g NLL_g + warm * KL, plus `prior`) / G.
    nll (B, G), kl (B,); `prior`: penalties on global parameters (the L0 count of the masks, ||A||_1), which act as
    their log-prior and so are scaled with the ELBO, keeping their balance with the KL they trade against.

    A likelihood summed over G genes grows with G (hundreds to thousands of nats a cell) while an adversary's
    cross-entropy does not, so with the sum the adversary would weigh 1/G as much in a larger panel. Dividing the
    ELBO by G equals multiplying lambda_adv by G; every network here is trained on this scale."""
    return ((nll.sum(-1) + warm * kl).mean() + prior) / nll.shape[-1]


class PerturbedVAE(nn.Module):
    def __init__(self, genes: int, singles: int, conditions: int, hidden: int, p: Params, masks: bool = True,
                 adversary: bool = True):
        super().__init__()
        self.p, self.use_masks, self.use_adv = p, masks, adversary
        self.scaler = GeneScaler(genes)
        self.enc_inv, self.enc_p = _mlp(genes, hidden, 2 * D_INV), _mlp(genes, hidden, 2 * D_P)
        self.decoder = _mlp(D_INV + D_P, hidden, genes)
        self.log_theta = nn.Parameter(torch.zeros(genes))
        self.effects = nn.Parameter(p.effect_init * torch.randn(singles, D_P))  # e_g
        self.log_alpha = nn.Parameter(torch.full((singles, D_P), 1.0))  # hard-concrete gate logits
        self.a_raw = nn.Parameter(torch.zeros(D_P, D_P))
        self.register_buffer("order", torch.triu(torch.ones(D_P, D_P), 1))  # fixed causal order
        self.adversary = _mlp(D_INV, hidden, conditions)

    def a(self) -> torch.Tensor:
        return self.a_raw * self.order  # strictly upper-triangular

    def gates(self, frozen: bool = False) -> torch.Tensor:
        """(K, 8) gates; `frozen`: sampled from the logits without a gradient to them (the gates' warm-up)."""
        log_alpha = self.log_alpha.detach() if frozen else self.log_alpha
        return hard_concrete(log_alpha, self.training) if self.use_masks else torch.ones_like(log_alpha)

    def encode(self, x: torch.Tensor):
        xl = self.scaler(x)
        mi, lvi = self.enc_inv(xl).chunk(2, -1)  # (B, 16) each
        mp, lvp = self.enc_p(xl).chunk(2, -1)  # (B, 8) each
        return mi, lvi.clamp(-8, 8), mp, lvp.clamp(-8, 8)

    def decode_mean(self, z_inv: torch.Tensor, z_p: torch.Tensor, library: torch.Tensor) -> torch.Tensor:
        return library[:, None] * self.decoder(torch.cat([z_inv, z_p], -1)).softmax(-1)  # (B, G)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x, pert, step = batch["x"], batch["P"], batch["step"][0]
        mi, lvi, mp, lvp = self.encode(x)
        z_inv = mi + torch.randn_like(mi) * (0.5 * lvi).exp()
        z_p = mp + torch.randn_like(mp) * (0.5 * lvp).exp()
        # the gates' warm-up: the only early gradient every gate logit shares is the L0 penalty's, which Adam turns
        # into a step of about lr each, so without it the gates close before the effects have grown
        gate_warm = int(step) < self.p.gate_warmup
        shift = pert @ (self.gates(frozen=gate_warm) * self.effects)  # (B, 8): sum over g in P of m_g * e_g
        kl = 0.5 * (mi**2 + lvi.exp() - 1 - lvi).sum(-1) + kl_scm_prior(mp, lvp, shift, self.a())
        nll = -nb_log_prob(x, self.decode_mean(z_inv, z_p, x.sum(-1)), self.log_theta.exp())  # (B, G)
        warm = min(1.0, (float(step) + 1) / max(self.p.kl_warmup, 1))
        prior = self.p.lambda_a * self.a().abs().sum()
        if self.use_masks and not gate_warm:
            prior = prior + self.p.lambda_l0 * l0_penalty(self.log_alpha)
        loss = elbo_per_gene(nll, kl, warm, prior)
        if self.use_adv:
            logits = self.adversary(GradReverse.apply(z_inv, self.p.lambda_adv))
            loss = loss + F.cross_entropy(logits, batch["cond"])
        return loss

    @torch.no_grad()
    def latent(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)[2]  # (B, 8): posterior means of z_p

    @torch.no_grad()
    def predict(self, x_ctrl: torch.Tensor, pert: torch.Tensor) -> torch.Tensor:
        """Mean log-normalised expression of control cells moved to perturbation set `pert` (K,)."""
        mi, _, mp, _ = self.encode(x_ctrl)
        z_base = mp @ (torch.eye(D_P) - self.a()).T  # invert the SCM: z_base = (I - A) z_p
        shift = pert @ (self.gates() * self.effects)  # (8,)
        z_p = torch.linalg.solve(torch.eye(D_P) - self.a(), (z_base + shift).T).T  # (B, 8)
        return log_normalise(self.decode_mean(mi, z_p, torch.full((len(x_ctrl),), 1e4))).mean(0)


class CPAStyle(nn.Module):
    """Compositional autoencoder: adversarially purged basal latent + dense additive perturbation embeddings."""

    def __init__(self, genes: int, singles: int, conditions: int, hidden: int, p: Params, dim: int = D_INV + D_P):
        super().__init__()
        self.p = p
        self.scaler = GeneScaler(genes)
        self.encoder, self.decoder = _mlp(genes, hidden, dim), _mlp(dim, hidden, genes)
        self.embed = nn.Parameter(0.1 * torch.randn(singles, dim))
        self.log_theta = nn.Parameter(torch.zeros(genes))
        self.adversary = _mlp(dim, hidden, conditions)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["x"]
        basal = self.encoder(self.scaler(x))  # (B, d)
        mean = x.sum(-1, keepdim=True) * self.decoder(basal + batch["P"] @ self.embed).softmax(-1)
        adv = F.cross_entropy(self.adversary(GradReverse.apply(basal, self.p.lambda_adv)), batch["cond"])
        return elbo_per_gene(-nb_log_prob(x, mean, self.log_theta.exp()), x.new_zeros(len(x))) + adv

    @torch.no_grad()
    def latent(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.scaler(x))

    @torch.no_grad()
    def predict(self, x_ctrl: torch.Tensor, pert: torch.Tensor) -> torch.Tensor:
        z = self.encoder(self.scaler(x_ctrl)) + pert @ self.embed
        return log_normalise(1e4 * self.decoder(z).softmax(-1)).mean(0)


class CondVAE(nn.Module):
    """Conditional VAE: one 24-d latent with an N(0, I) prior; the perturbation set enters encoder and decoder."""

    def __init__(self, genes: int, singles: int, conditions: int, hidden: int, p: Params, dim: int = D_INV + D_P):
        super().__init__()
        self.p = p
        self.scaler = GeneScaler(genes)
        self.encoder, self.decoder = _mlp(genes + singles, hidden, 2 * dim), _mlp(dim + singles, hidden, genes)
        self.log_theta = nn.Parameter(torch.zeros(genes))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x, pert, step = batch["x"], batch["P"], batch["step"][0]
        mu, lv = self.encoder(torch.cat([self.scaler(x), pert], -1)).chunk(2, -1)
        lv = lv.clamp(-8, 8)
        z = mu + torch.randn_like(mu) * (0.5 * lv).exp()
        mean = x.sum(-1, keepdim=True) * self.decoder(torch.cat([z, pert], -1)).softmax(-1)
        kl = 0.5 * (mu**2 + lv.exp() - 1 - lv).sum(-1)
        warm = min(1.0, (float(step) + 1) / max(self.p.kl_warmup, 1))
        return elbo_per_gene(-nb_log_prob(x, mean, self.log_theta.exp()), kl, warm)

    @torch.no_grad()
    def latent(self, x: torch.Tensor, pert: torch.Tensor) -> torch.Tensor:
        return self.encoder(torch.cat([self.scaler(x), pert], -1)).chunk(2, -1)[0]

    @torch.no_grad()
    def predict(self, x_ctrl: torch.Tensor, pert: torch.Tensor) -> torch.Tensor:
        mu = self.latent(x_ctrl, torch.zeros(len(x_ctrl), len(pert)))
        out = self.decoder(torch.cat([mu, pert.expand(len(mu), -1)], -1)).softmax(-1)
        return log_normalise(1e4 * out).mean(0)


# ---- training: every network in lock-step -----------------------------------------------------------------------
def _load(data_dir: Path) -> dict:
    obs, long = read_table(data_dir / "obs.parquet"), read_table(data_dir / "counts.parquet")
    x = np.zeros((len(obs["cell_id"]), int(obs["genes"][0])), np.float32)
    x[long["cell_id"], long["gene_id"]] = long["count"]
    names = obs["perturbation"].astype(str)
    singles = sorted({g for c in names if c != "ctrl" for g in c.split("+")})
    conds = sorted(set(names))
    pert = np.zeros((len(names), len(singles)), np.float32)
    for i, c in enumerate(names):
        for g in ([] if c == "ctrl" else c.split("+")):
            pert[i, singles.index(g)] = 1.0
    out = {"x": torch.from_numpy(x), "P": torch.from_numpy(pert), "names": names, "singles": singles,
           "cond": torch.tensor([conds.index(c) for c in names]), "conditions": len(conds),
           "train": obs["split"] == "train", "z_true": obs.get("z_causal")}
    if (data_dir / "truth.parquet").exists():
        t = read_table(data_dir / "truth.parquet")
        out["mask_true"] = t["mask"][[list(t["perturbation"]).index(g) for g in singles]] > 0.5  # (K, 8)
    return out


def _rho_tag(rho: float) -> str:
    return f"rho{round(100 * rho):02d}"  # 0.5 -> rho50 (module and metric names carry no dots)


class Arms(nn.Module):
    """The networks in lock-step (models/common/lockstep.py), each reading its own world's batch: keys `x`, `P`,
    `cond`, `step` for the main world, `<world>/x` ... for a sweep world."""

    def __init__(self, nets: dict[str, nn.Module], worlds: dict[str, str]):
        super().__init__()
        self.nets, self.worlds = nn.ModuleDict(nets), worlds  # worlds: network -> its world's key prefix

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, net in self.nets.items():
            prefix = self.worlds[name]
            out[name] = net({k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix) and
                             (prefix or "/" not in k)})
        return out


def _worlds(p: Params, data_dir: Path) -> dict[str, dict]:
    """Key prefix -> loaded world: "" the main data, "rho_<r>/" each further synthetic world of the sweep."""
    return {"": _load(data_dir)} | {f"{sub}/": _load(data_dir / sub) for sub in sweep_worlds(p).values() if sub}


def build(worlds: dict[str, dict], p: Params) -> Arms:
    torch.manual_seed(p.seed)
    nets: dict[str, nn.Module] = {}
    where: dict[str, str] = {}
    for prefix, d in worlds.items():
        args = (d["x"].shape[1], len(d["singles"]), d["conditions"], p.hidden, p)
        if prefix:  # a sweep world: the method and the entangled cVAE, the two arms the sweep compares
            tag = _rho_tag(float(prefix[4:-1]))
            arms = {f"pvae_{tag}": PerturbedVAE(*args), f"cvae_{tag}": CondVAE(*args)}
        else:
            arms = {"pvae": PerturbedVAE(*args), "cpa": CPAStyle(*args), "cvae": CondVAE(*args)}
            if p.ablations:
                arms |= {"no_mask": PerturbedVAE(*args, masks=False), "no_adv": PerturbedVAE(*args, adversary=False)}
        x_train = d["x"][np.flatnonzero(d["train"])]
        for net in arms.values():
            net.scaler.fit(x_train)  # every encoder reads its world's training cells standardised per gene
        nets |= arms
        where |= {name: prefix for name in arms}
    return Arms(nets, where)


def train(ctx) -> None:
    p: Params = ctx.params
    worlds = _worlds(p, ctx.data_dir)
    rows = {prefix: torch.from_numpy(np.flatnonzero(d["train"])) for prefix, d in worlds.items()}
    model = build(worlds, p)

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(p.seed * 100_003 + step)
        batch = {}
        for prefix, d in worlds.items():
            idx = rows[prefix][torch.randint(len(rows[prefix]), (p.batch_size,), generator=g)]
            batch |= {f"{prefix}x": d["x"][idx], f"{prefix}P": d["P"][idx], f"{prefix}cond": d["cond"][idx],
                      f"{prefix}step": torch.full((p.batch_size,), step)}
        return batch

    def step_fn(engine, batch, step):
        losses = engine(batch)
        return sum(losses.values()), {f"{k}_loss": float(v.detach()) for k, v in losses.items()}

    ctx.progress(f"phase fit: {len(model.nets)} networks in lock-step over {len(worlds)} world(s), {p.steps} steps, "
                 f"{len(rows[''])} training cells")
    ctx.fit("fit", ctx.engine(model, p.lr, arms=model.nets), step_fn, batch_fn, p.steps)


# ---- evaluation ---------------------------------------------------------------------------------------------
def de20_scores(pred: np.ndarray, true: np.ndarray, top: int = 20) -> tuple[float, float]:
    """Pearson and MSE between predicted and true changes vs control on the top-|true change| genes."""
    genes = np.argsort(-np.abs(true), kind="stable")[:top]
    r = np.corrcoef(pred[genes], true[genes])[0, 1] if np.std(pred[genes]) > 0 else 0.0
    return float(r), float(np.mean((pred[genes] - true[genes]) ** 2))


def mcc(learned: np.ndarray, true: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean |Pearson| of true latents vs learned dims after Hungarian matching; also learned dim of each true one."""
    d_true = true.shape[1]
    corr = np.abs(np.corrcoef(true.T, learned.T)[:d_true, d_true:])  # (8, d_learned)
    corr = np.nan_to_num(corr)
    rows, cols = linear_sum_assignment(-corr)
    match = np.empty(d_true, int)
    match[rows] = cols
    return float(corr[rows, cols].mean()), match


def mask_f1(gates: np.ndarray, truth: np.ndarray, match: np.ndarray) -> float:
    """F1 of learned supports (gate > 0.5, columns matched to the true latents) against the true supports."""
    flagged = gates[:, match] > 0.5  # (K, 8) in the true latents' order
    tp = float((flagged & truth).sum())
    return 2 * tp / max(float(flagged.sum() + truth.sum()), 1.0)


def probe_accuracy(z: np.ndarray, labels: np.ndarray, seed: int) -> tuple[float, float]:
    """A multinomial logistic probe reading the condition from latents: (held-out accuracy, chance), fitted on one
    half of the cells (stratified) and scored on the other; chance is the held-out half's majority-class rate."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    z_fit, z_test, y_fit, y_test = train_test_split(z, labels, test_size=0.5, random_state=seed, stratify=labels)
    scale = StandardScaler().fit(z_fit)
    probe = LogisticRegression(max_iter=500).fit(scale.transform(z_fit), y_fit)
    chance = np.unique(y_test, return_counts=True)[1].max() / len(y_test)
    return float(probe.score(scale.transform(z_test), y_test)), float(chance)


def _de20_world(nets: dict[str, nn.Module], d: dict) -> tuple[dict[str, tuple[float, float]], tuple]:
    """Mean Pearson-delta-DE20 and MSE of each network (and the additive baseline) over the world's held-out
    doubles, and the first double's changes for the plot."""
    names, xl = d["names"], log_normalise(d["x"]).numpy()
    ctrl = (names == "ctrl") & d["train"]
    x_ctrl = d["x"][np.flatnonzero(ctrl)[:1000]]
    base = {m: net.predict(x_ctrl, torch.zeros(len(d["singles"]))).numpy() for m, net in nets.items()}
    scores: dict[str, list[tuple[float, float]]] = {m: [] for m in (*nets, "additive")}
    example = None
    for c in sorted({c for c in names[~d["train"]]}):
        true = xl[names == c].mean(0) - xl[ctrl].mean(0)
        pert = torch.zeros(len(d["singles"]))
        pert[[d["singles"].index(g) for g in c.split("+")]] = 1.0
        preds = {m: net.predict(x_ctrl, pert).numpy() - base[m] for m, net in nets.items()}
        preds["additive"] = sum(xl[names == g].mean(0) - xl[ctrl].mean(0) for g in c.split("+"))
        for m, pred in preds.items():
            scores[m].append(de20_scores(pred, true))
        example = example or (c, true, preds)
    return {m: (float(np.mean([v[0] for v in vals])), float(np.mean([v[1] for v in vals])))
            for m, vals in scores.items()}, example


def _prefix(m: str) -> str:
    return "method/" if m == "pvae" else f"baseline/{m}/"


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    worlds = _worlds(p, ctx.data_dir)
    model = ctx.network("fit")
    d = worlds[""]
    main = [m for m in model.nets if not model.worlds[m]]
    scores, example = _de20_world({m: model.nets[m] for m in main}, d)
    out: dict[str, float] = {}
    for m, (r, mse) in scores.items():
        out[f"{_prefix(m)}pearson_de20"], out[f"{_prefix(m)}mse_de20"] = r, mse
    # premise: in every world z_p carries the perturbation (a probe reads the training cells' condition from
    # PerturbedVAE's posterior means of z_p); z_inv's probe is what the adversary works against (shown)
    margins = []
    for prefix, world in worlds.items():
        net = model.nets["pvae" if not prefix else f"pvae_{_rho_tag(float(prefix[4:-1]))}"]
        tag = "" if not prefix else f"_{_rho_tag(float(prefix[4:-1]))}"
        x_seen, seen = world["x"][np.flatnonzero(world["train"])], world["names"][world["train"]]
        acc, chance = probe_accuracy(net.latent(x_seen).numpy(), seen, p.seed)
        out[f"method/zp_probe_acc{tag}"], out[f"detail/probe_chance{tag}"] = acc, chance
        out[f"detail/zinv_probe_acc{tag}"] = probe_accuracy(net.encode(x_seen)[0].detach().numpy(), seen, p.seed)[0]
        margins.append(acc - chance)
    out["method/zp_probe_margin"] = min(margins)
    # the dominance sweep: the same draw at each rho_inv; the drop from the lowest rho_inv to rho_inv
    sweep = {}
    for rho, sub in sweep_worlds(p).items():
        if sub:
            tag = _rho_tag(rho)
            got = _de20_world({"pvae": model.nets[f"pvae_{tag}"], "cvae": model.nets[f"cvae_{tag}"]},
                              worlds[f"{sub}/"])[0]
        else:
            got = scores
        sweep[rho] = {m: got[m][0] for m in ("pvae", "cvae")}
        for m in ("pvae", "cvae"):
            out[f"{_prefix(m)}pearson_de20_{_rho_tag(rho)}"] = sweep[rho][m]
    low = min(p.sweep_rho)
    for m in ("pvae", "cvae"):
        out[f"{_prefix(m)}rho_drop"] = sweep[low][m] - sweep[p.rho_inv][m]
    z_true = d["z_true"]
    if z_true is not None:
        for m in main:
            net = model.nets[m]
            learned = net.latent(d["x"], d["P"]) if m == "cvae" else net.latent(d["x"])
            value, match = mcc(learned.numpy(), z_true)
            out[f"{_prefix(m)}mcc"] = value
            if isinstance(net, PerturbedVAE):
                gates = net.gates().detach().numpy()
                out[f"{_prefix(m)}mask_f1"] = mask_f1(gates, d["mask_true"], match)
                if m == "pvae":
                    _masks_plot(ctx.plots_dir / "masks.png", gates[:, match], d["mask_true"], d["singles"])
    else:  # real data: no ground truth for latents or programs
        out |= {f"{_prefix(m)}mcc": 0.0 for m in main}
        out |= {"method/mask_f1": 0.0}
    out["detail/held_out_doubles"] = float(len({c for c in d["names"][~d["train"]]}))
    _scatter_plot(ctx.plots_dir / "pred_vs_true_delta.png", *example)
    return out


def _scatter_plot(path: Path, cond: str, true: np.ndarray, preds: dict[str, np.ndarray]) -> None:
    import matplotlib.pyplot as plt

    genes = np.argsort(-np.abs(true))[:20]
    fig, ax = plt.subplots(figsize=(4.8, 4.5))
    for m, marker in (("pvae", "o"), ("cpa", "s"), ("cvae", "^"), ("additive", "x")):
        r = de20_scores(preds[m], true)[0]
        ax.scatter(true[genes], preds[m][genes], marker=marker, s=18, label=f"{m} (r={r:.2f})")
    lim = np.abs(true[genes]).max() * 1.1
    ax.plot([-lim, lim], [-lim, lim], "k:", lw=0.8)
    ax.set(xlabel="true change vs control (log1p)", ylabel="predicted change", title=f"held-out {cond}: top-20 DE")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _masks_plot(path: Path, gates: np.ndarray, truth: np.ndarray, singles: list[str]) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(6, 0.3 * len(singles) + 1.5))
    for ax, values, title in ((axes[0], truth.astype(float), "true supports"), (axes[1], gates, "learned gates")):
        ax.imshow(values, cmap="Greys", vmin=0, vmax=1, aspect="auto")
        ax.set(title=title, xlabel="causal latent (matched)", yticks=range(len(singles)), yticklabels=singles)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="perturbed_vae",
    title="PerturbedVAE: separating sparse perturbation effects in single-cell data",
    seed="003_9a806cafa3d919df.txt, abstract 11",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/pearson_de20", "max"),
    claim=Claim(premises=(  # the experiment tests the separation only if z_p carries the perturbation at all (in
        # every world of the sweep), and "beats CPA / cVAE" only if those arms predict the changes at all (r > 0)
        Compare("method/zp_probe_margin", ">", 0.0, name="zp_carries_perturbation"),
        Compare("baseline/cpa/pearson_de20", ">", 0.0, name="cpa_predicts_changes"),
        Compare("baseline/cvae/pearson_de20", ">", 0.0, name="cvae_predicts_changes"),
    ), all_of=(
        Compare("method/pearson_de20", ">", ("baseline/cpa/pearson_de20", "baseline/cvae/pearson_de20")),
        Compare("method/pearson_de20", ">=", "baseline/additive/pearson_de20"),
        Compare("method/mcc", ">", "baseline/cvae/mcc"),
        Compare("method/mask_f1", ">", 0.5),
        Compare("method/rho_drop", "<", "baseline/cvae/rho_drop"),
    ), summary="on held-out doubles PerturbedVAE beats CPA-style and cVAE and matches additive; its causal latents "
               "are more identifiable than the cVAE's and its masks recover the true programs (F1 > 0.5); from "
               "rho_inv 0.5 to 0.9 its Pearson-delta-DE20 drops less than the cVAE's",
       note="the rho_inv sweep (spec: full profile only) runs in every profile on synthetic worlds: the same draw "
            "at rho_inv 0.5, PerturbedVAE and cVAE retrained there"),
)
