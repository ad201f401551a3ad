"""Spectral schedules on tiny inputs: the spectrum's normalisation, the power-law fit, the bounds' SNR meaning,
and the redundancy count."""

from __future__ import annotations

import numpy as np

from models import spectral_schedule as ss


def test_white_noise_has_flat_normalised_power_sigma_squared():
    x = np.random.default_rng(0).normal(0, 0.3, (400, 1, 16, 16))
    s = ss.radial_spectrum(x).mean(0)  # (9,)
    assert np.allclose(s, 0.09, rtol=0.08)


def test_constant_image_puts_all_power_at_dc():
    s = ss.radial_spectrum(np.full((1, 3, 8, 8), 0.5))[0]
    assert np.isclose(s[0], 64 * 0.25) and np.allclose(s[1:], 0)


def test_power_law_fit_recovers_codes_exactly_and_on_random_fields():
    f = np.arange(0, 9).clip(min=1)
    exact = np.exp(1.3 - 2.5 * np.log(f))[None]
    assert np.allclose(ss.fit_power_law(exact), [[1.3, 2.5]])
    rng = np.random.default_rng(1)
    x = ss.gaussian_random_fields(300, 16, np.full(300, 0.5), np.full(300, 3.0), rng)
    codes = ss.fit_power_law(ss.radial_spectrum(x))
    # log of an averaged chi-square ring is biased low by ~E[log Exp]-ish; the slope is unbiased
    assert abs(np.median(codes[:, 1]) - 3.0) < 0.2 and abs(np.median(codes[:, 0]) - 0.5) < 0.5


def test_bounds_have_their_snr_meaning():
    spectrum = np.array([[4.0, 1.0, 0.1, 0.01, 0.002]])
    lo, hi = ss.noise_bounds(spectrum, kappa_hi=0.05, kappa_lo=20.0, q=1e-4)
    assert np.isclose(spectrum.max() / hi[0] ** 2, 0.05)  # above sigma_max every ring has SNR < kappa_hi
    assert np.isclose(spectrum.min() / lo[0] ** 2, 20.0)  # below sigma_min every ring has SNR > kappa_lo
    lo_q, _ = ss.noise_bounds(spectrum, 0.05, 20.0, q=0.05)
    assert np.isclose(lo_q[0], 0.05)  # quantisation floor
    codes = np.array([[np.log(4.0), 2.0]])
    lo_c, hi_c = ss.code_bounds(codes, 16, 0.05, 20.0, 1e-6)
    assert np.isclose(hi_c[0] ** 2, 4.0 / 0.05) and np.isclose(lo_c[0] ** 2, 4.0 * 8.0**-2 / 20.0)


def test_steeper_spectra_get_lower_sigma_min():
    rng = np.random.default_rng(2)
    x = ss.gaussian_random_fields(64, 16, np.zeros(64), np.r_[np.full(32, 1.0), np.full(32, 4.0)], rng)
    lo, hi = ss.noise_bounds(ss.radial_spectrum(x), 0.05, 20.0, 1e-6)
    assert np.median(lo[32:]) < 0.1 * np.median(lo[:32])


def test_redundancy_counts_levels_outside_each_range():
    sigmas = np.array([80.0, 10.0, 1.0, 0.1, 0.002])
    assert ss.redundancy(sigmas, np.array([0.05, 0.001]), np.array([20.0, 100.0])) == (2 / 5 + 0) / 2
