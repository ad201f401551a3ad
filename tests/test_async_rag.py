"""Async RAG's mechanism on tiny inputs: the KB and questions, the training sequences, the traces' labels, the
server on its simulated clock (exact declared costs, independent of real compute), and the real-data loaders on
fixtures."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models import async_rag as ar


def _params(**kw) -> ar.Params:
    base = dict(n_entities=20, n_questions=40, n_test=4, encoder="hashed", layers=1, d_model=32, lm_steps=1,
                head_steps=1, max_answer_tokens=8, retrieval_jitter=0.0)
    return ar.Params(**(base | kw))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = _params()
    out = tmp_path_factory.mktemp("async_rag")
    ar.prepare(p, out)
    return p, ar._load(out)


def test_kb_answers_are_the_gold_facts_in_order(data):
    _, d = data
    kb = d["kb"]
    assert len(set(kb["passage"])) == len(kb["passage"])
    for it in d["items"]:
        gold = it["gold"]
        assert it["answer"] == " ".join(kb["passage"][f] for f in gold)  # the answer is the facts, in order
        if kb["relation"][gold[1]] in ("in_country", "released"):  # a chain: hop 2's subject is hop 1's object
            assert kb["subject"][gold[1]] == kb["object"][gold[0]]
        words = it["answer"].split()
        for at, f in it["needs"]:
            assert words[at] == kb["object"][f]  # the need sits exactly at the fact's object token
    assert {it["split"] for it in d["items"]} == {"train", "test"}
    assert len({it["question"] for it in d["items"]}) == len(d["items"])


def test_build_sequence_puts_each_passage_before_its_fact(data):
    p, d = data
    it = next(x for x in d["items"] if x["split"] == "train")
    vocab = d["vocab"]
    for seed in range(20):
        full = p.model_copy(update={"docless_frac": 0.0, "doc_rate": 1.0, "distractor_rate": 0.0})
        seq, mask = ar.build_sequence(it, d["docs"], full, np.random.default_rng(seed))
        assert seq.count(-1) == 1  # the "<a>" slot
        assert [t for t, m in zip(seq, mask, strict=True) if m] == it["a"]  # the loss covers the answer, only it
        answer_positions = [i for i, m in enumerate(mask) if m]
        for at, f in it["needs"]:
            doc = d["docs"][f]
            start = next(i for i in range(len(seq)) if seq[i : i + len(doc)] == doc)
            assert start < answer_positions[at]  # inserted before the object it supports
        none = p.model_copy(update={"docless_frac": 1.0})
        seq, mask = ar.build_sequence(it, d["docs"], none, np.random.default_rng(seed))
        assert vocab.stoi["<doc>"] not in seq and len(seq) == len(it["q"]) + 1 + len(it["a"])


def test_features_and_trace_labels(data):
    p, d = data
    h, ent = torch.randn(5, 32), torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    px, qx = ar.features(h, ent, 2)
    assert px.shape == (40,) and torch.equal(px[-8:], torch.tensor([0, 0, 0, 0, 0, 0.1, 0.2, 0.3]))
    assert torch.allclose(qx, h[:3].mean(0))
    lm = ar._lm(p, len(d["vocab"])).eval()
    test = [x for x in d["items"] if x["split"] == "test"]
    tr = ar.traces(lm, test, d["vocab"].stoi["<a>"], p)
    for k, it in enumerate(test):  # labels recomputed from the full entropy trajectory of the same context
        _, full = ar.lm_state(lm, it["q"] + [d["vocab"].stoi["<a>"]] + it["a"])
        rows = (tr["item"] == k).nonzero()[:, 0]
        for r in rows.tolist():
            t = int(tr["pos"][r])
            assert tr["entropy"][r] == pytest.approx(float(full[t]), abs=1e-5)
            assert tr["label"][r] == float((full[t + 1 : t + 1 + p.delta] > p.theta).any())
        first_need = int(tr["need"][rows[0]])
        assert first_need == it["needs"][0][1] and int(tr["need"][rows[-1]]) in (-1, it["needs"][-1][1])


def test_lead_times_known_values():
    p = _params(delta=3, theta=1.0)
    ent = np.array([0.0, 0.0, 0.0, 2.0, 0.0, 0.0])  # one spike at position 3
    item, pos = np.zeros(6, int), np.arange(6)
    assert ar.lead_times(np.array([0, 0.9, 0, 0, 0, 0]), ent, item, pos, 0.5, p) == 2.0
    assert ar.lead_times(np.array([0.9, 0, 0, 0, 0, 0]), ent, item, pos, 0.5, p) == 3.0  # exactly Delta ahead
    assert ar.lead_times(np.array([0.9, 0, 0, 0, 0, 0]), ent, item, pos, 0.5, _params(delta=2)) == 0.0  # beyond
    assert ar.lead_times(ent, ent, item, pos, 1.0, p) == 0.0  # the current entropy fires only at the spike


def _untrained_server(p, d, l_r, embeddings=None):
    torch.manual_seed(0)
    lm, heads = ar._lm(p, len(d["vocab"])).eval(), ar.Heads(p.d_model).eval()
    with torch.no_grad():
        lm.body.tok.weight.zero_()  # uniform next-token distribution: every point is high-entropy, never "</a>"
    return ar.Server(p, d, lm, heads, retrieval_ms=l_r, embeddings=embeddings)


def test_servers_at_other_latencies_share_the_embeddings_and_serve_as_alone(data):
    """A server at another L_r reuses the texts the first embedded (MiniLM runs once a text) and serves exactly as
    a server with its own cache."""
    p, d = data
    it = next(x for x in d["items"] if x["split"] == "test")
    shared: dict = {}
    with torch.no_grad():
        _untrained_server(p, d, 20.0, shared).serve("sync_active", it, 0)
        second = _untrained_server(p, d, 80.0, shared)
        calls = []
        encode = second.encode
        second.encode = lambda texts: (calls.append(texts), encode(texts))[1]
        row = second.serve("sync_active", it, 0)
        assert shared and calls == []  # every text was embedded already
        assert row == _untrained_server(p, d, 80.0).serve("sync_active", it, 0)


def test_simulated_clock_charges_exactly_the_declared_costs(data):
    """Every arm's latency is the sum of its declared costs, to the last term: tokens decoded and prefilled,
    embeddings, retrievals waited for (a blocking one stalls L_r; one in flight only what decoding has not covered),
    and the gold-docs arm never retrieves."""
    p, d = data
    l_r = 20.0
    server = _untrained_server(p, d, l_r)
    it = next(x for x in d["items"] if x["split"] == "test")
    with torch.no_grad():
        r = {arm: server.serve(arm, it, 0) for arm in ar.ARMS}
    prefill = p.prefill_ms * (len(it["q"]) + 1)
    steps = p.max_answer_tokens  # never "</a>"
    approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-9)  # noqa: E731
    base = r["no_retrieval"]
    assert base["retrievals"] == 0 and base["embeds"] == 0 and base["stall_ms"] == 0
    assert base["ttft_ms"] == approx(prefill + p.decode_ms)
    assert base["latency_ms"] == approx(prefill + p.decode_ms * steps)
    gold = r["gold_docs"]
    gold_prefill = p.prefill_ms * sum(len(d["docs"][f]) for f in it["gold"])
    assert gold["retrievals"] == 0 and gold["stall_ms"] == 0
    assert gold["latency_ms"] == approx(gold_prefill + prefill + p.decode_ms * steps)
    docs = p.prefill_ms * sum(len(d["docs"][f]) for f in server.search_top(server.text_vec(it["question"]), p.top_k))
    single = r["sync_single"]
    assert single["retrievals"] == 1 and single["stall_ms"] == approx(l_r)  # a blocking retrieval: L_r, no less
    assert single["ttft_ms"] == approx(p.embed_ms + l_r + docs + prefill + p.decode_ms)
    assert single["latency_ms"] == approx(p.embed_ms + l_r + docs + prefill + p.decode_ms * steps)
    # active RAG: the question retrieval, then one blocking retrieval at every (uncertain) token, each L_r
    active = r["sync_active"]
    assert active["retrievals"] == 1 + steps and active["embeds"] == 1 + steps
    assert active["stall_ms"] == approx(l_r * (1 + steps))
    # heuristic async: the question's retrieval flies while the question is prefilled, so the stall at the first
    # (uncertain) token is L_r less the prefill, not L_r
    heur = r["heuristic_async"]
    assert heur["retrievals"] == 1 and heur["stall_ms"] == approx(l_r - prefill)
    meth = r["method"]  # its monitor embeds the latest sentence on the decode path: charged embed_ms each
    assert meth["latency_ms"] >= prefill + p.decode_ms * steps + p.embed_ms * meth["embeds"] + meth["stall_ms"]


def test_latency_is_the_declared_costs_not_the_machine(data, monkeypatch):
    """The same requests with MiniLM and the generator made slow for real (a 100 ms encode, 5 ms a forward pass):
    every arm's rows, latency and TTFT included, are identical to the fast run's: real compute is off the clock."""
    import time

    p, d = data
    it = next(x for x in d["items"] if x["split"] == "test")

    def rows(server):
        with torch.no_grad():
            return {arm: server.serve(arm, it, 0) for arm in ar.ARMS}

    fast = rows(_untrained_server(p, d, 20.0))
    slow_server = _untrained_server(p, d, 20.0)
    encode, state = slow_server.encode, ar.lm_state
    slow_server.encode = lambda texts: (time.sleep(0.1), encode(texts))[1]
    monkeypatch.setattr(ar, "lm_state", lambda lm, ids: (time.sleep(0.005), state(lm, ids))[1])
    w = time.perf_counter()
    slow = rows(slow_server)
    assert time.perf_counter() - w > 0.5  # it was slow for real
    assert slow == fast
    assert fast["sync_active"]["embeds"] == 1 + p.max_answer_tokens  # encoded for real, charged embed_ms each


def test_retrieval_draws_come_from_seed_question_and_pass(data):
    """L_r draws come from (seed, question, pass): two servers give the same rows, another pass other stalls."""
    p, d = data
    p = p.model_copy(update={"retrieval_jitter": 0.25})
    it = next(x for x in d["items"] if x["split"] == "test")
    with torch.no_grad():
        a = _untrained_server(p, d, 20.0).serve("sync_active", it, 0, 0)
        b = _untrained_server(p, d, 20.0).serve("sync_active", it, 0, 0)
        c = _untrained_server(p, d, 20.0).serve("sync_active", it, 0, 1)
    assert a == b and a["stall_ms"] != c["stall_ms"]


def test_loaders_on_fixtures(tmp_path):
    hotpot = [{"_id": "a", "question": "Who wrote X?", "answer": "Ann Lee",
               "supporting_facts": [["X", 0], ["Ann Lee", 0]],
               "context": [["X", ["X is a book.", "It was written by Ann Lee."]], ["Ann Lee", ["Ann Lee is a writer."]],
                           ["Y", ["Y is unrelated."]]]}]
    (tmp_path / "hotpot.json").write_text(json.dumps(hotpot))
    musique = {"id": "m", "question": "Where is Z?", "answer": "Paris",
               "paragraphs": [{"idx": 0, "title": "Z", "paragraph_text": "Z is in Paris.", "is_supporting": True},
                              {"idx": 1, "title": "W", "paragraph_text": "W is elsewhere.", "is_supporting": False}]}
    (tmp_path / "musique.jsonl").write_text(json.dumps(musique) + "\n")
    (tmp_path / "passages.jsonl").write_text(json.dumps({"id": "p0", "text": "An extra passage."}) + "\n")
    kb, qa = ar.load_qa(_params(dataset="hotpotqa", dataset_path=str(tmp_path / "hotpot.json"), n_test=1,
                                passages_path=str(tmp_path / "passages.jsonl")))
    assert kb["passage"] == ["x is a book . it was written by ann lee .", "ann lee is a writer .",
                             "y is unrelated .", "an extra passage ."]
    assert qa["gold_fact_ids"] == ["0 1"] and qa["answer"] == ["ann lee ."] and qa["split"] == ["test"]
    kb, qa = ar.load_qa(_params(dataset="musique", dataset_path=str(tmp_path / "musique.jsonl"), n_test=1))
    assert kb["passage"] == ["z is in paris .", "w is elsewhere ."] and qa["gold_fact_ids"] == ["0"]
    for name, table in (("kb", kb), ("qa", qa)):  # the rest of the pipeline reads them like the synthetic tables
        ar.write_table(tmp_path / f"{name}.parquet", table)
    emb = ar._hashed(kb["passage"])
    ar.write_table(tmp_path / "passage_emb.parquet", {"fact_id": kb["fact_id"],
                                                       **{f"e_{i}": emb[:, i] for i in range(384)}})
    d = ar._load(tmp_path)
    assert d["items"][0]["objects"] == ["paris"] and d["groups"] == []
