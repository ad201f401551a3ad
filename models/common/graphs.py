"""Text-attributed graphs (TAGs) several papers share: topic vocabularies, SBM generators, node text, positional
encodings, ego-graphs, GNN encoders and the loader for real TAG tables.

- `TOPICS`, `GENERIC`: ten topics of twelve real English words each (so MiniLM embeddings carry topic meaning) and
  topic-free filler words.
- `sbm_probs`, `sbm_graph`: networkx stochastic block models with the edge probabilities set for a target homophily
  (fraction of intra-block edges) and mean degree; `rewire_edges` replaces a fraction of edges by uniform ones.
- `node_texts`: per node `n_words` words drawn from its class's topic words (share `topic_share`, the rest generic),
  each topic word swapped for another class's word with probability `word_noise`.
- `word_vectors`, `mean_text_embedding`: per-word MiniLM embeddings (each word encoded once) or hashed random
  vectors (tests), and a text's embedding as the normalised mean of its words' vectors.
- `edge_index`: undirected torch_geometric edge index; `ego_nodes`: a centre node's k-hop neighbourhood (BFS order,
  centre first, truncated); `random_walk_pe` (torch_geometric's AddRandomWalkPE) and `laplacian_pe` (deterministic
  eigenvectors of the normalised Laplacian, sign fixed).
- `GNN`: GCN / GIN / GAT stacks over torch_geometric convolutions, returning every layer's output when asked.
- `load_tag_folder`, `write_tag_fixture`: real TAGs as `nodes.csv` (node_id, text, label, split) and `edges.csv`
  (src, dst), the format the full profiles read (Cora / PubMed / ogbn-arxiv TAG exports), and a tiny fixture of it.
"""

from __future__ import annotations

import csv
import zlib
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import numpy as np
import torch
from torch import nn
from torch_geometric.data import Data
from torch_geometric.nn import GATConv, GCNConv, GINConv
from torch_geometric.transforms import AddRandomWalkPE
from torch_geometric.utils import to_undirected

TOPICS: dict[str, tuple[str, ...]] = {
    "music": ("guitar", "melody", "drum", "piano", "violin", "chorus", "rhythm", "song", "concert", "singer", "album",
              "tune"),
    "law": ("court", "judge", "lawyer", "verdict", "trial", "statute", "jury", "attorney", "lawsuit", "contract",
            "appeal", "witness"),
    "cooking": ("recipe", "oven", "flour", "bake", "spice", "kitchen", "chef", "soup", "sauce", "roast", "dough",
                "simmer"),
    "astronomy": ("planet", "galaxy", "telescope", "orbit", "comet", "nebula", "star", "asteroid", "cosmos", "meteor",
                  "lunar", "eclipse"),
    "sports": ("football", "goal", "player", "tennis", "coach", "stadium", "match", "soccer", "team", "referee",
               "league", "athlete"),
    "medicine": ("doctor", "patient", "surgery", "vaccine", "nurse", "clinic", "disease", "therapy", "hospital",
                 "symptom", "dose", "fever"),
    "finance": ("bank", "stock", "investor", "loan", "market", "profit", "dividend", "credit", "budget", "interest",
                "bond", "capital"),
    "botany": ("flower", "leaf", "seed", "root", "petal", "plant", "stem", "garden", "tree", "blossom", "fern",
               "moss"),
    "computing": ("software", "computer", "algorithm", "code", "processor", "keyboard", "database", "network",
                  "program", "server", "laptop", "compiler"),
    "ocean": ("wave", "coral", "whale", "tide", "shark", "reef", "sailor", "harbor", "fish", "boat", "beach",
              "seaweed"),
}
GENERIC = ("the", "a", "about", "with", "many", "some", "new", "often", "report", "study", "people", "thing",
           "various", "general", "common", "several", "time", "way", "notes", "page")
EMB_DIM = 384  # all-MiniLM-L6-v2


