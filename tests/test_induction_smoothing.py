"""induction_smoothing: the count estimators, the exact Bayes predictor and the disentangled transformer, each
checked against a value computed another way."""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import gammaln

from models import induction_smoothing as m


def _params(**kw):
    return m.Params(**{"S": 3, "k": 2, "T": 24, "t_min": 4, **kw})


def _brute_counts(seq: np.ndarray, t: int, S: int, k: int):
    """Loops: order-j counts of the last j tokens' context and counts grouped by overlap, BOS-padded."""
    pad = [S] * k + list(seq)
    cur = pad[t + 1 : t + 1 + k]
    order, overlap = np.zeros((k + 1, S)), np.zeros((k + 1, S))
    for i in range(t + 1):  # transitions into tokens 0..t
        ctx = pad[i : i + k]
        ov = sum(a == b for a, b in zip(ctx, cur, strict=True))
        overlap[ov, seq[i]] += 1
        for j in range(k + 1):
            if ctx[k - j :] == cur[k - j :]:
                order[j, seq[i]] += 1
    return order, overlap


def test_in_context_counts_match_loops():
    p = _params()
    rng = np.random.default_rng(0)
    tokens = m.sample_tokens(m.sample_chains("B", 3, p, rng), p.T, p.k, rng)
    c = m.in_context_counts(tokens, p.S, p.k, p.t_min)
    per_seq = p.T - 1 - p.t_min
    for n in range(3):
        for qi, t in enumerate(range(p.t_min, p.T - 1)):
            order, overlap = _brute_counts(tokens[n], t, p.S, p.k)
            row = n * per_seq + qi
            assert np.array_equal(c["order"][row], order) and np.array_equal(c["overlap"][row], overlap)
            assert c["next"][row] == tokens[n, t + 1] and c["matches"][row] == order[p.k].sum()
            assert c["ctx"][row] == tokens[n, t - 1] * p.S + tokens[n, t]


def test_add_alpha_is_the_bayes_predictor_by_the_dirichlet_multinomial_chain_rule():
    """Setting A: the product of add-alpha predictive probabilities over a sequence equals the closed-form marginal
    likelihood prod_ctx Gamma(S a)/Gamma(S a + n_ctx) prod_s Gamma(a + n_ctx,s)/Gamma(a)."""
    p = _params(alpha=0.7, T=40, t_min=1)  # queries t = 1..T-2 predict every token with a full context
    rng = np.random.default_rng(1)
    tokens = m.sample_tokens(m.sample_chains("A", 2, p, rng), p.T, p.k, rng)
    c = m.in_context_counts(tokens, p.S, p.k, p.t_min)
    pred = m.add_beta(c["order"], p.alpha)
    log_chain = np.log(pred[np.arange(len(c["next"])), c["next"]]).reshape(2, -1).sum(1)
    for n in range(2):
        counts = np.zeros((p.S ** p.k, p.S))
        for t in range(p.k, p.T):
            counts[tokens[n, t - 2] * p.S + tokens[n, t - 1], tokens[n, t]] += 1
        closed = (gammaln(p.S * p.alpha) - gammaln(p.S * p.alpha + counts.sum(1))
                  + (gammaln(p.alpha + counts) - gammaln(p.alpha)).sum(1)).sum()
        assert np.isclose(log_chain[n], closed)
    # and directly: the posterior predictive is the Dirichlet posterior mean, estimated by sampling the posterior
    order = np.zeros((1, p.k + 1, p.S))
    order[0, -1] = [3, 0, 1]
    draws = rng.dirichlet(p.alpha + order[0, -1], size=200_000)
    assert np.allclose(m.add_beta(order, p.alpha)[0], draws.mean(0), atol=3e-3)


def test_soft_match_equals_the_disentangled_attention_and_its_limits():
    p = _params()
    rng = np.random.default_rng(2)
    tokens = m.sample_tokens(m.sample_chains("A", 4, p, rng), p.T, p.k, rng)
    c = m.in_context_counts(tokens, p.S, p.k, p.t_min)
    for beta, beta0 in ((0.0, 0.0), (1.3, 2.0), (4.0, 9.5)):
        literal = m.disentangled_forward(torch.from_numpy(tokens), p.S, p.k, beta, beta0)[:, p.t_min : p.T - 1]
        counted = m.soft_match(c["overlap"], beta, beta0)
        assert np.allclose(literal.reshape(-1, p.S).numpy(), counted, atol=1e-10)
    # large beta with pseudo-count alpha per symbol (e^{beta0 - k beta} = S alpha) is add-alpha = Bayes in A
    alpha = 0.5
    big = m.soft_match(c["overlap"], 40.0, p.k * 40.0 + np.log(p.S * alpha))
    seen = c["order"][:, -1].sum(-1) > 0
    assert np.allclose(big[seen], m.add_beta(c["order"], alpha)[seen], atol=1e-8)
    # beta = 0 without BOS mass is the order-0 frequency (every key weighted alike)
    flat = m.soft_match(c["overlap"], 0.0, -60.0)
    assert np.allclose(flat, c["order"][:, 0] / c["order"][:, 0].sum(-1, keepdims=True), atol=1e-10)


