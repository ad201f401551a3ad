"""WASH's mechanism on tiny inputs: green lists, the z statistic, the character alignment, averaging's TV drop."""

from __future__ import annotations

import numpy as np
import torch

from models import wash
from models.common.lm import BPETokenizer, TinyLM, train_bpe


def test_green_lists_exact_fraction_and_context_dependence():
    wm1 = wash.Watermark("kgw1", key=7, vocab=40, gamma=0.25, delta=2.0)
    ctx = np.arange(40)[:, None]
    g = wm1.green(ctx)
    assert (g.sum(1) == 10).all()  # exactly round(gamma V) per context
    assert len({tuple(row) for row in g}) > 30  # the list moves with the previous token
    assert not np.array_equal(g, wash.Watermark("kgw1", 8, 40, 0.25, 2.0).green(ctx))  # another key, another list
    uni = wash.Watermark("unigram", 7, 40, 0.25, 2.0).green(np.zeros((5, 0), np.int64))
    assert (uni == uni[0]).all()  # unigram: one fixed list
    kgw2 = wash.Watermark("kgw2", 7, 40, 0.25, 2.0)
    assert not np.array_equal(kgw2.green(np.array([[1, 2]])), kgw2.green(np.array([[3, 2]])))


def test_z_score_known_values():
    wm = wash.Watermark("kgw1", key=3, vocab=20, gamma=0.25, delta=2.0)
    ids = [0]
    for _ in range(40):  # always a green token
        ids.append(int(np.flatnonzero(wm.green(np.array([[ids[-1]]]))[0])[0]))
    t = 40
    assert np.isclose(wash.z_score(ids, wm), (t - 0.25 * t) / np.sqrt(t * 0.25 * 0.75))
    red = [0]
    for _ in range(40):
        red.append(int(np.flatnonzero(~wm.green(np.array([[red[-1]]]))[0])[0]))
    assert np.isclose(wash.z_score(red, wm), -0.25 * t / np.sqrt(t * 0.25 * 0.75))


def _provider(merges: int, seed: int, wm: bool = True) -> wash.Provider:
    torch.manual_seed(seed)
    text = ["the cat sat on the mat.", "a dog ran near the log."] * 4
    tok = BPETokenizer(wash.ALPHABET, train_bpe(text, merges))
    water = wash.Watermark("kgw1", seed, len(tok), 0.25, 2.5) if wm else None
    return wash.Provider(TinyLM(len(tok), 16, 1, 1, 33).eval(), tok, water, 32)


def test_alignment_is_exact_for_a_character_model():
    pr = _provider(0, 0)
    texts = ["the cat s", "a dog ran "]
    got = pr.char_probs(texts)
    direct = pr.probs([pr.tok.encode(t) for t in texts], 1)[:, 0]  # the char model's own next-token distribution
    assert torch.allclose(got, direct[:, [pr.tok.stoi[c] for c in wash.ALPHABET]], atol=1e-6)


class _WordLM(torch.nn.Module):
    """A token LM with a known character marginal: words drawn i.i.d. from WORDS, each emitted as its canonical
    BPE tokens after a space; contexts never seen in canonical data get a uniform distribution over the tokens of
    'a', 'b' and space. Its exact next-character distribution after ' ' + u is the word distribution given u."""

    WORDS = {"aba": 0.30, "abb": 0.20, "bab": 0.25, "ba": 0.15, "bba": 0.10}

    def __init__(self, tok: BPETokenizer):
        super().__init__()
        self.tok = tok
        self.can = {w: tuple(tok.stoi[t] for t in tok.tokens("x " + w)[1:]) for w in self.WORDS}
        self.allowed = [i for i, s in enumerate(tok.itos) if set(s) <= set("ab ")]

    def next_dist(self, hist: list[int]) -> torch.Tensor:
        first = torch.zeros(len(self.tok))
        for w, pw in self.WORDS.items():
            first[self.can[w][0]] += pw
        starts = [j for j, t in enumerate(hist) if self.tok.itos[t].startswith(" ")]
        if not starts:
            return first
        cur, p = tuple(hist[starts[-1] :]), torch.zeros(len(self.tok))
        for w, pw in self.WORDS.items():
            c = self.can[w]
            if c[: len(cur)] == cur:
                p += pw * first if len(c) == len(cur) else pw * torch.eye(len(self.tok))[c[len(cur)]]
        if p.sum() == 0:
            p[self.allowed] = 1.0
        return p / p.sum()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.full((*ids.shape, len(self.tok)), -1e9)
        for b in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                d = self.next_dist(ids[b, : j + 1].tolist())
                out[b, j] = torch.where(d > 0, d.log(), torch.tensor(-1e9))
        return out


