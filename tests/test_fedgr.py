"""FedGR's mechanism on tiny inputs: FedAvg arithmetic, the server round, sniffing, refining, the local losses, data."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from models import fedgr
from models.common.tables import read_table


def test_fedavg_matches_hand_computation():
    # 1 federation, 3 clients with 1, 2 and 5 samples: w = (1*w1 + 2*w2 + 5*w3) / 8
    local = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [-1.0, 8.0]]])  # (F=1, K=3, 2)
    n = torch.tensor([1.0, 2.0, 5.0])
    expected = torch.tensor([[(1 * 1 + 2 * 3 + 5 * -1) / 8, (0 + 2 * 4 + 5 * 8) / 8]])  # [[0.25, 6.0]]
    assert torch.allclose(fedgr.fedavg(local, n), expected)
    assert torch.allclose(expected, torch.tensor([[0.25, 6.0]]))
    # equal sizes: the plain mean; an empty client contributes nothing
    assert torch.allclose(fedgr.fedavg(local, torch.ones(3)), local.mean(1))
    assert torch.allclose(fedgr.fedavg(local, torch.tensor([1.0, 1.0, 0.0])), local[:, :2].mean(1))


def test_batched_mlp_equals_separate_linear_stacks():
    g = torch.Generator().manual_seed(0)
    w = fedgr.init_weights(3, (5, 7, 4, 2), g)
    x = torch.randn(3, 6, 5)
    logits, emb = fedgr.mlp(w, x)
    for m in range(3):
        z = F.relu(F.relu(x[m] @ w[0][m] + w[1][m]) @ w[2][m] + w[3][m])
        assert torch.allclose(emb[m], z, atol=1e-6)
        assert torch.allclose(logits[m], z @ w[4][m] + w[5][m], atol=1e-6)


SETTINGS = [{"name": "mild", "rho_min": 0.0, "rho_max": 0.0}, {"name": "severe", "rho_min": 0.5, "rho_max": 0.5}]


def _tiny_data(n=24, k=3, s=2, d=4, classes=3):
    g = torch.Generator().manual_seed(1)
    owner = torch.arange(n) % k
    owner[:6] = 0  # unequal client sizes
    true = torch.randint(0, classes, (n,), generator=g)
    return {"x": torch.rand(n, d, generator=g), "true": true, "noisy": true.repeat(s, 1), "owner": owner,
            "n": torch.bincount(owner, minlength=k).float(), "x_test": torch.rand(5, d, generator=g),
            "y_test": torch.randint(0, classes, (5,), generator=g), "shape": (1, 2)}


def test_arms_put_ablations_in_the_severe_setting_and_train_the_clean_reference_on_true_labels():
    arms = fedgr.arms(["mild", "severe"], ablations=True, clean_reference=True)
    assert [a.method for a in arms if a.setting == 0] == list(fedgr.METHODS)
    assert [a.method for a in arms if a.setting == 1] == [*fedgr.METHODS, *(f"fedgr_{k}" for k in fedgr.ABLATIONS)]
    assert arms[-1] == fedgr.Arm(-1, fedgr.CLEAN) and len(arms) == 2 * len(fedgr.METHODS) + 3 + 1
    assert len(fedgr.arms(["mild", "severe"], ablations=False, clean_reference=False)) == 2 * len(fedgr.METHODS)
    d = _tiny_data()
    d["noisy"][1] = (d["true"] + 1) % 3  # the severe setting: every label wrong
    fed = fedgr.Federation(arms, 3, (4, 6, 5, 3), 24, rounds=3, seed=0)
    labels = fedgr.arm_labels(fed, d)
    assert torch.equal(labels[fed.index(fedgr.CLEAN)[0]], d["true"])
    assert torch.equal(labels[fed.index("fedavg", 1)[0]], d["noisy"][1])
    assert fed.switches().tolist() == [[True] * 3, [True] * 3, [False, True, True], [True, False, True],
                                       [True, True, False]]


def test_server_round_aggregates_broadcasts_and_revises_ema():
    d = _tiny_data()
    p = fedgr.Params(settings=SETTINGS, clients=3, rounds=3, sniff_round=9)
    fed = fedgr.Federation(fedgr.arms(["mild", "severe"], True, True), 3, (4, 6, 5, 3), 24, rounds=3, seed=0)
    with torch.no_grad():
        for w in fed.local:  # clients drift apart during "local training"
            w.add_(torch.randn_like(w))
    before = [w.detach().clone().view(fed.F, 3, *w.shape[1:]) for w in fed.local]
    ema_before = [e.clone() for e in fed.weights("ema")]
    resets = []
    fedgr.server_round(fed, 1, d, p, lambda: resets.append(1))
    n = d["n"]
    for i, w in enumerate(fed.weights("glob")):
        by_hand = sum(n[k] * before[i][:, k] for k in range(3)) / n.sum()  # (F, ...)
        assert torch.allclose(w, by_hand, atol=1e-6)
        assert torch.equal(fed.local[i].detach(), w.repeat_interleave(3, 0))  # broadcast
        fg = w[fed.variants].repeat_interleave(3, 0)
        assert torch.allclose(fed.weights("ema")[i], 0.7 * ema_before[i] + 0.3 * fg, atol=1e-6)
    assert resets == [1]
    assert torch.isfinite(fed.test_acc[0]).all() and torch.isnan(fed.test_acc[1]).all()


def _oracle_federation(d, classes=3):
    """Every network maps the one-hot input of class c to logits 10 onehot(c): the refined labels are the truth."""
    fed = fedgr.Federation(fedgr.arms(["mild", "severe"], True, False), 3, (classes,) * 4, len(d["true"]), rounds=3,
                           seed=0)
    with torch.no_grad():
        for i, w in enumerate(fed.weights("glob")):
            w.copy_(torch.eye(classes).expand_as(w) * (10.0 if i == 4 else 1.0) if i % 2 == 0 else torch.zeros_like(w))
    return fed


def test_refining_recovers_the_true_label_of_every_mislabelled_sample_of_an_oracle_global_model():
    """The recall's known case: a global model that predicts the truth confidently refines every noisy label back
    (recall 1, precision 1), whatever the noise; the no_sniff ablation refines nothing and keeps c = 1."""
    d = _tiny_data()
    d["x"] = F.one_hot(d["true"], 3).float()
    d["noisy"][1, ::2] = (d["true"][::2] + 1) % 3  # severe: half the labels flipped
    p = fedgr.Params(settings=SETTINGS, clients=3, rounds=3, sniff_round=1, shift_pixels=0)
    fed = _oracle_federation(d)
    fedgr.server_round(fed, 0, d, p, lambda: None)
    for v, f in enumerate(fed.variants):
        s, method = fed.arms[f]
        refined = fed.refined[v].numpy()
        if method == "fedgr_no_sniff":
            assert (refined == -1).all() and (fed.clean_prob[v] == 1).all() and not fed.noisy_client[v].any()
            continue
        precision, recall = fedgr.refine_scores(refined, d["noisy"][s].numpy(), d["true"].numpy())
        assert (refined == d["true"].numpy()).all() and precision == 1.0
        assert recall == (1.0 if s == 1 else 0.0)  # mild has no mislabelled sample: recall 0 by definition
    v = fed.variants.index(fed.index("fedgr", 1)[0])  # the oracle's loss separates the flipped labels exactly
    assert ((fed.clean_prob[v] < 0.5) == (d["noisy"][1] != d["true"])).all()


def test_refine_scores_by_hand():
    true = np.array([0, 1, 2, 0, 1, 2, 0, -1])
    noisy = np.array([0, 2, 0, 1, 1, 2, 2, 1])  # mislabelled: indices 1, 2, 3, 6 (index 7 unknown)
    refined = np.array([0, 1, -1, 2, -1, 2, 0, 1])  # has: 0, 1, 3, 5, 6 -> correct 0, 1, 5, 6 -> precision 4/5
    precision, recall = fedgr.refine_scores(refined, noisy, true)
    assert precision == 0.8 and recall == 0.5  # mislabelled 1 and 6 recovered of 4


def test_sniff_separates_low_and_high_loss_samples_and_estimates_client_rates():
    rng = np.random.default_rng(0)
    owner = np.repeat([0, 1], 100)
    noisy = np.zeros(200, bool)
    noisy[:10], noisy[100:160] = True, True  # client 0: 10 % noisy, client 1: 60 %
    loss = np.where(noisy, rng.normal(2.5, 0.2, 200), rng.normal(0.3, 0.1, 200))
    clean, rate = fedgr.sniff(loss, owner, 2, seed=0)
    assert ((clean < 0.5) == noisy).mean() > 0.98
    assert np.allclose(rate, [0.1, 0.6], atol=0.03)


def test_weak_shift_moves_every_image_by_one_pixel():
    x = torch.zeros(40, 16)
    x[:, 5] = 1.0  # one lit pixel at (1, 1) of a 4x4 image
    out = fedgr.weak_shift(x, (1, 4), torch.Generator().manual_seed(0)).view(40, 4, 4)
    lit = out.nonzero()[:, 1:]  # (40, 2) new positions
    assert len(lit) == 40 and ((lit - 1).abs().sum(1) == 1).all()
    assert len({tuple(v.tolist()) for v in lit}) == 4  # all four directions occur


def test_fedgr_loss_parts():
    p = fedgr.Params(settings=SETTINGS)
    g = torch.Generator().manual_seed(0)
    logits, emb = torch.randn(1, 2, 5, 3, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    y = torch.randint(0, 3, (1, 2, 5), generator=g)
    ones, none = torch.ones(1, 2, 5), torch.full((1, 2, 5), -1)
    clean_clients = torch.zeros(1, 2, dtype=torch.bool)
    on = torch.ones(1, 3, dtype=torch.bool)
    # warm-up: plain CE
    total, _ = fedgr.fedgr_loss(logits, emb, logits, emb, logits, y, ones, none, clean_clients, on, p, False)
    assert torch.allclose(total, fedgr.ce(logits, y).mean(-1))
    # c = 1 everywhere, the teacher equal to the sharpened local, the global embedding equal to the local one
    teacher = logits * p.sharpen_t  # softmax(teacher / T) == softmax(logits)
    total, (ref, ema, rep) = fedgr.fedgr_loss(logits, emb, logits, emb, teacher, y, ones, none, clean_clients, on, p,
                                              True)
    assert torch.allclose(ref, fedgr.ce(logits, y).mean(-1)) and ema.abs().max() < 1e-5 and rep.abs().max() < 1e-5
    # c = 0 and a refined label: the loss is CE against the refined label; no refined label: nothing
    refined = (y + 1) % 3
    _, (ref, _, _) = fedgr.fedgr_loss(logits, emb, logits, emb, teacher, y, 0 * ones, refined, clean_clients, on, p,
                                      True)
    assert torch.allclose(ref, fedgr.ce(logits, refined).mean(-1))
    _, (ref, _, _) = fedgr.fedgr_loss(logits, emb, logits, emb, teacher, y, 0 * ones, none, clean_clients, on, p, True)
    assert torch.equal(ref, torch.zeros(1, 2))
    # noisy clients: pseudo-label CE only, averaged over samples that have one
    refined[0, 1, :2] = -1
    noisy_clients = torch.tensor([[False, True]])
    _, (ref, _, _) = fedgr.fedgr_loss(logits, emb, logits, emb, teacher, y, ones, refined, noisy_clients, on, p, True)
    assert torch.allclose(ref[0, 1], fedgr.ce(logits[0, 1, 2:], refined[0, 1, 2:]).mean())


def test_each_ablation_switch_removes_exactly_its_module():
    """Rows: full FedGR, no_ema, no_rep. A switched-off module adds exactly 0, and its input (the EMA teacher, the
    global embedding) no longer moves the loss; the other modules are untouched."""
    p = fedgr.Params(settings=SETTINGS)
    g = torch.Generator().manual_seed(0)
    logits, emb = torch.randn(3, 2, 5, 3, generator=g), torch.randn(3, 2, 5, 4, generator=g)
    y, refined = torch.randint(0, 3, (3, 2, 5), generator=g), torch.randint(0, 3, (3, 2, 5), generator=g)
    clean, noisy_clients = torch.rand(3, 2, 5, generator=g), torch.zeros(3, 2, dtype=torch.bool)
    on = torch.tensor([fedgr.VARIANTS[m] for m in ("fedgr", "fedgr_no_ema", "fedgr_no_rep")])
    teacher, emb_g = torch.randn(3, 2, 5, 3, generator=g), torch.randn(3, 2, 5, 4, generator=g)

    def loss(teacher, emb_g):
        return fedgr.fedgr_loss(logits, emb, logits, emb_g, teacher, y, clean, refined, noisy_clients, on, p, True)

    total, (ref, ema, rep) = loss(teacher, emb_g)
    assert (ema[0] > 0).all() and (rep[0] > 0).all()
    assert torch.equal(ema[1], torch.zeros(2)) and (rep[1] > 0).all()
    assert torch.equal(rep[2], torch.zeros(2)) and (ema[2] > 0).all()
    assert torch.allclose(total, ref + ema + rep)
    moved_teacher, _ = loss(torch.randn(3, 2, 5, 3, generator=g), emb_g)
    moved_emb, _ = loss(teacher, torch.randn(3, 2, 5, 4, generator=g))
    assert torch.equal(moved_teacher[1], total[1]) and not torch.allclose(moved_teacher[0], total[0])
    assert torch.equal(moved_emb[2], total[2]) and not torch.allclose(moved_emb[0], total[0])
    # no_sniff: its server state (c = 1, no refined label, no noisy client) makes the refine term plain CE(y)
    _, (ref, _, _) = fedgr.fedgr_loss(logits, emb, logits, emb_g, teacher, y, torch.ones(3, 2, 5),
                                      torch.full((3, 2, 5), -1), noisy_clients, on, p, True)
    assert torch.allclose(ref, fedgr.ce(logits, y).mean(-1))


def test_sce_and_small_loss_selection():
    logits, y = torch.tensor([[[4.0, 0.0], [0.0, 4.0]]]), torch.tensor([[0, 0]])
    sce = fedgr.sce_loss(logits, y)
    p_y = logits.softmax(-1)[0, :, 0]
    assert torch.allclose(sce[0], 0.1 * -p_y.log() + (1 - p_y) * -np.log(1e-4))
    loss = torch.tensor([[0.5, 0.1, 0.9, 0.3], [1.0, 2.0, 3.0, 4.0]])
    keep = fedgr.small_loss_mask(loss, torch.tensor([0.5, 0.25]))
    assert keep.tolist() == [[False, True, False, True], [True, True, True, False]]


def test_generator_noise_is_controlled_by_its_knobs(tmp_path):
    labels = np.repeat(np.arange(10), 30)
    owner = fedgr.dirichlet_partition(labels, 5, 0.1, np.random.default_rng(0))
    iid = fedgr.dirichlet_partition(labels, 5, 1000.0, np.random.default_rng(0))
    assert set(owner) <= set(range(5)) and len(owner) == len(labels)
    skew = lambda o: np.mean([np.bincount(labels[o == k], minlength=10).max() / max((o == k).sum(), 1)  # noqa: E731
                              for k in range(5)])
    assert skew(owner) > skew(iid) + 0.2  # small alpha: clients dominated by few classes
    rng = np.random.default_rng(0)
    sym = fedgr.inject_noise(labels, "symmetric", 0.3, 10, rng)
    assert (sym != labels).sum() == 90
    pair = fedgr.inject_noise(labels, "pair", 0.3, 10, rng)
    assert all(fedgr.PAIR_FLIPS[a] == b for a, b in zip(labels[pair != labels], pair[pair != labels], strict=True))
    # turning the noise off: rho = 0 leaves every label clean
    p = fedgr.Params(n_samples=200, clients=4, pair_flip_share=0.0, settings=SETTINGS)  # mild: rho = 0
    fedgr.prepare(p, tmp_path)
    t = read_table(tmp_path / "samples.parquet")
    off, on = (t["setting"] == "mild") & (t["split"] == "train"), (t["setting"] == "severe") & (t["split"] == "train")
    assert (t["noisy_label"][off] == t["true_label"][off]).all()
    assert abs((t["noisy_label"][on] != t["true_label"][on]).mean() - 0.5) < 0.05


def test_cifar_and_clothing1m_loaders_read_tiny_fixtures(tmp_path):
    import pickle

    from PIL import Image

    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 4), ("data_batch_2", 3), ("test_batch", 2)):
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(range(n))}, f)
    xtr, ytr, xte, yte = fedgr.load_cifar(tmp_path, 10)
    assert xtr.shape == (7, 3072) and xte.shape == (2, 3072) and ytr.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert 0 <= xtr.min() and xtr.max() <= 1
    c1m = tmp_path / "c1m"
    (c1m / "images").mkdir(parents=True)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(c1m / "images" / f"{i}.jpg")
    (c1m / "noisy_label_kv.txt").write_text("images/0.jpg 3\nimages/1.jpg 5\nimages/2.jpg 1\n")
    (c1m / "clean_label_kv.txt").write_text("images/1.jpg 4\nimages/3.jpg 13\n")
    (c1m / "noisy_train_key_list.txt").write_text("images/0.jpg\nimages/1.jpg\nimages/2.jpg\n")
    (c1m / "clean_test_key_list.txt").write_text("images/3.jpg\n")
    xtr, noisy, clean, xte, yte = fedgr.load_clothing1m(c1m, 8)
    assert xtr.shape == (3, 192) and noisy.tolist() == [3, 5, 1] and clean.tolist() == [-1, 4, -1]
    assert xte.shape == (1, 192) and yte.tolist() == [13]


def test_batched_cnn_networks_are_independent_cnns():
    """Full profile: M CNNs as one grouped convolution; network 1 equals a plain conv stack with its weights."""
    g = torch.Generator().manual_seed(0)
    w = [t.requires_grad_() for t in fedgr.init_cnn(3, (3, 4, 6, 10), g)]
    x = torch.randn(3, 5, 3 * 8 * 8)
    logits, emb = fedgr.net(w, x)
    assert logits.shape == (3, 5, 10) and emb.shape == (3, 5, 6)
    img = x[1].view(5, 3, 8, 8)
    h = torch.relu(torch.nn.functional.conv2d(img, w[0][1], w[1][1], padding=1))
    h = torch.relu(torch.nn.functional.conv2d(torch.nn.functional.max_pool2d(h, 2), w[2][1], w[3][1], padding=1))
    z = h.mean((2, 3))
    assert torch.allclose(emb[1], z, atol=1e-5) and torch.allclose(logits[1], z @ w[4][1] + w[5][1], atol=1e-5)
    logits[0].sum().backward()
    assert all(t.grad[1:].abs().max() == 0 for t in w)  # network 0's loss moves only network 0
    fed = fedgr.Federation(fedgr.arms(["mild", "severe"], True, True), 2, (3, 4, 6, 10), 24, rounds=3, seed=0,
                           arch="cnn")
    assert fed(torch.randn(fed.F * 2, 4, 3 * 8 * 8))[0].shape == (fed.F * 2, 4, 10)


def test_pair_flip_ratio_is_capped_so_the_true_label_stays_the_majority(tmp_path):
    """The root cause of a near-zero refining recall: pair flips at a ratio >= 0.5 relabel most of a class as its
    pair, the flipped label becomes what the data teach, and no small-loss or confidence rule can recover it."""
    labels = np.repeat(np.arange(10), 50)
    flipped = fedgr.inject_noise(labels, "pair", 0.6, 10, np.random.default_rng(0))  # what the generator did before
    assert all(np.bincount(flipped[labels == c], minlength=10).argmax() == fedgr.PAIR_FLIPS[c] for c in range(10))
    p = fedgr.Params(n_samples=600, clients=4, pair_flip_share=1.0,
                     settings=[{"name": "mild", "rho_min": 0.0, "rho_max": 0.4},
                               {"name": "severe", "rho_min": 0.6, "rho_max": 0.7}])
    fedgr.prepare(p, tmp_path)
    t, c = read_table(tmp_path / "samples.parquet"), read_table(tmp_path / "clients.parquet")
    assert (c["noise_ratio"][c["setting"] == "severe"] <= p.pair_flip_max).all()  # as realised
    train = (t["setting"] == "severe") & (t["split"] == "train")
    true, noisy = t["true_label"][train], t["noisy_label"][train]
    owner = t["client_id"][train]
    for k in range(4):  # in every class of every client, the true label is the given label's strict majority
        for cls in np.unique(true[owner == k]):
            given = noisy[(owner == k) & (true == cls)]
            assert (given == cls).sum() > len(given) / 2


def test_untrained_memorisation_scores_the_round0_model_on_each_clients_own_mislabelled_samples():
    """The probe of a model that memorised nothing: FedAvg's initial global model, per client, by hand; a setting
    without mislabelled samples scores 0."""
    d = _tiny_data()
    d |= {"K": 3, "settings": ["mild", "severe"], "classes": 3}
    d["noisy"][1, ::3] = (d["true"][::3] + 1) % 3
    p = fedgr.Params(settings=SETTINGS, clients=3, hidden=(6, 5), seed=4)
    arm_list = fedgr.arms(["mild", "severe"], True, True)
    got = fedgr.untrained_memorisation(p, d, arm_list)
    fed0 = fedgr.Federation(arm_list, 3, (4, 6, 5, 3), 24, rounds=1, seed=4)
    w0 = [w[fed0.index("fedavg", 1)[0]] for w in fed0.weights("glob")]
    pred = fedgr.mlp([w[None] for w in w0], d["x"][None])[0][0].argmax(-1)
    wrong = d["noisy"][1] != d["true"]
    by_hand = [float((pred[own] == d["noisy"][1, own]).float().mean())
               for own in ((d["owner"] == k) & wrong for k in range(3)) if own.any()]
    assert got[0] == 0.0 and np.isclose(got[1], np.mean(by_hand))
    assert 0.0 <= got[1] <= 1.0
