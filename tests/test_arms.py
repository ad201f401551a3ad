"""Arms in one engine train as they would alone; the schedule, the EMA and the plateau of `TrainContext.fit`.

Real DeepSpeed engines on gloo ranks (spawned processes, 1 and 2 ranks, ZeRO 0 and 1), compared bitwise through the
networks `fit` saves."""

from __future__ import annotations

import copy
import json
import math
import os
import socket
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.contract import PaperParams
from tasks.context import loss_plateau, network_file

STEPS = 12


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return {"x": x, "y": 3 * x.sum(1, keepdim=True)}  # gradient norms well above the clip: it acts every step


def train_phase(out_dir: Path, zero_stage: int, names: tuple[str, ...], *, arms: bool = True,
                grad_clip: float | None = 0.5, rank: int = 0, world_size: int = 1, lrs: list | None = None,
                checkpoint_every: int = 100, **schedule) -> None:
    """One phase over arms `names` ("a" trains on loss x 1, "b" on loss x 1,000), saved by `fit` in `out_dir`.
    `arms=False`: the same networks as one engine clipped together (the coupling arms remove)."""
    from tasks.context import TrainContext

    ctx = TrainContext(params=PaperParams(zero_stage=zero_stage, checkpoint_every=checkpoint_every),
                       data_dir=out_dir, out_dir=out_dir, rank=rank, world_size=world_size)
    model = nn.ModuleDict({n: _net(seed) for n, seed in (("a", 1), ("b", 2)) if n in names})
    engine = ctx.engine(model, 1e-2, 0.01, arms=dict(model.items()) if arms else None, grad_clip=grad_clip,
                        **schedule)

    def step_fn(engine, batch, step):
        if lrs is not None:
            lrs.append(engine.get_lr()[0])
        scale = {"a": 1.0, "b": 1000.0}
        loss = sum(scale[n] * F.mse_loss(net(batch["x"]), batch["y"]) for n, net in engine.module.items())
        return loss, {}

    ctx.fit("arms", engine, step_fn, _batch, STEPS)


SCHEDULE = {"steps": STEPS, "warmup": 3, "decay": "cosine", "ema": 0.9}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    root = Path(out)
    for zero in (0, 1):
        for label, names in (("beside", ("a", "b")), ("alone", ("a",))):
            train_phase(root / f"z{zero}-{label}", zero, names, rank=rank, world_size=world, **SCHEDULE)
    if world == 1:  # the controls: one engine clipped as a whole; the arm unclipped; the schedule's rates
        train_phase(root / "together", 0, ("a", "b"), arms=False, **SCHEDULE)
        with mock.patch("tasks.context._clip_in_optimizer", lambda has_arms, world, zero: has_arms):
            train_phase(root / "together_deepspeed_clip", 0, ("a", "b"), arms=False, **SCHEDULE)  # as before
        train_phase(root / "unclipped", 0, ("a",), grad_clip=None, **SCHEDULE)
        lrs: list[float] = []
        train_phase(root / "lrs", 0, ("a",), lrs=lrs, **SCHEDULE)
        (root / "lrs.json").write_text(json.dumps(lrs))


def _spawn(world: int, out: Path) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, str(out)), nprocs=world, join=True)


def _arm(folder: Path, name: str = "a", ema: bool = False) -> dict[str, torch.Tensor]:
    module = torch.load(folder / network_file("arms", ema), weights_only=False)["module"]
    return module[name].state_dict()


