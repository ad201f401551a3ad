"""Similarity of two representations of the same samples."""

from __future__ import annotations

import numpy as np


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA (Kornblith et al. 2019) of features x (N, Dx) and y (N, Dy): 1 for views equal up to rotation,
    isotropic scale and shift; near 0 for unrelated ones."""
    x, y = x - x.mean(0), y - y.mean(0)
    return float(np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))
