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


def test_carried_policy_is_exp_of_minus_eta_cumulative_q_hat():
    """Issue 21: pi_t proportional to exp(-eta sum_{i<t} Q_hat_i), Q_hat_i of pi_i in the model of i's epoch;
    carried over two epochs (3 episodes in one model, 2 in the next) it equals the replayed sum."""
    rng = np.random.default_rng(3)
    (l1, k1), (l2, k2), eta = _tiny(rng, 3, 3, 2), _tiny(rng, 3, 3, 2), 0.7
    pi, q_sum = np.full(l1.shape, 0.5), np.zeros(l1.shape)
    for i in range(5):
        q_sum += o.q_values(*((l1, k1) if i < 3 else (l2, k2)), pi)[0]
        e = np.exp(-eta * q_sum)
        pi = e / e.sum(-1, keepdims=True)
    carried = o.carry_policy(np.full((1, *l1.shape), 0.5), l1[None], k1[None], np.array([3]), eta)
    carried = o.carry_policy(carried, l2[None], k2[None], np.array([2]), eta)[0]
    assert np.allclose(carried, pi, atol=1e-12)


def test_batched_carry_equals_one_context_at_a_time():
    rng = np.random.default_rng(4)
    models = [_tiny(rng, 2, 3, 3) for _ in range(3)]
    loss, kernel = np.stack([m[0] for m in models]), np.stack([m[1] for m in models])
    steps, pi0 = np.array([0, 2, 5]), np.full(loss.shape, 1 / 3)
    batched = o.carry_policy(pi0, loss, kernel, steps, 1.3)
    for j in range(3):
        assert np.allclose(batched[j], o.mirror_descent(loss[j], kernel[j], int(steps[j]), 1.3))
        assert np.allclose(o.q_values(loss, kernel, batched)[0][j], o.q_values(loss[j], kernel[j], batched[j])[0])


def test_run_gives_five_timed_blocks_and_nonnegative_regret():
    p = o.Params(d=2, horizon=2, grid=[(3, 2)], n_f=4, n_p=4, episodes=12, seeds=1)
    rng = np.random.default_rng(5)
    w, u, f_true, p_true = o.make_classes(p, 3, 2, rng)
    contexts = rng.normal(size=(12, 2))
    for algo in o.ALGOS:
        res = o.run(p, algo, w, u, f_true, p_true, contexts, np.random.default_rng(6))
        assert res["block_ms"].shape == (5,) and (res["block_ms"] > 0).all()
        assert (res["regret"] >= -1e-12).all() and res["oracle_calls"] == 2 * 5  # t = 0, 1, 2, 4, 8


def test_epoch_model_is_the_per_context_optimistic_model():
    p = o.Params(d=3, horizon=2, grid=[(3, 2)], n_f=6, n_p=6, episodes=10)
    rng = np.random.default_rng(7)
    w, u, _, _ = o.make_classes(p, 3, 2, rng)
    learner = o.Learner(6, 6, beta=0.5)
    learner.loss_f, learner.loss_p = rng.random(6), rng.random(6)
    learner.oracle()
    contexts = rng.normal(size=(4, 3))
    for optimistic in (True, False):
        loss, kernel = o.epoch_model(contexts, learner, w, u, optimistic)
        for j, c in enumerate(contexts):
            f_all, p_all = o.class_values(w, u, c)
            f_hat = f_all[learner.f_hat]
            want = np.maximum(0.0, f_hat - learner.bonus(f_all, p_all)) if optimistic else f_hat
            assert np.allclose(loss[j], want) and np.allclose(kernel[j], p_all[learner.p_hat])


def test_late_over_early_reads_learning():
    """A sqrt(t) regret curve's per-episode regret falls to about a sixth; a flat one stays at 1; the premise is
    declared on it."""
    t = np.arange(1, 1001)
    assert 0.1 < o.late_over_early(1 / np.sqrt(t)) < 0.2
    assert o.late_over_early(np.full(1000, 0.3)) == 1.0
    assert [c.name for c in o.PAPER.claim.premises] == ["opo_learns", "greedy_misses_truth"]


