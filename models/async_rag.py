"""Async RAG: predictive asynchronous retrieval (when + what) for low-latency retrieval-augmented generation.

Seed: 003_9a806cafa3d919df.txt, abstract 14. Spec: ../shared/papers/async_rag.md.

What it implements (function names in brackets):
- a synthetic four-domain knowledge base (person -> birth city, city -> country, company -> product, product ->
  year), passages embedded with all-MiniLM-L6-v2, and multi-hop / cross-domain questions whose facts are needed at
  different answer positions [make_kb, prepare]; HotpotQA / 2WikiMultihopQA / MuSiQue / passage-file loaders [load_qa];
- the generator: a word-level decoder-only transformer (TinyLM) trained through DeepSpeed on question -> answer
  sequences with "<doc> ... </doc>" passages inserted at arbitrary points up to just before the fact they support,
  some sequences docless; entity names are renamed at random within their type in every training sequence, so no
  fact can be memorised and a missing passage means real uncertainty [build_sequence, train];
- docless generation traces: per answer position the last hidden state, the last 8 entropies, the mean hidden state
  of the last 16 tokens, the label "an entropy > theta within the next Delta tokens" and the passage needed next
  [traces];
- the retrieval predictor (when) and the query generator (what, a 384-d MiniLM-space vector, cosine loss) trained
  in one DeepSpeed engine [Heads, train];
- the context monitor (MiniLM embeddings of the latest sentence and the cached passages: invalidate and retrieve on
  an information-need shift; skip a prefetch whose query is already covered) and asynchronous execution on a
  simulated request clock: retrievals complete in the background while decoding goes on, arrivals are inserted at
  the next token boundary, and reaching a high-entropy point before the passage arrived stalls decoding
  [Server.serve];
- arms: the method, synchronous single-shot RAG, synchronous active RAG (FLARE-style), heuristic asynchronous RAG
  (a background retrieval every 16 tokens), no retrieval; the entropy-trigger precursor baseline scores the same
  traces as the predictor [evaluate].

Deviations from the paper (choices the abstract left open):
- Latency (end-to-end and TTFT) is charged on a simulated request clock under a declared cost model, not read
  from this machine's wall clock as the spec's "wall-clock with L_r" would have it: a decoded token costs
  `decode_ms`, a prefilled token (question or passage) `prefill_ms`, a text embedding `embed_ms` on every path
  that embeds (the context monitor included: it embeds on the decode path, so it is charged), a head call
  `head_ms`, and a retrieval arrives `retrieval_ms` x lognormal(0, `retrieval_jitter`) after its launch, drawn
  from (seed, question, pass), so the n-th retrieval of every arm gets the same draw. The generator, heads, MiniLM
  and the search run for real (they decide every token, trigger and retrieved passage), but their compute is
  never on the clock: on a wall clock the real compute (MiniLM's encodes above all, which the method's monitor
  needs at nearly every token) rode on the declared costs, and the same code and seeds gave different verdicts
  on two machines. A retrieval in flight overlaps decoding as a thread pool's would; serving is deterministic, so
  a re-evaluation reports the same numbers [Server, _serve_all].
- Quality and latency are means over the test questions and `repeats` passes (each with its own L_r draws: an
  asynchronous arm's answer can depend on when a passage arrives).
- The `gold_docs` arm (gold passages in the context before "<a>", no retrieval) is the premise that the generator
  answers from passages at all.
- Traces are teacher-forced over the gold docless answer (a "docless generation trace" without sampling noise).
- The method falls back to a synchronous retrieval with its query generator at a high-entropy point when nothing is
  in flight (so a missed prediction costs FLARE's stall, not quality). FLARE-style active RAG starts, as FLARE does,
  with a retrieval on the question (the same top-k as single-shot) and queries with question + partial sentence.
- The generator and heads run with `torch_threads` intra-op threads.
- Real datasets (full profile) keep their own vocabulary (closed over the loaded text) and skip the renaming.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.metrics import roc_auc_score
from torch import nn

from models.common.lm import TinyLM, WordVocab
from models.common.plots import roc_curves
from models.common.tables import read_table, write_table
from models.common.threads import torch_threads
from models.contract import Claim, Compare, Paper, ScheduledParams
from models.inputs import input_path

SPECIAL = ("<q>", "</q>", "<a>", "</a>", "<doc>", "</doc>")
ARMS = ("method", "sync_single", "sync_active", "heuristic_async", "no_retrieval", "gold_docs")
RELATIONS = {  # relation -> (subject type, object type, passage = answer sentence)
    "born_in": ("person", "city", "{s} was born in {o} ."),
    "in_country": ("city", "country", "{s} is in {o} ."),
    "makes": ("company", "product", "{s} makes {o} ."),
    "released": ("product", "year", "{s} was released in {o} ."),
}
QUESTIONS = {  # question type -> (template, relations in answer order; the 2nd chain fact's subject = 1st's object)
    "person": ("where was {a} born and where is that city ?", ("born_in", "in_country")),
    "company": ("what does {b} make and when was it released ?", ("makes", "released")),
    "mixed": ("where was {a} born and what does {b} make ?", ("born_in", "makes")),
}
SUFFIX = {"person": "", "city": "burg", "country": "ia", "company": "corp", "product": "ex"}
SYLLABLES = "ka lo mi re zan tor vel bri nu sa de fi go ha ju ly pe qua ros ti wen xo yar".split()


class Params(ScheduledParams):
    dataset: Literal["synthetic", "hotpotqa", "2wiki", "musique"] = Field("synthetic", description="QA source.")
    dataset_path: str = Field("", description="Real data: HotpotQA/2Wiki JSON list or MuSiQue JSONL file.")
    passages_path: str = Field("", description="Optional JSONL of extra passages {id, text} for the retrieval corpus.")
    n_entities: int = Field(120, ge=10, description="Synthetic KB: entities over the five entity types.")
    n_questions: int = Field(400, ge=8, description="Questions (train + test).")
    n_test: int = Field(32, ge=1, description="Held-out test questions.")
    mixing: float = Field(0.5, ge=0, le=1, description="Share of cross-domain questions (person + company).")
    encoder: Literal["minilm", "hashed"] = Field("minilm", description="Sentence embeddings: MiniLM, or hashed "
                                                 "bag-of-words (test profile: CI loads no model).")
    context: int = Field(64, ge=32, description="Generator context length in tokens.")
    layers: int = Field(2, ge=1)
    d_model: int = Field(64, ge=8, description="Generator width (4 heads when divisible, else 1).")
    lm_steps: int = Field(400, ge=1, description="Generator training steps.")
    lm_batch: int = Field(16, ge=1)
    lr: float = Field(3e-3, gt=0)
    docless_frac: float = Field(0.3, ge=0, le=1, description="Training sequences without any passage.")
    doc_rate: float = Field(0.8, ge=0, le=1, description="Chance each needed passage is inserted (not docless).")
    distractor_rate: float = Field(0.3, ge=0, le=1, description="Chance of one unrelated passage per sequence.")
    head_steps: int = Field(200, ge=1, description="Predictor + query-generator training steps.")
    head_batch: int = Field(256, ge=2)
    head_lr: float = Field(2e-3, gt=0)
    theta: float = Field(1.0, gt=0, description="Entropy threshold (nats) of a high-entropy point.")
    delta: int = Field(6, ge=1, description="Predictor horizon Delta in tokens.")
    p_star: float = Field(0.5, gt=0, lt=1, description="Predictor score that fires a prefetch.")
    kappa: float = Field(0.5, ge=-1, le=1, description="Monitor: sentence-to-cache similarity below which the "
                         "information need shifted (invalidate, retrieve).")
    kappa_query: float = Field(0.6, ge=-1, le=1, description="A prefetch query this close to a cached passage is "
                               "already covered (no retrieval).")
    top_k: int = Field(2, ge=1, description="Passages of a question-level retrieval (single-shot, FLARE's first).")
    max_answer_tokens: int = Field(16, ge=2)
    heuristic_every: int = Field(16, ge=1, description="Heuristic async: background retrieval period in tokens.")
    retrieval_ms: float = Field(30.0, ge=0, description="Network latency L_r per retrieval (ms on the request clock).")
    retrieval_jitter: float = Field(0.25, ge=0, description="Lognormal sigma of L_r draws.")
    retrieval_sweep: list[float] = Field([], description="Extra L_r values evaluated (detail metrics only, one "
                                         "pass each).")
    arms: list[Literal[ARMS]] = Field(list(ARMS), min_length=1, description="Arms served (method, sync_active, "
                                      "sync_single, heuristic_async and gold_docs are read by the claim).")
    repeats: int = Field(1, ge=1, description="Passes over the test set at L_r, each with its own L_r draws.")
    decode_ms: float = Field(10.0, ge=0, description="Declared cost per decoded token (ms on the request clock).")
    prefill_ms: float = Field(0.2, ge=0, description="Declared cost per prefilled token of question or passage (ms).")
    embed_ms: float = Field(4.0, ge=0, description="Declared cost per text embedding on every path that embeds: sync "
                            "queries, heuristic windows, the context monitor (ms).")
    head_ms: float = Field(0.1, ge=0, description="Declared cost per predictor / query-generator call (ms).")
    torch_threads: int = Field(1, ge=1, description="Intra-op threads of training and serving: a 100k-parameter "
                               "model's ops are too small to split: spare threads only burn CPU.")


# ---- data ----------------------------------------------------------------------------------------------------
def _norm(text: str) -> str:
    return " ".join(re.findall(r"\w+|[^\w\s]", text.lower()))


def make_kb(p: Params, rng: np.random.Generator) -> tuple[dict, dict]:
    """Synthetic KB and questions. Returns (kb columns, qa columns)."""
    counts = {"city": 0.15, "country": 0.05, "company": 0.2, "product": 0.2}
    counts = {t: max(2, round(f * p.n_entities)) for t, f in counts.items()}
    counts["product"] = counts["company"]  # each company makes one product
    counts["person"] = max(2, p.n_entities - sum(counts.values()))
    names, seen = {}, set(SPECIAL) | {w for t, _ in QUESTIONS.values() for w in t.split()}
    for t in ("person", "city", "country", "company", "product"):
        names[t] = []
        while len(names[t]) < counts[t]:
            w = "".join(rng.choice(SYLLABLES, size=rng.integers(2, 4))) + SUFFIX[t]
            if w not in seen:
                seen.add(w)
                names[t].append(w)
    years = [str(y) for y in range(1950, 2025)]
    obj = {"born_in": {s: names["city"][rng.integers(counts["city"])] for s in names["person"]},
           "in_country": {s: names["country"][rng.integers(counts["country"])] for s in names["city"]},
           "makes": dict(zip(names["company"], names["product"], strict=True)),
           "released": {s: years[rng.integers(len(years))] for s in names["product"]}}
    kb = {c: [] for c in ("fact_id", "domain", "subject", "relation", "object", "passage")}
    fid = {}
    for rel, table in obj.items():
        for s, o in table.items():
            fid[rel, s] = len(kb["fact_id"])
            for c, v in zip(kb, (fid[rel, s], RELATIONS[rel][0], s, rel, o, RELATIONS[rel][2].format(s=s, o=o)),
                            strict=True):
                kb[c].append(v)
    qa, used = {c: [] for c in ("q_id", "question", "answer", "gold_fact_ids", "split")}, set()
    kinds, probs = ["mixed", "person", "company"], [p.mixing, (1 - p.mixing) / 2, (1 - p.mixing) / 2]
    for _ in range(50 * p.n_questions):
        if len(used) == p.n_questions:
            break
        kind = kinds[rng.choice(3, p=probs)]
        a, b = names["person"][rng.integers(counts["person"])], names["company"][rng.integers(counts["company"])]
        template, rels = QUESTIONS[kind]
        q = template.format(a=a, b=b)
        if q in used:
            continue
        used.add(q)
        subj, facts = {"born_in": a, "makes": b}, []
        for rel in rels:
            s = subj.get(rel) or obj[facts[-1][0]][facts[-1][1]]  # chain: previous fact's object
            facts.append((rel, s))
        qa["question"].append(q)
        qa["answer"].append(" ".join(RELATIONS[r][2].format(s=s, o=obj[r][s]) for r, s in facts))
        qa["gold_fact_ids"].append(" ".join(str(fid[f]) for f in facts))
    n = len(qa["question"])
    qa["q_id"] = list(range(n))
    qa["split"] = ["train" if i < n - p.n_test else "test" for i in range(n)]
    return kb, qa


def load_qa(p: Params) -> tuple[dict, dict]:
    """HotpotQA / 2WikiMultihopQA (JSON list: question, answer, supporting_facts, context) or MuSiQue (JSONL:
    question, answer, paragraphs[{title, paragraph_text, is_supporting}]); one passage per paragraph, deduplicated
    by text; `passages_path` (JSONL {id, text}) adds distractor passages. The last n_test questions are the test."""
    text = input_path(p.dataset_path).read_text()
    rows = json.loads(text) if p.dataset in ("hotpotqa", "2wiki") else [json.loads(x) for x in text.splitlines() if x]
    kb = {c: [] for c in ("fact_id", "domain", "subject", "relation", "object", "passage")}
    index: dict[str, int] = {}

    def add(title: str, passage: str) -> int:
        passage = _norm(passage)
        if passage not in index:
            index[passage] = len(index)
            for c, v in zip(kb, (index[passage], p.dataset, _norm(title), "", "", passage), strict=True):
                kb[c].append(v)
        return index[passage]

    qa = {c: [] for c in ("q_id", "question", "answer", "gold_fact_ids", "split")}
    for row in rows[: p.n_questions]:
        if p.dataset == "musique":
            paras = [(x["title"], x["paragraph_text"], x.get("is_supporting", False)) for x in row["paragraphs"]]
        else:
            support = {t for t, _ in row["supporting_facts"]}
            paras = [(t, " ".join(s), t in support) for t, s in row["context"]]
        gold = [add(t, x) for t, x, sup in paras if sup] or [add(*paras[0][:2])]
        _ = [add(t, x) for t, x, sup in paras if not sup]
        qa["question"].append(_norm(row["question"]))
        qa["answer"].append(_norm(row["answer"]) + " .")
        qa["gold_fact_ids"].append(" ".join(map(str, gold)))
    if p.passages_path:
        for line in input_path(p.passages_path).read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                add(item.get("title", ""), item["text"])
    n = len(qa["question"])
    qa["q_id"], qa["split"] = list(range(n)), ["train" if i < n - p.n_test else "test" for i in range(n)]
    return kb, qa


def _hashed(texts: list[str], dim: int = 384) -> np.ndarray:
    """Test stand-in for MiniLM: a seeded random projection of word counts, L2-normalised."""
    out = np.zeros((len(texts), dim), np.float32)
    for i, t in enumerate(texts):
        for w in t.split():
            out[i] += np.random.default_rng(list(w.encode())).standard_normal(dim).astype(np.float32)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def encoder(p: Params):
    if p.encoder == "hashed":
        return _hashed
    from models.common.text import encode_sentences

    return encode_sentences


def prepare(p: Params, out_dir: Path) -> None:
    kb, qa = make_kb(p, np.random.default_rng(p.seed)) if p.dataset == "synthetic" else load_qa(p)
    write_table(out_dir / "kb.parquet", kb)
    emb = encoder(p)(list(kb["passage"]))  # (F, 384)
    cols = {"fact_id": kb["fact_id"], **{f"e_{i}": emb[:, i] for i in range(384)}}
    write_table(out_dir / "passage_emb.parquet", cols)
    write_table(out_dir / "qa.parquet", qa)


def _load(data_dir: Path) -> dict:
    kb, qa = read_table(data_dir / "kb.parquet"), read_table(data_dir / "qa.parquet")
    e = read_table(data_dir / "passage_emb.parquet")
    emb = np.stack([e[f"e_{i}"] for i in range(384)], 1).astype(np.float32)  # (F, 384)
    vocab = WordVocab(list(kb["passage"]) + list(qa["question"]) + list(qa["answer"]), extra=SPECIAL)
    ids = lambda text: [vocab.stoi[w] for w in text.split()]  # noqa: E731
    docs = [ids(f"<doc> {t} </doc>") for t in kb["passage"]]
    items = []
    for q, a, g, s in zip(qa["question"], qa["answer"], qa["gold_fact_ids"], qa["split"], strict=True):
        gold, words = [int(x) for x in g.split()], a.split()
        needs = []  # (answer position of the fact's object, fact id): where the passage is needed
        for f in gold:
            o = kb["object"][f].split()
            at = next((i for i in range(len(words)) if o and words[i : i + len(o)] == o and
                       all(i > n for n, _ in needs)), 0)
            needs.append((at, f))
        items.append({"q": ids(f"<q> {q} </q>"), "a": ids(a) + [vocab.stoi["</a>"]], "needs": needs,
                      "gold": gold, "objects": [kb["object"][f] or a.rstrip(" .") for f in gold], "answer": a,
                      "question": q, "split": s})
    by_type: dict[str, set[str]] = {}  # entity tokens renamed together (per type); empty for real data
    for s, r, o in zip(kb["subject"], kb["relation"], kb["object"], strict=True):
        if r in RELATIONS:
            by_type.setdefault(RELATIONS[r][0], set()).add(s)
            by_type.setdefault(RELATIONS[r][1], set()).add(o)
    groups = [np.array(sorted(vocab.stoi[w] for w in ws)) for _, ws in sorted(by_type.items())]
    return {"kb": kb, "emb": emb, "vocab": vocab, "docs": docs, "items": items, "groups": groups}


def build_sequence(item: dict, docs: list[list[int]], p: Params, rng: np.random.Generator) -> tuple[list, list]:
    """Token ids and loss mask (1 = an answer token to predict) of one training sequence with inserted passages."""
    inserts: dict[int, list[int]] = {}
    if rng.random() >= p.docless_frac:
        for at, f in item["needs"]:
            if rng.random() < p.doc_rate:
                inserts.setdefault(int(rng.integers(-1, at + 1)), []).append(f)  # -1: before "<a>"
        if rng.random() < p.distractor_rate:
            inserts.setdefault(int(rng.integers(-1, len(item["a"]))), []).append(int(rng.integers(len(docs))))
    seq, mask = list(item["q"]), [0] * len(item["q"])
    for i in range(-1, len(item["a"])):
        for f in inserts.get(i, []):
            seq += docs[f]
            mask += [0] * len(docs[f])
        seq.append(item["a"][i] if i >= 0 else -1)  # -1 marks "<a>", filled by the caller
        mask.append(int(i >= 0))
    return seq, mask


# ---- networks ------------------------------------------------------------------------------------------------
class Heads(nn.Module):
    """Retrieval predictor (when) and query generator (what), trained side by side in one engine."""

    def __init__(self, d: int, window: int = 8, hidden: int = 128):
        super().__init__()
        self.predictor = nn.Sequential(nn.Linear(d + window, hidden), nn.GELU(), nn.Linear(hidden, 1))
        self.query = nn.Sequential(nn.Linear(d, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, 384))

    def forward(self, pred_x: torch.Tensor, query_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pred_x (B, d+8) -> logit (B,); query_x (B, d) -> unit search vector (B, 384)
        return self.predictor(pred_x).squeeze(-1), F.normalize(self.query(query_x), dim=-1)


def _lm(p: Params, vocab_size: int) -> TinyLM:
    return TinyLM(vocab_size, p.d_model, p.layers, 4 if p.d_model % 4 == 0 else 1, p.context)


@torch.no_grad()
def lm_state(lm: TinyLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (T, d) and next-token entropies (T,) of one context."""
    h = lm.body(torch.tensor([ids]))[0]  # (T, d)
    logp = (h @ lm.body.tok.weight.T).log_softmax(-1)  # (T, V)
    return h, -(logp.exp() * logp).sum(-1)


