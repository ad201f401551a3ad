"""FedGR: a federated global reviser for heterogeneous label noise.

Seed: 003_9a806cafa3d919df.txt, abstract 16. Spec: ../shared/papers/fedgr.md.

Federated clients are SIMULATED INSIDE EACH RANK: every client of every federation ("arm": a method trained on one
setting's labels, `Arm`) is one slice of a batched network (`Federation`, weights stacked on a leading "network"
axis), so all of them train in lock-step in ONE DeepSpeed engine (AdamW is element-wise and the engine clips
nothing, so the stacked networks train exactly as they would apart). The ranks are data-parallel inside each
client: each client's minibatch is split across ranks and DeepSpeed averages gradients. The server runs on every
rank identically between rounds (deterministic, no communication needed).

What it implements (function names in brackets):
- FedAvg aggregation, the real arithmetic w_global = sum_k n_k w_k / sum_k n_k per federation [fedavg];
- global-guided noisy-label sniffing and refining [server_round]: the received global model's cross-entropy on
  every local sample, a running mean over rounds, one 2-component GMM on the pooled proxies per federation (clean
  probability c_i, flag c_i < 0.5, per-client noise-rate estimate) [sniff]; refined labels from the global model's
  prediction on a 1-pixel-shifted input when its confidence exceeds 0.9 [weak_shift]; local loss
  c_i CE(y) + (1 - c_i) CE(y_hat) on clients with estimated noise < 0.6, pseudo-label CE only on noisier ones
  [fedgr_loss];
- global-revised EMA distillation: per-client EMA teacher, ema <- beta ema + (1 - beta) global at each round start,
  soft targets sharpened at T, KL [fedgr_loss];
- global representation regularisation: KL(softmax(z_global / tau) || softmax(z_local / tau)) [fedgr_loss];
- the three single-module ablations, trained in the severe setting [ABLATIONS, Federation.switches]: no_sniff (no
  GMM and no refined labels: c = 1, plain CE on the given labels), no_ema (the EMA distillation term is 0), no_rep
  (the representation term is 0); each keeps the other two modules unchanged;
- baselines with the same model, data, rounds, batches and learning rate: FedAvg, FedProx (mu), FedAvg + SCE,
  FedAvg + Co-teaching; and FedAvg on the true labels [CLEAN], the premise that the task is learnable at all;
- memorisation probe in the FedAvg run: per round, the share of noisy-labelled training samples predicted as their
  noisy label by the global model and by each local model after local training [server_round]; context, not
  claim: a local model is scored on the samples it has just trained on, and the same probe of an untrained model
  (FedAvg's round-0 global model, which memorised nothing) also lies above the trained global model's
  [untrained_memorisation];
- precision and recall of the refined labels against the true labels [refine_scores].

The phenomenon is controlled by `settings[*].rho_min/rho_max` (label-noise ratio per client; [0, 0] turns label
noise off, and FedGR's advantage should vanish), `pair_flip_share` (noise type mix) and `alpha` (non-IID-ness).

Deviations from the paper (choices the abstract left open):
- Noise is injected per class of each client (a class-conditional flip rate, stochastic rounding), and pair-flip
  ratios are clipped at `pair_flip_max` = 0.45 (Co-teaching's "pair-45%"), a strict minority in every class. A
  pair flip at 0.5 or more is a label permutation: the flipped class becomes what the data teach, the small-loss
  proxy ranks the flipped samples as the clean ones and no refining can recover them. With the spec's severe range
  [0.4, 0.7] and half the clients pair-flip, most classes were in that state, which is why the refining recall was
  near zero there before this clip.
- Local training is a fixed number of local steps per round (`local_steps`) for every client rather than one local
  epoch: lock-step training needs equal step counts. Client batches cycle through a per-round permutation.
- The GMM is refitted every round from the sniffing round on (on the running-mean proxies); refined labels are
  recomputed each round from the current global model. A sample without a confident refined label keeps only its
  c_i CE(y) term (clean-ish clients) or is ignored (noisy clients).
- Smoke sniffs from round 8, not 4: with our budget (10 local steps a round) the global model is still far from
  trained at round 4, and sniffing/refining from that model made FedGR stall (an earlier smoke trial, one seed).
- Smoke refines on the unshifted input (`shift_pixels: 0`): an MLP on 8x8 digits is not shift-invariant (one pixel
  is 12.5 % of the image), and the global model's confident predictions on 1-pixel-shifted inputs were right far
  less often than on unshifted ones (severe setting, an earlier smoke trial). `shift_pixels: 1` is the paper's weak
  augmentation (full profile). Unshifted, the refined label is the global model's own prediction, so a clean
  sample that the GMM flags and the model gets wrong is trained toward the model's mistake.
- Rounds before `sniff_round` are warm-up rounds of plain CE (FedAvg) for FedGR's networks; the three modules
  (refining, EMA distillation, representation KL) all start at the sniffing round.
- The EMA teacher also follows the local model within a round (mean-teacher momentum `ema_local_momentum`), so
  clients' teachers differ; the spec's global revision happens at every round start.
- Co-teaching uses each client's realised noise ratio as its forget rate (the usual oracle, an advantage to the
  baseline), ramped over 5 rounds, and small-loss selection runs on each rank's share of the batch. SCE uses
  alpha = 0.1, beta = 1, A = log 1e-4.
- The module ablations run in the severe setting only (budget); the spec names them for the full profile.
- Full profile: CIFAR-10/100 pickle and Clothing1M list-file loaders feed a batched CNN [cnn: two 3x3 convs,
  max-pool, global average pool, linear head; every network one group of a grouped convolution], the spec's "CNN"
  option, not ResNet-18: 16 federations x 100 clients train in lock-step, and 1,600 ResNet-18s would hold
  18B parameters. FedAvg resets weights inside the engine,
  which assumes ZeRO stage 0 (fp32 params are the optimiser's own), so the full profile keeps zero_stage 0, fp32.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sklearn.datasets import load_digits
from sklearn.mixture import GaussianMixture
from torch import nn

from models.common.plots import split_histogram
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

METHODS = ("fedgr", "fedavg", "fedprox", "sce", "cot_a", "cot_b")  # arms of every setting; Co-teaching: two nets
BASELINES = ("fedavg", "fedprox", "sce", "coteaching")
# FedGR's single-module ablations: name -> (sniffing and refining, EMA distillation, representation loss) switched on
ABLATIONS = {"no_sniff": (False, True, True), "no_ema": (True, False, True), "no_rep": (True, True, False)}
VARIANTS = {"fedgr": (True, True, True), **{f"fedgr_{k}": v for k, v in ABLATIONS.items()}}  # FedGR-type arms
CLEAN = "fedavg_clean"  # FedAvg on the true labels: the reference that says the task is learnable at all
SETTINGS = ("mild", "severe")  # the claim is decided per setting; ablations run in the severe one
CLEAN_BAR = 0.9  # premise: FedAvg on clean labels reaches this test accuracy (digits: the task is learnt)
RECALL_BAR = 0.5  # context: FedGR's refining recovers at least half of the mislabelled samples in the severe setting
PAIR_FLIPS = {1: 7, 7: 1, 3: 8, 8: 3, 5: 6, 6: 5, 4: 9, 9: 4, 0: 6, 2: 7}  # look-alike pairs (digits)


class Arm(NamedTuple):
    """One federation: a method trained on the labels of one noise setting (-1: the true labels)."""

    setting: int
    method: str


def arms(settings: list[str], ablations: bool, clean_reference: bool) -> list[Arm]:
    """Every federation the run trains, in lock-step: the methods of each setting, the ablations in the severe
    setting, and the clean-label FedAvg reference."""
    out = []
    for s, name in enumerate(settings):
        out += [Arm(s, m) for m in METHODS]
        if ablations and name == "severe":
            out += [Arm(s, v) for v in VARIANTS if v != "fedgr"]
    return out + ([Arm(-1, CLEAN)] if clean_reference else [])


class NoiseSetting(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[a-z0-9_]+$")
    rho_min: float = Field(ge=0.0, le=0.95)
    rho_max: float = Field(ge=0.0, le=0.95)


class Params(PaperParams):
    dataset: Literal["digits", "cifar10", "cifar100", "clothing1m"] = Field("digits", description="Image source.")
    dataset_dir: str = Field("", description="cifar*: folder of the python pickles; clothing1m: folder of kv lists.")
    image_size: int = Field(32, ge=8, description="clothing1m: images are resized to this side (RGB).")
    n_samples: int = Field(0, ge=0, description="Use the first n samples of a seeded shuffle; 0 = all.")
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Clean held-out split (digits only).")
    clients: int = Field(10, ge=2, description="Federated clients K.")
    alpha: float = Field(0.5, gt=0.0, description="Dirichlet concentration over labels (small = non-IID).")
    pair_flip_share: float = Field(0.5, ge=0.0, le=1.0, description="Probability a client's noise is pair-flip.")
    pair_flip_max: float = Field(0.45, ge=0.0, lt=0.5, description="Pair-flip ratios are clipped to this: at 0.5 "
                                 "or more the flipped class outnumbers the true one and the labels are a permutation.")
    settings: list[NoiseSetting] = Field(min_length=2, max_length=2, description="The two noise settings, named mild "
                                         "and severe: per-client ratio ~ U[min, max].")
    ablations: bool = Field(True, description="Also train FedGR's three single-module ablations (severe setting).")
    clean_reference: bool = Field(True, description="Also train FedAvg on the true labels (the learnability premise).")
    rounds: int = Field(20, ge=2, description="Communication rounds R.")
    local_steps: int = Field(5, ge=1, description="Local AdamW steps per client per round.")
    batch_size: int = Field(64, ge=2, description="Per-client minibatch (split across ranks).")
    lr: float = Field(1e-3, gt=0)
    arch: Literal["mlp", "cnn"] = Field("mlp", description="Every network: the MLP on flattened pixels, or a CNN "
                                        "(two 3x3 conv layers, 2x2 max-pool, global average pool, linear head).")
    hidden: tuple[int, int] = Field((256, 128), description="MLP hidden widths / CNN channels; the second is the "
                                                            "embedding.")
    sniff_round: int = Field(4, ge=1, description="First round (1-based) using the GMM clean probabilities.")
    shift_pixels: int = Field(1, ge=0, le=4, description="Weak augmentation of the refining step (0 = none).")
    conf_threshold: float = Field(0.9, gt=0, lt=1, description="Refined label kept above this confidence.")
    noisy_client_rate: float = Field(0.6, gt=0, le=1, description="Clients above this estimated rate: pseudo-CE only.")
    ema_beta: float = Field(0.7, ge=0, lt=1, description="Global revision of the EMA teacher per round.")
    ema_local_momentum: float = Field(0.99, ge=0, le=1, description="Mean-teacher momentum per local step.")
    sharpen_t: float = Field(0.5, gt=0, description="Temperature sharpening the EMA teacher's targets.")
    rep_tau: float = Field(0.5, gt=0, description="Temperature of the representation KL.")
    lambda_ema: float = Field(1.0, ge=0, description="Weight of the EMA distillation loss.")
    lambda_rep: float = Field(1.0, ge=0, description="Weight of the representation regulariser.")
    prox_mu: float = Field(0.01, ge=0, description="FedProx proximal weight.")

    @model_validator(mode="after")
    def _named_settings(self) -> Params:
        if tuple(s.name for s in self.settings) != SETTINGS:
            raise ValueError(f"settings must be named {SETTINGS} in this order (the claim is decided per setting)")
        return self


# ---- data --------------------------------------------------------------------------------------------------
def load_cifar(folder: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """CIFAR python pickles: data_batch_* (or `train`) and test_batch (or `test`); pixels in [0, 1], (N, 3072)."""
    key = b"labels" if num_classes == 10 else b"fine_labels"
    names = (sorted(folder.glob("data_batch_*")) or [folder / "train"], [folder / "test_batch"]
             if (folder / "test_batch").exists() else [folder / "test"])
    out = []
    for files in names:
        parts = [pickle.load(open(f, "rb"), encoding="bytes") for f in files]
        out.append(np.concatenate([np.asarray(d[b"data"], np.float32) / 255.0 for d in parts]))
        out.append(np.concatenate([np.asarray(d[key], np.int64) for d in parts]))
    return out[0], out[1], out[2], out[3]


def load_clothing1m(folder: Path, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Clothing1M lists: noisy_label_kv.txt / clean_label_kv.txt ("path label"), noisy_train_key_list.txt and
    clean_test_key_list.txt. Returns train pixels, noisy labels, clean labels (-1 where unknown), test pixels/labels."""
    from PIL import Image

    def kv(name: str) -> dict[str, int]:
        return {ln.split()[0]: int(ln.split()[1]) for ln in (folder / name).read_text().splitlines() if ln.strip()}

    def keys(name: str) -> list[str]:
        return [ln.strip() for ln in (folder / name).read_text().splitlines() if ln.strip()]

    def pixels(paths: list[str]) -> np.ndarray:
        imgs = [np.asarray(Image.open(folder / p).convert("RGB").resize((size, size)), np.float32) / 255.0
                for p in paths]
        return np.stack([im.transpose(2, 0, 1).reshape(-1) for im in imgs])  # (N, 3 S S), CIFAR channel order

    noisy, clean = kv("noisy_label_kv.txt"), kv("clean_label_kv.txt")
    train, test = keys("noisy_train_key_list.txt"), keys("clean_test_key_list.txt")
    return (pixels(train), np.array([noisy[k] for k in train]), np.array([clean.get(k, -1) for k in train]),
            pixels(test), np.array([clean[k] for k in test]))


