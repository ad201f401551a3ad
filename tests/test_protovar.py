"""ProtoVAR mechanism on tiny inputs: residual quantisation reproduces representable latents, block-causal
attention makes teacher forcing equal to incremental next-scale decoding, strong prototype injection forces the
prototype's codes, the greedy MMD selector and herding pick what they should, and the full-profile loaders read
tiny fixtures."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from models import protovar as pv
from models.common import distill


def _params(**kw) -> pv.Params:
    base = dict(n_classes=3, latent_dim=4, codebook_size=6, tok_width=4, var_layers=2, var_dim=16, var_heads=2)
    return pv.Params(**(base | kw))


def _tokenizer(p: pv.Params) -> pv.Tokenizer:
    torch.manual_seed(0)
    tok = pv.Tokenizer(p, 1)
    codes = torch.randn(p.codebook_size, p.latent_dim)
    codes[0] = 0.0  # a zero code: what an already-matched residual quantises to
    tok.codebook.weight.data.copy_(codes)
    return tok.eval()


def test_residual_quantisation_reproduces_a_representable_latent():
    p = _params()
    tok = _tokenizer(p)
    code = tok.codebook.weight[3]
    f = code.reshape(1, -1, 1, 1).expand(2, -1, 4, 4).clone()  # (2, D, 4, 4): the 1x1 code everywhere
    idxs, f_hat, residuals = tok.quantize(f)
    assert (idxs[0] == 3).all() and all((i == 0).all() for i in idxs[1:])
    assert torch.allclose(f_hat, f, atol=1e-6)
    assert [tuple(r.shape[2:]) for r in residuals] == [(1, 1), (2, 2), (4, 4)]


def test_quantize_matches_a_direct_reconstruction_from_its_indices():
    p = _params()
    tok = _tokenizer(p)
    f = torch.randn(3, p.latent_dim, 4, 4)
    idxs, f_hat, residuals = tok.quantize(f)
    rebuilt = sum(tok.lookup(i, k) for i, k in zip(idxs, p.scales, strict=True))
    assert torch.allclose(rebuilt, f_hat, atol=1e-6)
    for r, i in zip(residuals, idxs, strict=True):  # every index is the nearest code to its residual
        flat = r.flatten(2).transpose(1, 2)
        assert (torch.cdist(flat, tok.codebook.weight[None]).argmin(-1) == i).all()


def test_block_causal_teacher_forcing_equals_incremental_decoding():
    p = _params()
    tok = _tokenizer(p)
    torch.manual_seed(1)
    var = pv.VAR(p, p.n_classes).eval()
    f = torch.randn(2, p.latent_dim, 4, 4)
    idxs, _, _ = tok.quantize(f)
    inputs, cls = pv.var_inputs(tok, idxs), torch.tensor([0, 2])
    with torch.no_grad():
        full = var(cls, inputs)  # (2, 21, V)
        for prefix in (1, 5):  # after scale 1 (1 token) and scale 2 (1 + 4 tokens)
            assert torch.allclose(var(cls, inputs[:, : prefix - 1]), full[:, :prefix], atol=1e-5)
        changed = inputs.clone()
        changed[:, 4:] += 1.0  # the finest scale's inputs
        out = var(cls, changed)
    assert torch.allclose(out[:, :5], full[:, :5], atol=1e-5) and not torch.allclose(out[:, 5:], full[:, 5:])


def test_strong_prototype_injection_forces_the_prototype_codes():
    p = _params(betas=(1e6, 1e6, 1e6))
    tok = _tokenizer(p)
    tok.decoder = nn.Identity()  # generate() then returns f_hat itself
    torch.manual_seed(2)
    var = pv.VAR(p, p.n_classes).eval()
    codes = tok.codebook.weight.detach()
    want = (1, 4, 2)  # the code each scale's prototype sits on
    protos = [codes[w].expand(p.n_classes, p.n_protos, k * k, -1).clone() for w, k in zip(want, p.scales, strict=True)]
    f_hat = pv.generate(var, tok, torch.tensor([0, 1, 2]), seed=0, temperature=1.0, protos=protos, betas=p.betas)
    expected = sum(codes[w] for w in want).clamp(-1, 1)
    assert torch.allclose(f_hat, expected.reshape(1, -1, 1, 1).expand_as(f_hat), atol=1e-5)
    free = pv.generate(var, tok, torch.tensor([0, 1, 2]), seed=0, temperature=1.0)  # untrained: not that map
    assert not torch.allclose(free, f_hat)


def test_class_prototypes_with_one_centroid_are_class_means():
    r = [torch.randn(12, 4, k, k) for k in (1, 2)]
    y = torch.arange(12) % 3
    protos = pv.class_prototypes(r, y, 3, 1, seed=0)
    assert protos[1].shape == (3, 1, 4, 4)
    mean = r[1][y == 2].mean(0).flatten(1).T  # (k*k, D)
    assert torch.allclose(protos[1][2, 0], mean, atol=1e-5)


def test_selector_drops_unconfident_and_matches_the_real_distribution():
    g = torch.Generator().manual_seed(0)
    real = torch.randn(50, 2, generator=g)
    near = real[:6] + 0.01
    far = torch.randn(6, 2, generator=g) + 8.0
    cand = torch.cat([far, near])
    conf = torch.cat([torch.full((6,), 0.9), torch.full((6,), 0.9)])
    chosen = pv.select(cand, conf, real, 3, 0.5)
    assert (chosen >= 6).all() and len(set(chosen.tolist())) == 3
    conf[6:] = 0.1  # now only the far ones are confident enough
    assert (pv.select(cand, conf, real, 3, 0.5) < 6).all()
    # the first greedy pick is the candidate whose singleton MMD is smallest
    single = [pv.mmd2(cand[i : i + 1], real) for i in range(12)]
    first = pv.select(cand, torch.ones(12), real, 1, 0.5)
    assert int(first) == int(np.argmin(single))


def test_herding_first_pick_is_closest_to_the_mean():
    feats = torch.tensor([[0.0, 0.0], [10.0, 0.0], [4.0, 1.0], [6.0, -1.0]])
    picks = distill.herding(feats, 2)
    assert int(picks[0]) == 2 and int(picks[1]) == 3  # (4,1) then (6,-1): their mean is the class mean


def _select_one(cand, conf, real, k, min_conf):  # the greedy selector one problem at a time (reference)
    keep = torch.nonzero(conf >= min_conf).flatten()
    if len(keep) < k:
        keep = conf.argsort(descending=True)[:k]
    bandwidth = float(torch.cdist(real, real).median().clamp(min=1e-6))
    kcc, kcr = pv.rbf(cand[keep], cand[keep], bandwidth), pv.rbf(cand[keep], real, bandwidth).mean(1)
    chosen, cross = [], torch.zeros(len(keep))
    for t in range(k):
        ss = kcc[chosen][:, chosen].sum() if chosen else torch.tensor(0.0)
        score = (ss + 2 * cross + kcc.diagonal()) / (t + 1) ** 2 - 2 * (kcr[chosen].sum() + kcr) / (t + 1)
        if chosen:
            score[chosen] = float("inf")
        best = int(score.argmin())
        chosen.append(best)
        cross += kcc[best]
    return keep[torch.tensor(chosen)]


def _herding_one(feats, k):  # herding one set at a time (reference)
    mu, total, chosen = feats.mean(0), torch.zeros(feats.shape[1]), []
    for t in range(k):
        dist = (mu - (total + feats) / (t + 1)).norm(dim=1)
        if chosen:
            dist[chosen] = float("inf")
        best = int(dist.argmin())
        chosen.append(best)
        total += feats[best]
    return torch.tensor(chosen)


def test_batched_selector_and_herding_equal_one_problem_at_a_time():
    g = torch.Generator().manual_seed(4)
    sizes, k = (12, 30, 7, 19), 6  # ragged problems; the third has fewer confident candidates than k
    cands = [torch.randn(n, 5, generator=g) for n in sizes]
    confs = [torch.rand(n, generator=g) for n in sizes]
    reals = [torch.randn(n + 3, 5, generator=g) for n in sizes]
    got = pv.select_many(cands, confs, reals, k, 0.5)
    for cand, conf, real, picks in zip(cands, confs, reals, got, strict=True):
        assert torch.equal(picks, _select_one(cand, conf, real, k, 0.5))
    herded = distill.herding_many(reals, 25)  # 25 > the smallest set: it then repeats index 0, as one at a time
    for real, picks in zip(reals, herded, strict=True):
        assert torch.equal(picks, _herding_one(real, 25)) and torch.equal(picks[:4], _herding_one(real, 4))


def test_augment_shapes_and_zero_shift_is_identity():
    x = torch.randn(5, 1, 16, 16)
    g = torch.Generator().manual_seed(0)
    assert pv.augment(x, g, flip=True).shape == x.shape
    assert torch.equal(pv.augment(x, g, flip=False, shift=0), x)


def test_augment_crops_each_image_at_its_own_drawn_shift():
    x = torch.randn(7, 3, 8, 8)
    for flip in (False, True):
        out = pv.augment(x, torch.Generator().manual_seed(3), flip=flip)
        g = torch.Generator().manual_seed(3)  # the same draws, applied image by image
        dx, dy = torch.randint(0, 5, (2, 7), generator=g)
        padded = torch.nn.functional.pad(x, (2,) * 4, value=-1.0)
        want = torch.stack([padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8] for i in range(7)])
        if flip:
            mirror = torch.rand(7, generator=g) < 0.5
            want[mirror] = want[mirror].flip(-1)
        assert torch.equal(out, want)


def test_cifar10_and_imagenette_loaders_on_tiny_fixtures(tmp_path):
    from PIL import Image

    cifar = tmp_path / "cifar-10-batches-py"
    cifar.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 6), ("test_batch", 4)):
        with open(cifar / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(range(n))}, f)
    x, y, test = pv.load_cifar10(cifar)
    assert x.shape == (10, 3, 32, 32) and x.max() <= 1 and test.sum() == 4 and y[:6].tolist() == list(range(6))
    p = pv.Params(dataset="cifar10", dataset_dir=str(cifar), n_classes=6, image_size=16, n_test=1)
    pv.prepare(p, tmp_path)
    assert pv._load(tmp_path, p)["x_test"].shape == (4, 3, 16, 16)

    nette = tmp_path / "nette"
    for split in ("train", "val"):
        for c in ("n01", "n02"):
            (nette / split / c).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(nette / split / c / f"{i}.png")
    x, y, test = pv.load_imagenette(nette, 8)
    assert x.shape == (8, 3, 8, 8) and sorted(set(y.tolist())) == [0, 1] and test.sum() == 4


def test_params_reject_mismatched_betas():
    with pytest.raises(ValueError, match="betas"):
        pv.Params(betas=(1.0, 2.0))


def test_generator_mmd_bound_separates_a_class_faithful_pool_from_a_wrong_class_pool():
    """The premise's bound is the midpoint of held-out real and wrong-class real MMD: a pool drawn from the class's
    own distribution lies below it, a pool of the other class's images above it."""
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [3.0, 0.0]])

    def draw(labels):
        return centres[labels] + torch.randn(len(labels), 2, generator=g), labels

    train, test = draw(torch.arange(2).repeat(60)), draw(torch.arange(2).repeat(20))
    good, bad = draw(torch.arange(2).repeat(30)), draw(torch.arange(2).repeat(30))
    bad = (bad[0], 1 - bad[1])  # every sample labelled as the other class
    m = pv.generator_mmd({"good": good, "bad": bad}, train, test, seed=0)
    assert m["detail/mmd/real_heldout"] < m["detail/mmd/bound"] < m["detail/mmd/wrong_class"]
    assert m["detail/mmd/pool_good"] < m["detail/mmd/bound"] < m["detail/mmd/pool_bad"]
    names = {c.left for c in pv.PAPER.claim.premises}
    assert names == {f"detail/mmd/pool_{g}" for g in pv.GENERATORS if g != "diffusion"}
    shown = {c.left for c in pv.PAPER.claim.context}  # the latent DDPM's premise and accuracy part are context
    assert "detail/mmd/pool_diffusion" in shown and not any("diffusion/" in c.right_names[0]
                                                            for c in pv.PAPER.claim.all_of if c.right_names)
    assert "method/gen_select_gflops" in shown  # a larger counted cost by construction: context


