"""PhaseLock's mechanism on tiny inputs: the spectral similarities, Latent Delta Guidance, its schedule and filter,
DDIM with a hook, the ballistic residual, the scorers and the data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import phaselock as pl
from models.common import sequences as seq
from models.common.diffusion import ddim_sample


def _video(b: int = 2, t: int = 5, s: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, t, 1, s, s, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_spectral_similarity_known_values():
    g = _video()
    ps, ms = pl.spectral_similarity(g, g)
    assert torch.allclose(ps, torch.ones(2)) and torch.allclose(ms, torch.ones(2))
    # a circular shift in time keeps every |X| (magnitude intact) but turns phases: the erosion PS measures
    ps, ms = pl.spectral_similarity(torch.roll(g, 2, dims=1), g)
    assert torch.allclose(ms, torch.ones(2), atol=1e-6) and (ps < 0.99).all()
    # doubling the intensities keeps every phase and doubles every magnitude: PS 1, MS 0
    ps, ms = pl.spectral_similarity(2 * (g + 1) - 1, g)
    assert torch.allclose(ps, torch.ones(2), atol=1e-6) and torch.allclose(ms, torch.zeros(2), atol=1e-6)


def test_lambda_schedule_decays_linearly_over_the_first_60_percent():
    values = [pl.lambda_schedule(k, 50, 0.6) for k in range(50)]
    assert values[0] == 1.0 and values[15] == pytest.approx(0.5) and values[29] > 0 and values[30] == 0.0
    assert all(v == 0.0 for v in values[30:]) and all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_gaussian_blur_keeps_constants_and_removes_the_checkerboard():
    const = torch.full((1, 2, 1, 8, 8), 0.7)
    assert torch.allclose(pl.gaussian_blur(const, 1.5), const, atol=1e-6)
    checker = (torch.arange(8)[:, None] + torch.arange(8)[None]) % 2 * 2.0 - 1
    blurred = pl.gaussian_blur(checker.view(1, 1, 1, 8, 8), 1.5)
    assert blurred.abs().max() < 0.05 * checker.abs().max()


def test_latent_delta_guidance_imposes_the_prior_deltas_and_anchors_frame_0():
    prior, x0 = _video(seed=1), _video(seed=2)
    hook = pl.phaselock_hook(prior, num_steps=10, fraction=0.6, sigma=1e-3)  # sigma -> 0: the filter is identity
    guided = hook(0, x0)  # lambda_0 = 1
    assert torch.equal(guided[:, 0], x0[:, 0])
    assert torch.allclose(guided[:, 1:] - guided[:, :-1], prior[:, 1:] - prior[:, :-1], atol=1e-5)
    half = hook(3, x0)  # lambda_3 = 0.5: halfway between the deltas
    mid = 0.5 * ((prior[:, 1:] - prior[:, :-1]) + (x0[:, 1:] - x0[:, :-1]))
    assert torch.allclose(half[:, 1:] - half[:, :-1], mid, atol=1e-5)
    assert torch.equal(hook(6, x0), x0)  # after 60% of the steps the run is free


def test_ddim_with_an_oracle_reaches_the_target_and_matches_the_shared_sampler():
    target = _video(b=1, seed=3) * 0.9
    cond = target[:, 0]
    ab = pl.ddim_scheduler(2).alphas_cumprod.float()

    class Oracle(torch.nn.Module):  # predicts the epsilon that makes x0_hat = target exactly
        def forward(self, x, t, cond):
            a = ab[t].view(-1, 1, 1, 1, 1)
            return (x - a.sqrt() * target) / (1 - a).sqrt()

    class VOracle(torch.nn.Module):  # the same oracle as v = sqrt(ab) eps - sqrt(1 - ab) x0, what the U-Net predicts
        def forward(self, x, t, cond):
            a = ab[t].view(-1, 1, 1, 1, 1)
            return a.sqrt() * Oracle()(x, t, cond) - (1 - a).sqrt() * target

    noise = torch.randn(target.shape, generator=torch.Generator().manual_seed(4))
    record: list[torch.Tensor] = []
    out = pl.sample(VOracle(), cond, noise, 5, record=record)
    assert torch.allclose(out, target, atol=1e-4) and len(record) == 5
    flat = lambda x, t: Oracle()(x.view(target.shape), t, cond).view(x.shape)  # noqa: E731
    ref = ddim_sample(flat, noise.view(1, 5, 8, 8), pl.TRAIN_STEPS, 5, schedule="cosine")
    assert torch.allclose(out.view(1, 5, 8, 8), ref, atol=1e-4)


def test_ballistic_residual_zero_on_a_parabola_and_the_guidance_reduces_it():
    t = torch.arange(6.0)
    parabola = torch.stack([2 + 0.5 * t, 1 + 0.2 * t + 0.15 * t**2], -1)[None]  # (1, T, 2)
    assert float(pl.ballistic_residual(parabola)[0]) == pytest.approx(0.0, abs=1e-8)
    traj, bounced = seq.bouncing_ball(2.0, 0.5, 3.0, 0.3, 0.8, 0.7, 10.0, 6)
    assert bounced.any() and float(pl.ballistic_residual(torch.from_numpy(traj)[None].float())[0]) > 0.1
    # a ball video along a bouncing path: one guidance step lowers the residual of its centroids
    video = torch.from_numpy(np.stack([pl.render_ball(16, x, y, 2.0, 0.0, 0.0) for x, y in traj])).float()
    video = (video * 2 - 1).view(1, 6, 1, 16, 16)
    before = pl.ballistic_residual(pl.soft_centroids(video)[:, 1:])
    after = pl.ballistic_residual(pl.soft_centroids(pl.ballistic_hook(0.05)(0, video))[:, 1:])
    assert float(after[0]) < float(before[0])


def test_external_guidance_backpropagates_through_the_network():
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    unet = pl.SpaceTimeUNet(4, (8, 16))
    cond = _video(b=2, t=4, s=8, seed=5)[:, 0]
    noise = torch.randn(2, 4, 1, 8, 8, generator=torch.Generator().manual_seed(6))
    counts, outs = {}, {}
    for name, guide in (("plain", None), ("guided", pl.ballistic_guide(0.3))):
        with FlopCounterMode(display=False) as counter:
            outs[name] = pl.sample(unet, cond, noise, 3, guide=guide)
        counts[name] = counter.get_total_flops()
    assert not torch.allclose(outs["plain"], outs["guided"])
    # one input-gradient backward pass through the U-Net per step costs about one more forward pass
    assert counts["guided"] > 1.8 * counts["plain"]
    assert all(q.grad is None and q.requires_grad for q in unet.parameters())  # the network stays untouched


def test_prepare_follows_the_exact_physics_and_frame_0_carries_the_trail(tmp_path):
    p = pl.Params(n_videos=8, n_frames=6, size=16, texture=0.0, pixel_noise=0.0)
    pl.prepare(p, tmp_path)
    d = pl.load_videos(tmp_path, p)
    assert d["x"].shape == (8, 6, 1, 16, 16) and {"videos.parquet", "params.parquet", "trajectories.parquet"} <= {
        f.name for f in tmp_path.iterdir()}
    m = pl.read_table(tmp_path / "params.parquet")
    for v in range(8):
        traj, _ = seq.bouncing_ball(m["y0"][v], m["vy"][v], m["x0"][v], m["vx"][v], m["g"][v], m["e"][v],
                                    16 - 1 - m["radius"][v], 6)
        assert np.allclose(d["traj"][v].numpy(), traj, atol=1e-5)
    # untextured, noiseless frames: the soft centroid sits on the true trajectory (frames 1..)
    c = pl.soft_centroids(d["x"])
    assert (c[:, 1:] - d["traj"][:, 1:]).abs().max() < 0.2
    assert pl.physical_consistency(d["x"], d["traj"], 1.5)[0] == 100.0
    mass = ((d["x"] + 1) / 2).sum((2, 3, 4))  # (V, T): the trail adds mass to frame 0 only
    assert (mass[:, 0] > mass[:, 1:].max(1).values).all()


def test_load_physics_iq_reads_png_frame_folders(tmp_path):
    from PIL import Image

    for clip in ("a", "b"):
        (tmp_path / clip).mkdir()
        for f in range(5):
            img = np.full((32, 32), 40 * f, dtype=np.uint8)
            Image.fromarray(img).save(tmp_path / clip / f"{f:03d}.png")
    (tmp_path / "metadata.csv").write_text("file,scenario\na,drop\nb,roll\n")
    videos, rows = pl.load_physics_iq(tmp_path, size=8, n_frames=4)
    assert videos.shape == (2, 4, 1, 8, 8) and [r["scenario"] for r in rows] == ["drop", "roll"]
    assert torch.allclose(videos[0, :, 0, 0, 0], torch.tensor([0, 40, 80, 120]) / 255 * 2 - 1)
    with pytest.raises(ValueError, match="frames"):
        pl.load_physics_iq(tmp_path, size=8, n_frames=6)


def test_networks_shapes_and_time_conditioning():
    p = pl.Params(n_frames=4, size=8, channels=(8, 16), ae_dim=4)
    model = pl.Both(p)
    x = _video(t=4)
    eps = model.unet(x, torch.tensor([10, 900]), x[:, 0])
    assert eps.shape == x.shape
    assert not torch.allclose(eps, model.unet(x, torch.tensor([500, 500]), x[:, 0]))
    losses = model(x, x[:, 0], torch.tensor([3, 700]), torch.randn_like(x),
                   pl.ddpm_scheduler(pl.TRAIN_STEPS, "cosine").alphas_cumprod.float())
    assert set(losses) == {"v", "ae"} and all(torch.isfinite(v) for v in losses.values())


def test_unet_takes_widths_that_are_not_multiples_of_8():
    """GroupNorm takes gcd(8, width) groups: 8 for the widths of before (bitwise the same), 4 for 12 or 36."""
    unet = pl.SpaceTimeUNet(4, (12, 24))
    groups = {m.num_channels: m.num_groups for m in unet.modules() if isinstance(m, torch.nn.GroupNorm)}
    assert groups == {12: 4, 24: 8, 36: 4, 48: 8}
    assert all(m.num_groups == 8 for m in pl.SpaceTimeUNet(4, (16, 32)).modules()
               if isinstance(m, torch.nn.GroupNorm))
    x = _video(t=4)
    v = unet(x, torch.tensor([10, 900]), x[:, 0])
    assert v.shape == x.shape and torch.isfinite(v).all()


def test_load_physics_iq_decodes_mp4(tmp_path):
    """Physics-IQ ships mp4: decoded with PyAV, grayscale, first n_frames, area-resized."""
    import av

    with av.open(str(tmp_path / "take.mp4"), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.height, stream.width, stream.pix_fmt = 32, 32, "yuv420p"
        for f in range(5):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * f + 20, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    (tmp_path / "metadata.csv").write_text("file,scenario\ntake.mp4,fall\n")
    videos, rows = pl.load_physics_iq(tmp_path, size=8, n_frames=4)
    assert videos.shape == (1, 4, 1, 8, 8) and rows[0]["scenario"] == "fall"
    expected = (torch.tensor([20, 60, 100, 140]) / 255 * 2 - 1)
    assert torch.allclose(videos[0, :, 0].mean((1, 2)), expected, atol=0.05)


def test_training_timesteps_uniform_at_power_1_and_skewed_to_high_noise_below():
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    uniform = pl.train_timesteps(20_000, 1.0, g())
    assert torch.equal(uniform, torch.randint(0, pl.TRAIN_STEPS, (20_000,), generator=g()))  # the old draws
    skewed = pl.train_timesteps(20_000, 0.5, g())
    assert skewed.min() >= 0 and skewed.max() <= pl.TRAIN_STEPS - 1
    # density ~ t: P(t >= 800) = 1 - 0.8^2 = 0.36 against 0.2 when uniform; mean 2/3 of the range against 1/2
    assert abs(float((uniform >= 800).float().mean()) - 0.2) < 0.015
    assert abs(float((skewed >= 800).float().mean()) - 0.36) < 0.015
    assert abs(float(skewed.float().mean()) / pl.TRAIN_STEPS - 2 / 3) < 0.01


def test_first_step_x0_estimate_stays_conditioned_under_v_prediction():
    # trailing spacing starts at t = 999 where alpha_bar ~ 2e-9: a v-model's error of 0.01 stays 0.01 in x0_hat,
    # where the same error in an epsilon-model's output is multiplied by ~2e4 (a saturated, empty first estimate)
    sched = pl.ddim_scheduler(2)
    t0 = int(sched.timesteps[0])
    ab = sched.alphas_cumprod.float()[t0]
    assert t0 == pl.TRAIN_STEPS - 1 and ab < 1e-6
    target = _video(b=2, seed=5) * 0.9
    err = 0.01 * torch.randn(target.shape, generator=torch.Generator().manual_seed(6))

    class NoisyV(torch.nn.Module):
        def forward(self, x, t, cond):
            a = sched.alphas_cumprod.float()[t].view(-1, 1, 1, 1, 1)
            eps = (x - a.sqrt() * target) / (1 - a).sqrt()
            return a.sqrt() * eps - (1 - a).sqrt() * target + err

    record: list[torch.Tensor] = []
    pl.sample(NoisyV(), target[:, 0], torch.randn(target.shape, generator=torch.Generator().manual_seed(7)), 2,
              record=record)
    assert (record[0] - target).abs().max() < 0.05
    assert ((1 - ab) / ab).sqrt() * 0.01 > 100  # the epsilon parameterisation's amplification of the same error


def test_centroid_tracker_ignores_background_haze():
    # a ball at (5, 9) in a 16 x 16 frame under uniform haze of 0.25 (0-1 scale): the tracker must stay on the ball
    frame = torch.from_numpy(pl.render_ball(16, 5.0, 9.0, 1.8, 0.3, 0.0)).float()
    x = (torch.clamp(frame + 0.25, 0, 1) * 2 - 1).view(1, 1, 1, 16, 16)
    c = pl.soft_centroids(x)[0, 0]
    assert torch.allclose(c, torch.tensor([5.0, 9.0]), atol=0.3)


def test_a_vanished_ball_fails_physical_consistency():
    # a generated video whose ball fades below the tracker's level in one frame: that frame's centroid is (0, 0),
    # so the video counts as unphysical instead of being tracked to wherever the haze sits
    traj = torch.tensor([[[8.0, 4.0 + f] for f in range(4)]])
    x = torch.stack([torch.from_numpy(pl.render_ball(16, 8.0, 4.0 + f, 1.8, 0.0, 0.0)).float() for f in range(4)])
    x[2] *= 0.4  # the ball at 0.4 intensity: under CENTROID_LEVEL
    x = (x * 2 - 1).view(1, 4, 1, 16, 16)
    assert torch.equal(pl.soft_centroids(x)[0, 2], torch.zeros(2))
    pc, rmse = pl.physical_consistency(x, traj, 1.5)
    assert pc == 0 and rmse[0] > 1.5
    pc_whole, _ = pl.physical_consistency(x[:, [0, 1, 3]], traj[:, [0, 1, 3]], 1.5)
    assert pc_whole == 100

def test_counted_flops_per_video_are_the_batchs_over_its_size():
    """evaluate counts each arm's FLOPs on one video: every arm's count is linear in the batch, so the cost ratios
    are those of the whole batch."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    unet = pl.SpaceTimeUNet(4, (8, 16))
    cond = _video(b=3, t=4, s=8, seed=7)[:, 0]
    noise = torch.randn(3, 4, 1, 8, 8, generator=torch.Generator().manual_seed(8))
    arms = {"plain": lambda c, z: {}, "guided": lambda c, z: {"guide": pl.ballistic_guide(0.3)},
            "phaselock": lambda c, z: {"hook": pl.phaselock_hook(pl.sample(unet, c, z, 2), 4, 0.6, 1.5)}}
    for make in arms.values():
        counts = []
        for n in (1, 3):
            with FlopCounterMode(display=False) as counter:
                pl.sample(unet, cond[:n], noise[:n], 4, **make(cond[:n], noise[:n]))
            counts.append(counter.get_total_flops())
        assert counts[1] == pytest.approx(3 * counts[0], rel=1e-3)


