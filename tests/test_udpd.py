"""UDPD mechanism on tiny inputs: uncertainty modulation, mutual guidance, the coupled DDIM reverse process, noise."""

from __future__ import annotations

import math

import numpy as np
import torch

from models import udpd
from models.common.tables import read_table


def _params(**kw):
    base = dict(n_nodes=60, n_classes=3, noise=[(0.1, 0.1)], n_seeds=1, text_encoder="hashed", pe_dim=4, dim=8,
                hidden=16, diffusion_steps=10, ddim_steps=3, noise_draws=1)
    return udpd.Params(**{**base, **kw})


def test_modulation_lets_the_uncertain_branch_listen():
    u_s, u_g = torch.tensor([0.9, 0.5, 0.1]), torch.tensor([0.1, 0.5, 0.9])
    l_gs, l_sg = udpd.modulation(u_s, u_g, kappa=4.0, c0=0.0)
    assert l_gs[0] > 0.5 > l_sg[0] and torch.isclose(l_gs[1], torch.tensor(0.5)) and l_gs[2] < 0.5
    assert torch.allclose(l_gs + l_sg, torch.ones(3))  # c0 = 0: the two directions share one unit
    assert torch.isclose(udpd.normalised_entropy(torch.zeros(1, 5)), torch.ones(1)).all()
    assert udpd.normalised_entropy(torch.tensor([[20.0, 0, 0, 0]])) < 1e-6
    assert math.isclose(float(udpd.time_embedding(torch.tensor([0]), 8)[0, 4]), 1.0)


def _graph(tmp_path, p):
    udpd.prepare(p, tmp_path)
    return udpd._load(tmp_path)[0]


def test_guidance_is_the_only_cross_branch_path(tmp_path):
    p = _params()
    g = _graph(tmp_path, p)
    torch.manual_seed(0)
    net = udpd.UDPD(p, g["x"].shape[1], g["pe"].shape[1], 3, "udpd")
    n, t = len(g["y"]), torch.full((len(g["y"]),), 5)
    zs, zg = torch.randn(n, 8), torch.randn(n, 8)
    with torch.no_grad():
        es_a = net.guided_eps(zs, zg, t, g["ei"])[0]
        es_b = net.guided_eps(zs, zg + 1.0, t, g["ei"])[0]
        assert not torch.allclose(es_a, es_b)  # the structural estimate steers the semantic denoiser
        net.w_gs.weight.zero_()
        es_a = net.guided_eps(zs, zg, t, g["ei"])[0]
        es_b = net.guided_eps(zs, zg + 1.0, t, g["ei"])[0]
        assert torch.allclose(es_a, es_b)  # ... and only through m_{g->s}


def test_coupled_ddim_with_an_oracle_denoiser_recovers_the_clean_embeddings(tmp_path):
    p = _params()
    g = _graph(tmp_path, p)
    torch.manual_seed(0)
    net = udpd.UDPD(p, g["x"].shape[1], g["pe"].shape[1], 3, "udpd").eval()
    zs, zg = net.encode(g["x"], g["pe"], g["ei"])
    calls = []

    def oracle(zs_t, zg_t, t, ei):  # predicts exactly the noise in z_t, so every DDIM step is exact
        ab = net.abar[t][:, None]
        calls.append(int(t[0]))
        es, eg = (zs_t - ab.sqrt() * zs) / (1 - ab).sqrt(), (zg_t - ab.sqrt() * zg) / (1 - ab).sqrt()
        return es, eg, zs.detach(), zg.detach()

    net.guided_eps = oracle
    logits = net.infer(g["x"], g["pe"], g["ei"], seed=0)
    expected = net.fused(torch.cat([zs, zg], 1)).log_softmax(-1)
    assert torch.allclose(logits, expected, atol=1e-4)
    assert calls[0] == p.diffusion_steps // 2 and calls == sorted(calls, reverse=True) and len(calls) == 3