def test_alignment_is_the_exact_character_marginal_on_a_hand_made_vocabulary():
    """Known values: ' ba' tokenises to [' b', 'a'] while the word 'bab' is the single token ' bab', so after ' ba'
    the next character is 'b' with 0.25 / 0.40 (the spec's one-token back-off gave {' ': 1.0}); ' a' is a token
    never seen canonically (the back-off gave NaN)."""
    tok = BPETokenizer(wash.ALPHABET, [("a", "b"), (" ", "b"), ("b", "a"), (" ", "a"), ("ab", "a"), (" b", "ab")])
    lm = _WordLM(tok)
    assert tok.tokens("x ba")[1:] == [" b", "a"] and tok.tokens("x bab")[1:] == [" bab"]
    pr = wash.Provider(lm, tok, None, 64)
    us = ["", "a", "ab", "b", "ba", "bb", "aba", "bab"]
    got = pr.char_probs(["ba aba " + u for u in us], watermark=False)
    assert torch.isfinite(got).all()
    for u, q in zip(us, got, strict=True):
        tot = sum(pw for w, pw in lm.WORDS.items() if w.startswith(u))
        exact = torch.zeros(len(wash.ALPHABET))
        for w, pw in lm.WORDS.items():
            if w.startswith(u):
                exact[wash.ALPHABET.index(" " if w == u else w[len(u)])] += pw / tot
        assert torch.allclose(q, exact, atol=1e-6), u
    ba = got[us.index("ba")]
    assert np.isclose(float(ba[wash.ALPHABET.index("b")]), 0.625) and np.isclose(float(ba[0 + 26]), 0.375)


def _sharp_provider(merges: int, seed: int) -> wash.Provider:
    """A random LM with peaked next-token distributions (embeddings of scale 1), watermarked."""
    pr = _provider(merges, seed)
    with torch.no_grad():
        pr.lm.body.tok.weight.normal_(0, 1)
    return pr


def test_aligned_marginal_of_one_provider_sums_to_one():
    """The kept hypotheses' next-character masses sum to 1 in every row at every step (no mass counted twice or
    lost beyond pruning's renormalisation), and the distribution is finite and non-negative."""
    pr = _sharp_provider(12, 5)
    beam = wash.CharBeam(pr, ["the cat.", "a dog ran."], watermark=True)
    for a, b in zip(" the cat sat on", " a dog sat near", strict=True):
        q = beam.mass()
        assert torch.allclose(q.sum(-1), torch.ones(2, dtype=torch.float64), atol=1e-5)
        assert (q >= 0).all() and torch.isfinite(q).all()
        beam.advance([wash.ALPHABET.index(a), wash.ALPHABET.index(b)])
    assert max(len([r for r in beam.rows if r == b]) for b in range(2)) <= beam.cap


