"""GaRA: graph-aware LoRA generation for adapting a frozen language model to zero-shot graph tasks.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 14. Spec: ../shared/papers/gara.md.

What it implements (function names in brackets):
- the task's text interface: "<centre node text> | (a) music (b) law ... ?" answered by one letter [prompt];
- a char-level decoder-only TinyLM pretrained from scratch on that interface, then frozen [train, phase "lm"];
- a functional forward of the frozen LM that adds per-sample low-rank updates to the query and value projections
  of every layer and can prepend soft prompt tokens [lm_hidden, answer_logits];
- the graph encoder: 2-layer GIN over the centre node's 2-hop ego-graph (<= 30 nodes; node input = MiniLM text
  embedding + 8-step random-walk PE + cosine similarity to each lettered label name), attention pooling with the
  centre node as query, concatenated with the mean MiniLM embedding of the label names [GraphReader];
- the LoRA generator: an MLP hypernetwork readout -> A_l (r x d), B_l (d x r) for W_q and W_v of every layer,
  dW_l = (alpha / r) B_l A_l, then the norm constraint dW_l <- dW_l * min(1, rho / ||dW_l||_F) [Generated.deltas];
- baselines trained on the same queries, steps and seed in the same DeepSpeed engine: graph-as-text (ego-graph
  serialised into a 256-char prompt, fixed trained LoRA r = 4) [GraphAsText], input-level injection (readout ->
  8 soft prompt tokens) [SoftPrompt], GaRA without the norm constraint [Generated(rho=inf)];
- zero-shot evaluation on graphs of unseen topics (unseen SBM parameters, networkx's karate club) [evaluate].

Deviations from the paper (choices the abstract left open):
- The mean of the label-name embeddings (the spec's task description) says nothing about which letter names which
  topic, so no encoder could answer through it. Each node's input therefore also carries its cosine similarity to
  each lettered label name (centred over the offered letters, x10 as a CLIP-style temperature; zero for absent
  letters); GaRA, soft prompts and the ablation share this encoder.
- The generated A_l is a learned base A_0 plus the hypernetwork's output (B_l fully generated): with A and B both
  generated near zero, dW = B A starts with a vanishing gradient. The generated B starts at exactly 0 (the B rows
  of the generator's last layer are zero, as a standard LoRA's B), so GaRA starts at the frozen LM.
- The reader's readout is layer-normalised (shared by GaRA, its ablation and the soft prompts): the GIN's sums reach
  activations in the hundreds, and one optimiser step then moved the generated B by about its whole norm.
- Every arm of the methods phase trains with the same AdamW weight decay and learning-rate schedule (`warmup`,
  `decay`): above rho the projected dW is invariant to the scale of B, so without decay nothing stops B's norm from
  growing (and Adam's effective step on the sphere from shrinking).
- The LM's pretraining loss is next-character cross-entropy over the prompt plus the answer-letter cross-entropy.
- Soft prompt tokens carry no position embedding (the prompt keeps the positions it was pretrained with).
- Full: the same TinyLM scaled up (no pretrained LM is installed here), with the TAG folder loader
  (`models.common.graphs.load_tag_folder`): one train folder and zero-shot test folders; label sets larger than
  `max_labels` are cut per query to the true label plus a seeded sample of the others.
- Every profile scores every test query of every zero-shot graph (`test_queries: 0`); the training-topic
  accuracy is on a seeded sample of `val_queries` validation queries.
- Chance (`detail/chance/zero_shot_acc`) is the mean of 1 / (offered letters) over the scored test queries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import networkx as nx
import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch_geometric.data import Batch, Data
from torch_geometric.utils import scatter, softmax

from models.common import graphs as G
from models.common.lm import TinyLM
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, ScheduledParams
from models.inputs import input_path

ALPHABET = "\0 abcdefghijklmnopqrstuvwxyz0123456789()|;:?-.,"  # index 0 pads
STOI = {c: i for i, c in enumerate(ALPHABET)}
LETTERS = "abcdefghij"
METHODS = ("gara", "soft_prompt", "graph_text", "no_norm")


class Params(ScheduledParams):
    dataset: Literal["synthetic", "folder"] = Field("synthetic", description="SBM topic graphs, or TAG folders.")
    train_dir: str = Field("", description="folder dataset: TAG folder (nodes.csv, edges.csv) to train on.")
    test_dirs: list[str] = Field(default_factory=list, description="folder dataset: zero-shot test TAG folders.")
    train_topics: list[str] = Field(["music", "law", "cooking", "astronomy", "sports", "medicine"],
                                    description="Topics of the training graphs; the other topics are zero-shot.")
    n_train_graphs: int = Field(120, ge=1, description="Training SBM graphs (6 training topics).")
    n_val_graphs: int = Field(8, ge=1, description="Held-out graphs of training topics (reference accuracy).")
    n_test_graphs: int = Field(24, ge=1, description="Zero-shot SBM graphs over the unseen topics.")
    karate: bool = Field(True, description="Add networkx's karate club (clubs -> two unseen topics) to the test set.")
    nodes_train: tuple[int, int] = Field((40, 80), description="Node count range of training graphs.")
    nodes_test: tuple[int, int] = Field((50, 90), description="Node count range of test graphs.")
    homophily_train: tuple[float, float] = Field((0.6, 0.9), description="Homophily range of training graphs.")
    homophily_test: tuple[float, float] = Field((0.7, 0.95), description="Homophily range of test graphs.")
    degree_train: float = Field(4.0, gt=0, description="Mean degree of training graphs.")
    degree_test: float = Field(6.0, gt=0, description="Mean degree of test graphs (different SBM parameters).")
    words_per_node: int = Field(5, ge=1, description="Words of a node's text.")
    p_noise: float = Field(0.5, ge=0, le=1, description="Probability that a node word comes from another topic.")
    text_encoder: Literal["minilm", "hashed"] = Field("minilm", description="Word embeddings: MiniLM or hashed.")
    max_labels: int = Field(4, ge=2, le=10, description="Letters offered per query.")
    lm_width: int = Field(64, ge=8, description="LM width d.")
    lm_layers: int = Field(2, ge=1, description="LM layers.")
    lm_heads: int = Field(4, ge=1, description="LM attention heads.")
    prompt_chars: int = Field(96, ge=32, description="Length cap of the plain prompt (characters).")
    text_chars: int = Field(256, ge=32, description="Length cap of the graph-as-text prompt (characters).")
    pretrain_steps: int = Field(150, ge=1, description="LM pretraining steps.")
    pretrain_batch: int = Field(16, ge=2, description="Prompts per pretraining step.")
    pretrain_lr: float = Field(3e-3, gt=0, description="LM pretraining learning rate.")
    hops: int = Field(2, ge=1, description="Ego-graph radius.")
    ego_max: int = Field(30, ge=2, description="Ego-graph node cap.")
    rw_steps: int = Field(8, ge=1, description="Random-walk positional encoding steps.")
    hidden: int = Field(64, ge=8, description="GIN width.")
    rank: int = Field(4, ge=1, description="LoRA rank r (generated and fixed).")
    alpha: float = Field(8.0, gt=0, description="LoRA scale alpha (dW = alpha/r B A).")
    rho: float = Field(1.0, gt=0, description="Frobenius-norm bound of each generated dW_l.")
    n_soft: int = Field(8, ge=1, description="Soft prompt tokens of the input-level baseline.")
    steps: int = Field(120, ge=1, description="Training steps of every method (jointly, one engine).")
    batch_size: int = Field(16, ge=2, description="Queries per step.")
    lr: float = Field(3e-3, gt=0, description="Learning rate of encoders, generators and baseline parts.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of every method's trainable parts (the "
                                "same for every arm); bounds the generated B that the scale-invariant norm "
                                "projection would otherwise let grow.")
    n_seeds: int = Field(1, ge=1, description="Independent initialisations of every method (mean reported).")
    val_queries: int = Field(300, ge=1, description="Queries drawn from the held-out training-topic graphs.")
    test_queries: int = Field(0, ge=0, description="Zero-shot queries per test graph (a seeded sample); 0 = all.")


# ---- data --------------------------------------------------------------------------------------------------
def _sbm(rng, topics: list[str], n_range, h_range, degree):
    n = int(rng.integers(n_range[0], n_range[1] + 1))
    k = min(int(rng.integers(3, 5)), len(topics))
    chosen = [topics[i] for i in rng.permutation(len(topics))[:k]]
    sizes = np.diff(np.round(np.linspace(0, n, k + 1)).astype(int)).tolist()
    labels, edges = G.sbm_graph(sizes, G.sbm_probs(sizes, float(rng.uniform(*h_range)), degree),
                                int(rng.integers(1 << 31)))
    return labels, edges, chosen


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    graphs: list[tuple[str, str, np.ndarray, np.ndarray, list[str], list[str]]] = []  # split, family, ...
    if p.dataset == "synthetic":
        test_topics = [t for t in G.TOPICS if t not in p.train_topics]
        plan = [("train", "sbm", p.train_topics, p.nodes_train, p.homophily_train, p.degree_train)] * p.n_train_graphs
        plan += [("val", "sbm", p.train_topics, p.nodes_train, p.homophily_train, p.degree_train)] * p.n_val_graphs
        plan += [("test", "sbm", test_topics, p.nodes_test, p.homophily_test, p.degree_test)] * p.n_test_graphs
        for split, family, topics, n_range, h_range, degree in plan:
            labels, edges, chosen = _sbm(rng, topics, n_range, h_range, degree)
            texts = G.node_texts(labels, [G.TOPICS[t] for t in chosen], p.words_per_node, rng, p.p_noise)
            graphs.append((split, family, labels, edges, chosen, texts))
        if p.karate:
            kc = nx.karate_club_graph()
            labels = np.asarray([int(kc.nodes[v]["club"] != "Mr. Hi") for v in kc.nodes])
            chosen = test_topics[:2]
            texts = G.node_texts(labels, [G.TOPICS[t] for t in chosen], p.words_per_node, rng, p.p_noise)
            graphs.append(("test", "karate", labels, np.asarray(sorted(kc.edges())), chosen, texts))
    else:
        for split, folder in [("train", p.train_dir)] + [("test", f) for f in p.test_dirs]:
            tag = G.load_tag_folder(input_path(folder))
            graphs.append((split, Path(folder).name, tag.label, tag.edges, tag.label_names, tag.text))
    texts_all = [t for g in graphs for t in g[5]]
    names_all = sorted({n for g in graphs for n in g[4]})
    if p.dataset == "synthetic":  # smoke/test: each distinct word through MiniLM once, text = mean of its words
        vec = G.word_vectors([w for t in texts_all for w in t.split()] + names_all, p.text_encoder)
        node_emb = G.mean_text_embedding(texts_all, vec)
        name_emb = np.stack([vec[n] for n in names_all])
    else:
        node_emb = G.text_embeddings(texts_all, p.text_encoder)
        name_emb = G.text_embeddings(names_all, p.text_encoder)
    g_cols = {c: [] for c in ("graph_id", "split", "family", "n_nodes")}
    n_cols = {c: [] for c in ("graph_id", "node_id", "text", "label", "topic_name")}
    e_cols = {c: [] for c in ("graph_id", "src", "dst")}
    l_cols = {c: [] for c in ("graph_id", "letter", "topic_name")}
    for gid, (split, family, labels, edges, chosen, texts) in enumerate(graphs):
        for c, v in zip(g_cols, (gid, split, family, len(labels)), strict=True):
            g_cols[c].append(v)
        n_cols["graph_id"] += [gid] * len(labels)
        n_cols["node_id"] += list(range(len(labels)))
        n_cols["text"] += list(texts)
        n_cols["label"] += labels.tolist()
        n_cols["topic_name"] += [chosen[y] for y in labels]
        e_cols["graph_id"] += [gid] * len(edges)
        e_cols["src"] += edges[:, 0].tolist()
        e_cols["dst"] += edges[:, 1].tolist()
        order = rng.permutation(len(chosen))  # letter order differs from block order
        l_cols["graph_id"] += [gid] * len(chosen)
        l_cols["letter"] += [LETTERS[i] if i < len(LETTERS) else f"x{i}" for i in range(len(chosen))]
        l_cols["topic_name"] += [chosen[i] for i in order]
    write_table(out_dir / "graphs.parquet", g_cols)
    write_table(out_dir / "nodes.parquet", {**n_cols, "embedding": node_emb})
    write_table(out_dir / "edges.parquet", e_cols)
    write_table(out_dir / "label_sets.parquet", l_cols)
    write_table(out_dir / "label_names.parquet", {"topic_name": names_all, "embedding": name_emb})


def encode(text: str, cap: int) -> list[int]:
    return [STOI.get(c, STOI["?"]) for c in text.lower()][:cap]


class Queries:
    """Every node is a query; builds (and caches) its candidate letters, ego-graph features and prompts."""

    def __init__(self, data_dir: Path, p: Params):
        self.p = p
        g, n, e = (read_table(data_dir / f) for f in ("graphs.parquet", "nodes.parquet", "edges.parquet"))
        ls, names = read_table(data_dir / "label_sets.parquet"), read_table(data_dir / "label_names.parquet")
        self.split = dict(zip(g["graph_id"].tolist(), g["split"].tolist(), strict=True))
        self.family = dict(zip(g["graph_id"].tolist(), g["family"].tolist(), strict=True))
        self.gid, self.text, self.topic = n["graph_id"], n["text"].tolist(), n["topic_name"].tolist()
        self.emb = torch.from_numpy(n["embedding"].astype(np.float32))  # (N, 384)
        name_emb = torch.from_numpy(names["embedding"].copy())  # (names, 384)
        self.name_emb = dict(zip(names["topic_name"].tolist(), name_emb, strict=True))
        self.offset = {gid: int(np.flatnonzero(self.gid == gid)[0]) for gid in self.split}
        self.adj = {gid: G.adjacency_lists(np.stack([e["src"][e["graph_id"] == gid], e["dst"][e["graph_id"] == gid]],
                                                    1), int((self.gid == gid).sum())) for gid in self.split}
        self.labels = {gid: ls["topic_name"][ls["graph_id"] == gid].tolist() for gid in self.split}
        self._cache: dict[int, dict] = {}

    def where(self, split: str, family: str | None = None, per_graph: int = 0) -> np.ndarray:
        """Query ids of a split (and family); `per_graph` > 0 keeps a seeded sample of that many per graph."""
        keep = [self.split[g] == split and (family is None or self.family[g] == family) for g in self.gid.tolist()]
        found = np.flatnonzero(keep)
        if per_graph:
            rng = np.random.default_rng(self.p.seed)
            found = np.concatenate([rng.permutation(found[self.gid[found] == g])[:per_graph]
                                    for g in np.unique(self.gid[found])])
        return np.sort(found)

    def candidates(self, q: int) -> list[str]:
        names = self.labels[int(self.gid[q])]
        if len(names) <= self.p.max_labels:
            return names
        rng = np.random.default_rng([self.p.seed, q])
        others = [i for i, t in enumerate(names) if t != self.topic[q]]
        keep = sorted([names.index(self.topic[q]), *rng.choice(others, self.p.max_labels - 1, replace=False)])
        return [names[i] for i in keep]

    def query(self, q: int) -> dict:
        if q in self._cache:
            return self._cache[q]
        p, gid = self.p, int(self.gid[q])
        off, cands = self.offset[gid], self.candidates(q)
        nodes = G.ego_nodes(self.adj[gid], q - off, p.hops, p.ego_max, np.random.default_rng([p.seed, q]))
        local = G.induced_edges(self.adj[gid], nodes)
        ei = G.edge_index(local, len(nodes))
        emb = self.emb[[off + v for v in nodes]]  # (m, 384)
        names = torch.stack([self.name_emb[c] for c in cands])  # (L, 384)
        sims = emb @ names.T  # (m, L): cosine similarity to each lettered label name (the task description)
        sims = F.pad(10 * (sims - sims.mean(1, keepdim=True)), (0, p.max_labels - len(cands)))  # centred, (m, L_max)
        x = torch.cat([emb, G.random_walk_pe(ei, len(nodes), p.rw_steps), sims], 1)
        options = " ".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(cands))
        neigh = " ; ".join(self.text[off + v] for v in nodes[1:])
        edges = " ".join(f"{a}-{b}" for a, b in local.tolist())
        tail = f" | {options} ?"
        body = f"{self.text[q]} | nb: {neigh} | e: {edges}"
        self._cache[q] = out = {
            "graph": Data(x=x, edge_index=ei), "task": names.mean(0),
            "prompt": encode(f"{self.text[q]}{tail}", p.prompt_chars),
            "graph_text": encode(body[: p.text_chars - len(tail)] + tail, p.text_chars),
            "answer": cands.index(self.topic[q]), "n_cands": len(cands)}
        return out

    def batch(self, qs: list[int]) -> dict[str, torch.Tensor]:
        items = [self.query(q) for q in qs]
        n_cands = torch.tensor([it["n_cands"] for it in items])  # (B,)
        out = {"answer": torch.tensor([it["answer"] for it in items]),
               "valid": torch.arange(self.p.max_labels)[None, :] < n_cands[:, None],  # (B, L)
               "task": torch.stack([it["task"] for it in items])}
        for key, cap in (("prompt", self.p.prompt_chars), ("graph_text", self.p.text_chars)):
            ids = np.zeros((len(items), cap), dtype=np.int64)
            for i, it in enumerate(items):
                ids[i, : len(it[key])] = it[key]
            out[key], out[f"{key}_len"] = torch.from_numpy(ids), torch.tensor([len(it[key]) for it in items])
        return out

    def graph_batch(self, qs: list[int]) -> Batch:
        return Batch.from_data_list([self.query(q)["graph"] for q in qs])


# ---- the frozen LM, read functionally so per-sample deltas and prefixes can enter --------------------------
def lm_hidden(lm: TinyLM, ids: torch.Tensor, dq=None, dv=None, prefix=None) -> torch.Tensor:
    """ids (B, T) -> (B, P + T, d). dq/dv: per-layer (B, d, d) additions to W_q/W_v; prefix (B, P, d) tokens."""
    body = lm.body
    h = body.tok(ids) + body.pos(torch.arange(ids.shape[1], device=ids.device))  # (B, T, d)
    if prefix is not None:
        h = torch.cat([prefix, h], 1)  # (B, P + T, d)
    b, t, d = h.shape
    for layer_i, layer in enumerate(body.blocks.layers):
        attn, x = layer.self_attn, layer.norm1(h)
        q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)  # 3 x (B, T, d)
        if dq is not None:
            q = q + torch.einsum("btd,bed->bte", x, dq[layer_i])
            v = v + torch.einsum("btd,bed->bte", x, dv[layer_i])
        heads = attn.num_heads
        q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, d/H)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        h = h + attn.out_proj(o)
        h = h + layer.linear2(layer.activation(layer.linear1(layer.norm2(h))))
    return body.norm(h)


def answer_logits(lm: TinyLM, batch: dict, key: str, valid: torch.Tensor, dq=None, dv=None, prefix=None):
    """Logits of the candidate letters (B, L) at each prompt's last position; absent letters get -1e9."""
    h = lm_hidden(lm, batch[key], dq, dv, prefix)  # (B, P + T, d)
    p_len = 0 if prefix is None else prefix.shape[1]
    last = h[torch.arange(len(h)), p_len + batch[f"{key}_len"] - 1]  # (B, d)
    letters = lm.body.tok.weight[[STOI[c] for c in LETTERS[: valid.shape[1]]]]  # (L, d)
    return (last @ letters.T).masked_fill(~valid, -1e9)


