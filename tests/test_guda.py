"""GUDA's mechanism on tiny inputs: the ELBO rule with common random numbers, the bounded unlearning objective,
LOGO masking, the agreement metrics and the baselines' self-attribution."""

from __future__ import annotations

import numpy as np
import torch

from models import guda
from models.common import diffusion as dm


def _p(**kw):
    return guda.Params(**({"n_groups": 3, "channels": (8, 16), "ddpm_steps": 20, "score_pairs": 4} | kw))


class Zero(torch.nn.Module):
    def forward(self, x, t):
        return torch.zeros_like(x)


def test_elbo_matches_hand_computation_and_common_random_numbers_cancel():
    ab = dm.ddpm_scheduler(20).alphas_cumprod
    w = dm.ddpm_elbo_weights(ab)
    t, eps = torch.tensor([0, 5, 19]), torch.randn(3, 1, 8, 8)
    x = torch.randn(2, 1, 8, 8)
    got = guda.elbo(Zero(), x, t, eps, w, ab, 20)
    ref = 20 * (w[t] * eps.pow(2).flatten(1).sum(1)).mean()
    assert torch.allclose(got, ref.expand(2))  # eps_hat = 0: the error is ||eps||^2 whatever x is
    net = dm.SmallUNet(1, 1, (8, 16))
    assert torch.equal(guda.elbo(net, x, t, eps, w, ab, 20), guda.elbo(net, x, t, eps, w, ab, 20))


def _batch(n=12):
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, 1, 8, 8, generator=g), "group": torch.arange(n) % 3,
            "t": torch.randint(0, 20, (n,), generator=g), "noise": torch.randn(n, 1, 8, 8, generator=g)}


def test_logo_network_never_sees_its_held_out_group():
    torch.manual_seed(0)
    model = guda.Phase1(_p())
    b = _batch()
    grads = []
    for shift in (0.0, 5.0):
        bb = dict(b, x=b["x"] + shift * (b["group"] == 1).float().view(-1, 1, 1, 1))
        model.zero_grad()
        model(bb)["logo1_s0"].backward()
        grads.append(torch.cat([q.grad.flatten() for q in model.nets["logo1_s0"].parameters()]))
    assert torch.equal(grads[0], grads[1])  # group 1's images do not touch logo1
    assert all(torch.equal(a, b_) for a, b_ in zip(model.nets["logo1_s0"].state_dict().values(),
                                                   model.nets["full_s0"].state_dict().values(), strict=True))


def test_unlearning_objective_is_retain_minus_bounded_forget():
    torch.manual_seed(0)
    full = dm.SmallUNet(1, 1, (8, 16)).state_dict()
    b = _batch()
    open_, capped = guda.Unlearn(_p(alpha=0.5, cap=1e6), full), guda.Unlearn(_p(alpha=0.5, cap=1e-6), full)
    per = guda.eps_loss(open_.nets["unl0"], b["x"], b["t"], b["noise"], open_.alphas_cumprod, 20)
    retain, forget = per[b["group"] != 0].mean(), per[b["group"] == 0].mean()
    assert torch.isclose(open_(b)["unl0"], retain - 0.5 * forget)
    capped(b)["unl0"].backward()  # the cap is reached: only the retain term has a gradient
    g_capped = torch.cat([q.grad.flatten() for q in capped.nets["unl0"].parameters()])
    net = capped.nets["unl0"]
    net.zero_grad()
    guda.eps_loss(net, b["x"], b["t"], b["noise"], capped.alphas_cumprod, 20)[b["group"] != 0].mean().backward()
    assert torch.allclose(g_capped, torch.cat([q.grad.flatten() for q in net.parameters()]), atol=1e-7)


def test_agreement_metrics_known_values():
    logo = np.array([[0.1, 0.5, 0.3], [0.9, 0.2, 0.4]])
    perfect = guda.agreement(logo * 2 + 1, logo)
    assert perfect["top1"] == 1.0 and perfect["spearman"] == 1.0 and np.isclose(perfect["ndcg3"], 1.0)
    reverse = guda.agreement(-logo, logo)
    assert reverse["top1"] == 0.0 and reverse["spearman"] == -1.0


def test_baselines_attribute_a_copied_training_image_to_its_group():
    torch.manual_seed(0)
    train_x, groups = torch.randn(3, 1, 8, 8), torch.tensor([0, 1, 2])  # one image per group
    gen = train_x[[2, 0]]  # exact copies of group 2's and group 0's images
    sim = guda.similarity_scores(guda.Classifier(3), gen, train_x, groups, 3)
    assert sim.argmax(1).tolist() == [2, 0]
    net = dm.SmallUNet(1, 1, (8, 16))
    ab = dm.ddpm_scheduler(20).alphas_cumprod
    t, eps = torch.tensor([3, 9]), torch.randn(2, 1, 8, 8)
    grad_s = guda.gradient_scores(net, gen, train_x, groups, t, eps, ab, 20, 3, 256, 0)
    assert grad_s.argmax(1).tolist() == [2, 0] and np.allclose(grad_s.max(1), 1.0, atol=1e-5)  # cosine with itself
    still = guda.instance_scores(net, gen, train_x, groups, t, eps, ab, 20, 3, steps=2, lr=0.0)
    assert still.shape == (2, 3) and np.allclose(still, 0.0)