def features(h: torch.Tensor, ent: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictor input [h_t, H_{t-7..t}] (d+8,) and query-generator input mean(h_{t-15..t}) (d,)."""
    window = F.pad(ent[max(0, t - 7) : t + 1], (8 - min(8, t + 1), 0))  # (8,), left-padded with 0
    return torch.cat([h[t], window]), h[max(0, t - 15) : t + 1].mean(0)


@torch.no_grad()
def traces(lm: TinyLM, items: list[dict], a_id: int, p: Params) -> dict[str, torch.Tensor]:
    """Docless teacher-forced traces: per answer position, features, current entropy, the label 'an entropy > theta
    within the next Delta tokens', and the fact needed next (-1: none left)."""
    cols: dict[str, list] = {k: [] for k in ("pred_x", "query_x", "entropy", "label", "need", "item", "pos")}
    for k, it in enumerate(items):
        ids = it["q"] + [a_id] + it["a"]
        start = len(it["q"])  # position of "<a>": context ends there before the first answer token
        h, ent = lm_state(lm, ids[-p.context:])
        off = max(0, len(ids) - p.context)
        for t in range(start - off, len(ids) - off - 1):
            px, qx = features(h, ent, t)
            future = ent[t + 1 : t + 1 + p.delta]
            need = next((f for at, f in it["needs"] if start + 1 + at - off > t), -1)
            for c, v in zip(cols, (px, qx, float(ent[t]), float((future > p.theta).any()), need, k, t), strict=True):
                cols[c].append(v)
    return {c: torch.stack(v) if c.endswith("_x") else torch.tensor(v) for c, v in cols.items()}


# ---- training --------------------------------------------------------------------------------------------------
def train(ctx) -> None:
    with torch_threads(ctx.params.torch_threads):  # restored after: the process may run other papers' work
        _train(ctx)


def _train(ctx) -> None:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    vocab, items = d["vocab"], [it for it in d["items"] if it["split"] == "train"]
    a_id = vocab.stoi["<a>"]
    lm = _lm(p, len(vocab))

    def lm_batch(step: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([p.seed, 1, step])
        ids, mask = torch.zeros(p.lm_batch, p.context, dtype=torch.long), torch.zeros(p.lm_batch, p.context)
        for b, k in enumerate(rng.integers(len(items), size=p.lm_batch)):
            seq, m = build_sequence(items[k], d["docs"], p, rng)
            seq = np.array([a_id if x < 0 else x for x in seq])[: p.context]
            table = np.arange(len(vocab))
            for g in d["groups"]:  # rename entities within their type: facts can be copied, never memorised
                table[g] = rng.permutation(g)
            ids[b, : len(seq)], mask[b, : len(seq)] = torch.from_numpy(table[seq]), torch.tensor(m[: p.context])
        return {"ids": ids, "mask": mask}  # (B, T) each

    def lm_step(engine, batch, step):
        logits = engine(batch["ids"][:, :-1])  # (B, T-1, V)
        nll = F.cross_entropy(logits.transpose(1, 2), batch["ids"][:, 1:], reduction="none")  # (B, T-1)
        mask = batch["mask"][:, 1:]
        return (nll * mask).sum() / mask.sum().clamp(min=1), {}

    ctx.progress(f"generator: {sum(x.numel() for x in lm.parameters())} parameters, vocab {len(vocab)}")
    engine = ctx.engine(lm, p.lr, steps=p.lm_steps, warmup=p.warmup, decay=p.decay)  # schedule: the generator only
    ctx.fit("generator", engine, lm_step, lm_batch, p.lm_steps)
    lm.eval()
    tr = traces(lm, items, a_id, p)
    target = torch.from_numpy(d["emb"])[tr["need"].clamp(min=0)]  # (N, 384) gold passage needed next
    heads = Heads(p.d_model)

    def head_batch(step: int) -> dict[str, torch.Tensor]:
        idx = torch.randint(len(tr["label"]), (p.head_batch,), generator=torch.Generator().manual_seed(p.seed + step))
        return {"pred_x": tr["pred_x"][idx], "query_x": tr["query_x"][idx], "label": tr["label"][idx],
                "target": target[idx], "has_need": (tr["need"][idx] >= 0).float()}

    def head_step(engine, batch, step):
        logit, q = engine(batch["pred_x"], batch["query_x"])
        bce = F.binary_cross_entropy_with_logits(logit, batch["label"])
        cos = ((1 - (q * batch["target"]).sum(-1)) * batch["has_need"]).sum() / batch["has_need"].sum().clamp(min=1)
        return bce + cos, {"bce": float(bce.detach()), "cosine_loss": float(cos.detach())}

    ctx.progress(f"heads: {len(tr['label'])} trace positions, {float(tr['label'].mean()):.2f} positive")
    engine = ctx.engine(heads, p.head_lr, arms={"predictor": heads.predictor, "query": heads.query})
    ctx.fit("heads", engine, head_step, head_batch, p.head_steps)


# ---- serving on a simulated clock: the method and every baseline arm ----------------------------------------------
class Server:
    """Decodes one request per arm, greedily: real LM and head forward passes and real dense search, on a simulated
    request clock (ms) that advances only by the spec's declared costs: a decoded token `decode_ms`, a prefilled
    token `prefill_ms`, a text embedding `embed_ms` on whichever path asks for it (the monitor's included), a head
    call `head_ms`. A retrieval launched at clock time t arrives at t + `retrieval_ms` x lognormal(0,
    `retrieval_jitter`), drawn from (seed, question, pass) so the n-th retrieval of every arm gets the same draw;
    decoding goes on meanwhile, arrivals join the context at the next token boundary at or after their arrival,
    and waiting for one (a blocking retrieval or a stall) moves the clock to its arrival. Real compute (MiniLM,
    the generator, the heads, the search) is never on the clock: the latency is that of the declared cost model,
    the same on every machine and under any load."""

    def __init__(self, p: Params, d: dict, lm: TinyLM, heads: Heads, retrieval_ms: float,
                 embeddings: dict[str, torch.Tensor] | None = None):
        """`embeddings`: text -> MiniLM vector, shared by servers at other L_r (the vectors do not depend on it)."""
        self.p, self.d, self.lm, self.heads, self.l_r = p, d, lm, heads, retrieval_ms
        self.emb = torch.from_numpy(d["emb"])  # (F, 384)
        self.encode, self._cache = encoder(p), {} if embeddings is None else embeddings
        v = d["vocab"]
        self.stop, self.dot = v.stoi["</a>"], v.stoi.get(".", -1)
        self.banned = torch.tensor([v.stoi[s] for s in SPECIAL if s != "</a>"] + [0, 1])  # never generated

    def text_vec(self, text: str) -> torch.Tensor:
        """MiniLM embedding of one text, cached across arms and repeats; its cost `embed_ms` is charged by the
        caller on every call, its compute never."""
        if text not in self._cache:
            self._cache[text] = torch.from_numpy(self.encode([text])[0])
        return self._cache[text]  # (384,)

    def search_top(self, vec: torch.Tensor, k: int, exclude: set[int] = frozenset()) -> list[int]:
        """Dense cosine search: the k best passages not already in the context."""
        order = torch.argsort(self.emb @ vec, descending=True, stable=True).tolist()
        return [f for f in order if f not in exclude][:k]

    def serve(self, arm: str, item: dict, q_index: int, repeat: int = 0) -> dict:
        p, d, itos = self.p, self.d, self.d["vocab"].itos
        rng = np.random.default_rng([p.seed, q_index, repeat])  # the n-th retrieval of every arm: the same draw
        st = {"now": 0.0, "stall": 0.0, "retrievals": 0, "ctx": list(item["q"]), "in_ctx": set(), "cache": [],
              "embeds": 0}
        pending: list[tuple[float, list[int]]] = []  # retrievals in flight, in launch order: (arrival ms, passages)

        def charge(ms: float) -> None:
            st["now"] += ms

        def embed(text: str) -> torch.Tensor:
            st["embeds"] += 1
            charge(p.embed_ms)
            return self.text_vec(text)

        def launch(vec: torch.Tensor, k: int = 1) -> tuple[float, list[int]]:
            # sent once its query is ready (embedding charged before); what it returns is fixed at launch
            st["retrievals"] += 1
            arrival = st["now"] + self.l_r * float(rng.lognormal(0.0, p.retrieval_jitter))
            return arrival, self.search_top(vec, k, set(st["in_ctx"]))

        def insert(fids: list[int]) -> None:
            for f in fids:
                if f in st["in_ctx"]:
                    continue
                st["ctx"] += d["docs"][f]
                charge(p.prefill_ms * len(d["docs"][f]))
                st["in_ctx"].add(f)
                st["cache"].append(f)

        def wait_for(retrieval: tuple[float, list[int]]) -> None:  # a blocking (synchronous) retrieval or a stall
            arrival, fids = retrieval
            st["stall"] += max(0.0, arrival - st["now"])
            st["now"] = max(st["now"], arrival)
            insert(fids)

        question = item["question"]
        if arm == "gold_docs":  # the premise arm: the gold passages in the context before answering
            insert(item["gold"])
        elif arm in ("sync_single", "sync_active"):
            wait_for(launch(embed(question), p.top_k))
        elif arm == "heuristic_async":
            pending.append(launch(embed(question)))
        st["ctx"].append(d["vocab"].stoi["<a>"])
        charge(p.prefill_ms * (len(item["q"]) + 1))  # passages were charged when inserted
        answer, ttft, triggers = [], None, []
        for step in range(p.max_answer_tokens):
            for r in [r for r in pending if r[0] <= st["now"]]:  # arrivals join at this token boundary
                pending.remove(r)
                insert(r[1])
            h, ent = lm_state(self.lm, st["ctx"][-p.context:])
            if arm == "method":
                px, qx = features(h, ent, len(h) - 1)
                logit, qvec = self.heads(px[None], qx[None])
                charge(p.head_ms)
                if torch.sigmoid(logit)[0] > p.p_star and not pending:
                    covered = st["cache"] and float((self.emb[st["cache"]] @ qvec[0]).max()) >= p.kappa_query
                    if not covered:
                        pending.append(launch(qvec[0]))
                        triggers.append(step)
            if float(ent[-1]) > p.theta and arm not in ("no_retrieval", "gold_docs"):  # a high-entropy point
                if pending:
                    wait_for(pending.pop(0))
                    h, ent = lm_state(self.lm, st["ctx"][-p.context:])
                if float(ent[-1]) > p.theta and arm in ("sync_active", "method"):
                    if arm == "method":
                        vec = self.heads(*features(h, ent, len(h) - 1))[1]
                        charge(p.head_ms)
                    else:  # FLARE-style: query with the question and the partial sentence
                        partial = " ".join(itos[t] for t in answer).split(" . ")[-1]
                        vec = embed(f"{question} {partial}")
                    wait_for(launch(vec))
                    h, ent = lm_state(self.lm, st["ctx"][-p.context:])
            logits = h[-1] @ self.lm.body.tok.weight.T  # (V,)
            tok = int(logits.index_fill(0, self.banned, -torch.inf).argmax())
            charge(p.decode_ms)
            ttft = st["now"] if ttft is None else ttft
            if tok == self.stop:
                break
            answer.append(tok)
            st["ctx"].append(tok)
            words = [itos[t] for t in answer]
            if arm == "method" and st["cache"] and tok != self.dot:  # context monitor on the latest sentence
                sentence = " ".join(words).split(" . ")[-1]
                sims = self.emb[st["cache"]] @ embed(sentence)  # charged: the monitor embeds on the decode path
                if float(sims.max()) < p.kappa:  # information need shifted: invalidate, retrieve for the new need
                    st["cache"].clear()
                    if not pending:
                        pending.append(launch(self.heads(*features(h, ent, len(h) - 1))[1]))
                        triggers.append(step)
            if arm == "heuristic_async" and (step + 1) % p.heuristic_every == 0:
                pending.append(launch(embed(" ".join(itos[t] for t in st["ctx"][-16:]))))
        # retrievals still in flight when the answer ended: not waited for, not counted
        text = " ".join(itos[t] for t in answer)
        found = [o in f" {text} " for o in (f" {o} " for o in item["objects"])]
        return {"latency_ms": st["now"], "ttft_ms": ttft, "fact_acc": float(np.mean(found)),
                "exact_match": float(text == item["answer"]), "retrievals": st["retrievals"],
                "stall_ms": st["stall"], "embeds": st["embeds"], "answer": text, "triggers": triggers}


# ---- evaluation ----------------------------------------------------------------------------------------------------
def _load_models(ctx) -> tuple[TinyLM, Heads]:
    return ctx.network("generator"), ctx.network("heads")


def lead_times(score: np.ndarray, entropy: np.ndarray, item: np.ndarray, pos: np.ndarray, fire: float, p: Params):
    """Mean lead (tokens) from the first firing within Delta positions before each entropy spike to the spike."""
    leads = []
    for k in np.flatnonzero(entropy > p.theta):
        window = np.flatnonzero((item == item[k]) & (pos < pos[k]) & (pos >= pos[k] - p.delta) & (score > fire))
        leads.append(float(pos[k] - pos[window].min()) if len(window) else 0.0)
    return float(np.mean(leads)) if leads else 0.0


def _serve_all(ctx, p: Params, d: dict, lm: TinyLM, heads: Heads, test: list[dict]) -> dict:
    """Every arm on every test question, `repeats` times at L_r (once at each swept L_r), each pass with its own
    L_r draws. Returns L_r -> pass -> arm -> per-question rows."""
    results: dict[float, list[dict[str, list[dict]]]] = {}
    embeddings: dict[str, torch.Tensor] = {}  # every L_r embeds the same texts: MiniLM runs once for each
    for l_r in [p.retrieval_ms, *[x for x in p.retrieval_sweep if x != p.retrieval_ms]]:
        server = Server(p, d, lm, heads, l_r, embeddings)
        reps = p.repeats if l_r == p.retrieval_ms else 1
        results[l_r] = [{arm: [server.serve(arm, it, k, r) for k, it in enumerate(test)] for arm in p.arms}
                        for r in range(reps)]
        ctx.progress(f"L_r={l_r:g} ms: served {len(test)} questions x {len(p.arms)} arms x {reps} passes "
                     f"(simulated clock, {len(server._cache)} texts embedded)")
    return results


@torch.no_grad()
def evaluate(ctx) -> dict[str, float]:
    # tiny ops: extra intra-op threads only spin; restored after (evaluation shares the flow's process)
    with torch_threads(ctx.params.torch_threads):
        return _evaluate(ctx)


def _evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    lm, heads = _load_models(ctx)
    test = [it for it in d["items"] if it["split"] == "test"]
    tr = traces(lm, test, d["vocab"].stoi["<a>"], p)
    logit, qvec = heads(tr["pred_x"], tr["query_x"])
    score, label, ent = torch.sigmoid(logit).numpy(), tr["label"].numpy(), tr["entropy"].numpy()
    two = len(set(label.tolist())) == 2
    m = {"method/predictor_auroc": roc_auc_score(label, score) if two else 0.5,
         "baseline/entropy_trigger/predictor_auroc": roc_auc_score(label, ent) if two else 0.5,
         "method/lead_tokens": lead_times(score, ent, tr["item"].numpy(), tr["pos"].numpy(), p.p_star, p),
         "baseline/entropy_trigger/lead_tokens": lead_times(ent, ent, tr["item"].numpy(), tr["pos"].numpy(),
                                                            p.theta, p)}
    has = (tr["label"] > 0) & (tr["need"] >= 0)
    top1 = (qvec[has] @ torch.from_numpy(d["emb"]).T).argmax(-1)
    m["method/query_precision_at_1"] = float((top1 == tr["need"][has]).float().mean()) if has.any() else 0.0
    if two:
        roc_curves(ctx.plots_dir / "predictor_roc.png", label, {"retrieval predictor": score, "entropy trigger": ent},
                   f"Spike within the next {p.delta} tokens")

    results = _serve_all(ctx, p, d, lm, heads, test)  # L_r -> pass -> arm -> per-question rows
    keys = ("latency_ms", "ttft_ms", "fact_acc", "exact_match", "retrievals", "stall_ms", "embeds")
    for l_r, reps in results.items():
        mean = {(arm, key): float(np.mean([x[key] for rows in reps for x in rows[arm]])) for arm in p.arms
                for key in keys}  # over questions and passes
        for (arm, key), v in mean.items():
            m[f"detail/lr{l_r:g}/{arm}/{key}"] = v
            if l_r == p.retrieval_ms:
                m[("method/" if arm == "method" else f"baseline/{arm}/") + key] = v
        m[f"detail/lr{l_r:g}/latency_reduction"] = 1 - mean["method", "latency_ms"] / mean["sync_active", "latency_ms"]
        m[f"detail/lr{l_r:g}/ttft_gain"] = 1 - mean["method", "ttft_ms"] / mean["sync_single", "ttft_ms"]
    m["method/latency_reduction"] = m[f"detail/lr{p.retrieval_ms:g}/latency_reduction"]  # paper: 0.435
    m["method/ttft_gain"] = m[f"detail/lr{p.retrieval_ms:g}/ttft_gain"]  # paper: 0.624
    m["method/fact_acc_vs_best_sync"] = m["method/fact_acc"] - max(
        m["baseline/sync_single/fact_acc"], m["baseline/sync_active/fact_acc"])
    results = {l_r: reps[0] for l_r, reps in results.items()}  # answers and plots: the first pass
    main = results[p.retrieval_ms]
    with open(ctx.out_dir / "answers.jsonl", "w") as f:
        for k, it in enumerate(test):
            f.write(json.dumps({"question": it["question"], "gold": it["answer"],
                                **{arm: main[arm][k]["answer"] for arm in p.arms}}) + "\n")
    _plots(ctx.plots_dir, m, results, p, tr, score)
    return {k: float(v) for k, v in m.items()}


def _plots(out: Path, m: dict, results: dict, p: Params, tr: dict, score: np.ndarray) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    names = [("method/" if a == "method" else f"baseline/{a}/") for a in p.arms]
    for ax, key, label in zip(axes, ("latency_ms", "ttft_ms", "fact_acc"), ("end-to-end latency (ms)", "TTFT (ms)",
                                                                              "fact accuracy"), strict=True):
        ax.bar(range(len(p.arms)), [m[n + key] for n in names], color=["tab:red"] + ["tab:gray"] * (len(p.arms) - 1))
        ax.set_xticks(range(len(p.arms)), [a.replace("_", "\n") for a in p.arms], fontsize=7)
        ax.set_ylabel(label)
    axes[0].set_title(f"L_r = {p.retrieval_ms:g} ms (simulated clock, declared costs)")
    fig.tight_layout()
    fig.savefig(out / "latency_quality.png", dpi=110)
    plt.close(fig)

    first = (tr["item"] == 0).numpy()  # one test question: entropy trajectory and predictor score
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(tr["pos"][first], tr["entropy"][first], "o-", label="next-token entropy (docless)")
    scale = max(1.0, float(tr["entropy"].max()))
    ax.plot(tr["pos"][first], score[first] * scale, "s--", label="predictor score (scaled)")
    ax.axhline(p.theta, color="k", ls=":", lw=0.8, label="theta")
    ax.set(xlabel="position", ylabel="nats", title="Precursors: the predictor rises before the spike")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "precursor_trace.png", dpi=110)
    plt.close(fig)

    if len(results) > 1:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = sorted(results)
        for arm in p.arms:
            ax.plot(xs, [np.mean([r["latency_ms"] for r in results[x][arm]]) for x in xs], "o-", label=arm)
        ax.set(xlabel="retrieval latency L_r (ms)", ylabel="end-to-end latency (ms)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "latency_sweep.png", dpi=110)
        plt.close(fig)


PAPER = Paper(
    id="async_rag",
    title="Predictive asynchronous retrieval for low-latency RAG",
    seed="003_9a806cafa3d919df.txt, abstract 14",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/latency_reduction", "max"),
    claim=Claim(
        premises=(  # the generator answers from passages at all, else no retrieval arm can be compared on quality
            Compare("baseline/gold_docs/fact_acc", ">=", 0.8, name="lm_reads_gold_docs"),
        ),
        all_of=(
            Compare("method/latency_reduction", ">", 0.0),  # vs synchronous active RAG; paper 0.435
            Compare("method/fact_acc_vs_best_sync", ">=", -0.02),  # within 2 points of the better synchronous arm
            Compare("method/fact_acc", ">", "baseline/heuristic_async/fact_acc"),  # predicted vs fixed-period prefetch
            Compare("method/predictor_auroc", ">", "baseline/entropy_trigger/predictor_auroc"),
        ),
        context=(  # single-shot RAG blocks on a retrieval before its first token by definition, the method never does
            Compare("method/ttft_gain", ">", 0.0),  # paper 0.624
            Compare("method/latency_ms", "<", "baseline/heuristic_async/latency_ms"),
        ),
        summary="lower end-to-end latency (declared costs, simulated clock) than synchronous active RAG, fact "
                "accuracy within 2 points of the better synchronous arm and above heuristic asynchronous RAG (a "
                "retrieval every 16 tokens), and a predictor that sees entropy spikes coming better than the "
                "current entropy; TTFT against single-shot RAG is context (it holds by the arms' definitions)"),
)
