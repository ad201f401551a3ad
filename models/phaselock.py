"""PhaseLock: lock a 2-step motion prior into a many-step image-to-video diffusion run (training-free guidance).

Seed: 003_9a806cafa3d919df.txt, abstract 5. Spec: ../shared/papers/phaselock.md.

What it implements (function names in brackets):
- data: videos of a textured ball under gravity bouncing off a floor with restitution e (exact event-driven
  trajectory from models/common/sequences.bouncing_ball); the conditioning first frame carries a faint trail (the
  ball at t = -a, -b, `trail_back`) that encodes the initial velocity, so the conditioning image determines the
  true motion
  [prepare, render_ball];
- the I2V model: a factorised space-time U-Net (per-frame 3x3 convs, then a temporal conv over frames, at two
  resolutions) fed the noisy video plus the conditioning frame broadcast over time, predicting v = sqrt(ab) eps -
  sqrt(1 - ab) x0 under the cosine schedule; at this scale the "latent" is pixel space (no VAE). A small frame
  autoencoder for the fidelity features trains beside it in one DeepSpeed engine [SpaceTimeUNet, FrameAE, Both];
- DDIM (diffusers' DDIMScheduler, eta 0) with a per-step hook on x0_hat; the DDIM update uses the hooked x0_hat
  and the epsilon recomputed from it [sample];
- spectral analysis: 3D FFT over (time, height, width) of x0_hat against the ground truth G; phase similarity PS
  = sum |X||G| cos(angle X - angle G) / sum |X||G| and magnitude similarity MS = 1 - || |X| - |G| ||_1 / ||G||_1
  [spectral_similarity], at S = 2, S = 50 and along the 50-step trajectory;
- PhaseLock: the 2-step prior x0^(2) from the same initial noise, its latent delta D_phys[f] = x0^(2)[f+1] -
  x0^(2)[f]; at step k, e_k = blur(D_phys - D(x0_hat^k)) (spatial Gaussian, sigma 1.5) and x0_hat^k[f] += lambda_k
  sum_{j<f} e_k[j] (frame 0 untouched), lambda_k decaying linearly from 1 to 0 over the first 60% of the steps
  [phaselock_hook, gaussian_blur, lambda_schedule];
- external physics guidance (baseline): at every step the residual of a least-squares ballistic fit (x linear, y
  quadratic in time) to the soft centroid trajectory of x0_hat(x_t) is differentiated w.r.t. x_t through the U-Net
  (a backward pass per step, as guidance through the model does), and x0_hat takes a normalised step down it
  [ballistic_guide, sample(guide=)];
- metrics: physical consistency PC = 100 x fraction of videos whose centroid RMSE to the true trajectory is at most
  `pc_threshold` px; Frechet distance of frame-autoencoder features and a sharpness ratio (gradient energy vs real);
  cost ratios against the 50-step run as counted FLOPs (torch's FlopCounterMode, per video: counted on a run of
  the first evaluation video, apart from the sampled runs, which it would slow) and extra stored floats
  [physical_consistency, sharpness, cost].

Deviations from the paper (choices the abstract and spec left open):
- The guidance's delta form, the filter and the schedule are the spec's choices. "Time ratio" is a FLOP ratio
  counted by torch.utils.flop_counter (convolutions and matmuls: the network and the blur), not wall-clock: the
  pipeline's metrics must be deterministic. Memory is reported as the floats PhaseLock keeps beside the run
  (the prior's deltas) relative to the network's parameters and one video.
- Smoke samples no videos of external guidance (`external_videos` off): no claim part reads its quality, only the
  compute context line its FLOPs, which are still counted; it was half of the evaluation's cost (a backward pass
  through the U-Net at every step). Full samples them.
- External guidance backpropagates through the network (the paper's reference, not the spec's x0_hat-only form,
  which is kept as `ballistic_hook`); its counted FLOPs include the backward passes.
- v-prediction, not epsilon: with "trailing" spacing every run starts at t = 999, where the capped cosine
  schedule's alpha_bar is ~2e-9; an epsilon model's x0_hat = (x_t - sqrt(1 - ab) eps_hat) / sqrt(ab) multiplies
  the epsilon error by ~2e4 there (a saturated first estimate, an empty 2-step prior), while x0_hat = sqrt(ab) x_t
  - sqrt(1 - ab) v_hat keeps the network's own, conditioned, estimate. x0_hat is still clipped to [-1, 1].
- The FFTs take intensities in [0, 1] (background 0). PC skips frame 0 (the conditioning image, whose trail moves
  its centroid).
- Full: the Physics-IQ-style loader is `load_physics_iq` (CSV + mp4 through PyAV, or PNG frame folders; both
  tested on fixtures). The full profile does not read it: Physics-IQ gives no object trajectories, which the
  physics metric needs, so it runs the synthetic ball at larger scale, in pixel space (no VAE yet).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from models.common import sequences as seq
from models.common.diffusion import ddpm_scheduler, frechet_distance
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, ScheduledParams

TRAIN_STEPS = 1000  # DDPM timesteps of the cosine schedule
CENTROID_LEVEL = 0.5  # intensity (0-1) above which a pixel weighs in the tracked centroid
PC_FLOOR = 10.0  # premise: the 50-step run's PC (0-100) at least this, so PC can register a change


class Params(ScheduledParams):
    n_videos: int = Field(1500, ge=8, description="Videos rendered by prepare.")
    n_frames: int = Field(8, ge=3, description="Frames per video.")
    size: int = Field(16, ge=8, description="Frame side in pixels (a multiple of 4).")
    radius: tuple[float, float] = Field((1.5, 2.0), description="Ball radius range in px.")
    gravity: tuple[float, float] = Field((0.25, 0.5), description="Gravity range in px/frame^2.")
    restitution: tuple[float, float] = Field((0.6, 0.9), description="Restitution range of the floor bounce.")
    texture: float = Field(0.3, ge=0, le=1, description="Amplitude of the ball's stripe texture.")
    trail: float = Field(0.35, gt=0, le=1, description="Intensity of the nearer trail copy (the farther: half).")
    trail_back: tuple[int, int] = Field((1, 2), description="Frames back (t = -a, -b) of the two trail copies in the "
                                        "conditioning frame: at 1 px/frame or less a copy one frame back lies mostly "
                                        "under the ball (drawn over it), farther copies show the velocity.")
    pixel_noise: float = Field(0.02, ge=0, description="Std of the pixel noise added to every frame.")
    test_fraction: float = Field(0.1, gt=0, lt=1, description="Held-out videos (evaluation conditions).")
    channels: tuple[int, int] = Field((16, 32), description="U-Net channels at full and half resolution.")
    ae_dim: int = Field(32, ge=2, description="Frame autoencoder feature size (fidelity features).")
    steps: int = Field(300, ge=1, description="Training steps (I2V model and autoencoder in lock-step).")
    batch_size: int = Field(16, ge=2, description="Videos per step.")
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate (peak, with `warmup` / `decay`).")
    t_power: float = Field(1.0, gt=0, le=1, description="Training timesteps t = floor(1000 u^t_power), u uniform: 1 "
                           "is uniform; below 1 the high-noise steps, where the ball's place and motion come from the "
                           "conditioning image only, are drawn more often (`train_timesteps`).")
    ema: float | None = Field(None, ge=0, le=1, description="EMA decay of the I2V weights; evaluation samples "
                              "with the EMA copy (None: the last weights).")
    prior_steps: int = Field(2, ge=1, description="DDIM steps of the motion prior (and of the 2-step arm).")
    full_steps: int = Field(50, ge=2, description="DDIM steps of the many-step run.")
    sweep_steps: list[int] = Field([], description="Extra step counts S for the PS/MS and PC sweep (detail).")
    lock_fraction: float = Field(0.6, gt=0, le=1, description="Share of steps over which lambda decays 1 -> 0.")
    lock_sigma: float = Field(1.5, gt=0, description="Std (px) of the spatial Gaussian low-pass.")
    ext_scale: float = Field(0.3, ge=0, description="Step size of the external ballistic guidance on x0_hat.")
    n_eval: int = Field(64, ge=2, description="Evaluation videos per arm.")
    external_videos: bool = Field(True, description="Sample external guidance's videos (its PC, FD, ...); off: its "
                                  "FLOPs are still counted, for the compute context line, the only thing of it the "
                                  "claim reads.")
    pc_threshold: float = Field(1.5, gt=0, description="Centroid RMSE (px) under which a video counts as physical.")


# ---- data ----------------------------------------------------------------------------------------------------
def render_ball(size: int, cx: float, cy: float, radius: float, texture: float, phase: float) -> np.ndarray:
    """(size, size) in [0, 1]: an anti-aliased disk with stripes of amplitude `texture` across it."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    disk = np.clip(radius + 0.5 - np.hypot(xx - cx, yy - cy), 0, 1)
    stripes = 1 - texture * 0.5 * (1 + np.cos(2.5 * (xx - cx) + phase))
    return disk * stripes


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    s, t_len = p.size, p.n_frames
    videos = {"video_id": [], "frame": [], "pixels": []}
    params = {k: [] for k in ("video_id", "x0", "y0", "vx", "vy", "g", "e", "radius", "phase", "split")}
    trajs = {"video_id": [], "frame": [], "cx": [], "cy": []}
    test = set(rng.permutation(p.n_videos)[: max(1, round(p.test_fraction * p.n_videos))].tolist())
    for v in range(p.n_videos):
        r, g, e = rng.uniform(*p.radius), rng.uniform(*p.gravity), rng.uniform(*p.restitution)
        floor = s - 1 - r
        vx = rng.uniform(-0.8, 0.8)
        lo, hi = r + 1 + max(0.0, -vx * (t_len - 1)), s - 2 - r - max(0.0, vx * (t_len - 1))
        x0, y0, vy = rng.uniform(lo, hi), rng.uniform(r + 1, 0.6 * s), rng.uniform(-1.0, 1.0)
        traj, _ = seq.bouncing_ball(y0, vy, x0, vx, g, e, floor, t_len)  # (T, 2) as (x, y)
        phase = rng.uniform(0, 2 * np.pi)
        for f in range(t_len):
            frame = render_ball(s, traj[f, 0], traj[f, 1], r, p.texture, phase)
            if f == 0:  # the trail: the ball at t = -a, -b (`trail_back`) under free flight, fading
                for back, weight in zip(p.trail_back, (p.trail, p.trail / 2), strict=True):
                    yb = min(y0 - vy * back + 0.5 * g * back**2, floor)
                    frame = np.maximum(frame, weight * render_ball(s, x0 - vx * back, yb, r, 0.0, 0.0))
            frame = np.clip(frame + p.pixel_noise * rng.standard_normal(frame.shape), 0, 1)
            videos["video_id"].append(v), videos["frame"].append(f)
            videos["pixels"].append(frame.reshape(-1).astype(np.float32))
            trajs["video_id"].append(v), trajs["frame"].append(f)
            trajs["cx"].append(traj[f, 0]), trajs["cy"].append(traj[f, 1])
        for k, val in zip(params, (v, x0, y0, vx, vy, g, e, r, phase, "test" if v in test else "train"), strict=True):
            params[k].append(val)
    write_table(out_dir / "videos.parquet", {**videos, "pixels": np.stack(videos["pixels"])})
    write_table(out_dir / "params.parquet", params)
    write_table(out_dir / "trajectories.parquet", trajs)