def test_cifar10_loader_and_prepare_on_a_pickle_fixture(tmp_path):
    """Full profile: CIFAR-10 python pickles -> one group per class, 3x32x32 images in [-1, 1]."""
    import pickle

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (12, 3072), dtype=np.uint8)
    for i in (1, 2):
        with open(tmp_path / f"data_batch_{i}", "wb") as fh:
            pickle.dump({b"data": raw[6 * (i - 1) : 6 * i], b"labels": [0, 1, 2, 0, 1, 2]}, fh)
    x, y = guda.load_cifar10(tmp_path)
    assert x.shape == (12, 3072) and y.tolist() == [0, 1, 2] * 4
    p = guda.Params(dataset="cifar10", dataset_dir=str(tmp_path), n_groups=3, per_group=2, score_pairs=4)
    (tmp_path / "out").mkdir()
    guda.prepare(p, tmp_path / "out")
    d = guda._load(tmp_path / "out", p)
    assert d["x"].shape == (6, 3, 32, 32) and d["eps"].shape == (4, 3, 32, 32)
    assert sorted(d["group"].tolist()) == [0, 0, 1, 1, 2, 2] and d["x"].abs().max() <= 1
    net = guda.Phase1(p)  # networks take their channels from the data source
    assert net.classifier(d["x"]).shape == (6, 3)


def test_every_estimator_uses_the_same_k_scoring_pairs(monkeypatch):
    """Fair arms: GUDA's ELBO and the gradient and instance baselines' losses all see the K pairs of d["t"]."""
    torch.manual_seed(0)
    p = _p(score_pairs=6, per_group_baseline=2, proj_dim=8, instance_steps=1)
    phase1 = guda.Phase1(p)
    unlearn = guda.Unlearn(p, phase1.nets["full_s0"].state_dict())
    d = {"x": torch.randn(9, 1, 8, 8), "group": torch.arange(9) % 3, "t": torch.randint(0, 20, (6,)),
         "eps": torch.randn(6, 1, 8, 8)}
    seen = []
    elbo, per_example = guda.elbo, guda._per_example_loss

    def spy_elbo(net, x, t, eps, *a):
        seen.append(("elbo", t.tolist(), eps))
        return elbo(net, x, t, eps, *a)

    def spy_loss(net, prm, x, t, eps, *a):
        seen.append(("loss", t.tolist(), eps))
        return per_example(net, prm, x, t, eps, *a)

    monkeypatch.setattr(guda, "elbo", spy_elbo)
    monkeypatch.setattr(guda, "_per_example_loss", spy_loss)
    scores = guda.attribution_scores(p, phase1, unlearn, torch.randn(2, 1, 8, 8), d)
    assert set(scores) == set(guda.METHODS) and all(s.shape == (2, 3) for s in scores.values())
    assert {kind for kind, _, _ in seen} == {"elbo", "loss"}
    assert all(t == d["t"].tolist() and eps is d["eps"] for _, t, eps in seen)


def test_premise_metrics_read_recognisability_and_logo_class_agreement():
    class Stub(torch.nn.Module):  # "classifies" by the mean pixel: sample i -> logits peaked at class i % 3
        def forward(self, x):
            cls = x.flatten(1).mean(1).round().long()
            return 10.0 * torch.nn.functional.one_hot(cls, 3).float()

    gen = torch.arange(4.0).remainder(3)[:, None, None, None].expand(4, 1, 8, 8).clone()  # classes 0, 1, 2, 0
    d = {"x": gen.clone(), "group": torch.tensor([0, 1, 2, 0])}
    logo = np.eye(3)[[0, 1, 0, 0]]  # LOGO argmax 0, 1, 0, 0: the class matches for samples 0, 1, 3
    m = guda.premise_metrics(Stub(), gen, d, logo, 3)
    assert m["detail/classifier_train_acc"] == 1.0 and m["detail/generated_recognisable"] == 1.0
    assert m["detail/logo_matches_class"] == 0.75 and np.isclose(m["detail/chance_top1"], 1 / 3)
    flat = guda.premise_metrics(lambda x: torch.zeros(len(x), 3), gen, d, logo, 3)  # uniform: nothing recognisable
    assert flat["detail/generated_recognisable"] == 0.0


def test_scoring_timesteps_are_one_grid_for_every_replicate(tmp_path):
    t = guda.score_timesteps(200, 16)
    assert t[0] == 11 and t[-1] == 188 and np.all(np.diff(t) > 0) and len(t) == 16
    drawn = []
    for seed in (0, 1):
        out = tmp_path / str(seed)
        out.mkdir()
        p = guda.Params(n_groups=2, per_group=3, score_pairs=8, seed=seed)
        guda.prepare(p, out)
        drawn.append(guda._load(out, p))
    assert torch.equal(drawn[0]["t"], drawn[1]["t"]) and not torch.equal(drawn[0]["eps"], drawn[1]["eps"])
