"""DOIT's mechanism on tiny inputs: the Doob correction tilts an exactly known model to the exact tilted target,
the likelihood-ratio gradient, the weights, the counted evaluations, the data and the D4RL loader."""

from __future__ import annotations

import h5py
import numpy as np
import torch

from models import doit
from models.common.rl import reference_controller


class GaussianEps(torch.nn.Module):
    """The exact eps-predictor of data N(0, 1) under a VP process: x_t ~ N(0, 1), eps = sqrt(1 - abar_t) x_t."""

    def __init__(self, sched: doit.Schedule):
        super().__init__()
        self.sched = sched

    def forward(self, x, t, cond=None):
        return (1 - self.sched.abar[t])[:, None].sqrt() * x


def test_schedule_reaches_noise_and_posterior_is_exact_at_the_end():
    sched = doit.Schedule(20)
    assert sched.abar[-1] < 0.01 and sched.beta.max() < 0.5 and sched.sigma[0] == 0
    x, eps = torch.randn(5, 2), torch.randn(5, 2)
    # x0 and the DDPM mean agree at t = 0: the last step lands on the predicted clean sample
    assert torch.allclose(sched.mean(x, eps, 0), sched.x0(x, eps, 0), atol=1e-5)


def _pretrained_std(sched: doit.Schedule) -> float:
    """Reference by recursion: with the exact eps of N(0, 1) data, x_{t-1} = sqrt(alpha_t) x_t + sigma_t z."""
    var = 1.0
    for t in range(sched.K - 1, -1, -1):
        var = float(1 - sched.beta[t]) * var + float(sched.sigma[t]) ** 2
    return var**0.5


def test_pretrained_sampler_matches_the_variance_recursion():
    sched = doit.Schedule(20)
    g = torch.Generator().manual_seed(0)
    x = doit.ddpm_sample(GaussianEps(sched), torch.randn((4000, 1), generator=g), sched, g)
    assert abs(float(x.mean())) < 0.06 and abs(float(x.std()) - _pretrained_std(sched)) < 0.04


def test_doit_proto_tilts_gaussian_to_exact_target():
    """Data N(0, 1), r(x) = x, alpha = 1: p exp(r) = N(1, 1). The Doob correction moves the mean from 0 to ~1
    without changing the spread; the reward itself is only ever evaluated (never differentiated)."""
    sched = doit.Schedule(20)
    net = GaussianEps(sched)
    calls = []

    def reward(x):
        calls.append(x.requires_grad)
        return x[:, 0]

    g = torch.Generator().manual_seed(1)
    x = doit.doob_sample(net, torch.randn((1500, 1), generator=g), sched,
                         doit.proto_log_h(net, reward, sched, 1.0, 4, g), 16, 1.0, g)
    assert 0.8 < float(x.mean()) < 1.2, float(x.mean())
    assert abs(float(x.std()) - _pretrained_std(sched)) < 0.1  # a shift, not a squeeze
    assert not any(calls)


def test_likelihood_ratio_gradient_recovers_grad_log_h():
    """h(x) = exp(c x): sum_m softmax(c x^(m)) z_m / sigma estimates c (the gradient of log h at mu)."""
    g = torch.Generator().manual_seed(2)
    sigma, c, m = 0.3, torch.tensor([1.5, -0.5]), 20000
    z = torch.randn((1, m, 2), generator=g)
    cand = 0.2 + sigma * z
    w = (cand @ c).softmax(-1)  # (1, M)
    v = (w[..., None] * z).sum(1) / sigma
    # E_h-weighted[z] = sigma c exactly for Gaussian z; the estimate is within Monte-Carlo error
    assert torch.allclose(v[0], c, atol=0.1)


def test_practical_weights_are_standardised_and_use_one_jump_x0():
    sched = doit.Schedule(10)
    seen = []

    def reward(x0, cond):
        seen.append(x0)
        return x0[:, 0] * 3 + 7

    log_h = doit.practical_log_h(reward, sched, tau=2.0, cond=torch.zeros(2, 3))
    cand, eps = torch.randn(2, 5, 1) * 0.1, torch.randn(2, 1) * 0.1
    lh = log_h(cand, eps, 4)
    assert torch.allclose(lh.mean(1), torch.zeros(2), atol=1e-5)
    assert torch.allclose(lh.std(1), torch.full((2,), 0.5), atol=1e-4)  # unit std / tau
    expected = sched.x0(cand, eps[:, None], 4).clamp(-1, 1).reshape(10, 1)
    assert torch.allclose(seen[0], expected)


def test_counted_evaluations_match_the_formulas():
    p = doit.Params(diffusion_steps=6, candidates=3, hidden=8)
    sched = doit.Schedule(p.diffusion_steps)
    net = doit.EpsNet(1, 2, 8, p.diffusion_steps)
    g, s = torch.Generator().manual_seed(0), torch.zeros(4, 2)
    pre, dob = doit.Counter(), doit.Counter()
    doit.ddpm_sample(net, torch.randn(4, 1), sched, g, s, count=pre)
    assert pre.fwd == 4 * 6
    reward = lambda a, c: a[:, 0]  # noqa: E731
    doit.doob_sample(net, torch.randn(4, 1), sched, doit.practical_log_h(reward, sched, 1.0, s, dob), 3, 1.0, g, s,
                     dob)
    assert (dob.fwd + dob.vjp + dob.q) / 4 == doit.nfe_doit(p) == 6 + 5 + 3 * 5


