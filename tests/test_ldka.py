"""LDKA mechanism: protocols, the look-alike knob, margins, PML weights, curvature, unbiased KD, decoupling, loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from models import ldka as m


def test_protocols():
    assert m.protocol_steps("4-2", 8) == [[1, 2, 3, 4], [5, 6], [7, 8]]
    assert m.protocol_steps("6-1", 8) == [[1, 2, 3, 4, 5, 6], [7], [8]]
    assert m.protocol_steps("4-4", 8) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert len(m.protocol_steps("15-1", 20)) == 6


def test_lookalike_knob():
    p = m.Params(lookalike=1.0, gap=0.6)
    old, new = m.class_look(1, p), m.class_look(5, p)
    assert old[0] == new[0] and np.allclose(old[1], new[1]) and new[2] - old[2] == pytest.approx(0.6)
    far = m.class_look(5, m.Params(lookalike=0.0))
    assert np.abs(far[1] - old[1]).max() > 0.3


def test_render_labels_every_object_pixel():
    img, mask = m.render_scene(np.random.default_rng(0), m.Params(max_objects=3))
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8 and mask.max() <= 8 and (mask > 0).any()


def test_pixel_margin_known_value():
    logits = torch.tensor([1.0, 3.0, 2.0, 9.0]).view(1, 4, 1, 1)
    assert m.pixel_margin(logits, torch.tensor([[[1]]]), 3).item() == pytest.approx(1.0)  # class 3 not yet seen
    assert m.pixel_margin(logits, torch.tensor([[[0]]]), 3).item() == pytest.approx(-2.0)


def test_pml_weights():
    margin = torch.tensor([[[-1.0, 0.0, 2.0, 5.0]]])
    assert torch.allclose(m.pml_weights(margin, 0.0), torch.ones_like(margin))
    w = m.pml_weights(margin, 1.0)
    assert w.mean().item() == pytest.approx(1.0)
    assert (w.flatten().diff() < 0).all()  # lower margin -> more weight


class Square(nn.Module):
    """z_0 = 0.5 f_0^2, z_1 = 0: margin of class 0 is 0.5 f_0^2, second derivative 1 along f_0."""

    def forward(self, f):
        return torch.cat([0.5 * f[:, :1] ** 2, torch.zeros_like(f[:, :1])], 1)


def test_skd_curvature_known_values():
    f = torch.tensor([1.5, -0.3, 0.7]).view(1, 3, 1, 1)
    y = torch.zeros(1, 1, 1, dtype=torch.long)
    # m = 0.5 f0^2 along u = e0: second difference eps^2 = 0.01, first 2 eps f0 = 0.3 -> (0.01 / 0.3)^2 = 1/900
    assert m.skd_curvature(Square(), f, y, 2, 0.1).item() == pytest.approx(1 / 900, rel=1e-3)
    assert m.skd_curvature(Square(), f, y, 2, 0.2).item() == pytest.approx(4 / 900, rel=1e-3)  # (eps m'' / 2m')^2
    linear = nn.Conv2d(3, 2, 1)
    assert m.skd_curvature(linear, f, y, 2, 0.1).item() == pytest.approx(0.0, abs=1e-6)


def test_skd_curvature_is_invariant_to_the_logit_scale():
    """The spec's raw [.]^2 / eps^4 grows as the logits' scale squared (and a flat head minimises it); the
    normalised term does not move when the head's logits are scaled, so shrinking them cannot lower it."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.Conv2d(6, 6, 1), nn.GELU(), nn.Conv2d(6, 4, 1)).double()
    f, y = torch.randn(2, 6, 5, 5, dtype=torch.float64), torch.randint(0, 4, (2, 5, 5))
    base = m.skd_curvature(head, f, y, 4, 0.1)
    assert 0 < base.item() < 0.1
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    scaled = m.skd_curvature(lambda h: scale * head(h), f, y, 4, 0.1)
    assert scaled.item() == pytest.approx(base.item(), rel=1e-9)
    (grad,) = torch.autograd.grad(scaled, scale)
    assert abs(grad.item()) * 3.0 < 1e-9 * base.item()  # no gradient towards a flatter (smaller-logit) head


def test_unbiased_kd():
    old = torch.randn(2, 5, 3, 3)
    assert m.unbiased_kd(old, old, 5, 5).item() == pytest.approx(0.0, abs=1e-6)
    # the new model moves the old model's background mass onto a new class: not penalised
    old_bg = torch.full((1, 3, 1, 1), -10.0)
    old_bg[:, 0] = 10.0
    new = torch.full((1, 4, 1, 1), -10.0)
    new[:, 3] = 10.0
    assert m.unbiased_kd(new, old_bg, 3, 4).item() == pytest.approx(0.0, abs=1e-4)
    plain = torch.nn.functional.kl_div(new[:, :3].log_softmax(1), old_bg.softmax(1), reduction="batchmean")
    assert plain.item() > 1.0


