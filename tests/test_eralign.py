"""ERAlign mechanism on tiny inputs: the energy, Energy Discrepancy's values and anti-collapse property, CD, CKA."""

from __future__ import annotations

import math

import numpy as np
import torch

from models import eralign
from models.common.tables import read_table


def _p(**kw):
    base = dict(graph1=dict(n=60), graph2=dict(n=40), n_classes=3, text_encoder="hashed", hidden=16, dim=8,
                negatives=4, langevin_steps=3)
    return eralign.Params(**{**base, **kw})


def _net(p, kind="eralign"):
    torch.manual_seed(0)
    return eralign.Aligner(p, 384, 3, kind)


def test_energy_is_scaled_squared_distance():
    p = _p()
    net = _net(p)
    with torch.no_grad():
        net.log_tau.fill_(math.log(0.5))
    zg, zt = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert torch.isclose(net.energy(zg, zt), torch.tensor([4.0])).all()  # ||.||^2 = 2, / 0.5
    assert net.energy(zg, zt[:, None].expand(1, 3, 2)).shape == (1, 3)


def test_ed_value_against_a_direct_computation_and_its_constant_projector_value():
    p = _p(negatives=5, w=1.0, s=0.1)
    net = _net(p)
    t = torch.randn(7, 384)
    zg = torch.nn.functional.normalize(torch.randn(7, 8), dim=-1)
    torch.manual_seed(3)
    got = eralign.energy_discrepancy(net, zg, t, p)
    torch.manual_seed(3)  # the same draws, written out literally
    y = t + math.sqrt(p.s) * torch.randn_like(t)
    neg = y[:, None] + math.sqrt(p.s) * torch.randn(7, 5, 384)
    e_pos = net.energy(zg, net.text(t))
    e_neg = net.energy(zg, net.text(neg))
    ref = torch.log(p.w / 5 + torch.exp(e_pos[:, None] - e_neg).mean(1)).mean()
    assert torch.isclose(got, ref, atol=1e-5)
    # a constant text projector makes every energy equal: L_ED = log(w/M + 1) > 0, above what alignment reaches
    with torch.no_grad():
        for m in net.p_t:
            if isinstance(m, torch.nn.Linear):
                m.weight.zero_()
        net.p_t[-1].bias.fill_(1.0)
    const = eralign.energy_discrepancy(net, zg, t, p)
    assert torch.isclose(const, torch.tensor(math.log(1 / 5 + 1)), atol=1e-5)


def test_ed_rewards_alignment_over_collapse():
    """Aligned views (P_g h = P_t t) give a lower ED loss than a collapsed, constant text projector."""
    p = _p(negatives=8, s=0.5)
    net = _net(p)
    t = torch.randn(50, 384)
    with torch.no_grad():
        net.log_tau.fill_(math.log(0.05))
        aligned = eralign.energy_discrepancy(net, net.text(t), t, p)
    assert aligned < math.log(1 / 8 + 1)


def test_langevin_negatives_descend_the_energy():
    p = _p(langevin_steps=30, langevin_step_size=0.05)
    net = _net(p)
    t = torch.randn(20, 384)
    zg = [torch.nn.functional.normalize(torch.randn(20, 8), dim=-1)]
    torch.manual_seed(0)
    neg = eralign.langevin_negatives(net, zg, t, torch.arange(20), p)
    with torch.no_grad():
        assert net.energy(zg[0], net.text(neg)).mean() < net.energy(zg[0], net.text(t)).mean()
    assert not neg.requires_grad


def test_step_flops_count_the_executed_passes():
    """Counted work: ED's alignment cost repeats per layer (2 layers = 2 x final-only's) and grows with M; CD's
    grows with the Langevin steps."""
    torch.manual_seed(0)
    n = 30
    g = {"x": torch.randn(n, 384), "ei": torch.randint(0, n, (2, 90)), "y": torch.randint(0, 3, (n,))}
    lab, nodes = torch.arange(10), torch.arange(n)

    def flops(kind, **kw):
        p = _p(**kw)
        return eralign.step_flops(_net(p, kind), g, lab, nodes)

    base = flops("gcn")
    ed, final = flops("eralign") - base, flops("final_only") - base
    assert ed > 0 and math.isclose(ed, 2 * final, rel_tol=1e-9)
    assert flops("eralign", negatives=8) - base > ed
    assert flops("cd", langevin_steps=6) - base > flops("cd", langevin_steps=3) - base > 0


def test_cka_known_values():
    a = np.random.default_rng(0).standard_normal((100, 5))
    q, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((5, 5)))
    assert math.isclose(eralign.linear_cka(a, 3 * a @ q), 1.0, rel_tol=1e-6)  # invariant to rotation and scale
    assert eralign.linear_cka(a, np.random.default_rng(2).standard_normal((100, 5))) < 0.2


def test_prepare_two_graphs_heldout_edges_and_label_rates(tmp_path):
    p = _p()
    eralign.prepare(p, tmp_path)
    nodes, edges = read_table(tmp_path / "nodes.parquet"), read_table(tmp_path / "edges.parquet")
    emb = read_table(tmp_path / "text_emb.parquet")
    assert (np.bincount(nodes["graph_id"]) == [60, 40]).all() and "e_383" in emb
    g1 = edges["graph_id"] == 0
    assert edges["heldout"][g1].sum() == round(0.1 * g1.sum()) and not edges["heldout"][~g1].any()
    g1_nodes, _ = eralign._load(tmp_path)
    small, large = eralign.train_nodes(g1_nodes, 0.05), eralign.train_nodes(g1_nodes, 0.2)
    assert set(small) <= set(large) and len(large) == 12  # nested label sets, test nodes never labelled
    assert not set(large) & set(np.flatnonzero(g1_nodes["split"] == "test"))


def test_word_noise_draws_topic_words_from_other_classes(tmp_path):
    """The topic-overlap knob: with q = 1 and no text noise, every word is a topic word; word_noise is the share
    drawn from another class's topic (0 by default)."""
    topics = [set(eralign.G.TOPICS[t]) for t in eralign.TOPIC_ORDER[:3]]
    shares = []
    for wn in (0.0, 0.5):
        p = _p(graph1=dict(n=200, q=1.0), text_noise=0.0, word_noise=wn)
        (tmp_path / str(wn)).mkdir()
        eralign.prepare(p, tmp_path / str(wn))
        nodes = read_table(tmp_path / str(wn) / "nodes.parquet")
        own = [np.mean([w in topics[c] for w in t.split()]) for t, c, g in
               zip(nodes["text"], nodes["label"], nodes["graph_id"], strict=True) if g == 0]
        shares.append(float(np.mean(own)))
    assert shares[0] == 1.0 and 0.4 < shares[1] < 0.6


def test_room_to_improve_premises_guard_their_rates_parts():
    premises = {c.name: c for c in eralign.PAPER.claim.premises}
    for r in (5, 20):
        room = premises[f"room_to_improve_r{r}"]
        assert room.left == f"detail/best_baseline_acc_r{r}" and room.op == "<=" and room.right == 0.85
        guarded = [part.left for part in eralign.PAPER.claim.all_of if part.guarded_by(room)]
        assert guarded and set(guarded) == {f"method/acc_r{r}"}
