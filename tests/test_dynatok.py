"""DynaTok's mechanism on tiny inputs: permutation invariance, the encoder variants, the residual tokens, shared-noise
decoding, the metrics, the partial-view renderer and the .anime loader."""

from __future__ import annotations

import numpy as np
import torch

from models import dynatok as dt


def tiny(**kw) -> dt.Params:
    base = dict(frames=3, n_in=16, n_complete=16, tokens=4, width=16, layers=1, heads=2, n_freq=2)
    return dt.Params(**(base | kw))


def test_tokenizer_is_permutation_invariant():
    torch.manual_seed(0)
    tok = dt.Tokenizer(tiny()).eval()
    pts = torch.randn(2, 16, 3)
    perm = torch.randperm(16)
    assert torch.allclose(tok(pts), tok(pts[:, perm]), atol=1e-5)


def test_per_frame_encoder_ignores_other_frames_and_temporal_encoder_does_not():
    torch.manual_seed(0)
    p = tiny()
    partial = torch.randn(1, 3, 16, 3)
    moved = partial.clone()
    moved[:, 2] += 0.5  # change the last frame only
    for mode, isolated in (("per_frame", True), ("no_decoupling", False)):
        net = dt.DynaTok(p, mode).eval()
        a, b = net.encode(partial), net.encode(moved)
        assert torch.allclose(a[:, :2], b[:, :2], atol=1e-5) == isolated, mode


def test_residual_tokens_decouple_a_shared_geometry():
    torch.manual_seed(0)
    net = dt.DynaTok(tiny(), "dynatok").eval()
    z, r = net.latents(torch.randn(2, 3, 16, 3))
    g = z - r  # (B, T, M, w): the geometry tokens, identical in every frame
    assert torch.allclose(g, g[:, :1].expand_as(g), atol=1e-6) and r.abs().sum() > 0
    z, r = dt.DynaTok(tiny(), "no_decoupling").eval().latents(torch.randn(2, 3, 16, 3))
    assert torch.equal(r, torch.zeros_like(r))


def test_residual_tokens_start_from_the_encoder_tokens():
    # with both MLPs silent, Z_t is the encoder token (as in no_decoupling) and R_t its departure from the time mean
    torch.manual_seed(0)
    net = dt.DynaTok(tiny(), "dynatok").eval()
    for head in (net.geo[-1], net.res[-1]):
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    x = torch.randn(2, 3, 16, 3)
    (z, r), e = net.latents(x), net.encode(x)
    assert torch.allclose(z, e, atol=1e-6) and torch.allclose(r, e - e.mean(1, keepdim=True), atol=1e-6)


def test_residual_tokens_pass_the_frame_to_frame_change_at_init():
    # the decoder must see the motion the encoder sees: Z_t varies over frames about as much as the encoder tokens
    # (the spec's literal bare MLPs passed about 5% of it at default init, and still about 4% after smoke training)
    torch.manual_seed(0)
    net = dt.DynaTok(tiny(width=64, tokens=16, heads=4), "dynatok").eval()
    x = torch.randn(4, 3, 16, 3)
    with torch.no_grad():
        e, z = net.encode(x), net.latents(x)[0]
    ratio = float(z.std(1).mean() / e.std(1).mean())  # variation over frames, latents against encoder tokens
    assert 0.8 < ratio < 1.25, ratio


def test_sampling_shares_the_initial_noise_across_frames():
    torch.manual_seed(0)
    net = dt.DynaTok(tiny(), "dynatok").eval()
    net.dec.forward = lambda x, s, z: torch.zeros_like(x)  # a zero velocity field leaves eps in place
    out = dt.sample(net, torch.randn(2, 3, 16, 3), 10, 4, torch.Generator().manual_seed(0))
    assert out.shape == (2, 3, 10, 3)
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 0], out[:, 2])
    assert not torch.equal(out[0, 0], out[1, 0])  # one eps per sequence