def _brute_force(pr: wash.Provider, start: list[int], y: str, cache: dict) -> float:
    """P(the text after `start` begins with y): every token sequence whose string starts with y, counted once by
    recursion over the tokens that match y (watermarked, one forward pass per path, cached)."""

    def nxt(path: tuple[int, ...]) -> torch.Tensor:
        if path not in cache:
            cache[path] = pr.probs([list(path)], 1)[0, 0].double()
        return cache[path]

    def mass(path: tuple[int, ...], pos: int) -> float:
        if pos == len(y):
            return 1.0
        rest, p, total = y[pos:], nxt(path), 0.0
        for t, s in enumerate(pr.tok.itos):
            if len(s) >= len(rest) and s.startswith(rest):
                total += float(p[t])
            elif len(s) < len(rest) and rest.startswith(s):
                total += float(p[t]) * mass((*path, t), pos + len(s))
        return total

    return mass(tuple(start), 0)


def test_beam_with_a_huge_cap_equals_brute_force_enumeration():
    pr = _sharp_provider(12, 6)
    prompt, y = "the cat.", " the ca"
    beam = wash.CharBeam(pr, [prompt], watermark=True, cap=10**6, prune=0.0)
    for c in y:
        beam.advance([wash.ALPHABET.index(c)])
    assert len(beam.rows) > 2  # several segmentations alive
    start = pr.tok.encode(prompt)
    cache: dict[tuple[int, ...], torch.Tensor] = {}
    p_y = _brute_force(pr, start, y, cache)
    assert np.isclose(float(beam.logz[0]), np.log(p_y), atol=1e-5)
    nxt = np.array([_brute_force(pr, start, y + c, cache) for c in wash.ALPHABET])
    assert np.isclose(nxt.sum(), p_y, rtol=1e-5)
    assert np.allclose(beam.dist()[0].numpy(), nxt / nxt.sum(), atol=1e-5)


def test_averaging_independent_watermarks_shrinks_tv_to_the_clean_average():
    rng = np.random.default_rng(0)
    v, n, contexts = 30, 3, 200
    base = rng.standard_normal((1, contexts, v)) + 0.1 * rng.standard_normal((n, contexts, v))  # similar models
    logits = torch.from_numpy(base.astype(np.float32))  # (N, B, V) clean logits
    prev = rng.integers(v, size=(contexts, 1))
    marks = [wash.Watermark("kgw1", 100 + m, v, 0.25, 2.5) for m in range(n)]
    wm = torch.stack([(logits[m] + marks[m].bias(prev)).softmax(-1) for m in range(n)])  # (N, B, V)
    clean = logits.softmax(-1).mean(0)
    tv = lambda a: 0.5 * (a - clean).abs().sum(-1).mean()  # noqa: E731
    same_key = torch.stack([(logits[m] + marks[0].bias(prev)).softmax(-1) for m in range(n)]).mean(0)
    assert tv(wm.mean(0)) < 0.75 * tv(wm[0])  # independent keys: the biases average out
    assert tv(wm.mean(0)) < tv(same_key)  # a shared key would not


def test_generation_lengths_and_scrub():
    pr = _provider(12, 2)
    g = torch.Generator().manual_seed(0)
    outs = wash.generate_tokens(pr, ["the cat.", "a dog."], 10, g)
    assert [len(o) for o in outs] == [10, 10]
    hyb = wash.generate_wash([pr, _provider(0, 3)], ["the cat.", "a dog."], 7, g)
    assert [len(o) for o in hyb] == [7, 7] and all(set(o) <= set(wash.ALPHABET) for o in hyb)
    text = " ".join(["w"] * 1000)
    scrubbed = wash.scrub([text], ["x"], 0.3, np.random.default_rng(0))[0].split()
    assert 0.25 < scrubbed.count("x") / 1000 < 0.35


