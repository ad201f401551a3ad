"""PerturbedVAE's mechanism on tiny inputs: the SCM prior's KL, NB likelihood, gates, prediction, metrics, data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import nbinom

from models import perturbed_vae as pv


def test_kl_scm_prior_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    a = torch.triu(torch.randn(pv.D_P, pv.D_P, generator=g), 1) * 0.5
    mu, logvar = torch.randn(4, pv.D_P, generator=g), 0.3 * torch.randn(4, pv.D_P, generator=g)
    shift = torch.randn(4, pv.D_P, generator=g)
    b = torch.linalg.inv(torch.eye(pv.D_P) - a)
    q = torch.distributions.MultivariateNormal(mu, torch.diag_embed(logvar.exp()))
    prior = torch.distributions.MultivariateNormal(shift @ b.T, b @ b.T)
    assert torch.allclose(pv.kl_scm_prior(mu, logvar, shift, a), torch.distributions.kl_divergence(q, prior), atol=1e-4)


def test_nb_log_prob_matches_scipy():
    x, mean, theta = torch.tensor([[0.0, 3.0, 17.0]]), torch.tensor([[2.0, 5.0, 9.0]]), torch.tensor([1.5, 10.0, 4.0])
    ref = nbinom.logpmf(x.numpy(), theta.numpy(), (theta / (theta + mean)).numpy())
    assert np.allclose(pv.nb_log_prob(x, mean, theta).numpy(), ref, atol=1e-4)


def test_hard_concrete_gates_are_exactly_sparse_and_l0_counts_them():
    log_alpha = torch.tensor([[-10.0, 10.0, 0.0]])
    assert pv.hard_concrete(log_alpha, training=False).tolist()[0][:2] == [0.0, 1.0]
    torch.manual_seed(0)
    samples = pv.hard_concrete(torch.zeros(2000), training=True)
    assert samples.min() == 0.0 and samples.max() == 1.0 and 0.05 < (samples == 0).float().mean() < 0.5
    assert pv.l0_penalty(torch.tensor([-10.0])) < 0.01 < 0.99 < pv.l0_penalty(torch.tensor([10.0]))


def test_gradient_reversal():
    x = torch.ones(3, requires_grad=True)
    pv.GradReverse.apply(x, 0.5).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), -0.5))


def test_predict_moves_control_cells_through_the_scm():
    p = pv.Params()
    torch.manual_seed(0)
    net = pv.PerturbedVAE(12, 3, 5, 16, p).eval()
    with torch.no_grad():
        net.a_raw.copy_(torch.randn(pv.D_P, pv.D_P))
        net.log_alpha.fill_(10.0)  # all gates open
    x = torch.poisson(torch.full((6, 12), 5.0))
    mi, _, mp, _ = net.encode(x)
    lib = torch.full((6,), 1e4)
    assert torch.allclose(net.predict(x, torch.zeros(3)), pv.log_normalise(net.decode_mean(mi, mp, lib)).mean(0),
                          atol=1e-5)  # empty set: the control cells themselves
    pert = torch.tensor([1.0, 0.0, 1.0])
    b = torch.linalg.inv(torch.eye(pv.D_P) - net.a())
    moved = mp + (pert @ net.effects) @ b.T  # z_p + (I - A)^-1 sum_g e_g
    assert torch.allclose(net.predict(x, pert), pv.log_normalise(net.decode_mean(mi, moved, lib)).mean(0), atol=1e-4)


def test_mcc_and_mask_f1_are_permutation_invariant():
    rng = np.random.default_rng(0)
    true = rng.standard_normal((500, pv.D_P))
    perm = rng.permutation(pv.D_P)
    learned = np.empty_like(true)
    learned[:, perm] = -3.0 * true  # learned dim perm[j] = scaled, sign-flipped true latent j
    value, match = pv.mcc(learned, true)
    assert np.isclose(value, 1.0) and (match == perm).all()
    mask = rng.random((4, pv.D_P)) < 0.3
    gates = np.zeros((4, pv.D_P))
    gates[:, perm] = mask
    assert pv.mask_f1(gates, mask, match) == 1.0
    assert pv.mask_f1(np.ones((4, pv.D_P)), mask, match) < 0.6  # a dense mask is penalised


def test_de20_scores():
    true = np.linspace(-1, 1, 50)
    assert np.isclose(pv.de20_scores(2 * true, true)[0], 1.0)
    assert np.isclose(pv.de20_scores(true + 0.5, true)[1], 0.25)


def _condition_share(p: pv.Params) -> float:
    """Share of the variance of log-normalised expression explained by the perturbation condition (eta^2)."""
    d = pv.simulate(p)
    xl = np.log1p(d["counts"] / d["counts"].sum(1, keepdims=True) * 1e4)
    total = xl.var(0).sum()
    means = {c: xl[d["cond"] == c].mean(0) for c in set(d["cond"])}
    between = np.mean([((means[c] - xl.mean(0)) ** 2).sum() for c in d["cond"]])
    return between / total


def test_generator_sparsity_split_and_dominance_knob():
    p = pv.Params(genes=40, singles=5, doubles=6, cells=1200)
    d = pv.simulate(p)
    assert d["mask"].sum(1).min() >= 1 and d["mask"].sum(1).max() <= p.max_targets
    assert (d["shift"][~d["mask"]] == 0).all()
    test = set(d["cond"][d["split"] == "test"])
    assert test and all("+" in c for c in test) and not test & set(d["cond"][d["split"] == "train"])
    assert {g for c in test for g in c.split("+")} <= set(d["cond"][d["split"] == "train"])  # singles seen
    dominated = _condition_share(p)
    balanced = _condition_share(p.model_copy(update={"rho_inv": 0.1}))
    assert balanced > 2 * dominated  # lowering rho_inv makes the perturbation signal a larger share


def test_norman_mtx_loader(tmp_path):
    from scipy.io import mmwrite
    from scipy.sparse import csr_matrix

    counts = np.array([[0, 2, 1], [3, 0, 0], [1, 1, 1], [0, 0, 5]])
    mmwrite(str(tmp_path / "matrix.mtx"), csr_matrix(counts))
    (tmp_path / "obs.csv").write_text("cell,condition\nc0,ctrl\nc1,A+ctrl\nc2,B+A\nc3,C+B\n")
    d = pv.load_norman_mtx(tmp_path)
    assert (d["counts"] == counts).all() and d["cond"].tolist() == ["ctrl", "A", "A+B", "B+C"]
    assert d["split"].tolist() == ["train", "train", "train", "test"]


def _write_h5ad(path, counts, conditions, legacy=False, layer=False, x=None):
    """AnnData's on-disk layout written with h5py (anndata itself is not installed): X (csr group) or
    layers/counts, obs with a categorical `condition` (anndata >= 0.8 group, or 0.7 codes + __categories)."""
    import h5py
    from scipy.sparse import csr_matrix

    cats = sorted(set(conditions))
    with h5py.File(path, "w") as f:
        f.attrs["encoding-type"] = "anndata"
        m = csr_matrix(counts)
        grp = f.create_group("layers").create_group("counts") if layer else f.create_group("X")
        grp.attrs["encoding-type"], grp.attrs["shape"] = "csr_matrix", counts.shape
        grp["data"], grp["indices"], grp["indptr"] = m.data.astype(np.float32), m.indices, m.indptr
        if x is not None:
            f["X"] = x
        obs = f.create_group("obs")
        obs["_index"] = np.array([f"cell{i}" for i in range(len(conditions))], dtype="S")
        codes = np.array([cats.index(c) for c in conditions], np.int8)
        if legacy:
            obs["condition"] = codes
            obs.create_group("__categories")["condition"] = np.array(cats, dtype="S")
        else:
            col = obs.create_group("condition")
            col.attrs["encoding-type"] = "categorical"
            col["codes"], col["categories"] = codes, np.array(cats, dtype=h5py.string_dtype())


def test_norman_h5ad_loader(tmp_path):
    counts = np.array([[0, 2, 1], [3, 0, 0], [1, 1, 1], [0, 0, 5]])
    conditions = ["ctrl", "A+ctrl", "B+A", "C+B"]
    _write_h5ad(tmp_path / "new.h5ad", counts, conditions)
    _write_h5ad(tmp_path / "old.h5ad", counts, conditions, legacy=True)
    for name in ("new.h5ad", "old.h5ad"):
        d = pv.load_norman_h5ad(tmp_path / name)
        assert (d["counts"] == counts).all() and d["cond"].tolist() == ["ctrl", "A", "A+B", "B+C"]
        assert d["split"].tolist() == ["train", "train", "train", "test"] and d["library"].tolist() == [3, 3, 3, 5]
    # GEARS keeps log-normalised values in X: the raw counts layer is read instead, and X alone is refused
    _write_h5ad(tmp_path / "gears.h5ad", counts, conditions, layer=True, x=np.log1p(counts.astype(np.float32)))
    assert (pv.load_norman_h5ad(tmp_path / "gears.h5ad")["counts"] == counts).all()
    import h5py

    with h5py.File(tmp_path / "gears.h5ad", "a") as f:
        del f["layers"]
    with pytest.raises(ValueError, match="not raw counts"):
        pv.load_norman_h5ad(tmp_path / "gears.h5ad")


def test_elbo_per_gene_known_value_and_invariance_to_gene_count():
    nll, kl = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]), torch.tensor([6.0, 0.0])
    assert torch.isclose(pv.elbo_per_gene(nll, kl, warm=0.5, prior=3.0), torch.tensor((6.0 + 0.5 * 3.0 + 3.0) / 3))
    # the same cells on a panel tiled 4x: the likelihood part per gene is unchanged (the summed one grows 4x)
    tiled = nll.repeat(1, 4)
    zero = torch.zeros(2)
    assert torch.isclose(pv.elbo_per_gene(tiled, zero), pv.elbo_per_gene(nll, zero))
    assert torch.isclose(tiled.sum(-1).mean(), 4 * nll.sum(-1).mean())


@pytest.mark.parametrize("arm", ["pvae", "cpa", "cvae"])
def test_every_arm_trains_on_the_per_gene_scale(arm):
    """At initialisation a panel 10x larger gives a loss of the same size (a summed likelihood would be ~10x)."""
    p = pv.Params(lambda_adv=0.0, lambda_l0=0.0, lambda_a=0.0)
    losses = []
    for genes in (30, 300):
        torch.manual_seed(0)
        net = {"pvae": pv.PerturbedVAE, "cpa": pv.CPAStyle, "cvae": pv.CondVAE}[arm](genes, 3, 4, 16, p)
        x = torch.poisson(torch.full((64, genes), 3000.0 / genes))
        batch = {"x": x, "P": torch.zeros(64, 3), "cond": torch.zeros(64, dtype=torch.long),
                 "step": torch.full((64,), 10**6)}
        losses.append(float(net(batch).detach()))
    assert 0.5 < losses[1] / losses[0] < 2.0


def test_probe_reads_a_latent_that_carries_the_condition_and_not_noise():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.array(["ctrl", "a", "b", "c"]), 100)
    carrying = rng.standard_normal((400, pv.D_P)) + 3.0 * (labels[:, None] == np.array(["a", "b", "c", "x"] * 2))
    acc, chance = pv.probe_accuracy(carrying, labels, seed=0)
    assert chance == 0.25 and acc > 0.9
    acc, _ = pv.probe_accuracy(rng.standard_normal((400, pv.D_P)), labels, seed=0)
    assert acc < 0.4


def test_sweep_world_is_the_same_draw_at_another_rho(tmp_path):
    p = pv.Params(genes=30, singles=3, doubles=2, cells=300, sweep_rho=[0.5])
    assert pv.sweep_worlds(p) == {0.5: "rho_0.5", 0.9: ""}
    assert pv.sweep_worlds(p.model_copy(update={"dataset": "norman_h5ad"})) == {0.5: "rho_0.5", 0.9: "rho_0.9"}
    pv.prepare(p, tmp_path)
    worlds = pv._worlds(p, tmp_path)
    main, low = worlds[""], worlds["rho_0.5/"]
    assert (main["names"] == low["names"]).all() and (main["mask_true"] == low["mask_true"]).all()
    assert not torch.equal(main["x"], low["x"])  # the counts differ: only the dominance changed
    model = pv.build(worlds, p)
    assert set(model.nets) == {"pvae", "cpa", "cvae", "no_mask", "no_adv", "pvae_rho50", "cvae_rho50"}
    seen = {}
    for name in ("cvae", "cvae_rho50"):
        model.nets[name].forward = lambda batch, name=name: seen.setdefault(name, batch["x"]).sum()
    batch = {"x": torch.zeros(2, 30), "rho_0.5/x": torch.ones(2, 30)}
    model.nets = torch.nn.ModuleDict({k: model.nets[k] for k in ("cvae", "cvae_rho50")})
    model(batch)
    assert seen["cvae"].sum() == 0 and seen["cvae_rho50"].sum() == 60  # each arm reads its own world's batch


def test_gate_warmup_freezes_the_gate_logits_and_leaves_out_l0():
    """Before `gate_warmup` the gate logits get no gradient (L0 off, gates sampled from frozen logits), so they
    cannot close while the effects are still small; from then on the L0 penalty acts and they train."""
    p = pv.Params(gate_warmup=5, lambda_adv=0.0, effect_init=1.0)
    torch.manual_seed(0)
    net = pv.PerturbedVAE(12, 3, 4, 16, p)
    assert 0.7 < float(net.effects.std()) < 1.3  # effects start at the prior's unit scale
    x = torch.poisson(torch.full((32, 12), 20.0))
    pert = torch.zeros(32, 3)
    pert[:16, 0] = 1.0

    def grads(step: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        net.zero_grad()
        batch = {"x": x, "P": pert, "cond": torch.zeros(32, dtype=torch.long), "step": torch.full((32,), step)}
        torch.manual_seed(1)
        net(batch).backward()
        return net.log_alpha.grad, net.effects.grad

    la, eff = grads(4)
    assert la is None and eff[0].abs().sum() > 0  # effects learn during the warm-up, the gates do not
    la, _ = grads(5)
    assert la is not None and la.abs().sum() > 0
    # with no perturbed cell the only gradient to the logits is the L0 penalty's: every gate is pushed shut
    pert.zero_()
    la, _ = grads(5)
    assert (la > 0).all()


def test_every_encoder_reads_its_worlds_training_cells_standardised_per_gene(tmp_path):
    """build fits each arm's GeneScaler on its own world's training cells (never the held-out doubles): on them every
    encoder's input has mean 0 and std 1 per gene; the statistics are buffers, so the saved network keeps them."""
    p = pv.Params(genes=30, singles=3, doubles=2, cells=300, sweep_rho=[0.5])
    pv.prepare(p, tmp_path)
    worlds = pv._worlds(p, tmp_path)
    model = pv.build(worlds, p)
    for name, net in model.nets.items():
        d = worlds[model.worlds[name]]
        train, test = d["x"][np.flatnonzero(d["train"])], d["x"][np.flatnonzero(~d["train"])]
        z = net.scaler(train)  # (N, G)
        assert torch.allclose(z.mean(0), torch.zeros(30), atol=1e-4) and torch.allclose(z.std(0), torch.ones(30),
                                                                                        atol=1e-3)
        assert net.scaler(test).mean(0).abs().max() > 0.05  # the held-out cells were not part of the fit
        assert {"scaler.mean", "scaler.std"} <= set(net.state_dict())
    assert not torch.equal(model.nets["pvae"].scaler.mean, model.nets["pvae_rho50"].scaler.mean)  # each its world's
    # the encoders read the standardised input: PerturbedVAE's z_p means are its encoder applied to it
    net, x = model.nets["pvae"], worlds[""]["x"][:5]
    assert torch.allclose(net.latent(x), net.enc_p(net.scaler(x)).chunk(2, -1)[0])