# ---- graph encoder, LoRA generator and baselines -----------------------------------------------------------
class GraphReader(nn.Module):
    """GIN over the ego-graph; attention pooling with the centre node as query; + mean label-name embedding."""

    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.gin = G.GNN("gin", in_dim, hidden, hidden, layers=2)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.task = nn.Linear(G.EMB_DIM, hidden)
        self.out_dim = 2 * hidden
        # the GIN's sums over up to 30 nodes reach activations in the hundreds: unnormalised, one Adam step on the
        # generator moves the generated B by ~1, so the readout is layer-normalised (every arm shares this reader)
        self.norm = nn.LayerNorm(self.out_dim)

    def forward(self, gb: Batch, task: torch.Tensor) -> torch.Tensor:
        h = self.gin(gb.x, gb.edge_index)  # (M, h) over all ego nodes of the batch
        centre = h[gb.ptr[:-1]]  # (B, h): the centre is each ego-graph's first node
        score = (self.k(h) * self.q(centre)[gb.batch]).sum(-1) / h.shape[1] ** 0.5  # (M,)
        pooled = scatter(softmax(score, gb.batch)[:, None] * self.v(h), gb.batch, 0, reduce="sum")  # (B, h)
        return self.norm(torch.cat([pooled, self.task(task)], 1))  # (B, 2h)