def test_c4_jsonl_loader_on_a_fixture(tmp_path):
    """Full profile: C4-style jsonl ({"text", "timestamp", "url"} per line), reduced to the providers' alphabet."""
    import json

    lines = [{"text": "The Cat sat.\nIt's 3 o'clock!", "timestamp": "2019-04-25", "url": "https://a"},
             {"text": "Second   doc. Ends here.", "url": "https://b"}]
    (tmp_path / "c4.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert wash.load_jsonl(tmp_path / "c4.jsonl") == ["the cat sat. it s o clock", "second doc. ends here."]


def test_counted_work_per_arm():
    """Counted work (LM forward passes, one per sequence row): WASH pays one pass per character for the character
    provider and one per new token path for a BPE provider, token-level sampling one pass per token, so a BPE
    provider pays fewer passes than characters."""
    chars, prompts = 9, ["the cat.", "a dog.", "some bird."]
    g = torch.Generator().manual_seed(0)
    provs = [_provider(0, 1), _provider(12, 2), _provider(24, 3)]
    start = wash.PASSES["rows"]
    wash.generate_wash(provs[:1], prompts, chars, g)  # characters: one path per row, one pass per character
    assert wash.PASSES["rows"] - start == chars * len(prompts)
    start = wash.PASSES["rows"]
    wash.generate_wash(provs, prompts, chars, g)  # BPE providers forward only the paths that took a new token
    assert chars * len(prompts) < wash.PASSES["rows"] - start <= (1 + 2 * 16) * chars * len(prompts)
    start = wash.PASSES["rows"]
    outs = wash.generate_tokens(provs[0], prompts, chars, g)  # characters: one token per character
    assert wash.PASSES["rows"] - start == chars * len(prompts) and all(len(o) == chars for o in outs)
    start = wash.PASSES["rows"]
    wash.generate_tokens(provs[2], prompts, chars, g)
    assert wash.PASSES["rows"] - start <= chars * len(prompts)


def test_entropy_rate_matches_the_sampled_sentences_log_probability():
    """The grammar's entropy per character equals -E[log P(sentence)] / E[characters + separator] on samples."""
    p = wash.Params(lexicon=60)
    rng = np.random.default_rng(0)
    lex = wash._lexicon(p, rng)
    prob = {c: dict(zip(words, w, strict=True)) for c, (words, w) in lex.items()}
    cls = {x: c for c, (words, _) in lex.items() for x in words}
    nll, chars = 0.0, 0
    for _ in range(4000):
        s = wash._sentence(lex, rng)
        nll -= np.log(1 / len(wash.TEMPLATES)) + sum(np.log(prob[cls[x]][x]) for x in s[:-1].split())
        chars += len(s) + 1
    assert abs(nll / chars - wash.entropy_rate(lex)) < 0.02 * wash.entropy_rate(lex)


def test_heldout_nats_per_char_scores_every_token_once_with_context():
    """A character LM: with text within one window the measure is the LM's plain next-token cross-entropy; with a
    longer text every token after the first is scored exactly once (its stride windows never double-count)."""
    pr = _provider(0, 4, wm=False)
    text = "the cat sat on the mat."
    ids = torch.tensor([pr.tok.encode(text)])
    with torch.no_grad():
        direct = float(pr.lm.loss(ids))
    assert np.isclose(wash.heldout_nats_per_char(pr.lm, pr.tok, text, 32), direct, atol=1e-5)
    long = "the cat sat on the mat. a dog ran near the log. " * 3
    seen = []
    lm = lambda ids: (seen.append(ids.shape[1]), torch.zeros(1, ids.shape[1], len(pr.tok)))[1]  # noqa: E731
    got = wash.heldout_nats_per_char(lm, pr.tok, long, 16)
    assert np.isclose(got, np.log(len(pr.tok)))  # uniform LM: ln V per character, whatever the windows
    assert sum(seen[:1]) + 8 * (len(seen) - 1) >= len(long) - 1 and max(seen) == 16


def test_unigram_level_and_claim_context():
    train = "aab " * 50
    assert np.isclose(wash.unigram_nats_per_char(train, "a"), -np.log(101 / (200 + 28)))
    context = {c.left for c in wash.PAPER.claim.context}
    assert context == {"method/passes_per_char", "method/tv"}  # a count and a triangle inequality: not evidence
    premises = {c.name: c for c in wash.PAPER.claim.premises}
    assert premises["reference_lm_learned"].guards == ("method/ppl",)
    assert premises["alignment_faithful"].guards == ("method/ppl",) and premises["alignment_faithful"].scale == 1.1
