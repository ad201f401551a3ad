"""Diffusion machinery the generative papers share: a small conditional U-Net, EDM preconditioning, loss and Heun
sampler, DDPM/DDIM on diffusers' schedulers, and the Frechet distance between Gaussian fits.

What lives here and where it comes from:
- `SmallUNet`: a DDPM-style U-Net (residual blocks, GroupNorm, SiLU, an additive noise/condition embedding, one
  skip per level). `forward(..., features=True)` also returns every block's activations (`enc<l>`, `mid`, `dec<l>`),
  which papers that supervise hidden layers need.
- EDM (Karras et al. 2022): `karras_sigmas` (rho spacing, per sample: each row may have its own [sigma_min,
  sigma_max]), `EDMDenoiser` (c_skip, c_out, c_in, c_noise), `edm_loss`, `heun_sample` (Algorithm 1, deterministic).
  diffusers' EDM schedulers hold one schedule per batch, so per-image schedules cannot use them; the tests check
  `karras_sigmas` against `diffusers.EDMEulerScheduler` where both apply.
- DDPM/DDIM (Ho et al. 2020; Song et al. 2021): `ddpm_scheduler` (diffusers `DDPMScheduler`, its betas and
  alphas_cumprod), `q_sample`, `predict_x0`, `ddim_sample` (diffusers `DDIMScheduler.step`), `ddpm_elbo_weights`.
- `frechet_distance`: ||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1 S2)^1/2), as in FID, on any feature vectors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# ---- network -------------------------------------------------------------------------------------------------
class FourierEmbedding(nn.Module):
    """Random Fourier features of a few scalars (noise level, a conditioning code), then an MLP."""

    def __init__(self, in_dim: int, out_dim: int, num_freqs: int = 16, scale: float = 4.0, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("freqs", torch.randn(in_dim, num_freqs, generator=g) * scale)  # (D, F), fixed
        self.mlp = nn.Sequential(nn.Linear(2 * num_freqs, out_dim), nn.SiLU(), nn.Linear(out_dim, out_dim))

    def forward(self, v: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, out_dim)
        angle = 2 * math.pi * v @ self.freqs  # (B, F)
        return self.mlp(torch.cat([angle.cos(), angle.sin()], -1))


class ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, emb_dim: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(min(8, c_in), c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(emb_dim, c_out)
        self.norm2, self.conv2 = nn.GroupNorm(min(8, c_out), c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # (B, Ci, H, W) -> (B, Co, H, W)
        h = self.conv1(F.silu(self.norm1(x))) + self.emb(emb)[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class SmallUNet(nn.Module):
    """U-Net with one ResBlock per level on the way down and up; levels halve the resolution.

    `noise` (B,) is the noise-level input (EDM's c_noise or DDPM's t / T); `cond` (B, cond_dim) an optional code,
    embedded by its own Fourier features and added to the noise embedding (zeros = unconditional)."""

    def __init__(self, in_ch: int, out_ch: int, channels: tuple[int, ...] = (16, 32), emb_dim: int = 64,
                 cond_dim: int = 0):
        super().__init__()
        self.channels = tuple(channels)
        self.noise_emb = FourierEmbedding(1, emb_dim, seed=1)
        self.cond_emb = FourierEmbedding(cond_dim, emb_dim, scale=1.0, seed=2) if cond_dim else None
        self.stem = nn.Conv2d(in_ch, channels[0], 3, padding=1)
        self.down = nn.ModuleList()
        prev = channels[0]
        for ch in channels:
            self.down.append(ResBlock(prev, ch, emb_dim))
            prev = ch
        self.mid = ResBlock(prev, prev, emb_dim)
        self.up = nn.ModuleList()
        for ch in reversed(channels):
            self.up.append(ResBlock(prev + ch, ch, emb_dim))
            prev = ch
        self.out = nn.Sequential(nn.GroupNorm(min(8, prev), prev), nn.SiLU(), nn.Conv2d(prev, out_ch, 3, padding=1))

    def forward(self, x: torch.Tensor, noise: torch.Tensor, cond: torch.Tensor | None = None,
                features: bool = False):
        emb = self.noise_emb(noise.reshape(-1, 1).to(x.dtype))  # (B, E)
        if self.cond_emb is not None and cond is not None:
            emb = emb + self.cond_emb(cond.to(x.dtype))
        h, skips, feats = self.stem(x), [], {}  # (B, C0, H, W)
        for level, block in enumerate(self.down):
            if level:
                h = F.avg_pool2d(h, 2)  # (B, C, H / 2^l, W / 2^l)
            h = block(h, emb)
            skips.append(h)
            feats[f"enc{level}"] = h
        h = self.mid(h, emb)
        feats["mid"] = h
        for i, block in enumerate(self.up):
            level = len(self.channels) - 1 - i
            if i:
                h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = block(torch.cat([h, skips[level]], 1), emb)  # (B, C_l, H / 2^l, W / 2^l)
            feats[f"dec{level}"] = h
        out = self.out(h)  # (B, out_ch, H, W)
        return (out, feats) if features else out


# ---- EDM -------------------------------------------------------------------------------------------------------
def karras_sigmas(sigma_min: torch.Tensor, sigma_max: torch.Tensor, n: int, rho: float = 7.0) -> torch.Tensor:
    """(B,), (B,) -> (B, n + 1): n levels from sigma_max down to sigma_min with rho spacing, then 0 (EDM eq. 5)."""
    sigma_min, sigma_max = torch.as_tensor(sigma_min, dtype=torch.float64), torch.as_tensor(sigma_max,
                                                                                           dtype=torch.float64)
    ramp = torch.linspace(0, 1, n, dtype=torch.float64) if n > 1 else torch.zeros(1, dtype=torch.float64)
    lo, hi = sigma_min.reshape(-1, 1) ** (1 / rho), sigma_max.reshape(-1, 1) ** (1 / rho)
    sig = (hi + ramp * (lo - hi)) ** rho  # (B, n)
    return torch.cat([sig, torch.zeros(sig.shape[0], 1, dtype=sig.dtype)], 1).float()


class EDMDenoiser(nn.Module):
    """D(x; sigma, c) = c_skip x + c_out F(c_in x; c_noise, c) with EDM's preconditioning."""

    def __init__(self, net: nn.Module, sigma_data: float):
        super().__init__()
        self.net, self.sigma_data = net, float(sigma_data)

    def coefficients(self, sigma: torch.Tensor):
        s, sd = sigma.reshape(-1, 1, 1, 1), self.sigma_data  # (B, 1, 1, 1)
        c_skip = sd**2 / (s**2 + sd**2)
        c_out = s * sd / (s**2 + sd**2).sqrt()
        c_in = 1 / (s**2 + sd**2).sqrt()
        return c_skip, c_out, c_in, sigma.log() / 4

    def raw(self, x_noisy: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        _, _, c_in, c_noise = self.coefficients(sigma)
        return self.net(c_in * x_noisy, c_noise, cond)  # F's output, (B, C, H, W)

    def forward(self, x_noisy: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        c_skip, c_out, _, _ = self.coefficients(sigma)
        return c_skip * x_noisy + c_out * self.raw(x_noisy, sigma, cond)


def edm_loss(denoiser: EDMDenoiser, x0: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor | None = None,
             noise: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample EDM loss lambda(sigma) ||D(x0 + sigma n) - x0||^2, written as F's regression target so that the
    effective weight is 1 (EDM eq. 8 with lambda = 1 / c_out^2). Returns (B,)."""
    noise = torch.randn_like(x0) if noise is None else noise
    x_noisy = x0 + sigma.reshape(-1, 1, 1, 1) * noise
    c_skip, c_out, _, _ = denoiser.coefficients(sigma)
    target = (x0 - c_skip * x_noisy) / c_out
    return (denoiser.raw(x_noisy, sigma, cond) - target).pow(2).flatten(1).mean(1)


@torch.no_grad()
def heun_sample(denoiser: Callable, x: torch.Tensor, sigmas: torch.Tensor,
                cond: torch.Tensor | None = None) -> torch.Tensor:
    """EDM Algorithm 1 (deterministic Heun). x: (B, C, H, W) = sigmas[:, 0] * N(0, I); sigmas: (B, n + 1) ending
    in 0. NFE = 2n - 1 (the last step, to sigma = 0, is an Euler step)."""
    for i in range(sigmas.shape[1] - 1):
        s, s_next = sigmas[:, i], sigmas[:, i + 1]  # (B,)
        d = (x - denoiser(x, s, cond)) / s.reshape(-1, 1, 1, 1)
        x_next = x + (s_next - s).reshape(-1, 1, 1, 1) * d
        if bool((s_next > 0).all()):
            d_next = (x_next - denoiser(x_next, s_next, cond)) / s_next.reshape(-1, 1, 1, 1)
            x_next = x + (s_next - s).reshape(-1, 1, 1, 1) * (d + d_next) / 2
        x = x_next
    return x


def heun_levels(nfe: int) -> int:
    """Number of sigma levels n for a Heun run with `nfe` network evaluations (nfe = 2n - 1)."""
    if nfe < 1 or nfe % 2 == 0:
        raise ValueError(f"Heun NFE must be odd and positive, got {nfe}")
    return (nfe + 1) // 2


# ---- DDPM / DDIM (diffusers schedulers) -------------------------------------------------------------------------
def ddpm_scheduler(num_steps: int, schedule: str = "linear"):
    """diffusers DDPMScheduler; schedule 'linear' (Ho et al.) or 'cosine' (Nichol & Dhariwal: squaredcos_cap_v2)."""
    from diffusers import DDPMScheduler

    name = {"linear": "linear", "cosine": "squaredcos_cap_v2"}[schedule]
    return DDPMScheduler(num_train_timesteps=num_steps, beta_schedule=name, clip_sample=False)


def _per_sample(values: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """values[t] shaped (B, 1, ..., 1) to broadcast over samples of any rank (images, point sets, sequences)."""
    return values.to(like.device)[t].reshape(-1, *([1] * (like.dim() - 1)))


def q_sample(x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    ab = _per_sample(alphas_cumprod, t, x0)  # (B, 1, ..., 1)
    return ab.sqrt() * x0 + (1 - ab).sqrt() * eps


def predict_x0(x_t: torch.Tensor, t: torch.Tensor, eps_hat: torch.Tensor, alphas_cumprod: torch.Tensor):
    ab = _per_sample(alphas_cumprod, t, x_t)
    return (x_t - (1 - ab).sqrt() * eps_hat) / ab.sqrt()


def ddpm_elbo_weights(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """(T,) weights w_t of ||eps - eps_hat||^2 in the DDPM negative ELBO (Ho et al. eq. 12, sigma_t^2 = beta_t):
    w_t = beta_t^2 / (2 sigma_t^2 alpha_t (1 - abar_t)) for t > 0. At t = 0 the decoder term takes the same weight
    as t = 1 (a Gaussian decoder); the constant is dropped."""
    ab = alphas_cumprod.double()
    ab_prev = torch.cat([torch.ones(1, dtype=ab.dtype), ab[:-1]])
    alpha = ab / ab_prev
    beta = 1 - alpha
    sigma2 = beta * (1 - ab_prev) / (1 - ab)  # posterior variance (beta tilde)
    w = beta**2 / (2 * sigma2.clamp(min=1e-20) * alpha * (1 - ab))
    w[0] = w[1]
    return w.float()


@torch.no_grad()
def ddim_sample(eps_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                num_train_steps: int, num_inference_steps: int, schedule: str = "linear") -> torch.Tensor:
    """Deterministic DDIM (eta = 0) through diffusers' DDIMScheduler. eps_model(x_t, t (B,)) -> eps_hat.

    With "cosine" and few training steps, abar at the last (trailing) timestep is ~1e-6 and the first step divides
    eps's error by sqrt(abar): unclipped samples explode (seen at 100 steps). Use "linear", or >= 1000 steps."""
    from diffusers import DDIMScheduler

    name = {"linear": "linear", "cosine": "squaredcos_cap_v2"}[schedule]
    sched = DDIMScheduler(num_train_timesteps=num_train_steps, beta_schedule=name, clip_sample=False,
                          set_alpha_to_one=True, timestep_spacing="trailing")
    sched.set_timesteps(num_inference_steps)
    for t in sched.timesteps:
        eps = eps_model(x, torch.full((x.shape[0],), int(t), dtype=torch.long, device=x.device))
        x = sched.step(eps, int(t), x).prev_sample
    return x


# ---- metrics ---------------------------------------------------------------------------------------------------
def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Frechet distance between Gaussian fits of two feature sets (N, D) and (M, D)."""
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    # tr (S1 S2)^1/2 = sum of the square roots of the eigenvalues of S1 S2 (real, >= 0 up to rounding)
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvals(s1 @ s2).real, 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2) - 2 * tr_covmean)