def test_flow_sampling_is_exact_for_the_ideal_velocity():
    # with v = (y - x) / (1 - s) (the rectified-flow velocity towards a fixed y), Euler lands exactly on y
    torch.manual_seed(0)
    net = dt.DynaTok(tiny(), "dynatok").eval()
    y = torch.randn(6, 5, 3)  # (B*T, n, 3)
    net.dec.forward = lambda x, s, z: (y - x) / (1 - s[:, None, None])
    out = dt.sample(net, torch.randn(2, 3, 16, 3), 5, 4, torch.Generator().manual_seed(0))
    assert torch.allclose(out.flatten(0, 1), y, atol=1e-5)


def test_losses_are_finite_for_every_variant():
    torch.manual_seed(0)
    models = dt.Models(tiny())
    losses = models(torch.randn(2, 3, 16, 3), torch.randn(2, 3, 8, 3))
    assert set(losses) == set(dt.MODELS) and all(torch.isfinite(v) for v in losses.values())


def test_chamfer_fscore_occluded_and_drift_known_values():
    gt = torch.rand(2, 20, 3) * torch.tensor([1.0, 1.0, 0.0])  # points on the plane z = 0
    assert torch.allclose(dt.chamfer_terms(gt, gt), torch.zeros(2, 2))
    shifted = gt + torch.tensor([0.0, 0.0, 10.0])  # lifted off the plane: the nearest neighbour is the twin
    assert torch.allclose(dt.chamfer_terms(shifted, gt), torch.full((2, 2), 100.0), atol=1e-3)
    m = dt.frame_metrics(gt, gt, gt[:, :10], radius=1e-6)
    assert m["chamfer"] < 1e-6 and m["fscore"] == 1.0 and m["occluded_chamfer"] < 1e-6
    far = dt.frame_metrics(shifted, gt, gt[:, :10], radius=1e-6)
    assert far["fscore"] == 0.0 and np.isclose(far["occluded_chamfer"], 100.0, atol=1e-3)
    u = torch.randn(1, 20, 3).expand(2, -1, -1)
    assert dt.drift(gt, gt, u) < 1e-6  # points that keep their identity do not drift
    assert dt.drift(torch.stack([gt[0], gt[1].flip(0)]), gt, u) > 0.5


def test_normalised_drift_does_not_reward_a_collapsed_static_output():
    g = torch.Generator().manual_seed(0)
    base = torch.rand(64, 3, generator=g)
    gt = torch.stack([base + 0.03 * t for t in range(4)])  # (T, Q, 3): the object translates
    u = base.expand(4, -1, -1)  # canonical coordinate = the frame-0 position
    blob = (base.mean(0) + 0.001 * torch.randn(64, 3, generator=g)).expand(4, -1, -1)  # static, collapsed
    shuffled = torch.stack([gt[t, torch.randperm(64, generator=g)] for t in range(4)])  # random identities
    # raw drift rewards the collapse (its points all read about the same u), the normalised one does not
    assert dt.drift(blob, gt, u, normalise=False) < dt.drift(shuffled, gt, u, normalise=False)
    assert dt.drift(blob, gt, u) > dt.drift(shuffled, gt, u) > 0.5
    assert dt.drift(gt, gt, u) < 1e-6  # a perfect tracker still scores 0


def test_renderer_keeps_the_side_facing_the_camera():
    rng = np.random.default_rng(0)
    d = rng.standard_normal((4000, 3))
    sphere = d / np.linalg.norm(d, axis=1, keepdims=True)
    p = tiny(n_in=200, dropout=0.0, noise=0.0)
    seen = dt.render_partial(rng, sphere, np.array([0.0, 0.0, 4.0]), p)
    assert seen.shape == (200, 3) and (seen[:, 2] > 0).mean() > 0.95


def test_prepare_writes_consistent_tables(tmp_path):
    p = tiny(n_sequences=4, n_dense=128, scene_fraction=0.5, test_fraction=0.25)
    dt.prepare(p, tmp_path)
    d = dt.load_data(tmp_path)
    assert d["partial"].shape == (4, 3, 16, 3) and d["complete"].shape == (4, 3, 16, 6) and d["test"].sum() == 1
    u = d["complete"][..., 3:]
    assert torch.equal(u, u[:, :1].expand_as(u))  # canonical coordinates do not move


