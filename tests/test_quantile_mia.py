"""quantile_mia's mechanism on tiny inputs: scores, losses, the attacks' decision rules, the data roles."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import norm

from models import quantile_mia as qm


def test_scores_match_softmax_definitions():
    logits = torch.tensor([[3.0, 1.0, -2.0], [0.5, 2.5, 2.0]])
    y = torch.tensor([0, 2])
    assert torch.allclose(qm.logit_margin(logits, y), torch.tensor([2.0, -0.5]))
    p = logits.softmax(-1).gather(1, y[:, None])[:, 0]
    assert torch.allclose(qm.logit_confidence(logits, y), torch.log(p / (1 - p)), atol=1e-5)


def test_pinball_minimiser_is_the_empirical_quantile():
    rng = np.random.default_rng(0)
    target = torch.from_numpy(rng.standard_normal(4000).astype(np.float32))
    grid = torch.linspace(-3, 3, 601)
    for level in (0.5, 0.9, 0.99):
        levels = torch.tensor([level])
        losses = torch.stack([qm.pinball_loss(g.expand(4000, 1), target, levels).mean() for g in grid])
        best = float(grid[losses.argmin()])
        assert abs(best - float(torch.quantile(target, level))) < 0.03, level


def test_gaussian_nll_is_minimised_at_the_sample_moments():
    rng = np.random.default_rng(1)
    target = torch.from_numpy((1.5 + 0.5 * rng.standard_normal(5000)).astype(np.float64))
    mu, sigma = target.mean(), target.std(unbiased=False)
    raw = torch.stack([mu, torch.log(torch.expm1(sigma - 1e-3))]).requires_grad_()  # softplus(raw) + 1e-3 = sigma
    (grad,) = torch.autograd.grad(qm.gaussian_nll(raw.expand(len(target), 2), target).mean(), raw)
    assert grad.abs().max() < 1e-6  # the MLE is a stationary point
    base = float(qm.gaussian_nll(raw.detach().expand(len(target), 2), target).mean())
    for shift in ([0.1, 0.0], [0.0, 0.1], [0.0, -0.1]):
        moved = raw.detach() + torch.tensor(shift, dtype=torch.float64)
        assert float(qm.gaussian_nll(moved.expand(len(target), 2), target).mean()) > base


def test_quantile_attack_at_level_alpha_has_fpr_alpha_on_calibrated_nonmembers():
    rng = np.random.default_rng(2)
    n = 200_000
    difficulty = rng.uniform(0, 3, n)  # per-example mean and spread of the non-member score
    s = difficulty + (0.2 + difficulty) * rng.standard_normal(n)
    mean, std = 0.7, 2.0  # the regressor works on standardised targets
    out = np.stack([(difficulty - mean) / std, np.log(np.expm1((0.2 + difficulty) / std - 1e-3))], -1)
    z = qm.quantile_scores(s, out, mean, std)
    assert np.allclose(z, (s - difficulty) / (0.2 + difficulty), atol=1e-3)
    for alpha in (0.1, 0.01):
        assert abs((z > norm.ppf(1 - alpha)).mean() - alpha) < 0.15 * alpha


def test_lira_online_and_offline_directions():
    # 4 shadows, all OUT of the 2 queries (phi ~ 0); on their pool, IN shadows see phi ~ 3 more than OUT ones
    jitter = np.array([[0.1, -0.1], [-0.1, 0.1], [0.1, -0.1], [-0.1, 0.1]])
    pool_in = np.array([[1, 0], [1, 1], [0, 1], [0, 0]], dtype=bool)
    pool_phi = np.where(pool_in, 3.0, 0.0) + jitter
    scores = qm.lira_scores(np.array([3.0, 0.0]), jitter, pool_phi, pool_in)
    assert scores["lira_online"][0] > 0 > scores["lira_online"][1]
    assert scores["lira_offline"][0] > scores["lira_offline"][1]
    assert abs(scores["lira_offline"][1]) < 1.0  # at the OUT mean: about zero standard deviations


def test_lira_online_ranks_in_reverse_far_past_the_in_mean():
    # the unseen setting's shape: IN narrower than OUT, queries far above both means (no shadow saw the class);
    # past the ratio's maximum a higher phi scores lower online, while offline stays monotone
    rng = np.random.default_rng(0)
    phi_out = np.tile(rng.normal(0.0, 2.0, (8, 1)), (1, 50))  # every query has the same OUT mean
    pool_in = rng.random((8, 40)) < 0.5
    pool_phi = np.where(pool_in, 3.0, 0.0) + rng.normal(0.0, 1.0, (8, 40))
    far = np.linspace(25.0, 35.0, 50)
    scores = qm.lira_scores(far, phi_out, pool_phi, pool_in)
    assert np.all(np.diff(scores["lira_online"]) < 0)
    assert np.all(np.diff(scores["lira_offline"]) > 0)


def test_tpr_at_fpr_known_value():
    member = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=bool)
    score = np.array([10, 9, 1, 0, 8, 5, 4, 3, 2, 1.5, 0.5, 0.2, 0.1, -1])
    assert qm.tpr_at_fpr(member, score, 0.0) == 0.5  # two members above every non-member
    assert qm.tpr_at_fpr(member, score, 0.1) == 0.5  # one false positive (10%) buys nothing more
    assert qm.tpr_at_fpr(member, score, 1.0) == 1.0


def test_roles_keep_class_h_away_from_the_auditor_and_variants_together():
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(10), 40)
    roles = qm.assign_roles(labels, 9, 0.5, rng)
    assert set(roles[labels == 9]) == {"member", "query_member", "query_nonmember", "public_h"}
    assert set(roles[labels != 9]) == {"member", "public"}
    images = np.zeros((3, 1, 8, 8), np.float32)
    images[:, 0, 4, 4] = 1.0
    pixels, nu, src = qm.augment(images, 5, 0.0, rng)
    assert pixels.shape == (15, 64) and (nu == 0).all() and (src == np.repeat(np.arange(3), 5)).all()
    assert (pixels.sum(1) == 1).all()  # a shift moves the pixel, never duplicates or drops it
    on = pixels.argmax(1)
    assert (np.abs(on // 8 - 4) <= 1).all() and (np.abs(on % 8 - 4) <= 1).all()


def test_shadow_membership_is_balanced_per_source():
    sources = np.repeat(np.arange(7), 3)
    inside = qm._shadow_membership(sources, 8, np.random.default_rng(4))
    assert all(v.sum() == 4 for v in inside.values()) and len(inside) == 7


def test_ensemble_networks_are_independent():
    torch.manual_seed(0)
    net = qm.EnsembleMLP(3, 5, 7, 2)
    x = torch.randn(3, 4, 5)
    out = net(x)
    w0, b0 = net.weights[0][1], net.biases[0][1]
    h = torch.relu(x[1] @ w0 + b0)
    h = torch.relu(h @ net.weights[1][1] + net.biases[1][1])
    assert torch.allclose(out[1], h @ net.weights[2][1] + net.biases[2][1], atol=1e-6)
    out[0].sum().backward()
    assert net.weights[0].grad[1:].abs().max() == 0  # net 0's loss moves only net 0


def test_cifar10_loader_on_a_ten_image_pickle_fixture(tmp_path):
    import pickle

    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, (10, 3072), dtype=np.uint8)
    labels = list(range(10))
    with open(tmp_path / "data_batch_1", "wb") as f:
        pickle.dump({b"data": data[:6], b"labels": labels[:6]}, f)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": data[6:], b"labels": labels[6:]}, f)
    images, y = qm.load_cifar10(tmp_path)
    assert images.shape == (10, 3, 32, 32) and y.tolist() == labels
    assert np.allclose(images[7].reshape(-1), data[7] / 255.0)
    p = qm.Params(dataset="cifar10", dataset_dir=str(tmp_path), variants=2, held_out_class=3)
    qm.prepare(p, tmp_path)
    t = qm.read_table(tmp_path / "samples.parquet")
    assert t["pixels"].shape == (20, 3072) and set(t["role"][t["label"] == 3]) <= {"query_member",
                                                                                      "query_nonmember", "public_h"}


def test_resnet_ensemble_networks_are_independent_resnet18s():
    """Full profile: ResNet-18 targets and shadows, stacked as one module; each network sees only its own batch."""
    torch.manual_seed(0)
    nets = qm.EnsembleResNet(3, (3, 32, 32), 4, 10)
    single = qm.resnet18(3, 4, 10)
    assert sum(v.numel() for v in nets.parameters()) == 3 * sum(v.numel() for v in single.parameters())
    assert sum(1 for m in single.modules() if isinstance(m, qm.BasicBlock)) == 8  # 2 per stage x 4 stages
    x = torch.randn(3, 5, 3 * 32 * 32, requires_grad=True)
    out = nets(x)
    assert out.shape == (3, 5, 10)
    out[1].sum().backward()  # network 1's output depends on its own inputs and weights only
    assert x.grad[0].abs().sum() == 0 and x.grad[2].abs().sum() == 0 and x.grad[1].abs().sum() > 0
    grads = [p.grad for p in nets.parameters()]
    assert all(g[0].abs().sum() == 0 and g[2].abs().sum() == 0 for g in grads)
    params = {k: v[1] for k, v in zip(nets.names, nets.stacked, strict=True)}  # network 1 as a plain ResNet-18
    single.load_state_dict(params)
    assert torch.allclose(single(x[1].detach().view(5, 3, 32, 32)), out[1], atol=1e-5)


def test_queries_are_a_subset_of_class_h_that_no_shadow_sees():
    """Issue 21: the unseen-class setting. Every shadow (unseen and seen control) trains on the auditor's public
    data only: no query, and in the unseen setting no class-h sample at all; queries are a fraction of class h."""
    rng = np.random.default_rng(5)
    labels = np.repeat(np.arange(10), 40)
    roles = qm.assign_roles(labels, 9, 0.5, rng, query_fraction=0.25)
    src = np.repeat(np.arange(len(labels)), 3)  # three variants per source
    t = {"role": roles[src], "source_id": src, "label": labels[src]}
    queries = np.flatnonzero(np.isin(t["role"], ["query_member", "query_nonmember"]))
    is_h = t["label"] == 9
    assert 0 < len(queries) < 0.5 * is_h.sum() and (t["label"][queries] == 9).all()
    for seen in (False, True):
        pool, in_mask = qm.shadow_sets(t, 4, seen, np.random.default_rng(6))
        assert in_mask.shape == (4, len(pool)) and (in_mask.sum(0) == 2).all()
        for k in range(4):
            assert not np.intersect1d(pool[in_mask[k]], queries).size
            assert seen or not is_h[pool[in_mask[k]]].any()
    assert is_h[qm.shadow_sets(t, 4, True, rng)[0]].any()  # the seen control does hold class-h non-members


def test_premises_name_a_generalising_target_that_leaks_membership():
    """The claim is inconclusive unless the target generalises (seen-class accuracy >= 0.8) and the shadow-free
    global threshold separates class-h members from non-members above chance (AUROC > 0.5)."""
    prem = {c.name: c for c in qm.PAPER.claim.premises}
    assert set(prem) == {"target_generalises", "membership_leaks"}
    member = np.r_[np.ones(50, bool), np.zeros(50, bool)]
    rng = np.random.default_rng(0)
    leaky, blind = qm._metrics(member, member + rng.normal(0, 1, 100)), qm._metrics(member, rng.normal(0, 1, 100))
    assert leaky["auroc"] > 0.7 and abs(blind["auroc"] - 0.5) < 0.15
    ok = {"detail/target_seen_class_test_acc": 0.9, "baseline/global_threshold/auroc": leaky["auroc"]}
    assert all(prem[n].difference(ok)[0] > 0 for n in prem)
    assert prem["membership_leaks"].difference({**ok, "baseline/global_threshold/auroc": 0.5})[0] <= 0


def test_query_fraction_one_queries_every_class_h_source_and_n_sources_subsets(tmp_path):
    """Smoke queries every class-h source (1% FPR rests on the most non-member sources) on a seeded subset of the
    digits' source images; the seen-class control then has no class-h data left, so smoke runs without it."""
    labels = np.repeat(np.arange(10), 40)
    roles = qm.assign_roles(labels, 9, 0.5, np.random.default_rng(7), query_fraction=1.0)
    assert set(roles[labels == 9]) == {"query_member", "query_nonmember"}
    p = qm.Params(n_sources=120, variants=2, seed=3)
    qm.prepare(p, tmp_path)
    t = qm._load(tmp_path)
    assert len(np.unique(t["source_id"])) == 120 and len(t["role"]) == 240
    (tmp_path / "again").mkdir()
    qm.prepare(p, tmp_path / "again")
    assert (qm._load(tmp_path / "again")["pixels"] == t["pixels"]).all()  # seeded: the same subset and variants
