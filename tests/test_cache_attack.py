"""CacheAttack's mechanism on tiny inputs: the cache's serving rule, the mitigations, the search, the data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import cache_attack as ca
from models.common.lm import BPETokenizer, info_nce, train_bpe
from models.common.tables import read_table


def _params(**kw) -> ca.Params:
    base = dict(n_intents=4, paraphrases=6, n_pairs=40, max_false_hit=0.05,
                tau_sweep=[0.7, 0.9], population=6, generations=5, max_words=4, victim_encoder="hashed")
    return ca.Params(**(base | kw))


def _unit(*rows) -> np.ndarray:
    x = np.asarray(rows, dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_serve_top1_threshold_and_lexical_check():
    keys = _unit([1, 0, 0], [0, 1, 0])
    queries = _unit([1, 0.1, 0], [0.5, 0.5, 0.7], [0.1, 1, 0])
    assert ca.serve(queries, keys, 0.9).tolist() == [0, -1, 1]  # the middle query is below tau for both keys
    lexical = (["check my balance", "x", "open my card"], ["check balance now", "close the account"], 0.3)
    # query 0 shares {check, balance} with key 0 (Jaccard 2/3): served; query 2 shares nothing with key 1: refused
    assert ca.serve(queries, keys, 0.9, lexical).tolist() == [0, -1, -1]


def test_rotation_mitigation_is_a_negative_control():
    rng = np.random.default_rng(0)
    keys, queries = _unit(*rng.standard_normal((20, 8))), _unit(*rng.standard_normal((30, 8)))
    rot = np.linalg.qr(rng.standard_normal((8, 8)))[0]
    for tau in (0.2, 0.5, 0.8):
        assert np.array_equal(ca.serve(queries, keys, tau), ca.serve(queries @ rot, keys @ rot, tau))


def test_hijack_rates_attacker_first_and_no_insertion_on_hit():
    # intents 0 and 1, one warm key and two victims each; the attack targets intent 0
    q = {"role": np.array(["warm", "victim", "victim", "warm", "victim", "victim"]),
         "intent_id": np.array([0, 0, 0, 1, 1, 1]), "text": np.array(["w0", "v0", "v0b", "w1", "v1", "v1b"])}
    keys = _unit([1, 0, 0], [0.9, 0.1, 0.4], [0.8, 0.2, 0.5], [0, 1, 0], [0, 1, 0.1], [0, 1, 0.2])
    emb = {"keys": keys, "close": _unit([0.85, 0.15, 0.45])[0], "onto_w1": _unit([0, 1, 0.01])[0]}
    # the attack sits next to intent 0's victims; intent 0's own warm key is absent (attacker first)
    assert ca.hijack_rates(emb, q, {0: "close"}, 0.95, None).tolist() == [1.0]
    # an attack query that already hits intent 1's warm key is served, not inserted: nothing hijacked
    assert ca.hijack_rates(emb, q, {0: "onto_w1"}, 0.95, None).tolist() == [0.0]
    assert ca.benign_rates(keys, q, 0.8, None) == (1.0, 0.0)  # every victim served its own intent's key
    assert ca.benign_rates(keys, q, 0.95, None) == (0.5, 0.0)  # intent 0's victims (cos 0.91, 0.83) now miss


def test_genetic_search_keeps_payload_counts_queries_and_never_regresses():
    p = _params()
    pool = ["alpha", "beta", "gamma", "delta", "bank"]
    score = lambda texts: np.array([t.split().count("bank") - 0.1 * len(t.split()) for t in texts])  # noqa: E731
    log: list[float] = []
    best, queries = ca.genetic_search(score, "PAY LOAD", ["alpha beta"], pool, p, np.random.default_rng(0), log)
    assert best.startswith("PAY LOAD ") and 1 <= len(best.split()) - 2 <= p.max_words
    assert queries == p.population * p.generations
    assert all(b >= a for a, b in zip(log, log[1:], strict=False))  # elitism: the best never gets worse
    assert score([best])[0] > score(["PAY LOAD alpha beta"])[0]  # it improved on its seed
    rand = ca.random_search(score, "PAY LOAD", ["alpha beta"], pool, queries, p, np.random.default_rng(0))
    assert rand.startswith("PAY LOAD ")


def test_random_and_genetic_search_start_from_the_same_seeds():
    """Random search scores the genetic search's initial population first (same rng state -> same seeds), so with
    a budget of one population it can never do worse than the genetic search's first generation."""
    p = _params(population=6, generations=1)
    pool = ["alpha", "beta", "gamma", "delta", "bank"]
    guesses = ["how do i check my bank", "bank balance check"]
    seen: list[list[str]] = []

    def score(texts):
        seen.append(list(texts))
        return np.array([t.split().count("bank") - 0.1 * len(t.split()) for t in texts])

    ca.genetic_search(score, "PAY", guesses, pool, p, np.random.default_rng(3))
    ca.random_search(score, "PAY", guesses, pool, p.population, p, np.random.default_rng(3))
    assert seen[0] == seen[1]  # identical candidate lists at the same budget and seed
    assert seen[0][0] == "PAY how do i check"  # the first guess (truncated to max_words) is a seed of both
    init = ca.initial_population(guesses, pool, p, np.random.default_rng(3))
    assert [" ".join(g) for g in init[:2]] == ["how do i check", "bank balance check"]
    assert len(init) == p.population and all(1 <= len(s) <= p.max_words for s in init)