def test_mad_loss_and_competition():
    f = torch.zeros(1, 2, 1, 2)
    f[0, 0, 0, 0], f[0, 1, 0, 1] = 1.0, 1.0  # pixel 0 (class 0) along e0, pixel 1 (class 1) along e1
    y = torch.tensor([[[0, 1]]])
    comp = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    orthogonal = torch.eye(2)
    assert m.mad_loss(f, y, orthogonal, comp).item() == pytest.approx(0.0)
    same = torch.ones(2, 2)
    assert m.mad_loss(f, y, same, comp).item() == pytest.approx(1.0)  # cos(w0, w1) = 1, both directions, / 2
    assert m.mad_loss(f, y, same, torch.zeros(2, 2)).item() == 0.0
    logits = torch.tensor([[[[2.0, 0.0]], [[0.0, 2.0]]]])  # (1, 2, 1, 2)
    stats, count = m.competition_stats(logits, y, 2)
    assert torch.allclose(count, torch.ones(2)) and torch.allclose(stats.sum(1), torch.ones(2))
    assert stats[0, 0] > stats[0, 1]


def test_mad_loss_does_not_grow_with_the_number_of_classes():
    """Identical classifier vectors competing uniformly: every row's weighted cosine is 1, so the loss is 1 for any
    number of classes (the spec's plain sum would be n)."""
    for n in (3, 6, 9):
        comp = (torch.ones(n, n) - torch.eye(n)) / (n - 1)
        f, y = torch.randn(1, 4, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long)  # one class present: no prototype pair
        assert m.mad_loss(f, y, torch.ones(n, 4), comp).item() == pytest.approx(1.0)


def _fixture_pair(img_path, mask_path, value):
    from PIL import Image

    img_path.parent.mkdir(parents=True, exist_ok=True)
    mask_path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((20, 30, 3), 100, np.uint8)).save(img_path)
    mask = np.zeros((20, 30), np.uint8)
    mask[5:15, 5:20], mask[0, 0] = value, 255
    Image.fromarray(mask).save(mask_path)


def test_voc_loader(tmp_path):
    names = ["2007_000001", "2007_000002", "2007_000003"]
    for i, n in enumerate(names):
        _fixture_pair(tmp_path / "JPEGImages" / f"{n}.jpg", tmp_path / "SegmentationClassAug" / f"{n}.png", i + 1)
    sets = tmp_path / "ImageSets" / "Segmentation"
    sets.mkdir(parents=True)
    (sets / "train_aug.txt").write_text("\n".join(names[:2]))
    (sets / "val.txt").write_text(names[2])
    scenes, pools = m.load_voc(tmp_path, 16)
    assert pools == ["train", "train", "test"]
    assert scenes[0][0].shape == (16, 16, 3) and set(np.unique(scenes[2][1])) == {0, 3}  # 255 -> background


def test_ade20k_loader(tmp_path):
    for i, split in enumerate(["training", "training", "validation"]):
        _fixture_pair(tmp_path / "images" / split / f"ADE_{i}.jpg", tmp_path / "annotations" / split / f"ADE_{i}.png",
                      i + 10)
    scenes, pools = m.load_ade20k(tmp_path, 8)
    assert pools == ["train", "train", "test"] and scenes[1][1].max() == 11 and scenes[0][0].shape == (8, 8, 3)


