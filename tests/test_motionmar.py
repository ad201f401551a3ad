"""MotionMAR's mechanism on tiny inputs: the residual quantiser, block-causal next-scale prediction, the data, the
AMASS FK loader, the metrics."""

from __future__ import annotations

import numpy as np
import torch

from models import motionmar as mm
from models.common import sequences as seq


def tiny(**kw) -> mm.Params:
    base = dict(window=16, width=16, layers=1, heads=2, codebook=8, code_dim=4, scales=[1, 2, 4])
    return mm.Params(**(base | kw))


def test_quantiser_recovers_a_constant_code_at_the_coarsest_scale():
    q = mm.Quantizer(4, 3, [1, 2, 4], decay=0.99, beta=0.25).eval()
    q.codebook.copy_(torch.tensor([[0.0, 0, 0], [1.0, 2, 3], [-1.0, 0, 1], [5.0, 5, 5]]))
    z = torch.tensor([1.0, 2, 3]).expand(2, 4, 3)  # (B, L, D): the same vector at every latent step
    zq, idx, commit = q(z)
    assert [i.shape[1] for i in idx] == [1, 2, 4]
    assert idx[0].eq(1).all() and all(i.eq(0).all() for i in idx[1:])  # coarse scale takes it all, residual 0
    assert torch.allclose(zq, z) and float(commit) == 0.0
    assert torch.allclose(q.f_hat(idx, 4), z) and torch.allclose(q.f_hat(idx, 4, upto=1), z)


def test_quantised_value_is_the_sum_of_upsampled_codes():
    torch.manual_seed(0)
    q = mm.Quantizer(16, 4, [1, 2, 4, 8], decay=0.99, beta=0.25).eval()
    z = torch.randn(3, 8, 4)
    zq, idx, _ = q(z)
    ref = sum(torch.nn.functional.interpolate(q.codebook[i].transpose(1, 2), size=8, mode="linear",
                                              align_corners=False).transpose(1, 2) for i in idx)
    assert torch.allclose(zq, ref, atol=1e-6)


def test_ema_moves_a_used_code_towards_its_assignments_and_restarts_dead_codes():
    torch.manual_seed(0)
    q = mm.Quantizer(4, 2, [1], decay=0.5, beta=0.25).train()
    z = torch.randn(6, 1, 2)
    q(z)  # first step: every code restarts at a batch residual (data-dependent init)
    assert all(any(torch.allclose(c, r, atol=1e-2) for r in z[:, 0]) for c in q.codebook)
    target = torch.tensor([3.0, -3.0])
    before = (q.codebook - target).norm(dim=-1).min()
    for _ in range(5):
        q(target.expand(8, 1, 2))
    assert (q.codebook - target).norm(dim=-1).min() < before * 0.1


def test_man_is_block_causal_across_scales_and_generation_is_self_consistent():
    torch.manual_seed(0)
    p = tiny()
    vq, man = mm.VQVAE(9, p, p.scales).eval(), mm.MAN(p, 6, p.scales, flat=False).eval()
    c = torch.randn(2, 16, 6)
    idx = [torch.randint(8, (2, s)) for s in p.scales]
    inp = man.inputs(vq.quant, idx, 4)
    changed = [i.clone() for i in idx]
    changed[-1] = (changed[-1] + 1) % 8  # the finest scale's codes are never an input
    assert torch.equal(man.inputs(vq.quant, changed, 4), inp)
    bumped = inp.clone()
    bumped[:, 3:] += 1.0  # inputs of the finest scale (tokens 3..6) must not change coarser logits
    a, b = man(inp, c), man(bumped, c)
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6) and not torch.allclose(a[:, 3:], b[:, 3:])
    gen = man.generate(vq.quant, c, 4)
    assert torch.equal(man(man.inputs(vq.quant, gen, 4), c).argmax(-1), torch.cat(gen, 1))


