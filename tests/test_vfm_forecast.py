"""vfm_forecast's mechanism on tiny inputs: context windows, the flow sampler, rollout, the probe layout, metrics."""

from __future__ import annotations

import numpy as np
import torch

from models import vfm_forecast as vf
from models.common.tables import read_table


def test_context_windows_are_left_padded_and_end_before_the_target():
    vid, idx, valid = vf.context_indices(torch.tensor([5, 6]), torch.tensor([1, 3]), torch.tensor([4, 0]), 3)
    assert valid.tolist() == [[False, False, True], [True, True, True]]
    assert idx[0, -1] == 4 and idx[1].tolist() == [0, 1, 2]  # last context frame = start + clen - 1
    assert vid.tolist() == [[5, 5, 5], [6, 6, 6]]


class _Oracle:
    """The exact rectified-flow velocity towards a single point x1: v(x, t) = (x1 - x) / (1 - t)."""

    generative = True

    def __init__(self, x1):
        self.x1 = x1

    def __call__(self, ctx, valid, x, t):
        return (self.x1 - x) / (1 - t[:, None, None])


def test_euler_sampler_reaches_the_target_under_the_exact_velocity():
    x1 = torch.randn(3, 4, 2)
    for steps in (1, 2, 7):
        out = vf.sample(_Oracle(x1), torch.zeros(3, 1, 4, 2), torch.ones(3, 1, dtype=torch.bool),
                        torch.randn(3, 4, 2), steps)
        assert torch.allclose(out, x1, atol=1e-5)


def test_flow_matching_loss_is_zero_for_the_true_velocity():
    net = vf.Forecaster(2, 8, 1, 4, 2, generative=True)
    x1, x0, t = torch.randn(3, 4, 2), torch.randn(3, 4, 2), torch.rand(3)
    net.forward = lambda ctx, valid, x_t, t_: x1 - x0  # the straight-path velocity
    assert float(vf.flow_matching_loss(net, torch.zeros(3, 2, 4, 2), torch.ones(3, 2, dtype=torch.bool),
                                       x1, x0, t)) == 0.0


class _PlusOne:
    generative = False

    def __call__(self, ctx, valid):
        return ctx[:, -1] + 1


def test_rollout_slides_the_window_over_its_own_outputs():
    ctx = torch.zeros(2, 3, 4, 1)
    ctx[:, -1] = 10.0
    out = vf.rollout(_PlusOne(), ctx, torch.ones(2, 3, dtype=torch.bool), horizon=3, k=2, euler=1,
                     g=torch.Generator())
    assert out.shape == (2, 2, 3, 4, 1)
    assert out[..., 0, 0].unique().tolist() == [11.0, 12.0, 13.0]
    assert torch.equal(out[:, :, 2], torch.full((2, 2, 4, 1), 13.0))


def test_probe_layout_inverts_the_vfm_patching():
    # one-hot per-pixel logits laid out per token through an identity probe come back as the label image
    size, patch = 16, 4
    labels = torch.randint(0, vf.N_CLASSES, (2, size, size))
    vfm = vf.VFM(size, patch, 8, 1)
    tokens = vfm.patches(labels.float()).long()  # (B, N, p*p)
    onehot = torch.nn.functional.one_hot(tokens, vf.N_CLASSES).float().flatten(2)  # (B, N, p*p*C)
    probe = vf.Probe(onehot.shape[-1], patch, size)
    with torch.no_grad():
        probe.linear.weight.copy_(torch.eye(onehot.shape[-1]))
        probe.linear.bias.zero_()
    assert torch.equal(probe(onehot).argmax(1), labels)


def test_miou_and_frechet_distance_known_values():
    true = np.array([[0, 0], [1, 1]])
    pred = np.array([[0, 1], [1, 1]])
    # class 0: I=1, U=2; class 1: I=2, U=3
    assert np.isclose(vf.miou(pred, true), (1 / 2 + 2 / 3) / 2)
    a = np.random.default_rng(0).standard_normal((500, 3))
    assert abs(vf.frechet_distance(a, a)) < 1e-8
    shift = np.array([1.0, -2.0, 0.5])
    assert np.isclose(vf.frechet_distance(a, a + shift), (shift**2).sum())


