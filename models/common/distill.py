"""Dataset-distillation machinery: the image loaders of the full profiles, the standard ConvNet-3 (observer and
evaluation network), shift / flip augmentation, the RBF-kernel MMD and herding selection (Welling 2009).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def load_cifar10(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cifar-10-batches-py: data_batch_* (train) and test_batch; pixels (N, 3, 32, 32) in [0, 1], labels, is_test."""
    xs, ys, test = [], [], []
    for path in sorted(folder.glob("data_batch_*")) + [folder / "test_batch"]:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        xs.append(np.asarray(batch[b"data"], np.float32).reshape(-1, 3, 32, 32) / 255.0)
        ys.append(np.asarray(batch[b"labels"], np.int64))
        test.append(np.full(len(ys[-1]), path.name == "test_batch"))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(test)


def load_imagenette(folder: Path, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ImageNette layout: train/<class>/*, val/<class>/*; RGB resized to size x size."""
    from PIL import Image

    classes = sorted(d.name for d in (folder / "train").iterdir() if d.is_dir())
    xs, ys, test = [], [], []
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            for path in sorted((folder / split / name).iterdir()):
                img = Image.open(path).convert("RGB").resize((size, size))
                xs.append(np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0)
                ys.append(c)
                test.append(split == "val")
    return np.stack(xs), np.asarray(ys, np.int64), np.asarray(test)


class ConvNet3(nn.Module):
    """The dataset-distillation ConvNet: 3 x [conv 3x3, instance norm, ReLU, avg-pool 2], then a linear head."""

    def __init__(self, channels: int, width: int, n_classes: int, size: int):
        super().__init__()
        layers, c = [], channels
        for _ in range(3):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.GroupNorm(width, width, affine=True), nn.ReLU(),
                       nn.AvgPool2d(2)]
            c = width
        self.features = nn.Sequential(*layers, nn.Flatten())  # (B, width * (size / 8)^2)
        self.head = nn.Linear(width * (size // 8) ** 2, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def augment(x: torch.Tensor, g: torch.Generator, flip: bool, shift: int = 2) -> torch.Tensor:
    """Random shift by up to `shift` pixels (zero padding, crop) and, for natural images, horizontal flip."""
    b, c, h, w = x.shape
    padded = F.pad(x, (shift,) * 4, value=-1.0)
    dx, dy = torch.randint(0, 2 * shift + 1, (2, b), generator=g)
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None]  # (B, 1, H, 1): image i's crop rows
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :]  # (B, 1, 1, W)
    out = padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]  # one gather
    if flip:
        mirror = torch.rand(b, generator=g) < 0.5
        out[mirror] = out[mirror].flip(-1)
    return out


def rbf(a: torch.Tensor, b: torch.Tensor, bandwidth: float) -> torch.Tensor:
    return torch.exp(-torch.cdist(a, b).pow(2) / (2 * bandwidth**2))


def herding(feats: torch.Tensor, k: int) -> torch.Tensor:
    """Welling's herding: greedily pick samples whose running mean tracks the class mean."""
    return herding_many([feats], k)[0]


def herding_many(feats: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """`herding` of several sets (one per class) at once: the greedy steps of all sets run together on their
    features zero-padded to the largest set (padding is never picked), each set's arithmetic unchanged. The picks
    for k are the first k of any larger k."""
    n, m = len(feats), max(len(f) for f in feats)
    x, taken = torch.zeros(n, m, feats[0].shape[1]), torch.ones(n, m, dtype=torch.bool)
    for i, f in enumerate(feats):
        x[i, : len(f)], taken[i, : len(f)] = f, False
    mu = torch.stack([f.mean(0) for f in feats])[:, None]  # (n, 1, F)
    rows, total = torch.arange(n), torch.zeros(n, 1, x.shape[2])
    chosen = []
    for t in range(k):
        dist = (mu - (total + x) / (t + 1)).norm(dim=2).masked_fill(taken, float("inf"))  # (n, m)
        best = dist.argmin(1)  # the first minimum, as for one set
        chosen.append(best)
        taken[rows, best] = True
        total += x[rows, best][:, None]
    return list(torch.stack(chosen, 1)) if chosen else [torch.zeros(0, dtype=torch.long)] * n


def mmd2(a: torch.Tensor, b: torch.Tensor) -> float:
    bandwidth = float(torch.cdist(b, b).median().clamp(min=1e-6))
    return float(rbf(a, a, bandwidth).mean() + rbf(b, b, bandwidth).mean() - 2 * rbf(a, b, bandwidth).mean())
