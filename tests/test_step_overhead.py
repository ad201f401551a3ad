"""The training loop's fixed costs a step are cut without changing a single bit of what it trains: the per-step
seed touches only the generators the step draws from, and a one-rank engine skips DeepSpeed's gradient all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from models.contract import PaperParams


def test_seed_step_leaves_the_cpu_generator_as_manual_seed_does():
    from tasks.context import seed_step

    torch.manual_seed(12345)
    expected_state = torch.get_rng_state()
    expected_draw = torch.nn.functional.dropout(torch.ones(64), 0.5)
    torch.manual_seed(0)  # some other state in between
    seed_step(12345, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), expected_state)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), expected_draw)


def _train(tmp_path, allreduce: bool | None) -> tuple[dict[str, torch.Tensor], bool]:
    """12 steps of a dropout MLP on one rank, ZeRO 0, clipped; `allreduce` forces DeepSpeed's gradient all-reduce
    on or off (None: as `engine` sets it)."""
    from tasks.context import TrainContext

    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 1))
    ctx = TrainContext(params=PaperParams(checkpoint_every=5), data_dir=tmp_path, out_dir=tmp_path)
    engine = ctx.engine(net, 1e-2, grad_clip=0.5, steps=12, warmup=2, decay="cosine")
    chosen = engine.enable_backward_allreduce
    if allreduce is not None:
        engine.enable_backward_allreduce = allreduce

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=g)
        return {"x": x, "y": 3 * x.sum(1, keepdim=True)}

    def step_fn(engine, batch, step):
        return torch.nn.functional.mse_loss(engine(batch["x"]), batch["y"]), {}

    ctx.fit("net", engine, step_fn, batch, 12)
    return {k: v.clone() for k, v in engine.module.state_dict().items()}, chosen


def test_one_rank_engine_skips_the_all_reduce_and_trains_bitwise_the_same(tmp_path):
    from tasks.worker import _init_distributed

    _init_distributed()
    skipped, chosen = _train(tmp_path / "skipped", None)
    assert chosen is False, "a one-rank ZeRO-0 engine should not all-reduce its gradients"
    reduced, _ = _train(tmp_path / "reduced", True)
    assert skipped.keys() == reduced.keys()
    assert all(torch.equal(skipped[k], reduced[k]) for k in skipped)
    torch.manual_seed(3)
    untrained = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 1)).state_dict()
    assert not torch.equal(skipped["0.weight"], untrained["0.weight"])  # it did train