def test_prepare_injects_both_noise_sources(tmp_path):
    p = _params(n_nodes=300, noise=[(0.4, 0.3)])
    udpd.prepare(p, tmp_path)
    nodes, edges, s = (read_table(tmp_path / f) for f in ("nodes.parquet", "edges.parquet", "settings.parquet"))
    assert abs(nodes["text_noisy"].mean() - 0.4) < 0.08
    assert edges["is_noise"].sum() == round(0.3 * len(edges["is_noise"]))
    assert 0.4 < s["homophily"][0] < 0.8  # 0.8 before rewiring, diluted by the uniform edges
    assert nodes["struct_pe"].shape[1] == p.pe_dim + 1  # structure only: PEs and log-degree
    split = nodes["split"]
    assert (split == "train").sum() == 30 and (split == "val").sum() == 30
    assert np.isfinite(nodes["struct_pe"]).all()


def test_checkpoint_selection_uses_validation_and_ignores_stale_snapshots(tmp_path):
    chosen = udpd.select_on_validation({"a__d0": [0.2, 0.6, 0.4], "b__d0": [0.5, 0.3, 0.5], "c__d0": [0.1],
                                        "a__d1": [0.3, 0.5, 0.5], "c__d1": [0.1]})
    # best validation accuracy over the grid and the steps; the latest step, then the later grid point, among ties
    assert chosen == {"a": ("a__d0", 1), "b": ("b__d0", 2), "c": ("c__d1", 0)}
    from tasks.context import EvalContext, TrainContext

    p = _params(steps=150, select_every=25)
    for step in (25, 50, 60, 150, 175):  # 60: another select_every; 150, 175: not before the final step
        TrainContext(p, tmp_path, tmp_path).save_record(f"{udpd.SNAPSHOT}{step:06d}", {})
    cands = udpd._candidates(EvalContext(p, tmp_path, tmp_path, tmp_path), p)
    assert cands == [(25, "snapshot_step000025"), (50, "snapshot_step000050"), (150, None)]  # None: the final network


def test_training_draws_every_diffusion_step_and_inference_starts_at_t_star(tmp_path, monkeypatch):
    """Training keeps the spec's full range t ~ U{0..T-1}: restricting it to t <= t* (the steps inference visits)
    was probed on the smoke graphs and trained worse classifiers."""
    p = _params(diffusion_steps=20)
    g = _graph(tmp_path, p)
    torch.manual_seed(0)
    net = udpd.UDPD(p, g["x"].shape[1], g["pe"].shape[1], 3, "udpd")
    seen = []
    guided = net.guided_eps
    monkeypatch.setattr(net, "guided_eps", lambda zs, zg, t, ei: (seen.append(t), guided(zs, zg, t, ei))[1])
    labelled = torch.arange(10)
    for _ in range(10):
        net.loss(g["x"], g["pe"], g["ei"], g["y"], labelled, torch.arange(len(g["y"])))
    t = torch.cat(seen)
    assert int(t.max()) == p.diffusion_steps - 1 and int(t.min()) == 0 and net.t_star == 10


def test_every_arm_trains_once_per_dropout_rate_of_the_grid(tmp_path):
    p = _params(dropouts=[0.0, 0.5])
    udpd.prepare(p, tmp_path)
    graphs = udpd._load(tmp_path)
    model = udpd.AllNets(p, graphs)
    arms = {udpd._parse(n)[1] for n in model.nets}
    assert arms == {"udpd", *udpd.ABLATIONS, *udpd.BASELINES}
    for arm in arms:  # the same grid for the method and every baseline
        assert sorted(net.dropout for n, net in model.nets.items() if udpd._parse(n)[1] == arm) == [0.0, 0.5]
    g = graphs[0]
    net = model.nets["g0_s0_udpd__d1"].train()
    torch.manual_seed(0)
    a = net.encode(g["x"], g["pe"], g["ei"])[0]
    b = net.encode(g["x"], g["pe"], g["ei"])[0]
    assert not torch.allclose(a, b)  # the text features are dropped in training ...
    net.eval()
    assert torch.allclose(net.encode(g["x"], g["pe"], g["ei"])[0], net.encode(g["x"], g["pe"], g["ei"])[0])