def _trail_offset_r2(trail_back: tuple[int, int], tmp_path) -> float:
    """R^2 of the velocity read off frame 0 by a linear fit on one feature: the centroid of the faint (trail-level)
    pixels minus the ball's centroid."""
    tmp_path.mkdir()
    p = pl.Params(n_videos=200, n_frames=4, size=16, pixel_noise=0.0, trail_back=trail_back)
    pl.prepare(p, tmp_path)
    d, m = pl.load_videos(tmp_path, p), pl.read_table(tmp_path / "params.parquet")
    f0 = ((d["x"][:, 0, 0] + 1) / 2).numpy()  # (V, S, S) in [0, 1]
    yy, xx = np.mgrid[0:16, 0:16]

    def centroid(w):
        return np.stack([(w * xx).sum((1, 2)), (w * yy).sum((1, 2))], -1) / np.maximum(w.sum((1, 2)), 1e-6)[:, None]

    feat = centroid(((f0 > 0.08) & (f0 < 0.45)) * f0) - centroid(np.clip(f0 - 0.5, 0, None))
    x = np.concatenate([feat, np.ones((len(f0), 1))], 1)
    v = np.stack([m["vx"], m["vy"]], -1)[np.argsort(m["video_id"])]
    w, *_ = np.linalg.lstsq(x, v, rcond=None)
    return float(1 - ((x @ w - v) ** 2).mean() / v.var(0).mean())


def test_a_trail_drawn_farther_back_shows_the_velocity_the_ball_hides(tmp_path):
    near, far = _trail_offset_r2((1, 2), tmp_path / "near"), _trail_offset_r2((2, 4), tmp_path / "far")
    assert far > 0.85 and far > near + 0.1  # one frame back, the copy lies mostly under the ball