def test_anime_loader_on_a_two_frame_cube(tmp_path):
    verts = np.array([[x, y, z] for x in (0, 1) for y in (0, 1) for z in (0, 1)], dtype=np.float32)  # 8 vertices
    faces = np.array([[0, 1, 3], [0, 3, 2], [4, 6, 7], [4, 7, 5], [0, 4, 5], [0, 5, 1],
                      [2, 3, 7], [2, 7, 6], [0, 2, 6], [0, 6, 4], [1, 5, 7], [1, 7, 3]], dtype=np.int32)
    offsets = np.tile(np.array([[0.5, 0.0, 0.0]], dtype=np.float32), (8, 1))  # frame 1: translated by +0.5 x
    path = tmp_path / "cube.anime"
    with open(path, "wb") as f:
        np.array([2, 8, 12], dtype=np.int32).tofile(f)
        verts.tofile(f), faces.tofile(f), offsets.tofile(f)
    frames, read_faces = dt.read_anime(path)
    assert frames.shape == (2, 8, 3) and np.array_equal(read_faces, faces)
    assert np.allclose(frames[1] - frames[0], [0.5, 0, 0])
    pts, u = dt.anime_points(np.random.default_rng(0), frames, faces, 50)
    assert np.allclose(pts[0], u) and np.allclose(pts[1] - pts[0], [0.5, 0, 0], atol=1e-6)
    assert np.allclose(np.minimum(u, 1 - u).min(1), 0, atol=1e-6)  # every sample lies on a face of the cube


def test_parameter_asymmetry_the_claims_note_states():
    # DynaTok adds the geometry and residual MLPs to the flow baselines' networks; the folding decoder is smaller
    size = {m: sum(w.numel() for w in net.parameters()) for m, net in dt.Models(tiny()).nets.items()}
    assert size["per_frame"] == size["no_decoupling"] < size["dynatok"]
    assert size["deterministic"] < size["per_frame"]
    assert "parameters" in dt.PAPER.claim.note



def test_sequence_metrics_equal_the_metrics_computed_one_by_one():
    # evaluation computes the decoded-to-GT distances once per sequence; every metric must be what the separate
    # computations give, bit for bit (Chamfer as chamfer_terms' mean of squared distances, both drifts)
    g = torch.Generator().manual_seed(0)
    gt, seen = torch.rand(4, 96, 3, generator=g), torch.rand(4, 40, 3, generator=g)
    pred, u = gt + 0.05 * torch.randn(4, 96, 3, generator=g), torch.rand(1, 96, 3, generator=g).expand(4, -1, -1)
    occluded = dt.occluded_mask(gt, seen, 0.1)
    assert 0 < occluded.float().mean() < 1  # both kinds of GT point occur
    m = dt.sequence_metrics(pred, gt, u, occluded)
    assert m["chamfer"] == float(dt.chamfer_terms(pred, gt).sum(-1).mean())
    dist = torch.cdist(pred, gt)
    occ = (dist.min(-2).values.pow(2) * occluded).sum() / occluded.sum()
    assert m["occluded_chamfer"] == float(occ)
    assert {k: m[k] for k in ("chamfer", "fscore", "occluded_chamfer")} == dt.frame_metrics(pred, gt, seen, 0.1)
    nn_idx = dist.argmin(-1)
    uu = torch.gather(u, 1, nn_idx[..., None].expand(-1, -1, 3))
    moved = (uu[1:] - uu[:-1]).norm(dim=-1).mean()
    assert m["raw_drift"] == float(moved) == dt.drift(pred, gt, u, normalise=False)
    assert m["drift"] == float(moved / (uu - uu.roll(48, dims=1)).norm(dim=-1).mean()) == dt.drift(pred, gt, u)
