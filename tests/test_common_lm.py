"""models/common/lm.py: TinyLM starts at chance."""

from __future__ import annotations

import math

import pytest
import torch

from models.common.lm import TinyLM

V = 60  # the language papers' character vocabularies are of this size


@pytest.mark.parametrize(("d", "layers", "heads"), [(16, 1, 2), (32, 1, 4), (64, 2, 4), (256, 6, 8), (512, 8, 8)])
def test_initial_next_token_loss_is_within_10_percent_of_chance(d, layers, heads):
    """The widths of the language papers' profiles (async_rag, gara, skeleton_llm, sslogic, wash: test to full)."""
    torch.manual_seed(0)
    lm = TinyLM(V, d, layers, heads, 65)
    ids = torch.randint(0, V, (16, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = float(lm.loss(ids))
    assert abs(loss - math.log(V)) < 0.1 * math.log(V), loss


def test_residual_projections_are_scaled_by_depth():
    torch.manual_seed(0)
    lm = TinyLM(V, 256, 8, 8, 65)
    block = lm.body.blocks.layers[0]
    assert abs(float(block.linear1.weight.std()) - 0.02) < 0.001
    assert abs(float(block.linear2.weight.std()) - 0.02 / 4) < 0.0005  # 0.02 / sqrt(2 * 8)
    assert float(block.linear1.bias.abs().max()) == 0.0 and float(block.self_attn.in_proj_bias.abs().max()) == 0.0
