"""Causal Forcing's mechanism on tiny inputs: frame-level injectivity of AR vs bidirectional ODE pairs, the
block-causal mask, the Euler path, the Self Forcing rollout, the DMD gradient, stage freezing, scorers, data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models import causal_forcing as cf

P = cf.Params(n_frames=4, width=16, layers=1, heads=2)


def _nets():
    torch.manual_seed(0)
    return cf.build(P, False).eval(), cf.build(P, True).eval()


def test_causal_mask_blocks_the_future_and_other_noisy_frames():
    _, ar = _nets()
    g = torch.Generator().manual_seed(1)
    noisy, clean = torch.randn(2, 4, 64, generator=g), torch.randn(2, 4, 64, generator=g)
    t, prompt = torch.rand(2, 4, generator=g), torch.tensor([1, 3])
    with torch.no_grad():
        base = ar(noisy, t, prompt, clean)
        clean2, noisy2 = clean.clone(), noisy.clone()
        clean2[:, 2:] += 1.0  # clean frames >= 2 and noisy frame 3 must not reach noisy frame 2 (nor 0, 1)
        noisy2[:, 3] += 1.0
        out = ar(noisy2, t, prompt, clean2)
    assert torch.allclose(out[:, :3], base[:, :3], atol=1e-6)
    assert not torch.allclose(out[:, 3], base[:, 3], atol=1e-4)
    clean3 = clean.clone()
    clean3[:, 1] += 1.0  # the past does reach frame 2
    with torch.no_grad():
        assert not torch.allclose(ar(noisy, t, prompt, clean3)[:, 2], base[:, 2], atol=1e-4)


def test_euler_levels_read_the_piecewise_linear_path_exactly():
    x1, v = torch.randn(3, 5), torch.randn(3, 5)
    states, end = cf.euler_levels(lambda x, t: v * (1 + t), x1, 2, cf.LEVELS)
    # velocity v (1 + t): step 1 (t 1 -> 0.5) moves by 0.5 * 2v, step 2 (t 0.5 -> 0) by 0.5 * 1.5v
    mid = x1 - 0.5 * 2 * v
    assert torch.allclose(states[0], x1) and torch.allclose(states[2], mid)
    assert torch.allclose(states[1], x1 - 0.25 * 2 * v)
    assert torch.allclose(states[3], mid - 0.25 * 1.5 * v)
    assert torch.allclose(end, mid - 0.5 * 1.5 * v)


def test_ar_pairs_are_injective_per_frame_and_bidirectional_pairs_are_not():
    """The spec's core: under T_ar frame i is a function of eps^{<=i} (its own noise and the past), under T_bi it
    also depends on the future frames' noise, which a causal student cannot see."""
    bi, ar = _nets()
    g = torch.Generator().manual_seed(2)
    eps, prompt = torch.randn(3, 4, 64, generator=g), torch.tensor([0, 1, 2])
    eps2 = eps.clone()
    eps2[:, 3] = torch.randn(3, 64, generator=g)  # change only the last frame's noise
    _, clean_ar = cf.curate_pairs(ar, eps, prompt, 3)
    _, clean_ar2 = cf.curate_pairs(ar, eps2, prompt, 3)
    states_bi, clean_bi = cf.curate_pairs(bi, eps, prompt, 3)
    _, clean_bi2 = cf.curate_pairs(bi, eps2, prompt, 3)
    assert torch.allclose(clean_ar[:, :3], clean_ar2[:, :3], atol=1e-6)
    assert not torch.allclose(clean_bi[:, :3], clean_bi2[:, :3], atol=1e-4)
    assert states_bi.shape == (3, len(cf.LEVELS), 4, 64) and torch.allclose(states_bi[:, 0], eps)


def test_a_bidirectional_teachers_weights_load_into_a_block_causal_student():
    """student_bi starts from T_bi's weights: the same parameter layout, only the attention mask differs."""
    bi, _ = _nets()
    student = cf.build(P, True)
    student.load_state_dict(bi.state_dict())  # strict: every key matches
    assert student.causal and all(torch.equal(a, b) for a, b in zip(student.parameters(), bi.parameters(), strict=True))