class Generated(nn.Module):
    """GaRA: readout -> A_l, B_l for W_q and W_v of every layer; dW = alpha/r B A, Frobenius-projected to rho."""

    def __init__(self, reader: GraphReader, d: int, layers: int, r: int, alpha: float, rho: float):
        super().__init__()
        self.reader, self.d, self.layers, self.r, self.scale, self.rho = reader, d, layers, r, alpha / r, rho
        self.gen = nn.Sequential(nn.Linear(reader.out_dim, 128), nn.ReLU(), nn.Linear(128, layers * 2 * 2 * r * d))
        nn.init.normal_(self.gen[2].weight, std=0.01)
        nn.init.zeros_(self.gen[2].bias)
        with torch.no_grad():  # the generated B starts at exactly 0 (standard LoRA): GaRA starts at the frozen LM
            self.gen[2].weight.view(layers, 2, 2, r * d, -1)[:, :, 1] = 0.0
        # A = A_0 + generated part: with A and B both generated near zero, dW = B A has a vanishing gradient
        self.a0 = nn.Parameter(torch.randn(layers, 2, r, d) / d**0.5)  # (l, q|v, r, d)

    def deltas(self, gb: Batch, task: torch.Tensor):
        """-> dq, dv (lists of (B, d, d) per layer), Frobenius norms before and after the constraint (B, 2 layers)."""
        raw = self.gen(self.reader(gb, task)).view(-1, self.layers, 2, 2, self.r * self.d)  # (B, l, q|v, A|B, r d)
        a = self.a0 + raw[:, :, :, 0].reshape(-1, self.layers, 2, self.r, self.d)  # (B, l, 2, r, d)
        b = raw[:, :, :, 1].reshape(-1, self.layers, 2, self.d, self.r)  # (B, l, 2, d, r)
        dw = self.scale * b @ a  # (B, l, 2, d, d)
        before = dw.flatten(3).norm(dim=-1)  # (B, l, 2)
        if np.isfinite(self.rho):  # the ablation skips it (inf / x would make NaN gradients)
            dw = dw * (self.rho / before.clamp(min=1e-12)).clamp(max=1.0)[..., None, None]
        after = dw.flatten(3).norm(dim=-1)
        return [dw[:, i, 0] for i in range(self.layers)], [dw[:, i, 1] for i in range(self.layers)], before, after


