"""Plot helpers several papers share: saving a figure, ROC curves and score histograms (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay the figure out tightly, write it to `path` and free it (pyplot keeps every open figure)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def roc_curves(path: Path, labels: np.ndarray, scores: Mapping[str, np.ndarray], title: str) -> None:
    """One ROC curve per score (higher score = more likely positive), AUROC in the legend."""
    from sklearn.metrics import roc_auc_score, roc_curve

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for name, score in scores.items():
        fpr, tpr, _ = roc_curve(labels, score)
        ax.plot(fpr, tpr, label=f"{name} ({roc_auc_score(labels, score):.3f})", lw=2 if name.startswith("SEI") else 1)
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title=title)
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def split_histogram(path: Path, values: np.ndarray, positive: np.ndarray, names: tuple[str, str], xlabel: str,
                    title: str) -> None:
    """Overlaid histograms of a statistic for the negative and positive groups."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    bins = np.histogram_bin_edges(values, bins=40)
    ax.hist(values[~positive], bins=bins, alpha=0.6, label=names[0], density=True)
    ax.hist(values[positive], bins=bins, alpha=0.6, label=names[1], density=True)
    ax.set(xlabel=xlabel, ylabel="density", title=title)
    ax.legend()
    save_figure(fig, path)
