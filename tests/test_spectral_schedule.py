"""Spectral schedules on tiny inputs: the spectrum's normalisation, the power-law fit, the bounds' SNR meaning,
and the redundancy count."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_cifar10_and_imagenet64_loaders_on_fixtures(tmp_path):
    """Full profile: CIFAR-10 python pickles (data_batch_*) and downsampled-ImageNet npz, both channel-major."""
    import pickle

    rng = np.random.default_rng(0)
    raw = [rng.integers(0, 256, (3, 3072), dtype=np.uint8) for _ in range(2)]
    for i, data in enumerate(raw, 1):
        with open(tmp_path / f"data_batch_{i}", "wb") as fh:
            pickle.dump({b"data": data, b"labels": [0, 1, 2], b"batch_label": b"x"}, fh)
    with open(tmp_path / "test_batch", "wb") as fh:  # not read: training images only
        pickle.dump({b"data": raw[0], b"labels": [0, 1, 2]}, fh)
    x = ss.load_cifar10(tmp_path)
    assert x.shape == (6, 3, 32, 32) and x.min() >= -1 and x.max() <= 1
    assert np.allclose(x[4, 2, 0, :4], raw[1][1, 2048:2052] / 127.5 - 1)  # image 1 of batch 2, blue channel, row 0
    with pytest.raises(FileNotFoundError):
        ss.load_cifar10(tmp_path / "missing")
    data = rng.integers(0, 256, (2, 12288), dtype=np.uint8)
    np.savez(tmp_path / "train_data_batch_1.npz", data=data, labels=np.array([5, 7]))
    y = ss.load_imagenet64(tmp_path / "train_data_batch_1.npz")
    assert y.shape == (2, 3, 64, 64) and np.allclose(y[1, 1, 3, 5], data[1, 4096 + 3 * 64 + 5] / 127.5 - 1)