def test_prepare_roles_and_no_victim_text_in_public_data(tmp_path):
    p = _params(n_intents=6, paraphrases=8, n_pairs=200)
    ca.prepare(p, tmp_path)
    q = read_table(tmp_path / "queries.parquet")
    for intent in set(q["intent"]):
        roles = q["role"][q["intent"] == intent]
        assert (roles == "warm").sum() == 2 and (roles == "guess").sum() == 3 and (roles == "victim").sum() == 3
        assert len(set(q["text"][q["intent"] == intent])) == 8  # distinct paraphrases
    assert "banking" in set(q["domain"])
    pairs = read_table(tmp_path / "pairs.parquet")
    assert not set(q["text"][q["role"] == "victim"]) & (set(pairs["a"]) | set(pairs["b"]))


def test_qqp_loader_on_fixture(tmp_path):
    rows = ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            "0\t1\t2\tHow do I open a bank account?\tHow can I open a bank account?\t1",
            "1\t2\t3\tHow can I open a bank account?\tWhat is needed to open a bank account?\t1",
            "2\t4\t5\tWhat is python?\tWhat is a snake?\t0",
            "3\t6\t7\tHow to learn python?\tBest way to learn python?\t1",
            "4\t8\t9\tWhy is the sky blue?\tWhy is the sea blue?\t0"]
    path = tmp_path / "train.tsv"
    path.write_text("\n".join(rows) + "\n")
    intents, texts = ca.load_qqp(path, 5)
    assert [len(t) for t in texts] == [3, 2]  # two duplicate components, largest first
    assert intents[0][1] == "banking" and intents[1][1] == "qqp"


def test_bpe_round_trip_and_info_nce():
    texts = ["the cat sat on the mat", "the dog sat on the log"] * 5
    merges = train_bpe(texts, 10)
    tok, chars = BPETokenizer("".join(sorted(set("".join(texts)))), merges), BPETokenizer("acdefghilmnogst ", [])
    assert tok.decode(tok.encode(texts[0])) == texts[0]
    assert len(tok.encode(texts[0])) < len(chars.encode(texts[0])) == len(texts[0])
    a = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    assert info_nce(a, a, 0.05) < info_nce(a, a.roll(1, 0), 0.05)