def test_a_bidirectional_model_tells_its_frames_apart_from_the_start():
    """Shuffling the frames of a clip changes the bidirectional model's output by far more than rounding: the frame
    position is at the tokens' scale (at 0.02 the model was nearly permutation-equivariant and never learned order)."""
    bi, _ = _nets()
    torch.manual_seed(1)
    noisy, t, prompt = torch.randn(8, 4, cf.P), torch.rand(8, 4), torch.randint(0, len(cf.PROMPTS), (8,))
    order = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        out = bi(noisy, t, prompt)
        shuffled = bi(noisy[:, order], t[:, order], prompt)
    # an equivariant model gives out[:, order] back; the measured change relative to the output's scale
    change = (shuffled - out[:, order]).norm() / out.norm()
    assert change > 0.3


def test_pair_inputs_gather_each_frames_own_level():
    states = torch.arange(2 * 4 * 3 * 64, dtype=torch.float32).reshape(2, 4, 3, 64)
    clean = torch.randn(2, 3, 64)
    level = torch.tensor([[0, 3, 1], [2, 2, 0]])
    noisy, t, ctx = cf.pair_inputs(states, clean, level)
    for b in range(2):
        for f in range(3):
            assert torch.equal(noisy[b, f], states[b, level[b, f], f])
            assert t[b, f] == cf.LEVELS[level[b, f]]
    assert ctx is clean


def test_rollout_is_autoregressive_and_exits_with_a_one_step_prediction():
    _, ar = _nets()
    g = torch.Generator().manual_seed(3)
    eps, prompt = torch.randn(2, 4, 64, generator=g), torch.tensor([1, 2])
    with torch.no_grad():
        x = cf.rollout(ar, eps, prompt)
        eps2 = eps.clone()
        eps2[:, 2:] += 1.0
        assert torch.allclose(cf.rollout(ar, eps2, prompt)[:, :2], x[:, :2], atol=1e-6)
        one = cf.rollout(ar, eps, prompt, exit_level=0)
        t1 = torch.ones(2, 4)
        first = eps[:, 0] - ar(eps[:, :1].expand(-1, 4, -1), t1, prompt, torch.zeros_like(eps))[:, 0]
        assert torch.allclose(one[:, 0], first, atol=1e-5)
    x = cf.rollout(ar, eps, prompt, exit_level=1, grad=True)
    assert x.requires_grad
    x[:, 3].sum().backward()  # context frames are detached: only frame 3's exit prediction carries the gradient
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in ar.parameters())


def test_dmd_gradient_is_fake_minus_real_denoised_and_vanishes_when_they_agree():
    bi, _ = _nets()
    fake = cf.build(P, False).eval()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 64, generator=g, requires_grad=True)
    prompt, t, noise = torch.tensor([0, 1, 3]), torch.tensor([0.3, 0.6, 0.9]), torch.randn(3, 4, 64, generator=g)
    cf.dmd_loss(x, bi, fake, prompt, t, noise).backward()
    with torch.no_grad():
        x_t = (1 - t[:, None, None]) * x + t[:, None, None] * noise
        tt = t[:, None].expand(-1, 4)
        real, fk = cf.x0_of(bi, x_t, tt, prompt), cf.x0_of(fake, x_t, tt, prompt)
        expected = (fk - real) / (x - real).abs().mean((1, 2), keepdim=True) / 3
    assert torch.allclose(x.grad, expected, atol=1e-5)
    y = x.detach().clone().requires_grad_(True)
    cf.dmd_loss(y, bi, bi, prompt, t, noise).backward()
    assert float(y.grad.abs().max()) == 0.0


def test_frozen_stage_parameters_do_not_move_even_with_adam_momentum():
    model = cf.Pipeline(P)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, prompt = torch.randn(2, 4, 64), torch.tensor([0, 1])
    t = torch.rand(2, 4)
    for trained in (model.fakes, model.gens):  # a fake step (gives the fakes Adam momentum), then a generator step
        cf.freeze_all_but(model, trained)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        loss = sum(cf.fm_loss(n, x, t, torch.randn_like(x), prompt) for n in model.fakes.values()) + sum(
            cf.fm_loss(n, x, t, torch.randn_like(x), prompt, clean=x) for n in model.gens.values())
        loss.backward()
        opt.step()
        after = model.state_dict()
        moved = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k])}
        assert moved == {"fakes" if trained is model.fakes else "gens"}