def load_videos(data_dir: Path, p: Params) -> dict[str, torch.Tensor]:
    """x: clean videos (V, T, 1, S, S) in [-1, 1] (frame 0 with its trail is the conditioning image); traj: the
    true centroids (V, T, 2) as (x, y); test: held-out mask."""
    v, t, m = (read_table(data_dir / n) for n in ("videos.parquet", "trajectories.parquet", "params.parquet"))
    n = int(v["video_id"].max()) + 1
    order = np.lexsort((v["frame"], v["video_id"]))
    x = torch.from_numpy(v["pixels"][order]).view(n, p.n_frames, 1, p.size, p.size) * 2 - 1
    order = np.lexsort((t["frame"], t["video_id"]))
    traj = torch.from_numpy(np.stack([t["cx"][order], t["cy"][order]], -1)).view(n, p.n_frames, 2).float()
    test = torch.from_numpy(m["split"][np.argsort(m["video_id"])] == "test")
    return {"x": x.float(), "traj": traj, "test": test}


def load_physics_iq(root: Path, size: int, n_frames: int) -> tuple[torch.Tensor, list[dict[str, str]]]:
    """Physics-IQ-style clips: `metadata.csv` whose `file` column names, beside it, an mp4 (decoded with PyAV) or a
    folder of PNG frames (Pillow); other columns are kept as metadata. Returns grayscale videos (N, n_frames, 1,
    size, size) in [-1, 1] (area-resampled, first n_frames) and the rows."""
    rows = list(csv.DictReader((root / "metadata.csv").open()))
    clips = []
    for row in rows:
        path = root / row["file"]
        if path.is_dir():
            from PIL import Image

            frames = [np.asarray(Image.open(f).convert("L"), dtype=np.float32) for f in sorted(path.glob("*.png"))]
        else:
            try:
                import av
            except ImportError as e:
                raise ImportError(f"{path}: decoding mp4 needs PyAV (pip install av); or give a PNG folder") from e
            with av.open(str(path)) as container:
                frames = [fr.to_ndarray(format="gray").astype(np.float32) for fr in container.decode(video=0)]
        if len(frames) < n_frames:
            raise ValueError(f"{path} has {len(frames)} frames, {n_frames} needed")
        gray = torch.from_numpy(np.stack(frames[:n_frames]))[:, None] / 255  # (T, 1, H, W)
        clips.append(F.interpolate(gray, size=(size, size), mode="area") * 2 - 1)
    return torch.stack(clips), rows


