"""CacheAttack: black-box key-collision attacks on semantic caches.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 16. Spec: ../shared/papers/cache_attack.md.

What it implements (function names in brackets):
- a GPTCache-style semantic cache: the top-1 key by cosine answers if its similarity >= tau, else the stub LLM answers
  and the query enters the cache; a query carrying the attacker's payload gets a response with "[HIJACK-MARKER]"
  [serve, hijack_rates, benign_rates];
- embedders: E1 MiniLM mean pooling (the victim), E2 MiniLM's first 3 layers with CLS pooling, E3 TF-IDF (1-2 grams)
  + TruncatedSVD, E4 a 2-layer transformer sentence encoder trained through DeepSpeed with in-batch InfoNCE on
  template paraphrase pairs [embedders, train]; E3 and E4 never see victim queries;
- CacheAttack: genetic search over a suffix s (<= max_words words from the guessed phrasings' words and common
  words) after the intact payload P, maximising the mean surrogate cosine to the attacker's guessed phrasings;
  mutations substitute / insert / delete, tournament selection, elitism; every scored candidate is one counted
  surrogate query [genetic_search];
- baselines: naive (payload + the first guessed phrasing verbatim), random search with the same query budget
  and the same seeds [random_search], and the same genetic search scored on E1 directly (white-box upper bound);
- agent: a tool-plan cache keyed by task descriptions (victim queries inside agent task wrappers); a hijack serves a
  marked tool call; the banking (finance) intents are reported separately [agent_rates];
- mitigations over the tau sweep: plain, lexical verification (content-word Jaccard >= 0.3 with the served key),
  and a secret random orthogonal rotation of the embeddings (negative control: cosine is rotation-invariant).

Deviations from the paper (choices the abstract left open):
- "Attacker first": for each attacked intent the cache holds the warm entries of every OTHER intent, and the attack
  query is submitted before any victim; if it already hits an entry it is not inserted (the attack fails).
- Both searches start from the same seeds: the guessed phrasings (half the population) plus random suffixes
  [initial_population]; random search then draws random suffixes from the same word pool up to the same budget.
- The official method's first stage, estimating the cache's threshold tau through response latency (hits return
  faster), is not implemented: the search maximises the surrogate cosine without a stopping threshold, and every
  cache is scored at the operator's calibrated tau. The claim text says so.
- The white-box reference (the genetic search scored on E1) runs in smoke too: its hit rate is the premise that
  some attack query can reach the victim cache's tau at all. It is a premise, not an arm, so it may search harder
  (its own population and generations) on the first `whitebox_intents` attacked intents (MiniLM scoring is the
  smoke profile's largest cost); it has no naive or random counterpart.
- Transfer parts are guarded by premises that some attack arm hijacks that cache at all (0 vs 0 is a floor).
- The tau Spearman is context: raising tau shrinks the benign and hijack hit sets of one cache together, so over a
  few tau points it is near-monotone by construction.
- The spec's "positive Spearman" is `method/tau_spearman > 0`; a constant curve (undefined Spearman) counts as 0.
- tau is set per embedder (their similarity scales differ); the values sit in params.yaml. The test profile uses a
  hashed bag-of-words stand-in for MiniLM (`victim_encoder: hashed`) so CI loads no model.
- Full: Quora Question Pairs, intents = connected components of duplicate pairs [load_qqp]; the victim E1/E2 is
  BGE-small from a local sentence-transformers folder [load_sentence_model] (no download; MiniLM in smoke).
- Payloads are two words, an imperative and the marker, with no word of any domain: the attacker words its
  instruction, and domain words ("wire details", "install update") or a longer payload pull the query away from the
  target intent (toward another one), which is the attacker's loss, not the cache's defence.
- Intents are distinct requests: each template intent has its own object while objects last (its action drawn at
  random). Intents that differ only in the verb on one object (check / cancel / open my savings account) are
  near-duplicates for any sentence embedder; they would set the operator's tau so high that the victims' own
  paraphrases barely reach each other, a cache with no locality left to attack.
- E2 is centred on the public queries' mean before normalising: MiniLM was trained with mean pooling, so its raw
  layer-3 CLS vectors share one dominant direction, every pair sits near cosine 1, and no tau separates intents
  (its cache served other intents' answers to most benign queries at any tau on the grid).
"""

from __future__ import annotations

import csv
import os
from functools import cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from scipy.stats import spearmanr

from models.common.lm import SentenceEncoder, WordVocab, info_nce
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

