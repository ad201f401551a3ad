"""DiLA: a disentangled latent action world model (content and structure pathways, single-stage training).

Seed: 000_2dd18ae8605fb5c1.txt, abstract 15. Spec: ../shared/papers/dila.md.

What it implements (function names in brackets):
- data: 32x32 RGB videos of a coloured load_digits sprite on a stripes/checker texture, moved by hidden actions
  (8 directions x speed 1 or 2 px) with a per-frame global brightness jitter the action does not cause [prepare];
- DiLA [DiLA]: content pathway E_c(o_t) -> 64-d global code + 8x8x16 detail map [ContentEncoder]; structure pathway
  E_s(o) -> 8x8x4 layout map [conv_stack] (every map is `map_side` = 8 on a side, whatever the frame size); latent
  action q(a | s_t, s_t+1), Gaussian in R^4, that sees structure maps only [ActionEncoder]; structure dynamics
  F(s_t, a) [Dynamics]; generator D(s_hat, content) with FiLM from the global code and skips from the detail map
  [Generator]. Loss |o_hat - o_t+1|^2 + beta KL [DiLA.loss];
- baselines: a continuous single-pathway LAM (inverse dynamics on raw frame pairs, D(o_t, a)) and a discrete LAM
  with an 8-code VQ action [LAM], both at the conv width that matches DiLA's parameter count [lam_width]; the
  discrete LAM is in no claim part, so smoke leaves it out (`discrete_lam`); the beta sweep trains DiLA and the
  continuous LAM at every beta in `betas`;
- a digit classifier on rendered sprite crops, for action transfer [DigitNet]. Every network trains in lock-step
  in one DeepSpeed engine [Everything];
- metrics: PSNR/SSIM of o_hat_t+1 with the inferred action, 4-step rollout PSNR, action transfer accuracy (template
  matching + classifier), linear-probe R^2 a -> (dx, dy), content leakage (background-type probe accuracy), CEM
  visual planning success [evaluate, transfer, plan].

Deviations from the paper (choices the abstract left open):
- Module forms and sizes are ours (the spec's); the digit classifier is trained on 10x10 crops of rendered training
  frames (coloured sprite on its texture) rather than on raw load_digits, so it judges sprites as they are drawn.
- The discrete LAM uses a straight-through VQ with codebook and commitment losses (weight 0.25), no KL term.
- Action transfer applies A's inferred action to B's frame: for DiLA through B's structure map and content, for the
  LAMs through D(o_B, a). Planning: CEM (64 candidates, 4 iterations, 8 elites) over 3 latent actions minimising
  pixel MSE of the final generated frame to the goal frame; the discrete LAM's candidates snap to the nearest code.
- Smoke runs a smaller world (16x16 frames, so the sprite's move is a larger share of the frame) with KL weight
  1e-3 and learning rate 3e-3: at 32x32 and beta 0.1 (a KL nat costs more than the move saves in per-pixel MSE)
  the latent actions of every model stayed uninformative within the budget (the probe premises failed).
- Full: BridgeData V2 is not loaded yet (no loader in this module); the full profile runs the synthetic world at
  larger width, more data and the beta sweep.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.model_selection import cross_val_score
from torch import nn

from models.common import sequences as seq
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, ScheduledParams

TEXTURES = ("stripes", "checker")
SPRITE = 10
A_DIM = 4
PROBE_BAR = 0.5  # premise: the probe's R^2 of (dx, dy) from a model's inferred actions


class Params(ScheduledParams):
    n_videos: int = Field(800, ge=4, description="Videos rendered by prepare.")
    n_frames: int = Field(8, ge=3, description="Frames per video.")
    size: int = Field(32, ge=16, description="Frame side in pixels (map_side times a power of 2).")
    map_side: int = Field(8, ge=2, description="Side of the structure, detail and frame maps (the spec: 8x8).")
    brightness: float = Field(0.1, ge=0.0, lt=1.0, description="Global brightness jitter b: factor U[1-b, 1+b].")
    speeds: list[int] = Field([1, 2], min_length=1, description="Action speeds in px per frame.")
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Held-out videos.")
    channels: int = Field(16, ge=4, description="Conv channels of every encoder and decoder.")
    betas: list[float] = Field([0.1], min_length=1, description="KL weights; the first is the claim's beta.")
    steps: int = Field(300, ge=1, description="Training steps (all models in lock-step).")
    batch_size: int = Field(32, ge=2, description="Frame pairs per step.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    discrete_lam: bool = Field(True, description="Train and report the discrete (VQ) LAM beside the claim.")
    eval_pairs: int = Field(256, ge=2, description="Test frame pairs for fidelity and probes.")
    transfer_pairs: int = Field(64, ge=1, description="(A, B) pairs of the action-transfer test.")
    plan_goals: int = Field(16, ge=1, description="Planning problems (start, goal 3 steps later).")
    cem_population: int = Field(64, ge=4, description="CEM candidates per iteration.")
    cem_iters: int = Field(4, ge=1, description="CEM iterations.")


# ---- data ----------------------------------------------------------------------------------------------------
def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    sprites, digit_labels = seq.digit_sprites(SPRITE)
    hi = p.size - SPRITE
    frames, actions = {"video_id": [], "t": [], "pixels": []}, {"video_id": [], "t": [], "dx": [], "dy": []}
    meta = {"video_id": [], "digit": [], "sprite": [], "colour": [], "background": [], "split": [], "y0": [], "x0": []}
    test = set(rng.permutation(p.n_videos)[: max(1, round(p.test_fraction * p.n_videos))].tolist())
    for v in range(p.n_videos):
        kind = TEXTURES[int(rng.integers(2))]
        bg = seq.background_texture(rng, p.size, kind, 1.0)[..., None] * rng.uniform(0.1, 0.6, 3)  # (S, S, 3)
        i = int(rng.integers(len(sprites)))
        colour = rng.uniform(0.5, 1.0, 3)
        pos = rng.integers(0, hi + 1, size=2)
        meta["y0"].append(int(pos[0])), meta["x0"].append(int(pos[1]))
        for t in range(p.n_frames):
            frame, _ = seq.render_sprites(bg, [sprites[i]], [pos], colours=[colour])
            frame = np.clip(frame * rng.uniform(1 - p.brightness, 1 + p.brightness), 0, 1)  # not caused by a
            frames["video_id"].append(v), frames["t"].append(t)
            frames["pixels"].append(np.round(frame * 255).astype(np.uint8).reshape(-1))
            if t + 1 < p.n_frames:  # action t moves frame t to frame t+1 (clipped at the walls)
                step = seq.HEADINGS8[rng.integers(8)] * p.speeds[int(rng.integers(len(p.speeds)))]
                new = np.clip(pos + step, 0, hi)
                actions["video_id"].append(v), actions["t"].append(t)
                actions["dy"].append(int(new[0] - pos[0])), actions["dx"].append(int(new[1] - pos[1]))
                pos = new
        meta["video_id"].append(v), meta["digit"].append(int(digit_labels[i])), meta["sprite"].append(i)
        meta["colour"].append(",".join(f"{c:.3f}" for c in colour)), meta["background"].append(kind)
        meta["split"].append("test" if v in test else "train")
    write_table(out_dir / "frames.parquet", {**frames, "pixels": np.stack(frames["pixels"])})
    write_table(out_dir / "actions.parquet", actions)
    write_table(out_dir / "meta.parquet", meta)


def load_videos(data_dir: Path) -> dict[str, torch.Tensor]:
    f, a, m = (read_table(data_dir / n) for n in ("frames.parquet", "actions.parquet", "meta.parquet"))
    v, t = int(f["video_id"].max()) + 1, int(f["t"].max()) + 1
    side = int(round(np.sqrt(f["pixels"].shape[1] // 3)))
    order = np.lexsort((f["t"], f["video_id"]))
    pixels = torch.from_numpy(f["pixels"][order].astype(np.float32) / 255).view(v, t, side, side, 3)
    order = np.lexsort((a["t"], a["video_id"]))
    disp = torch.from_numpy(np.stack([a["dy"][order], a["dx"][order]], -1)).view(v, t - 1, 2)  # (V, T-1, 2)
    mo = np.argsort(m["video_id"])
    start = torch.from_numpy(np.stack([m["y0"][mo], m["x0"][mo]], -1))  # (V, 2)
    pos = torch.cat([start[:, None], start[:, None] + disp.cumsum(1)], 1)  # (V, T, 2) sprite top-left
    return {"x": pixels.permute(0, 1, 4, 2, 3).contiguous(), "disp": disp, "pos": pos,
            "digit": torch.from_numpy(m["digit"][mo]),
            "alpha": torch.from_numpy(seq.digit_sprites(SPRITE)[0][m["sprite"][mo]]),  # (V, 10, 10) coverage
            "is_test": torch.from_numpy(m["split"][mo] == "test"),
            "background": torch.from_numpy((m["background"][mo] == "checker").astype(np.int64))}


# ---- networks ------------------------------------------------------------------------------------------------
def halvings(size: int, side: int) -> int:
    """How many stride-2 stages take a size x size frame to a side x side map (size / side a power of 2)."""
    k = int(round(np.log2(size / side)))
    if k < 1 or side * 2**k != size:
        raise ValueError(f"frame side {size} is not {side} times a power of 2 (at least 2)")
    return k


def conv_stack(cin: int, c: int, cout: int, down: int = 2) -> nn.Sequential:
    """(B, cin, S, S) -> (B, cout, S/2^down, S/2^down): `down` stride-2 convs and a 1x1 head."""
    layers: list[nn.Module] = []
    for i in range(down):
        layers += [nn.Conv2d(cin if i == 0 else c, c, 4, 2, 1), nn.SiLU()]
    return nn.Sequential(*layers, nn.Conv2d(c, cout, 1))


class ContentEncoder(nn.Module):
    def __init__(self, c: int, down: int = 2):
        super().__init__()
        self.detail = conv_stack(3, c, c, down)
        self.glob = nn.Linear(c, 64)

    def forward(self, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        detail = self.detail(o)  # (B, c, 8, 8)
        return self.glob(detail.mean((2, 3))), detail  # (B, 64), (B, c, 8, 8)


class ActionEncoder(nn.Module):
    """Inverse dynamics: a pair of maps -> Gaussian (mu, logvar) in R^4, or a pre-quantisation vector."""

    def __init__(self, cin: int, c: int, spatial: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, c, 3, 1, 1), nn.SiLU(), nn.Conv2d(c, c, 3, 2, 1), nn.SiLU(),
                                 nn.Flatten(), nn.Linear(c * (spatial // 2) ** 2, 2 * A_DIM))

    def forward(self, pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.net(pair).chunk(2, -1)  # 2 x (B, 4)
        return mu, logvar.clamp(-8, 4)


class Dynamics(nn.Module):
    """F(s_t, a) -> s_hat_t+1, residual on the structure map."""

    def __init__(self, s_ch: int, c: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(s_ch + A_DIM, c, 3, 1, 1), nn.SiLU(), nn.Conv2d(c, c, 3, 1, 1), nn.SiLU(),
                                 nn.Conv2d(c, s_ch, 3, 1, 1))

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        a_map = a[:, :, None, None].expand(-1, -1, *s.shape[2:])  # (B, 4, 8, 8)
        return s + self.net(torch.cat([s, a_map], 1))


class Generator(nn.Module):
    """Map (+ skip features) -> RGB frame `up` doublings larger, FiLM-modulated by a conditioning vector."""

    def __init__(self, cin: int, c: int, cond: int, up: int = 2):
        super().__init__()
        self.inp = nn.Conv2d(cin, c, 3, 1, 1)
        self.film = nn.Linear(cond, 2 * c)
        layers: list[nn.Module] = [nn.SiLU()]
        for _ in range(up):
            layers += [nn.Upsample(scale_factor=2), nn.Conv2d(c, c, 3, 1, 1), nn.SiLU()]
        self.up = nn.Sequential(*layers, nn.Conv2d(c, 3, 3, 1, 1), nn.Sigmoid())

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.film(cond).chunk(2, -1)  # (B, c) each
        return self.up(self.inp(h) * (1 + gamma[:, :, None, None]) + beta[:, :, None, None])  # (B, 3, S, S)


def kl_normal(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    return 0.5 * (mu**2 + logvar.exp() - 1 - logvar).sum(-1).mean()


class DiLA(nn.Module):
    def __init__(self, c: int, size: int, s_ch: int = 4, side: int = 8):
        super().__init__()
        k = halvings(size, side)
        self.content, self.structure = ContentEncoder(c, k), conv_stack(3, c, s_ch, k)
        self.action = ActionEncoder(2 * s_ch, c, side)
        self.dynamics, self.generator = Dynamics(s_ch, c), Generator(s_ch + c, c, 64, k)

    def infer(self, o_t: torch.Tensor, o_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.action(torch.cat([self.structure(o_t), self.structure(o_next)], 1))

    def step(self, o_t: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """o_hat_t+1 = D(F(E_s(o_t), a), E_c(o_t))."""
        glob, detail = self.content(o_t)
        s_next = self.dynamics(self.structure(o_t), a)  # (B, 4, 8, 8)
        return self.generator(torch.cat([s_next, detail], 1), glob)

    def loss(self, o_t: torch.Tensor, o_next: torch.Tensor, beta: float) -> torch.Tensor:
        mu, logvar = self.infer(o_t, o_next)
        a = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return F.mse_loss(self.step(o_t, a), o_next) + beta * kl_normal(mu, logvar)


class LAM(nn.Module):
    """Single-pathway LAM (LAPO/Genie-style): a = IDM(o_t, o_t+1), o_hat_t+1 = D(o_t, a); Gaussian or VQ action."""

    def __init__(self, c: int, size: int, codes: int = 0, side: int = 8):
        super().__init__()
        k = halvings(size, side)
        self.action = ActionEncoder(6, c, size)
        self.frame = conv_stack(3, c, c, k)
        self.generator = Generator(c + A_DIM, c, A_DIM, k)
        self.codebook = nn.Parameter(torch.randn(codes, A_DIM)) if codes else None

    def infer(self, o_t: torch.Tensor, o_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.action(torch.cat([o_t, o_next], 1))
        return (self.quantise(mu), logvar) if self.codebook is not None else (mu, logvar)

    def quantise(self, z: torch.Tensor) -> torch.Tensor:
        """Nearest code, straight-through gradient to z."""
        q = self.codebook[torch.cdist(z, self.codebook).argmin(-1)]  # (B, 4)
        return z + (q - z).detach()

    def step(self, o_t: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        h = self.frame(o_t)  # (B, c, 8, 8)
        return self.generator(torch.cat([h, a[:, :, None, None].expand(-1, -1, *h.shape[2:])], 1), a)

    def loss(self, o_t: torch.Tensor, o_next: torch.Tensor, beta: float) -> torch.Tensor:
        mu, logvar = self.action(torch.cat([o_t, o_next], 1))
        if self.codebook is None:
            a, reg = mu + torch.randn_like(mu) * (0.5 * logvar).exp(), beta * kl_normal(mu, logvar)
        else:
            q = self.codebook[torch.cdist(mu, self.codebook).argmin(-1)]
            a, reg = mu + (q - mu).detach(), F.mse_loss(q, mu.detach()) + 0.25 * F.mse_loss(mu, q.detach())
        return F.mse_loss(self.step(o_t, a), o_next) + reg


class DigitNet(nn.Module):
    """Digit classifier on 10x10 RGB sprite crops."""

    def __init__(self, c: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, c, 3, 1, 1), nn.SiLU(), nn.Conv2d(c, 2 * c, 3, 2, 1), nn.SiLU(),
                                 nn.Flatten(), nn.Linear(2 * c * 25, 10))

    def forward(self, crop: torch.Tensor) -> torch.Tensor:
        return self.net(crop)  # (B, 10)


def n_params(m: nn.Module) -> int:
    return sum(q.numel() for q in m.parameters())


def lam_width(c: int, size: int, side: int = 8) -> int:
    """The LAMs' conv width whose parameter count is closest to DiLA's at width `c` (the spec: matched
    parameters; the LAM's raw-frame inverse dynamics grows with the frame, DiLA's with the map)."""
    target = n_params(DiLA(c, size, side=side))
    lo, hi = 2, 4 * c  # the LAM's count grows with its width: bisect for the first width at or above the target
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if n_params(LAM(mid, size, side=side)) < target else (lo, mid)
    return min((lo - 1, lo) if lo > 2 else (lo,), key=lambda w: abs(n_params(LAM(w, size, side=side)) - target))


def model_names(p: Params) -> list[str]:
    """dila-b<beta>, lam_cont-b<beta> for every beta, and the discrete LAM where `discrete_lam` (MLflow names
    allow no '@')."""
    return [f"{m}-b{b:g}" for b in p.betas for m in ("dila", "lam_cont")] + (["lam_disc"] if p.discrete_lam else [])


class Everything(nn.Module):
    def __init__(self, p: Params):
        super().__init__()
        w = lam_width(p.channels, p.size, p.map_side)
        build = {"dila": lambda: DiLA(p.channels, p.size, side=p.map_side),
                 "lam_cont": lambda: LAM(w, p.size, side=p.map_side),
                 "lam_disc": lambda: LAM(w, p.size, codes=8, side=p.map_side)}
        self.models = nn.ModuleDict({n.replace(".", "_"): build[n.split("-b")[0]]() for n in model_names(p)})
        self.betas = {n.replace(".", "_"): float(n.split("-b")[1]) if "-b" in n else 0.0 for n in model_names(p)}
        self.labels = {n.replace(".", "_"): n for n in model_names(p)}  # ModuleDict keys cannot hold "."
        self.digits = DigitNet(p.channels)

    def forward(self, o_t: torch.Tensor, o_next: torch.Tensor, crops: torch.Tensor, digit: torch.Tensor):
        losses = {n: m.loss(o_t, o_next, self.betas[n]) for n, m in self.models.items()}
        return losses | {"digits": F.cross_entropy(self.digits(crops), digit)}


# ---- training: every model and the digit classifier in lock-step ----------------------------------------------
def crops_at(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, 3, S, S) frames, (B, 2) integer top-left -> (B, 3, 10, 10) sprite crops."""
    return torch.stack([img[:, y : y + SPRITE, x_ : x_ + SPRITE] for img, (y, x_) in zip(x, pos.tolist(), strict=True)])