def test_flat_ar_is_causal_token_by_token():
    torch.manual_seed(0)
    p = tiny()
    vq, ar = mm.VQVAE(9, p, [4]).eval(), mm.MAN(p, 6, [4], flat=True).eval()
    idx = [torch.randint(8, (1, 4))]
    inp = ar.inputs(vq.quant, idx, 4)
    assert torch.equal(inp[:, 0], torch.zeros(1, 4)) and torch.equal(inp[:, 1:], vq.quant.codebook[idx[0][:, :-1]])
    c, bumped = torch.randn(1, 16, 6), inp.clone()
    bumped[:, 2] += 1.0
    a, b = ar(inp, c), ar(bumped, c)
    assert torch.allclose(a[:, :2], b[:, :2], atol=1e-6) and not torch.allclose(a[:, 2:], b[:, 2:])


def test_synthetic_motion_keeps_bones_and_feet_on_the_floor():
    p = mm.Params(window=32)
    rng = np.random.default_rng(0)
    for cls in mm.CLASSES:
        joints = mm.synth_motion(rng, cls, p)
        lengths = seq.bone_lengths(joints)
        assert np.allclose(lengths, lengths[0], atol=1e-9), cls
        assert np.allclose(joints[:, [12, 15], 1].min(1), 0.05), cls
    walk, idle = mm.synth_motion(rng, "walk", p), mm.synth_motion(rng, "idle", p)
    assert np.linalg.norm(walk[-1, 0] - walk[0, 0]) > 5 * np.linalg.norm(idle[-1, 0] - idle[0, 0])


def test_features_round_trip_and_metrics_known_values():
    joints = torch.randn(2, 8, 16, 3)
    x = mm.features(joints)
    assert x.shape == (2, 8, 48) and torch.allclose(x[..., :3], joints[..., 0, :])
    assert torch.allclose(mm.joints_from_features(x), joints, atol=1e-6)
    shifted = joints + torch.tensor([0.01, 0.0, 0.0])
    m = mm.motion_metrics(shifted, joints, [10, 11], fps=30)
    assert np.isclose(m["mpjpe"], 1.0) and np.isclose(m["root_error"], 1.0) and np.isclose(m["mpjve"], 0, atol=1e-4)
    assert np.isclose(m["jitter"], mm.motion_metrics(joints, joints, [0], 30)["jitter"], rtol=1e-4)


def test_mrn_starts_as_identity_and_direct_regression_matches_parameters():
    p = tiny()
    mrn = mm.MRN(9, 6, 16)
    x, c = torch.randn(2, 16, 9), torch.randn(2, 16, 6)
    assert torch.equal(mrn(x, c), x)
    nets = mm.build(p, 9, 6)
    target = sum(mm.n_params(nets[k]) for k in ("tmt", "man", "mrn"))
    assert abs(mm.n_params(nets["direct"]) - target) / target < 0.1


def test_amass_loader_on_tiny_fixtures(tmp_path):
    # toy tree: root -> spine (0, 0, 1) -> head (0, 0, 1) in AMASS's z-up frame, plus a hand off the spine
    body = {"parents": np.array([-1, 0, 1, 1]),
            "joints_template": np.array([[0, 0, 0], [0, 0, 1], [0, 0, 2], [1, 0, 1]], dtype=np.float64)}
    np.savez(tmp_path / "body.npz", **body)
    poses = np.zeros((4, 12))
    trans = np.tile([[0.5, 0.0, 0.0]], (4, 1))
    rest = mm.amass_joints(poses, trans, np.zeros(10), body)
    assert np.allclose(rest[0], [[0.5, 0, 0], [0.5, 1, 0], [0.5, 2, 0], [1.5, 1, 0]])  # y up, z = -y_amass
    poses[:, 5] = np.pi / 2  # spine turns 90 degrees about z (up): the hand swings from +x to +y (z-up)
    turned = mm.amass_joints(poses, trans, np.zeros(10), body)
    assert np.allclose(turned[0, 3], [0.5, 1, -1], atol=1e-9) and np.allclose(turned[0, 2], rest[0, 2])
    for sub, n in (("CMU", 40), ("HDM05", 70)):
        (tmp_path / "amass" / sub).mkdir(parents=True)
        np.savez(tmp_path / "amass" / sub / "m.npz", poses=np.zeros((n, 12)), trans=np.zeros((n, 3)),
                 betas=np.zeros(10), mocap_framerate=np.array(60.0))
    p = mm.Params(dataset="amass", amass_dir=str(tmp_path / "amass"), body_model=str(tmp_path / "body.npz"),
                  fps=30, window=8, tracker_joints=[2, 3, 3], lower_joints=[1])
    windows, names, _ = mm.load_amass(p)
    assert len(windows) == 20 // 8 + 35 // 8 and windows[0].shape == (8, 4, 3)
    assert names.count("CMU") == 2 and names.count("HDM05") == 4
    mm.prepare(p, tmp_path)
    d = mm.load_data(tmp_path)
    assert d["x"].shape == (6, 8, 12) and d["c"].shape == (6, 8, 18)