# ---- generators --------------------------------------------------------------------------------------------
def sbm_probs(sizes: list[int], homophily: float, mean_degree: float) -> np.ndarray:
    """Block probability matrix whose expected intra-edge share is `homophily` and mean degree `mean_degree`."""
    sizes_a = np.asarray(sizes, dtype=np.float64)
    n = sizes_a.sum()
    pairs_in = (sizes_a * (sizes_a - 1) / 2).sum()
    pairs_out = (n * n - (sizes_a**2).sum()) / 2
    edges = n * mean_degree / 2
    p_in = min(1.0, homophily * edges / max(pairs_in, 1))
    p_out = min(1.0, (1 - homophily) * edges / max(pairs_out, 1))
    return np.where(np.eye(len(sizes), dtype=bool), p_in, p_out)


def sbm_graph(sizes: list[int], probs: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """networkx SBM -> (labels (n,) block ids, edges (E, 2) with src < dst)."""
    g = nx.stochastic_block_model(sizes, probs.tolist(), seed=seed)
    labels = np.asarray([g.nodes[v]["block"] for v in range(g.number_of_nodes())], dtype=np.int64)
    edges = np.asarray(sorted((min(a, b), max(a, b)) for a, b in g.edges()), dtype=np.int64).reshape(-1, 2)
    return labels, edges


def rewire_edges(edges: np.ndarray, n: int, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Replace `fraction` of the edges by uniformly random ones (structure noise); returns (edges, is_noise)."""
    edges = edges.copy()
    chosen = rng.choice(len(edges), size=round(fraction * len(edges)), replace=False)
    existing = {tuple(e) for e in edges.tolist()}
    for i in chosen:
        while True:
            a, b = sorted(rng.choice(n, size=2, replace=False).tolist())
            if (a, b) not in existing:
                break
        existing.discard(tuple(edges[i]))
        existing.add((a, b))
        edges[i] = (a, b)
    is_noise = np.zeros(len(edges), dtype=bool)
    is_noise[chosen] = True
    return edges, is_noise


def node_texts(text_class: np.ndarray, topic_words: list[tuple[str, ...]], n_words: int, rng: np.random.Generator,
               word_noise: float = 0.0, topic_share: float = 1.0, generic: tuple[str, ...] = GENERIC) -> list[str]:
    """One text per node: each word is a topic word of the node's class with probability `topic_share` (else a
    generic word); a topic word comes from a uniformly drawn other class with probability `word_noise`."""
    k = len(topic_words)
    texts = []
    for c in text_class.tolist():
        words = []
        for _ in range(n_words):
            if rng.random() >= topic_share:
                words.append(generic[rng.integers(len(generic))])
                continue
            src = (c + rng.integers(1, k)) % k if (k > 1 and rng.random() < word_noise) else c
            words.append(topic_words[src][rng.integers(len(topic_words[src]))])
        texts.append(" ".join(words))
    return texts


# ---- text features -----------------------------------------------------------------------------------------
def word_vectors(words: list[str], encoder: str) -> dict[str, np.ndarray]:
    """Each distinct word embedded once: "minilm" (all-MiniLM-L6-v2, offline) or "hashed" (random unit vectors
    seeded by the word, for tests that must not load MiniLM)."""
    words = sorted(set(words))
    if encoder == "minilm":
        from models.common.text import encode_sentences

        return dict(zip(words, encode_sentences(words), strict=True))
    out = {}
    for w in words:
        v = np.random.default_rng(zlib.crc32(w.encode())).standard_normal(EMB_DIM).astype(np.float32)
        out[w] = v / np.linalg.norm(v)
    return out


def mean_text_embedding(texts: list[str], vectors: dict[str, np.ndarray]) -> np.ndarray:
    """(len(texts), 384): normalised mean of the word vectors (MiniLM's own pooling is a mean too)."""
    out = np.stack([np.mean([vectors[w] for w in t.split()], axis=0) for t in texts]).astype(np.float32)
    return out / np.linalg.norm(out, axis=1, keepdims=True).clip(min=1e-8)


def text_embeddings(texts: list[str], encoder: str) -> np.ndarray:
    """Whole-text embeddings: each distinct text through MiniLM once ("minilm"), or the hashed word mean."""
    if encoder != "minilm":
        return mean_text_embedding(texts, word_vectors([w for t in texts for w in t.split()], encoder))
    from models.common.text import encode_sentences

    distinct = sorted(set(texts))
    emb = dict(zip(distinct, encode_sentences(distinct), strict=True))
    return np.stack([emb[t] for t in texts])


# ---- structure ---------------------------------------------------------------------------------------------
def edge_index(edges: np.ndarray, n: int) -> torch.Tensor:
    """(E, 2) undirected edge list -> torch_geometric edge_index (2, 2E), both directions, sorted."""
    ei = torch.as_tensor(np.asarray(edges, dtype=np.int64).reshape(-1, 2).T.copy())
    return to_undirected(ei, num_nodes=n)


def adjacency_lists(edges: np.ndarray, n: int) -> list[list[int]]:
    adj: list[list[int]] = [[] for _ in range(n)]
    for a, b in np.asarray(edges).reshape(-1, 2).tolist():
        if a != b:
            adj[a].append(b)
            adj[b].append(a)
    return [sorted(set(a)) for a in adj]


def ego_nodes(adj: list[list[int]], center: int, hops: int, max_nodes: int, rng: np.random.Generator) -> list[int]:
    """Centre first, then its 1-hop, 2-hop ... neighbours (each ring shuffled by `rng`), truncated to max_nodes."""
    seen, out, ring = {center}, [center], [center]
    for _ in range(hops):
        nxt = sorted({u for v in ring for u in adj[v]} - seen)
        nxt = [nxt[i] for i in rng.permutation(len(nxt))]
        seen.update(nxt)
        out.extend(nxt)
        ring = nxt
    return out[:max_nodes]


def induced_edges(adj: list[list[int]], nodes: list[int]) -> np.ndarray:
    """Local (E, 2) edges of the subgraph induced by `nodes` (ids relabelled to positions in `nodes`)."""
    pos = {v: i for i, v in enumerate(nodes)}
    return np.asarray([(pos[v], pos[u]) for v in nodes for u in adj[v] if u in pos and pos[v] < pos[u]],
                      dtype=np.int64).reshape(-1, 2)


def random_walk_pe(ei: torch.Tensor, n: int, steps: int) -> torch.Tensor:
    """(n, steps): return probability of a k-step random walk, k = 1..steps (Dwivedi et al. RWPE)."""
    data = AddRandomWalkPE(walk_length=steps, attr_name="pe")(Data(edge_index=ei, num_nodes=n))
    return data.pe.float()


def laplacian_pe(edges: np.ndarray, n: int, k: int) -> np.ndarray:
    """(n, k): eigenvectors of the symmetric normalised Laplacian for the k smallest non-trivial eigenvalues,
    each with its largest-magnitude entry made positive (a deterministic sign); zero-padded when n <= k."""
    import scipy.sparse as sp

    e = np.asarray(edges).reshape(-1, 2)
    a = sp.coo_matrix((np.ones(2 * len(e)), (np.r_[e[:, 0], e[:, 1]], np.r_[e[:, 1], e[:, 0]])), shape=(n, n)).tocsr()
    a.data[:] = 1.0  # duplicate edges count once
    d = np.asarray(a.sum(1)).ravel()
    inv = sp.diags(np.where(d > 0, 1 / np.sqrt(d.clip(min=1e-12)), 0.0))
    lap = sp.eye(n) - inv @ a @ inv
    if n <= 2000:
        _, vec = np.linalg.eigh(lap.toarray())  # ascending
    else:  # large graphs (full profiles): Lanczos from a fixed start vector, deterministic
        from scipy.sparse.linalg import eigsh

        val, vec = eigsh(lap, k=min(k + 1, n - 1), which="SA", v0=np.ones(n) / np.sqrt(n))
        vec = vec[:, np.argsort(val)]
    vec = vec[:, 1 : k + 1]
    vec = vec * np.sign(vec[np.abs(vec).argmax(0), np.arange(vec.shape[1])])[None, :]
    return np.pad(vec, ((0, 0), (0, k - vec.shape[1]))).astype(np.float32)


# ---- encoders ----------------------------------------------------------------------------------------------
class GNN(nn.Module):
    """`layers` message-passing layers (GCN, GIN or GAT with `heads` concatenated heads), ReLU between them."""

    def __init__(self, kind: str, in_dim: int, hidden: int, out_dim: int, layers: int = 2, heads: int = 4):
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]

        def conv(i: int, o: int, last: bool) -> nn.Module:
            if kind == "gcn":
                return GCNConv(i, o)
            if kind == "gin":
                return GINConv(nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o)), train_eps=True)
            if kind == "gat":
                return GATConv(i, o, heads=1) if last else GATConv(i, o // heads, heads=heads)
            raise ValueError(f"unknown GNN kind {kind!r}")

        self.convs = nn.ModuleList(conv(i, o, j == layers - 1) for j, (i, o) in enumerate(zip(dims, dims[1:],
                                                                                                strict=False)))

    def forward(self, x: torch.Tensor, ei: torch.Tensor, all_layers: bool = False):
        """x (n, in) -> (n, out), or the list of every layer's output (after ReLU except the last)."""
        outs = []
        for j, conv in enumerate(self.convs):
            x = conv(x, ei)
            if j < len(self.convs) - 1:
                x = torch.relu(x)
            outs.append(x)
        return outs if all_layers else x


# ---- real TAG tables ---------------------------------------------------------------------------------------
@dataclass
class TAG:
    text: list[str]
    label: np.ndarray  # (n,) class ids
    label_names: list[str]
    split: np.ndarray  # (n,) "train" / "val" / "test" (empty strings when the file has none)
    edges: np.ndarray  # (E, 2) node positions


def load_tag_folder(folder: Path) -> TAG:
    """`nodes.csv` (node_id, text, label[, split]) and `edges.csv` (src, dst) -> TAG; labels may be names or ids."""
    folder = Path(folder)
    for name in ("nodes.csv", "edges.csv"):
        if not (folder / name).exists():
            raise FileNotFoundError(f"{folder / name} missing: a TAG folder holds nodes.csv and edges.csv")
    with open(folder / "nodes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    missing = {"node_id", "text", "label"} - set(rows[0] if rows else {})
    if missing:
        raise ValueError(f"{folder / 'nodes.csv'} lacks columns {sorted(missing)}")
    pos = {r["node_id"]: i for i, r in enumerate(rows)}
    names = sorted({r["label"] for r in rows})
    with open(folder / "edges.csv", newline="") as f:
        edges = [(pos[r["src"]], pos[r["dst"]]) for r in csv.DictReader(f) if r["src"] in pos and r["dst"] in pos]
    return TAG(text=[r["text"].lower() for r in rows], label=np.asarray([names.index(r["label"]) for r in rows]),
               label_names=names, split=np.asarray([r.get("split", "") or "" for r in rows]),
               edges=np.asarray(sorted({(min(a, b), max(a, b)) for a, b in edges if a != b}),
                                dtype=np.int64).reshape(-1, 2))


def write_tag_fixture(folder: Path, n: int = 10, topics: tuple[str, ...] = ("music", "law"), seed: int = 0) -> None:
    """A tiny TAG in the `load_tag_folder` format (ring plus chords; texts from the topics' words)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(topics)
    texts = node_texts(labels, [TOPICS[t] for t in topics], 4, rng)
    splits = ["train", "val", "test", "test", "train"]
    with open(folder / "nodes.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["node_id", "text", "label", "split"])
        for i in range(n):
            w.writerow([f"n{i}", texts[i], topics[labels[i]], splits[i % len(splits)]])
    with open(folder / "edges.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["src", "dst"])
        for i in range(n):
            w.writerow([f"n{i}", f"n{(i + 1) % n}"])
            w.writerow([f"n{i}", f"n{(i + 2) % n}"])