def test_pca_space_round_trip_at_full_rank_is_identity():
    raw = torch.randn(4, 3, 2, 8)  # (V, T, N, D)
    ae = vf.FeatureAE(8, 2, 2)
    spaces = vf.fit_spaces(raw, torch.ones(4, dtype=torch.bool), ae, k=8)
    z = (raw - spaces["mean"]) / spaces["std"]
    back = vf.from_space("pca", vf.to_space("pca", z, spaces, ae), spaces, ae)
    assert torch.allclose(back, z, atol=1e-4)
    lat = vf.to_space("pca", z, spaces, ae)
    assert torch.allclose(lat.reshape(-1, 8).std(0, correction=0), torch.ones(8), atol=1e-2)  # standardised latents


def test_prepare_labels_match_the_rendered_digits(tmp_path):
    p = vf.Params(n_videos=6, n_frames=6, p_turn=0.5)
    vf.prepare(p, tmp_path)
    d = vf.load_videos(tmp_path)
    meta = read_table(tmp_path / "meta.parquet")
    assert d["pixels"].shape == (6, 6, 32, 32) and d["is_test"].any()
    for v in range(6):
        digits = {int(x) for x in meta["digits"][v].split(",")}
        present = set(d["labels"][v].unique().tolist()) - {vf.BACKGROUND}
        assert present <= digits and present  # every labelled pixel belongs to one of the video's sprites
        on = d["labels"][v] != vf.BACKGROUND
        assert d["pixels"][v][on].mean() > d["pixels"][v][~on].mean()  # sprites are brighter than the texture


def test_seg_target_foreground_marks_sprites_and_keeps_digits_on_request():
    labels = torch.tensor([[vf.BACKGROUND, 3], [0, vf.BACKGROUND]])
    assert torch.equal(vf.seg_target(labels, "foreground"), torch.tensor([[0, 1], [1, 0]]))
    assert torch.equal(vf.seg_target(labels, "digits"), labels)


def test_pca_below_the_probes_directions_loses_what_the_probe_reads():
    """The premise pca_compression_lossy: a per-token PCA smaller than the span the probe reads reconstructs
    features on which the probe's decision changes; at full rank nothing is lost. Here the label lives in one of 4
    independent directions (equal variance once standardised), and a 1-d PCA keeps another."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(400, 2, 4, generator=g) * torch.tensor([3.0, 2.0, 1.0, 0.5])  # (frames, tokens, D)
    labels = (z[..., 3] > 0).long()
    ae = vf.FeatureAE(4, 1, 2)  # unused by PCA; fit_spaces also records its latent statistics
    for k, lossless in ((1, False), (4, True)):
        spaces = vf.fit_spaces(z[:, None], torch.ones(400, dtype=torch.bool), ae, k)
        zs = (z - spaces["mean"]) / spaces["std"]
        recon = vf.from_space("pca", vf.to_space("pca", zs, spaces, ae), spaces, ae)
        agree = ((recon[..., 3] > 0).long() == labels).float().mean()
        assert (agree > 0.99) if lossless else (agree < 0.8)


def test_lossy_premise_guards_the_ae_versus_pca_parts_only():
    claim = vf.PAPER.claim
    premise = next(c for c in claim.premises if c.name == "pca_compression_lossy")
    guarded = {c.left for c in claim.all_of if c.guarded_by(premise)}
    assert guarded == {"method/miou", "method/fd", "method/recon_miou"}
    lossless = {"baseline/pca/recon_miou": 0.9, "detail/oracle_miou": 0.9, "method/miou": 0.5,
                "baseline/fm_raw/miou": 0.4, "baseline/fm_pca/miou": 0.4, "method/fd": 1.0, "baseline/fm_raw/fd": 2.0,
                "baseline/fm_pca/fd": 2.0, "method/fd_h2plus": 1.0, "baseline/regression/fd_h2plus": 2.0,
                "method/recon_miou": 0.95}
    reps = [{k: v + 0.01 * i for k, v in lossless.items()} for i in range(3)]
    result = claim.decide(reps)
    assert result.verdict == "inconclusive" and "pca_compression_lossy" in result.reason