MARKER = "[HIJACK-MARKER]"
EMBEDDERS = ("e1", "e2", "e3", "e4")
ATTACKS = ("cacheattack", "naive", "random")
DOMAINS = {  # domain -> (objects, actions); an intent is one (action, object) pair
    "banking": (["account balance", "credit card", "savings account", "loan payment"],
                ["check", "cancel", "open", "change"]),
    "travel": (["flight", "hotel room", "train ticket", "rental car"], ["book", "cancel", "change", "track"]),
    "health": (["doctor appointment", "prescription", "insurance claim", "lab results"],
               ["book", "cancel", "check", "track"]),
    "coding": (["python script", "build error", "unit test", "database query"], ["fix", "check", "change", "find"]),
    "shopping": (["order", "package", "refund", "gift card"], ["track", "cancel", "check", "find"]),
    "home": (["thermostat", "alarm", "wifi password", "light schedule"], ["change", "check", "fix", "find"]),
}
SYNONYMS = {
    "check": ["check", "view", "see", "look up"], "cancel": ["cancel", "stop", "terminate", "call off"],
    "open": ["open", "create", "set up", "start"], "change": ["change", "update", "modify", "edit"],
    "book": ["book", "reserve", "schedule", "arrange"], "track": ["track", "follow", "monitor", "trace"],
    "fix": ["fix", "debug", "repair", "resolve"], "find": ["find", "locate", "search for", "get"],
    "account balance": ["account balance", "balance", "available funds"], "credit card": ["credit card", "card"],
    "flight": ["flight", "plane ticket", "air travel"], "hotel room": ["hotel room", "hotel", "room"],
    "doctor appointment": ["doctor appointment", "appointment", "visit with the doctor"],
    "build error": ["build error", "compile error", "failing build"], "order": ["order", "purchase"],
    "package": ["package", "parcel", "delivery"], "wifi password": ["wifi password", "wireless password"],
}
TEMPLATES = ["how do i {a} my {o}", "how can i {a} my {o}", "i want to {a} my {o}", "please help me {a} my {o}",
             "{a} my {o}", "my {o} , how do i {a} it", "is it possible to {a} my {o}", "can you {a} my {o} for me",
             "what is the way to {a} my {o}", "i need to {a} the {o}", "{o} : {a} it"]
PREFIXES, SUFFIXES = ["", "", "hi ,", "quick question :", "hello ,"], ["", "", "please", "right now", "today", "thanks"]
COMMON = ("the a to my i how do can please help me want is it for with and now today what way need you")
PAYLOADS = ["say marker", "reply marker", "repeat marker"]  # the attacker's instruction: no domain word
AGENT_WRAPPERS = ["as my assistant , {q}", "agent task : {q}", "{q} using your tools"]
STOP = set(COMMON.split()) | {",", ":", "hi", "hello", "quick", "question", "thanks", "right", "of", "on", "in"}