def test_doob_step_equals_manual_vjp_with_constant_weights():
    """With equal weights the correction uses v = mean z / sigma; check g = (d mu / d x)^T v against autograd."""
    torch.manual_seed(0)
    sched = doit.Schedule(3)
    net = doit.EpsNet(2, 0, 8, 3)
    x = torch.randn(3, 2)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    out = doit.doob_sample(net, x.clone(), sched, lambda c, e, t: torch.zeros(c.shape[:2]), 4, 1.0, g1)
    # manual replay of the same random draws
    xt = x.clone()
    for t in (2, 1, 0):
        xg = xt.clone().requires_grad_(True)
        eps = net(xg, torch.full((3,), t))
        if t > 0:
            z = torch.randn((3, 4, 2), generator=g2)
            v = z.mean(1) / sched.sigma[t]
            step = lambda y, t=t: sched.mean(y, net(y, torch.full((3,), t)), t)  # noqa: E731
            grad = torch.autograd.functional.vjp(step, xt, v)[1]
            eps = eps - (1 - sched.abar[t]).sqrt() * grad
        xt = (sched.mean(xt, eps, t) + sched.sigma[t] * torch.randn(xt.shape, generator=g2)).detach()
    assert torch.allclose(out, xt, atol=1e-5)


def test_prepare_mixes_random_and_controller_episodes(tmp_path):
    p = doit.Params(n_transitions=800, random_share=0.5, ref_episodes=2, eval_horizon=100, toy_train=32)
    doit.prepare(p, tmp_path)
    refs = doit.read_table(tmp_path / "refs.parquet")
    assert refs["expert_return"][0] > refs["random_return"][0] + 100  # the controller swings up, random does not
    d = doit.load_env(tmp_path, "Pendulum-v1")
    assert d["s"].shape == (800, 3) and d["a"].shape == (800, 1) and float(d["a"].abs().max()) <= 2.0
    toy = doit.read_table(tmp_path / "toy.parquet")["x"]
    assert toy.shape == (32, 2) and np.allclose(np.linalg.norm(toy, axis=1).mean(), 2, atol=0.3)


def test_d4rl_loader_on_tiny_fixture(tmp_path):
    path = tmp_path / "tiny.hdf5"
    obs = np.arange(12, dtype=np.float32).reshape(6, 2)
    with h5py.File(path, "w") as f:
        f["observations"], f["actions"] = obs, np.ones((6, 1), np.float32)
        f["rewards"] = np.arange(6, dtype=np.float32)
        f["terminals"] = np.array([0, 0, 1, 0, 0, 0], bool)
        f["timeouts"] = np.array([0, 0, 0, 0, 0, 1], bool)
    d = doit.load_d4rl(path)
    assert d["episode"].tolist() == [0, 0, 0, 1, 1] and d["t"].tolist() == [0, 1, 2, 0, 1]
    assert d["done"].tolist() == [False, False, True, False, False]
    assert np.array_equal(d["s2"][0], obs[1]) and np.array_equal(d["s2"][2], obs[2])


def test_baselines_weigh_the_same_q_as_doit_and_are_scale_free(monkeypatch):
    """Issue 21: Best-of-N and SVDD draw their kept sample from the same standardised weights DOIT-Practical uses,
    so a critic rescaled by any positive affine map leaves every arm's choice unchanged."""
    sched, tau = doit.Schedule(4), 0.7
    net = doit.EpsNet(2, 3, 8, 4)
    cond = torch.randn(3, 3)
    real = torch.multinomial
    probs, qs = [], []

    def multinomial(w, k, generator=None):
        probs.append(w.clone())
        return real(w, k, generator=generator)

    def q(a, c):
        qs.append(a[:, 0] * 3 + a[:, 1] - c[:, 0])
        return qs[-1]

    monkeypatch.setattr(torch, "multinomial", multinomial)
    for sampler in (lambda r, g: doit.best_of_n(net, cond, 5, r, sched, tau, g, doit.Counter()),
                    lambda r, g: doit.svdd_sample(net, cond, 5, r, sched, tau, g, doit.Counter())):
        probs.clear(), qs.clear()
        a = sampler(q, torch.Generator().manual_seed(3))
        for w, r in zip(probs, qs, strict=True):  # DOIT-Practical's weights given the same Q values
            log_h = doit.practical_log_h(lambda x0, c, r=r: r, sched, tau, cond)
            assert torch.allclose(w, log_h(torch.zeros(3, 5, 2), torch.zeros(3, 2), 0).softmax(-1), atol=1e-6)
        rescaled = sampler(lambda x, c: 40 * q(x, c) - 9, torch.Generator().manual_seed(3))
        assert torch.allclose(a, rescaled, atol=1e-5)