def test_deeplabv3_shapes_and_a_torchvision_format_backbone_checkpoint(tmp_path):
    """Full profile: DeepLabv3-ResNet (output stride 16, ASPP) and its ImageNet backbone from a local checkpoint in
    torchvision's format (a state dict with fc.*), here a tiny random one, as .pth and as .safetensors."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = m.DeepLabV3(3, depth=50, width=4).eval()
    assert sum(len(getattr(net, f"layer{i}")) for i in range(1, 5)) == 16  # ResNet-50: 3 + 4 + 6 + 3
    logits, f = net(torch.randn(2, 3, 64, 64))
    assert logits.shape == (2, 4, 64, 64) and f.shape == (2, 256, 64, 64)
    assert net.layer4[0].conv2.stride == (1, 1) and net.layer4[1].conv2.dilation == (2, 2)  # output stride 16
    donor = m.DeepLabV3(3, depth=50, width=4)
    state = {k: v for k, v in donor.state_dict().items() if k.startswith(("conv1.", "bn1.", "layer"))}
    state |= {"fc.weight": torch.randn(10, 128), "fc.bias": torch.zeros(10)}  # torchvision's classifier: dropped
    torch.save(state, tmp_path / "resnet50.pth")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "resnet50.safetensors"))
    for name in ("resnet50.pth", "resnet50.safetensors"):
        fresh = m.DeepLabV3(3, depth=50, width=4)
        m.load_backbone(fresh, tmp_path / name)
        assert torch.equal(fresh.layer3[2].conv2.weight, donor.layer3[2].conv2.weight)
        assert not torch.equal(fresh.project[0].weight, donor.project[0].weight)  # ASPP stays freshly initialised
    with pytest.raises(ValueError, match="ResNet-101"):
        m.load_backbone(m.DeepLabV3(3, depth=101, width=4), tmp_path / "resnet50.pth")
    p = m.Params(arch="deeplabv3", backbone_depth=50, width=4, backbone_weights=str(tmp_path / "resnet50.pth"))
    assert torch.equal(m.segmenter(p).conv1.weight, donor.conv1.weight)


def test_grids_need_equal_selection_effort():
    p = m.Params(arms=["base", "ldka"], grid={"lambda_kd": [1, 5, 25], "lambda_skd": [0, 10, 100]})
    assert m.candidates(p, "base") == [1, 5, 25] and m.candidates(p, "ldka") == [0, 10, 100]
    assert m.candidates(m.Params(arms=["base", "finetune"], grid={"lambda_kd": [1, 5]}), "finetune") == [None]
    assert set(m.net_names(p)) == {f"{a}_c{k}_s{s}" for a in ("base", "ldka") for k in range(3) for s in range(2)}
    with pytest.raises(ValueError, match="equal selection effort"):
        m.Params(arms=["base", "ldka"], grid={"lambda_kd": [1, 5, 25], "lambda_skd": [0, 10]})
    with pytest.raises(ValueError, match="equal selection effort"):
        m.Params(arms=["base", "ldka"], grid={"lambda_kd": [1, 5]})  # LDKA's own weight must be tuned as well


def _tiny(tmp_path):
    """A tiny world and the saved networks, untrained (each candidate its own random init)."""
    from models.common.lockstep import LockStep

    p = m.Params(n_train=12, n_val=6, n_test=6, n_seeds=1, width=4, arms=["base", "ldka"],
                 grid={"lambda_kd": [1, 5, 25], "lambda_skd": [0, 10, 100]})
    m.prepare(p, tmp_path)
    torch.manual_seed(0)
    first = LockStep({"s0": m.UNet(4, 8)})
    final = LockStep({name: m.UNet(4, 8) for name in m.net_names(p)})
    for net in final.nets.values():  # distinct predictions per candidate: shift the running statistics
        for bn in (mod for mod in net.modules() if isinstance(mod, nn.BatchNorm2d)):
            bn.running_mean.normal_(0, 0.5)
    from tasks.context import EvalContext, TrainContext

    saver = TrainContext(p, tmp_path, tmp_path)  # the networks as `fit` saves them: the first step's and the last's
    saver.save_network("4-2_step0", first)
    saver.save_network(f"4-2_step{len(m.protocol_steps('4-2', p.n_classes)) - 1}", final)
    ctx = EvalContext(p, tmp_path, tmp_path, tmp_path)
    with torch.no_grad():
        x = m._load(tmp_path, p)
        preds = {n: {pool: net.eval()(x[f"x_{pool}"])[0].argmax(1) for pool in ("val", "test")}
                 for n, net in final.nets.items()}
    return p, ctx, preds


def _relabel(tmp_path, pool, masks):
    from models.common.tables import read_table, write_table

    imgs, table = read_table(tmp_path / "images.parquet"), read_table(tmp_path / "masks.parquet")
    mask = table["mask"].copy()
    mask[imgs["pool"] == pool] = masks.reshape(len(masks), -1).numpy().astype(np.uint8)
    write_table(tmp_path / "masks.parquet", {"img_id": table["img_id"], "mask": mask})


def test_selection_reads_the_validation_split_not_the_test_split(tmp_path):
    p, ctx, preds = _tiny(tmp_path)
    # validation labels = candidate 2's predictions: the selection must keep lambda 25 (base) and 100 (LDKA)
    _relabel(tmp_path, "val", preds["base_c2_s0"]["val"])
    assert m.evaluate(ctx)["detail/base/chosen_lambda_kd"] == 25
    _relabel(tmp_path, "val", preds["ldka_c2_s0"]["val"])
    out = m.evaluate(ctx)
    assert out["detail/ldka/chosen_lambda_skd"] == 100 and out["method/val_miou"] == pytest.approx(1.0)
    # test labels = candidate 0's predictions (test mIoU 1 for it): the choice stays with validation ...
    _relabel(tmp_path, "test", preds["ldka_c0_s0"]["test"])
    again = m.evaluate(ctx)
    assert again["detail/ldka/chosen_lambda_skd"] == 100 and again["method/all_miou"] < 1.0
    # ... and the premise metric reads the lambda_skd = 0 candidate, whichever was chosen
    assert "detail/ldka_lambda0/forgetting" in again and "detail/step0_old_miou" in again


def test_prepare_writes_disjoint_validation_split(tmp_path):
    from models.common.tables import read_table

    m.prepare(m.Params(n_train=10, n_val=4, n_test=3), tmp_path)
    pools = read_table(tmp_path / "images.parquet")["pool"]
    assert [(pools == k).sum() for k in ("train", "val", "test")] == [10, 4, 3]


def test_step_losses_equal_with_a_shared_first_step_model():
    """At step 1 every candidate of a seed distils from the same first-step model, whose forward is computed once:
    the loss of every network equals its loss with an old model of its own (a copy of the same weights)."""
    import types

    from models.common.lockstep import LockStep

    p = m.Params(n_seeds=2, width=4, arms=["base", "ldka"], grid={"lambda_kd": [1, 5], "lambda_skd": [0, 10]})
    names = m.net_names(p)
    torch.manual_seed(0)
    first = {s: m.UNet(4, 8).eval().requires_grad_(False) for s in range(2)}
    nets = {name: m.UNet(4, 8) for name in names}
    b = {"x": torch.rand(8, 3, 16, 16), "y": torch.randint(0, 7, (8, 16, 16)), "who": torch.arange(8) % 2}
    b["y_full"] = b["y"]
    ctx = types.SimpleNamespace(all_reduce_sum=lambda t: t)
    out = {}
    for shared in (True, False):
        old = {n: first[s] if shared else m._copy(first[s], p).eval().requires_grad_(False)
               for n, (_, _, s) in names.items()}
        comp = {n: torch.full((7, 7), float("nan")) for n in names}
        torch.manual_seed(1)  # the SKD feature noise
        step_fn = m._step_fn(ctx, p, 1, 7, 5, 4, old, comp, names)
        out[shared] = step_fn(types.SimpleNamespace(module=LockStep(nets)), b, 0)[1]
    assert out[True].keys() == out[False].keys() and len(out[True]) > len(names)
    for k in out[True]:
        assert out[True][k] == pytest.approx(out[False][k], rel=1e-6, abs=1e-7), k


def test_incremental_steps_train_at_step_lr(tmp_path):
    """The first step's engine gets `lr`; every incremental step's fresh AdamW gets `step_lr` (unset: `lr`), the
    same rate for every arm and candidate, since they share one engine per step."""
    import types

    seen_lrs = {}

    def run(step_lr):
        p = m.Params(n_train=24, n_val=4, n_test=4, n_seeds=1, width=2, images_per_step=8, batch_size=4,
                     arms=["base", "ldka"], grid={"lambda_kd": [1, 5], "lambda_skd": [0, 10]}, lr=3e-3,
                     step_lr=step_lr)
        calls = []

        def engine(model, lr, arms=None, **schedule):
            calls.append((lr, sorted(arms), schedule.get("steps")))
            return model

        ctx = types.SimpleNamespace(params=p, data_dir=tmp_path, progress=lambda msg: None, engine=engine,
                                    fit=lambda *a, **k: None)
        m.prepare(p, tmp_path)
        m.train(ctx)
        return calls

    seen_lrs["set"], seen_lrs["unset"] = run(0.02), run(None)
    networks = sorted(m.net_names(m.Params(n_seeds=1, arms=["base", "ldka"],
                                           grid={"lambda_kd": [1, 5], "lambda_skd": [0, 10]})))
    assert [lr for lr, _, _ in seen_lrs["set"]] == [3e-3, 0.02, 0.02]  # protocol 4-2: base step, then two increments
    assert all(arms == networks for _, arms, _ in seen_lrs["set"][1:])  # both arms, every candidate, one rate
    assert [lr for lr, _, _ in seen_lrs["unset"]] == [3e-3] * 3
    with pytest.raises(ValueError):
        m.Params(step_lr=0.0)
