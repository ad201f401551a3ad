"""qubo_relax: exact optima against brute force, formulations against their binary objectives, the checker's
verdicts, and the solvers on problems with known answers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from models import qubo_relax as m
from tasks import fixtures


def _params(**kw):
    return m.Params(**{"knapsack_items": 6, "pit_rows": 2, "pit_cols": 3, "tsp_small": 4, "tsp_large": 5,
                       "starts": 16, "max_steps": 400, **kw})


def _binaries(n):
    return ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1).astype(float)


def _value(q, c, z):
    return np.einsum("bi,ij,bj->b", z, q, z) + z @ c


def test_exact_optima_match_brute_force():
    rng = np.random.default_rng(0)
    p = _params()
    for _ in range(3):
        inst = m.make_instance("knapsack", rng, p)
        z = _binaries(len(inst["w"]))
        ok = z @ inst["w"] <= inst["C"]
        assert m.optimum("knapsack", inst) == (z[ok] @ inst["v"]).max()
        inst = m.make_instance("pit", rng, p)
        z = _binaries(6)
        closed = m.feasible("pit", inst, z)
        assert np.isclose(m.optimum("pit", inst), (z[closed] @ np.array(inst["profit"])).max())
        xy = rng.random((6, 2))
        d = np.linalg.norm(xy[:, None] - xy[None], axis=-1)
        tours = [d[(0, *perm), (*perm, 0)].sum() for perm in itertools.permutations(range(1, 6))]
        assert np.isclose(m.held_karp(d), min(tours))


def test_formulations_encode_the_problems_on_binaries():
    rng = np.random.default_rng(1)
    p = _params(knapsack_items=4)
    # knapsack: the minimum over slack of the QUBO (+ P C^2) is -v^T x exactly where w^T x <= C
    inst = m.make_instance("knapsack", rng, p)
    bits = int(np.ceil(np.log2(inst["C"] + 1)))
    forms = m.knapsack_qubo(np.array(inst["w"], float), np.array(inst["v"], float), inst["C"], bits, 0.01)
    z = _binaries(4 + bits)
    for q, c in forms.values():
        vals = _value(q, c, z) + (1 + max(inst["v"])) * inst["C"] ** 2
        assert np.allclose(vals, _value(*forms["naive"], z) + (1 + max(inst["v"])) * inst["C"] ** 2)
        for x in _binaries(4):
            best = vals[(z[:, :4] == x).all(1)].min()
            if x @ inst["w"] <= inst["C"]:
                assert np.isclose(best, -(x @ inst["v"]))
            else:
                assert best > -(x @ inst["v"])
    # TSP: on permutation matrices both formulations equal the tour length; the minimiser is the optimal tour
    xy = rng.random((4, 2))
    d = np.linalg.norm(xy[:, None] - xy[None], axis=-1)
    forms = m.tsp_qubo(d, 0.01)
    z = _binaries(16)
    perm = m.feasible("tsp_small", {"coords": xy.tolist()}, z)
    for q, c in forms.values():
        vals = _value(q, c, z) + 2 * 4 * (d.max() + 1)  # the dropped constants P per row and column
        lengths = m.gap("tsp_small", {"coords": xy.tolist()}, z[perm], 1.0) + 1.0
        assert np.allclose(vals[perm], lengths)
        assert np.isclose(vals.min(), m.held_karp(d)) and perm[vals.argmin()]


def test_checker_verdicts():
    rng = np.random.default_rng(2)
    p = _params()
    inst = m.make_instance("pit", rng, p)
    forms = m.pit_qubo(np.array(inst["profit"]), 2, 3, 0.01)
    proposed = m.check_conditions("pit", inst, *forms["proposed"], p, rng)
    naive = m.check_conditions("pit", inst, *forms["naive"], p, rng)
    assert proposed["c1"] == 1 and proposed["c2_counterexamples"] == 0 and proposed["c2_enumerated"] == 1
    assert naive["c1"] == 0  # zero diagonal
    # a hand-made QUBO whose infeasible point (1, 1) is a strict local minimum: C2 must report it
    inst = {"w": [1, 1], "v": [1, 1], "C": 1, "bits": 0}
    q, c = np.array([[-0.01, -1.0], [-1.0, -0.01]]), np.array([0.5, 0.5])
    out = m.check_conditions("knapsack", inst, q, c, p, rng)
    assert out["c1"] == 1 and out["c2_counterexamples"] == 1 and out["c2_checked"] == 1


def test_solvers_reach_vertices_of_concave_coordinates_and_anneal_finds_the_minimum():
    rng = np.random.default_rng(3)
    q = np.array([[-0.5, 0.3, 0.0], [0.3, -0.5, 0.2], [0.0, 0.2, -0.5]])
    c = np.array([0.2, -0.1, 0.3])
    x0 = torch.from_numpy(rng.random((1, 64, 3)))
    for x, steps in (m.pgd(torch.from_numpy(q)[None], torch.from_numpy(c)[None], x0, 2000),
                     m.adam(torch.from_numpy(q)[None], torch.from_numpy(c)[None], x0, 2000, 0.05)):
        assert (torch.minimum(x, 1 - x).amax(-1) < 1e-3).all() and (steps < 2000).all()
        z = x[0].numpy().round()
        g = 2 * z @ q + c
        assert (g * (1 - 2 * z) >= -1e-9).all()  # every end point is a KKT vertex
    z_all = _binaries(3)
    best = _value(q, c, z_all).min()
    sa = m.anneal(q[None], c[None], 16, 200, rng)
    assert np.isclose(_value(q, c, sa[0]).min(), best)
    # a convex coordinate (positive diagonal) lets PGD stop inside the box: the naive failure mode
    x, _ = m.pgd(torch.tensor([[[1.0]]], dtype=torch.float64), torch.tensor([[-1.0]], dtype=torch.float64),
                 torch.full((1, 4, 1), 0.9, dtype=torch.float64), 2000)
    assert torch.allclose(x, torch.full_like(x, 0.5), atol=1e-4)


def test_tsplib_loader_reads_a_five_city_fixture(tmp_path):
    text = "NAME : five\nTYPE : TSP\nDIMENSION : 5\nEDGE_WEIGHT_TYPE : EUC_2D\nNODE_COORD_SECTION\n" \
           "1 0 0\n2 3 0\n3 3 4\n4 0 4\n5 1.5 6\nEOF\n"
    (tmp_path / "five.tsp").write_text(text)
    xy = m.load_tsplib(tmp_path / "five.tsp")
    assert xy.shape == (5, 2) and xy[4].tolist() == [1.5, 6.0]
    d = np.linalg.norm(xy[:, None] - xy[None], axis=-1)
    assert np.isclose(m.held_karp(d), 3 + 4 + 2 * np.hypot(1.5, 2) + 4)  # the convex hull order 0-1-2-4-3
    p = _params(tsp_file=str(tmp_path / "five.tsp"), instances=2)
    m.prepare(p, tmp_path)
    inst = m.load(tmp_path)["tsp_large"]
    assert len(inst) == 1 and len(inst[0]["naive"][1]) == 25 and np.isclose(inst[0]["optimum"], m.held_karp(d))


_minelib = fixtures.minelib  # a 4-block UPIT instance and its .prec


def test_minelib_loader_and_exact_optimum(tmp_path):
    inst = m.load_minelib(_minelib(tmp_path))
    assert inst["profit"] == [-1.0, -2.0, 5.0, 1.0] and sorted(inst["edges"]) == [[2, 0], [2, 1], [3, 1]]
    assert m.optimum("pit", inst) == pytest.approx(3.0)  # all four blocks: -1 - 2 + 5 + 1
    z = np.array([[1, 1, 1, 1], [0, 0, 1, 0], [0, 1, 0, 1]], float)
    assert m.feasible("pit", inst, z).tolist() == [True, False, True]
    forms = m.formulations("pit", inst, m.Params())
    assert (np.diag(forms["proposed"][0]) < 0).all()
    (tmp_path / "bad.upit").write_text("NAME: x\nTYPE: CPIT\nNBLOCKS: 1\n")
    with pytest.raises(ValueError, match="UPIT"):
        m.load_minelib(tmp_path / "bad.upit")


def test_prepare_reads_minelib_for_the_open_pit(tmp_path):
    p = m.Params(instances=2, minelib_file=str(_minelib(tmp_path)), starts=4, max_steps=10)
    (tmp_path / "out").mkdir()
    m.prepare(p, tmp_path / "out")
    d = m.load(tmp_path / "out")
    assert len(d["pit"]) == 1 and d["pit"][0]["optimum"] == pytest.approx(3.0)
    assert len(d["pit"][0]["naive"][1]) == 4


def test_solvers_stop_only_at_stationary_points():
    """A run stops when the projected gradient ||x - clip(x - g)||_inf is below the tolerance (a KKT point of the box
    problem), never merely because the iterate stalled; the measure is zero at a bound the gradient presses on."""
    q1, c_out, c_in = torch.tensor([[[-0.01]]], dtype=torch.float64), torch.tensor([[-1.0]], dtype=torch.float64), \
        torch.tensor([[1.0]], dtype=torch.float64)
    one = torch.ones((1, 1, 1), dtype=torch.float64)
    assert m.projected_gradient(q1, c_out, one).item() == 0  # gradient pushes past x = 1: stationary
    assert m.projected_gradient(q1, c_in, one).item() > 0.9  # gradient points into the box: not stationary
    rng = np.random.default_rng(7)
    a = rng.standard_normal((2, 6, 6))
    q = torch.from_numpy((a + a.transpose(0, 2, 1)) / 2)
    c = torch.from_numpy(rng.standard_normal((2, 6)))
    x0 = torch.from_numpy(rng.random((2, 32, 6)))
    for x, steps in (m.pgd(q, c, x0, 3000), m.adam(q, c, x0, 3000, 0.05)):
        done = steps < 3000
        assert done.any()
        assert (m.projected_gradient(q, c, x)[done] < m.STATIONARY_TOL).all()


@pytest.mark.parametrize("big_p", [1.0, 10.0, 1000.0])
def test_squared_residual_knapsack_fails_c2_for_any_penalty_even_with_unary_slack(big_p):
    """Why the knapsack candidate cannot meet C2: with every slack bit off and a small excess r = w^T x - C, dropping
    an item of weight w_i > 2 r raises P (w^T x + s - C)^2 by P w_i (w_i - 2 r) and adding slack raises it too, so
    the infeasible point is a single-flip local minimum for every P, whatever the slack encoding (unary here)."""
    w, v, cap = np.array([6.0, 5.0]), np.array([1.0, 1.0]), 10
    a = np.concatenate([w, np.ones(cap)])  # unary slack: one bit per unit of spare capacity
    q, c = big_p * np.outer(a, a), -2 * big_p * cap * a - np.concatenate([v, np.zeros(cap)])
    q, c = m.concave_diagonal(q, c, 0.01)
    inst = {"w": w.tolist(), "v": v.tolist(), "C": cap, "bits": cap}
    out = m.check_conditions("knapsack", inst, q, c, _params(), np.random.default_rng(0))
    assert out["c1"] == 1 and out["c2_counterexamples"] >= 1
    z = np.r_[1.0, 1.0, np.zeros(cap)]  # both items, no slack: w^T x = 11 > 10
    assert ((2 * z @ q + c) * (1 - 2 * z) >= 0).all()  # no coordinate descends


def test_pgd_line_search_is_monotone_and_beats_the_fixed_step_on_an_ill_conditioned_qubo():
    """Issue 40: with knapsack's 2^k slack coefficients ||Q||_2 is large, so the fixed step 1 / (2 ||Q||_2) crawls
    along the flat, concave directions; the Armijo step (floored at 1 / L) never raises f and reaches a stationary
    binary point in far fewer steps."""
    rng = np.random.default_rng(3)
    w, v = rng.integers(1, 11, 8).astype(float), rng.integers(1, 21, 8).astype(float)
    q, c = m.knapsack_qubo(w, v, int(0.4 * w.sum()), 5, 0.01)["proposed"]
    qt, ct = torch.from_numpy(q)[None], torch.from_numpy(c)[None]
    x0 = torch.from_numpy(rng.random((1, 16, len(c))))
    f = lambda x: ((x @ qt) * x).sum(-1) + (x * ct[:, None]).sum(-1)  # noqa: E731  (I, R)
    values = [f(x0)]
    for cap in (1, 2, 4, 8):
        values.append(f(m.pgd(qt, ct, x0, cap)[0]))
    assert all((b <= a + 1e-9).all() for a, b in zip(values, values[1:], strict=False))  # monotone in the step count
    x, steps = m.pgd(qt, ct, x0, 5000)
    assert (steps < 5000).all() and (m.projected_gradient(qt, ct, x) < m.STATIONARY_TOL).all()
    assert (torch.minimum(x, 1 - x).amax(-1) < 1e-3).all()  # C1: no fractional stationary end point
    eta = 1.0 / (2 * torch.linalg.matrix_norm(qt, ord=2))[:, None, None]
    fixed = m._projected(lambda x, g, s: x - eta * g, qt, ct, x0, int(steps.max()))[1]
    assert (fixed >= int(steps.max())).any()  # the fixed step has not converged in as many steps


def test_knapsack_is_context_and_the_convergence_premises_read_the_deciding_problems():
    """Issue 40: the knapsack candidate fails C2 by construction (test above), so its comparisons are context and
    no premise asks it to meet C1 + C2; the convergence premises cover the problems that decide the claim."""
    claim = m.PAPER.claim
    assert [p.name for p in claim.premises] == ["pgd_converged", "adam_converged"]
    assert not any("knapsack" in n for c in claim.all_of for n in (c.left, *c.right_names))
    assert {c.left.split("/")[1] for c in claim.all_of} == set(m.DECIDING)
    assert all("/knapsack/" in c.left for c in claim.context) and len(claim.context) == 4
