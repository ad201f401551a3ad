"""The engine's EMA warms its decay up, so the average forgets the initial weights (tasks/context.py)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tasks.context import ema_decay, ema_with_warmup


def _averaged_after(weights: list[float], decay: float, warmup: bool = True) -> float:
    model = torch.nn.Linear(1, 1, bias=False)
    averaged = AveragedModel(model, multi_avg_fn=ema_with_warmup(decay) if warmup else get_ema_multi_avg_fn(decay))
    for w in weights:
        with torch.no_grad():
            model.weight.fill_(w)
        averaged.update_parameters(model)
    return float(averaged.module.weight)


def test_the_average_is_the_warmed_up_recursion():
    weights = [float(k) for k in range(1, 31)]
    expected = weights[0]  # AveragedModel copies at its first update
    for n, w in enumerate(weights[1:], start=1):
        d = min(0.9, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * w
    assert _averaged_after(weights, 0.9) == pytest.approx(expected, rel=1e-6)


def test_the_first_weights_fade_out_unlike_a_fixed_decay():
    # 220 updates at 0.99 (phaselock's smoke phase): the first weights keep 0.99^219 = 11 % without the warm-up
    first = [1.0] + [0.0] * 219
    assert _averaged_after(first, 0.99, warmup=False) == pytest.approx(0.99 ** 219, rel=1e-4)  # torch's, 11 %
    assert 0 < _averaged_after(first, 0.99) < 1e-3


def test_the_decay_reaches_its_value_and_stays():
    assert ema_decay(0.99, 0) == pytest.approx(0.1)
    assert ema_decay(0.99, 889) < 0.99 and ema_decay(0.99, 900) == 0.99 == ema_decay(0.99, 10**6)
