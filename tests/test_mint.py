"""MINT's mechanism on tiny inputs: the environment's rules, beliefs and completions, embedding beliefs for unseen
names, the tree's question choice and stopping rule, and exact resume of the rollout collector."""

from __future__ import annotations

import copy

import numpy as np
import torch
from gymnasium.utils.env_checker import check_env

from models import mint

POS = np.array([[[0, 2], [2, 0]]])  # (E=1, K=2, 2)


def _phi(goal: int, hazard=(0, 0), fragile=(0, 0)) -> np.ndarray:
    phi = np.zeros((1, 2, 3), np.float32)
    phi[0, goal, 0] = 1
    phi[0, :, 1], phi[0, :, 2] = hazard, fragile
    return phi


def test_env_rules_goal_hazard_fragile():
    start = np.array([[0, 1]])
    # move (0, +1) onto object 0 = the goal: +1 - 0.01, done
    agent, r, done, hit = mint.env_step(POS, _phi(0), start, np.array([0]), 3)
    assert agent.tolist() == [[0, 2]] and np.isclose(r[0], 0.99) and done[0] and hit[0].tolist() == [True, False]
    # object 0 is a hazard and not the goal: -0.5 on contact, not done
    agent, r, done, _ = mint.env_step(POS, _phi(1, hazard=(1, 0)), start, np.array([0]), 3)
    assert agent.tolist() == [[0, 2]] and np.isclose(r[0], -0.51) and not done[0]
    # object 0 is fragile and not the goal: the move is refused (extra steps), the bump is a contact
    agent, r, done, hit = mint.env_step(POS, _phi(1, fragile=(1, 0)), start, np.array([0]), 3)
    assert agent.tolist() == [[0, 1]] and np.isclose(r[0], -0.01) and hit[0, 0] and not done[0]
    # a fragile goal can be delivered
    _, r, done, _ = mint.env_step(POS, _phi(0, fragile=(1, 0)), start, np.array([0]), 3)
    assert done[0]


def test_gymnasium_env_api():
    env = mint.DeliveryEnv(np.array([1, 1]), POS[0], _phi(1)[0], grid=3, horizon=6)
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    _, r, term, _, _ = env.step(2)  # (+1, 0) -> (2, 1)
    _, r, term, _, _ = env.step(1)  # (0, -1) -> (2, 0) = object 1, the goal
    assert term and np.isclose(r, 0.99)


def test_belief_and_completions_respect_knowledge():
    prior = np.full((1, 3, 3), 0.3, np.float32)
    prior[..., 0] = 1 / 3
    mask, vals = np.zeros_like(prior), np.zeros_like(prior)
    assert np.allclose(mint.belief(prior, mask, vals)[0, :, 0], 1 / 3)
    mask[0, 0, 0] = 1  # "is object 0 the goal?" -> no
    b = mint.belief(prior, mask, vals)
    assert np.allclose(b[0, :, 0], [0, 0.5, 0.5])
    mask[0, 2, 1], vals[0, 2, 1] = 1, 1  # object 2 is a hazard
    phi = mint.complete(prior, mask, vals, 4000, np.random.default_rng(0))  # (1, C, K, 3)
    assert (phi[..., 0].sum(-1) == 1).all() and (phi[0, :, 0, 0] == 0).all() and (phi[0, :, 2, 1] == 1).all()
    assert abs(phi[0, :, 1, 0].mean() - 0.5) < 0.03 and abs(phi[0, :, 0, 2].mean() - 0.3) < 0.03
    mask[0, 1, 0], vals[0, 1, 0] = 1, 1  # object 1 confirmed: the others are excluded
    assert np.allclose(mint.belief(prior, mask, vals)[0, :, 0], [0, 1, 0])


def test_unseen_beliefs_come_from_the_nearest_seen_names():
    emb = np.eye(4, dtype=np.float32)
    emb[3] = emb[0] * 0.99 + emb[1] * 0.14  # the unseen name sits next to seen name 0
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    objects = {"name": np.array(["a", "b", "c", "u"]), "split": np.array(["seen", "seen", "seen", "unseen"]),
               "hazard_prob": np.array([0.9, 0.1, 0.1, 0.5]), "fragile_prob": np.array([0.2, 0.8, 0.5, 0.5]),
               "embedding": emb}
    b = mint.name_beliefs(objects, knn=2)
    assert b["a"] == (0.9, 0.2)  # seen: its own frequency
    assert b["u"][0] > 0.8 and b["u"][1] < 0.3  # unseen: pulled to its neighbour, not the truth (0.5, 0.5)


