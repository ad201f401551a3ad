"""PB-SAC's mechanism on tiny inputs: the mixing-time estimate, the KL, the bounds, the posterior critic, the policy
density, and exact resume of the replay chain."""

from __future__ import annotations

import math

import numpy as np
import torch

from models import pb_sac
from models.common.rl import Replay
from models.common.threads import torch_threads


def test_integrated_autocorr_time_of_ar1_matches_closed_form():
    rng = np.random.default_rng(0)
    phi, n = 0.8, 200_000
    x = np.zeros(n)
    noise = rng.standard_normal(n)
    for t in range(1, n):
        x[t] = phi * x[t - 1] + noise[t]
    tau = pb_sac.integrated_autocorr_time(x)
    assert abs(tau - (1 + phi) / (1 - phi)) < 0.1 * 9  # exact value 9
    assert abs(pb_sac.integrated_autocorr_time(noise) - 1.0) < 0.1
    assert pb_sac.mixing_time(noise, x) == 2 * tau


def test_kl_is_zero_at_init_and_matches_torch_distributions():
    torch.manual_seed(0)
    critic = pb_sac.Critic(3, 1, 8, prior_sigma=0.05)
    assert float(critic.kl(0.05).detach()) < 1e-6
    with torch.no_grad():
        for q, ls in zip(critic.mu(), critic.log_sigma, strict=True):
            q.add_(0.02 * torch.randn_like(q))
            ls.add_(0.3 * torch.randn_like(ls))
    mu, sig = critic.flat_mu(), torch.cat([ls.exp().reshape(-1) for ls in critic.log_sigma])
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mu, sig),
                                            torch.distributions.Normal(critic.theta0, 0.1)).sum()
    assert torch.allclose(critic.kl(0.1), ref, rtol=1e-4)


def test_bounds_reduce_and_order_as_the_theory_says():
    emp, kl, n, delta = 0.05, 3.0, 2000, 0.05
    iid = pb_sac.markov_bound(emp, kl, n, delta)
    assert iid == emp + math.sqrt((kl + math.log(2 * math.sqrt(n) / delta)) / (2 * n))
    # Markov dependence (t_mix > 1/9) shrinks n_eff and loosens the bound
    assert pb_sac.markov_bound(emp, kl, n / (9 * 5), delta) > iid
    budget = (kl + math.log(2 * math.sqrt(n) / delta)) / n
    q = pb_sac.kl_inverse(emp, budget)
    kl_bern = emp * math.log(emp / q) + (1 - emp) * math.log((1 - emp) / (1 - q))
    assert abs(kl_bern - budget) < 1e-6 and q > emp
    assert q <= emp + math.sqrt(budget / 2) + 1e-9  # Pinsker: the kl-inverse is never looser


def test_posterior_critic_collapses_to_its_mean_and_loss_is_bounded():
    torch.manual_seed(1)
    critic = pb_sac.Critic(3, 1, 8, prior_sigma=0.1)
    s, a = torch.randn(5, 3), torch.randn(5, 1)
    mean_q = critic(s, a)  # (5,)
    tiny = critic(s, a, samples=3, sigma=1e-9)  # (3, 5)
    assert tiny.shape == (3, 5) and torch.allclose(tiny, mean_q.expand(3, 5), atol=1e-5)
    wide = critic(s, a, samples=64)
    assert wide.std(0).mean() > 1e-3  # the posterior's weight noise reaches Q
    loss = pb_sac.certified_loss(wide, torch.zeros(5) + 100.0, 10.0)
    assert float(loss.min()) >= 0 and float(loss.max()) <= 1


def test_actor_log_density_matches_tanh_transformed_normal():
    torch.manual_seed(2)
    actor = pb_sac.Actor(3, 2, 16, high=1.0)
    s = torch.randn(6, 3)
    g = torch.Generator().manual_seed(0)
    a, logp = actor(s, g)
    mean, log_std = actor.net(s).chunk(2, -1)
    dist = torch.distributions.TransformedDistribution(
        torch.distributions.Normal(mean, log_std.clamp(-5, 2).exp()), [torch.distributions.TanhTransform()])
    a_safe = a.clamp(-1 + 1e-6, 1 - 1e-6)
    assert torch.allclose(logp, dist.log_prob(a_safe).sum(-1), atol=1e-3)