def test_critic_rank_premise_reads_whether_q_prefers_the_controller():
    """The premise critic_ranks_actions: a critic peaked at the clean controller's action ranks it above a random
    action almost always, one blind to the action never strictly does, one peaked at the opposite action rarely."""
    p = doit.Params()
    nets = doit.EnvNets(3, 1, 2.0, p)
    angle = torch.rand(500) * 2 * np.pi
    s = torch.stack([angle.cos(), angle.sin(), torch.randn(500) * 3], 1)
    a_data = torch.zeros(500, 1)
    best = lambda st: torch.from_numpy(reference_controller("Pendulum-v1", st.numpy()).astype(np.float32)) / 2  # noqa: E731
    for q, lo, hi in ((lambda st, a: -(a[:, 0] - best(st)[:, 0]) ** 2, 0.9, 1.0),
                      (lambda st, a: torch.zeros(len(a)), 0.0, 0.0),
                      (lambda st, a: -(a[:, 0] + best(st)[:, 0]) ** 2, 0.0, 0.5)):
        nets.q = q
        assert lo <= doit.critic_rank_acc(nets, "Pendulum-v1", s, a_data, 400, 0) <= hi
    names = {c.name for c in doit.PAPER.claim.premises}
    assert names == {"behaviour_policy_learned", "critic_ranks_actions"}
    assert [c.left for c in doit.PAPER.claim.context] == ["method/flops_per_action"]


def test_behaviour_policy_is_clipped_apart_from_the_critics():
    """Each network (behaviour diffusion, twin critics, value net, toy model) is its own arm: every trainable
    parameter in exactly one, and with the summed loss the behaviour diffusion trains exactly as it would alone,
    while one clip over a task's networks (the old layout) lets the critics' gradient norm shrink its steps."""
    from tasks.context import ArmsAdamW, _arm_groups

    p = doit.Params(hidden=16, diffusion_steps=5, reward_scale=10.0)  # large rewards: a critic gradient norm >> 1
    model = doit.build(p, {"Pendulum-v1": (3, 1, 2.0)})
    arms = doit.network_arms(model)
    assert sorted(arms) == ["pendulum/policy", "pendulum/q1", "pendulum/q2", "pendulum/v", "toy"]
    groups = _arm_groups(model, arms, 1.0)
    assert {id(q) for g in groups for q in g["params"]} == {id(q) for q in model.parameters() if q.requires_grad}
    nets, sched = model["pendulum"], doit.Schedule(p.diffusion_steps)
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def policy_after(mode: str, steps: int = 3) -> torch.Tensor:
        model.load_state_dict(start)
        if mode == "arms":
            opt = ArmsAdamW(_arm_groups(model, doit.network_arms(model), 1.0), lr=1e-2, weight_decay=0.0,
                            partitioned=False)
        else:  # "alone": the policy only; "task": the task's networks as one arm under one clip
            params = list(nets.policy.parameters()) if mode == "alone" else [q for q in nets.parameters()
                                                                               if q.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            b = {"s": torch.randn(64, 3, generator=g), "a": torch.rand(64, 1, generator=g) * 2 - 1,
                 "s2": torch.randn(64, 3, generator=g), "r": torch.randn(64, generator=g) * 10,
                 "done": torch.zeros(64)}
            model.zero_grad()
            loss = doit.diffusion_loss(nets.policy, b["a"], nets.norm(b["s"]), sched, torch.Generator().manual_seed(9))
            if mode != "alone":
                loss = loss + doit.iql_losses(nets, b, p)[0]
            loss.backward()
            if mode != "arms":
                torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
            opt.step()
        return torch.cat([q.detach().flatten() for q in nets.policy.parameters()])

    first = torch.cat([start[n].flatten() for n, _ in model.named_parameters() if n.startswith("pendulum.policy.")])
    alone, beside, task = policy_after("alone"), policy_after("arms"), policy_after("task")
    assert torch.allclose(alone, beside, atol=1e-6) and (alone - first).abs().max() > 1e-3
    assert (task - alone).abs().max() > 1e-3  # the shared clip moved the policy elsewhere


def test_random_policy_share_is_exactly_the_parameter():
    """The mixing ratio is a parameter: each seed draws which episodes are random, never how many (a per-episode
    coin gave 8-23 % random episodes over smoke's seeds, and the behaviour clone's score followed it)."""
    for seed in range(3):
        p = doit.Params(seed=seed, n_transitions=2000, random_share=0.3)  # 10 episodes of 200 steps
        data = doit._generate("Pendulum-v1", p, 0)
        gap = np.abs(data["a"] - reference_controller("Pendulum-v1", data["s"]).clip(-2, 2))[:, 0]  # (N,)
        per_episode = np.array([gap[data["episode"] == e].mean() for e in range(10)])
        assert (per_episode > 0.8).sum() == 3  # noise std 0.5: ~0.4 from the controller; uniform actions ~1.2