def test_full_profile_reads_the_amass_fixture_at_its_own_window(tmp_path):
    """The AMASS-format fixture the planner prepares the full profile on (tasks/fixtures.py) serves the full
    profile's own settings: SMPL's 22 joints, 196-frame windows at 60 fps from 120 Hz takes, both splits."""
    from models import registry
    from tasks import settings
    from tasks.fixtures import real_format

    full = registry.ask("motionmar", "full", None, settings.params_file()).raw
    fixture = real_format("motionmar", full, tmp_path / "fixture")
    assert set(fixture) == {"dataset", "amass_dir", "body_model"} and fixture["dataset"] == "amass"
    p = registry.validate(registry.get("motionmar"), {**full, **fixture}, where="motionmar.full on the fixture")
    windows, names, held = mm.load_amass(p)
    assert len(windows) == 8 and all(w.shape == (196, 22, 3) for w in windows)  # 4 takes x 2 windows
    assert len(set(names)) == 4 and 0 < sum(held) < len(held)  # one name a take's folder; some takes held out
    mm.prepare(p, tmp_path)
    d = mm.load_data(tmp_path)
    assert d["x"].shape == (8, 196, 66) and d["c"].shape == (8, 196, 18) and 0 < int(d["test"].sum()) < 8
    assert max(p.tracker_joints + p.lower_joints) < 22 and p.scales[-1] == p.window // 4


def test_vqvae_loss_weights_the_root_trajectory():
    """root_weight scales the root's 3 features against each joint coordinate; the weights average to 1, so an error
    on the root costs root_weight times an equal error on a joint coordinate."""
    p = tiny().model_copy(update={"root_weight": 8.0})
    vq = mm.VQVAE(9, p, p.scales).eval()
    assert torch.allclose(vq.weight.mean(), torch.tensor(1.0))
    assert torch.allclose(vq.weight[:3] / vq.weight[3:].mean(), torch.tensor(8.0))
    x = torch.zeros(1, 16, 9)
    costs = []
    for feature in (0, 3):  # the same constant error on a root coordinate, then on a joint coordinate
        rec = torch.zeros(1, 16, 9)
        rec[..., feature] = 1.0
        vq.decode = lambda f, r=rec: r
        with torch.no_grad():
            costs.append(float(vq.loss(x)) - float(vq.quant(vq.encode(x))[2]))  # minus the commitment term
    assert abs(costs[0] / costs[1] - 8.0) < 1e-4


def test_direct_regression_parameter_count_is_counted_without_building():
    for cin, feat, w, layers, length in [(18, 48, 64, 2, 32), (6, 9, 16, 1, 16), (54, 66, 132, 4, 196)]:
        built = mm.DirectRegression(cin, feat, w, layers, 4, length)
        assert mm.direct_params(cin, feat, w, layers, length) == mm.n_params(built)
    p = tiny()
    w = mm.matched_width(20_000, 6, 9, p)
    assert w % p.heads == 0
    assert all(abs(mm.direct_params(6, 9, w, p.layers, p.window) - 20_000)
               <= abs(mm.direct_params(6, 9, v, p.layers, p.window) - 20_000) for v in (w - p.heads, w + p.heads))