def _tiny_sentence_model(folder):
    """A random 3-layer BERT saved as a sentence-transformers folder (safetensors): the on-disk format of BGE/E5."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = "how do i open a bank account the my card is lost reset password what".split()
    (folder / "hf").mkdir(parents=True)
    (folder / "hf" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    BertTokenizerFast(vocab_file=str(folder / "hf" / "vocab.txt")).save_pretrained(folder / "hf")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=5 + len(words), hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(folder / "hf")
    word = Transformer(str(folder / "hf"))
    SentenceTransformer(modules=[word, Pooling(16, "cls")], device="cpu").save(str(folder / "st"))
    return folder / "st"


def test_local_victim_encoder_loads_a_saved_sentence_transformer(tmp_path):
    """Full profile: the victim embedder from a local path (never downloaded), here a tiny random checkpoint."""
    path = _tiny_sentence_model(tmp_path)
    assert (path / "modules.json").exists() and list(path.glob("*.safetensors"))
    st = ca.load_sentence_model(str(path))
    texts = ["how do i open a bank account", "my card is lost"]
    e1 = st.encode(texts, normalize_embeddings=True)
    assert e1.shape == (2, 16) and np.allclose(np.linalg.norm(e1, axis=1), 1, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="modules.json"):
        ca.load_sentence_model(str(tmp_path / "hf"))


def test_surrogate_score_embeds_each_candidate_once():
    calls = []

    def embed(texts):
        calls.append(list(texts))
        return ca._hashed(texts, 0)

    score = ca._surrogate_score(embed, ["how do i check my card", "check card"])
    a = score(["pay x", "pay y", "pay x"])
    b = score(["pay y", "pay z"])
    direct = (ca._hashed(["pay x", "pay y", "pay z"], 0) @ ca._hashed(["how do i check my card", "check card"], 0).T)
    assert np.allclose(a, direct.mean(1)[[0, 1, 0]], atol=1e-6) and np.allclose(b, direct.mean(1)[[1, 2]], atol=1e-6)
    assert calls[1:] == [["pay x", "pay y"], ["pay z"]]  # after the guesses: only unseen candidates


def test_claim_floors_and_context():
    claim = ca.PAPER.claim
    assert {c.left for c in claim.context} == {"method/tau_spearman"}
    guards = {c.name: c.guards for c in claim.premises}
    assert guards["transfer_1_off_floor"] == ("method/transfer_1",)
    assert guards["transfer_2_off_floor"] == ("method/transfer_2",)


def test_calibrated_tau_rejects_novel_intents():
    """Leave-intent-out: tau sits above every calibration query's similarity to other intents' keys, even where
    the top-1 key (its own intent's) is always right, so an empty grid start (0.30) is not chosen."""
    e = np.array([[1, 0, 0], [0, 1, 0], [0.8, 0.6, 0], [0.6, 0.8, 0]], np.float32)  # warm a, warm b, guess a, guess b
    q = {"role": np.array(["warm", "warm", "guess", "guess"]), "intent_id": np.array([0, 1, 0, 1])}
    assert ca.calibrate_tau(e, q, 0.05) == 0.61  # other-intent similarities are both 0.6


def test_e2_is_centred_on_the_public_queries(tmp_path):
    """E2 (the truncated encoder, CLS pooling) is centred on the public queries' mean before normalising: the shared
    direction that put every raw CLS pair near cosine 1 is gone. Centred vectors sum to zero over the public queries,
    so some pair of them has a negative cosine; unit norm is kept."""
    path = _tiny_sentence_model(tmp_path)
    p = _params(victim_encoder="local", victim_path=str(path))
    (tmp_path / "data").mkdir()
    ca.prepare(p, tmp_path / "data")
    d = ca._load(tmp_path / "data")
    fns = ca.embedders(p, d, ca._encoder(p, d["vocab"]))
    public = list(d["q"]["text"][d["q"]["role"] != "victim"])
    e2 = fns["e2"](public)
    assert e2.shape == (len(public), 16) and np.allclose(np.linalg.norm(e2, axis=1), 1, atol=1e-5)
    assert (e2 @ e2.T).min() < 0


def _tau_hashed(p: ca.Params, folder) -> float:
    """The operator's calibrated tau on the prepared corpus, embedded with the hashed stand-in for MiniLM."""
    ca.prepare(p, folder)
    q = read_table(folder / "queries.parquet")
    q = {"role": np.asarray(q["role"]), "intent_id": np.unique(np.asarray(q["intent"]), return_inverse=True)[1],
         "text": list(q["text"])}
    return ca.calibrate_tau(ca._hashed(q["text"], 1), q, p.max_false_hit)


def test_one_object_per_intent_spreads_intents_and_lowers_tau(tmp_path):
    """Every template intent has its own object while objects last (a banking intent always present); beyond them
    intents repeat objects but stay distinct. Verb-only siblings set the operator's tau: without them it is lower
    (seeded, hashed bag-of-words stand-in, smoke-sized corpus)."""
    n_obj = len({o for objs, _ in ca.DOMAINS.values() for o in objs})
    for seed in range(4):
        for n in (4, 12, n_obj):
            intents, _ = ca.template_corpus(_params(n_intents=n, seed=seed), np.random.default_rng(seed))
            assert len({name.split(" ", 1)[1] for name, _ in intents}) == n
            assert "banking" in {d for _, d in intents}
    intents, _ = ca.template_corpus(_params(n_intents=n_obj + 6), np.random.default_rng(0))
    assert len(set(intents)) == n_obj + 6
    old, _ = ca.template_corpus(_params(n_intents=n_obj, one_object_per_intent=False), np.random.default_rng(0))
    assert len({name.split(" ", 1)[1] for name, _ in old}) < n_obj  # the old draw: verb-only siblings
    taus = {True: [], False: []}
    for seed in range(3):
        for spread in taus:
            (tmp_path / f"{seed}{spread}").mkdir()
            p = _params(n_intents=n_obj, paraphrases=12, n_pairs=8, one_object_per_intent=spread, seed=seed)
            taus[spread].append(_tau_hashed(p, tmp_path / f"{seed}{spread}"))
    assert all(a <= b for a, b in zip(taus[True], taus[False], strict=True)), taus
    assert np.mean(taus[True]) < np.mean(taus[False]) - 0.05, taus


def test_payloads_are_short_and_carry_no_domain_word():
    """The attacker's instruction: at most two words, none of them a word of any intent, template or filler."""
    corpus = set(ca.COMMON.split()) | ca.STOP
    for objs, acts in ca.DOMAINS.values():
        corpus |= {w for x in objs + acts for w in x.split()}
    corpus |= {w for syn in ca.SYNONYMS.values() for x in syn for w in x.split()}
    corpus |= {w for t in ca.TEMPLATES + ca.PREFIXES + ca.SUFFIXES for w in t.split()}
    for payload in ca.PAYLOADS:
        assert 1 <= len(payload.split()) <= 2 and not set(payload.split()) & corpus, payload