def _equal(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("world", [1, 2])
def test_an_arm_beside_a_1000x_arm_trains_bitwise_as_alone(world, tmp_path):
    _spawn(world, tmp_path)
    for zero in (0, 1):
        beside, alone = tmp_path / f"z{zero}-beside", tmp_path / f"z{zero}-alone"
        assert _equal(_arm(beside), _arm(alone)), f"ZeRO {zero}, {world} rank(s): the arm moved with its neighbour"
        assert _equal(_arm(beside, ema=True), _arm(alone, ema=True))
        assert not _equal(_arm(beside), _arm(beside, ema=True))  # the EMA is an average, not the last step
    if world == 1:
        from flows.serving import load_networks
        from tasks.context import EvalContext

        folder = tmp_path / "z0-beside"
        ctx = EvalContext(params=PaperParams(), data_dir=folder, out_dir=folder, plots_dir=folder)
        assert _equal(ctx.network("arms", ema=True)["a"].state_dict(), _arm(folder, ema=True))
        assert not ctx.network("arms").training
        assert list(load_networks(folder)) == list(load_networks(folder, ema=True)) == ["arms"]  # no "arms.ema"
        with pytest.raises(FileNotFoundError, match="no such network"):
            ctx.network("other")
        alone = _arm(tmp_path / "z0-alone")
        assert not _equal(_arm(tmp_path / "together"), alone), "a global clip couples the arms (the control)"
        for name in ("a", "b"):  # one rank, no ZeRO: the optimizer clips the whole model bitwise as DeepSpeed did
            assert _equal(_arm(tmp_path / "together", name), _arm(tmp_path / "together_deepspeed_clip", name))
        assert not _equal(_arm(tmp_path / "unclipped"), alone), "the arm's own clip acts"
        lrs = json.loads((tmp_path / "lrs.json").read_text())
        peak = 1e-2
        assert lrs[:3] == pytest.approx([0.0, peak / 3, 2 * peak / 3])  # linear warm-up over 3 steps
        assert peak > lrs[3] > lrs[2] and all(a > b for a, b in zip(lrs[3:], lrs[4:], strict=False))
        assert lrs[-1] == pytest.approx(peak * 1e-4)  # cosine down to DeepSpeed's floor at the last step


def test_arms_must_cover_the_model_once():
    from tasks.context import _arm_groups

    model = nn.ModuleDict({"a": _net(1), "b": _net(2)})
    with pytest.raises(ValueError, match="in no arm"):
        _arm_groups(model, {"a": model["a"]}, 1.0)
    with pytest.raises(ValueError, match="share parameters"):
        _arm_groups(model, {"a": model["a"], "both": model}, 1.0)
    with pytest.raises(ValueError, match="not the model's"):
        _arm_groups(model, {"a": model["a"], "b": model["b"], "other": _net(3)}, 1.0)
    groups = _arm_groups(model, {"a": model["a"], "b": model["b"].parameters()}, 0.5)
    assert [(g["name"], g["max_norm"], len(g["params"])) for g in groups] == [("a", 0.5, 4), ("b", 0.5, 4)]


def test_plateau_is_the_relative_change_over_the_last_fifth():
    assert loss_plateau([2.0, 2.0, 2.0, 2.0]) == 0.0
    assert loss_plateau([4.0, 2.0, 1.0, 1.0]) == pytest.approx(2 / 3)  # halves' means 3 and 1
    assert loss_plateau([-2.0, -1.0]) == pytest.approx(0.5)  # relative to the magnitude: negative losses too
    assert loss_plateau([1.0]) is None and loss_plateau([1.0, math.nan]) is None


def test_fit_logs_the_plateau_and_the_replicate_metrics_carry_it(tmp_path):
    """A constructed loss 1/(1+step) over 20 steps: the last fifth is steps 16..19."""
    from tasks.context import FIT_METRICS, MetricSink, TrainContext
    from tasks.steps import fit_metrics
    from tasks.worker import _init_distributed

    _init_distributed()

    class Sink(MetricSink):
        logged: dict = {}

        def add(self, metrics, step):
            self.logged.update(metrics)

    sink = Sink(None, None)
    ctx = TrainContext(params=PaperParams(checkpoint_every=100), data_dir=tmp_path, out_dir=tmp_path, sink=sink)
    net = nn.Linear(1, 1)
    engine = ctx.engine(net, 1e-3, grad_clip=None)

    def step_fn(engine, batch, step):
        return (engine.module.weight * 0).sum() + 1.0 / (1 + step), {}

    ctx.fit("constructed", engine, step_fn, lambda step: {"x": torch.zeros(1, 1)}, 20)
    expected = loss_plateau([1.0 / (1 + s) for s in range(16, 20)])  # the loop sees float32 losses
    logged = sink.logged["train/constructed/plateau"]
    assert logged == pytest.approx(expected, rel=1e-6)
    measured = json.loads((tmp_path / FIT_METRICS).read_text())
    assert measured == fit_metrics(tmp_path)
    assert measured.keys() == {"train/constructed/plateau", "timing/train/constructed/steps_per_s"}
    assert measured["train/constructed/plateau"] == logged and measured["timing/train/constructed/steps_per_s"] > 0


def test_engine_betas_reach_every_arm_and_step_as_adamw(tmp_path):
    """`ctx.engine(betas=...)` is AdamW's own (beta1, beta2) for every arm: 5 steps equal torch's AdamW bitwise."""
    from tasks.context import TrainContext
    from tasks.worker import _init_distributed

    _init_distributed()
    ctx = TrainContext(params=PaperParams(checkpoint_every=100), data_dir=tmp_path, out_dir=tmp_path)
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2)})
    reference = copy.deepcopy(model)
    engine = ctx.engine(model, 1e-2, arms=dict(model.items()), grad_clip=None, betas=(0.8, 0.9))
    assert [g["betas"] for g in engine.optimizer.param_groups] == [(0.8, 0.9), (0.8, 0.9)]
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.8, 0.9))

    def loss(net: nn.ModuleDict, step: int) -> torch.Tensor:
        x = torch.full((4, 3), float(step + 1))
        return sum(arm(x).square().mean() for arm in net.values())

    ctx.fit("betas", engine, lambda engine, batch, step: (loss(engine.module, step), {}), lambda step: {}, 5)
    for step in range(5):
        plain.zero_grad()
        loss(reference, step).backward()
        plain.step()
    assert all(torch.equal(x, y) for x, y in zip(model.parameters(), reference.parameters(), strict=True))