def test_count_baselines_limits():
    order = np.array([[[5.0, 3.0, 2.0], [2.0, 1.0, 0.0], [0.0, 0.0, 0.0]],   # order-2 context unseen
                      [[5.0, 3.0, 2.0], [2.0, 1.0, 0.0], [1.0, 0.0, 1.0]]])
    assert np.allclose(m.mle(order), [[1 / 3] * 3, [0.5, 0.0, 0.5]])
    assert np.allclose(m.add_beta(order, 1e-9), m.mle(order), atol=1e-6)
    assert np.allclose(m.add_beta(order, 1e9), 1 / 3)
    # JM with every lambda = 1 is the highest seen order's MLE; hand-computed mix for lambdas (0.5, 0.5, 0.5)
    assert np.allclose(m.jelinek_mercer(order, (1.0, 1.0, 1.0))[0], [2 / 3, 1 / 3, 0])
    u = np.full(3, 1 / 3)
    p0 = 0.5 * np.array([0.5, 0.3, 0.2]) + 0.5 * u
    p1 = 0.5 * np.array([2 / 3, 1 / 3, 0]) + 0.5 * p0
    assert np.allclose(m.jelinek_mercer(order, (0.5, 0.5, 0.5))[1], 0.5 * np.array([0.5, 0, 0.5]) + 0.5 * p1)


def test_chains_and_kl():
    p = _params(alpha=0.5, c=4.0)
    rng = np.random.default_rng(3)
    a, b = m.sample_chains("A", 200, p, rng), m.sample_chains("B", 200, p, rng)
    assert np.allclose(a.sum(-1), 1) and np.allclose(b.sum(-1), 1)
    # setting B: rows sharing the most recent token are correlated (they share q(.|b)); in A they are not
    corr = lambda ch: np.corrcoef(ch[:, 0, 0], ch[:, p.S, 0])[0, 1]  # noqa: E731  contexts (0,0) and (1,0)
    assert corr(b) > 0.3 and abs(corr(a)) < 0.2
    kl, ce = m.kl_ce(np.full((2, 3), 1 / 3), np.array([[1.0, 0, 0], [1 / 3, 1 / 3, 1 / 3]]), np.array([0, 1]))
    assert np.isclose(kl, np.log(3) / 2) and np.isclose(ce, np.log(3))


def test_attention_recovery_reads_back_a_planted_soft_match_pattern():
    """Feed the disentangled head's own attention as a 'trained' pattern: the regression returns its beta."""
    p = _params(T=20, t_min=6)
    rng = np.random.default_rng(4)
    tokens = m.sample_tokens(m.sample_chains("A", 8, p, rng), p.T, p.k, rng)
    ov = m.overlap_matrix(torch.from_numpy(tokens), p.S, p.k)
    L = p.T + 1
    logits = (1.7 * ov).masked_fill(torch.ones(L, L, dtype=torch.bool).tril().logical_not(), -torch.inf)
    logits[:, :, 0] = 3.0
    pattern = logits.softmax(-1)[:, None].float()  # (n, 1, L, L)
    rec = m.attention_recovery(pattern, tokens, p.model_copy(update={"heads": 1}))
    assert np.isclose(rec["head0/beta_hat"], 1.7, atol=1e-4) and rec["head0/r2"] > 0.999
    assert rec["head0/bos_spearman"] < 0  # more exact matches -> less mass on BOS


def test_report_head_searches_every_layer_from_two_up():
    """Issue 21: the induction head may form above layer 2; the planted overlap head in layer 3 is the one reported,
    and the premise reads its R^2."""
    p = _params(T=20, t_min=6)
    rng = np.random.default_rng(5)
    tokens = m.sample_tokens(m.sample_chains("A", 8, p, rng), p.T, p.k, rng)
    L = p.T + 1
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    planted = (1.7 * m.overlap_matrix(torch.from_numpy(tokens), p.S, p.k)).masked_fill(~causal, -torch.inf)
    noise = torch.randn(len(tokens), L, L, generator=torch.Generator().manual_seed(0)).masked_fill(~causal, -torch.inf)
    two_heads = p.model_copy(update={"heads": 2})
    recs = {1: m.attention_recovery(torch.stack([noise, noise.flip(0)], 1).softmax(-1), tokens, two_heads),
            2: m.attention_recovery(torch.stack([noise, planted], 1).softmax(-1), tokens, two_heads)}
    assert m.report_head(recs) == (2, 1) and recs[2]["head1/r2"] > 0.999
    assert max(recs[1][f"head{h}/r2"] for h in range(2)) < 0.5
    assert [c.name for c in m.PAPER.claim.premises] == ["induction_heads_formed", "kl_settled_in_last_half"]