def _images(p: Params):
    """(x_train, given_train or None, true_train, x_test, y_test, num_classes)."""
    rng = np.random.default_rng(p.seed)
    if p.dataset == "digits":
        d = load_digits()
        x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
        order = rng.permutation(len(y))[: p.n_samples or None]
        x, y = x[order], y[order]
        n_test = round(p.test_fraction * len(y))
        return x[n_test:], None, y[n_test:], x[:n_test], y[:n_test], 10
    if p.dataset == "clothing1m":
        xtr, noisy, clean, xte, yte = load_clothing1m(input_path(p.dataset_dir), p.image_size)
        return xtr, noisy, clean, xte, yte, 14
    k = 10 if p.dataset == "cifar10" else 100
    xtr, ytr, xte, yte = load_cifar(input_path(p.dataset_dir), k)
    order = rng.permutation(len(ytr))[: p.n_samples or None]
    return xtr[order], None, ytr[order], xte, yte, k


def dirichlet_partition(labels: np.ndarray, clients: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Client id of each sample: each class's samples split across clients by proportions ~ Dirichlet(alpha)."""
    owner = np.empty(len(labels), np.int64)
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet(np.full(clients, alpha))) * len(members)).round().astype(int)[:-1]
        for k, part in enumerate(np.split(members, cuts)):
            owner[part] = k
    return owner