def test_scorers_on_rendered_clips():
    moving = cf.render_clip(1, 1, 1.0, 1.0, 3.0, 4)  # horizontal, 1 px/frame, away from the edges
    static = cf.render_clip(0, 0, 0.0, 3.5, 3.5, 4)
    x = torch.from_numpy(np.stack([moving, static])).float()
    c = cf.centroids(x)
    assert torch.allclose(c[0, :, 0], torch.tensor([1.0, 2.0, 3.0, 4.0]), atol=0.15)
    assert torch.equal(cf.dynamic(x), torch.tensor([True, False]))
    assert (cf.blob_fidelity(x) > 0.99).all()
    doubled = torch.from_numpy(cf.blob(np.array([1.5]), np.array([3.0])) + cf.blob(np.array([5.5]), np.array([3.0])))
    doubled = doubled.reshape(1, 1, 64).expand(1, 4, 64).float()
    assert float(cf.blob_fidelity(doubled)[0]) < 0.9


def test_dynamic_gap_charges_jitter_that_dynamic_degree_rewards():
    """A static prompt whose blob jumps between frames counts as dynamic; the gap to the real clips' degree (what the
    claim reads) charges it, while a faithful copy of the real clips has no gap."""
    rng = np.random.default_rng(0)
    static = [cf.render_clip(0, 0, 0.0, *rng.uniform(2, 5, 2), 4) for _ in range(8)]
    moving = [cf.render_clip(1, 1, 1.0, 1.0, *rng.uniform(2, 5, 1), 4) for _ in range(8)]
    real = torch.from_numpy(np.stack(static + moving)).float()
    jumps = rng.uniform(1, 6, (8, 4, 2))  # a fresh position every frame
    jitter = torch.from_numpy(np.stack([cf.blob(j[:, 0], j[:, 1]).reshape(4, 64) for j in jumps])).float()
    jittery = torch.cat([jitter, real[8:]])
    assert float(cf.dynamic(real).float().mean()) == 0.5
    assert float(cf.dynamic(jittery).float().mean()) > 0.9  # more "dynamic" than the data
    assert cf.dynamic_gap(real, real) == 0.0
    assert cf.dynamic_gap(jittery, real) > 0.4


def test_static_dynamic_counts_only_the_static_prompts_wander():
    """Moving clips do not count; a static clip whose blob wanders does; a still one does not."""
    rng = np.random.default_rng(1)
    still = [cf.render_clip(0, 0, 0.0, *rng.uniform(2, 5, 2), 4) for _ in range(4)]
    jumps = rng.uniform(1, 6, (4, 4, 2))
    wander = [cf.blob(j[:, 0], j[:, 1]).reshape(4, 64) for j in jumps]
    moving = [cf.render_clip(1, 1, 1.0, 1.0, *rng.uniform(2, 5, 1), 4) for _ in range(8)]
    x = torch.from_numpy(np.stack(still + wander + moving)).float()
    prompt = torch.tensor([0] * 8 + [1] * 8)
    assert cf.static_dynamic(x, prompt) == 0.5
    assert cf.static_dynamic(x[:4], prompt[:4]) == 0.0
    assert cf.static_dynamic(x[8:], prompt[8:]) == 0.0  # no static clip: nothing to wander


def test_sliced_w2_known_values():
    a = torch.randn(400, 16, generator=torch.Generator().manual_seed(5))
    assert cf.sliced_w2(a, a, seed=0) == pytest.approx(0.0, abs=1e-9)
    shift = torch.zeros(16)
    shift[0] = 4.0
    # a translation by c: every projection moves by c . theta, so SW2^2 = E (c . theta)^2 = |c|^2 / D
    assert cf.sliced_w2(a, a + shift, seed=0, n_projections=4000) == pytest.approx(4.0 / math.sqrt(16), rel=0.05)


def test_prepare_renders_prompted_motion_inside_the_frame(tmp_path):
    p = cf.Params(n_clips=40, n_frames=6)
    cf.prepare(p, tmp_path)
    d = cf.load_clips(tmp_path)
    pix = cf.to_pixels(d["x"])
    assert d["x"].shape == (40, 6, 64) and torch.allclose(cf.to_model(pix), d["x"], atol=1e-5)
    assert abs(float(d["x"].mean())) < 0.1 and abs(float(d["x"].std()) - 1) < 0.1  # unit-variance scale
    table = cf.read_table(tmp_path / "clips.parquet")
    assert {"clip_id", "prompt", "sign", "speed", "x0", "y0", "frame", "pix_0", "pix_63", "split"} <= set(table)
    static = d["prompt"] == 0
    assert torch.allclose(d["x"][static], d["x"][static][:, :1].expand(-1, 6, -1))  # static clips do not move
    assert (cf.dynamic(pix[~static]).float().mean() > 0.6)
    assert np.all((cf.fold(np.linspace(-20, 20, 101)) >= 0) & (cf.fold(np.linspace(-20, 20, 101)) <= 7))