class SoftPrompt(nn.Module):
    """Input-level injection (GraphGPT / LLaGA style): the same readout -> n soft tokens before the prompt."""

    def __init__(self, reader: GraphReader, d: int, n: int):
        super().__init__()
        self.reader, self.n, self.d = reader, n, d
        self.proj = nn.Linear(reader.out_dim, n * d)

    def forward(self, gb: Batch, task: torch.Tensor) -> torch.Tensor:
        return self.proj(self.reader(gb, task)).view(-1, self.n, self.d)  # (B, n, d)


class GraphAsText(nn.Module):
    """A fixed trained LoRA (r) on W_q and W_v; the graph enters only as serialised text."""

    def __init__(self, d: int, layers: int, r: int, alpha: float):
        super().__init__()
        self.a = nn.Parameter(torch.randn(layers, 2, r, d) / d**0.5)  # (l, q|v, r, d)
        self.b = nn.Parameter(torch.zeros(layers, 2, d, r))  # zero: starts at the pretrained LM (standard LoRA)
        self.scale = alpha / r

    def deltas(self, batch_size: int):
        dw = self.scale * self.b @ self.a  # (l, 2, d, d)
        return ([dw[i, 0].expand(batch_size, -1, -1) for i in range(len(dw))],
                [dw[i, 1].expand(batch_size, -1, -1) for i in range(len(dw))])


