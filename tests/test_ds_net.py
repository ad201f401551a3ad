"""DS-Net mechanism: box rules, the co-occurrence knobs of the generator, stream separation, SGGen recall."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from models import ds_net as m
from models.common.tables import read_table


def _params(**kw):
    base = {"n_train": 60, "n_test": 10, "steps": 1, "batch_images": 4, "n_seeds": 1, "width": 8}
    return m.Params(**(base | kw))


def test_box_rules_known_configurations():
    obj = np.array([0.4, 0.5, 0.2, 0.2])
    assert m.geometric_predicate(np.array([0.45, 0.3, 0.1, 0.2]), obj) == "on"  # bottom touches the top
    assert m.geometric_predicate(np.array([0.45, 0.1, 0.1, 0.1]), obj) == "above"
    assert m.geometric_predicate(np.array([0.45, 0.85, 0.1, 0.1]), obj) == "under"
    assert m.geometric_predicate(np.array([0.1, 0.55, 0.1, 0.1]), obj) == "left of"
    assert m.geometric_predicate(np.array([0.42, 0.52, 0.18, 0.18]), obj) == "in front of"


def _relations(tmp_path, **kw):
    p = _params(**kw)
    tmp_path.mkdir(parents=True, exist_ok=True)
    m.prepare(p, tmp_path)
    return read_table(tmp_path / "relations.parquet")


def test_tie_knob_controls_entanglement(tmp_path):
    tied = _relations(tmp_path / "a", tie=1.0, rho=1.0)
    sem = tied["sem_predicate"] > 0
    assert sem.any()
    for s, g in zip(tied["sem_predicate"][sem], tied["geo_predicate"][sem], strict=True):
        assert m.PREDICATES[s] in m.TIED[m.PREDICATES[g]]  # every interaction sits on its tied geometry
    free = _relations(tmp_path / "b", tie=0.0, rho=1.0)
    sem = free["sem_predicate"] > 0
    mismatched = [m.PREDICATES[s] not in m.TIED.get(m.PREDICATES[g], ()) for s, g in
                  zip(free["sem_predicate"][sem], free["geo_predicate"][sem], strict=True)]
    assert np.mean(mismatched) > 0.5


def test_rho_and_salience(tmp_path):
    none = _relations(tmp_path / "a", rho=0.0)
    assert (none["sem_predicate"] == 0).all() and (none["predicate"] == none["geo_predicate"]).all()
    rel = _relations(tmp_path / "b", rho=1.0, p_sem=0.5, n_train=200)
    sem = rel["sem_predicate"] > 0
    assert 0.4 < rel["salient"][sem].mean() < 0.6
    # salient pairs are labelled with the interaction, the others keep the geometric label
    assert (rel["predicate"][rel["salient"]] == rel["sem_predicate"][rel["salient"]]).all()
    assert (rel["predicate"][~rel["salient"]] == rel["geo_predicate"][~rel["salient"]]).all()
    # the salient cue is stronger along the interaction's prototype than the weak one
    norm = np.linalg.norm(rel["cue"], axis=1)
    assert norm[rel["salient"]].mean() > norm[sem & ~rel["salient"]].mean()


def test_streams_are_separate_without_fusion():
    torch.manual_seed(0)
    net = m.DSNet(12, 8, None, rounds=0).eval()
    b = {"s_in": torch.randn(5, m.APP + 4), "o_in": torch.randn(5, m.APP + 4), "cue": torch.randn(5, m.APP),
         "spatial": torch.randn(5, m.N_SPATIAL)}
    base = net(b)[0]
    cue_changed = net(b | {"cue": torch.randn(5, m.APP)})[0]
    space_changed = net(b | {"spatial": torch.randn(5, m.N_SPATIAL)})[0]
    geo, sem = slice(1, 1 + len(m.GEO)), slice(1 + len(m.GEO), None)
    assert torch.allclose(base[:, geo], cue_changed[:, geo])
    assert not torch.allclose(base[:, sem], cue_changed[:, sem])
    assert torch.allclose(base[:, sem], space_changed[:, sem])
    assert not torch.allclose(base[:, geo], space_changed[:, geo])
    fused = m.DSNet(12, 8, None, rounds=2).eval()
    assert not torch.allclose(fused(b)[0][:, geo], fused(b | {"cue": torch.randn(5, m.APP)})[0][:, geo])


def test_sggen_recall_known_values():
    rows = {"image": np.array([0, 0]), "sp": np.array([0, 1]), "op": np.array([1, 0])}
    gt = {"image": np.array([0]), "subj": np.array([0]), "obj": np.array([1]), "predicate": np.array([7]),
          "s_cls": np.array([3]), "o_cls": np.array([5]), "iou": {0: np.eye(2)}}
    scores = {"pred": np.array([7, 1]), "pred_score": np.array([0.9, 0.8]), "s_lab": np.array([3, 5]),
              "o_lab": np.array([5, 3]), "s_score": np.ones(2), "o_score": np.ones(2)}
    assert m.sggen_recall(rows, scores, gt)["R50"] == 1.0
    assert m.sggen_recall(rows, scores | {"pred": np.array([1, 7])}, gt)["mR100"] == 0.0  # wrong predicate
    assert m.sggen_recall(rows, scores | {"s_lab": np.array([4, 5])}, gt)["R100"] == 0.0  # wrong subject class
    assert m.sggen_recall(rows, scores, gt | {"iou": {0: 0.4 * np.eye(2)}})["R100"] == 0.0  # boxes off
    # graph constraint with K=1: the other pair outranks the right one, so it is not recalled
    ranked = scores | {"pred_score": np.array([0.1, 0.8])}
    assert m.sggen_recall(rows, ranked, gt, ks=(1,))["R1"] == 0.0


def test_frequency_bias_is_a_log_distribution():
    rows = {"s_cls": np.array([0, 0, 1]), "o_cls": np.array([1, 1, 0]), "label": np.array([3, 3, 0])}
    fb = m.frequency_bias(rows, 2)
    assert np.allclose(np.exp(fb).sum(-1), 1.0)
    assert fb[0, 1].argmax() == 3


def test_diagnostics_overprediction_and_cosine():
    rows = {"label": np.array([1, 7, 7])}  # on, riding, riding
    logits = np.zeros((3, len(m.PREDICATES)))
    logits[:, 1] = 5.0  # everything predicted "on"
    hidden = np.ones((3, 4))
    d = m.diagnostics(rows, logits, hidden)
    assert d["geo_overpred"] == 1.0 and d["entangle_cos"] == pytest.approx(1.0)


def _vg150_fixture(folder, predicates=(4, 1)):
    """Two images in the VG150 layout (Xu et al. 2017): boxes at longest side 1024 as (cx, cy, w, h), 1-based
    classes and predicates, relationships indexing boxes globally, split 0 train / 2 test."""
    folder.mkdir(parents=True, exist_ok=True)
    with h5py.File(folder / "VG-SGG-with-attri.h5", "w") as f:
        f["split"] = np.array([0, 2])
        f["img_to_first_box"], f["img_to_last_box"] = np.array([0, 2]), np.array([1, 4])
        f["img_to_first_rel"], f["img_to_last_rel"] = np.array([0, 1]), np.array([0, 1])
        f["boxes_1024"] = np.array([[50, 50, 100, 100], [200, 150, 100, 100], [100, 100, 50, 50],
                                    [500, 500, 500, 500], [300, 600, 200, 100]])
        f["labels"] = np.array([[1], [2], [3], [1], [2]])
        f["relationships"] = np.array([[0, 1], [3, 2]])
        f["predicates"] = np.array([[predicates[0]], [predicates[1]]])
    (folder / "VG-SGG-dicts-with-attri.json").write_text(json.dumps(
        {"idx_to_label": {str(i): f"c{i}" for i in range(1, 4)},
         "idx_to_predicate": {"1": "above", "2": "riding", "3": "on", "4": "holding", "5": "near"}}))
    (folder / "image_data.json").write_text(json.dumps([{"width": 1024, "height": 1024}, {"width": 512,
                                                                                          "height": 256}]))
    return folder


def test_vg150_loader_on_fixture(tmp_path):
    p = _params(source="vg150", geometric_predicates=["on", "above", "near"])
    images, splits, voc = m.load_vg150(_vg150_fixture(tmp_path), p)
    assert splits == ["train", "test"] and [len(img[0]) for img in images] == [2, 3]
    # predicates renumbered from the data: background, geometric (VG order), then the rest
    assert voc.predicates == ("__background__", "above", "on", "near", "riding", "holding") and voc.n_geo == 3
    assert voc.n_classes == 3 and voc.n_sem == 2
    s, o, label, geo, sem, _, _ = images[0][3][0]
    assert (s, o, label, geo, sem) == (0, 1, 5, 0, 5)  # holding: non-geometric
    assert images[1][3][0][:5] == (1, 0, 1, 1, 0)  # above (VG 1), geometric; box indices relative to the image
    assert np.allclose(images[0][1][1], [150 / 1024, 100 / 1024, 100 / 1024, 100 / 1024])
    # a 512 x 256 image: boxes_1024 scaled by 1024 / 512, then normalised per axis
    assert np.allclose(images[1][1][0], [(50 - 12.5) / 512, (50 - 12.5) / 256, 25 / 512, 25 / 256])
    with pytest.raises(ValueError, match="not in"):
        m.load_vg150(tmp_path, _params(source="vg150", geometric_predicates=["beside"]))


def test_vg150_features_carry_no_predicate_label(tmp_path):
    p = _params(source="vg150", geometric_predicates=["on", "above", "near"])
    a, _, _ = m.load_vg150(_vg150_fixture(tmp_path / "a", predicates=(4, 1)), p)
    b, _, _ = m.load_vg150(_vg150_fixture(tmp_path / "b", predicates=(2, 5)), p)
    for img_a, img_b in zip(a, b, strict=True):
        assert np.array_equal(img_a[2], img_b[2])  # appearance
        for rel_a, rel_b in zip(img_a[3], img_b[3], strict=True):
            assert rel_a[2] != rel_b[2] and np.array_equal(rel_a[6], rel_b[6])  # other label, same union cue


def test_vg150_prepare_sizes_the_heads_from_the_data(tmp_path):
    p = _params(source="vg150", vg_dir=str(_vg150_fixture(tmp_path / "vg")), n_distractors=1,
                geometric_predicates=["on", "above", "near"])
    (tmp_path / "data").mkdir()  # the stage empties and creates it
    m.prepare(p, tmp_path / "data")
    voc = m.vocab(tmp_path / "data", p)
    assert len(voc.predicates) == 6 and voc.n_classes == 3
    rows = m.pair_rows(tmp_path / "data", "train", p)
    fb = m.frequency_bias(rows, voc.n_classes, len(voc.predicates))
    assert fb.shape == (4, 4, 6)
    model = m.build(p, fb, voc)
    logits, ls, _, _ = model.nets["ds_fb_s0"]({k: torch.from_numpy(rows[k]) for k in m.FEATS})
    assert logits.shape == (len(rows["label"]), 6) and ls.shape[1] == 4  # 3 classes + background
    assert set(rows["s_cls"]) <= {0, 1, 2, 3}  # distractor proposals: class 3


def test_premises_compare_the_hosts_with_chance():
    premises = {c.name: c for c in m.PAPER.claim.premises}
    assert set(premises) == {"host_above_chance", "host_fb_above_chance"}
    assert all(c.right == "baseline/chance/mR100" and c.op == ">" for c in premises.values())
