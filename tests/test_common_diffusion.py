"""The shared diffusion machinery (models/common/diffusion.py) against references computed another way."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import EDMEulerScheduler

from models.common import diffusion as dm


def test_karras_sigmas_match_diffusers_and_take_per_row_ranges():
    ours = dm.karras_sigmas(torch.tensor([0.002]), torch.tensor([80.0]), 5, rho=7.0)[0]
    ref = EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, sigma_schedule="karras")
    ref.set_timesteps(5)
    assert torch.allclose(ours, ref.sigmas.float(), rtol=1e-4)
    rows = dm.karras_sigmas(torch.tensor([0.01, 0.5]), torch.tensor([2.0, 30.0]), 4)  # (2, 5)
    assert torch.allclose(rows[:, 0], torch.tensor([2.0, 30.0]))
    assert torch.allclose(rows[:, 3], torch.tensor([0.01, 0.5]))
    assert (rows[:, :-1].diff(dim=1) < 0).all() and (rows[:, -1] == 0).all()


def test_edm_loss_is_lambda_weighted_denoising_error():
    torch.manual_seed(0)
    den = dm.EDMDenoiser(dm.SmallUNet(1, 1, (8, 16)), sigma_data=0.7)
    x0, noise, sigma = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8), torch.tensor([0.01, 0.3, 2.0, 40.0])
    ours = dm.edm_loss(den, x0, sigma, None, noise)
    lam = (sigma**2 + 0.7**2) / (sigma * 0.7) ** 2  # EDM's lambda(sigma) = 1 / c_out^2
    ref = lam * (den(x0 + sigma.view(-1, 1, 1, 1) * noise, sigma) - x0).pow(2).flatten(1).mean(1)
    assert torch.allclose(ours, ref, rtol=1e-4)


def test_heun_converges_to_the_exact_probability_flow_of_gaussian_data_and_counts_nfe():
    s, calls = 0.8, []

    def ideal(x, sigma, cond=None):  # E[x0 | x] for x0 ~ N(0, s^2 I)
        calls.append(1)
        return s**2 / (s**2 + sigma.view(-1, 1, 1, 1) ** 2) * x

    x = torch.randn(500, 1, 2, 2, generator=torch.Generator().manual_seed(0)) * 80.0
    exact = x * s / (s**2 + 80.0**2) ** 0.5  # the ODE's solution: x(sigma) scales with sqrt(s^2 + sigma^2)
    errors = []
    for nfe in (17, 65):
        calls.clear()
        sigmas = dm.karras_sigmas(torch.full((500,), 0.002), torch.full((500,), 80.0), dm.heun_levels(nfe))
        out = dm.heun_sample(ideal, x, sigmas)
        assert len(calls) == nfe
        errors.append(float((out - exact).abs().max() / exact.abs().max()))
    assert errors[1] < 0.03 and errors[1] < errors[0] / 4  # second order: 4x the steps, well over 4x smaller


def test_ddpm_elbo_weights_match_ho_et_al_and_ddim_is_exact_for_a_point_mass():
    sched = dm.ddpm_scheduler(200, "linear")
    ab = sched.alphas_cumprod
    w = dm.ddpm_elbo_weights(ab)
    t = 50
    beta, alpha = sched.betas[t], 1 - sched.betas[t]
    var = beta * (1 - ab[t - 1]) / (1 - ab[t])
    assert torch.isclose(w[t], beta**2 / (2 * var * alpha * (1 - ab[t])), rtol=1e-4)
    # with the exact eps of a point mass at c, deterministic DDIM lands on c from any start
    c = torch.full((3, 1, 4, 4), 0.3)
    x_t = torch.randn(3, 1, 4, 4)
    eps_model = lambda x, tt: (x - ab[tt].sqrt().view(-1, 1, 1, 1) * c) / (1 - ab[tt]).sqrt().view(-1, 1, 1, 1)  # noqa: E731
    assert torch.allclose(dm.ddim_sample(eps_model, x_t, 200, 10), c, atol=1e-4)
    x0 = torch.randn(3, 1, 4, 4)
    tt, eps = torch.tensor([0, 70, 199]), torch.randn(3, 1, 4, 4)
    assert torch.allclose(dm.predict_x0(dm.q_sample(x0, tt, eps, ab), tt, eps, ab), x0, atol=1e-4)
    points = torch.randn(3, 16, 3)  # samples of any rank: point sets (B, N, 3), flat vectors (B, D)
    for x in (points, points.flatten(1)):
        noise = torch.randn_like(x)
        assert torch.allclose(dm.predict_x0(dm.q_sample(x, tt, noise, ab), tt, noise, ab), x, atol=1e-4)
        assert torch.allclose(dm.q_sample(x, tt, noise, ab)[1], ab[70].sqrt() * x[1] + (1 - ab[70]).sqrt() * noise[1])


def test_unet_shapes_and_features():
    net = dm.SmallUNet(3, 2, (16, 32, 32), cond_dim=2)
    out, feats = net(torch.randn(2, 3, 16, 16), torch.rand(2), torch.randn(2, 2), features=True)
    assert out.shape == (2, 2, 16, 16)
    assert feats["mid"].shape == (2, 32, 4, 4) and feats["dec0"].shape == (2, 16, 16, 16)
    assert feats["dec1"].shape == (2, 32, 8, 8) and feats["enc2"].shape == (2, 32, 4, 4)


def test_frechet_distance_of_1d_gaussians():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0, 1, (200000, 1)), rng.normal(2, 3, (200000, 1))
    assert abs(dm.frechet_distance(a, b) - (4 + (3 - 1) ** 2)) < 0.1
    assert dm.frechet_distance(a, a) < 1e-6