def test_convergence_premise_reads_the_held_out_kl_drop_against_the_claims_margin():
    """The verdict waits on the held-out KL having settled: a drop over the last half above the claim's margin
    (still descending) fails the premise, a smaller one meets it; heldout_kl reads a perfect predictor as 0."""
    (prem,) = [c for c in m.PAPER.claim.premises if c.name == "kl_settled_in_last_half"]
    assert prem.left == "detail/convergence/kl_drop_last_half"
    assert prem.difference({prem.left: 0.5 * m.KL_TOL})[0] < 0 < prem.difference({prem.left: 2 * m.KL_TOL})[0]



def test_heldout_kl_reads_each_bos_model_on_its_own_settings_held_out_sequences(tmp_path):
    """A model that predicts uniformly has, on each setting's fitting sequences, KL(true || uniform) = log S - H(true)
    averaged over the queries: heldout_kl returns exactly that, per setting."""
    p = _params(n_fit=6, n_test=4, width=8, heads=2)
    m.prepare(p, tmp_path)
    model = m.Trio(p)
    with torch.no_grad():
        for net in model.nets.values():
            net.unembed[1].weight.zero_(), net.unembed[1].bias.zero_()
    got = m.heldout_kl(model, tmp_path, p)
    for setting in m.SETTINGS:
        tokens, chains = m.load_split(tmp_path, p, setting, "train")
        c = m.in_context_counts(tokens, p.S, p.k, p.t_min)
        true = chains[np.repeat(np.arange(len(tokens)), p.T - 1 - p.t_min), c["ctx"]]
        want = float((np.log(p.S) + (true * np.log(np.maximum(true, 1e-300))).sum(-1)).mean())
        assert np.isclose(got[f"kl_{setting}"], want, rtol=1e-6)


def test_setting_b_rows_are_dirichlet_draws_as_numpy_samples_them():
    """The one-call gamma sampler of setting B gives, draw for draw, what a Dirichlet call per row gives."""
    p = _params(c=4.0)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        q = rng.dirichlet(np.full(p.S, p.alpha), size=(5, p.S))
        rows = np.stack([np.stack([rng.dirichlet(p.c * q[i, b]) for b in np.arange(p.S ** p.k) % p.S])
                         for i in range(5)])
        assert np.array_equal(m.sample_chains("B", 5, p, np.random.default_rng(seed)), rows)


def test_fused_attention_is_the_explicit_attention():
    """Training runs attention fused; evaluation reads the explicit patterns: both give the same logits."""
    p = _params(width=16, heads=2, layers=2)
    torch.manual_seed(0)
    net = m.AttnOnly(p.S + 1, p.S, p.T + 1, p.width, p.heads, p.layers)
    x = torch.randint(0, p.S + 1, (4, p.T + 1))
    with torch.no_grad():
        explicit, patterns = net(x)
        fused, none = net(x, patterns=False)
    assert torch.allclose(explicit, fused, atol=1e-5) and none == [] and len(patterns) == p.layers
    assert torch.allclose(patterns[0].sum(-1), torch.ones(())) and patterns[0].triu(1).abs().max() == 0


def test_with_ema_the_convergence_premise_and_the_evaluation_read_the_ema_weights(tmp_path):
    """Issue 40: with `ema` set, the held-out KL half-way is the EMA copy's (not the raw weights', which half-way
    carry the noise of a rate near its peak), and evaluation (its end-of-training KL, the premise's other end, and
    every metric) reads the EMA copy of the final network."""
    from tasks.context import EvalContext, TrainContext
    from tasks.worker import _init_distributed

    _init_distributed()
    p = m.Params(S=3, k=2, T=16, t_min=8, n_fit=16, n_test=16, width=16, steps=8, warmup=2, decay="cosine",
                 batch_size=8, lr=3e-2, grid=3, ema=0.5, checkpoint_every=100, seed=0)
    m.prepare(p, tmp_path)
    m.train(TrainContext(params=p, data_dir=tmp_path, out_dir=tmp_path))
    ctx = EvalContext(p, tmp_path, tmp_path, tmp_path)
    half = ctx.record("heldout_kl_half")
    ema_half, raw_half = ctx.network("markov_half", ema=True), ctx.network("markov_half")
    assert half == m.heldout_kl(ema_half, tmp_path, p)
    assert all(not np.isclose(half[key], val, rtol=0, atol=1e-9)
               for key, val in m.heldout_kl(raw_half, tmp_path, p).items())
    out = m.evaluate(ctx)
    ema_end, raw_end = (m.heldout_kl(ctx.network("markov", ema=e), tmp_path, p) for e in (True, False))
    for setting in m.SETTINGS:
        assert out[f"detail/convergence/heldout_kl_{setting}_end"] == ema_end[f"kl_{setting}"]
        assert not np.isclose(ema_end[f"kl_{setting}"], raw_end[f"kl_{setting}"], rtol=0, atol=1e-9)
    assert out["detail/convergence/kl_drop_last_half"] == max(half[f"kl_{s}"] - ema_end[f"kl_{s}"] for s in m.SETTINGS)