def train(ctx) -> None:
    p: Params = ctx.params
    d = load_videos(ctx.data_dir)
    train_ids = torch.nonzero(~d["is_test"]).flatten()
    t_len = d["x"].shape[1]

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(p.seed * 100_003 + step)
        v = train_ids[torch.randint(len(train_ids), (p.batch_size,), generator=g)]
        t = torch.randint(0, t_len - 1, (p.batch_size,), generator=g)
        return {"o_t": d["x"][v, t], "o_next": d["x"][v, t + 1], "crops": crops_at(d["x"][v, t], d["pos"][v, t]),
                "digit": d["digit"][v]}

    def step_fn(engine, b, step):
        losses = engine(b["o_t"], b["o_next"], b["crops"], b["digit"])
        return sum(losses.values()), {k: float(v.detach()) for k, v in losses.items()}

    model = Everything(p)
    ctx.progress(f"phase joint: {len(model.models)} world models + digit classifier in lock-step, {p.steps} steps")
    engine = ctx.engine(model, p.lr, arms={**model.models, "digits": model.digits}, steps=p.steps,
                        warmup=p.warmup, decay=p.decay)
    ctx.fit("joint", engine, step_fn, batch_fn, p.steps)


# ---- evaluation ----------------------------------------------------------------------------------------------
def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR (B,) for images in [0, 1]."""
    return 10 * torch.log10(1 / ((a - b) ** 2).flatten(1).mean(1).clamp(min=1e-10))


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 7, sigma: float = 1.5) -> torch.Tensor:
    """Per-image SSIM (B,) (Wang et al. 2004, Gaussian window, C1 = 0.01^2, C2 = 0.03^2, per channel, mean)."""
    g = torch.exp(-((torch.arange(window) - window // 2) ** 2) / (2 * sigma**2))
    k = (g[:, None] * g[None]) / g.sum() ** 2
    k = k.expand(a.shape[1], 1, window, window).to(a)
    blur = lambda x: F.conv2d(x, k, groups=a.shape[1])  # noqa: E731  valid window positions
    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2, blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return s.flatten(1).mean(1)


def locate(frames: torch.Tensor, templates: torch.Tensor, alpha: torch.Tensor | None = None) -> torch.Tensor:
    """Top-left (B, 2) of the best SSD match of each (3, 10, 10) template in each (3, S, S) frame; `alpha`
    (B, 10, 10), the sprite's coverage, weights the SSD so the texture behind the template does not count."""
    patches = F.unfold(frames, SPRITE)  # (B, 3*100, P)
    w = torch.ones_like(templates) if alpha is None else alpha[:, None].expand_as(templates)
    ssd = (w.flatten(1)[:, :, None] * (patches - templates.flatten(1)[:, :, None]) ** 2).sum(1)  # (B, P)
    side = frames.shape[-1] - SPRITE + 1
    best = ssd.argmin(1)
    return torch.stack([best // side, best % side], 1)


@torch.no_grad()
def plan(model: nn.Module, o0: torch.Tensor, goal: torch.Tensor, steps: int, p: Params,
         g: torch.Generator, discrete: bool) -> torch.Tensor:
    """CEM over `steps` latent actions: minimise pixel MSE between the rolled-out last frame and the goal frame.
    Returns the final frame (3, S, S) of the optimised plan's mean."""
    mean, std, n_elite = torch.zeros(steps, A_DIM), torch.ones(steps, A_DIM), max(2, p.cem_population // 8)

    def roll(actions: torch.Tensor) -> torch.Tensor:  # (N, steps, 4) -> (N, 3, S, S)
        o = o0.expand(actions.shape[0], -1, -1, -1)
        for s in range(steps):
            a = model.quantise(actions[:, s]) if discrete else actions[:, s]
            o = model.step(o, a)
        return o

    for _ in range(p.cem_iters):
        cand = mean + std * torch.randn(p.cem_population, steps, A_DIM, generator=g)
        cost = ((roll(cand) - goal) ** 2).flatten(1).mean(1)
        elite = cand[cost.argsort()[:n_elite]]
        mean, std = elite.mean(0), elite.std(0) + 1e-3
    return roll(mean[None])[0]


@torch.no_grad()
def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    d = load_videos(ctx.data_dir)
    everything = ctx.network("joint")
    test_ids = torch.nonzero(d["is_test"]).flatten()
    t_len, g = d["x"].shape[1], torch.Generator().manual_seed(p.seed + 11)
    n = p.eval_pairs
    v, t = test_ids[torch.randint(len(test_ids), (n,), generator=g)], torch.randint(0, t_len - 1, (n,), generator=g)
    o_t, o_next, disp = d["x"][v, t], d["x"][v, t + 1], d["disp"][v, t].float()
    # transfer pairs: B's sprite must be able to make A's move without hitting a wall
    hi = p.size - SPRITE
    tb = torch.randint(0, t_len, (n,), generator=g)
    vb = test_ids[torch.randint(len(test_ids), (n,), generator=g)]
    target = d["pos"][vb, tb] + d["disp"][v, t]
    ok = torch.nonzero(((target >= 0) & (target <= hi)).all(1)).flatten()[: p.transfer_pairs]
    horizon = min(4, t_len - 1)
    roll_v = test_ids[: max(1, min(len(test_ids), n // 4))]
    plan_v = test_ids[torch.randint(len(test_ids), (p.plan_goals,), generator=g)]
    plan_steps = min(3, t_len - 1)

    out, examples, scatter = {}, {}, {}
    for name, model in everything.models.items():
        discrete = name == "lam_disc"
        mu, _ = model.infer(o_t, o_next)  # (n, 4): the inferred action (posterior mean / nearest code)
        pred = model.step(o_t, mu)
        m = {"psnr": float(psnr(pred, o_next).mean()), "ssim": float(ssim(pred, o_next).mean())}
        frames = d["x"][roll_v]
        o, vals = frames[:, 0], []
        for s in range(horizon):  # actions inferred from the true pairs, frames fed back
            o = model.step(o, model.infer(frames[:, s], frames[:, s + 1])[0])
            vals.append(psnr(o, frames[:, s + 1]).mean())
        m["rollout_psnr"] = float(torch.stack(vals).mean())
        # action transfer: A's action on B's frame; template-match B's sprite; classifier must still read B's digit
        o_b = d["x"][vb[ok], tb[ok]]
        gen = model.step(o_b, mu[ok])
        found = locate(gen, crops_at(o_b, d["pos"][vb[ok], tb[ok]]), d["alpha"][vb[ok]])
        moved_ok = ((found - target[ok]).float().norm(dim=1) <= 1.0)
        read_ok = everything.digits(crops_at(gen, found)).argmax(1) == d["digit"][vb[ok]]
        m["transfer_acc"] = float((moved_ok & read_ok).float().mean()) if len(ok) else 0.0
        m["transfer_move_acc"] = float(moved_ok.float().mean()) if len(ok) else 0.0
        # interpretability probes on the inferred actions
        a_np, folds = mu.numpy(), min(3, n)
        m["probe_r2"] = float(np.mean(cross_val_score(LinearRegression(), a_np, disp.numpy(), cv=folds, scoring="r2")))
        bg = d["background"][v].numpy()
        m["leakage"] = float(np.mean(cross_val_score(LogisticRegression(max_iter=500), a_np, bg, cv=folds))) \
            if len(np.unique(bg)) > 1 and np.bincount(bg).min() >= folds else float(bg.mean().round())
        # visual planning: reach the sprite position of the frame `plan_steps` later
        hits = []
        for gv in plan_v:
            final = plan(model, d["x"][gv, 0][None], d["x"][gv, plan_steps], plan_steps, p, g, discrete)
            where = locate(final[None], crops_at(d["x"][gv, 0][None], d["pos"][gv, 0][None]), d["alpha"][gv][None])[0]
            hits.append(float((where - d["pos"][gv, plan_steps]).float().norm() <= 2.0))
        m["plan_success"] = float(np.mean(hits))
        label = everything.labels[name]
        kind, beta = (label.split("-b") + [""])[:2]
        claim_beta = beta == f"{p.betas[0]:g}"
        prefix = ("method/" if kind == "dila" else f"baseline/{kind}/") if claim_beta or not beta else \
            f"detail/{label}/"
        out |= {prefix + k: v_ for k, v_ in m.items()} | {f"detail/{label}/{k}": v_ for k, v_ in m.items()}
        examples[label] = gen[:4]
        scatter[label] = (a_np, d["disp"][v, t].numpy())
    _plots(ctx.plots_dir, out, o_t[ok[:4]], o_next[ok[:4]], d["x"][vb[ok[:4]], tb[ok[:4]]], examples, scatter)
    return out


def _plots(plots: Path, out: dict, a_t, a_next, b_frames, examples: dict, scatter: dict) -> None:
    import matplotlib.pyplot as plt

    labels = list(examples)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, metric in zip(axes, ("transfer_acc", "psnr", "leakage"), strict=True):
        ax.bar(range(len(labels)), [out[f"detail/{lab}/{metric}"] for lab in labels],
               color=["tab:red" if lab.startswith("dila") else "tab:gray" for lab in labels])
        ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
        ax.set_title(metric)
    fig.tight_layout()
    fig.savefig(plots / "models.png", dpi=110)
    plt.close(fig)

    rows = [("A: o_t", a_t), ("A: o_t+1", a_next), ("B: o_t", b_frames)] + [(f"B + a_A ({k})", v) for k, v in
                                                                           examples.items()]
    cols = len(a_t)
    if cols:
        fig, axes = plt.subplots(len(rows), cols, figsize=(1.6 * cols, 1.5 * len(rows)), squeeze=False)
        for r, (label, imgs) in enumerate(rows):
            for j in range(cols):
                axes[r, j].imshow(imgs[j].permute(1, 2, 0).clamp(0, 1).numpy())
                axes[r, j].set_xticks([]), axes[r, j].set_yticks([])
            axes[r, 0].set_ylabel(label, fontsize=6)
        fig.suptitle("Action transfer: A's inferred action applied to B's frame", fontsize=8)
        fig.tight_layout()
        fig.savefig(plots / "transfer_examples.png", dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(scatter), figsize=(3.2 * len(scatter), 3), squeeze=False)
    for ax, (label, (a, disp)) in zip(axes[0], scatter.items(), strict=True):
        ax.scatter(a[:, 0], a[:, 1], c=np.arctan2(disp[:, 0], disp[:, 1]), cmap="hsv", s=6)
        ax.set(title=f"{label}: a[0] vs a[1]", xlabel="a0", ylabel="a1")
    fig.suptitle("Latent actions coloured by the true move direction", fontsize=8)
    fig.tight_layout()
    fig.savefig(plots / "latent_actions.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="dila",
    title="DiLA: disentangled latent action world model",
    seed="000_2dd18ae8605fb5c1.txt, abstract 15",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/transfer_acc", "max"),
    claim=Claim(premises=(  # the latent actions carry the motion (a linear probe reads (dx, dy) from them)
        Compare("method/probe_r2", ">", PROBE_BAR, name="dila_actions_read_motion"),
        Compare("baseline/lam_cont/probe_r2", ">", PROBE_BAR, name="lam_cont_actions_read_motion"),
    ), all_of=(
        Compare("method/transfer_acc", ">", "baseline/lam_cont/transfer_acc"),
        Compare("method/psnr", ">=", "baseline/lam_cont/psnr", margin=-0.5),
    ), summary="at the same beta, DiLA transfers actions better than the continuous LAM without losing more than "
               "0.5 dB PSNR"),
)
