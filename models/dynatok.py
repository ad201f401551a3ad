"""DynaTok: correspondence-free 4D reconstruction from partial point-cloud sequences.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 6. Spec: ../shared/papers/dynatok.md.

What it implements (function names in brackets):
- data: deforming articulated objects (ellipsoid torso, 2-4 capsule limbs on sinusoidal hinges, random rigid
  translation and yaw) sampled densely with canonical surface coordinates u; a depth camera on a slowly orbiting
  path keeps the points that win a 32x32 z-buffer (within a depth tolerance), then 10% dropout, N(0, 0.005) noise
  and a shuffle; scene level: 2-3 objects side by side occluding each other [render_partial, synth_sequence,
  prepare]. Full: DeformingThings4D .anime meshes [read_anime, anime_points];
- frame tokenizer: Fourier features + MLP per point, cross-attention from M learned queries (permutation
  invariant) [Tokenizer]; spatiotemporal transformer over T x M tokens with learned time embeddings [DynaTok.encode];
- residual tokens: G = mean_t tokens + MLP(mean_t tokens), R_t = d_t + MLP(d_t) with d_t = tokens_t - mean_t tokens,
  Z_t = G + R_t, penalty lambda |R_t|^2 [DynaTok.latents];
- flow-matching decoder v(p, s, Z_t): an MLP with cross-attention from the point to Z_t, rectified flow
  p_s = (1-s) eps + s y, target y - eps [FlowDecoder, flow_loss]; Euler sampling with the same eps_i for point i
  in every frame [sample];
- baselines: per-frame (encoder attends within a frame only), no decoupling (Z_t = encoder tokens), deterministic
  folding decoder with Chamfer loss [Folding]; all four models train in lock-step in one engine [Models];
- metrics: Chamfer-L2, F-score at 1% of the box diagonal, occluded-region Chamfer, correspondence drift
  [chamfer_terms, frame_metrics, drift].

Deviations from the paper (choices the abstract left open):
- Sizes are the spec's smoke choices, trimmed to the smoke budget; the noise eps is N(0, I) in the centred frame
  (every sequence is centred on the mean of its partial points, known at inference). The smoke profile departs from
  the spec's smoke line so the flow decoders train long enough: object-level sequences only, fewer observed and
  target points per frame, more and larger steps, and a linear warm-up then cosine decay of the learning rate, the
  same for all four arms (params.yaml).
- Drift is normalised by the decoded points' own canonical spread (the mean |u_i - u_j| of two different decoded
  points in one frame): the paper's raw drift rewards an output collapsed onto a few GT points; the raw value is
  kept as `raw_drift`. The premise `method_reconstructs_motion` asks the decoder to beat the first GT frame held
  still (`detail/static_chamfer`) on Chamfer against the moving target.
- The residual tokens are residual MLPs around the temporal mean (the spec writes G = MLP(mean),
  R_t = MLP(tokens_t - G)): a bare 3-layer MLP at PyTorch's default init passes little of its input, so the
  literal form gives the decoder latents that barely change from frame to frame, at init and still after the smoke
  training, and the penalty on R_t pushes the same way. This form starts near where no_decoupling starts
  (Z_t = tokens_t + MLP(mean) + MLP(d_t)); G still sees only what the frames share, R_t only frame t's departure
  from the temporal mean (not from G). Parameter count and compute are unchanged.
- Visibility uses the z-buffer only (the generator has no normals): a point is kept when it lies within 0.05 of the
  nearest depth in its pixel, so back faces vanish behind front faces.
- Occluded-region Chamfer is one-sided: the mean squared distance from each occluded GT point to the nearest
  decoded point (how well the hidden surface is completed).
- Scene-level sequences give each object's canonical coordinates its own offset, so drift across objects counts.
- DeformingThings4D: surface points are fixed (face, barycentric) samples of the mesh, their u the same
  barycentric mix of the first frame's vertices; the first `frames` frames of each file form one sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from models.common import sequences as seq
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, ScheduledParams
from models.inputs import input_path

MODELS = ("dynatok", "per_frame", "no_decoupling", "deterministic")
KEYS = {"dynatok": "method", "per_frame": "baseline/per_frame", "no_decoupling": "baseline/no_decoupling",
        "deterministic": "baseline/deterministic"}


class Params(ScheduledParams):
    dataset: Literal["synthetic", "dt4d"] = Field("synthetic", description="Articulated primitives or "
                                                                           "DeformingThings4D .anime files.")
    dt4d_dir: str = Field("", description="dt4d: folder searched recursively for .anime files.")
    n_sequences: int = Field(600, ge=4, description="synthetic: sequences generated.")
    scene_fraction: float = Field(0.25, ge=0.0, le=1.0, description="Share of scene-level sequences (2-3 objects).")
    limbs: tuple[int, int] = Field((2, 4), description="Limb count range (inclusive).")
    amplitude: float = Field(0.8, gt=0.0, description="Hinge angle amplitude (radians).")
    orbit_speed: float = Field(0.1, ge=0.0, description="Camera orbit speed (radians per frame).")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Random dropout of visible points.")
    noise: float = Field(0.005, ge=0.0, description="Std of the observation noise.")
    frames: int = Field(8, ge=2, description="T: frames per sequence.")
    n_dense: int = Field(2048, ge=64, description="Surface points per object before visibility.")
    n_in: int = Field(256, ge=8, description="N_in: observed points per frame.")
    n_complete: int = Field(512, ge=16, description="Complete GT points stored per frame (and decoded in eval).")
    test_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Held-out sequences.")
    tokens: int = Field(16, ge=1, description="M: latent tokens per frame.")
    width: int = Field(64, ge=8, description="Token width.")
    layers: int = Field(2, ge=1, description="Spatiotemporal encoder layers.")
    heads: int = Field(4, ge=1, description="Attention heads.")
    n_freq: int = Field(6, ge=1, description="Fourier frequencies per coordinate.")
    residual_weight: float = Field(0.01, ge=0.0, description="lambda: penalty on |R_t|^2.")
    steps: int = Field(150, ge=1, description="Training steps (all four models in lock-step).")
    batch_size: int = Field(4, ge=1, description="Sequences per step.")
    target_points: int = Field(256, ge=4, description="GT points per frame per training step.")
    lr: float = Field(1e-3, gt=0)
    euler_steps: int = Field(8, ge=1, description="Euler steps of flow sampling.")
    eval_sequences: int = Field(32, ge=1, description="Test sequences decoded.")
    occluded_radius: float = Field(0.02, gt=0.0, description="GT points farther than this from every input "
                                                            "point are occluded.")


# ---- data ------------------------------------------------------------------------------------------------------
def render_partial(rng: np.random.Generator, pts: np.ndarray, cam: np.ndarray, p: Params) -> np.ndarray:
    """Points (N, 3) seen from camera position `cam` looking at the origin: a 32x32 z-buffer over a 60-degree view,
    keeping points within 0.05 of their pixel's nearest depth; then dropout, noise, shuffle, resample to n_in."""
    fwd = -cam / np.linalg.norm(cam)
    right = np.cross(fwd, [0.0, 1.0, 0.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, fwd)
    rel = pts - cam
    depth = rel @ fwd
    u, v = (rel @ right) / depth, (rel @ up) / depth  # tan of the view angles
    px = np.clip(((u / np.tan(np.pi / 6) + 1) / 2 * 32).astype(int), 0, 31)
    py = np.clip(((v / np.tan(np.pi / 6) + 1) / 2 * 32).astype(int), 0, 31)
    pix = py * 32 + px
    nearest = np.full(32 * 32, np.inf)
    np.minimum.at(nearest, pix, depth)
    keep = depth <= nearest[pix] + 0.05
    keep &= rng.uniform(size=len(pts)) >= p.dropout
    seen = pts[keep] + rng.normal(0, p.noise, (int(keep.sum()), 3))
    return seen[rng.choice(len(seen), p.n_in, replace=len(seen) < p.n_in)]  # shuffled, N_in points


def synth_sequence(rng: np.random.Generator, p: Params, scene: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Dense surface points (T, N, 3), canonical coordinates (N, 3) and object count of one object, or 2-3 in a row."""
    parts = int(rng.integers(2, 4)) if scene else 1
    pts, canon = [], []
    for k in range(parts):
        x, u = seq.articulated_points(rng, p.frames, int(rng.integers(p.limbs[0], p.limbs[1] + 1)),
                                      p.n_dense // parts, p.amplitude)
        a = rng.uniform(0, 2 * np.pi)
        yaw = np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])  # random heading about y
        offset = np.array([1.3 * (k - (parts - 1) / 2), 0.0, rng.uniform(-0.3, 0.3)])
        pts.append(x @ yaw.T + offset)
        canon.append(u + np.array([4.0 * k, 0.0, 0.0]))  # each object's own region of canonical space
    return np.concatenate(pts, 1), np.concatenate(canon), parts


def read_anime(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """DeformingThings4D .anime: int32 nf, nv, nt; float32 vertices (nv, 3); int32 faces (nt, 3); float32 offsets
    (nf-1, nv, 3). Returns vertices of every frame (nf, nv, 3) and faces (nt, 3)."""
    with open(path, "rb") as f:
        nf, nv, nt = np.fromfile(f, dtype=np.int32, count=3)
        verts = np.fromfile(f, dtype=np.float32, count=nv * 3).reshape(nv, 3)
        faces = np.fromfile(f, dtype=np.int32, count=nt * 3).reshape(nt, 3)
        offsets = np.fromfile(f, dtype=np.float32, count=-1)
    if offsets.size != (nf - 1) * nv * 3:
        raise ValueError(f"{path}: {offsets.size} offset floats, expected (nf-1)*nv*3 = {(nf - 1) * nv * 3}")
    return np.concatenate([verts[None], verts[None] + offsets.reshape(nf - 1, nv, 3)]), faces


def anime_points(rng: np.random.Generator, verts: np.ndarray, faces: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """n fixed surface samples (area-weighted face, barycentric weights) over all frames: (T, n, 3), u (n, 3)."""
    tri = verts[0][faces]  # (F, 3, 3)
    area = np.linalg.norm(np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=-1)
    face = rng.choice(len(faces), n, p=area / area.sum())
    w = rng.dirichlet(np.ones(3), n)  # (n, 3)
    pts = np.einsum("nk,tnkd->tnd", w, verts[:, faces[face]])
    return pts, pts[0].copy()


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    if p.dataset == "synthetic":
        levels = np.where(rng.uniform(size=p.n_sequences) < p.scene_fraction, "scene", "object")
        sequences = [synth_sequence(rng, p, lv == "scene") for lv in levels]
    else:
        files = sorted(input_path(p.dt4d_dir).rglob("*.anime"))
        if not files:
            raise FileNotFoundError(f"no .anime files under {p.dt4d_dir!r}; set dt4d_dir to DeformingThings4D")
        sequences = []
        for f in files:
            verts, faces = read_anime(f)
            verts = verts[: p.frames]
            scale = np.ptp(verts[0], axis=0).max()  # unit-size objects, like the synthetic ones
            sequences.append((*anime_points(rng, verts / scale, faces, p.n_dense), 1))
        n_scenes = round(p.scene_fraction * len(sequences))  # the scene-level set: synthetic multi-object scenes
        sequences += [synth_sequence(rng, p, True) for _ in range(n_scenes)]
        levels = np.array(["object"] * len(files) + ["scene"] * n_scenes)
    n = len(sequences)
    is_test = np.zeros(n, bool)
    is_test[rng.permutation(n)[: max(1, round(p.test_fraction * n))]] = True
    partial, complete = [], []
    for x, u, _ in sequences:
        angle = rng.uniform(0, 2 * np.pi)
        obs = []
        for t in range(p.frames):
            a = angle + p.orbit_speed * t
            cam = np.array([3.0 * np.sin(a), 1.0, 3.0 * np.cos(a)]) + x[t].mean(0)
            obs.append(render_partial(rng, x[t] - x[t].mean(0), cam - x[t].mean(0), p) + x[t].mean(0))
        obs = np.stack(obs)  # (T, N_in, 3)
        centre = obs.reshape(-1, 3).mean(0)  # known at inference
        keep = rng.choice(x.shape[1], p.n_complete, replace=False)
        partial.append(obs - centre)
        complete.append(np.concatenate([x[:, keep] - centre, np.broadcast_to(u[keep], (p.frames, p.n_complete, 3))],
                                       -1))
    partial, complete = np.stack(partial), np.stack(complete)  # (S, T, N_in, 3), (S, T, N_c, 6)
    grid = lambda *shape: [a.reshape(-1) for a in np.meshgrid(*map(np.arange, shape), indexing="ij")]  # noqa: E731
    sid, frame, _ = grid(n, p.frames, p.n_in)
    write_table(out_dir / "partial.parquet", {"seq_id": sid, "frame": frame,
                                              **{a: partial[..., k].reshape(-1) for k, a in enumerate("xyz")}})
    sid, frame, _ = grid(n, p.frames, p.n_complete)
    write_table(out_dir / "complete.parquet", {"seq_id": sid, "frame": frame, **{
        a: complete[..., k].reshape(-1) for k, a in enumerate(("x", "y", "z", "u0", "u1", "u2"))}})
    write_table(out_dir / "meta.parquet", {"seq_id": np.arange(n), "level": levels,
                                           "n_parts": np.array([s[2] for s in sequences]),
                                           "split": np.where(is_test, "test", "train")})


def load_data(data_dir: Path) -> dict[str, torch.Tensor]:
    pt, ct, meta = (read_table(data_dir / f"{n}.parquet") for n in ("partial", "complete", "meta"))
    n, t = len(meta["seq_id"]), int(pt["frame"].max()) + 1
    o = np.lexsort((pt["frame"], pt["seq_id"]))  # stable: point order within a frame is kept
    partial = np.stack([pt[a][o] for a in "xyz"], -1).reshape(n, t, -1, 3)
    o = np.lexsort((ct["frame"], ct["seq_id"]))
    complete = np.stack([ct[a][o] for a in ("x", "y", "z", "u0", "u1", "u2")], -1).reshape(n, t, -1, 6)
    test = meta["split"][np.argsort(meta["seq_id"])] == "test"
    return {"partial": torch.from_numpy(partial.astype(np.float32)),  # (S, T, N_in, 3)
            "complete": torch.from_numpy(complete.astype(np.float32)),  # (S, T, N_c, 6): xyz, u
            "test": torch.from_numpy(test)}


# ---- networks --------------------------------------------------------------------------------------------------
def fourier(x: torch.Tensor, n_freq: int) -> torch.Tensor:
    """(..., 3) -> (..., 3 + 6 n_freq): xyz with sin/cos at octave frequencies."""
    f = x[..., None] * (2.0 ** torch.arange(n_freq, device=x.device) * np.pi)  # (..., 3, n_freq)
    return torch.cat([x, f.sin().flatten(-2), f.cos().flatten(-2)], -1)


def mlp(cin: int, w: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(cin, w), nn.GELU(), nn.Linear(w, w), nn.GELU(), nn.Linear(w, cout))


class Tokenizer(nn.Module):
    """A point set (B, N, 3) -> M tokens (B, M, w) by cross-attention from learned queries (permutation invariant)."""

    def __init__(self, p: Params):
        super().__init__()
        self.n_freq = p.n_freq
        self.point = mlp(3 + 6 * p.n_freq, p.width, p.width)
        self.queries = nn.Parameter(torch.randn(p.tokens, p.width) * 0.02)
        self.attn = nn.MultiheadAttention(p.width, p.heads, batch_first=True)
        self.out = mlp(p.width, p.width, p.width)

    def forward(self, pts: torch.Tensor) -> torch.Tensor:
        feat = self.point(fourier(pts, self.n_freq))  # (B, N, w)
        q = self.queries.expand(len(pts), -1, -1)  # (B, M, w)
        h = q + self.attn(q, feat, feat, need_weights=False)[0]
        return h + self.out(h)


class FlowDecoder(nn.Module):
    """v(p, s, Z_t): point and time features -> cross-attention to the frame latent Z_t -> MLP -> velocity (3)."""

    def __init__(self, p: Params):
        super().__init__()
        self.n_freq = p.n_freq
        self.inp = mlp(3 + 6 * p.n_freq + 16, p.width, p.width)
        self.attn = nn.MultiheadAttention(p.width, p.heads, batch_first=True)
        self.out = mlp(p.width, p.width, 3)

    def forward(self, x: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x (B, P, 3), s (B,), z (B, M, w) -> (B, P, 3)."""
        sf = fourier(s[:, None, None].expand(-1, x.shape[1], 1), 8)[..., 1:]  # (B, P, 16)
        h = self.inp(torch.cat([fourier(x, self.n_freq), sf], -1))  # (B, P, w)
        h = h + self.attn(h, z, z, need_weights=False)[0]
        return self.out(h)


class Folding(nn.Module):
    """PCN/FoldingNet-style deterministic decoder: a 2-D grid folded twice, conditioned on the pooled latent."""

    def __init__(self, p: Params):
        super().__init__()
        self.code = nn.Linear(p.width, p.width)
        self.fold1, self.fold2 = mlp(2 + p.width, p.width, 3), mlp(3 + p.width, p.width, 3)

    def forward(self, z: torch.Tensor, n: int) -> torch.Tensor:
        """z (B, M, w) -> n points (B, n, 3); point i is always grid cell i (its identity over time)."""
        side = int(np.sqrt(n))
        while n % side:
            side -= 1
        g = torch.stack(torch.meshgrid(torch.linspace(-1, 1, side), torch.linspace(-1, 1, n // side),
                                       indexing="ij"), -1).reshape(-1, 2).to(z)  # (n, 2)
        code = self.code(z.mean(1))[:, None].expand(-1, n, -1)  # (B, n, w)
        first = self.fold1(torch.cat([g.expand(len(z), -1, -1), code], -1))
        return first + self.fold2(torch.cat([first, code], -1))


class DynaTok(nn.Module):
    """Tokenizer -> spatiotemporal encoder -> frame latents Z_t -> decoder; `mode` picks the variant."""

    def __init__(self, p: Params, mode: str):
        super().__init__()
        self.mode = mode
        self.tok = Tokenizer(p)
        self.time = nn.Parameter(torch.randn(p.frames, 1, p.width) * 0.02)
        layer = nn.TransformerEncoderLayer(p.width, p.heads, 4 * p.width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.enc = nn.TransformerEncoder(layer, p.layers, enable_nested_tensor=False)
        if mode == "dynatok":
            self.geo, self.res = mlp(p.width, p.width, p.width), mlp(p.width, p.width, p.width)
        self.dec = Folding(p) if mode == "deterministic" else FlowDecoder(p)

    def encode(self, partial: torch.Tensor) -> torch.Tensor:
        """(B, T, N, 3) -> encoder tokens (B, T, M, w); per_frame attends within each frame only."""
        b, t = partial.shape[:2]
        h = self.tok(partial.flatten(0, 1)).unflatten(0, (b, t)) + self.time[:t]  # (B, T, M, w)
        m = h.shape[2]
        if self.mode == "per_frame":
            return self.enc(h.flatten(0, 1)).unflatten(0, (b, t))
        return self.enc(h.flatten(1, 2)).unflatten(1, (t, m))

    def latents(self, partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Frame latents Z (B, T, M, w) and motion residuals R (zero where there is no decoupling)."""
        e = self.encode(partial)
        if self.mode != "dynatok":
            return e, torch.zeros_like(e)
        mean = e.mean(1, keepdim=True)  # (B, 1, M, w): what the frames share
        g = mean + self.geo(mean)  # (B, 1, M, w): geometry tokens, shared by every frame
        r = (e - mean) + self.res(e - mean)  # (B, T, M, w): motion residual tokens, frame t's departure only
        return g + r, r


def flow_loss(model: DynaTok, partial: torch.Tensor, target: torch.Tensor, lam: float) -> torch.Tensor:
    """Rectified flow on GT points y (B, T, P, 3): p_s = (1-s) eps + s y, regress y - eps; + lambda |R|^2. The
    deterministic variant instead minimises the Chamfer-L2 of its folded points."""
    z, r = model.latents(partial)
    zf, y = z.flatten(0, 1), target.flatten(0, 1)  # (BT, M, w), (BT, P, 3)
    if model.mode == "deterministic":
        return chamfer_terms(model.dec(zf, y.shape[1]), y).sum(-1).mean()
    eps = torch.randn_like(y)
    s = torch.rand(len(y), device=y.device)  # (BT,)
    ps = (1 - s[:, None, None]) * eps + s[:, None, None] * y
    return F.mse_loss(model.dec(ps, s, zf), y - eps) + lam * r.pow(2).mean()


@torch.no_grad()
def sample(model: DynaTok, partial: torch.Tensor, n: int, steps: int, gen: torch.Generator) -> torch.Tensor:
    """Decoded points (B, T, n, 3): Euler integration of the flow from one eps per sequence shared by all frames,
    so point i keeps an identity over time (the folding decoder's identity is its grid index)."""
    b, t = partial.shape[:2]
    z = model.latents(partial)[0].flatten(0, 1)  # (BT, M, w)
    if model.mode == "deterministic":
        return model.dec(z, n).unflatten(0, (b, t))
    x = torch.randn(b, 1, n, 3, generator=gen).expand(-1, t, -1, -1).flatten(0, 1).clone()  # (BT, n, 3)
    for k in range(steps):
        s = torch.full((len(x),), k / steps)
        x = x + model.dec(x, s, z) / steps
    return x.unflatten(0, (b, t))


class Models(nn.Module):
    """The method and the three baselines, trained in lock-step (summed losses)."""

    def __init__(self, p: Params):
        super().__init__()
        self.nets = nn.ModuleDict({m: DynaTok(p, m) for m in MODELS})
        self.lam = p.residual_weight

    def forward(self, partial: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {m: flow_loss(net, partial, target, self.lam) for m, net in self.nets.items()}


def train(ctx) -> None:
    p: Params = ctx.params
    d = load_data(ctx.data_dir)
    tr = torch.nonzero(~d["test"]).flatten()

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(p.seed * 100_003 + step)
        i = tr[torch.randint(len(tr), (p.batch_size,), generator=g)]
        j = torch.randint(d["complete"].shape[2], (p.target_points,), generator=g)
        return {"partial": d["partial"][i], "target": d["complete"][i][:, :, j, :3]}

    def step_fn(engine, b, step):
        losses = engine(b["partial"], b["target"])
        return sum(losses.values()), {k: float(v.detach()) for k, v in losses.items()}

    model = Models(p)
    ctx.progress(f"phase joint: DynaTok + 3 baselines in lock-step, {p.steps} steps of {p.batch_size} sequences")
    engine = ctx.engine(model, p.lr, arms=model.nets, steps=p.steps, warmup=p.warmup, decay=p.decay)  # all alike
    ctx.fit("joint", engine, step_fn, batch_fn, p.steps)


# ---- evaluation --------------------------------------------------------------------------------------------------
def chamfer_terms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., P, 3), (..., Q, 3) -> (..., 2): mean squared distance a -> b and b -> a."""
    dist = torch.cdist(a, b).pow(2)  # (..., P, Q)
    return torch.stack([dist.min(-1).values.mean(-1), dist.min(-2).values.mean(-1)], -1)


def frame_metrics(pred: torch.Tensor, gt: torch.Tensor, seen: torch.Tensor, radius: float) -> dict[str, float]:
    """pred (F, P, 3), gt (F, Q, 3), seen (F, N, 3) -> Chamfer-L2, F-score at 1% of the diagonal, occluded Chamfer."""
    return metrics_from(torch.cdist(pred, gt), gt, occluded_mask(gt, seen, radius))


def occluded_mask(gt: torch.Tensor, seen: torch.Tensor, radius: float) -> torch.Tensor:
    """(F, Q): GT points farther than `radius` from every observed point (the same for every decoder)."""
    return torch.cdist(gt, seen).min(-1).values > radius


def metrics_from(dist: torch.Tensor, gt: torch.Tensor, occluded: torch.Tensor) -> dict[str, float]:
    """Chamfer-L2, F-score and occluded Chamfer from the decoded-to-GT distances dist (F, P, Q), computed once."""
    to_gt, to_pred = dist.min(-1).values, dist.min(-2).values  # (F, P), (F, Q)
    tau = 0.01 * (gt.amax(1) - gt.amin(1)).norm(dim=-1)[:, None]  # (F, 1)
    precision = (to_gt < tau).float().mean(-1)
    recall = (to_pred < tau).float().mean(-1)
    fscore = 2 * precision * recall / (precision + recall).clamp(min=1e-9)
    occ = (to_pred.pow(2) * occluded).sum() / occluded.sum().clamp(min=1)
    # the minimum of squared distances is the square of the minimum: chamfer_terms(pred, gt) bit for bit
    chamfer = torch.stack([to_gt.pow(2).mean(-1), to_pred.pow(2).mean(-1)], -1).sum(-1).mean()
    return {"chamfer": float(chamfer), "fscore": float(fscore.mean()), "occluded_chamfer": float(occ)}


def drift(pred: torch.Tensor, gt: torch.Tensor, u: torch.Tensor, normalise: bool = True) -> float:
    """Correspondence drift of decoded points pred (T, P, 3) against GT points gt (T, Q, 3) with canonical
    coordinates u (T, Q, 3): each decoded point reads the canonical coordinate of its nearest GT point; raw drift is
    the mean over points and frames of |u_i^t - u_i^{t+1}|. Normalised (the default), it is divided by the mean
    |u_i^t - u_j^t| between two different decoded points of the same frame (j = i + P/2): a random re-assignment
    scores about 1, a perfect tracker 0, and an output collapsed onto a few GT points (a static blob, whose raw drift
    is small because its points all read nearly the same u) scores high, so collapse cannot win the metric."""
    return drifts_from(torch.cdist(pred, gt), u)["drift" if normalise else "raw_drift"]


def drifts_from(dist: torch.Tensor, u: torch.Tensor) -> dict[str, float]:
    """Normalised and raw drift (see `drift`) from the decoded-to-GT distances dist (T, P, Q)."""
    nn_idx = dist.argmin(-1)  # (T, P)
    uu = torch.gather(u, 1, nn_idx[..., None].expand(-1, -1, 3))  # (T, P, 3)
    moved = (uu[1:] - uu[:-1]).norm(dim=-1).mean()
    spread = (uu - uu.roll(dist.shape[1] // 2, dims=1)).norm(dim=-1).mean()  # pairs of distinct points
    return {"drift": float(moved / spread.clamp(min=1e-3)), "raw_drift": float(moved)}


def sequence_metrics(pred: torch.Tensor, gt: torch.Tensor, u: torch.Tensor, occluded: torch.Tensor
                     ) -> dict[str, float]:
    """Every reconstruction metric of one decoded sequence pred (T, P, 3) from one distance matrix to the GT: what
    `frame_metrics` and `drift` (normalised and raw) return, each of which would compute it again."""
    dist = torch.cdist(pred, gt)  # (T, P, Q)
    return metrics_from(dist, gt, occluded) | drifts_from(dist, u)


@torch.no_grad()
def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    d = load_data(ctx.data_dir)
    model = ctx.network("joint")
    te = torch.nonzero(d["test"]).flatten()[: p.eval_sequences]
    partial, complete = d["partial"][te], d["complete"][te]
    occluded = [occluded_mask(complete[k, ..., :3], partial[k], p.occluded_radius) for k in range(len(te))]
    per: dict[str, list[float]] = {}
    decoded = {}
    for name, net in model.nets.items():
        pred = sample(net, partial, p.n_complete, p.euler_steps, torch.Generator().manual_seed(p.seed))
        decoded[name] = pred[0]
        for k in range(len(te)):
            m = sequence_metrics(pred[k], complete[k, ..., :3], complete[k, ..., 3:], occluded[k])
            for key, value in m.items():
                per.setdefault(f"{KEYS[name]}/{key}", []).append(value)
    metrics = {k: float(np.mean(v)) for k, v in per.items()}
    metrics |= {f"detail/params_{name}": float(sum(w.numel() for w in net.parameters()))
                for name, net in model.nets.items()}  # the arms' sizes differ (the claim's note)
    # the motion bar: the first GT frame held still against the moving target (what a static output at best scores)
    metrics["detail/static_chamfer"] = float(np.mean([
        chamfer_terms(complete[k, :1, :, :3].expand(p.frames, -1, -1), complete[k, ..., :3]).sum(-1).mean()
        for k in range(len(te))]))
    # a collapsed output (every point near the first frame's centroid, held still) must not win drift
    blob = torch.randn(p.n_complete, 3, generator=torch.Generator().manual_seed(1)) * 0.02
    metrics["detail/static_blob_drift"] = float(np.mean([
        drift((complete[k, :1, :, :3].mean(1, keepdim=True) + blob).expand(p.frames, -1, -1), complete[k, ..., :3],
              complete[k, ..., 3:]) for k in range(len(te))]))
    # drift of a perfect tracker (GT points in their own order) is 0; of a random re-assignment, this:
    shuffled = complete[:, :, torch.randperm(complete.shape[2], generator=torch.Generator().manual_seed(0))]
    metrics["detail/random_order_drift"] = float(np.mean([
        drift(torch.stack([shuffled[k, t, :, :3] if t % 2 else complete[k, t, :, :3] for t in range(p.frames)]),
              complete[k, ..., :3], complete[k, ..., 3:]) for k in range(len(te))]))
    _plots(ctx.plots_dir, partial[0], complete[0], decoded, metrics)
    return metrics


def _plots(plots: Path, partial: torch.Tensor, complete: torch.Tensor, decoded: dict, metrics: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = [0, partial.shape[0] // 2, partial.shape[0] - 1]
    rows = {"input (partial)": partial, "ground truth": complete[..., :3], **decoded}
    fig, axes = plt.subplots(len(rows), len(frames), figsize=(2.4 * len(frames), 2.2 * len(rows)))
    colour = decoded["dynatok"][0, :, 0]  # colour points by their first-frame x: identity kept over time
    for r, (name, pts) in enumerate(rows.items()):
        for c, t in enumerate(frames):
            ax = axes[r, c]
            kw = {"c": colour, "cmap": "viridis"} if name in decoded and pts.shape[1] == len(colour) else {}
            ax.scatter(pts[t, :, 0], pts[t, :, 1], s=1, **kw)
            lo, hi = complete[t, :, :2].amin(0) - 0.3, complete[t, :, :2].amax(0) + 0.3  # the GT's frame
            ax.set(xticks=[], yticks=[], xlim=(float(lo[0]), float(hi[0])), ylim=(float(lo[1]), float(hi[1])))
            if c == 0:
                ax.set_ylabel(name, fontsize=8)
            if r == 0:
                ax.set_title(f"frame {t}", fontsize=8)
    fig.tight_layout()
    fig.savefig(plots / "reconstructions.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, metric in zip(axes, ("chamfer", "occluded_chamfer", "drift"), strict=True):
        ax.bar(list(KEYS), [metrics[f"{KEYS[m]}/{metric}"] for m in KEYS], color="tab:blue")
        ax.set_title(metric)
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(plots / "metrics.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="dynatok",
    title="DynaTok: correspondence-free 4D reconstruction from partial point cloud sequences",
    seed="000_2dd18ae8605fb5c1.txt, abstract 6",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/chamfer", "min"),
    claim=Claim(premises=(  # the decoder follows the motion: closer to the moving target than a still first frame
        Compare("method/chamfer", "<", "detail/static_chamfer", name="method_reconstructs_motion"),
    ), all_of=(
        Compare("method/chamfer", "<", ("baseline/per_frame/chamfer", "baseline/no_decoupling/chamfer")),
        Compare("method/drift", "<", ("baseline/per_frame/drift", "baseline/no_decoupling/drift",
                                      "baseline/deterministic/drift")),
    ), note="DynaTok has more parameters than the flow baselines (its geometry and residual MLPs) and the "
            "deterministic baseline fewer (a folding decoder), logged as detail/params_<model>; every arm trains "
            "the same steps, batches and schedule; smoke is object level only",
       summary="DynaTok's Chamfer beats per-frame and no-decoupling, and its drift (normalised by the decoded "
               "points' own canonical spread, so a collapsed output cannot win it) beats every baseline"),
)