class GoalGapU(torch.nn.Module):
    """A stand-in U whose gap is 1 - max goal belief: only the goal matters for the outcome."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x):
        per = x[:, 2 : 2 + 8 * self.k].reshape(len(x), self.k, 8)  # offset (2), values/beliefs (3), mask (3)
        emax = 1 - per[:, :, 2].max(1).values
        return torch.cat([torch.zeros(len(x), 8), emax[:, None]], 1)


def test_tree_asks_only_outcome_relevant_questions_and_stops():
    k = 4
    p = mint.Params(grid=5, n_objects=k, budget=6)
    nets = mint.SeedNets(k, 8)
    nets.u = GoalGapU(k)
    rng = np.random.default_rng(0)
    e = 16
    phi = np.zeros((e, k, 3), np.float32)
    phi[np.arange(e), rng.integers(k, size=e), 0] = 1
    prior = np.full((e, k, 3), 0.5, np.float32)  # hazard/fragile maximally uncertain (1 bit each)
    prior[..., 0] = 1 / k
    ep = {"start": np.zeros((e, 2), int), "pos": rng.integers(5, size=(e, k, 2)), "phi": phi, "prior": prior}
    mask, vals, nq, asked = mint.mint_questions(nets, ep, p, eps_stop=0.0)
    assert ((asked[asked >= 0] % 3) == 0).all()  # only "is X the goal?" questions
    assert (nq <= k - 1).all() and nq.max() > 0
    assert np.allclose(mint.belief(prior, mask, vals)[..., 0], phi[..., 0])  # the goal is always resolved
    # the information-gain questioner, given the same counts, spends them on the 1-bit hazard/fragile questions
    mask_ig, _, _ = mint.scripted_questions(ep, p, nq, "info_gain", rng)
    assert mask_ig[..., 0].sum() == 0
    # a loose threshold asks nothing: gap(K = {}) = 1 - 1/K = 0.75
    assert mint.mint_questions(nets, ep, p, eps_stop=0.8)[2].sum() == 0


def test_collector_resume_is_exact():
    p = mint.Params(grid=5, n_objects=2, dqn_steps=48, n_envs=4)
    rng = np.random.default_rng(0)
    e = 6
    phi = np.zeros((e, 2, 3), np.float32)
    phi[np.arange(e), rng.integers(2, size=e), 0] = 1
    tr = {"start": rng.integers(5, size=(e, 2)), "pos": rng.integers(5, size=(e, 2, 2)), "phi": phi}
    torch.manual_seed(0)
    q = mint.mlp(mint.obs_dim(2), 8, 4)
    full = mint.Collector(tr, p, seed=3)
    full.collect(12, q, 0.3)
    half = mint.Collector(tr, p, seed=3)
    half.collect(5, q, 0.3)
    resumed = mint.Collector(tr, p, seed=3)
    for key, v in half.state.items():
        resumed.state[key].copy_(v)
    resumed.collect(12, q, 0.3)
    for key in full.state:
        assert torch.equal(torch.nan_to_num(full.state[key], 7.0), torch.nan_to_num(resumed.state[key], 7.0)), key
    assert resumed.filled() == 12 and not torch.isnan(full.state["r"][:12]).any()


class GoalQ(torch.nn.Module):
    """A stand-in Q / U mean: action a 'delivers object a', worth its goal value (Q) or goal belief (U)."""

    def __init__(self, k: int, u: bool):
        super().__init__()
        self.k, self.u = k, u

    def forward(self, x):
        goal = x[:, 2 : 2 + 8 * self.k].reshape(len(x), self.k, 8)[:, :, 2]  # (B, K) values or beliefs
        return torch.cat([goal, torch.zeros(len(x), 5)], 1) if self.u else goal


def _goal_world(k: int, e: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    phi = np.zeros((e, k, 3), np.float32)
    phi[np.arange(e), rng.integers(k, size=e), 0] = 1
    prior = np.full((e, k, 3), 0.5, np.float32)  # hazard / fragile: 1 bit each, irrelevant to the value
    prior[..., 0] = 1 / k
    return {"start": np.zeros((e, 2), int), "pos": rng.integers(5, size=(e, k, 2)), "phi": phi, "prior": prior}


def test_uct_searches_question_sequences_and_stops_when_questions_cost_more():
    k, e = 4, 6
    nets = mint.SeedNets(k, 8)
    nets.q, nets.u = GoalQ(k, u=False), GoalQ(k, u=True)
    ep = _goal_world(k, e)
    p = mint.Params(grid=5, n_objects=k, budget=3, uct_sims=300, question_cost=0.01, uct_c=0.3)
    mask, vals, nq, asked = mint.mint_uct(nets, ep, p, seed=0)
    assert ((asked[asked >= 0] % 3) == 0).all()  # only "is X the goal?": the others change no outcome
    # a sequence, not a single question: each episode asks until the goal is known (at most K - 1 questions)
    assert np.allclose(mint.belief(ep["prior"], mask, vals)[..., 0], ep["phi"][..., 0]) and (nq <= k - 1).all()
    assert nq.max() >= 2
    # at 0.3 a question costs more than it gains (0.25 x 0.7 + 0.75 x 0.033 < 0.25): stop at the root
    costly = p.model_copy(update={"question_cost": 0.3})
    assert mint.mint_uct(nets, ep, costly, seed=0)[2].sum() == 0


def test_freeze_keeps_q_fixed_while_a_shared_optimiser_trains_u():
    """U trains in the DQN's engine: an optimiser that zeroes gradients instead of dropping them would keep moving Q
    on Adam's stale momentum (it did: the expert's success fell between the DQN and U phases) unless Q is frozen."""
    torch.manual_seed(0)
    nets = mint.SeedNets(2, 8)
    opt = torch.optim.AdamW(nets.parameters(), lr=1e-2)
    x = torch.randn(16, mint.obs_dim(2))
    for _ in range(3):  # a few DQN-like steps give Q momentum
        opt.zero_grad(set_to_none=False)
        nets.q(x).square().mean().backward()
        opt.step()
    moved = copy.deepcopy(nets.q.state_dict())
    opt.zero_grad(set_to_none=False)
    opt.step()  # zeroed gradients, no freeze: Adam's momentum still moves Q
    assert any((moved[k] - v).abs().max() > 0 for k, v in nets.q.state_dict().items())
    before = copy.deepcopy(nets.q.state_dict())
    mint.freeze(nets.q)
    for _ in range(3):  # U's phase
        opt.zero_grad(set_to_none=False)
        nets.u(x).square().mean().backward()
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in nets.q.state_dict().items())