def test_plain_var_selector_arm_is_the_selector_on_the_plain_var_pool():
    """The arm that separates the prototypes from the selector: the same greedy MMD selector as ProtoVAR's, run on
    plain VAR's pool (untrained networks suffice: the plumbing is what is checked)."""
    p = _params(n_classes=2, ipcs=(1, 3), pool_factor=4, observer_width=4, unet_channels=(8, 16), ddim_steps=2,
                ddpm_steps=10, codebook_size=8)
    g = torch.Generator().manual_seed(0)
    d = {"x": torch.rand(20, 1, 16, 16, generator=g) * 2 - 1, "y": torch.arange(20) % 2}
    tok = _tokenizer(p)
    torch.manual_seed(0)
    gens = pv.Generators(p, 1, p.n_classes).eval()
    with torch.no_grad():
        _, _, residuals = tok.quantize(tok.encoder(d["x"]))
    protos = pv.class_prototypes(residuals, d["y"], p.n_classes, p.n_protos, 0)
    sets, costs, pools = pv.distil(p, d, tok, gens, protos, 1.0)
    plain, classes = pools["plain_var"]
    feats, probs = pv.observe(gens.observer, plain)
    real_feats, _ = pv.observe(gens.observer, d["x"])
    for k in p.ipcs:
        x, y = sets[f"plain_var_selector_ipc{k}"]
        assert x.shape[0] == k * p.n_classes
        for c in range(p.n_classes):
            pool = torch.nonzero(classes == c).flatten()[: p.pool_factor * k]
            want = pv.select(feats[pool], probs[pool, c], real_feats[d["y"] == c], k, p.min_confidence)
            assert torch.equal(x[y == c], plain[pool[want]])
    assert costs["gflops"]["plain_var_selector"] > costs["gflops"]["plain_var"]
    assert {f"{a}_ipc{k}" for a in pv.ARMS for k in p.ipcs} == set(sets)
    parts = {c.right_names[0] for c in pv.PAPER.claim.all_of if c.right_names}
    assert "baseline/plain_var_selector/acc_ipc10" in parts and "baseline/plain_var/acc_ipc10" in parts
