"""icl_bayes_gap: the exact Bayes reference checked against values computed another way, and the identity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal
from sklearn.linear_model import Ridge

from models import icl_bayes_gap as m


def _types(d=3):
    p = m.Params(d=d, types=[{"mu": 0.0, "tau": 1.0, "sigma": 0.1, "pi": 0.5},
                             {"mu": 2.0, "tau": 0.25, "sigma": 0.5, "pi": 0.3},
                             {"mu": -2.0, "tau": 1.0, "sigma": 0.25, "pi": 0.2}],
                 train_M=[8], train_N=[4], n_test_max=8, fit_n_max=4)
    return m.type_table(p)


def test_posterior_and_marginal_likelihood_match_dense_formulas():
    rng = np.random.default_rng(0)
    d, n = 3, 6
    x, y = rng.standard_normal((2, n, d)), rng.standard_normal((2, n))
    mu, cov0, s2 = np.array([0.5, -1.0, 2.0]), np.diag([1.0, 0.5, 2.0]) + 0.1, 0.3
    mean, cov, ll = m.gaussian_posterior(*m.prefix_stats(x, y, n), n, mu, cov0, s2)
    for p_ in range(2):
        # marginal: y ~ N(X mu, s2 I + X cov0 X^T), as an n x n density (no Woodbury)
        dense = multivariate_normal(x[p_] @ mu, s2 * np.eye(n) + x[p_] @ cov0 @ x[p_].T).logpdf(y[p_])
        assert np.isclose(ll[p_], dense, rtol=1e-10)
        # posterior mean with an isotropic prior = ridge on the residual y - X mu with alpha = s2 / tau^2
        iso_mean, _, _ = m.gaussian_posterior(*m.prefix_stats(x[p_ : p_ + 1], y[p_ : p_ + 1], n), n, mu,
                                              2.0 * np.eye(d), s2)
        ridge = Ridge(alpha=s2 / 2.0, fit_intercept=False).fit(x[p_], y[p_] - x[p_] @ mu)
        assert np.allclose(iso_mean[0], mu + ridge.coef_, atol=1e-8)
        # posterior covariance: the conditional of the joint Gaussian (w, y)
        joint = np.linalg.inv(s2 * np.eye(n) + x[p_] @ cov0 @ x[p_].T)
        assert np.allclose(cov[p_], cov0 - cov0 @ x[p_].T @ joint @ x[p_] @ cov0, atol=1e-10)


def test_bayes_predictor_matches_importance_sampling_over_the_prior():
    """f*(x_q) = E[x_q^T w | prompt]: estimate it by weighting prior draws of (type, w) by their likelihood."""
    types, rng = _types(), np.random.default_rng(1)
    s = m.sample_prompts(types, 3, 3, rng)
    b = m.bayes_predict(types, *m.prefix_stats(s["x"], s["y"], 3), 3, s["x"][:, -1])
    draws = 400_000
    k = rng.choice(3, size=draws, p=types["pi"])
    w = types["mu"][k] + types["tau"][k, None] * rng.standard_normal((draws, 3))  # (D, d)
    for p_ in range(3):
        resid = s["y"][p_, :3, None] - s["x"][p_, :3] @ w.T  # (3, D)
        logw = -0.5 * (resid ** 2).sum(0) / types["sigma"][k] ** 2 - 3 * np.log(types["sigma"][k])
        weight = np.exp(logw - logw.max())
        estimate = (weight * (w @ s["x"][p_, -1])).sum() / weight.sum()
        assert abs(estimate - b["f"][p_]) < 0.05 * (1 + abs(b["f"][p_]))
        posterior_k = np.bincount(k, weights=weight, minlength=3) / weight.sum()
        assert np.allclose(posterior_k, b["omega"][p_], atol=0.03)


def test_zero_context_predictor_is_the_prior_mean_and_pv_matches_closed_form():
    types, rng = _types(), np.random.default_rng(2)
    s = m.sample_prompts(types, 20000, 8, rng)
    b0 = m.bayes_predict(types, *m.prefix_stats(s["x"], s["y"], 0), 0, s["x"][:, -1])
    assert np.allclose(b0["omega"], types["pi"]) and np.allclose(b0["f"], s["x"][:, -1] @ (types["pi"] @ types["mu"]))
    # Monte Carlo PV(n) agrees with the average posterior predictive variance (two estimates of one number)
    b = m.bayes_predict(types, *m.prefix_stats(s["x"], s["y"], 8), 8, s["x"][:, -1])
    mc = (s["y"][:, -1] - b["f"]) ** 2
    assert abs(mc.mean() - b["pred_var"].mean()) < 4 * mc.std() / np.sqrt(len(mc))
    # knowing the type never hurts: PV_task <= PV, and the type posterior concentrates with n
    f_k = b["per_type"][np.arange(20000), s["type"]]
    assert ((s["y"][:, -1] - f_k) ** 2).mean() <= mc.mean() + 1e-9
    assert b["omega"][np.arange(20000), s["type"]].mean() > b0["omega"][np.arange(20000), s["type"]].mean()


def test_risk_identity_is_exact_per_sample_and_cross_term_vanishes_for_the_bayes_predictor():
    rng = np.random.default_rng(3)
    y, f_star, f_model = rng.standard_normal((3, 1000))
    r = m.risk_identity(y, f_star, f_model)
    assert np.isclose(r["risk"] - r["bg"] - r["pv"], r["residual"])  # algebraic, any predictors
    types = _types()
    s = m.sample_prompts(types, 20000, 4, rng)
    b = m.bayes_predict(types, *m.prefix_stats(s["x"], s["y"], 4), 4, s["x"][:, -1])
    # a model that is any function of the prompt: the cross term is zero in expectation
    r = m.risk_identity(s["y"][:, -1], b["f"], 0.7 * b["f"] + np.tanh(s["x"][:, -1, 0]))
    assert abs(r["residual"]) < 4 * r["residual_se"]


def test_mix_decay_fit_recovers_rate_and_pooled_prior_moments():
    n = np.arange(17)
    a, b, r2 = m.mix_decay_fit(np.exp(1.5 - 0.4 * n), 16)
    assert np.isclose(a, 1.5) and np.isclose(b, 0.4) and np.isclose(r2, 1.0)
    types, rng = _types(), np.random.default_rng(4)
    s = m.sample_prompts(types, 200_000, 1, rng)
    mean, cov, s2 = m.pooled_prior(types)
    assert np.allclose(s["w"].mean(0), mean, atol=0.02) and np.allclose(np.cov(s["w"].T), cov, atol=0.05)
    assert np.isclose(s2, types["pi"] @ types["sigma"] ** 2)


def test_uniform_attention_is_a_permutation_invariant_mean_over_the_context():
    torch.manual_seed(0)
    net = m.ICLTransformer(3, 8, 2, "uniform")
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6))
    out = net(*m.make_tokens(x, y, 5, 5))
    perm = np.r_[rng.permutation(5), 5]  # shuffle the context, keep the query last
    assert torch.allclose(out, net(*m.make_tokens(x[:, perm], y[:, perm], 5, 5)), atol=1e-5)
    # padding beyond n is ignored; duplicating every context pair leaves a 1/n mean unchanged
    assert torch.allclose(out, net(*m.make_tokens(x, y, 5, 9)), atol=1e-5)
    dup_x, dup_y = np.concatenate([x[:, :5], x[:, :5], x[:, 5:]], 1), np.concatenate([y[:, :5], y[:, :5], y[:, 5:]], 1)
    assert torch.allclose(out, net(*m.make_tokens(dup_x, dup_y, 10, 10)), atol=1e-5)


@pytest.mark.parametrize("arch", m.ARCHS)
def test_last_block_on_the_query_only_matches_every_token_updated(arch):
    """The last block updates only token 0 (the only one the head reads): same prediction and same gradients as
    updating every token, for both architectures."""
    torch.manual_seed(0)
    net = m.ICLTransformer(3, 8, 2, arch)
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((4, 7, 3)), rng.standard_normal((4, 7))
    tokens, mask = m.make_tokens(x, y, 5, 6)

    def full(tokens, mask):
        h = net.embed(tokens)
        for block in net.blocks:
            h = block(h, mask)
        return net.head(h[:, 0])[:, 0]

    out, ref = net(tokens, mask), full(tokens, mask)
    assert out.shape == (4,) and torch.allclose(out, ref, atol=1e-6)
    g = torch.autograd.grad(out.square().sum(), list(net.parameters()), allow_unused=True)
    g_ref = torch.autograd.grad(ref.square().sum(), list(net.parameters()), allow_unused=True)
    for a, b in zip(g, g_ref, strict=True):
        assert (a is None and (b is None or not b.abs().any())) or torch.allclose(a, b, atol=1e-6)


def test_plateau_rule_keeps_the_best_check_and_stops_after_patience_checks_without_a_real_improvement():
    stop = m.Plateau(patience=2, rel_tol=0.01)
    kept = [stop.update(v) for v in (1.0, 0.8, 0.795, 0.9, 0.7, 0.699, 0.75)]
    assert kept == [True, True, False, False, True, False, False]  # 0.795 and 0.699 are within 1% of the best
    assert stop.stopped and stop.best == 0.7 and len(stop.history) == 7
    fresh = m.Plateau(patience=2, rel_tol=0.01)
    assert [fresh.update(v) for v in (1.0, 2.0)] == [True, False] and not fresh.stopped


def test_validation_mse_reads_each_model_on_prompts_of_its_own_length():
    p = m.Params(d=3, types=[{"mu": 0.0, "tau": 1.0, "sigma": 0.1, "pi": 1.0}], train_M=[8], train_N=[2, 4],
                 n_test_max=4, fit_n_max=2, width=8)
    torch.manual_seed(0)
    models = m.Models(p)
    s = {n: m.sample_prompts(m.type_table(p), 16, n, np.random.default_rng(n)) for n in (2, 4)}
    val = {n: (*m.make_tokens(v["x"], v["y"], n, n), torch.tensor(v["y"][:, -1], dtype=torch.float32))
           for n, v in s.items()}
    out = m.validation_mse(models, val)
    assert set(out) == set(models.names)
    net = models.nets["uniform_M8_N4"]
    assert np.isclose(out["uniform_M8_N4"], float(((net(*val[4][:2]) - val[4][2]) ** 2).mean()))
