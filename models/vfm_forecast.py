"""Generative forecasting of vision-foundation-model (VFM) features in a compact, diffusion-ready latent space.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 7. Spec: ../shared/papers/vfm_forecast.md.

What it implements (function names in brackets):
- data: 32x32 videos of one or two load_digits sprites on a texture, bouncing off the walls and turning to a random
  diagonal heading with probability p_turn per frame (so a short context has several futures), with per-pixel
  labels (10 digits + background) [prepare, via models.common.sequences];
- the VFM stand-in: a ViT (patch 8 -> 16 tokens x 64) trained by masked-patch reconstruction, then frozen [VFM];
  a linear per-token segmentation probe on its features, the "actionable" decoder, trained in its own phase
  [Probe, seg_target];
- the method's latent: a feature autoencoder (per-token MLP 64 -> 8, decoder with a token-mixing transformer layer)
  trained with MSE + beta KL, latents standardised to unit variance [FeatureAE, ae_loss];
- PCA compression to the same size per token (sklearn) [fit_spaces];
- forecasters with one backbone (context frames' tokens prepended, variable context 1-3): regression (MSE) on raw
  features, and rectified flow matching in raw, PCA and AE spaces [Forecaster, Forecasters, flow_matching_loss],
  sampled with Euler steps and rolled out autoregressively to horizon H [sample, rollout];
- metrics: future-segmentation mIoU through the frozen probe (mean over K samples and best-of-K), Frechet distance of
  mean-pooled features, information preservation (probe mIoU and MSE after AE vs PCA reconstruction), and the
  averaging diagnostic (forecast variance / real variance) [evaluate, miou, frechet_distance].

Deviations from the paper (choices the spec or abstract left open):
- The VFM is a tiny masked-patch (SimMIM-style: learned mask token, pixel loss on masked patches) ViT on synthetic
  sprites, not DINOv2; the full profile keeps this stand-in at larger width because no DINOv2 weights are installed
  here.
- Raw features are standardised per dimension before every use (probe, PCA, AE, forecasting): a common rescaling
  that changes no information and keeps flow matching in raw space numerically comparable.
- The probe segments sprite vs background by default (`seg_labels: foreground`): a linear probe on the stand-in
  VFM's 8x8-patch tokens reads the digit classes too poorly for forecast mIoU to mean anything; `digits` keeps the
  10 digit classes + background. The premise `probe_reads_true_features` asks the probe on true features for a
  stated mIoU (ORACLE_BAR).
- Premise `pca_compression_lossy`: PCA's reconstruction keeps at most the oracle's probe mIoU minus LOSSY_BAR. With
  a sprite-vs-background probe a per-token PCA that loses nothing the probe reads leaves AE and PCA latents nothing
  to differ on (mIoU, FD and reconstruction mIoU parts); the smoke latent is sized so that compression is lossy.
- The forecasters share one engine, so one schedule (linear warm-up over `forecast_warmup` of the steps, then
  cosine decay) trains all four alike.
- FD uses the mean-pooled features of all test frames as the real distribution (a few contexts alone give a singular
  64-d covariance); every model is compared against the same reference.
- The image-generation application (unconditional flow matching decoded to pixels) is not implemented yet; the spec
  runs it in the full profile only. No Cityscapes/DINOv2 loader yet either: full runs the synthetic world at scale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from pydantic import Field
from scipy import linalg
from sklearn.decomposition import PCA
from torch import nn

from models.common import sequences as seq
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams

N_CLASSES = 11  # 10 digits + background
BACKGROUND = 10
FORECASTERS = ("regression", "fm_raw", "fm_pca", "fm_ae")
ORACLE_BAR = 0.7  # premise: the probe's mIoU on the true (not forecast) features of test frames
LOSSY_BAR = 0.02  # premise: PCA reconstruction loses at least this much of the probe's mIoU on true features


class Params(PaperParams):
    n_videos: int = Field(1000, ge=4, description="Videos rendered by prepare.")
    n_frames: int = Field(16, ge=6, description="Frames per video.")
    size: int = Field(32, ge=16, description="Frame side in pixels (a multiple of patch).")
    sprite_size: int = Field(12, ge=4, description="Digit sprite side (8x8 load_digits resampled).")
    max_sprites: int = Field(2, ge=1, le=3, description="Sprites per video: 1..max_sprites.")
    p_turn: float = Field(0.2, ge=0.0, le=1.0, description="Per-frame probability of turning to a random heading.")
    speed_min: int = Field(1, ge=1, description="Slowest speed, px per frame per axis.")
    speed_max: int = Field(3, ge=1, description="Fastest speed, px per frame per axis.")
    texture: str = Field("stripes", pattern="^(stripes|checker|noise)$", description="Background texture kind.")
    texture_amplitude: float = Field(0.3, ge=0.0, le=1.0, description="Background intensity range.")
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Held-out videos.")
    patch: int = Field(8, ge=2, description="ViT patch side.")
    vfm_dim: int = Field(64, ge=8, description="VFM token width (feature dimension per token).")
    vfm_layers: int = Field(2, ge=1, description="VFM transformer layers.")
    mask_ratio: float = Field(0.5, gt=0.0, lt=1.0, description="Masked-patch fraction of the VFM pretext task.")
    latent_dim: int = Field(8, ge=1, description="Per-token size of the AE and PCA latents.")
    kl_beta: float = Field(1e-4, ge=0.0, description="KL weight of the feature autoencoder.")
    width: int = Field(64, ge=8, description="Forecaster transformer width.")
    layers: int = Field(2, ge=1, description="Forecaster transformer layers.")
    max_context: int = Field(3, ge=1, description="Context frames: 1..max_context, drawn per example.")
    vfm_steps: int = Field(200, ge=1, description="Training steps of the VFM stand-in.")
    ae_steps: int = Field(200, ge=1, description="Training steps of the feature autoencoder.")
    probe_steps: int = Field(1000, ge=1, description="Training steps of the linear segmentation probe (own phase).")
    probe_lr: float = Field(3e-3, gt=0, description="AdamW learning rate of the probe.")
    seg_labels: Literal["digits", "foreground"] = Field(
        "foreground", description="What the probe segments: the 10 digit classes + background, or sprite vs "
                                  "background (where a linear probe on the stand-in VFM's tokens reads the truth).")
    forecast_steps: int = Field(200, ge=1, description="Training steps of the four forecasters (lock-step).")
    forecast_warmup: float = Field(0.0, ge=0.0, lt=1.0, description="Share of the forecasters' steps spent in a "
                                   "linear warm-up, followed by cosine decay (0: constant rate); one schedule for "
                                   "all four forecasters, which share one engine.")
    batch_size: int = Field(32, ge=2, description="Examples per step (frames or contexts).")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of every network.")
    test_contexts: int = Field(32, ge=1, description="Test contexts rolled out at evaluation.")
    samples: int = Field(4, ge=1, description="K samples per context of each generative forecaster.")
    euler_steps: int = Field(10, ge=1, description="Euler steps of the flow-matching samplers.")
    horizon: int = Field(4, ge=1, description="Autoregressive rollout horizon H.")
    recon_frames: int = Field(512, ge=4, description="Test frames used for the information-preservation metrics.")


# ---- data ----------------------------------------------------------------------------------------------------
def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    sprites, digit_labels = seq.digit_sprites(p.sprite_size)
    speed = (p.speed_min, max(p.speed_min, p.speed_max))
    frames, masks, meta = {"video_id": [], "t": [], "pixels": []}, {"video_id": [], "t": [], "mask": []}, \
        {"video_id": [], "digits": [], "turn_times": [], "split": []}
    test = set(rng.permutation(p.n_videos)[: max(1, round(p.test_fraction * p.n_videos))].tolist())
    for v in range(p.n_videos):
        bg = seq.background_texture(rng, p.size, p.texture, p.texture_amplitude)
        k = int(rng.integers(1, p.max_sprites + 1))
        chosen = rng.integers(0, len(sprites), size=k)
        walks = [seq.sprite_walk(rng, p.n_frames, p.size, p.sprite_size, speed, p.p_turn) for _ in range(k)]
        for t in range(p.n_frames):
            frame, mask = seq.render_sprites(bg, [sprites[i] for i in chosen], [w[0][t] for w in walks],
                                             labels=[int(digit_labels[i]) for i in chosen], background_label=BACKGROUND)
            frames["video_id"].append(v), frames["t"].append(t), masks["video_id"].append(v), masks["t"].append(t)
            frames["pixels"].append(np.round(frame * 255).astype(np.uint8).reshape(-1))
            masks["mask"].append(mask.astype(np.uint8).reshape(-1))
        turn_times = sorted({int(t) for w in walks for t in np.flatnonzero(w[2])})
        meta["video_id"].append(v)
        meta["digits"].append(",".join(str(int(digit_labels[i])) for i in chosen))
        meta["turn_times"].append(",".join(map(str, turn_times)))
        meta["split"].append("test" if v in test else "train")
    write_table(out_dir / "frames.parquet", {**frames, "pixels": np.stack(frames["pixels"])})
    write_table(out_dir / "labels.parquet", {**masks, "mask": np.stack(masks["mask"])})
    write_table(out_dir / "meta.parquet", meta)


def load_videos(data_dir: Path) -> dict[str, torch.Tensor]:
    """(V, T, S, S) pixels in [0, 1], (V, T, S, S) labels, (V,) is_test; rows ordered by (video_id, t)."""
    f, lab, meta = (read_table(data_dir / n) for n in ("frames.parquet", "labels.parquet", "meta.parquet"))
    v, t = int(f["video_id"].max()) + 1, int(f["t"].max()) + 1
    side = int(round(np.sqrt(f["pixels"].shape[1])))
    order = np.lexsort((f["t"], f["video_id"]))
    pixels = torch.from_numpy(f["pixels"][order].astype(np.float32) / 255).view(v, t, side, side)
    order = np.lexsort((lab["t"], lab["video_id"]))
    labels = torch.from_numpy(lab["mask"][order].astype(np.int64)).view(v, t, side, side)
    is_test = torch.from_numpy(meta["split"][np.argsort(meta["video_id"])] == "test")
    return {"pixels": pixels, "labels": labels, "is_test": is_test}


# ---- networks ------------------------------------------------------------------------------------------------
def _encoder(width: int, layers: int) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class VFM(nn.Module):
    """ViT stand-in: patches -> tokens; pretext = reconstruct masked patches' pixels; features = encoder output."""

    def __init__(self, size: int, patch: int, dim: int, layers: int):
        super().__init__()
        self.patch, self.tokens = patch, (size // patch) ** 2
        self.embed = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(self.tokens, dim))
        self.mask_token = nn.Parameter(torch.zeros(dim))
        self.body = _encoder(dim, layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, patch * patch)

    def patches(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, S) -> (B, N, p*p)
        return rearrange(x, "b (h p1) (w p2) -> b (h w) (p1 p2)", p1=self.patch, p2=self.patch)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(self.patches(x))  # (B, N, D)
        if mask is not None:  # (B, N) True = hidden
            h = torch.where(mask[..., None], self.mask_token, h)
        return self.norm(self.body(h + self.pos))  # (B, N, D)

    def pretext_loss(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        recon = self.head(self(x, mask))  # (B, N, p*p)
        err = ((recon - self.patches(x)) ** 2).mean(-1)  # (B, N)
        return (err * mask).sum() / mask.sum().clamp(min=1)


class Probe(nn.Module):
    """Linear per-token segmentation probe: a token's feature -> logits for each pixel of its patch."""

    def __init__(self, dim: int, patch: int, size: int):
        super().__init__()
        self.patch, self.size = patch, size
        self.linear = nn.Linear(dim, patch * patch * N_CLASSES)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, C, S, S)
        logits = self.linear(feats).unflatten(-1, (self.patch * self.patch, N_CLASSES))  # (B, N, p*p, C)
        g = self.size // self.patch
        return rearrange(logits, "b (h w) (p1 p2) c -> b c (h p1) (w p2)", h=g, w=g, p1=self.patch)


