"""GaRA mechanism on tiny inputs: the functional LM forward, the generated norm-constrained LoRA, the zero-shot data."""

from __future__ import annotations

import numpy as np
import torch

from models import gara
from models.common.graphs import write_tag_fixture
from models.common.lm import TinyLM
from models.common.tables import read_table


def _lm(d=16, layers=2):
    torch.manual_seed(0)
    return TinyLM(len(gara.ALPHABET), d, layers, 2, 40).eval()


def test_functional_forward_matches_the_lm_and_applies_delta_to_wq_wv():
    lm = _lm()
    ids = torch.randint(1, len(gara.ALPHABET), (3, 12))
    with torch.no_grad():
        assert torch.allclose(gara.lm_hidden(lm, ids), lm.body(ids), atol=1e-5)
        # a delta shared by the batch equals editing W_q and W_v of the module itself
        d = 16
        dq = [torch.randn(d, d) * 0.1 for _ in range(2)]
        dv = [torch.randn(d, d) * 0.1 for _ in range(2)]
        got = gara.lm_hidden(lm, ids, [x.expand(3, -1, -1) for x in dq], [x.expand(3, -1, -1) for x in dv])
        for i, layer in enumerate(lm.body.blocks.layers):
            layer.self_attn.in_proj_weight[:d] += dq[i]
            layer.self_attn.in_proj_weight[2 * d :] += dv[i]
        assert torch.allclose(got, lm.body(ids), atol=1e-5)


def test_soft_prefix_changes_only_through_attention():
    lm = _lm()
    ids = torch.randint(1, len(gara.ALPHABET), (2, 8))
    with torch.no_grad():
        h = gara.lm_hidden(lm, ids, prefix=torch.zeros(2, 3, 16) + 0.5)
    assert h.shape == (2, 11, 16)


def test_generated_lora_is_low_rank_and_norm_constrained(tmp_path):
    p = gara.Params(n_train_graphs=2, n_val_graphs=1, n_test_graphs=1, nodes_train=(12, 16), nodes_test=(12, 16),
                    text_encoder="hashed", lm_width=16, lm_layers=2, hidden=8, rank=2, rho=0.05, alpha=50.0)
    gara.prepare(p, tmp_path)
    qb = gara.Queries(tmp_path, p)
    qs = qb.where("train")[:5].tolist()
    in_dim = qb.query(qs[0])["graph"].x.shape[1]
    torch.manual_seed(0)
    for rho in (0.05, float("inf")):
        net = gara.Generated(gara.GraphReader(in_dim, 8), 16, 2, 2, 50.0, rho)
        dq, dv, before, after = net.deltas(qb.graph_batch(qs), qb.batch(qs)["task"])
        assert dq[0].shape == (5, 16, 16)
        assert int(torch.linalg.matrix_rank(dq[0][0])) <= 2
        if np.isfinite(rho):
            assert (after <= rho * (1 + 1e-4)).all()
            small = before <= rho
            assert torch.allclose(after[small], before[small])
            assert torch.allclose(after[~small], torch.full_like(after[~small], rho), rtol=1e-4)
        else:
            assert torch.allclose(after, before)


def test_methods_read_the_lm_in_groups_with_each_network_s_own_logits(tmp_path):
    """Methods.forward runs the frozen LM once per (prompt, injection) group; each network's rows equal its own
    pass over the batch (as `answer_logits` per network)."""
    p = gara.Params(n_train_graphs=2, n_val_graphs=1, n_test_graphs=1, nodes_train=(12, 16), nodes_test=(12, 16),
                    text_encoder="hashed", lm_width=16, lm_layers=2, lm_heads=2, hidden=8, rank=2, n_seeds=2,
                    prompt_chars=40, text_chars=40)
    gara.prepare(p, tmp_path)
    qb = gara.Queries(tmp_path, p)
    qs = qb.where("train")[:5].tolist()
    lm = gara.TinyLM(len(gara.ALPHABET), 16, 2, 2, 41).eval()
    methods = gara.Methods(p, qb.query(qs[0])["graph"].x.shape[1], lm)
    gb, batch = qb.graph_batch(qs), qb.batch(qs)
    with torch.no_grad():
        logits, norms = methods(gb, batch)
        assert list(logits) == list(methods.nets) and set(norms) == {"gara_0", "gara_1", "no_norm_0", "no_norm_1"}
        for name, net in methods.nets.items():
            if isinstance(net, gara.Generated):
                dq, dv, *_ = net.deltas(gb, batch["task"])
                alone = gara.answer_logits(lm, batch, "prompt", batch["valid"], dq, dv)
            elif isinstance(net, gara.SoftPrompt):
                alone = gara.answer_logits(lm, batch, "prompt", batch["valid"], prefix=net(gb, batch["task"]))
            else:
                alone = gara.answer_logits(lm, batch, "graph_text", batch["valid"], *net.deltas(len(qs)))
            assert logits[name].shape == (5, p.max_labels) and torch.allclose(logits[name], alone, atol=1e-5), name