def test_replay_resume_reproduces_the_chain_exactly():
    def act(obs, row, g):  # depends on the observation and the row's generator, like a policy
        return np.clip(-0.5 * obs[2:3] + (torch.rand(1, generator=g).numpy() - 0.5), -2, 2)

    full = Replay("Pendulum-v1", 30, seed=3, horizon=7)  # several episodes, with resets inside the chain
    full.collect(30, act)
    resumed = Replay("Pendulum-v1", 30, seed=3, horizon=7)
    for key, value in full.state.items():  # a checkpoint taken mid-episode (row 17 of 30)
        resumed.state[key][:17] = value[:17]
    resumed.collect(30, act)
    for key in full.state:
        assert torch.equal(full.state[key], resumed.state[key]), key
    assert int(full.state["episode"][-1]) == 4 and full.state["end"].sum() == 4
    steps, returns = full.episode_returns()
    assert list(steps) == [7, 14, 21, 28] and np.allclose(returns[0], full.state["r"][:7].sum().item())


def test_mujoco_task_replay_resumes_mid_episode():
    """Full profile: MuJoCo (gymnasium's Hopper, the `mujoco` package) through the same resumable replay."""
    def act(obs, row, g):
        return (torch.rand(3, generator=g) * 2 - 1).numpy()

    a = pb_sac.SimReplay("Hopper-v5", 40, seed=1)
    a.collect(40, act)
    b = pb_sac.SimReplay("Hopper-v5", 40, seed=1)
    for k in b.state:  # a checkpoint taken after 20 rows, mid-episode
        b.state[k][:20] = a.state[k][:20]
    b.collect(40, act)
    for k in a.state:
        assert torch.allclose(a.state[k], b.state[k], atol=1e-6, equal_nan=True), k
    assert a.state["sim"].shape[1] == 6 + 6  # Hopper: qpos (6) + qvel (6)


def test_loss_scale_follows_the_q_range_and_certificate_chain_is_whole_reset_episodes(tmp_path):
    """c is loss_scale x (r_max - r_min) / (1 - gamma) from the random policy's rewards written in prepare; the
    certificate chain is whole episodes laid end to end, at least chain_steps long."""
    p = pb_sac.Params(envs=["Pendulum-v1"], ref_episodes=2, eval_episodes=1, loss_scale=0.1, gamma=0.99)
    pb_sac.prepare(p, tmp_path)
    refs = pb_sac.read_table(tmp_path / "refs.parquet")
    lo, hi = float(refs["reward_min"][0]), float(refs["reward_max"][0])
    assert -16.3 <= lo < hi <= 0.0  # Pendulum's reward -(theta^2 + 0.1 thdot^2 + 0.001 u^2)
    assert math.isclose(pb_sac.loss_scale(p, refs, 0), 0.1 * (hi - lo) / 0.01)
    # a critic off by a tenth of the Q range no longer saturates the loss at 1 (it did with c = 10)
    c = pb_sac.loss_scale(p, refs, 0)
    assert pb_sac.certified_loss(torch.tensor([0.05 * (hi - lo) / 0.01]), torch.tensor([0.0]), c).item() < 0.3
    torch.manual_seed(0)
    actor = pb_sac.Actor(3, 1, 8, 2.0)
    chain = pb_sac._flat(pb_sac.run_episodes("Pendulum-v1", pb_sac._policy(actor, False, 0), [1, 2, 3]))
    assert len(chain["r"]) == 600 and torch.equal(chain["s"][1:200], chain["s2"][:199])  # episode-major, whole


def test_mixing_time_of_a_long_ar1_chain_gives_an_informative_n_eff():
    """On an AR(1) chain with phi = 0.9 (tau = 19), n_eff = n / (9 t_mix) grows linearly with the chain's length:
    a chain of 2,000 steps leaves n_eff near 6, one of 40,000 near 120."""
    rng = np.random.default_rng(0)
    n_eff = {}
    for n in (2000, 40000):
        x = np.zeros(n)
        for t in range(1, n):
            x[t] = 0.9 * x[t - 1] + rng.standard_normal()
        n_eff[n] = n / (9 * pb_sac.mixing_time(x))
    assert 3 < n_eff[2000] < 10 and 80 < n_eff[40000] < 160