def _two_ranks(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same initial codebook and the same step seed on both ranks, as in TrainContext.fit
    q = mm.Quantizer(16, 3, [1, 2], decay=0.9, beta=0.25).train()
    data = torch.Generator().manual_seed(rank)  # each rank quantises its own shard
    for _ in range(4):
        q(torch.randn(4, 2, 3, generator=data) * (1 + 5 * rank))
    torch.save({k: v.clone() for k, v in q.state_dict().items()}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_codebooks_stay_identical_across_ranks_with_different_shards(tmp_path):
    """The EMA statistics are all-reduced and the restarts broadcast from rank 0, so two ranks that quantise
    different data keep bitwise the same codebook (DeepSpeed only synchronises gradients)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in ("codebook", "ema_sum", "ema_count"))
    assert bool(a["initialised"]) and not torch.equal(a["codebook"], torch.zeros_like(a["codebook"]))


def test_cosine_lr_decays_to_its_final_fraction():
    lrs = [mm.cosine_lr(2e-3, 0.1, s, 100) for s in range(100)]
    assert np.isclose(lrs[0], 2e-3) and np.isclose(lrs[-1], 2e-4)
    assert all(a >= b for a, b in zip(lrs[:-1], lrs[1:], strict=True))
    assert mm.cosine_lr(1e-3, 1.0, 7, 10) == 1e-3


def test_conv_stacks_start_with_he_init_so_the_first_layers_get_gradient():
    """Under PyTorch's default conv init the VQ-VAE's 14 unnormalised convolutions shrink the signal to a near
    constant and the encoder's first layer gets ~1e-4 of the last layer's gradient (the plateau the smoke VQ-VAEs
    sat on); he_init keeps the latents and SAC's conditioning at unit scale and the gradient within 10x."""
    from torch import nn

    p = mm.Params(window=32, width=64, code_dim=64, codebook=256)
    for seed in range(2):
        torch.manual_seed(seed)
        vq, sac = mm.VQVAE(48, p, p.scales), mm.SAC(18, 64, p.scales)
        x = torch.randn(16, 32, 48)
        z = vq.encode(x)  # (B, T/4, D)
        (vq.decode(z) - x).abs().mean().backward()
        ratio = float(vq.enc[0].weight.grad.norm() / vq.dec[-1].weight.grad.norm())
        cond = sac(torch.randn(16, 32, 18)).detach()  # (B, N, w)
        assert float(z.detach().std()) > 0.3 and float(cond.std()) > 0.3 and ratio > 0.1
        for m in vq.modules():  # PyTorch's default init, for contrast: the first layer's gradient vanishes
            if isinstance(m, nn.Conv1d | nn.ConvTranspose1d):
                m.reset_parameters()
        vq.zero_grad()
        (vq.decode(vq.encode(x)) - x).abs().mean().backward()
        assert float(vq.enc[0].weight.grad.norm() / vq.dec[-1].weight.grad.norm()) < 1e-2 * ratio


def test_direct_regression_trains_as_many_steps_as_motionmars_tracker_reading_phases(tmp_path):
    """Fair arms: direct regression trains in its own phase for ar + mrn steps (MAN+SAC's and MRN's) on the same
    batches, and the AR phase trains only MAN+SAC and the flat AR."""
    from tasks.context import TrainContext
    from tasks.worker import _init_distributed

    _init_distributed()
    p = tiny(n_sequences=12, batch_size=4, vq_steps=3, ar_steps=2, mrn_steps=1, checkpoint_every=100)
    mm.prepare(p, tmp_path)
    phases: dict[str, tuple[int, set[str], list[int]]] = {}

    class Recording(TrainContext):  # each phase's steps, the networks it trains and the batches it draws
        def fit(self, name, engine, step_fn, batch_fn, num_steps, **kw):
            nets = {n for part in engine.module.parts for n in part}
            draws: list[int] = []

            def drawn(step):
                draws.append(step)
                return batch_fn(step)

            before = [q.detach().clone() for q in engine.module.parameters()]
            super().fit(name, engine, step_fn, drawn, num_steps, **kw)
            moved = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
            phases[name] = (num_steps, nets, draws) if moved else (0, nets, draws)

    mm.train(Recording(params=p, data_dir=tmp_path, out_dir=tmp_path))
    assert phases["ar"][:2] == (2, {"man", "flat_ar"})
    assert phases["direct"][:2] == (2 + 1, {"direct"}) and phases["mrn"][:2] == (1, {"mrn"})
    assert phases["direct"][2] == list(range(3))  # the same batches as the method's phases (batch k at step k)
