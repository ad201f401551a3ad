"""A tiny from-scratch language-model kit several language papers share: tokenisers and a small transformer.

- `WordVocab`: whitespace word vocabulary with [PAD]/[UNK] (sentence encoders over template text).
- `BPETokenizer`: byte-pair encoding over characters; `train_bpe` learns merges by pair frequency (Sennrich et al.),
  `encode` applies them in merge-rank order; zero merges is a character tokeniser.
- `TinyTransformer`: token + position embeddings, pre-norm `nn.TransformerEncoderLayer`s, final LayerNorm; causal
  or bidirectional. `TinyLM` adds a tied next-token head (GPT-2's initialisation, `gpt2_init`); `SentenceEncoder`
  mean-pools non-pad positions.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

PAD, UNK = "[PAD]", "[UNK]"


class WordVocab:
    def __init__(self, texts: list[str], extra: tuple[str, ...] = ()):
        words = sorted({w for t in texts for w in t.split()} | set(extra))
        self.itos = [PAD, UNK, *words]
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, texts: list[str], max_len: int) -> torch.Tensor:
        """(len(texts), max_len) int64, right-padded with 0, truncated at max_len."""
        out = torch.zeros(len(texts), max_len, dtype=torch.long)
        for i, t in enumerate(texts):
            ids = [self.stoi.get(w, 1) for w in t.split()][:max_len]
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


def train_bpe(texts: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Learn `num_merges` merges over characters (words keep their leading space, GPT-2 style pre-split)."""
    words = Counter()
    for t in texts:
        for i, w in enumerate(t.split(" ")):
            words[tuple((" " + w) if i else w)] += 1
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:], strict=False):
                pairs[a, b] += c
        if not pairs:
            break
        best = max(pairs, key=lambda ab: (pairs[ab], ab))  # ties broken by the pair itself: deterministic
        merges.append(best)
        words = Counter({_merge(w, best): c for w, c in words.items()})
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


class BPETokenizer:
    """Vocabulary = the alphabet, then one token per merge. `encode` merges greedily by rank within each word."""

    def __init__(self, alphabet: str, merges: list[tuple[str, str]]):
        self.merges = [tuple(m) for m in merges]
        self.rank = {m: r for r, m in enumerate(self.merges)}
        self.itos = list(dict.fromkeys([*alphabet, *(a + b for a, b in self.merges)]))
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self._cache: dict[str, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self.itos)

    def _word(self, w: str) -> tuple[str, ...]:
        if w not in self._cache:
            word = tuple(w)
            while len(word) > 1:
                r, pair = min((self.rank.get(p, 1 << 30), p) for p in zip(word, word[1:], strict=False))
                if r == 1 << 30:
                    break
                word = _merge(word, pair)
            self._cache[w] = word
        return self._cache[w]

    def tokens(self, text: str) -> list[str]:
        """Canonical tokenisation: split before spaces (a word keeps its leading space), merge within words."""
        out: list[str] = []
        for i, w in enumerate(text.split(" ")):
            out.extend(self._word((" " + w) if i else w))
        return out

    def encode(self, text: str) -> list[int]:
        return [self.stoi[t] for t in self.tokens(text)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids)


class TinyTransformer(nn.Module):
    def __init__(self, vocab_size: int, d: int, layers: int, heads: int, max_len: int, causal: bool):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.causal, self.max_len = causal, max_len

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """ids (B, T) -> hidden (B, T, d); `pad` (B, T) true at padding positions."""
        t = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))  # (B, T, d)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device) if self.causal else None
        return self.norm(self.blocks(h, mask=mask, src_key_padding_mask=pad, is_causal=self.causal))


class TinyLM(nn.Module):
    """Decoder-only LM: next-token logits with the output head tied to the token embedding. Initialised as GPT-2
    (and nanoGPT): weights and embeddings normal(0, 0.02), the residual projections (attention output, second MLP
    layer) normal(0, 0.02 / sqrt(2 * layers)), biases zero, so the first next-token loss is near ln V."""

    def __init__(self, vocab_size: int, d: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.body = TinyTransformer(vocab_size, d, layers, heads, max_len, causal=True)
        gpt2_init(self, layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body(ids) @ self.body.tok.weight.T  # (B, T, V)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over ids (B, T)."""
        logits = self(ids[:, :-1])  # (B, T-1, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gpt2_init(model: nn.Module, layers: int, std: float = 0.02) -> None:
    """GPT-2's initialisation of a stack of `layers` nn.TransformerEncoderLayer blocks (with embeddings)."""
    residual = std / math.sqrt(2 * layers)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.MultiheadAttention):
            nn.init.normal_(module.in_proj_weight, 0.0, std)
            nn.init.zeros_(module.in_proj_bias)
    for module in model.modules():  # after the loop above: attention's out_proj is an nn.Linear too
        if isinstance(module, nn.TransformerEncoderLayer):
            nn.init.normal_(module.self_attn.out_proj.weight, 0.0, residual)
            nn.init.normal_(module.linear2.weight, 0.0, residual)


class SentenceEncoder(nn.Module):
    """Bidirectional encoder, mean pooling over non-pad tokens, L2-normalised (B, d)."""

    def __init__(self, vocab_size: int, d: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.body = TinyTransformer(vocab_size, d, layers, heads, max_len, causal=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0  # (B, T)
        h = self.body(ids, pad)  # (B, T, d)
        keep = (~pad).unsqueeze(-1).float()
        return F.normalize((h * keep).sum(1) / keep.sum(1).clamp(min=1), dim=-1)


def info_nce(a: torch.Tensor, b: torch.Tensor, temperature: float) -> torch.Tensor:
    """Symmetric in-batch InfoNCE over normalised pairs a, b (B, d): row i's positive is column i."""
    logits = a @ b.T / temperature  # (B, B)
    target = torch.arange(len(a), device=a.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