def test_trap_world_wrong_members_differ_from_the_truth_only_at_the_last_lock_action():
    p = o.Params(d=3, horizon=3, grid=[(4, 3)], n_f=5, n_p=3, episodes=10, trap=3.0)
    w, u, f_true, _ = o.make_classes(p, 4, 3, np.random.default_rng(8))
    differs = (w != w[f_true]).any(-1).any(0)  # (H, S, A): where some member disagrees with the truth
    assert differs.sum() == 1 and differs[-1, 0].any()
    lock = int(np.flatnonzero(differs[-1, 0])[0])
    assert w[f_true, -1, 0, lock, -1] == -3.0 and (np.delete(w[:, -1, 0, lock, -1], f_true) == 3.0).all()
    c = np.r_[np.zeros(2), 1.0]  # the intercept coordinate is 1
    _, kernel = o.class_values(w, u, c)
    stay = kernel[:, :, 0, :, 0]  # (|P|, H, A): probability of staying in state 0
    assert (stay.max(-1) > 0.99).all() and (np.sort(stay, -1)[..., -2] < 0.01).all()  # one lock action a layer
    tolled, _, _, _ = o.make_classes(p.model_copy(update={"toll": 0.5}), 4, 3, np.random.default_rng(8))
    added = tolled[..., -1] - w[..., -1]  # (|F|, H, S, A): the toll on the intercept, the same in every member
    locks = kernel[0, :, 0, :, 0].argmax(-1)  # (H,): each layer's lock action
    assert (added[:, np.arange(2), 0, locks[:2]] == 0.5).all() and np.count_nonzero(added) == 5 * 2
    assert (tolled[..., :-1] == w[..., :-1]).all()


def _lock_openings(p, algo, world_seed, monkeypatch):
    """One run in a seeded tolled-lock world (|S|, |A| = 5, 3): the expected number of episodes whose policy opens
    the lock (walks the lock's path and plays its last action: the only data that tells the truth from the wrong
    members), and whether the run's last ERMs are the truth."""
    rng = np.random.default_rng(world_seed)
    w, u, f_true, p_true = o.make_classes(p, 5, 3, rng)
    contexts = rng.normal(0, 1, (p.episodes, p.d)) / np.sqrt(p.d)
    contexts[:, -1] = 1.0
    lock = o.class_values(w, u, contexts[0])[1][p_true, :, 0, :, 0].argmax(-1)  # (H,): the action that stays in 0
    policies, value = [], o.policy_value
    monkeypatch.setattr(o, "policy_value", lambda pi, loss, kernel: policies.append(pi) or value(pi, loss, kernel))
    res = o.run(p, algo, w, u, f_true, p_true, contexts, np.random.default_rng(world_seed + 100))
    monkeypatch.undo()
    opens = sum(np.prod(pi[np.arange(p.horizon), 0, lock]) for pi in policies)
    return float(opens), res["identified"]


def test_the_toll_moves_greedy_off_the_lock_and_opo_still_opens_it(monkeypatch):
    """The smoke world's mechanism, in 8 seeded worlds of its shape (H = 4, |A| = 3, its margin, trap and toll,
    100 episodes). With the toll every wrong member ranks the lock's path below the other actions, so greedy's
    carried policy leaves it within its first episodes: it opens the lock about as often as its first near-uniform
    episodes do by chance (1/81 each) and never identifies the truth. Without the toll the wrong member is
    indifferent to the path and greedy keeps walking it. OPO's bonus at the unseen lock action sends it there in
    the tolled worlds, and it identifies the truth."""
    kw = dict(d=4, horizon=4, grid=[(5, 3)], n_f=8, n_p=4, episodes=100, trap=3.0, margin=0.25)
    tolled, free = o.Params(**kw, toll=0.5), o.Params(**kw, toll=0.0)
    greedy = [_lock_openings(tolled, "greedy", s, monkeypatch) for s in range(8)]
    assert all(opens < 0.1 and found == 0.0 for opens, found in greedy)
    untolled = [_lock_openings(free, "greedy", s, monkeypatch)[0] for s in range(8)]
    assert np.mean(untolled) > 5 * np.mean([opens for opens, _ in greedy]) and max(untolled) > 1
    opo = [_lock_openings(tolled, "opo", s, monkeypatch) for s in range(8)]
    assert all(opens > 10 and found == 1.0 for opens, found in opo)