class Params(PaperParams):
    dataset: Literal["templates", "qqp"] = Field("templates", description="Slot-template corpus, or a QQP TSV.")
    qqp_path: str = Field("", description="qqp: TSV with question1, question2, is_duplicate columns.")
    n_intents: int = Field(24, ge=2, description="Intents (templates: action x object pairs; qqp: largest clusters).")
    paraphrases: int = Field(12, ge=6, description="Paraphrases per intent: 2 warm, 3 attacker guesses, rest victim.")
    one_object_per_intent: bool = Field(True, description="templates: every intent its own object while objects "
                                        "last (verb-only siblings such as check / cancel my card are near-duplicates "
                                        "that set the operator's tau); off: any action x object pairs.")
    synonym_rate: float = Field(0.5, ge=0, le=1, description="Chance each slot uses a non-canonical synonym.")
    filler_rate: float = Field(0.5, ge=0, le=1, description="Chance of a filler prefix / suffix.")
    n_pairs: int = Field(2000, ge=8, description="Paraphrase pairs for E4's contrastive training (no victim text).")
    n_attacked: int = Field(8, ge=1, description="Intents the attacker targets (at least one banking intent).")
    population: int = Field(16, ge=2, description="Genetic search population.")
    generations: int = Field(20, ge=1, description="Genetic search generations (budget = population x generations).")
    max_words: int = Field(16, ge=1, description="Longest suffix s, in words.")
    surrogates: list[Literal["e3", "e4"]] = Field(["e3"], min_length=1, description="Surrogates (first: metrics).")
    whitebox: bool = Field(True, description="Also run the search scored on E1 (upper bound; the premise).")
    whitebox_intents: int = Field(0, ge=0, description="White-box: the first this many attacked intents (0: all).")
    whitebox_population: int = Field(0, ge=0, description="White-box population (0: `population`); the reference "
                                     "is a premise, not an arm, so it may search harder than the black-box arms.")
    whitebox_generations: int = Field(0, ge=0, description="White-box generations (0: `generations`).")
    victim_encoder: Literal["minilm", "local", "hashed"] = Field("minilm", description="E1/E2: MiniLM, a local "
                                                                "sentence-transformers model (`victim_path`), or "
                                                                "hashed BoW (tests).")
    victim_path: str = Field("", description="local: folder of a saved sentence-transformers model (e.g. BGE or "
                                             "E5: modules.json, config.json, model.safetensors, tokenizer).")
    svd_dim: int = Field(128, ge=2, description="E3 TruncatedSVD components (capped by the corpus).")
    e4_layers: int = Field(2, ge=1)
    e4_dim: int = Field(64, ge=8, description="E4 width (4 heads when divisible, else 1).")
    e4_steps: int = Field(150, ge=1, description="E4 InfoNCE training steps.")
    e4_batch: int = Field(32, ge=2, description="Pairs per E4 step (in-batch negatives).")
    lr: float = Field(2e-3, gt=0)
    temperature: float = Field(0.05, gt=0, description="InfoNCE temperature.")
    max_false_hit: float = Field(0.05, gt=0, lt=1, description="Each cache's tau: the lowest with at most this "
                                 "false-hit rate on public calibration queries (the guesses, own intent left "
                                 "out), never victims.")
    tau_sweep: list[float] = Field(min_length=2, description="Taus of E1's trade-off curve.")
    jaccard: float = Field(0.3, ge=0, le=1, description="Lexical verification: content-word Jaccard threshold.")


# ---- data --------------------------------------------------------------------------------------------------
def _phrase(rng: np.random.Generator, action: str, obj: str, p: Params) -> str:
    pick = lambda w: SYNONYMS.get(w, [w])[rng.integers(1, len(SYNONYMS[w]))] \
        if w in SYNONYMS and rng.random() < p.synonym_rate else w  # noqa: E731
    text = TEMPLATES[rng.integers(len(TEMPLATES))].format(a=pick(action), o=pick(obj))
    if rng.random() < p.filler_rate:
        text = f"{PREFIXES[rng.integers(len(PREFIXES))]} {text} {SUFFIXES[rng.integers(len(SUFFIXES))]}"
    return " ".join(text.split())


def template_corpus(p: Params, rng: np.random.Generator) -> tuple[list[tuple[str, str, str]], list[list[str]]]:
    """Intents (name, domain, finance flag as domain) and their distinct paraphrases."""
    combos = [(d, a, o) for d, (objs, acts) in DOMAINS.items() for o in objs for a in acts]
    order = list(rng.permutation(len(combos)))
    if p.one_object_per_intent:  # each object once first (its action the first drawn), then the other pairs
        firsts: dict[str, int] = {}
        for i in order:
            firsts.setdefault(combos[i][2], i)
        head = set(firsts.values())
        order = list(firsts.values()) + [i for i in order if i not in head]
    chosen = [combos[i] for i in order[: p.n_intents]]
    if not any(d == "banking" for d, _, _ in chosen):  # the finance case study needs a banking intent
        chosen[-1] = next(combos[i] for i in order if combos[i][0] == "banking")
    intents, texts = [], []
    for d, a, o in chosen:
        seen: list[str] = [f"how do i {a} my {o}"]
        for _ in range(50 * p.paraphrases):
            if len(seen) == p.paraphrases:
                break
            t = _phrase(rng, a, o, p)
            seen += [t] if t not in seen else []
        intents.append((f"{a} {o}", d))
        texts.append(seen)
    return intents, texts


