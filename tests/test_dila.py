"""DiLA's mechanism on tiny inputs: the action sees structure only, VQ, KL, metrics, template matching, data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models import dila, registry

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"


class _CentredLayout(torch.nn.Module):
    def forward(self, o):  # (B, 3, 16, 16) -> (B, 4, 8, 8), invariant to adding a constant
        centred = o - o.mean((1, 2, 3), keepdim=True)
        return torch.cat([centred, centred[:, :1]], 1)[:, :, ::2, ::2]


def test_dila_action_sees_structure_only_while_the_lam_sees_appearance():
    torch.manual_seed(0)
    model, lam = dila.DiLA(8, 16), dila.LAM(8, 16)
    o_t, o_next = torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16)
    # a structure pathway blind to global brightness: then a brightness change cannot reach the action
    model.structure = _CentredLayout()
    mu, _ = model.infer(o_t, o_next)
    mu_bright, _ = model.infer(o_t + 0.1, o_next - 0.05)
    assert torch.allclose(mu, mu_bright, atol=1e-6)
    assert not torch.allclose(lam.infer(o_t, o_next)[0], lam.infer(o_t + 0.1, o_next - 0.05)[0], atol=1e-4)


def test_dila_generator_uses_content_of_the_current_frame():
    torch.manual_seed(0)
    model = dila.DiLA(8, 16)
    o, a = torch.rand(1, 3, 16, 16), torch.zeros(1, 4)
    out = model.step(o, a)
    assert out.shape == (1, 3, 16, 16) and (out >= 0).all() and (out <= 1).all()
    loss = model.loss(o, o, beta=0.1)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # one stage: every pathway gets a gradient


@pytest.mark.parametrize("size", [16, 32])
def test_structure_map_is_8x8x4_at_every_frame_size(size):
    model = dila.DiLA(8, size)
    o = torch.rand(2, 3, size, size)
    assert model.structure(o).shape == (2, 4, 8, 8)
    assert model.content(o)[1].shape == (2, 8, 8, 8)
    assert dila.LAM(8, size).frame(o).shape == (2, 8, 8, 8)
    with pytest.raises(ValueError, match="power of 2"):
        dila.DiLA(8, 24)


@pytest.mark.parametrize("profile", ["smoke", "full"])  # the profiles whose verdicts compare the arms
def test_lams_have_dilas_parameter_count_within_5_percent(profile):
    p = registry.resolve("dila", profile, None, PARAMS)
    model = dila.Everything(p) if p.channels <= 16 else None
    w = dila.lam_width(p.channels, p.size, p.map_side)
    target = dila.n_params(dila.DiLA(p.channels, p.size, side=p.map_side))
    for codes in (0, 8):
        assert abs(dila.n_params(dila.LAM(w, p.size, codes=codes, side=p.map_side)) / target - 1) < 0.05
    if model is not None:  # the arms the run trains are the matched ones
        counts = {n: dila.n_params(m) for n, m in model.models.items()}
        assert max(counts.values()) / min(counts.values()) < 1.05, counts


def test_vq_quantises_to_codes_with_straight_through_gradient():
    lam = dila.LAM(8, 16, codes=8)
    z = torch.randn(5, 4, requires_grad=True)
    q = lam.quantise(z)
    assert all(any(torch.allclose(row, c) for c in lam.codebook) for row in q.detach())
    q.sum().backward()
    assert torch.equal(z.grad, torch.ones_like(z))


def test_kl_is_zero_at_the_prior_and_positive_elsewhere():
    assert float(dila.kl_normal(torch.zeros(3, 4), torch.zeros(3, 4))) == 0.0
    assert np.isclose(float(dila.kl_normal(torch.ones(1, 4), torch.zeros(1, 4))), 2.0)  # 0.5 * |mu|^2


def test_psnr_and_ssim_known_values():
    a = torch.rand(2, 3, 16, 16)
    assert torch.allclose(dila.ssim(a, a), torch.ones(2))
    b = (a + 0.1).clamp(max=10)
    assert torch.allclose(dila.psnr(a, b), torch.full((2,), 20.0))  # 10 log10(1 / 0.01)
    assert (dila.ssim(a, torch.rand(2, 3, 16, 16)) < 0.5).all()


def test_locate_finds_a_pasted_template_and_crops_read_it_back():
    frames = torch.rand(3, 3, 24, 24) * 0.2
    templates = torch.rand(3, 3, 10, 10)
    where = torch.tensor([[0, 5], [14, 14], [7, 2]])
    for i, (y, x) in enumerate(where.tolist()):
        frames[i, :, y : y + 10, x : x + 10] = templates[i]
    assert torch.equal(dila.locate(frames, templates), where)
    assert torch.equal(dila.crops_at(frames, where), templates)


def test_prepare_moves_the_sprite_by_the_recorded_actions(tmp_path):
    p = dila.Params(n_videos=6, n_frames=5, brightness=0.0)
    dila.prepare(p, tmp_path)
    d = dila.load_videos(tmp_path)
    assert d["x"].shape == (6, 5, 3, 32, 32)
    assert (d["pos"] >= 0).all() and (d["pos"] <= 32 - dila.SPRITE).all()
    assert (d["disp"].abs().max(-1).values <= max(p.speeds)).all()
    # without jitter, the sprite crop at the recorded position is the best match of the previous crop
    for v in range(6):
        for t in range(4):
            template = dila.crops_at(d["x"][v, t][None], d["pos"][v, t][None])
            found = dila.locate(d["x"][v, t + 1][None], template, d["alpha"][v][None])[0]
            assert torch.equal(found, d["pos"][v, t + 1]) or d["disp"][v, t].abs().sum() == 0


def test_trained_structure_encoder_keeps_appearance_out_of_the_action(tmp_path):
    # train a tiny DiLA on the real generator, then probe the trained structure pathway: (1) the content pathway
    # cannot reach the action at all (a different content encoder leaves it bitwise unchanged); (2) recolouring
    # the scene (a brightness change of both frames, the jitter the data carries) moves the inferred action less
    # than a different move of the sprite does
    p = dila.Params(n_videos=48, n_frames=4, size=16, brightness=0.1, speeds=[2], test_fraction=0.25)
    dila.prepare(p, tmp_path)
    d = dila.load_videos(tmp_path)
    torch.manual_seed(0)
    model = dila.DiLA(8, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = d["x"][~d["is_test"]]  # (V, T, 3, 16, 16)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        v, t = torch.randint(len(x), (16,), generator=g), torch.randint(0, 3, (16,), generator=g)
        loss = model.loss(x[v, t], x[v, t + 1], beta=1e-3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    xt = d["x"][d["is_test"]]
    o_t, o_next, o_other = xt[:, 0], xt[:, 1], xt[:, 2]  # o_t -> o_next is one move, o_t -> o_other another
    with torch.no_grad():
        mu = model.infer(o_t, o_next)[0]
        model.content = dila.ContentEncoder(8)  # an untrained content pathway
        assert torch.equal(model.infer(o_t, o_next)[0], mu)
        bright = model.infer((o_t * 1.1).clamp(0, 1), (o_next * 1.1).clamp(0, 1))[0]
        moved = model.infer(o_t, o_other)[0]
    assert (bright - mu).norm(dim=1).mean() < 0.5 * (moved - mu).norm(dim=1).mean()
