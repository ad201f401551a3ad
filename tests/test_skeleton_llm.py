"""SkeletonLLM mechanism: DrAction's soft segments, invariances and gradients; the DFT loss; the data generator;
BLEU-4 and reasoning scores; the real-data loaders on tiny fixtures."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from models import skeleton_llm as sk


def _pose(action="wave_l", frames=8, fmt="A"):
    t = np.arange(frames) / frames
    return sk.derive_joints(sk.action_pose(action, t, 1.0, 0.3, 0.1), fmt)


def test_segment_field_matches_brute_force_distance():
    a, b = torch.tensor([[-0.3, -0.2]]), torch.tensor([[0.25, 0.1]])
    sigma, size = torch.tensor(0.07), 12
    field = sk.segment_field(a, b, sigma, size)[:, 0]  # (HW,)
    g = (np.arange(size) + 0.5) / size - 0.5
    pts = a.numpy()[0] + np.linspace(0, 1, 20001)[:, None] * (b - a).numpy()[0]  # dense samples of the segment
    for idx in (0, 17, 60, 143):
        pix = np.array([g[idx % size], g[idx // size]])  # (u, v) = (column, row)
        d2 = ((pts - pix) ** 2).sum(1).min()
        assert float(field[idx]) == pytest.approx(math.exp(-d2 / (2 * 0.07**2)), rel=1e-3, abs=1e-6)


def test_segment_field_backward_matches_autograd():
    # the written-out backward gives autograd's gradients (to the 1e-8 guard on the bone length), the forward the
    # reference's values bit for bit; batched like the renderer's (B, K, S, E, 2) segments, with clamped ends
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(2, 3, 2, 5, 2, generator=g) - 0.5, torch.rand(2, 3, 2, 5, 2, generator=g) - 0.5
    sigma = torch.tensor([0.08])
    up = torch.rand(2, 3, 2, 64, 5, generator=g)  # an arbitrary upstream gradient
    fields, grads = [], []
    for fn in (sk.segment_field, sk.segment_field_ref):
        x, y, sg = (t.clone().double().requires_grad_() for t in (a, b, sigma))
        f = fn(x, y, sg, 8)
        (f * up.double()).sum().backward()
        grads.append([x.grad, y.grad, sg.grad])
        fields.append(fn(a, b, sigma, 8))
    assert torch.equal(fields[0], fields[1])
    for got, want in zip(*grads, strict=True):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert grads[0][2].abs() > 0 and grads[0][0].abs().sum() > 0


def test_draction_is_invariant_to_scale_translation_and_joint_order():
    torch.manual_seed(0)
    r = sk.DrAction(tile=8, trail=1)
    x = torch.from_numpy(_pose(fmt="C")).float()[None]  # (1, T, 15, 3)
    bones, desc = sk.format_table("C")
    img = r(x, bones, desc)
    assert img.shape == (1, 3, 16, 16) and torch.isfinite(img).all() and img.max() > 0.1
    assert torch.allclose(r(2.5 * x + torch.tensor([1.0, -2.0, 0.5]), bones, desc), img, atol=1e-5)
    perm = torch.randperm(x.shape[2])  # the same skeleton listed in another order: the same picture
    inv = torch.argsort(perm)
    assert torch.allclose(r(x[:, :, perm], inv[bones], desc[perm]), img, atol=1e-5)


def test_mllm_gradients_reach_every_renderer_parameter_unless_frozen():
    p = sk.Params(tile=8, patch=4, d_model=16, layers=1, heads=2, trail=1, frames=8)
    x = torch.from_numpy(np.stack([_pose("wave_l"), _pose("kick_r")])).float()  # (2, T, 25, 3)
    fmt = sk.format_table("A")
    ids, tgt = torch.tensor([[3, 4, 5, 6], [3, 4, 7, 6]]), torch.tensor([[0, 0, 1, 1.0], [0, 0, 1, 1]])
    for frozen in (False, True):
        torch.manual_seed(0)
        arm = sk.VisualArm(p, vocab=10, max_len=30, frozen=frozen)
        arm.dec.loss(arm.prefix(x, None, fmt), ids, tgt).backward()
        grads = [q.grad for q in arm.render.parameters()]
        if frozen:
            assert all(g is None for g in grads)
        else:
            assert all(g is not None and g.abs().sum() > 0 for g in grads)
        assert arm.vit.embed.weight.grad.abs().sum() > 0


def test_decoder_is_causal_and_dft_loss_is_a_softmax_over_sequence_likelihoods():
    torch.manual_seed(0)
    dec = sk.PrefixLM(vocab=12, d=16, layers=1, heads=2, max_len=20)
    prefix = torch.randn(2, 3, 16)
    ids = torch.tensor([[2, 3, 4, 5], [2, 6, 7, 8]])
    changed = ids.clone()
    changed[:, 3] = 9
    assert torch.allclose(dec(prefix, ids)[:, :3], dec(prefix, changed)[:, :3], atol=1e-6)  # no peeking ahead
    cand = torch.tensor([[[2, 3, 4, 1], [2, 3, 5, 1]], [[2, 3, 5, 1], [2, 3, 4, 1]]])  # (B, 2 candidates, L)
    tgt = torch.tensor([0, 0, 1, 1.0]).expand(2, 2, 4)
    lp = torch.stack([dec.token_logp(prefix, cand[:, c], tgt[:, c]) for c in range(2)], 1)  # (B, 2)
    want = -torch.log_softmax(lp, 1)[:, 0].mean()
    valid = torch.ones(2, 2, dtype=torch.bool)
    assert float(sk.dft_loss(dec, prefix, cand, tgt, valid)) == pytest.approx(float(want), rel=1e-5)
    valid[:, 1] = False  # a label without a confusion partner contributes nothing
    assert float(sk.dft_loss(dec, prefix, cand, tgt, valid)) == pytest.approx(0.0, abs=1e-6)


def test_action_programs_show_the_facts_the_rationales_state():
    c = sk.CANON.index
    for action, joint, other in (("wave_l", "l_wrist", "r_wrist"), ("wave_r", "r_wrist", "l_wrist")):
        x = sk.action_pose(action, np.arange(16) / 16, 1.0, 0.0, 0.0)  # (T, 16, 3)
        assert (x[:, c(joint), 1] > x[:, c("head"), 1]).all() and (x[:, c(other), 1] < x[:, c("head"), 1]).all()
    kick = sk.action_pose("kick_l", np.arange(16) / 16, 1.0, 0.0, 0.0)
    assert kick[:, c("l_ankle"), 2].max() > 0.3 and abs(kick[:, c("r_ankle"), 2]).max() < 1e-9  # left foot forward
    squat, jump = (sk.action_pose(a, np.arange(16) / 16, 1.0, 0.0, 0.0)[:, 0, 1] for a in ("squat", "jump"))
    assert squat.min() < -0.3 and squat.max() <= 1e-9 and jump.max() > 0.3 and jump.min() >= -1e-9


def test_formats_are_trees_with_mirrored_format_free_descriptors():
    for fmt, joints in sk.FORMATS.items():
        names = [n for n, _ in joints]
        assert len(set(names)) == len(names) and sum(1 for _, p in joints if not p) == 1
        for n, _ in joints:  # every joint reaches the root without a cycle
            seen, cur = set(), n
            while cur:
                assert cur not in seen
                seen.add(cur)
                cur = dict(joints)[cur]
        bones, desc = sk.format_table(fmt)
        assert bones.shape == (len(names) - 1, 2) and desc.shape == (len(names), 6)
    assert [len(sk.FORMATS[f]) for f in "ABCK"] == [25, 17, 15, 18]
    left, right = sk.joint_descriptor("l_elbow"), sk.joint_descriptor("r_elbow")
    assert left[4] == 1 and right[4] == -1 and np.array_equal(np.delete(left, 4), np.delete(right, 4))
    a, b = _pose(fmt="A"), _pose(fmt="B")
    assert np.allclose(a[:, 6], b[:, 9])  # the left wrist is the same point in every format


def test_vq_quantise_picks_the_nearest_code():
    torch.manual_seed(0)
    arm = sk.VQArm(sk.Params(d_model=16, n_codes=8, layers=1, heads=2), vocab=20, max_len=30, in_dim=75, n_words=12)
    poses = torch.randn(2, 5, 75)
    z, codes = arm.quantise(poses)
    brute = ((z[..., None, :] - arm.codebook) ** 2).sum(-1).argmin(-1)
    assert torch.equal(codes, brute) and float(arm.vq_loss(poses)) > 0


def test_a_phase_trains_only_its_arms_and_leaves_branches_exactly_unchanged():
    p = sk.Params(tile=8, patch=4, d_model=16, layers=1, heads=2, n_codes=8, frames=4)
    arms = sk.build(p, {"n_words": 10, "max_text": 6, "pad": 75})
    opt = torch.optim.AdamW(arms.parameters(), lr=0.1, weight_decay=0.0)
    for name, q in arms.named_parameters():
        q.requires_grad_(name.startswith(sk.TRAINABLE["crd"]))
    assert all(q.requires_grad for a in sk.SCHEDULE["crd"] if a != "vq" for q in arms[a].parameters())
    assert not any(q.requires_grad for a in ("frozen", "nodft") for q in arms[a].parameters())
    assert not any(q.requires_grad for q in arms["vq"].enc.parameters())
    assert arms["vq"].dec.lm.body.tok.weight.requires_grad
    before = {k: v.clone() for k, v in arms.state_dict().items()}
    x = torch.from_numpy(np.stack([_pose(frames=4)] * 2)).float()
    poses = torch.randn(2, 4, 75)
    ids, tgt = torch.tensor([[3, 4, 5, 6]] * 2), torch.tensor([[0, 0, 1, 1.0]] * 2)
    loss = sum(arms[a].dec.loss(arms[a].prefix(x, poses, sk.format_table("A")), ids, tgt) for a in arms)
    loss.backward()  # every arm's loss, but only the phase's parameters have gradients
    opt.step()
    after = arms.state_dict()
    for k in after:
        assert torch.equal(after[k], before[k]) != k.startswith(("skel.", "feature.", "vq.dec.", "nocrd.")), k


def test_every_ablation_trains_as_many_steps_on_the_same_prompts_as_its_method():
    """No-CRD sees the same "why" prompts, statements and answers as CRD, only answer first; no-DFT trains the DFT
    phase too, on the same tasks without the candidate loss (issue 24: no-CRD used to see no "why" prompt at all)."""
    facts, answer = "left wrist above head ; left hand moves side to side", "wave left hand"
    crd, post = sk.why_texts(facts, answer)
    assert crd.split()[:2] == post.split()[:2] == ["why", ":"]
    assert sorted(crd.split()) == sorted(post.replace("because", "so").split())  # same words, same target length
    assert crd.index("so wave") > crd.index("side to side") and post.index("because") > post.index(answer)
    assert sk.reasoning(crd[6:-6], facts) == sk.reasoning(post[6:-6], facts) == 1.0  # both orders are scored alike
    tasks = {(ph, a): sk.ARM_TASKS.get((ph, a), sk.TASKS[ph]) for ph in sk.SCHEDULE for a in sk.SCHEDULE[ph]}
    for ph in ("crd", "dft"):  # no-CRD replaces exactly CRD's task by the post-hoc order, in both phases
        assert "nocrd" in sk.SCHEDULE[ph] and "nocrd." in sk.TRAINABLE[ph]
        assert [t if t != "post" else "crd" for t in tasks[ph, "nocrd"]] == list(tasks[ph, "skel"])
    assert "nodft" in sk.SCHEDULE["dft"] and "nodft" not in sk.DFT_ARMS and "skel" in sk.DFT_ARMS
    assert tasks["dft", "nodft"] == tasks["dft", "skel"]


def test_every_arm_trains_its_dft_phase_at_dft_lr_and_other_phases_at_lr():
    p = sk.Params(lr=2e-3, dft_lr=5e-4)
    assert [sk.phase_lr(p, ph) for ph in sk.PHASES] == [2e-3, 2e-3, 2e-3, 5e-4]
    assert all(sk.phase_lr(sk.Params(lr=1e-3), ph) == 1e-3 for ph in sk.PHASES)  # no dft_lr: one rate throughout
    with pytest.raises(ValueError):
        sk.Params(dft_lr=0.0)


def test_smoke_profile_tests_on_more_than_60_sequences():
    from models import registry
    from tasks import settings

    p = registry.resolve("skeleton_llm", "smoke", None, settings.params_file())
    assert p.n_test > 60 and p.replicates >= 3


def test_bleu4_and_reasoning_known_values():
    assert sk.bleu4([["a", "b", "c", "d", "e"]], [["a", "b", "c", "d", "e"]]) == pytest.approx(1.0)
    got = sk.bleu4([list("abcdef")], [list("abcdeg")])
    assert got == pytest.approx((5 / 6 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25, rel=1e-6)
    assert sk.bleu4([list("ab")], [list("abcd")]) < 0.4  # brevity penalty and smoothed empty 3/4-grams
    facts = "left wrist above head ; left hand moves side to side"
    assert sk.reasoning("left wrist above head ; left hand moves side to side ; so wave left hand", facts) == 1.0
    assert sk.reasoning("left wrist above head ; so wave left hand", facts) == 0.5
    three = "right wrist above head ; left knee bends ; left wrist above head"
    assert sk.reasoning(three, facts) == pytest.approx(1 / 3)
    assert sk.reasoning("so wave left hand", facts) == 0.0


def test_ntu_and_kinetics_loaders_on_tiny_fixtures(tmp_path):
    rng = np.random.default_rng(0)
    xyz = rng.normal(size=(2, 25, 3))
    lines = ["2"]
    for f, bodies in enumerate((1, 2)):
        lines.append(str(bodies))
        for b in range(bodies):
            lines += ["72057594037931101 0 1 1 1 1 0 0.02 0.1 2", "25"]
            for j in range(25):
                vals = (xyz[f, j] if b == 0 else xyz[f, j] + 5).tolist() + [0.1, 0.2, 300.0, 200.0, 0, 0, 0, 1, 2]
                lines.append(" ".join(f"{v:.6f}" for v in vals))
    path = tmp_path / "S001C001P001R001A007.skeleton"
    path.write_text("\n".join(lines) + "\n")
    assert np.allclose(sk.load_ntu_skeleton(path), xyz, atol=1e-5)  # the first body of every frame

    pose = rng.uniform(size=(3, 36))
    doc = {"data": [{"frame_index": f + 1, "skeleton": [{"pose": pose[f].tolist(), "score": [1.0] * 18}]}
                    for f in range(3)] + [{"frame_index": 4, "skeleton": []}], "label": "waving", "label_index": 4}
    (tmp_path / "clip.json").write_text(json.dumps(doc))
    x, label = sk.load_kinetics_json(tmp_path / "clip.json")
    assert label == 4 and x.shape == (4, 18, 3) and np.allclose(x[:3, :, 0], pose[:, 0::2])
    assert np.allclose(x[:3, :, 1], -pose[:, 1::2]) and not x[3].any()


def test_prepare_real_source_reads_the_loader(tmp_path):
    (tmp_path / "raw").mkdir()
    for a in (1, 2, 3, 4):
        pose = np.random.default_rng(a).uniform(size=(5, 36))
        doc = {"data": [{"frame_index": f, "skeleton": [{"pose": pose[f].tolist()}]} for f in range(5)],
               "label_index": a}
        (tmp_path / "raw" / f"c{a}.json").write_text(json.dumps(doc))
    p = sk.Params(source="kinetics", data_root=str(tmp_path / "raw"), n_train=2, n_test=2, frames=4, n_drawings=4,
                  tile=8, patch=4)
    sk.prepare(p, tmp_path)
    d = sk.load(tmp_path, p)
    assert list(d["joints"]) == ["K"] and d["joints"]["K"].shape == (4, 4, 18, 3)
    assert d["classes"] == [f"class {a}" for a in (1, 2, 3, 4)] and list(d["split"]) == ["train"] * 2 + ["test"] * 2


def test_baselines_read_each_joint_in_the_same_slot_in_every_format():
    """The feature and VQ baselines get joints aligned by name (issue 24): the same body in formats A, B and C puts
    a shared joint's coordinates in the same slot, and no other slot differs between formats except the ones a
    format lacks (zero there)."""
    from models.skeleton_llm import FORMATS, JOINT_SLOTS, by_name

    names = {n for joints in FORMATS.values() for n, _ in joints}
    coords = {n: torch.randn(3, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sorted(names))}
    slots = {}
    for fmt in "ABC":
        x = torch.stack([coords[n] for n, _ in FORMATS[fmt]]).expand(1, 2, -1, -1)  # (N=1, T=2, J, 3)
        slots[fmt] = by_name(x, fmt).view(1, 2, len(JOINT_SLOTS), 3)
    for fmt in "ABC":
        present = {n for n, _ in FORMATS[fmt]}
        for k, name in enumerate(JOINT_SLOTS):
            expected = coords[name] if name in present else torch.zeros(3)
            assert torch.equal(slots[fmt][0, 1, k], expected), (fmt, name)


def test_greedy_decoding_reads_words_only_not_motion_codes():
    """The VQ arm's vocabulary ends in motion codes; a caption or rationale is decoded over the words alone."""
    vocab = sk.WordVocab(["describe : a person waves <eos>"])
    n_words = len(vocab)

    def dec(prefix, ids):  # the highest logit on a motion code, the next on "waves", then "<eos>"
        logits = torch.zeros(ids.shape[0], ids.shape[1], n_words + 4)
        logits[..., n_words + 2], logits[..., vocab.stoi["<eos>"]] = 9.0, 1.0
        logits[:, :, vocab.stoi["waves"]] = torch.where(ids[:, -2:-1] == vocab.stoi["waves"], 0.0, 5.0)
        return logits

    out = sk.generate(dec, torch.zeros(2, 1, 4), vocab.encode(["describe :"] * 2, 2), vocab, 5)
    assert out == ["waves", "waves"]