class Methods(nn.Module):
    """Every trainable part of GaRA, its ablation and the baselines, per seed; the frozen LM stays outside."""

    def __init__(self, p: Params, in_dim: int, lm: TinyLM):
        super().__init__()
        self._lm = [lm]  # a list: not a submodule, so the engine neither owns nor updates it
        d, lay = p.lm_width, p.lm_layers
        nets = {}
        for s in range(p.n_seeds):
            torch.manual_seed(p.seed * 1000 + s)
            nets[f"gara_{s}"] = Generated(GraphReader(in_dim, p.hidden), d, lay, p.rank, p.alpha, p.rho)
            nets[f"no_norm_{s}"] = Generated(GraphReader(in_dim, p.hidden), d, lay, p.rank, p.alpha, float("inf"))
            nets[f"soft_prompt_{s}"] = SoftPrompt(GraphReader(in_dim, p.hidden), d, p.n_soft)
            nets[f"graph_text_{s}"] = GraphAsText(d, lay, p.rank, p.alpha)
        self.nets = nn.ModuleDict(nets)

    def forward(self, gb: Batch, batch: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """-> answer logits (B, L) per network, and dW norms (before, after) of the generated ones. The frozen LM
        reads the networks that share a prompt and an injection (per-layer LoRA deltas or a soft prefix) as one
        batch: one pass per group, each network's rows its own."""
        lm, valid, groups, norms = self._lm[0], batch["valid"], {}, {}
        for name, net in self.nets.items():  # (prompt, injection) -> [(network, dq, dv, prefix)]
            if isinstance(net, Generated):
                dq, dv, before, after = net.deltas(gb, batch["task"])
                groups.setdefault(("prompt", "lora"), []).append((name, dq, dv, None))
                norms[name] = (before, after)
            elif isinstance(net, SoftPrompt):
                groups.setdefault(("prompt", "prefix"), []).append((name, None, None, net(gb, batch["task"])))
            else:
                dq, dv = net.deltas(len(valid))
                groups.setdefault(("graph_text", "lora"), []).append((name, dq, dv, None))
        logits = {}
        for (key, how), members in groups.items():
            n = len(members)
            rows = {key: batch[key].repeat(n, 1), f"{key}_len": batch[f"{key}_len"].repeat(n)}
            layers = range(len(members[0][1])) if how == "lora" else []
            dq = [torch.cat([m[1][i] for m in members]) for i in layers] if how == "lora" else None
            dv = [torch.cat([m[2][i] for m in members]) for i in layers] if how == "lora" else None
            prefix = torch.cat([m[3] for m in members]) if how == "prefix" else None
            out = answer_logits(lm, rows, key, valid.repeat(n, 1), dq, dv, prefix)  # (n B, L)
            logits |= {m[0]: chunk for m, chunk in zip(members, out.chunk(n), strict=True)}
        return {name: logits[name] for name in self.nets}, norms


# ---- training ----------------------------------------------------------------------------------------------
def _build_lm(p: Params) -> TinyLM:
    torch.manual_seed(p.seed)
    return TinyLM(len(ALPHABET), p.lm_width, p.lm_layers, p.lm_heads, max(p.prompt_chars, p.text_chars) + 1)


def train(ctx) -> None:
    p: Params = ctx.params
    qb = Queries(ctx.data_dir, p)
    train_q = qb.where("train")

    def batches(size: int, salt: int):
        def batch_fn(step: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(p.seed * 7919 + salt * 100_003 + step)
            return {"q": torch.from_numpy(train_q)[torch.randint(len(train_q), (size,), generator=g)]}

        return batch_fn

    lm = _build_lm(p)

    def lm_step(engine, b, step):
        batch = qb.batch(b["q"].tolist())
        ids = batch["prompt"]
        full = torch.cat([ids, torch.zeros(len(ids), 1, dtype=torch.long)], 1)  # room for the answer letter
        letters = torch.tensor([STOI[LETTERS[a]] for a in batch["answer"].tolist()])
        full[torch.arange(len(ids)), batch["prompt_len"]] = letters
        logits = engine(full[:, :-1])  # (B, T, V)
        lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), full[:, 1:].reshape(-1), ignore_index=0)
        ans = answer_logits(engine.module, batch, "prompt", batch["valid"])
        ans_loss = F.cross_entropy(ans, batch["answer"])
        return lm_loss + ans_loss, {"answer_loss": float(ans_loss.detach())}

    ctx.fit("lm", ctx.engine(lm, p.pretrain_lr), lm_step, batches(p.pretrain_batch, 0), p.pretrain_steps)
    lm.eval().requires_grad_(False)

    in_dim = G.EMB_DIM + p.rw_steps + p.max_labels
    methods = Methods(p, in_dim, lm)

    def step_fn(engine, b, step):
        qs = b["q"].tolist()
        batch = qb.batch(qs)
        logits, norms = engine(qb.graph_batch(qs), batch)
        answer = batch["answer"]
        losses = {k: F.cross_entropy(v, answer) for k, v in logits.items()}
        metrics = {f"{k}_loss": float(v.detach()) for k, v in losses.items()}
        metrics |= {f"{k}_dw_norm": float(v[0].detach().mean()) for k, v in norms.items()}
        metrics |= {f"{k}_batch_acc": float((v.detach().argmax(-1) == answer).float().mean())
                    for k, v in logits.items()}  # accuracy on training topics over steps (did each arm learn?)
        return sum(losses.values()), metrics

    ctx.progress(f"phase methods: {len(methods.nets)} networks in lock-step over one frozen LM")
    engine = ctx.engine(methods, p.lr, p.weight_decay, arms=methods.nets, steps=p.steps, warmup=p.warmup,
                        decay=p.decay)  # one schedule and decay for every arm
    ctx.fit("methods", engine, step_fn, batches(p.batch_size, 1), p.steps)