def test_load_ode_pairs_reads_the_self_forcing_format(tmp_path):
    prompts = ["a cat walks", "a ball rolls"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    for i, prompt in enumerate(prompts):
        torch.save({prompt: torch.full((1, 5, 3, 16, 4, 4), float(i))}, tmp_path / f"{i:05d}.pt")
    pairs = cf.load_ode_pairs(tmp_path)
    assert [q for q, _ in pairs] == prompts and pairs[1][1].shape == (5, 3, 16, 4, 4)
    assert float(pairs[1][1].mean()) == 1.0
    (tmp_path / "00001.pt").unlink()
    with pytest.raises(FileNotFoundError, match="00001.pt"):
        cf.load_ode_pairs(tmp_path)


def test_stage_one_has_its_own_schedule_and_the_later_stages_start_from_its_ema(tmp_path):
    """Both teachers train under one warm-up + cosine schedule on their own engine; the ODE and DMD stages keep
    their own constant rates (a DeepSpeed schedule on a shared engine would rewrite them), and everything after
    stage 1 holds the teachers' EMA weights, not the live ones."""
    from tasks.context import TrainContext
    from tasks.worker import _init_distributed

    _init_distributed()
    p = cf.Params(n_clips=32, n_frames=4, width=16, layers=1, heads=2, batch_size=4, teacher_steps=6,
                  teacher_warmup=2, teacher_decay="cosine", teacher_ema=0.5, n_pairs=4, n_pairs_heldout=4,
                  euler_steps=2, student_steps=2, dmd_steps=1, fake_updates=1, n_eval=4, checkpoint_every=100)
    cf.prepare(p, tmp_path)
    lrs: dict[str, list[list[float]]] = {}

    class Recording(TrainContext):  # each step's learning rate of every arm, as the step trains with it
        def fit(self, name, engine, step_fn, batch_fn, num_steps, **kw):
            def recorded(engine, batch, step):
                lrs.setdefault(name, []).append([g["lr"] for g in engine.optimizer.param_groups])
                return step_fn(engine, batch, step)

            super().fit(name, engine, recorded, batch_fn, num_steps, **kw)

    cf.train(Recording(params=p, data_dir=tmp_path, out_dir=tmp_path))

    teacher = [set(step) for step in lrs["teachers"]]  # T_bi, T_ar, classifier
    assert all(len(step) == 1 for step in teacher)  # one schedule for every teacher
    rate = [step.pop() for step in teacher]
    top = rate.index(max(rate))  # warms up from 0, then decays: rises to a peak inside the stage, falls after
    assert len(rate) == p.teacher_steps and rate[0] == 0.0 and 0 < top < len(rate) - 1 and max(rate) <= p.lr
    assert rate[: top + 1] == sorted(rate[: top + 1]) and rate[top:] == sorted(rate[top:], reverse=True)
    assert {r for step in lrs["ode_init"] for r in step} == {p.student_lr}
    assert {r for step in lrs["dmd"] for r in step} == {p.dmd_lr}

    def load(phase: str, ema: bool = False) -> dict[str, torch.Tensor]:
        return torch.load(tmp_path / f"network.{phase}{'.ema' if ema else ''}.pt", weights_only=False)["module"]

    ema, live, after = load("teachers", ema=True), load("teachers"), load("dmd").teachers
    for key, value in after.state_dict().items():
        assert torch.equal(value, ema.state_dict()[key]), key
    assert any(not torch.equal(v, live.state_dict()[k]) for k, v in after.state_dict().items())


def test_shifted_timesteps_keep_the_ends_and_move_mass_toward_noise():
    u = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cf.shift_t(u, 1.0), u)  # no shift: the uniform draw, bitwise
    t = cf.shift_t(u, 3.0)
    assert float(cf.shift_t(torch.tensor(0.0), 3.0)) == 0.0 and float(cf.shift_t(torch.tensor(1.0), 3.0)) == 1.0
    assert bool((t >= u).all()) and bool((torch.diff(cf.shift_t(torch.linspace(0, 1, 50), 3.0)) > 0).all())
    assert float(t.median()) == pytest.approx(0.75, abs=0.02)  # 3 * 0.5 / (1 + 2 * 0.5)
    assert float((t > 0.8).float().mean()) == pytest.approx(1 - 0.8 / (3 - 2 * 0.8), abs=0.02)  # u > 0.571