def inject_noise(labels: np.ndarray, kind: str, ratio: float, num_classes: int,
                 rng: np.random.Generator) -> np.ndarray:
    """Flip ratio n_c labels of each class c (n_c samples; stochastic rounding, so the rate is unbiased): uniformly
    to another class, or to the class's pair. Pair flips below 0.5 stay a strict minority of every class (at most
    ceil(n_c / 2) - 1), so the true label remains what the class's labels teach."""
    noisy = labels.copy()
    pair = PAIR_FLIPS if num_classes == 10 else {c: (c + 1) % num_classes for c in range(num_classes)}
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        count = int(ratio * len(members) + rng.random())  # floor(x) + Bernoulli(frac(x)): E[count] = ratio n_c
        if kind == "pair" and ratio < 0.5:
            count = min(count, -(-len(members) // 2) - 1)
        chosen = rng.choice(members, size=count, replace=False)
        if kind == "symmetric":
            noisy[chosen] = (c + rng.integers(1, num_classes, size=len(chosen))) % num_classes
        else:
            noisy[chosen] = pair[int(c)]
    return noisy


def prepare(p: Params, out_dir: Path) -> None:
    xtr, given, true, xte, yte, k = _images(p)
    rng = np.random.default_rng([p.seed, 1])
    owner = dirichlet_partition(np.where(true >= 0, true, given if given is not None else 0), p.clients, p.alpha, rng)
    samples = {c: [] for c in ("setting", "sample_id", "client_id", "split", "pixels", "true_label", "noisy_label")}
    clients = {c: [] for c in ("setting", "client_id", "noise_type", "noise_ratio", "n")}
    for s in p.settings:
        noisy = true.copy() if given is None else given.copy()
        for c in range(p.clients):
            members = np.flatnonzero(owner == c)
            kind = "pair" if rng.random() < p.pair_flip_share else "symmetric"
            ratio = float(rng.uniform(s.rho_min, s.rho_max))
            ratio = min(ratio, p.pair_flip_max) if kind == "pair" else ratio
            if given is None:  # synthetic noise; real noisy labels (Clothing1M) are kept as they are
                noisy[members] = inject_noise(true[members], kind, ratio, k, rng)
                ratio = float((noisy[members] != true[members]).mean()) if len(members) else ratio  # as realised
            row = (s.name, c, kind if given is None else "real", ratio, len(members))
            for col, v in zip(clients, row, strict=True):
                clients[col].append(v)
        n, m = len(true), len(yte)
        samples["setting"] += [s.name] * (n + m)
        samples["sample_id"] += list(range(n + m))
        samples["client_id"] += list(owner) + [-1] * m
        samples["split"] += ["train"] * n + ["test"] * m
        samples["pixels"] += list(xtr) + list(xte)
        samples["true_label"] += list(true) + list(yte)
        samples["noisy_label"] += list(noisy) + list(yte)
    write_table(out_dir / "samples.parquet", {c: np.asarray(v) if c == "pixels" else v for c, v in samples.items()})
    write_table(out_dir / "clients.parquet", clients)


# ---- networks: many MLPs as one batched module -----------------------------------------------------------------
def mlp(w: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched MLP: x (M, B, D) with weights [W1 (M,D,H1), b1 (M,1,H1), W2, b2, W3 (M,H2,C), b3]."""
    h = F.relu(torch.baddbmm(w[1], x, w[0]))  # (M, B, H1)
    z = F.relu(torch.baddbmm(w[3], h, w[2]))  # (M, B, H2): the embedding
    return torch.baddbmm(w[5], z, w[4]), z  # (M, B, C), (M, B, H2)


def cnn(w: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched CNN, the same 6-tensor interface as `mlp`: x (M, B, C*S*S) with weights [K1 (M,C1,C,3,3), b1 (M,C1),
    K2 (M,H2,C1,3,3), b2 (M,H2), W3 (M,H2,C), b3 (M,1,C)]; the M networks run as one grouped convolution."""
    m, b, d = x.shape
    c_in = w[0].shape[2]
    side = round((d // c_in) ** 0.5)
    h = x.view(m, b, c_in, side, side).transpose(0, 1).reshape(b, m * c_in, side, side)  # (B, M C, S, S)
    h = F.max_pool2d(F.relu(F.conv2d(h, w[0].flatten(0, 1), w[1].flatten(), padding=1, groups=m)), 2)
    h = F.relu(F.conv2d(h, w[2].flatten(0, 1), w[3].flatten(), padding=1, groups=m))  # (B, M H2, S/2, S/2)
    z = h.mean((2, 3)).view(b, m, -1).transpose(0, 1)  # (M, B, H2): the embedding
    return torch.baddbmm(w[5], z, w[4]), z  # (M, B, C), (M, B, H2)


def net(w: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batched network the weights describe: conv kernels (5-d) make a CNN, matrices an MLP."""
    return cnn(w, x) if w[0].dim() == 5 else mlp(w, x)


def init_cnn(m: int, dims: tuple[int, ...], g: torch.Generator) -> list[torch.Tensor]:
    """nn.Conv2d / nn.Linear default init for m CNNs, dims = (C, C1, H2, classes)."""
    c, c1, h2, k = dims
    shapes = [((c1, c, 3, 3), (c1,), 9 * c), ((h2, c1, 3, 3), (h2,), 9 * c1), ((h2, k), (1, k), h2)]
    out = []
    for w_shape, b_shape, fan_in in shapes:
        bound = fan_in**-0.5
        out += [(torch.rand(m, *w_shape, generator=g) * 2 - 1) * bound,
                (torch.rand(m, *b_shape, generator=g) * 2 - 1) * bound]
    return out


def init_weights(m: int, dims: tuple[int, ...], g: torch.Generator) -> list[torch.Tensor]:
    """nn.Linear's default init, for m networks at once."""
    out = []
    for d_in, d_out in zip(dims[:-1], dims[1:], strict=True):
        bound = d_in**-0.5
        out += [(torch.rand(m, d_in, d_out, generator=g) * 2 - 1) * bound,
                (torch.rand(m, 1, d_out, generator=g) * 2 - 1) * bound]
    return out


class Federation(nn.Module):
    """Local weights of every (arm, client) network + server state as buffers (checkpointed with it).

    Arm f's clients are rows f K ... f K + K - 1 of every local weight; FedGR-type arms (FedGR and its ablations)
    additionally hold EMA teachers and the sniffing state, indexed by their position v in `self.variants`."""

    def __init__(self, arm_list: list[Arm], k: int, dims: tuple[int, ...], n_train: int, rounds: int, seed: int,
                 arch: str = "mlp"):
        super().__init__()
        self.arms, self.K = list(arm_list), k
        self.S = max(a.setting for a in self.arms) + 1
        self.F = len(self.arms)
        self.variants = [f for f, a in enumerate(self.arms) if a.method in VARIANTS]  # FedGR-type arms
        v = len(self.variants)
        g = torch.Generator().manual_seed(seed)
        init = init_cnn if arch == "cnn" else init_weights  # dims: (C, C1, H2, classes) / (D, H1, H2, classes)
        base = init(max(self.S, 1), dims, g)  # every method of a setting starts from the same global init ...
        peer = init(max(self.S, 1), dims, g)  # ... except Co-teaching's second network
        glob = [torch.stack([(q if a.method == "cot_b" else b)[max(a.setting, 0)] for a in self.arms])  # (F, ...)
                for b, q in zip(base, peer, strict=True)]
        self.local = nn.ParameterList([nn.Parameter(t.repeat_interleave(k, 0).clone()) for t in glob])  # (F K, ...)
        for i, t in enumerate(glob):
            self.register_buffer(f"glob{i}", t.clone())
            self.register_buffer(f"ema{i}", t[self.variants].repeat_interleave(k, 0).clone())  # (V K, ...)
        self.register_buffer("loss_sum", torch.zeros(v, n_train))  # running sum of the global model's CE
        self.register_buffer("clean_prob", torch.ones(v, n_train))  # c_i (1 before sniffing)
        self.register_buffer("refined", torch.full((v, n_train), -1, dtype=torch.long))  # y_hat, -1 = none
        self.register_buffer("noisy_client", torch.zeros(v, k, dtype=torch.bool))
        self.register_buffer("test_acc", torch.full((rounds, self.F), float("nan")))  # after each aggregation
        self.register_buffer("mem_global", torch.full((rounds, self.S), float("nan")))  # FedAvg probes
        self.register_buffer("mem_local", torch.full((rounds, self.S, k), float("nan")))

    def index(self, method: str, setting: int | None = None) -> list[int]:
        """Arm indices of a method (in setting order), or its one arm in `setting`."""
        return [f for f, a in enumerate(self.arms) if a.method == method and setting in (None, a.setting)]

    def switches(self) -> torch.Tensor:
        """(V, 3) bool: sniffing/refining, EMA distillation and representation loss on, per FedGR-type arm."""
        return torch.tensor([VARIANTS[self.arms[f].method] for f in self.variants], dtype=torch.bool).view(-1, 3)

    def weights(self, kind: str) -> list[torch.Tensor]:
        return list(self.local) if kind == "local" else [getattr(self, f"{kind}{i}") for i in range(6)]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return net(list(self.local), x)  # (F K, B, C), (F K, B, H2)


def fedavg(local: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """FedAvg: local (F, K, ...) weights of F federations x K clients, n (K,) sample counts -> (F, ...)."""
    share = (n / n.sum()).to(local.dtype)  # (K,)
    return torch.einsum("fk...,k->f...", local, share)


def weak_shift(x: torch.Tensor, shape: tuple[int, int], g: torch.Generator, pixels: int = 1) -> torch.Tensor:
    """Weak augmentation: shift each image by `pixels` (up/down/left/right, zero fill). x (N, C S S)."""
    if pixels == 0:
        return x
    c, side, k = shape[0], shape[1], pixels
    img = x.view(-1, c, side, side)
    direction = torch.randint(0, 4, (len(x),), generator=g)
    out = torch.zeros_like(img)
    out[direction == 0, :, k:, :] = img[direction == 0, :, :-k, :]
    out[direction == 1, :, :-k, :] = img[direction == 1, :, k:, :]
    out[direction == 2, :, :, k:] = img[direction == 2, :, :, :-k]
    out[direction == 3, :, :, :-k] = img[direction == 3, :, :, k:]
    return out.view(len(x), -1)


def sniff(loss_mean: np.ndarray, owner: np.ndarray, clients: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One GMM on the pooled loss proxies: clean probability per sample, estimated noise rate per client."""
    z = (loss_mean - loss_mean.min()) / max(loss_mean.max() - loss_mean.min(), 1e-12)
    gmm = GaussianMixture(2, max_iter=20, tol=1e-2, reg_covar=5e-4, random_state=seed).fit(z[:, None])
    clean = gmm.predict_proba(z[:, None])[:, int(np.argmin(gmm.means_[:, 0]))]
    rate = np.array([(clean[owner == k] < 0.5).mean() if (owner == k).any() else 0.0 for k in range(clients)])
    return clean, rate


# ---- the server: FedAvg, probes, sniffing and refining ---------------------------------------------------------
def _load(data_dir: Path) -> dict:
    t = read_table(data_dir / "samples.parquet")
    c = read_table(data_dir / "clients.parquet")
    names = list(dict.fromkeys(t["setting"]))
    first, k = t["setting"] == names[0], int(c["client_id"].max()) + 1
    tr, te = first & (t["split"] == "train"), first & (t["split"] == "test")
    sel = lambda s, split: (t["setting"] == s) & (t["split"] == split)  # noqa: E731
    dim = t["pixels"].shape[1]
    channels = 3 if dim % 3 == 0 and round((dim // 3) ** 0.5) ** 2 == dim // 3 else 1
    owner = torch.from_numpy(t["client_id"][tr])
    return {
        "settings": names, "K": k, "shape": (channels, round((dim // channels) ** 0.5)),
        "x": torch.from_numpy(t["pixels"][tr].astype(np.float32)),  # (N, D): identical across settings
        "true": torch.from_numpy(t["true_label"][tr]),  # (N,), -1 where unknown (Clothing1M)
        "noisy": torch.from_numpy(np.stack([t["noisy_label"][sel(s, "train")] for s in names])),  # (S, N)
        "owner": owner, "n": torch.bincount(owner, minlength=k).float(),  # (K,) client sizes
        "x_test": torch.from_numpy(t["pixels"][te].astype(np.float32)), "y_test": torch.from_numpy(t["true_label"][te]),
        "ratio": torch.tensor(np.stack([c["noise_ratio"][c["setting"] == s] for s in names]), dtype=torch.float32),
        "classes": int(max(t["true_label"].max(), t["noisy_label"].max())) + 1,
    }


def arm_labels(fed: Federation, d: dict) -> torch.Tensor:
    """(F, N) the training labels each arm sees: its setting's noisy labels, or the true ones."""
    return torch.stack([d["noisy"][a.setting] if a.setting >= 0 else d["true"] for a in fed.arms])


def _clients(t: torch.Tensor, fed: Federation) -> torch.Tensor:
    """(F K, ...) -> (F, K, ...)."""
    return t.view(fed.F, fed.K, *t.shape[1:])


@torch.no_grad()
def server_round(fed: Federation, r: int, d: dict, p: Params, reset_optimizer) -> None:
    """Start of round r (0-based): aggregate round r-1, probe, broadcast, revise EMA teachers, sniff and refine."""
    K, V = fed.K, len(fed.variants)
    x, noisy, owner = d["x"], d["noisy"], d["owner"]
    mislabeled = noisy != d["true"][None]  # (S, N)
    if r >= 1:
        a = r - 1
        local = [_clients(w, fed) for w in fed.weights("local")]  # (F, K, ...)
        for s in range(fed.S):  # memorisation probe of each FedAvg client after local training, on its own samples
            fa = fed.index("fedavg", s)[0]
            for k in range(K):
                own = (owner == k) & mislabeled[s]
                if own.any():
                    logits, _ = net([w[fa, k][None] for w in local], x[own][None])  # (1, n, C)
                    fed.mem_local[a, s, k] = (logits[0].argmax(-1) == noisy[s, own]).float().mean()
        for i, w in enumerate(fed.weights("glob")):
            w.copy_(fedavg(local[i], d["n"]))
        glob = fed.weights("glob")
        for s in range(fed.S):
            fa = fed.index("fedavg", s)[0]
            logits, _ = net([w[fa][None] for w in glob], x[mislabeled[s]][None])
            fed.mem_global[a, s] = (logits[0].argmax(-1) == noisy[s, mislabeled[s]]).float().mean()
        logits, _ = net(glob, d["x_test"].expand(fed.F, -1, -1))  # (F, M, C)
        fed.test_acc[a] = (logits.argmax(-1) == d["y_test"]).float().mean(-1)
    glob = fed.weights("glob")
    for i, w in enumerate(glob):  # broadcast: every client starts the round from its federation's global model
        fed.local[i].copy_(w.repeat_interleave(K, 0))
    reset_optimizer()
    if not V:
        return
    g_var = [w[fed.variants] for w in glob]  # (V, ...): the FedGR-type arms' global models
    for e, w in zip(fed.weights("ema"), g_var, strict=True):  # global revision of the EMA teachers
        e.mul_(p.ema_beta).add_((1 - p.ema_beta) * w.repeat_interleave(K, 0))
    labels = arm_labels(fed, d)[fed.variants]  # (V, N)
    logits, _ = net(g_var, x.expand(V, -1, -1))  # (V, N, C): the received global model on every local sample
    fed.loss_sum += F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    sniffs = fed.switches()[:, 0]  # (V,): the no_sniff ablation keeps c = 1 and no refined labels
    if r + 1 >= p.sniff_round:
        for v in np.flatnonzero(sniffs.numpy()):
            clean, rate = sniff((fed.loss_sum[v] / (r + 1)).numpy(), owner.numpy(), K, p.seed)
            fed.clean_prob[v] = torch.from_numpy(clean).float()
            fed.noisy_client[v] = torch.from_numpy(rate >= p.noisy_client_rate)
    g = torch.Generator().manual_seed(p.seed * 7919 + r)
    probs = net(g_var, weak_shift(x, d["shape"], g, p.shift_pixels).expand(V, -1, -1))[0].softmax(-1)  # (V, N, C)
    conf, pred = probs.max(-1)
    fed.refined.copy_(torch.where((conf > p.conf_threshold) & sniffs[:, None], pred, -1))


# ---- local losses -------------------------------------------------------------------------------------------
def sce_loss(logits: torch.Tensor, y: torch.Tensor, alpha: float = 0.1, beta: float = 1.0) -> torch.Tensor:
    """Symmetric CE (Wang et al. 2019): alpha CE + beta RCE, RCE = -sum_c p_c log clamp(onehot_c, 1e-4, 1)."""
    p_y = logits.softmax(-1).gather(-1, y[..., None])[..., 0]  # (..., B)
    return alpha * ce(logits, y) + beta * (1 - p_y) * -float(np.log(1e-4))


def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample CE for logits (..., B, C) and labels (..., B); label -1 gives 0."""
    return F.cross_entropy(logits.movedim(-1, 1), y.clamp(min=0), reduction="none") * (y >= 0)


def small_loss_mask(loss: torch.Tensor, forget: torch.Tensor) -> torch.Tensor:
    """Co-teaching selection: keep the (1 - forget) smallest-loss samples of each row. loss (..., B), forget (...)."""
    b = loss.shape[-1]
    rank = loss.argsort(-1).argsort(-1)  # (..., B): 0 = smallest loss
    return rank < (b - (forget * b).round())[..., None]


def fedgr_loss(logits, emb, logits_g, emb_g, logits_e, y, clean, refined, noisy_client, on, p: Params,
               sniffing: bool):
    """FedGR's local objective per network. logits (V, K, B, C), emb (V, K, B, H); `on` (V, 3) switches the three
    modules per arm (an ablation's switched-off module contributes exactly 0); returns (V, K) and the parts."""
    if not sniffing:  # warm-up rounds: plain FedAvg training of the same network
        return ce(logits, y).mean(-1), (ce(logits, y).mean(-1).detach(), torch.zeros(()), torch.zeros(()))
    has = refined >= 0  # (V, K, B)
    mixed = clean * ce(logits, y) + (1 - clean) * ce(logits, refined)
    l_ref = torch.where(noisy_client[..., None], ce(logits, refined), mixed)
    l_ref = l_ref.sum(-1) / torch.where(noisy_client, has.sum(-1), y.shape[-1]).clamp(min=1)
    target = (logits_e / p.sharpen_t).softmax(-1)  # sharpened EMA-teacher targets
    l_ema = (target * (target.clamp_min(1e-12).log() - logits.log_softmax(-1))).sum(-1).mean(-1)
    q = (emb_g / p.rep_tau).softmax(-1)
    l_rep = (q * (q.clamp_min(1e-12).log() - (emb / p.rep_tau).log_softmax(-1))).sum(-1).mean(-1)
    l_ema, l_rep = l_ema * on[:, 1, None], l_rep * on[:, 2, None]  # (V, K)
    return l_ref + p.lambda_ema * l_ema + p.lambda_rep * l_rep, (l_ref, l_ema, l_rep)


# ---- training: every client of every method and setting, in lock-step ------------------------------------------
def _reset_optimizer(engine) -> None:
    """A client's turn starts with fresh AdamW state (FedAvg clients do not keep optimiser state across rounds)."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    opt.state.clear()


def train(ctx) -> None:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    K, n_train = d["K"], len(d["true"])
    first = d["shape"][0] if p.arch == "cnn" else d["x"].shape[1]  # input channels / flattened pixels
    fed = Federation(arms(d["settings"], p.ablations, p.clean_reference), K, (first, *p.hidden, d["classes"]),
                     n_train, p.rounds, p.seed, p.arch)
    F_, V = fed.F, len(fed.variants)
    engine = ctx.engine(fed, p.lr, grad_clip=None)  # stacked: no clip could be one network's own, so none
    data = {k_: v.to(ctx.device) if torch.is_tensor(v) else v for k_, v in d.items()}
    labels = arm_labels(fed, data)  # (F, N)
    members = [torch.nonzero(d["owner"] == k)[:, 0] for k in range(K)]
    members = [m if len(m) else torch.arange(n_train) for m in members]  # an empty client trains on weight 0
    plain = fed.index("fedavg") + fed.index("fedprox") + fed.index(CLEAN)  # CE on their labels
    prox, sce_i, cot_a, cot_b = fed.index("fedprox"), fed.index("sce"), fed.index("cot_a"), fed.index("cot_b")
    cot_ratio = data["ratio"][[fed.arms[f].setting for f in cot_a]]  # (n_cot, K): true noise ratios (oracle)
    on = fed.switches()  # (V, 3)
    main = [i for i, f in enumerate(fed.variants) if fed.arms[f].method == "fedgr"]  # full FedGR among the V

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        r, j = divmod(step, p.local_steps)
        g = torch.Generator().manual_seed(p.seed * 100_003 + r)  # one cycling permutation per client and round
        cols = []
        for m in members:
            reps = -(-p.local_steps * p.batch_size // len(m))
            cyc = torch.cat([m[torch.randperm(len(m), generator=g)] for _ in range(reps)])
            cols.append(cyc[j * p.batch_size : (j + 1) * p.batch_size])
        return {"idx": torch.stack(cols, 1)}  # (B, K): sample ids of each client's minibatch

    def step_fn(engine, batch, step):
        r, j = divmod(step, p.local_steps)
        module = engine.module
        if j == 0:
            server_round(module, r, data, p, lambda: _reset_optimizer(engine))
        local = [_clients(w, module) for w in module.weights("local")]  # (F, K, ...)
        with torch.no_grad():  # mean-teacher step of the EMA teachers toward the local models
            for e, w in zip(module.weights("ema"), local, strict=True):
                e.lerp_(w[module.variants].flatten(0, 1), 1 - p.ema_local_momentum)
        idx = batch["idx"].T  # (K, b)
        x = data["x"][idx]  # (K, b, D)
        logits, emb = engine(x.expand(F_, -1, -1, -1).flatten(0, 1))  # (F K, b, C), (F K, b, H)
        logits, emb = _clients(logits, module), _clients(emb, module)  # (F, K, b, ...)
        y = labels[:, idx]  # (F, K, b)
        per = torch.zeros(F_, K)  # every arm's loss per client
        per[plain] = ce(logits[plain], y[plain]).mean(-1)
        per[sce_i] = sce_loss(logits[sce_i], y[sce_i]).mean(-1)
        gw = module.weights("glob")
        per[prox] += p.prox_mu / 2 * sum(((w[prox] - g_[prox, None]) ** 2).flatten(2).sum(-1)
                                         for w, g_ in zip(local, gw, strict=True))
        la, lb = ce(logits[cot_a], y[cot_a]), ce(logits[cot_b], y[cot_b])  # (n_cot, K, b)
        forget = cot_ratio * min(r / 5, 1.0)  # Co-teaching's ramped forget rate
        keep_a, keep_b = small_loss_mask(lb.detach(), forget), small_loss_mask(la.detach(), forget)  # peer picks
        per[cot_a] = (la * keep_a).sum(-1) / keep_a.sum(-1).clamp(min=1)
        per[cot_b] = (lb * keep_b).sum(-1) / keep_b.sum(-1).clamp(min=1)
        vi = module.variants
        with torch.no_grad():
            glob = [w[vi].repeat_interleave(K, 0) for w in gw]
            lg, eg = net(glob, x.repeat(V, 1, 1))  # (V K, b, C): the global model on the same inputs
            le, _ = net(module.weights("ema"), x.repeat(V, 1, 1))  # (V K, b, C): the EMA teacher
        view = lambda t: t.view(V, K, *t.shape[1:])  # noqa: E731
        per[vi], parts = fedgr_loss(logits[vi], emb[vi], view(lg), view(eg), view(le), y[vi],
                                    module.clean_prob[:, idx], module.refined[:, idx], module.noisy_client, on, p,
                                    sniffing=r + 1 >= p.sniff_round)
        metrics = {f"{m}_loss": float(per[module.index(m)].detach().mean())
                   for m in dict.fromkeys(a.method for a in module.arms)}
        metrics |= {f"fedgr_{k_}": float(v.detach()[main].mean()) if v.dim() else 0.0  # full FedGR's parts
                    for k_, v in zip(("refine", "ema", "rep"), parts, strict=True)}
        return per.sum(), metrics

    ctx.progress(f"phase federated: {F_} federations x {K} clients = {F_ * K} networks in lock-step, "
                 f"{p.rounds} rounds x {p.local_steps} local steps")
    ctx.fit("federated", engine, step_fn, batch_fn, p.rounds * p.local_steps)
    server_round(fed, p.rounds, data, p, lambda: _reset_optimizer(engine))  # aggregate the last round
    keep = ("test_acc", "mem_global", "mem_local", "loss_sum", "clean_prob", "refined", "noisy_client")
    ctx.save_record("federation", {k_: getattr(fed, k_).cpu() for k_ in keep} | {"rounds": p.rounds, "arms": fed.arms})
    ctx.save_network("aggregated", fed)  # with the last round's global models, which `fit`'s network predates


# ---- evaluation -------------------------------------------------------------------------------------------------
def _f1(flagged: np.ndarray, truth: np.ndarray) -> float:
    tp = float((flagged & truth).sum())
    return 2 * tp / max(float(flagged.sum() + truth.sum()), 1.0)


def refine_scores(refined: np.ndarray, noisy: np.ndarray, true: np.ndarray) -> tuple[float, float]:
    """Precision of the refined labels (share correct among samples that have one) and their recall (share of the
    mislabelled samples whose refined label is the true one). refined -1 = none; true -1 = unknown (skipped)."""
    known = true >= 0
    has, mislabeled = (refined >= 0) & known, (noisy != true) & known
    precision = float((refined[has] == true[has]).mean()) if has.any() else 0.0
    return precision, float(((refined == true) & mislabeled).sum() / max(mislabeled.sum(), 1))


def evaluate(ctx) -> dict[str, float]:
    rec = ctx.record("federation")
    d = _load(ctx.data_dir)
    arm_list = [Arm(*a) for a in rec["arms"]]
    where = {(a.setting, a.method): f for f, a in enumerate(arm_list)}
    variants = [f for f, a in enumerate(arm_list) if a.method in VARIANTS]
    acc = rec["test_acc"].numpy()  # (R, F)
    cols = {"method": "fedgr", **{b: ("cot_a" if b == "coteaching" else b) for b in BASELINES}}
    true = d["true"].numpy()
    known = true >= 0
    out, per = {}, {}
    for s, name in enumerate(d["settings"]):
        for who, method in cols.items():
            prefix = "method/" if who == "method" else f"baseline/{who}/"
            f = where[(s, method)]
            out[f"{prefix}test_acc_{name}"] = float(acc[-1, f])
            per.setdefault(f"{prefix}test_acc", []).append(acc[-1, f])
            per.setdefault(f"{prefix}best_test_acc", []).append(acc[:, f].max())
        for ab in ABLATIONS:
            if (s, f"fedgr_{ab}") in where:
                out[f"ablation/{ab}/test_acc_{name}"] = float(acc[-1, where[(s, f"fedgr_{ab}")]])
        noisy_lab = d["noisy"][s].numpy()
        mislabeled = (noisy_lab != true) & known
        v = variants.index(where[(s, "fedgr")])
        flagged = rec["clean_prob"][v].numpy() < 0.5
        precision, recall = refine_scores(rec["refined"][v].numpy(), noisy_lab, true)
        for k_, val in {"detect_f1": _f1(flagged[known], mislabeled[known]), "refine_precision": precision,
                        "refine_recall": recall}.items():
            per.setdefault(f"method/{k_}", []).append(val)
            out[f"method/{k_}_{name}"] = val
        mem_g, mem_l = rec["mem_global"][:, s].numpy(), rec["mem_local"][:, s].numpy()  # (R,), (R, K)
        auc_l = np.nanmean(mem_l, 0)  # (K,) per-client area (mean over rounds)
        any_noise = bool(mislabeled.any())  # no noisy label at all (rho = 0): nothing to memorise
        per.setdefault("baseline/fedavg/mem_auc_global", []).append(float(np.nanmean(mem_g)) if any_noise else 0.0)
        per.setdefault("baseline/fedavg/mem_auc_local", []).append(float(np.nanmean(auc_l)) if any_noise else 0.0)
        curves = {w: acc[:, where[(s, m)]] for w, m in cols.items()}
        curves |= {ab: acc[:, where[(s, f"fedgr_{ab}")]] for ab in ABLATIONS if (s, f"fedgr_{ab}") in where}
        if (-1, CLEAN) in where:
            curves["fedavg, clean labels"] = acc[:, where[(-1, CLEAN)]]
        _curves(ctx.plots_dir / f"test_acc_{name}.png", curves, "test accuracy of the global model",
                f"{name}: test accuracy per round")
        _curves(ctx.plots_dir / f"memorisation_{name}.png",
                {"global": mem_g, **{f"client {k}": mem_l[:, k] for k in range(mem_l.shape[1])}},
                "share predicted as the noisy label", f"{name}: memorisation of noisy labels (FedAvg)")
        loss_mean = rec["loss_sum"][v].numpy() / (rec["rounds"] + 1)
        if mislabeled.any() and (~mislabeled).any():
            split_histogram(ctx.plots_dir / f"loss_proxy_{name}.png", loss_mean[known], mislabeled[known],
                            ("clean", "mislabeled"), "running-mean CE of the global model", f"{name}: loss proxies")
    if (-1, CLEAN) in where:
        out[f"baseline/{CLEAN}/test_acc"] = float(acc[-1, where[(-1, CLEAN)]])
    per["detail/fedavg/mem_untrained_local"] = untrained_memorisation(ctx.params, d, arm_list)
    return {k_: float(np.mean(v)) for k_, v in per.items()} | out


def untrained_memorisation(p: Params, d: dict, arm_list: list[Arm]) -> list[float]:
    """The memorisation probe of a local model that memorised nothing: FedAvg's round-0 global model (the weights
    every client starts from, before any training), scored like `mem_local` on each client's own mislabelled
    samples and averaged over clients; one value per setting. A trained global model predicts the true label on a
    mislabelled sample, so its share predicted as the noisy label falls below what any untrained model scores:
    where this probe also exceeds `mem_auc_global`, "global < local" holds without any local memorisation."""
    first = d["shape"][0] if p.arch == "cnn" else d["x"].shape[1]
    fed0 = Federation(arm_list, d["K"], (first, *p.hidden, d["classes"]), len(d["true"]), 1, p.seed, p.arch)
    out = []
    with torch.no_grad():
        for s in range(len(d["settings"])):
            mislabeled = d["noisy"][s] != d["true"]
            w0 = [w[fed0.index("fedavg", s)[0]][None] for w in fed0.weights("glob")]
            shares = []
            for k in range(d["K"]):
                own = (d["owner"] == k) & mislabeled
                if own.any():
                    logits, _ = net(w0, d["x"][own][None])
                    shares.append(float((logits[0].argmax(-1) == d["noisy"][s, own]).float().mean()))
            out.append(float(np.mean(shares)) if shares else 0.0)
    return out


def _curves(path: Path, curves: dict[str, np.ndarray], ylabel: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, values in curves.items():
        bold = name in ("method", "global")
        ax.plot(np.arange(1, len(values) + 1), values, lw=2.2 if bold else 1, alpha=1 if bold else 0.6,
                label="FedGR" if name == "method" else name)
    ax.set(xlabel="round", ylabel=ylabel, title=title)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="fedgr",
    title="FedGR: federated global reviser for heterogeneous label noise",
    seed="003_9a806cafa3d919df.txt, abstract 16",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/test_acc", "max"),
    claim=Claim(
        premises=(  # the task is learnt at all: FedAvg on the true labels, same model, data, rounds and budget
            Compare(f"baseline/{CLEAN}/test_acc", ">", CLEAN_BAR, name="fedavg_learns_clean_labels"),
        ),
        all_of=(
            *(Compare(f"method/test_acc_{s}", ">", tuple(f"baseline/{b}/test_acc_{s}" for b in BASELINES))
              for s in SETTINGS),
            *(Compare("method/test_acc_severe", ">", f"ablation/{ab}/test_acc_severe") for ab in ABLATIONS),
        ),
        context=(  # the memorisation observation scores each local model on the samples it has just trained on,
            # and an untrained model (which memorised nothing) also scores above the global one: not evidence
            Compare("baseline/fedavg/mem_auc_global", "<", "baseline/fedavg/mem_auc_local"),
            Compare("baseline/fedavg/mem_auc_global", "<", "detail/fedavg/mem_untrained_local"),
            Compare("method/refine_recall_severe", ">", RECALL_BAR),
        ),
        summary="FedGR's final test accuracy beats every baseline in each noise setting; and each single-module "
                "ablation (no sniffing/refining, no EMA distillation, no representation loss) is below full FedGR in "
                "the severe setting",
        note="4 of the paper's 8 baselines; module ablations in the severe setting only; unequal tuning: FedGR's "
             "sniff_round and shift_pixels were chosen by an earlier smoke trial, while no baseline knob was tuned "
             "(FedProx mu, SCE alpha/beta, Co-teaching's ramp keep their published defaults) and no arm has a "
             "validation split; Co-teaching's forget rate is each client's true noise ratio (an oracle)",
    ),
)