class FeatureAE(nn.Module):
    """Per-token MLP encoder D -> (mu, logvar) in R^k; decoder k -> D with one token-mixing transformer layer."""

    def __init__(self, dim: int, latent: int, tokens: int):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, 2 * latent))
        self.dec_in = nn.Linear(latent, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens, dim))
        self.mix = _encoder(dim, 1)
        self.dec_out = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def encode(self, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, N, D) -> 2 x (B, N, k)
        mu, logvar = self.enc(f).chunk(2, -1)
        return mu, logvar.clamp(-10, 5)

    def decode(self, z: torch.Tensor) -> torch.Tensor:  # (B, N, k) -> (B, N, D)
        return self.dec_out(self.mix(self.dec_in(z) + self.pos))


def ae_loss(ae: FeatureAE, f: torch.Tensor, beta: float) -> torch.Tensor:
    """MSE reconstruction + beta * KL(q(z|f) || N(0, I)), KL summed over latent dims, averaged over tokens."""
    mu, logvar = ae.encode(f)
    z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
    kl = 0.5 * (mu**2 + logvar.exp() - 1 - logvar).sum(-1).mean()
    return F.mse_loss(ae.decode(z), f) + beta * kl


class Forecaster(nn.Module):
    """One backbone for every forecaster: context tokens (B, C, N, D), left-padded, then N target tokens.

    Regression: the target tokens are learned queries. Flow matching: they are x_t plus a time embedding, and the
    output is the velocity. Padding frames are hidden from attention by a key-padding mask."""

    def __init__(self, dim: int, width: int, layers: int, tokens: int, max_context: int, generative: bool):
        super().__init__()
        self.generative = generative
        self.inp = nn.Linear(dim, width)
        self.tok = nn.Parameter(0.02 * torch.randn(tokens, width))
        self.frame = nn.Parameter(0.02 * torch.randn(max_context + 1, width))
        if generative:
            self.time = nn.Sequential(nn.Linear(1, width), nn.SiLU(), nn.Linear(width, width))
        else:
            self.query = nn.Parameter(torch.zeros(tokens, width))
        self.body = _encoder(width, layers)
        self.out = nn.Linear(width, dim)

    def forward(self, ctx: torch.Tensor, valid: torch.Tensor, x_t: torch.Tensor | None = None,
                t: torch.Tensor | None = None) -> torch.Tensor:
        b, c, n, _ = ctx.shape
        h_ctx = self.inp(ctx) + self.tok + self.frame[:c, None]  # (B, C, N, W)
        if self.generative:
            h_tgt = self.inp(x_t) + self.tok + self.frame[c] + self.time(t[:, None])[:, None]  # (B, N, W)
        else:
            h_tgt = (self.query + self.tok + self.frame[c]).expand(b, n, -1)  # (B, N, W)
        pad = torch.cat([(~valid).repeat_interleave(n, 1), torch.zeros(b, n, dtype=torch.bool, device=ctx.device)], 1)
        h = self.body(torch.cat([h_ctx.flatten(1, 2), h_tgt], 1), src_key_padding_mask=pad)  # (B, C*N + N, W)
        return self.out(h[:, c * n :])  # (B, N, D)