def test_every_network_is_its_own_arm_and_unclipped_by_default():
    """Actor, critic 1, critic 2 and temperature of each agent are separate arms (no clip couples the actor's or the
    temperature's update to a critic's gradient norm); every trainable parameter is in exactly one."""
    from tasks.context import _arm_groups

    p = pb_sac.Params(hidden=8)
    model = pb_sac._build(p, "Pendulum-v1")
    arms = pb_sac.network_arms(model)
    assert sorted(arms) == sorted(f"{a}/{n}" for a in pb_sac.AGENTS for n in ("actor", "q1", "q2", "alpha"))
    groups = _arm_groups(model, arms, float(p.grad_clip or 0.0))
    assert len(groups) == 8 and all(g["max_norm"] == 0.0 for g in groups)
    assert {id(q) for g in groups for q in g["params"]} == {id(q) for q in model.parameters() if q.requires_grad}
    assert any("log_sigma" in n for n, _ in model["pbsac"].q1.named_parameters())  # rho's sigma trains with critic 1


def test_critic_in_units_of_c_scales_q_and_prior_mu_is_the_init():
    torch.manual_seed(3)
    plain = pb_sac.Critic(3, 1, 8, prior_sigma=0.05)
    torch.manual_seed(3)
    scaled = pb_sac.Critic(3, 1, 8, prior_sigma=0.05, out_scale=160.0)
    s, a = torch.randn(4, 3), torch.randn(4, 1)
    assert torch.allclose(scaled(s, a), 160.0 * plain(s, a))
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.allclose(scaled(s, a, samples=2, generator=g1), 160.0 * plain(s, a, samples=2, generator=g2))
    for q, q0 in zip(scaled.mu(), scaled.prior_mu(), strict=True):
        assert torch.equal(q, q0)
    with torch.no_grad():
        scaled.layers[-1].bias.add_(1.0)
    assert scaled.prior_mu()[-1][0].item() != scaled.layers[-1].bias[0].item()  # theta0 is a copy, not a view
    p = pb_sac.Params(hidden=8, critic_in_c=True)
    model = pb_sac._build(p, "Pendulum-v1", c=160.0)
    assert all(getattr(model[n], q).out_scale == 160.0 for n in pb_sac.AGENTS
               for q in ("q1", "q2", "q1_target", "q2_target"))


def test_prior_loss_of_the_premise_equals_the_posteriors_at_init_and_ignores_its_moves():
    """posterior_learned compares the posterior's empirical loss with its prior's on the same chain and targets: at
    init (rho = pi_0) they coincide; moving rho's mean changes only the posterior's."""
    p = pb_sac.Params(hidden=8, cert_samples=4, sigma_grid=[0.03], prior_sigma=0.03)
    torch.manual_seed(0)
    agent = pb_sac._build(p, "Pendulum-v1", c=50.0)["pbsac"]
    chain = pb_sac._flat(pb_sac.run_episodes("Pendulum-v1", pb_sac._policy(agent.actor, False, 0), [1, 2]))
    val = pb_sac._flat(pb_sac.run_episodes("Pendulum-v1", pb_sac._policy(agent.actor, False, 1), [3]))
    at_init = pb_sac.certify(agent, chain, val, p, 50.0, posthoc=False)
    assert at_init["kl"] < 1e-6 and math.isclose(at_init["emp_loss"], at_init["prior_emp_loss"], rel_tol=1e-5)
    with torch.no_grad():
        agent.q1.layers[-1].bias.add_(-1.0)  # Q shifts by -c: rho moves away from pi_0
    moved = pb_sac.certify(agent, chain, val, p, 50.0, posthoc=False)
    assert moved["kl"] > 100 and moved["emp_loss"] != at_init["emp_loss"]
    assert math.isclose(moved["prior_emp_loss"], at_init["prior_emp_loss"], rel_tol=1e-6)