# ---- networks ------------------------------------------------------------------------------------------------
def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(1e4) * torch.arange(dim // 2) / (dim // 2))
    angle = t.float()[:, None] * freqs  # (B, dim / 2)
    return torch.cat([angle.sin(), angle.cos()], -1)


class STBlock(nn.Module):
    """Factorised space-time residual block: 3x3 conv per frame, then a kernel-3 conv over frames."""

    def __init__(self, c_in: int, c_out: int, emb: int):
        super().__init__()
        self.n1, self.conv1 = nn.GroupNorm(math.gcd(8, c_in), c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(emb, c_out)
        self.n2, self.conv2 = nn.GroupNorm(math.gcd(8, c_out), c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.temporal = nn.Conv1d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor, frames: int) -> torch.Tensor:
        # x (B T, C, H, W), emb (B T, E)
        h = self.conv1(F.silu(self.n1(x))) + self.emb(emb)[:, :, None, None]
        h = self.skip(x) + self.conv2(F.silu(self.n2(h)))  # (B T, Co, H, W)
        bt, c, hh, ww = h.shape
        seq_ = h.view(bt // frames, frames, c, hh * ww).permute(0, 3, 2, 1).reshape(-1, c, frames)  # (B H W, C, T)
        mixed = self.temporal(F.silu(seq_)).view(bt // frames, hh * ww, c, frames).permute(0, 3, 2, 1)
        return h + mixed.reshape(bt, c, hh, ww)


class SpaceTimeUNet(nn.Module):
    """v_hat(x_t, t, cond): the noisy video (B, T, 1, S, S) with the conditioning frame broadcast over time."""

    def __init__(self, frames: int, channels: tuple[int, int], emb: int = 64):
        super().__init__()
        c1, c2 = channels
        self.emb_dim = emb
        self.t_mlp = nn.Sequential(nn.Linear(emb, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.frame_emb = nn.Parameter(torch.zeros(frames, emb))
        self.stem = nn.Conv2d(2, c1, 3, padding=1)
        self.down1, self.down2 = STBlock(c1, c1, emb), STBlock(c1, c2, emb)
        self.mid = STBlock(c2, c2, emb)
        self.up2, self.up1 = STBlock(2 * c2, c2, emb), STBlock(c2 + c1, c1, emb)
        self.out = nn.Sequential(nn.GroupNorm(math.gcd(8, c1), c1), nn.SiLU(), nn.Conv2d(c1, 1, 3, padding=1))

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        b, frames, _, s, _ = x_t.shape
        inp = torch.cat([x_t, cond[:, None].expand(-1, frames, -1, -1, -1)], 2).flatten(0, 1)  # (B T, 2, S, S)
        emb = self.t_mlp(time_embedding(t, self.emb_dim))[:, None] + self.frame_emb  # (B, T, E)
        emb = emb.flatten(0, 1)
        h1 = self.down1(self.stem(inp), emb, frames)  # (B T, c1, S, S)
        h2 = self.down2(F.avg_pool2d(h1, 2), emb, frames)  # (B T, c2, S/2, S/2)
        h = self.mid(h2, emb, frames)
        h = self.up2(torch.cat([h, h2], 1), emb, frames)
        h = self.up1(torch.cat([F.interpolate(h, scale_factor=2, mode="nearest"), h1], 1), emb, frames)
        return self.out(h).view(b, frames, 1, s, s)


class FrameAE(nn.Module):
    """Frame autoencoder whose bottleneck gives the fidelity features (trained on real frames)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        flat = 32 * (size // 4) ** 2
        self.enc = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.SiLU(), nn.Conv2d(16, 32, 4, 2, 1), nn.SiLU(),
                                 nn.Flatten(), nn.Linear(flat, dim))
        self.dec = nn.Sequential(nn.Linear(dim, flat), nn.Unflatten(1, (32, size // 4, size // 4)), nn.SiLU(),
                                 nn.ConvTranspose2d(32, 16, 4, 2, 1), nn.SiLU(), nn.ConvTranspose2d(16, 1, 4, 2, 1))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # (N, 1, S, S) -> reconstruction loss
        return F.mse_loss(self.dec(self.enc(frames)), frames)


class Both(nn.Module):
    def __init__(self, p: Params):
        super().__init__()
        self.unet, self.ae = SpaceTimeUNet(p.n_frames, p.channels), FrameAE(p.size, p.ae_dim)

    def forward(self, x0, cond, t, eps, alphas_cumprod) -> dict[str, torch.Tensor]:
        ab = alphas_cumprod[t].view(-1, 1, 1, 1, 1)
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * eps  # (B, T, 1, S, S)
        v = ab.sqrt() * eps - (1 - ab).sqrt() * x0  # v-prediction target (Salimans & Ho 2022)
        return {"v": F.mse_loss(self.unet(x_t, t, cond), v), "ae": self.ae(x0.flatten(0, 1))}


# ---- training ------------------------------------------------------------------------------------------------
def train_timesteps(n: int, power: float, g: torch.Generator) -> torch.Tensor:
    """(n,) DDPM timesteps of a training batch: uniform for power 1 (torch.randint, the same draws as before the
    knob); otherwise floor(TRAIN_STEPS u^power), u ~ U(0, 1), which for power < 1 draws the high-noise steps more
    often (density ~ t^(1 / power - 1)), where the network must place the ball from the conditioning image alone."""
    if power == 1.0:
        return torch.randint(0, TRAIN_STEPS, (n,), generator=g)
    u = torch.rand(n, generator=g)
    return (TRAIN_STEPS * u**power).long().clamp(max=TRAIN_STEPS - 1)


def train(ctx) -> None:
    p: Params = ctx.params
    d = load_videos(ctx.data_dir, p)
    train_ids = torch.nonzero(~d["test"]).flatten()
    alphas_cumprod = ddpm_scheduler(TRAIN_STEPS, "cosine").alphas_cumprod.float()
    torch.manual_seed(p.seed)
    model = Both(p)

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(p.seed * 100_003 + step)
        v = train_ids[torch.randint(len(train_ids), (p.batch_size,), generator=g)]
        return {"x0": d["x"][v], "t": train_timesteps(p.batch_size, p.t_power, g),
                "eps": torch.randn(d["x"][v].shape, generator=g)}

    def step_fn(engine, b, step):
        losses = engine(b["x0"], b["x0"][:, 0], b["t"], b["eps"], alphas_cumprod)
        return sum(losses.values()), {k: float(v.detach()) for k, v in losses.items()}

    ctx.progress(f"I2V U-Net and frame autoencoder in lock-step, {p.steps} steps")
    engine = ctx.engine(model, p.lr, arms={"unet": model.unet, "ae": model.ae}, steps=p.steps, warmup=p.warmup,
                        decay=p.decay, ema=p.ema)
    ctx.fit("i2v", engine, step_fn, batch_fn, p.steps)  # on the profile's `threads` (1: small videos)


# ---- sampling and guidance -------------------------------------------------------------------------------------
def ddim_scheduler(num_steps: int):
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(num_train_timesteps=TRAIN_STEPS, beta_schedule="squaredcos_cap_v2", clip_sample=False,
                          set_alpha_to_one=True, timestep_spacing="trailing")
    sched.set_timesteps(num_steps)
    return sched


@torch.no_grad()
def sample(unet: nn.Module, cond: torch.Tensor, noise: torch.Tensor, num_steps: int, hook=None,
           record: list | None = None, guide=None) -> torch.Tensor:
    """Deterministic DDIM (eta 0) through diffusers' scheduler. The U-Net predicts v; x0_hat = sqrt(ab) x_t -
    sqrt(1 - ab) v_hat, clipped to the data range [-1, 1]; `hook(k,
    x0_hat)` may change it at step k; the update then uses it and the epsilon recomputed from it. `guide(k, x_t,
    x0_hat, grad)` is external guidance through the network: x0_hat is computed with autograd on x_t, and the
    guide gets the function grad(loss) -> d loss / d x_t (a backward pass through the U-Net) [ballistic_guide]."""
    sched = ddim_scheduler(num_steps)
    ab_all = sched.alphas_cumprod.float()
    x = noise
    frozen = {q: q.requires_grad for q in unet.parameters()}
    for q in unet.parameters():  # guidance differentiates w.r.t. x_t only: no parameter gradients
        q.requires_grad_(False)
    for k, t in enumerate(sched.timesteps):
        ab = ab_all[int(t)]
        with torch.set_grad_enabled(guide is not None):
            x_in = x.detach().requires_grad_(guide is not None)
            v = unet(x_in, torch.full((x.shape[0],), int(t)), cond)  # (B, T, 1, S, S)
            x0 = (ab.sqrt() * x_in - (1 - ab).sqrt() * v).clamp(-1, 1)  # no 1 / sqrt(alpha_bar): bounded error
            if guide is not None:
                x0 = guide(k, x0, lambda loss, x_in=x_in: _input_grad(loss, x_in))
        x0 = x0.detach()
        if hook is not None:
            x0 = hook(k, x0)
        eps = (x - ab.sqrt() * x0) / (1 - ab).sqrt()
        if record is not None:
            record.append(x0)
        x = sched.step(eps, int(t), x).prev_sample
    for q, flag in frozen.items():
        q.requires_grad_(flag)
    return x


def _input_grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d loss / d x by a backward pass (torch.autograd.grad trips FlopCounterMode's module tracker)."""
    loss.backward()
    return x.grad


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable spatial Gaussian low-pass of (..., 1, S, S), reflect padding, radius ceil(3 sigma)."""
    radius = int(math.ceil(3 * sigma))
    k = torch.exp(-(torch.arange(-radius, radius + 1, dtype=x.dtype) ** 2) / (2 * sigma**2))
    k = k / k.sum()
    shape = x.shape
    y = F.pad(x.reshape(-1, 1, *shape[-2:]), (radius,) * 4, mode="reflect")
    y = F.conv2d(F.conv2d(y, k.view(1, 1, 1, -1)), k.view(1, 1, -1, 1))
    return y.reshape(shape)


def lambda_schedule(k: int, num_steps: int, fraction: float) -> float:
    """Guidance weight at step k: 1 at the first step, linearly down to 0 at `fraction` of the steps, then 0."""
    return max(0.0, 1.0 - k / (fraction * num_steps))


def phaselock_hook(prior: torch.Tensor, num_steps: int, fraction: float, sigma: float):
    """Latent Delta Guidance toward the 2-step prior's frame deltas: x0[f] += lambda_k sum_{j<f} e_k[j] with
    e_k = blur(D_phys - D(x0_hat)); with lambda 1 and no blur the guided deltas equal D_phys exactly."""
    d_phys = prior[:, 1:] - prior[:, :-1]  # (B, T-1, 1, S, S)

    def hook(k: int, x0: torch.Tensor) -> torch.Tensor:
        lam = lambda_schedule(k, num_steps, fraction)
        if lam == 0:
            return x0
        e = gaussian_blur(d_phys - (x0[:, 1:] - x0[:, :-1]), sigma)
        return torch.cat([x0[:, :1], x0[:, 1:] + lam * e.cumsum(1)], 1)  # frame 0 stays anchored

    return hook


def soft_centroids(x: torch.Tensor) -> torch.Tensor:
    """(B, T, 1, S, S) in [-1, 1] -> (B, T, 2) intensity-weighted centroids (x, y); weights = intensity above
    `CENTROID_LEVEL` on the [0, 1] scale (differentiable almost everywhere); a frame with no pixel above it gives
    (0, 0), so a video whose ball vanishes counts as far off.
    The level sits between the ball (stripes 0.7-1) and faint background haze, which would pull the centroid to the
    frame centre, and above the trail (0.35)."""
    w = ((x[:, :, 0] + 1) / 2 - CENTROID_LEVEL).clamp(min=0)  # (B, T, S, S)
    grid = torch.arange(x.shape[-1], dtype=x.dtype)
    mass = w.sum((2, 3)).clamp(min=1e-4)
    cx, cy = (w.sum(2) * grid).sum(-1) / mass, (w.sum(3) * grid).sum(-1) / mass
    return torch.stack([cx, cy], -1)


def ballistic_residual(c: torch.Tensor) -> torch.Tensor:
    """(B, T, 2) -> (B,) squared residual of the least-squares fit x = a + b t, y = a + b t + c t^2."""
    t = torch.arange(c.shape[1], dtype=c.dtype)
    res = []
    for axis, degree in ((0, 1), (1, 2)):
        a = torch.stack([t**i for i in range(degree + 1)], 1)  # (T, D)
        proj = a @ torch.linalg.pinv(a)  # (T, T) hat matrix
        res.append(((c[..., axis] - c[..., axis] @ proj.T) ** 2).sum(1))
    return res[0] + res[1]


def ballistic_hook(scale: float):
    """The spec's cheap form of external guidance: a normalised gradient step on x0_hat down the ballistic-fit
    residual of its centroid trajectory (frames 1..; frame 0 is the conditioning image with its trail), the
    gradient taken w.r.t. x0_hat only (no pass through the network). Kept for tests; the claim's arm is
    `ballistic_guide`."""

    def hook(k: int, x0: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = x0.detach().requires_grad_(True)
            ballistic_residual(soft_centroids(x)[:, 1:]).sum().backward()
        g = x.grad
        return x0 - scale * g / g.abs().amax((1, 2, 3, 4), keepdim=True).clamp(min=1e-8)

    return hook


def ballistic_guide(scale: float):
    """External physics guidance as the paper describes it (universal / DPS-style guidance): the ballistic-fit
    residual of x0_hat(x_t)'s centroid trajectory is differentiated w.r.t. x_t through the U-Net (one backward
    pass per step), and x0_hat moves by a normalised step along that gradient."""

    def guide(k: int, x0: torch.Tensor, grad) -> torch.Tensor:
        g = grad(ballistic_residual(soft_centroids(x0)[:, 1:]).sum())  # (B, T, 1, S, S) d residual / d x_t
        return x0.detach() - scale * g / g.abs().amax((1, 2, 3, 4), keepdim=True).clamp(min=1e-8)

    return guide


# ---- evaluation ----------------------------------------------------------------------------------------------
def spectral_similarity(x: torch.Tensor, gt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-video phase and magnitude similarity (B,), (B,) of the 3D FFT over (time, height, width)."""
    # on intensities in [0, 1] (background 0), so the DC term measures the ball, not the background
    fx = torch.fft.fftn((x[:, :, 0].double() + 1) / 2, dim=(1, 2, 3))  # (B, T, S, S) complex
    fg = torch.fft.fftn((gt[:, :, 0].double() + 1) / 2, dim=(1, 2, 3))
    ax, ag = fx.abs(), fg.abs()
    ps = (fx * fg.conj()).real.sum((1, 2, 3)) / (ax * ag).sum((1, 2, 3)).clamp(min=1e-12)  # |X||G| cos(dphase)
    ms = 1 - (ax - ag).abs().sum((1, 2, 3)) / ag.sum((1, 2, 3)).clamp(min=1e-12)
    return ps.float(), ms.float()


def physical_consistency(x: torch.Tensor, traj: torch.Tensor, threshold: float) -> tuple[float, torch.Tensor]:
    """PC = 100 x share of videos whose centroid RMSE to the true trajectory (frames 1..) is <= threshold px."""
    rmse = (soft_centroids(x)[:, 1:] - traj[:, 1:]).pow(2).sum(-1).mean(1).sqrt()  # (B,)
    return 100 * float((rmse <= threshold).float().mean()), rmse


def sharpness(x: torch.Tensor) -> float:
    """Mean squared spatial finite difference (gradient energy)."""
    return float(((x[..., 1:, :] - x[..., :-1, :]) ** 2).mean() + ((x[..., 1:] - x[..., :-1]) ** 2).mean())


@torch.no_grad()
def evaluate(ctx) -> dict[str, float]:
    from torch.utils.flop_counter import FlopCounterMode

    p: Params = ctx.params
    d = load_videos(ctx.data_dir, p)
    model = ctx.network("i2v", ema=p.ema is not None)  # the autoencoder's EMA too: it only gives features
    ids = torch.nonzero(d["test"]).flatten()[: p.n_eval]
    gt, traj = d["x"][ids], d["traj"][ids]
    cond = gt[:, 0]
    noise = torch.randn(gt.shape, generator=torch.Generator().manual_seed(p.seed + 17))
    unet = model.unet

    def run(steps: int, hook_of=None, record=None, guide=None, videos: bool = True) -> tuple[torch.Tensor, int]:
        """Sample every evaluation video (`videos`; off: none, only the count), then count the run's FLOPs (the
        prior, the guidance and its backward passes included) per video, on the first one: a dispatch mode that
        sees every op slows the sampling it watches, and every counted op is linear in the batch."""
        hook_of = hook_of or (lambda c, z: None)
        video = sample(unet, cond, noise, steps, hook_of(cond, noise), record, guide) if videos else None
        with FlopCounterMode(display=False) as counter:
            sample(unet, cond[:1], noise[:1], steps, hook_of(cond[:1], noise[:1]), None, guide)
        return video, counter.get_total_flops()

    trajectory: list[torch.Tensor] = []
    videos, flops = {}, {}
    videos["ddim2"], flops["ddim2"] = run(p.prior_steps)
    videos["ddim50"], flops["ddim50"] = run(p.full_steps, record=trajectory)
    videos["phaselock"], flops["phaselock"] = run(p.full_steps, lambda c, z: phaselock_hook(
        sample(unet, c, z, p.prior_steps), p.full_steps, p.lock_fraction, p.lock_sigma))
    videos["external"], flops["external"] = run(p.full_steps, guide=ballistic_guide(p.ext_scale),
                                                videos=p.external_videos)
    if videos["external"] is None:  # counted only: its time ratio is a context line
        del videos["external"]

    real_frames = d["x"][d["test"]].flatten(0, 1)
    real_feat = model.ae.enc(real_frames).numpy()
    out: dict[str, float] = {}
    n_params = sum(q.numel() for q in unet.parameters())
    extra = {"phaselock": gt[:, 1:].numel(), "external": gt.numel()}  # the prior's deltas; the residual's gradient
    out["baseline/external/time_ratio"] = flops["external"] / flops["ddim50"]
    for arm, x in videos.items():
        ps, ms = spectral_similarity(x, gt)
        pc, rmse = physical_consistency(x, traj, p.pc_threshold)
        m = {"pc": pc, "centroid_rmse": float(rmse.mean()), "phase_sim": float(ps.mean()),
             "mag_sim": float(ms.mean()), "fd": frechet_distance(model.ae.enc(x.flatten(0, 1)).numpy(), real_feat),
             "sharpness_ratio": sharpness(x) / sharpness(gt), "time_ratio": flops[arm] / flops["ddim50"],
             "mem_ratio": 1 + extra.get(arm, 0) / (n_params + 3 * gt.numel())}
        prefix = "method/" if arm == "phaselock" else f"baseline/{arm}/"
        out |= {prefix + k: v for k, v in m.items()}
    ps2, ps50 = out["baseline/ddim2/phase_sim"], out["baseline/ddim50/phase_sim"]
    ms2, ms50 = out["baseline/ddim2/mag_sim"], out["baseline/ddim50/mag_sim"]
    out["detail/phase_drop_pct"] = 100 * (ps2 - ps50) / max(abs(ps2), 1e-8)
    out["detail/mag_drop_pct"] = 100 * (ms2 - ms50) / max(abs(ms2), 1e-8)
    out["detail/real/pc"] = physical_consistency(gt, traj, p.pc_threshold)[0]
    curve = torch.stack([torch.stack(spectral_similarity(x0, gt)).mean(1) for x0 in trajectory])  # (K, 2)
    for k in sorted({0, 1, len(curve) // 2, len(curve) - 1}):
        out[f"detail/trajectory/step{k + 1}/phase_sim"] = float(curve[k, 0])
        out[f"detail/trajectory/step{k + 1}/mag_sim"] = float(curve[k, 1])
    sweep = {}
    for steps in p.sweep_steps:
        x = sample(unet, cond, noise, steps)
        sweep[steps] = (float(spectral_similarity(x, gt)[0].mean()), physical_consistency(x, traj, p.pc_threshold)[0])
        out[f"detail/sweep/S{steps}/phase_sim"], out[f"detail/sweep/S{steps}/pc"] = sweep[steps]
    _plots(ctx.plots_dir, out, curve, gt, traj, videos, p)
    return out


def _plots(plots: Path, out: dict[str, float], curve: torch.Tensor, gt: torch.Tensor, traj: torch.Tensor,
           videos: dict[str, torch.Tensor], p: Params) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    steps = np.arange(1, len(curve) + 1)
    ax.plot(steps, curve[:, 0].numpy(), label="phase similarity (x0_hat vs G)")
    ax.plot(steps, curve[:, 1].numpy(), label="magnitude similarity")
    ax.axhline(out["baseline/ddim2/phase_sim"], color="tab:blue", ls=":", label=f"PS of the {p.prior_steps}-step run")
    ax.axhline(out["baseline/ddim2/mag_sim"], color="tab:orange", ls=":", label="MS of the 2-step run")
    ax.set(xlabel=f"DDIM step of the {p.full_steps}-step run", ylabel="similarity to ground truth",
           title="Phase erosion along the trajectory")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(plots / "phase_trajectory.png", dpi=110)
    plt.close(fig)

    rows = {"ground truth": gt, **videos}
    n_show, t_len, s = min(3, len(gt)), gt.shape[1], gt.shape[-1]
    tile = torch.ones(len(rows), s + 1, n_show, t_len * s + 2)
    for r, x in enumerate(rows.values()):
        strips = x[:n_show, :, 0].permute(2, 0, 1, 3).reshape(s, n_show, t_len * s)  # (S, n, T S)
        tile[r, :s, :, : t_len * s] = ((strips + 1) / 2).clamp(0, 1)
    fig, ax = plt.subplots(figsize=(1.0 * n_show * t_len / 2, 0.6 * len(rows) + 0.6))
    ax.imshow(tile.reshape(len(rows) * (s + 1), -1).numpy(), cmap="gray", vmin=0, vmax=1)
    ax.set_yticks([r * (s + 1) + s / 2 for r in range(len(rows))], list(rows), fontsize=7)
    ax.set_xticks([])
    ax.set_title("Videos (frames left to right; one conditioning image and noise per column)", fontsize=8)
    fig.savefig(plots / "samples.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    arms = list(videos)
    key = lambda a, m: ("method/" if a == "phaselock" else f"baseline/{a}/") + m  # noqa: E731
    for ax, metric in zip(axes[:2], ("pc", "fd"), strict=True):
        ax.bar(arms, [out[key(a, metric)] for a in arms],
               color=["tab:red" if a == "phaselock" else "tab:gray" for a in arms])
        ax.set_title({"pc": "physical consistency (higher is better)", "fd": "feature FD (lower is better)"}[metric],
                     fontsize=8)
    for a in arms:
        axes[2].plot(soft_centroids(videos[a][:1])[0, :, 1].numpy(), label=a)
    axes[2].plot(traj[0, :, 1].numpy(), "k--", label="true")
    axes[2].set(xlabel="frame", ylabel="centroid y (px, down)", title="one video's height")
    axes[2].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(plots / "physics.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="phaselock",
    title="PhaseLock: locking 2-step motion priors into many-step image-to-video diffusion",
    seed="003_9a806cafa3d919df.txt, abstract 5",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/pc", "max"),
    claim=Claim(premises=(  # the model generates physics PC can see, and the phase erosion the paper explains
        Compare("baseline/ddim50/pc", ">=", PC_FLOOR, name="ddim50_pc_off_the_floor"),
        Compare("baseline/ddim2/phase_sim", ">", "baseline/ddim50/phase_sim", name="phase_drop_2_to_50_steps"),
    ), all_of=(
        Compare("baseline/ddim2/pc", ">", "baseline/ddim50/pc"),
        Compare("method/pc", ">", "baseline/ddim50/pc"),
        Compare("method/fd", "<=", "baseline/ddim50/fd", scale=1.1),
    ), context=(  # counted FLOPs: PhaseLock's 52 / 50 network passes by construction; external guidance pays a
        # backward pass through the U-Net at every step
        Compare("method/time_ratio", "<=", 1.15),
        Compare("baseline/external/time_ratio", ">", "method/time_ratio"),
    ), summary="the 2-step run keeps more physics than the 50-step one; PhaseLock raises physical consistency over "
               "50-step DDIM with FD within 10% (context: at most 1.15x the compute, 52 / 50 passes by construction; "
               "premises: 50-step PC off the floor, the phase drop from 2 to 50 steps)"),
)
