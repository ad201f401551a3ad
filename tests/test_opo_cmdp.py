"""OPO-CMDP's mechanism on tiny CMDPs: backward induction against brute force, mirror descent reaching the optimum,
the oracles recovering the truth, the bonus, inverse-gap weighting and the slope estimate."""

from __future__ import annotations

import itertools

import numpy as np

from models import opo_cmdp as o


def _tiny(rng, h=2, s=2, a=2):
    loss = rng.random((h, s, a))
    kernel = rng.random((h, s, a, s))
    return loss, kernel / kernel.sum(-1, keepdims=True)


def test_optimal_backup_equals_brute_force_over_deterministic_policies():
    loss, kernel = _tiny(np.random.default_rng(0))
    best = np.inf
    for actions in itertools.product(range(2), repeat=4):
        pi = np.zeros((2, 2, 2))
        for k, act in enumerate(actions):
            pi[k // 2, k % 2, act] = 1.0
        best = min(best, o.policy_value(pi, loss, kernel))
    assert np.isclose(o.optimal_value(loss, kernel), best)


def test_mirror_descent_approaches_the_optimal_value():
    loss, kernel = _tiny(np.random.default_rng(1), h=3, s=3, a=3)
    gaps = [o.policy_value(o.mirror_descent(loss, kernel, k, 2.0), loss, kernel) - o.optimal_value(loss, kernel)
            for k in (1, 10, 200)]
    assert gaps[0] > gaps[1] > gaps[2] >= -1e-12 and gaps[2] < 1e-3


def test_oracles_recover_the_true_members_and_bonus_vanishes():
    p = o.Params(d=3, horizon=2, grid=[(3, 2)], n_f=6, n_p=6, episodes=10)
    rng = np.random.default_rng(2)
    w, u, f_true, p_true = o.make_classes(p, 3, 2, rng)
    learner = o.Learner(6, 6, beta=1.0)
    learner.oracle()
    f_all, p_all = o.class_values(w, u, rng.normal(size=3))
    assert (learner.bonus(f_all, p_all) >= 0).all() and learner.bonus(f_all, p_all).max() > 0
    for _ in range(3000):
        c = rng.normal(size=3)
        f_all, p_all = o.class_values(w, u, c)
        h, s, a = rng.integers(2), rng.integers(3), rng.integers(2)
        loss = float(rng.random() < f_all[f_true, h, s, a])
        nxt = int(rng.choice(3, p=p_all[p_true, h, s, a]))
        learner.observe(f_all, p_all, h, s, a, loss, nxt)
    learner.oracle()
    assert learner.f_hat == f_true and learner.p_hat == p_true
    assert learner.f_set.sum() == 1 and learner.p_set.sum() == 1
    assert np.allclose(learner.bonus(f_all, p_all), 0.0)  # singleton version spaces: no optimism left
    assert learner.oracle_calls == 4


def test_inverse_gap_weighting():
    q = np.array([[[0.2, 0.5, 0.9]]])
    p = o.igw(q, 10.0)
    assert np.isclose(p.sum(), 1.0) and p[0, 0].argmax() == 0
    assert np.isclose(p[0, 0, 1], 1 / (3 + 10 * 0.3)) and np.allclose(o.igw(q, 0.0), 1 / 3)


def test_loglog_slope_of_a_sqrt_curve():
    t = np.arange(1, 2001)
    assert abs(o.loglog_slope(3 * np.sqrt(t)) - 0.5) < 1e-6
    assert abs(o.loglog_slope(np.log(t + 1) * 0 + 5.0)) < 1e-6  # saturated regret: slope 0