# ---- evaluation --------------------------------------------------------------------------------------------
@torch.no_grad()
def _predict(methods: Methods, qb: Queries, qs: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Correctness (n,) per network (plus the frozen LM alone) and dW norms (n,) before/after per generated net."""
    correct: dict[str, list] = {}
    norms: dict[str, list] = {}
    for i in range(0, len(qs), 256):
        chunk = qs[i : i + 256].tolist()
        batch = qb.batch(chunk)
        logits, nrm = methods(qb.graph_batch(chunk), batch)
        logits["lm_only"] = answer_logits(methods._lm[0], batch, "prompt", batch["valid"])
        for k, v in logits.items():
            correct.setdefault(k, []).append((v.argmax(-1) == batch["answer"]).numpy())
        correct.setdefault("n_cands", []).append(batch["valid"].sum(1).numpy())
        for k, (before, after) in nrm.items():
            norms.setdefault(f"{k}|before", []).append(before.mean((1, 2)).numpy())
            norms.setdefault(f"{k}|after", []).append(after.mean((1, 2)).numpy())
    return {k: np.concatenate(v) for k, v in correct.items()}, {k: np.concatenate(v) for k, v in norms.items()}


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    qb = Queries(ctx.data_dir, p)
    methods = ctx.network("methods")  # holds the frozen, pretrained LM it was trained over
    val = qb.where("val")
    val = val[np.random.default_rng(p.seed).permutation(len(val))[: p.val_queries]] if len(val) else val
    families = sorted({qb.family[g] for g in qb.split if qb.split[g] == "test"})
    runs = {f"zs_{f}": _predict(methods, qb, qb.where("test", f, p.test_queries)) for f in families}
    # zero-shot overall = every test query of every family (pooled, not a mean of family means)
    first = next(iter(runs.values()))
    runs["zero_shot"] = tuple({k: np.concatenate([r[i][k] for r in runs.values()]) for k in first[i]} for i in (0, 1))
    if len(val):
        runs["train_topic"] = _predict(methods, qb, val)
    out, table, norm_hist = {}, {}, {}
    for set_name, (correct, norms) in runs.items():
        for m in (*METHODS, "lm_only"):
            accs = [v.mean() for k, v in correct.items() if k.rsplit("_", 1)[0] == m or k == m]
            prefix = "method" if m == "gara" else ("detail/lm_only" if m == "lm_only" else f"baseline/{m}")
            out[f"{prefix}/{set_name}_acc"] = float(np.mean(accs))
            table.setdefault(m, {})[set_name] = float(np.mean(accs))
        if set_name == "zero_shot":
            for m, prefix in (("gara", "method"), ("no_norm", "baseline/no_norm")):
                before = np.concatenate([v for k, v in norms.items() if k.startswith(f"{m}_") and k.endswith("before")])
                after = np.concatenate([v for k, v in norms.items() if k.startswith(f"{m}_") and k.endswith("after")])
                out[f"{prefix}/dw_norm"] = float(after.mean())
                out[f"detail/{m}/dw_norm_unconstrained"] = float(before.mean())
                norm_hist[m] = after
            out["detail/chance/zero_shot_acc"] = float(np.mean(1 / correct["n_cands"]))
    _plots(ctx.plots_dir, table, norm_hist, p.rho)
    return out


def _plots(plots_dir: Path, table: dict, norm_hist: dict, rho: float) -> None:
    import matplotlib.pyplot as plt

    sets = list(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(table)
    for i, (m, accs) in enumerate(table.items()):
        ax.bar(np.arange(len(sets)) + i * width, [accs[s] for s in sets], width, label=m)
    ax.set_xticks(np.arange(len(sets)) + 0.4 - width / 2, sets)
    ax.set(ylabel="accuracy", title="GaRA vs baselines: zero-shot (unseen topics) and training-topic accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plots_dir / "accuracy.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    top = max(max(float(v.max()) for v in norm_hist.values()), rho) * 1.05
    for m, v in norm_hist.items():
        ax.hist(v, bins=np.linspace(0, top, 31), alpha=0.6, label=m)
    ax.axvline(rho, color="k", ls=":", label="rho")
    ax.set(xlabel="mean ||dW_l||_F per query", ylabel="queries", title="Generated LoRA norms (zero-shot queries)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plots_dir / "dw_norms.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="gara",
    title="GaRA: graph-aware LoRA generation for zero-shot graph learning with language models",
    seed="000_2dd18ae8605fb5c1.txt, abstract 14",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/zero_shot_acc", "max"),
    claim=Claim(premises=(  # the comparison tests graph-aware adapters only if the input-level baseline learned
        Compare("baseline/soft_prompt/zero_shot_acc", ">", "detail/chance/zero_shot_acc",
                name="soft_prompt_above_chance"),
        # GaRA starts at the frozen LM (generated B near 0): above the LM alone on held-out graphs of its training
        # topics means its generated weights learned to carry graph information at all
        Compare("method/train_topic_acc", ">", "detail/lm_only/train_topic_acc", name="gara_learned_training_topics"),
    ), all_of=(
        Compare("method/zero_shot_acc", ">", "baseline/soft_prompt/zero_shot_acc"),
    ), context=(
        # nearly built in: the character LM trained from scratch cannot read unseen topic words, and graph-as-text
        # gets no cosine cue to the label names (the encoder's input of GaRA and the soft prompts)
        Compare("method/zero_shot_acc", ">", "baseline/graph_text/zero_shot_acc"),
        Compare("method/zero_shot_acc", ">", "baseline/no_norm/zero_shot_acc"),  # the ablation, reported beside
    ), note="GaRA vs graph-as-text is context: a char LM cannot read unseen topic words and graph-as-text gets no "
            "cosine cue",
    summary="GaRA's zero-shot accuracy beats input-level soft prompts (graph-as-text and the no-norm ablation "
            "beside it)"),
)