def flow_matching_loss(net: Forecaster, ctx: torch.Tensor, valid: torch.Tensor, x1: torch.Tensor,
                       x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Rectified flow: x_t = t x1 + (1 - t) x0, regress the velocity x1 - x0."""
    x_t = t[:, None, None] * x1 + (1 - t[:, None, None]) * x0  # (B, N, D)
    return F.mse_loss(net(ctx, valid, x_t, t), x1 - x0)


@torch.no_grad()
def sample(net: Forecaster, ctx: torch.Tensor, valid: torch.Tensor, noise: torch.Tensor, steps: int) -> torch.Tensor:
    """Euler integration of the learned velocity from t = 0 (noise) to t = 1."""
    x, dt = noise, 1.0 / steps
    for i in range(steps):
        t = torch.full((x.shape[0],), i * dt)
        x = x + dt * net(ctx, valid, x, t)
    return x


class Forecasters(nn.Module):
    """The four forecasters, trained in lock-step (summed losses; AdamW keeps them independent)."""

    def __init__(self, p: Params, tokens: int):
        super().__init__()
        dims = {"regression": p.vfm_dim, "fm_raw": p.vfm_dim, "fm_pca": p.latent_dim, "fm_ae": p.latent_dim}
        self.nets = nn.ModuleDict({name: Forecaster(dims[name], p.width, p.layers, tokens, p.max_context,
                                                    name != "regression") for name in FORECASTERS})

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        losses = {"regression": F.mse_loss(self.nets["regression"](batch["ctx_raw"], batch["valid"]), batch["y_raw"])}
        for i, (name, space) in enumerate((("fm_raw", "raw"), ("fm_pca", "pca"), ("fm_ae", "ae"))):
            y = batch[f"y_{space}"]
            noise = batch[f"noise_{space}"]
            losses[name] = flow_matching_loss(self.nets[name], batch[f"ctx_{space}"], batch["valid"], y, noise,
                                              batch["t"][:, i])
        return losses


# ---- feature spaces ------------------------------------------------------------------------------------------
@torch.no_grad()
def vfm_features(vfm: VFM, pixels: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """(V, T, S, S) -> (V, T, N, D) frozen features."""
    flat = pixels.flatten(0, 1)
    out = torch.cat([vfm(flat[i : i + chunk]) for i in range(0, len(flat), chunk)])
    return out.view(*pixels.shape[:2], *out.shape[1:])


def fit_spaces(raw: torch.Tensor, is_train: torch.Tensor, ae: FeatureAE, k: int) -> dict:
    """Standardisation of raw features, per-token PCA to k dims, and AE latent statistics, all from train videos."""
    d = raw.shape[-1]
    train = raw[is_train].reshape(-1, d)  # (tokens, D)
    mean, std = train.mean(0), train.std(0) + 1e-6
    z_train = ((train - mean) / std).numpy()
    pca = PCA(k, svd_solver="full").fit(z_train)
    pca_z = pca.transform(z_train)
    with torch.no_grad():
        mu, _ = ae.encode(torch.from_numpy(z_train))
    return {"mean": mean, "std": std, "pca": pca, "pca_std": torch.from_numpy(pca_z.std(0) + 1e-6).float(),
            "ae_mean": mu.mean(0), "ae_std": mu.std(0) + 1e-6}


def to_space(space: str, z: torch.Tensor, s: dict, ae: FeatureAE) -> torch.Tensor:
    """Standardised raw features (..., N, D) -> the space's standardised coordinates."""
    if space == "raw":
        return z
    shape = z.shape[:-1]
    if space == "pca":
        lat = torch.from_numpy(s["pca"].transform(z.reshape(-1, z.shape[-1]).numpy())).float()
        return (lat / s["pca_std"]).view(*shape, -1)
    with torch.no_grad():
        mu, _ = ae.encode(z)
    return (mu - s["ae_mean"]) / s["ae_std"]


def from_space(space: str, x: torch.Tensor, s: dict, ae: FeatureAE) -> torch.Tensor:
    """Inverse of to_space: back to standardised raw features (..., N, D)."""
    if space == "raw":
        return x
    if space == "pca":
        flat = (x * s["pca_std"]).reshape(-1, x.shape[-1]).numpy()
        return torch.from_numpy(s["pca"].inverse_transform(flat)).float().view(*x.shape[:-1], -1)
    with torch.no_grad():  # the decoder mixes tokens: flatten leading dims to (M, N, k)
        return ae.decode((x * s["ae_std"] + s["ae_mean"]).flatten(0, -3)).view(*x.shape[:-1], -1)


# ---- training: VFM -> (probe, AE) -> forecasters, each phase one engine ------------------------------------------
class ProbeAndAE(nn.Module):
    """Probe and autoencoder on frozen, standardised VFM features (each trained in its own phase)."""

    def __init__(self, p: Params, tokens: int):
        super().__init__()
        self.probe = Probe(p.vfm_dim, p.patch, p.size)
        self.ae = FeatureAE(p.vfm_dim, p.latent_dim, tokens)


class _AELoss(nn.Module):
    def __init__(self, ae: FeatureAE, beta: float):
        super().__init__()
        self.ae, self.beta = ae, beta

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return ae_loss(self.ae, f, self.beta)


class _ProbeLoss(nn.Module):
    def __init__(self, probe: Probe):
        super().__init__()
        self.probe = probe

    def forward(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.probe(f), y)


def seg_target(labels: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-pixel labels (..., S, S) in 0..10 -> the probe's classes: unchanged (digits), or 1 on a sprite and 0 on
    the background (foreground)."""
    return labels if kind == "digits" else (labels != BACKGROUND).long()


def context_indices(vid: torch.Tensor, clen: torch.Tensor, start: torch.Tensor, max_context: int):
    """Left-padded context window: frame indices (B, C) and validity (B, C) for contexts [start, start + clen)."""
    idx = (start + clen)[:, None] - max_context + torch.arange(max_context)  # (B, C)
    return vid[:, None].expand_as(idx), idx.clamp(min=0), idx >= start[:, None]


def _phase_seed(seed: int, phase: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + phase * 10_007 + step)


def train(ctx) -> None:
    p: Params = ctx.params
    d = load_videos(ctx.data_dir)
    v, t_len = d["pixels"].shape[:2]
    train_ids = torch.nonzero(~d["is_test"]).flatten()
    vfm = VFM(p.size, p.patch, p.vfm_dim, p.vfm_layers)
    n_tok = vfm.tokens
    frames = d["pixels"][train_ids].flatten(0, 1)  # (Ntr*T, S, S)

    def vfm_batch(step: int) -> dict[str, torch.Tensor]:
        g = _phase_seed(p.seed, 1, step)
        idx = torch.randint(len(frames), (p.batch_size,), generator=g)
        mask = torch.rand(p.batch_size, n_tok, generator=g).argsort(1) < round(p.mask_ratio * n_tok)  # (B, N)
        return {"x": frames[idx], "mask": mask}

    ctx.progress(f"phase vfm: masked-patch ViT, {p.vfm_steps} steps")
    ctx.fit("vfm", ctx.engine(vfm, p.lr), lambda eng, b, s: (eng.module.pretext_loss(b["x"], b["mask"]), {}),
            vfm_batch, p.vfm_steps)
    vfm.eval()
    raw = vfm_features(vfm, d["pixels"])  # (V, T, N, D), frozen from here on
    mean, std = raw[train_ids].reshape(-1, p.vfm_dim).mean(0), raw[train_ids].reshape(-1, p.vfm_dim).std(0) + 1e-6
    z = (raw - mean) / std
    z_frames = z[train_ids].flatten(0, 1)
    y_frames = seg_target(d["labels"][train_ids].flatten(0, 1), p.seg_labels)

    two = ProbeAndAE(p, n_tok)

    def two_batch(step: int, phase: int = 2) -> dict[str, torch.Tensor]:
        idx = torch.randint(len(z_frames), (p.batch_size,), generator=_phase_seed(p.seed, phase, step))
        return {"f": z_frames[idx], "y": y_frames[idx]}

    def ae_step(eng, b, step):
        loss = eng(b["f"])
        return loss, {"ae_loss": float(loss.detach())}

    def probe_step(eng, b, step):
        loss = eng(b["f"], b["y"])
        return loss, {"probe_ce": float(loss.detach())}

    ctx.progress(f"phase ae: feature AE, {p.ae_steps} steps")
    ctx.fit("ae", ctx.engine(_AELoss(two.ae, p.kl_beta), p.lr), ae_step, two_batch, p.ae_steps)
    ctx.progress(f"phase probe: linear segmentation probe ({p.seg_labels}), {p.probe_steps} steps")
    ctx.fit("probe", ctx.engine(_ProbeLoss(two.probe), p.probe_lr), probe_step, lambda s: two_batch(s, 4),
            p.probe_steps)
    two.eval()
    spaces = fit_spaces(raw, ~d["is_test"], two.ae, p.latent_dim)
    coords = {s: to_space(s, z, spaces, two.ae) for s in ("raw", "pca", "ae")}  # each (V, T, N, D_s)

    nets = Forecasters(p, n_tok)

    def fc_batch(step: int) -> dict[str, torch.Tensor]:
        g, n = _phase_seed(p.seed, 3, step), p.batch_size
        clen = torch.randint(1, p.max_context + 1, (n,), generator=g)
        start = (torch.rand(n, generator=g) * (t_len - clen)).long()  # target frame start + clen <= T - 1
        return {"vid": train_ids[torch.randint(len(train_ids), (n,), generator=g)], "clen": clen, "start": start,
                "t": torch.rand(n, 3, generator=g),
                **{f"noise_{s}": torch.randn(n, n_tok, coords[s].shape[-1], generator=g) for s in coords}}

    def fc_step(eng, b, step):
        vid, idx, valid = context_indices(b["vid"].cpu(), b["clen"].cpu(), b["start"].cpu(), p.max_context)
        tgt = (b["start"] + b["clen"]).cpu()
        batch = {"valid": valid.to(ctx.device), "t": b["t"]}
        for s, c in coords.items():
            batch[f"ctx_{s}"] = c[vid, idx].to(ctx.device)  # (B, C, N, D_s)
            batch[f"y_{s}"] = c[b["vid"].cpu(), tgt].to(ctx.device)  # (B, N, D_s)
            batch[f"noise_{s}"] = b[f"noise_{s}"]
        losses = eng(batch)
        return sum(losses.values()), {k: float(v) for k, v in losses.items()}

    ctx.progress(f"phase forecast: {len(FORECASTERS)} forecasters in lock-step, {p.forecast_steps} steps")
    schedule = {"steps": p.forecast_steps, "warmup": round(p.forecast_warmup * p.forecast_steps), "decay": "cosine"} \
        if p.forecast_warmup > 0 else {}
    ctx.fit("forecast", ctx.engine(nets, p.lr, arms=nets.nets, **schedule), fc_step, fc_batch, p.forecast_steps)
    ctx.save_record("spaces", spaces)


# ---- evaluation --------------------------------------------------------------------------------------------------
def confusion(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    """(C, C) pixel confusion matrix (rows: truth)."""
    return np.bincount(true.ravel() * N_CLASSES + pred.ravel(), minlength=N_CLASSES**2).reshape(N_CLASSES, N_CLASSES)


def miou(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean IoU over the classes that occur in the truth or the prediction (pooled over all pixels given)."""
    cm = confusion(pred, true)
    inter, union = np.diag(cm), cm.sum(0) + cm.sum(1) - np.diag(cm)
    return float((inter[union > 0] / union[union > 0]).mean())


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """FD between Gaussians fitted to rows of a and b: |mu_a - mu_b|^2 + tr(Sa + Sb - 2 (Sa Sb)^1/2)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(sa @ sb).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(sa + sb - 2 * covmean))


@torch.no_grad()
def rollout(net: Forecaster, ctx0: torch.Tensor, valid0: torch.Tensor, horizon: int, k: int, euler: int,
            g: torch.Generator) -> torch.Tensor:
    """Autoregressive rollout: (B, C, N, D) context -> (B, K, H, N, D) forecasts; the window slides over outputs."""
    ctx, valid = ctx0.repeat_interleave(k, 0), valid0.repeat_interleave(k, 0)  # (B*K, C, N, D)
    outs = []
    for _ in range(horizon):
        if net.generative:
            noise = torch.randn(ctx.shape[0], *ctx.shape[2:], generator=g)
            nxt = sample(net, ctx, valid, noise, euler)
        else:
            nxt = net(ctx, valid)
        outs.append(nxt)
        ctx = torch.cat([ctx[:, 1:], nxt[:, None]], 1)
        valid = torch.cat([valid[:, 1:], torch.ones_like(valid[:, :1])], 1)
    return torch.stack(outs, 1).unflatten(0, (ctx0.shape[0], k))  # (B, K, H, N, D)


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    d = load_videos(ctx.data_dir)
    vfm, nets, spaces = ctx.network("vfm"), ctx.network("forecast"), ctx.record("spaces")
    probe, ae = ctx.network("probe").probe, ctx.network("ae").ae
    test_ids = torch.nonzero(d["is_test"]).flatten()
    # only test videos are read below: their features alone (rows indexed by video id through `row`)
    z = (vfm_features(vfm, d["pixels"][test_ids]) - spaces["mean"]) / spaces["std"]  # (Nte, T, N, D)
    row = torch.full((len(d["is_test"]),), -1, dtype=torch.long)
    row[test_ids] = torch.arange(len(test_ids))
    t_len, h_len = z.shape[1], p.horizon
    seg = lambda f: probe(f.flatten(0, -3)).argmax(1).numpy()  # (..., N, D) -> (M, S, S)  # noqa: E731

    # contexts: length cycles 1..max_context; the rollout must stay inside the video
    g = torch.Generator().manual_seed(p.seed + 7)
    n = p.test_contexts
    clen = torch.arange(n) % min(p.max_context, t_len - h_len) + 1
    start = (torch.rand(n, generator=g) * (t_len - h_len - clen + 1)).long()
    vid = test_ids[torch.randint(len(test_ids), (n,), generator=g)]
    vids, idx, valid = context_indices(vid, clen, start, p.max_context)
    future = (start + clen)[:, None] + torch.arange(h_len)  # (B, H)
    true_seg = seg_target(d["labels"][vid[:, None], future], p.seg_labels).numpy()  # (B, H, S, S)
    reference = z.mean(2).reshape(-1, z.shape[-1]).numpy()  # (Nte*T, D) mean-pooled real frames
    real_var = z.reshape(-1, *z.shape[2:]).var(0)  # (N, D)

    out, curves = {}, {}
    for name, space in zip(FORECASTERS, ("raw", "raw", "pca", "ae"), strict=True):
        k = 1 if name == "regression" else p.samples
        ctx_s = to_space(space, z[row[vids], idx], spaces, ae)  # (B, C, N, D_s)
        fc = from_space(space, rollout(nets.nets[name], ctx_s, valid, h_len, k, p.euler_steps, g), spaces, ae)
        pred = seg(fc).reshape(n, k, h_len, p.size, p.size)
        m_h = [np.mean([miou(pred[:, j, h], true_seg[:, h]) for j in range(k)]) for h in range(h_len)]
        best = np.stack([[max(range(k), key=lambda j: miou(pred[b, j, h], true_seg[b, h])) for h in range(h_len)]
                         for b in range(n)])  # (B, H) best sample per context and horizon
        b_h = [miou(pred[np.arange(n), best[:, h], h], true_seg[:, h]) for h in range(h_len)]
        fd_h = [frechet_distance(fc[:, :, h].mean(-2).reshape(-1, fc.shape[-1]).numpy(), reference)
                for h in range(h_len)]
        var = float((fc.reshape(-1, h_len, *fc.shape[-2:]).var(0) / real_var).mean())
        prefix = "method/" if name == "fm_ae" else f"baseline/{name}/"
        out |= {f"{prefix}miou": float(np.mean(m_h)), f"{prefix}miou_best": float(np.mean(b_h)),
                f"{prefix}fd": float(np.mean(fd_h)), f"{prefix}fd_h2plus": float(np.mean(fd_h[1:] or fd_h)),
                f"{prefix}var_ratio": var}
        out |= {f"detail/{name}/miou_h{h + 1}": m_h[h] for h in range(h_len)}
        out |= {f"detail/{name}/fd_h{h + 1}": fd_h[h] for h in range(h_len)}
        curves[name] = (m_h, fd_h, pred[0, 0])

    # information preservation at equal size: probe mIoU and feature MSE after AE vs PCA reconstruction
    frames = z.flatten(0, 1)[: p.recon_frames]  # (M, N, D)
    labels = seg_target(d["labels"][test_ids].flatten(0, 1)[: p.recon_frames], p.seg_labels).numpy()
    out["detail/oracle_miou"] = miou(seg(frames), labels)
    for space, prefix in (("ae", "method/"), ("pca", "baseline/pca/")):
        recon = from_space(space, to_space(space, frames, spaces, ae), spaces, ae)
        out[f"{prefix}recon_miou"] = miou(seg(recon), labels)
        out[f"{prefix}recon_mse"] = float(F.mse_loss(recon, frames))
    _plots(ctx.plots_dir, curves, d["pixels"][vid[0], future[0]].numpy(), true_seg[0], out)
    return out


def _plots(plots: Path, curves: dict, frames: np.ndarray, true_seg: np.ndarray, out: dict) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, (m_h, fd_h, _) in curves.items():
        hs = np.arange(1, len(m_h) + 1)
        axes[0].plot(hs, m_h, "o-", lw=2.5 if name == "fm_ae" else 1.2, label=name)
        axes[1].plot(hs, fd_h, "o-", lw=2.5 if name == "fm_ae" else 1.2, label=name)
    axes[0].axhline(out["detail/oracle_miou"], color="k", ls=":", label="probe on true features")
    axes[0].set(xlabel="horizon", ylabel="future segmentation mIoU (mean of K)", title="Forecast mIoU")
    axes[1].set(xlabel="horizon", ylabel="FD to real features", title="Forecast Frechet distance")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plots / "horizon_curves.png", dpi=110)
    plt.close(fig)

    h = len(frames)
    rows = [("frames", frames, "gray"), ("true seg", true_seg, "tab20")] + \
        [(name, c[2], "tab20") for name, c in curves.items()]
    fig, axes = plt.subplots(len(rows), h, figsize=(1.6 * h, 1.6 * len(rows)), squeeze=False)
    for r, (label, imgs, cmap) in enumerate(rows):
        for j in range(h):
            axes[r, j].imshow(imgs[j], cmap=cmap, vmin=0, vmax=1 if cmap == "gray" else N_CLASSES - 1)
            axes[r, j].set_xticks([]), axes[r, j].set_yticks([])
        axes[r, 0].set_ylabel(label, fontsize=7)
    fig.suptitle("Rollout of one test context: segmentation of forecast features (sample 1)", fontsize=8)
    fig.tight_layout()
    fig.savefig(plots / "rollout_example.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="vfm_forecast",
    title="Generative forecasting of VFM features in a compact latent space",
    seed="000_2dd18ae8605fb5c1.txt, abstract 7",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/miou", "max"),
    claim=Claim(premises=(  # the frozen probe reads the true features, so forecast mIoU measures the forecast
        Compare("detail/oracle_miou", ">=", ORACLE_BAR, name="probe_reads_true_features"),
        # compression at latent_dim loses something the probe reads: else AE and PCA latents cannot differ
        Compare("baseline/pca/recon_miou", "<=", "detail/oracle_miou", margin=-LOSSY_BAR,
                name="pca_compression_lossy", guards=("method/miou", "method/fd", "method/recon_miou")),
    ), all_of=(
        Compare("method/miou", ">", ("baseline/fm_raw/miou", "baseline/fm_pca/miou")),
        Compare("method/fd", "<", ("baseline/fm_raw/fd", "baseline/fm_pca/fd")),
        Compare("method/fd_h2plus", "<", "baseline/regression/fd_h2plus"),
        Compare("method/recon_miou", ">", "baseline/pca/recon_miou"),
    ), summary="AE-latent flow matching beats raw and PCA flow matching on mIoU and FD, beats regression's FD at "
               "horizons >= 2, and the AE keeps more probe mIoU than PCA at equal size"),
)