def test_training_n_eff_counts_the_buffer_or_the_certificate_chain():
    """n_eff = n / (9 t_mix) with t_mix from the buffer's states; n is the buffer's rows (spec) or chain_steps."""
    rng = np.random.default_rng(3)
    states = np.zeros((3000, 3))
    for t in range(1, 3000):
        states[t] = 0.95 * states[t - 1] + rng.standard_normal(3)
    t_mix = pb_sac.mixing_time(*states.T)
    buffer = pb_sac.training_n_eff(pb_sac.Params(chain_steps=100_000), states)
    chain = pb_sac.training_n_eff(pb_sac.Params(chain_steps=100_000, train_n="chain"), states)
    assert math.isclose(buffer, 3000 / (9 * t_mix)) and math.isclose(chain, 100_000 / (9 * t_mix))
    # a posterior 5 nats from its prior, with zero loss: vacuous at the buffer's n_eff (~5), not at the chain's (~150)
    assert pb_sac.markov_bound(0.0, 5.0, buffer, 0.05) > 1 > 0.5 > pb_sac.markov_bound(0.0, 5.0, chain, 0.05)


def test_posterior_moves_from_its_prior_only_at_the_chains_n_eff():
    """Critic 1 trained on the bound (sac_losses) for 100 Adam steps on a fixed batch: at a buffer-scale n_eff (2) the
    complexity term holds it at its prior; at a chain-scale n_eff (100) it moves further and fits the targets
    better (squared error of the posterior mean, deterministic)."""
    out = {}
    with torch_threads(1):
        for n_eff in (2.0, 100.0):
            torch.manual_seed(0)
            p = pb_sac.Params(hidden=16, posterior_samples=4)
            agent = pb_sac.Agent(3, 1, 2.0, p, pb=True)
            g = torch.Generator().manual_seed(1)
            s = torch.randn(128, 3, generator=g)
            b = {"s": s, "a": torch.rand(128, 1, generator=g) * 4 - 2, "r": torch.sin(2 * s[:, 0]),
                 "s2": torch.randn(128, 3, generator=g), "terminal": torch.ones(128),  # y = r: a fixed target
                 "n_eff": torch.full((128,), n_eff), "c": torch.ones(128)}
            with torch.no_grad():
                prior_fit = float(((agent.q1(s, b["a"]) - b["r"]) ** 2).mean())
            opt = torch.optim.Adam(agent.q1.parameters(), lr=1e-2)
            for _ in range(100):
                loss, _ = pb_sac.sac_losses(agent, b, p)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                gain = prior_fit - float(((agent.q1(s, b["a"]) - b["r"]) ** 2).mean())
                out[n_eff] = (float(agent.q1.kl(p.prior_sigma)), gain)
    assert out[100.0][0] > 10 * out[2.0][0]  # the posterior moves much further from its prior (0.45 vs 0.01 nats)
    assert out[100.0][1] > 3 * max(out[2.0][1], 0.0)  # and fits the targets better (0.012 vs 0.002)


def test_fit_yardsticks_score_the_mean_weights_and_the_mean_target_critic():
    """fit_yardsticks scores critic 1's mean weights on the certificate's targets beside a critic predicting the
    chain's mean target: a critic 1 set to output that mean everywhere scores exactly the yardstick, and one shifted
    off it scores worse (the mean minimises the squared error; the shift keeps every loss below the clip)."""
    p = pb_sac.Params(hidden=8, cert_samples=4)
    torch.manual_seed(0)
    agent = pb_sac._build(p, "Pendulum-v1", c=50.0)["pbsac"]
    chain = pb_sac._flat(pb_sac.run_episodes("Pendulum-v1", pb_sac._policy(agent.actor, False, 0), [1, 2]))
    y = pb_sac.soft_target(agent, chain["r"], chain["s2"], chain["terminal"], p.gamma,
                           generator=torch.Generator().manual_seed(7))
    assert float(((y - y.mean()) / 1000.0).abs().max()) < 1.0  # c = 1000 below: no loss reaches the clip
    last = agent.q1.layers[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(float(y.mean()) / agent.q1.out_scale)  # Q = mean target everywhere
    at_mean = pb_sac.fit_yardsticks(agent, chain, p, 1000.0, seed=7)
    assert math.isclose(at_mean["mean_emp_loss"], at_mean["const_emp_loss"], rel_tol=1e-5)
    with torch.no_grad():
        last.bias.add_(20.0 / agent.q1.out_scale)  # Q = mean target + 20
    off = pb_sac.fit_yardsticks(agent, chain, p, 1000.0, seed=7)
    assert off["const_emp_loss"] == at_mean["const_emp_loss"]
    assert math.isclose(off["mean_emp_loss"], off["const_emp_loss"] + 20.0**2 / 1000.0**2, rel_tol=1e-3)