def load_qqp(path: Path, n_intents: int) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """QQP TSV: intents are connected components of duplicate pairs, largest first (ties by first question)."""
    import networkx as nx

    g = nx.Graph()
    with open(path, newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if row.get("is_duplicate", "0").strip() == "1":
                g.add_edge(row["question1"].strip().lower(), row["question2"].strip().lower())
    comps = sorted((sorted(c) for c in nx.connected_components(g)), key=lambda c: (-len(c), c[0]))[:n_intents]
    money = ("bank", "money", "invest", "loan", "credit", "pay")
    intents = [(c[0], "banking" if any(m in " ".join(c) for m in money) else "qqp") for c in comps]
    return intents, [list(c) for c in comps]


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    intents, texts = (template_corpus(p, rng) if p.dataset == "templates"
                      else load_qqp(input_path(p.qqp_path), p.n_intents))
    cols = {c: [] for c in ("query_id", "intent", "domain", "text", "role")}
    for (name, domain), paras in zip(intents, texts, strict=True):
        for j, t in enumerate(paras):
            role = "warm" if j < 2 else "guess" if j < 5 else "victim"
            for c, v in zip(cols, (len(cols["text"]), name, domain, t, role), strict=True):
                cols[c].append(v)
    write_table(out_dir / "queries.parquet", cols)
    write_table(out_dir / "payloads.parquet", {"payload_id": np.arange(len(PAYLOADS)), "text": PAYLOADS})
    victims = {t for t, r in zip(cols["text"], cols["role"], strict=True) if r == "victim"}
    public = [t for t, r in zip(cols["text"], cols["role"], strict=True) if r != "victim"]
    a, b = [], []
    for k in range(p.n_pairs):  # E4's pairs: two fresh paraphrases of one intent, never a victim query
        i = k % len(intents)
        pair = [_phrase(rng, *intents[i][0].split(" ", 1), p) if p.dataset == "templates"
                else public[rng.integers(len(public))] for _ in range(2)]
        if not victims & set(pair):
            a.append(pair[0])
            b.append(pair[1])
    write_table(out_dir / "pairs.parquet", {"a": a, "b": b})


def _load(data_dir: Path) -> dict:
    q = read_table(data_dir / "queries.parquet")
    pairs = read_table(data_dir / "pairs.parquet")
    public = list(q["text"][q["role"] != "victim"])
    vocab_texts = list(pairs["a"]) + list(pairs["b"]) + public
    return {"q": q, "pairs": pairs, "payloads": list(read_table(data_dir / "payloads.parquet")["text"]),
            "vocab": WordVocab(vocab_texts + PAYLOADS, extra=tuple(COMMON.split()))}


# ---- E4: a tiny sentence encoder trained with in-batch InfoNCE ------------------------------------------------
def _encoder(p: Params, vocab: WordVocab) -> SentenceEncoder:
    heads = 4 if p.e4_dim % 4 == 0 else 1
    return SentenceEncoder(len(vocab), p.e4_dim, p.e4_layers, heads, max_len=48)


def train(ctx) -> None:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    vocab, a, b = d["vocab"], d["pairs"]["a"], d["pairs"]["b"]
    model = _encoder(p, vocab)

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        idx = torch.randperm(len(a), generator=torch.Generator().manual_seed(p.seed * 7919 + step))[: p.e4_batch]
        return {"a": vocab.encode([a[i] for i in idx], 48), "b": vocab.encode([b[i] for i in idx], 48)}  # (B, 48)

    def step_fn(engine, batch, step):
        return info_nce(engine(batch["a"]), engine(batch["b"]), p.temperature), {}

    ctx.progress(f"E4: {sum(x.numel() for x in model.parameters())} parameters, {p.e4_steps} InfoNCE steps")
    ctx.fit("e4", ctx.engine(model, p.lr), step_fn, batch_fn, p.e4_steps)


# ---- embedders ----------------------------------------------------------------------------------------------
def _hashed(texts: list[str], seed: int, dim: int = 256) -> np.ndarray:
    """Test stand-in for MiniLM: random projection of word + bigram counts (locality without a model)."""
    out = np.zeros((len(texts), dim), np.float32)
    for i, t in enumerate(texts):
        w = t.split()
        for g in w + [" ".join(x) for x in zip(w, w[1:], strict=False)]:
            out[i] += np.random.default_rng([seed, *g.encode()]).standard_normal(dim).astype(np.float32)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def embedders(p: Params, d: dict, enc: SentenceEncoder) -> dict:
    """Embedder name -> texts -> (n, dim) L2-normalised; E3/E4 are fitted on public text only."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    public = list(d["q"]["text"][d["q"]["role"] != "victim"]) + list(d["pairs"]["a"])
    tfidf = TfidfVectorizer(ngram_range=(1, 2), token_pattern=r"[^ ]+").fit(public)
    svd = TruncatedSVD(min(p.svd_dim, len(tfidf.vocabulary_) - 1), random_state=p.seed).fit(tfidf.transform(public))
    norm = lambda x: x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-9)  # noqa: E731

    def e4(texts):
        with torch.no_grad():
            return enc(d["vocab"].encode(texts, 48)).numpy()

    out = {"e3": lambda texts: norm(svd.transform(tfidf.transform(texts))).astype(np.float32), "e4": e4}
    if p.victim_encoder == "hashed":
        return out | {"e1": lambda t: _hashed(t, 1), "e2": lambda t: _hashed(t, 2)}
    if p.victim_encoder == "local":
        st = load_sentence_model(p.victim_path)
        e1 = lambda texts: np.asarray(st.encode(texts, normalize_embeddings=True), np.float32)  # noqa: E731
    else:
        from models.common.text import encode_sentences, sentence_model

        st, e1 = sentence_model(), encode_sentences

    def cls3(texts: list[str]) -> np.ndarray:  # the victim's encoder truncated after 3 layers, CLS pooling, (n, d)
        batch = st.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            return st[0].auto_model(**batch, output_hidden_states=True).hidden_states[3][:, 0].numpy()

    # raw layer-3 CLS vectors share one dominant direction (a mean-pooled model never trained its CLS), so every pair
    # sits near cosine 1 and no tau separates intents; E2 is centred on the public queries' mean, fitted like E3
    mu = cls3(list(d["q"]["text"][d["q"]["role"] != "victim"])).mean(0)  # (d,)
    return out | {"e1": e1, "e2": lambda texts: norm(cls3(texts) - mu).astype(np.float32)}


@cache
def load_sentence_model(path: str):
    """A sentence-transformers model saved in a local folder (BGE, E5, ...): loaded offline, never downloaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    folder = input_path(path)
    if not (folder / "modules.json").exists():
        raise FileNotFoundError(f"{folder}: not a saved sentence-transformers model (no modules.json)")
    return SentenceTransformer(str(folder), device="cpu", local_files_only=True)


# ---- CacheAttack and its baselines ----------------------------------------------------------------------------
def genetic_search(score, payload: str, guesses: list[str], pool: list[str], p: Params, rng: np.random.Generator,
                   log: list | None = None) -> tuple[str, int]:
    """Maximise score(P + s) over suffixes s; returns the best query and the number of scored candidates."""
    text = lambda s: " ".join([payload, *s])  # noqa: E731
    pop = initial_population(guesses, pool, p, rng)
    fit = score([text(s) for s in pop])
    queries = len(pop)
    for _ in range(p.generations - 1):
        children = [pop[int(np.argmax(fit))]]  # elitism: the best survives
        while len(children) < p.population:
            i, j = rng.integers(len(pop), size=2)
            child = list(pop[i] if fit[i] >= fit[j] else pop[j])  # tournament of two
            op = rng.integers(3)
            if op == 0 or (op == 2 and len(child) == 1):  # substitute
                child[rng.integers(len(child))] = rng.choice(pool)
            elif op == 1 and len(child) < p.max_words:  # insert
                child.insert(int(rng.integers(len(child) + 1)), rng.choice(pool))
            elif op == 2:  # delete
                child.pop(int(rng.integers(len(child))))
            children.append(child)
        pop, fit = children, score([text(s) for s in children])
        queries += len(children)
        if log is not None:
            log.append(float(fit.max()))
    return text(pop[int(np.argmax(fit))]), queries


def initial_population(guesses: list[str], pool: list[str], p: Params, rng: np.random.Generator) -> list[list[str]]:
    """The seeds both searches start from: the guessed phrasings (up to half the population), then random
    suffixes from the pool."""
    pop = [g.split()[: p.max_words] for g in guesses][: p.population // 2]
    return pop + [random_suffix(pool, p, rng) for _ in range(p.population - len(pop))]


def random_suffix(pool: list[str], p: Params, rng: np.random.Generator) -> list[str]:
    return list(rng.choice(pool, size=rng.integers(1, p.max_words + 1)))


def random_search(score, payload: str, guesses: list[str], pool: list[str], budget: int, p: Params,
                  rng: np.random.Generator) -> str:
    """The same seeds as the genetic search (`initial_population`), then random suffixes up to the same budget."""
    seeds = initial_population(guesses, pool, p, rng)[:budget]
    cands = [" ".join([payload, *s]) for s in seeds + [random_suffix(pool, p, rng) for _ in range(budget - len(seeds))]]
    return cands[int(np.argmax(score(cands)))]


def _surrogate_score(embed, guesses: list[str]):
    """Mean cosine to the guesses, (n,); a candidate scored before (an elite, a repeated child) is not re-embedded."""
    target = embed(guesses)  # (G, dim)
    seen: dict[str, float] = {}

    def score(texts: list[str]) -> np.ndarray:
        new = [t for t in dict.fromkeys(texts) if t not in seen]
        if new:
            seen.update(zip(new, (embed(new) @ target.T).mean(1).tolist(), strict=True))
        return np.array([seen[t] for t in texts])

    return score


# ---- the cache, its metrics and mitigations -----------------------------------------------------------------------
def _content(t: str) -> set[str]:
    return {w for w in t.split() if w not in STOP}


def serve(q_emb: np.ndarray, k_emb: np.ndarray, tau: float, lexical: tuple | None = None) -> np.ndarray:
    """Index of the served key per query (-1 = miss). `lexical` = (query texts, key texts, threshold)."""
    sims = q_emb @ k_emb.T  # (Q, K)
    top = sims.argmax(1)
    hit = sims[np.arange(len(q_emb)), top] >= tau
    if lexical is not None:
        qt, kt, thr = lexical
        for i in np.flatnonzero(hit):
            a, b = _content(qt[i]), _content(kt[top[i]])
            hit[i] = len(a & b) / max(len(a | b), 1) >= thr
    return np.where(hit, top, -1)


def hijack_rates(emb: dict[str, np.ndarray], q: dict, attack: dict[int, str], tau: float, lexical: float | None,
                 wrap=None) -> np.ndarray:
    """Per attacked intent: share of its victims served the attacker's entry (cache = other intents' warm keys)."""
    texts = [wrap(i, t) for i, t in enumerate(q["text"])] if wrap else list(q["text"])
    rates = []
    for t, query in attack.items():
        keys = np.flatnonzero((q["role"] == "warm") & (q["intent_id"] != t))
        k_emb, k_txt = emb["keys"][keys], [texts[k] for k in keys]
        a_emb = emb[query][None]
        if serve(a_emb, k_emb, tau, ([query], k_txt, lexical) if lexical else None)[0] >= 0:
            rates.append(0.0)  # the attack query hit an existing entry: nothing was inserted
            continue
        victims = np.flatnonzero((q["role"] == "victim") & (q["intent_id"] == t))
        all_k = np.vstack([k_emb, a_emb])
        served = serve(emb["keys"][victims], all_k, tau,
                       ([texts[v] for v in victims], k_txt + [query], lexical) if lexical else None)
        rates.append(float((served == len(keys)).mean()))
    return np.asarray(rates)


def calibrate_tau(e: np.ndarray, q: dict, max_false: float) -> float:
    """The operator's tau: the lowest on a 0.01 grid at which at most max_false of the calibration queries would be
    served ANOTHER intent's entry were their own intent not cached yet (leave-intent-out: a novel query must miss;
    a cache holding the query's own intent would mask it, and the attack runs exactly while it is absent)."""
    keys, calib = np.flatnonzero(q["role"] == "warm"), np.flatnonzero(q["role"] == "guess")
    sims = e[calib] @ e[keys].T  # (G, K)
    other = np.where(q["intent_id"][keys][None, :] != q["intent_id"][calib][:, None], sims, -np.inf).max(1)  # (G,)
    for tau in np.arange(0.30, 1.0, 0.01):
        if (other >= tau).mean() <= max_false:
            return float(round(tau, 2))
    return 0.99


def benign_rates(e: np.ndarray, q: dict, tau: float, lexical: float | None) -> tuple[float, float]:
    """(correct-hit, false-hit) rates of all victim queries against the full warm cache."""
    keys, victims = np.flatnonzero(q["role"] == "warm"), np.flatnonzero(q["role"] == "victim")
    served = serve(e[victims], e[keys], tau,
                   ([q["text"][v] for v in victims], [q["text"][k] for k in keys], lexical) if lexical else None)
    hit = served >= 0
    correct = hit & (q["intent_id"][keys][np.maximum(served, 0)] == q["intent_id"][victims])
    return float(correct.mean()), float((hit & ~correct).mean())


# ---- evaluation -------------------------------------------------------------------------------------------------
def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    q = d["q"]
    names = list(dict.fromkeys(q["intent"]))
    q["intent_id"] = np.asarray([names.index(n) for n in q["intent"]])
    rng = np.random.default_rng(p.seed)
    domain = dict(zip(q["intent_id"], q["domain"], strict=False))
    banking = [i for i in range(len(names)) if domain[i] == "banking"]
    attacked = [int(i) for i in rng.permutation(len(names))[: p.n_attacked]]
    if not set(banking) & set(attacked):
        attacked[-1] = banking[0]
    emb_fns = embedders(p, d, ctx.network("e4"))

    attacks: dict[str, dict[str, dict[int, str]]] = {}  # surrogate -> attack -> intent -> query
    curves, budget = {}, {}
    white = p.model_copy(update={"population": p.whitebox_population or p.population,
                                 "generations": p.whitebox_generations or p.generations})
    for sur in p.surrogates + (["e1"] if p.whitebox else []):
        sp = white if sur == "e1" else p  # the white-box reference is the genetic search only: no baselines
        per = attacks.setdefault(sur, {a: {} for a in (("cacheattack",) if sur == "e1" else ATTACKS)})
        for n, t in enumerate(attacked[: p.whitebox_intents or None] if sur == "e1" else attacked):
            guesses = list(q["text"][(q["role"] == "guess") & (q["intent_id"] == t)])
            payload = d["payloads"][n % len(d["payloads"])]
            pool = sorted({w for g in guesses for w in g.split()} | set(COMMON.split()))
            score = _surrogate_score(emb_fns[sur], guesses)
            log: list[float] = []
            per["cacheattack"][t], budget[sur] = genetic_search(score, payload, guesses, pool, sp, rng, log)
            if sur != "e1":
                per["random"][t] = random_search(score, payload, guesses, pool, budget[sur], sp, rng)
                per["naive"][t] = f"{payload} {guesses[0]}"
            curves.setdefault(sur, []).append(log)
        ctx.progress(f"surrogate {sur}: {len(per['cacheattack'])} intents attacked, {budget[sur]} queries each")

    wraps = lambda i, t: AGENT_WRAPPERS[i % len(AGENT_WRAPPERS)].format(q=t)  # noqa: E731
    texts = list(q["text"])
    agent_texts = [wraps(i, t) for i, t in enumerate(texts)]
    extra = sorted({x for s in attacks.values() for a in s.values() for x in a.values()})
    emb = {}
    for e in EMBEDDERS:
        vecs = emb_fns[e](texts + agent_texts + extra)
        emb[e] = {"keys": vecs[: len(texts)], "agent": vecs[len(texts) : 2 * len(texts)],
                  **dict(zip(extra, vecs[2 * len(texts) :], strict=False))}

    m: dict[str, float] = {}
    taus = {e: calibrate_tau(emb[e]["keys"], q, p.max_false_hit) for e in EMBEDDERS}
    m |= {f"detail/tau_{e}": t for e, t in taus.items()}
    first = p.surrogates[0]
    key = lambda a: "method" if a == "cacheattack" else f"baseline/{a}"  # noqa: E731
    others = [e for e in ("e2", "e3", "e4") if e != first]
    for sur, per in attacks.items():
        for a, queries in per.items():
            for e in EMBEDDERS:
                rate = float(hijack_rates(emb[e], q, queries, taus[e], None).mean())
                m[f"detail/{sur}/{a}/hit_{e}"] = rate
                if sur == first:
                    m[f"{key(a)}/hit_{e}"] = rate
            if sur == "e1" and a == "cacheattack":
                m["baseline/whitebox/hit_e1"] = m[f"detail/e1/{a}/hit_e1"]
    for a in ATTACKS:
        for n, e in enumerate(others, 1):
            m[f"{key(a)}/transfer_{n}"] = m[f"{key(a)}/hit_{e}"]
    for n in range(1, len(others) + 1):  # the best attack's transfer: 0 means every arm sits at the floor
        m[f"detail/best_transfer_{n}"] = max(m[f"{key(a)}/transfer_{n}"] for a in ATTACKS)
    for a, queries in attacks[first].items():
        agent_emb = {"keys": emb["e1"]["agent"], **{k: v for k, v in emb["e1"].items() if k not in ("keys", "agent")}}
        rates = hijack_rates(agent_emb, q, queries, taus["e1"], None, wrap=wraps)
        m[f"{key(a)}/agent_hijack"] = float(rates.mean())
        m[f"{key(a)}/agent_finance_hijack"] = float(rates[[t in banking for t in queries]].mean())
    for e in EMBEDDERS:
        correct, false = benign_rates(emb[e]["keys"], q, taus[e], None)
        m[f"method/benign_correct_{e}"], m[f"method/benign_false_{e}"] = correct, false

    # trade-off over tau on the victim E1, per mitigation; the rotation is a negative control
    rot = np.linalg.qr(np.random.default_rng(p.seed + 1).standard_normal((emb["e1"]["keys"].shape[1],) * 2))[0]
    mitigations = {"plain": (emb["e1"], None), "lexical": (emb["e1"], p.jaccard),
                   "rotation": ({k: v @ rot for k, v in emb["e1"].items()}, None)}
    trade = {}
    for mit, (e_emb, lex) in mitigations.items():
        for tau in p.tau_sweep:
            benign = benign_rates(e_emb["keys"], q, tau, lex)[0]
            hijack = float(hijack_rates(e_emb, q, attacks[first]["cacheattack"], tau, lex).mean())
            trade.setdefault(mit, []).append((tau, benign, hijack))
            m[f"detail/tradeoff/{mit}/tau{tau:g}/benign_correct"], m[f"detail/tradeoff/{mit}/tau{tau:g}/hijack"] = \
                benign, hijack
    b, h = np.array(trade["plain"])[:, 1], np.array(trade["plain"])[:, 2]
    rho = spearmanr(b, h).statistic if b.std() > 0 and h.std() > 0 else 0.0
    m["method/tau_spearman"] = float(rho)
    m["detail/paper_hit_rate"] = 0.86
    m["detail/surrogate_queries"] = float(budget[first])
    _plots(ctx.plots_dir, m, trade, curves)
    (ctx.out_dir / "attack_queries.txt").write_text(
        "\n".join(f"{names[t]} | {a} | {x}" for a, qs in attacks[first].items() for t, x in qs.items()) + "\n")
    return m


def _plots(out: Path, m: dict, trade: dict, curves: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mit, style in zip(trade, ("-o", "--s", ":^"), strict=True):
        arr = np.array(trade[mit])
        ax.plot(arr[:, 1], arr[:, 2], style, label=mit)
    ax.set(xlabel="benign correct-hit rate", ylabel="hijack hit rate", title="E1 cache over tau: utility vs attack")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tradeoff.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for k, a in enumerate(ATTACKS):
        pre = "method" if a == "cacheattack" else f"baseline/{a}"
        ax.bar(np.arange(4) + 0.27 * (k - 1), [m[f"{pre}/hit_{e}"] for e in EMBEDDERS], 0.27, label=a)
    ax.axhline(0.86, color="k", ls=":", lw=0.8, label="paper (86%)")
    ax.set_xticks(range(4), ["E1 MiniLM", "E2 3-layer", "E3 TF-IDF", "E4 tiny"])
    ax.set(ylabel="hijack hit rate", title="Hit rate per cache embedder")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "hit_rates.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for sur, logs in curves.items():
        if logs and logs[0]:
            ax.plot(np.mean(logs, 0), label=f"surrogate {sur}")
    ax.set(xlabel="generation", ylabel="best surrogate cosine (mean over intents)", title="Genetic search")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "search.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="cache_attack",
    title="CacheAttack: key-collision attacks on semantic caches",
    seed="000_2dd18ae8605fb5c1.txt, abstract 16",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/hit_e1", "max"),
    claim=Claim(premises=(  # some attack query reaches the victim cache's tau at all (white-box, scored on E1)
        Compare("baseline/whitebox/hit_e1", ">", 0.0, name="whitebox_reaches_tau"),
        # some attack (any arm) hijacks the other caches at all: else transfer is 0 vs 0, a floor, not evidence
        Compare("detail/best_transfer_1", ">", 0.0, name="transfer_1_off_floor", guards=("method/transfer_1",)),
        Compare("detail/best_transfer_2", ">", 0.0, name="transfer_2_off_floor", guards=("method/transfer_2",)),
    ), all_of=(
        Compare("method/hit_e1", ">", ("baseline/naive/hit_e1", "baseline/random/hit_e1")),
        Compare("method/transfer_1", ">", "baseline/naive/transfer_1"),
        Compare("method/transfer_2", ">", "baseline/naive/transfer_2"),
    ), context=(
        # raising tau shrinks both the benign and the hijack hit sets of the same cache: near-monotone by
        # construction over a few tau points, so it is shown, not tested
        Compare("method/tau_spearman", ">", 0.0),
    ), summary="black-box CacheAttack beats naive and random on the victim and transfers above naive to the two "
               "non-surrogate embedders (the official method's first stage, estimating tau through response "
               "latency, is not implemented: caches are scored at the operator's tau)",
        note="no latency-based tau estimation (the official method's first stage): caches scored at the "
             "operator's tau"),
)
