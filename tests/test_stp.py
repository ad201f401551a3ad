"""StP mechanism on tiny inputs: the schedule, the size-scale fit, EGNN equivariance, the sampler with an oracle
denoiser (it must return the data molecule under every prior scale), the commitment times and the quality checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from models import stp


def _rotation(seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(seed)))
    return q


def test_polynomial_schedule_is_variance_preserving_and_monotone():
    alpha, sigma = stp.polynomial_schedule(500)
    assert torch.allclose(alpha**2 + sigma**2, torch.ones(501), atol=1e-6)
    assert alpha[0] > 0.999 and alpha[-1] < 0.01
    assert (alpha[1:] <= alpha[:-1] + 1e-7).all()


def test_fit_scales_recovers_power_law_with_unit_mean():
    n = torch.tensor([3, 5, 8, 12, 12, 20])
    rg = 0.5 * n.double() ** 0.4
    # a molecule whose atoms sit at +-r along x has radius of gyration r
    x = torch.zeros(len(n), 20, 3)
    mask = torch.arange(20)[None] < n[:, None]
    for i, k in enumerate(n.tolist()):
        x[i, :k, 0] = torch.tensor([rg[i] if j % 2 == 0 else -rg[i] for j in range(k)])
        x[i, :k] -= x[i, :k].mean(0)
    scales = stp.fit_scales(x, mask, n, 20)
    assert float(scales["nu"]) == pytest.approx(0.4, abs=0.05)  # odd N: the centring shifts Rg a little
    for form in ("power_law", "table"):
        assert scales[form][n.numpy()].mean() == pytest.approx(1.0, abs=1e-9)
        assert (np.diff(scales[form][3:21]) > 0).all()  # larger molecules get a larger prior scale


def test_egnn_is_equivariant_and_ignores_padding():
    torch.manual_seed(0)
    net = stp.EGNN(len(stp.ELEMENTS), 16, 2)
    mask = torch.tensor([[True] * 5 + [False] * 2])
    x = stp.remove_com(torch.randn(1, 7, 3), mask)
    h = torch.randn(1, 7, len(stp.ELEMENTS)) * mask[..., None]
    t = torch.tensor([0.3])
    ex, eh = net(x, h, t, mask)
    r = _rotation(1)
    ex_r, eh_r = net(x @ r.T + torch.tensor([1.0, -2.0, 0.5]) * mask[..., None], h, t, mask)
    assert torch.allclose(ex_r, ex @ r.T, atol=1e-4) and torch.allclose(eh_r, eh, atol=1e-4)
    assert torch.allclose(ex[mask].sum(0), torch.zeros(3), atol=1e-5)  # zero-CoM output
    ex_pad, eh_pad = net(x, h + 5.0 * (~mask)[..., None], t, mask)  # garbage in the padding changes nothing
    assert torch.allclose(ex_pad[mask], ex[mask], atol=1e-5) and torch.allclose(eh_pad[mask], eh[mask], atol=1e-5)
    perm = torch.tensor([3, 1, 4, 0, 2, 5, 6])
    ex_p, _ = net(x[:, perm], h[:, perm], t, mask)
    assert torch.allclose(ex_p, ex[:, perm], atol=1e-4)


class Oracle(nn.Module):
    """The exact eps of a one-molecule data set: eps = (x_t - alpha x_0) / (sigma s)."""

    def __init__(self, model: stp.Diffusion, arm: str, x0: torch.Tensor, h0: torch.Tensor):
        super().__init__()
        self.model, self.arm, self.x0, self.h0 = model, arm, x0, h0

    def forward(self, x, h, t, mask):
        steps = len(self.model.alpha) - 1
        k = int(round(float(t[0]) * steps))
        a, s = self.model.alpha[k], self.model.sigma[k]
        scale = self.model.noise_scale(self.arm, mask.sum(1))
        x0 = self.x0 / self.model.divisor[self.arm]
        return (x - a * x0) / (s * scale), (h - a * self.h0) / s


@pytest.mark.parametrize("arm", stp.ARMS)
def test_ancestral_sampler_with_oracle_returns_the_data(arm):
    p = stp.Params(n_max=6, layers=1, hidden=8, diffusion_steps=100)
    n = torch.tensor([5, 5])
    mask = torch.arange(5)[None] < n[:, None]
    x0 = stp.remove_com(torch.randn(1, 5, 3, generator=torch.Generator().manual_seed(0)), mask[:1]) * 1.5
    h0 = torch.nn.functional.one_hot(torch.tensor([[1, 2, 1, 3, 1]]), len(stp.ELEMENTS)).float() * stp.TYPE_SCALE
    scales = {"power_law": np.linspace(0.2, 2.0, 7), "table": np.linspace(0.3, 1.5, 7), "global": np.array(1.7)}
    model = stp.Diffusion(p, scales)
    model.nets[arm] = Oracle(model, arm, x0, h0)
    out = stp.sample(model, arm, n, steps=20, seed=0)
    assert torch.allclose(out["x"], x0.expand(2, -1, -1), atol=1e-3)
    assert (out["types"] == torch.tensor([1, 2, 1, 3, 1])).all()
    assert out["traj_x"].shape == (20, 2, 5, 3)


def test_commitment_times_known_values():
    rng = np.random.default_rng(0)
    final = rng.normal(size=(6, 3))
    traj = np.stack([rng.normal(size=(6, 3)) * 5 for _ in range(10)])
    traj[4:] = final  # structure formed at step 4 of 10
    types = np.zeros((10, 6), int)
    types[:7] = np.arange(6) % 3 + 1  # all differ from the final zeros until step 7
    types[7:] = 0
    t_s, t_a = stp.commitment_times(traj, types, 6, 0.9)
    assert t_s == pytest.approx(0.4) and t_a == pytest.approx(0.7)


def test_consistency_slope_and_bin_std():
    n = np.array([3, 4, 7, 8, 11, 12])
    times = 0.1 + 0.2 * np.log(n)
    c = stp.consistency(times, n, (3, 6, 9, 13))
    assert c["slope"] == pytest.approx(0.2) and c["bin_std"] > 0
    flat = stp.consistency(np.full(6, 0.5), n, (3, 6, 9, 13))
    assert flat["bin_std"] == 0 and flat["abs_slope"] == pytest.approx(0, abs=1e-12)


def test_stability_and_validity_on_a_real_conformer_and_a_broken_one():
    elements, xyz = stp.embed("CC(=O)OCCN", 0, hydrogens=False)
    assert stp.stability(elements, xyz, hydrogens=False) == (len(elements), True)
    assert stp.validity(elements, xyz, hydrogens=False) is not None
    apart = xyz * 3.0  # every bond stretched: isolated atoms, several fragments
    assert stp.stability(elements, apart, hydrogens=False)[1] is False
    assert stp.validity(elements, apart, hydrogens=False) is None
    h_el, h_xyz = stp.embed("CCO", 0, hydrogens=True)
    assert stp.stability(h_el, h_xyz, hydrogens=True) == (9, True)
    assert stp.validity(h_el, h_xyz, hydrogens=True) == "CCO"


def test_sdf_loader_on_a_tiny_fixture(tmp_path):
    from rdkit import Chem
    from rdkit.Chem import AllChem

    path = tmp_path / "tiny.sdf"
    with Chem.SDWriter(str(path)) as w:
        for smi in ("CCO", "c1ccncc1", "CC(=O)N"):
            mol = Chem.AddHs(Chem.MolFromSmiles(smi))
            AllChem.EmbedMolecule(mol, randomSeed=0)
            w.write(mol)
    mols = stp.load_sdf(path, 2, hydrogens=False)
    assert [len(m[1]) for m in mols] == [3, 6]
    assert all(np.allclose(m[2].mean(0), 0, atol=1e-6) for m in mols)
    assert len(stp.load_sdf(path, 10, hydrogens=True)[0][1]) == 9
    p = stp.Params(dataset="sdf", sdf_path=str(path), n_molecules=3, n_min=3, n_max=9)
    stp.prepare(p, tmp_path)
    assert len(stp._load(tmp_path)["n"]) == 3


def test_claim_is_inconclusive_when_edm_makes_no_stable_molecule():
    """StP >= EDM on validity and stability holds trivially at zero: the premise turns that into 'inconclusive'."""
    claim = stp.PAPER.claim

    def replicate(r: int, edm_quality: float) -> dict[str, float]:
        m = {n: 1.0 + 0.01 * r for n in claim.metric_names() if n.startswith("baseline/")}  # baselines' t_s spread
        m |= {n: 0.5 + 0.01 * r for n in claim.metric_names() if n.startswith("method/")}  # StP's: smaller
        m |= {"method/validity": edm_quality + 0.1, "method/mol_stability": edm_quality + 0.1,
              "baseline/edm/validity": edm_quality, "baseline/edm/mol_stability": edm_quality}
        return m

    worked = claim.decide([replicate(r, 0.2 + 0.01 * r) for r in range(3)])
    assert worked.verdict == "holds"
    empty = claim.decide([replicate(r, 0.0) for r in range(3)])
    assert empty.verdict == "inconclusive" and "edm_molecules_stable" in empty.reason


def test_edm_premises_guard_only_the_chemistry_parts():
    """EDM making no stable or valid molecule leaves only the `>= EDM's` parts undecided: a commitment-time part that
    fails still decides the claim."""
    from models.stp import PAPER
    from models.verdicts import FAILS

    metrics = []
    for i in range(3):
        row = {f"{arm}/{name}": 0.5 for arm in ("method", "baseline/edm", "baseline/global")
               for name in ("ts_bin_std", "ts_abs_slope")}
        row |= {"baseline/edm/mol_stability": 0.0, "baseline/edm/validity": 0.0,
                "method/mol_stability": 0.0, "method/validity": 0.0,
                "method/ts_bin_std": 0.9 + i / 100}  # the method's times spread more than EDM's: that part fails
        metrics.append(row)
    result = PAPER.claim.decide(metrics)
    undecided = {p.text.split()[0] for p in result.parts if p.undecided_by}
    assert undecided == {"method/validity", "method/mol_stability"}
    assert result.verdict == FAILS


def test_arms_subset_keeps_the_claims_arms():
    """Smoke trains only the arms the claim reads (EDM, global rescale, the claim's StP form); a profile that drops
    one of them is refused before any work starts."""
    p = stp.Params(arms=("edm", "global", "stp_power_law"), layers=1, hidden=8)
    scales = {"power_law": np.linspace(0.2, 2.0, 17), "table": np.linspace(0.3, 1.5, 17), "global": np.array(1.7)}
    model = stp.Diffusion(p, scales)
    assert set(model.nets) == {"edm", "global", "stp_power_law"}
    n = torch.tensor([4, 7])
    assert torch.allclose(model.noise_scale("stp_power_law", n).flatten(), torch.tensor(scales["power_law"][[4, 7]],
                                                                                         dtype=torch.float32))
    with pytest.raises(ValueError, match="arms"):
        stp.Params(arms=("edm", "stp_power_law"))
    with pytest.raises(ValueError, match="arms"):
        stp.Params(scale="table", arms=("edm", "global", "stp_power_law"))