def test_zero_shot_split_and_query_views(tmp_path):
    p = gara.Params(n_train_graphs=3, n_val_graphs=1, n_test_graphs=2, nodes_train=(20, 30), nodes_test=(20, 30),
                    text_encoder="hashed", ego_max=10)
    gara.prepare(p, tmp_path)
    nodes, graphs = read_table(tmp_path / "nodes.parquet"), read_table(tmp_path / "graphs.parquet")
    split = dict(zip(graphs["graph_id"], graphs["split"], strict=True))
    seen = {t for g, t in zip(nodes["graph_id"], nodes["topic_name"], strict=True) if split[g] == "train"}
    unseen = {t for g, t in zip(nodes["graph_id"], nodes["topic_name"], strict=True) if split[g] == "test"}
    assert seen <= set(p.train_topics) and not seen & unseen
    assert "karate" in set(graphs["family"]) and graphs["n_nodes"][graphs["family"] == "karate"][0] == 34
    qb = gara.Queries(tmp_path, p)
    q = int(qb.where("test", "karate")[3])
    item = qb.query(q)
    assert item["graph"].num_nodes <= 10
    assert np.allclose(item["graph"].x[0, :384].numpy(), qb.emb[q].numpy())  # centre node first
    cands = qb.candidates(q)
    assert cands[item["answer"]] == qb.topic[q]
    prompt = "".join(gara.ALPHABET[i] for i in item["prompt"])
    assert prompt.startswith(qb.text[q]) and prompt.endswith("?") and f"({gara.LETTERS[item['answer']]})" in prompt
    assert len(item["graph_text"]) <= p.text_chars
    # test_queries = 0 (every profile's setting) scores every node of every zero-shot graph
    n_test = int(graphs["n_nodes"][graphs["split"] == "test"].sum())
    assert len(qb.where("test")) == n_test
    assert sum(len(qb.where("test", f)) for f in set(graphs["family"][graphs["split"] == "test"])) == n_test


def test_folder_loader_on_a_ten_node_fixture(tmp_path):
    write_tag_fixture(tmp_path / "tr", n=10, topics=("music", "law"))
    write_tag_fixture(tmp_path / "te", n=10, topics=("ocean", "botany", "finance"), seed=1)
    p = gara.Params(dataset="folder", train_dir=str(tmp_path / "tr"), test_dirs=[str(tmp_path / "te")],
                    text_encoder="hashed", max_labels=2)
    out = tmp_path / "data"
    out.mkdir()
    gara.prepare(p, out)
    graphs = read_table(out / "graphs.parquet")
    assert list(graphs["split"]) == ["train", "test"] and list(graphs["n_nodes"]) == [10, 10]
    qb = gara.Queries(out, p)
    for q in qb.where("test"):
        cands = qb.candidates(int(q))
        assert len(cands) == 2 and qb.topic[int(q)] in cands  # 3 labels cut to max_labels, truth kept


def _tiny(tmp_path, **kw):
    p = gara.Params(n_train_graphs=2, n_val_graphs=1, n_test_graphs=1, nodes_train=(12, 16), nodes_test=(12, 16),
                    text_encoder="hashed", lm_width=16, lm_layers=2, lm_heads=2, hidden=8, rank=2,
                    prompt_chars=40, text_chars=40, **kw)
    gara.prepare(p, tmp_path)
    return p, gara.Queries(tmp_path, p)


def test_generated_b_starts_at_zero_so_gara_starts_at_the_frozen_lm(tmp_path):
    p, qb = _tiny(tmp_path)
    qs = qb.where("train")[:6].tolist()
    gb, batch = qb.graph_batch(qs), qb.batch(qs)
    lm = gara.TinyLM(len(gara.ALPHABET), 16, 2, 2, 41).eval()
    torch.manual_seed(0)
    net = gara.Generated(gara.GraphReader(gb.x.shape[1], 8), 16, 2, 2, 8.0, 1.0)
    with torch.no_grad():
        dq, dv, before, _ = net.deltas(gb, batch["task"])
        assert float(before.abs().max()) == 0.0
        assert torch.allclose(gara.answer_logits(lm, batch, "prompt", batch["valid"], dq, dv),
                              gara.answer_logits(lm, batch, "prompt", batch["valid"]))
    # ... yet B gets a gradient through the learned base A_0 (not the vanishing one of B = A = 0)
    dq, dv, *_ = net.deltas(gb, batch["task"])
    F = torch.nn.functional
    F.cross_entropy(gara.answer_logits(lm, batch, "prompt", batch["valid"], dq, dv), batch["answer"]).backward()
    assert float(net.gen[2].weight.grad.view(2, 2, 2, 32, -1)[:, :, 1].norm()) > 0


def test_weight_decay_keeps_the_projected_generator_from_growing(tmp_path):
    """Above rho the projected dW is invariant to B's scale, so its gradient never shrinks B and Adam's steps only
    grow it; weight decay (the same for every arm) bounds it."""
    p, qb = _tiny(tmp_path)
    qs = qb.where("train")[:8].tolist()
    gb, batch = qb.graph_batch(qs), qb.batch(qs)
    lm = gara.TinyLM(len(gara.ALPHABET), 16, 2, 2, 41).eval().requires_grad_(False)
    grown = {}
    for wd in (0.0, 1.0):
        torch.manual_seed(0)
        net = gara.Generated(gara.GraphReader(gb.x.shape[1], 8), 16, 2, 2, 8.0, 0.05)
        opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=wd)
        for _ in range(60):
            dq, dv, before, after = net.deltas(gb, batch["task"])
            loss = torch.nn.functional.cross_entropy(gara.answer_logits(lm, batch, "prompt", batch["valid"], dq, dv),
                                                     batch["answer"])
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert float(after.detach().max()) <= 0.05 * (1 + 1e-4)
        grown[wd] = float(before.detach().mean())
    assert grown[1.0] < 0.5 * grown[0.0], grown
