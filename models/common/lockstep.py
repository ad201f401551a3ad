"""Train several independent networks as one module, so one DeepSpeed engine (and its start-up) serves them all.

With a summed loss each network's gradient is exactly its own loss's gradient and AdamW is per-parameter; handed to
the engine as its arms (`ctx.engine(model, lr, arms=model.nets)`), each network is also clipped on its own, so the
networks train as they would apart (STACK-NOTES: "Many networks in one paper").
"""

from __future__ import annotations

import torch
from torch import nn


class LockStep(nn.Module):
    def __init__(self, nets: dict[str, nn.Module]):
        super().__init__()
        self.nets = nn.ModuleDict(nets)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: net(x) for name, net in self.nets.items()}


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over entries where `mask` is true (0 when none are)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
