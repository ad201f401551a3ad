"""The train and evaluate contexts a paper receives: DeepSpeed engines, the one training loop, checkpoints, logging.

The loop (`TrainContext.fit`) is the only training loop in the project. Papers give it a `step_fn` (forward + loss
on a batch) and a `batch_fn` (the global batch of a step, drawn from a generator seeded by the step number so a
resumed run sees exactly the batches it would have seen). Each rank trains on its slice of the global batch;
DeepSpeed averages the gradients.

Checkpoints (one folder per `fit` phase): DeepSpeed writes `step<N>` with `save_latest=False`; after every rank
returned, rank 0 commits it by atomically replacing `committed.json`. Resume loads the committed tag explicitly.
Metrics are buffered and flushed to MLflow when a checkpoint commits, so steps replayed after a crash never log twice.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from models.contract import PaperParams

Batch = Mapping[str, torch.Tensor]
StepFn = Callable[[Any, Batch, int], tuple[torch.Tensor, Mapping[str, float]]]


_METRIC_NAME = re.compile(r"[\w\-./ ]+")


class MetricSink:
    """Rank 0's buffered connection to the MLflow run; `None` run id logs nowhere (in-process tests).

    Metrics are sent when a checkpoint commits. If the tracking server is unreachable then, training goes on: the
    batch is appended to `<run folder>/pending_metrics.jsonl` (on disk, so a killed rank loses nothing) and sent,
    before anything newer, at the next flush that reaches the server; the flow sends what is still pending after
    training (`send_pending`)."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, spill_dir: Path | None = None):
        self.run_id = run_id
        self._buffer: list[tuple[str, float, int]] = []
        self._client = None
        self._spill = (spill_dir / PENDING_METRICS) if spill_dir else None
        if run_id:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri)

    def add(self, metrics: Mapping[str, float], step: int) -> None:
        bad = [k for k in metrics if not _METRIC_NAME.fullmatch(k)]
        if bad:  # fail at the first log, not at the first flush many steps later
            raise ValueError(f"metric names MLflow rejects (allowed: letters, digits, _ - . / space): {bad}")
        self._buffer.extend((k, float(v), step) for k, v in metrics.items())

    def flush(self) -> None:
        if not self._client:
            self._buffer.clear()
            return
        if self._spill:
            with open(self._spill, "a") as f:  # durable first, then sent: a failure in between loses nothing
                f.writelines(json.dumps(m) + "\n" for m in self._buffer)
            self._buffer.clear()
            try:
                send_pending(self._client, self.run_id, self._spill.parent)
            except Exception as e:  # noqa: BLE001 - tracking down: keep training, the metrics wait on disk
                print(f"[tracking] unreachable ({type(e).__name__}); metrics kept in {self._spill}, sent at the next "
                      "checkpoint", file=sys.stderr, flush=True)
            return
        _log_metrics(self._client, self.run_id, self._buffer)
        self._buffer.clear()

    def drop(self) -> None:
        self._buffer.clear()


PENDING_METRICS = "pending_metrics.jsonl"


def _log_metrics(client, run_id: str, metrics: list) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, v, now, s) for k, v, s in metrics]
    for i in range(0, len(batch), 900):  # MLflow caps a batch at 1000 metrics
        client.log_batch(run_id, metrics=batch[i : i + 900])


def send_pending(client, run_id: str, run_dir: Path) -> int:
    """Send the metrics waiting in `run_dir/pending_metrics.jsonl`, then remove the file; returns how many.
    Sent batches leave the file as they go, so a failure part-way resends nothing twice."""
    path = run_dir / PENDING_METRICS
    if not path.exists():
        return 0
    metrics = [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    for i in range(0, len(metrics), 900):
        _log_metrics(client, run_id, metrics[i : i + 900])
        rest = path.with_suffix(".tmp")  # what is still unsent, so a failure later resends nothing twice
        rest.write_text("".join(json.dumps(m) + "\n" for m in metrics[i + 900 :]))
        os.replace(rest, path)
    path.unlink()
    return len(metrics)


SCHEDULES = {"constant": "WarmupLR", "cosine": "WarmupCosineLR", "linear": "WarmupDecayLR"}  # DeepSpeed's


def _scheduler_config(lr: float, steps: int | None, warmup: int, decay: str) -> dict | None:
    """DeepSpeed's `scheduler` section for a linear warm-up of `warmup` steps from 0, then `decay` until `steps`;
    None for a constant rate without warm-up."""
    if decay == "constant":
        if not warmup:
            return None
        return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                               "warmup_num_steps": warmup, "warmup_type": "linear"}}
    if decay == "cosine":  # ratios of each group's own rate; without warm-up it starts at the full rate
        return {"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_num_steps": max(warmup, 1),
                                                     "warmup_min_ratio": 0.0 if warmup else 1.0,
                                                     "warmup_type": "linear"}}
    return {"type": "WarmupDecayLR", "params": {"total_num_steps": steps, "warmup_min_lr": 0.0 if warmup else lr,
                                                "warmup_max_lr": lr, "warmup_num_steps": max(warmup, 1),
                                                "warmup_type": "linear"}}


def _arm_groups(model: torch.nn.Module, arms: Mapping[str, Any] | None, clip: float) -> list[dict]:
    """The optimizer's param groups: one per arm with trainable parameters (each with its own clip), or the whole
    model as one."""
    if arms is None:  # as a plain AdamW over model.parameters() has it; DeepSpeed clips the whole model
        return [{"params": list(model.parameters()), "name": "model", "max_norm": 0.0}]
    trainable = [q for q in model.parameters() if q.requires_grad]
    if not arms:
        raise ValueError("arms={}: name at least one arm")
    owner: dict[int, str] = {}
    groups = []
    for name, arm in arms.items():
        params = [q for q in (arm.parameters() if isinstance(arm, torch.nn.Module) else arm) if q.requires_grad]
        for q in params:
            if id(q) in owner:
                raise ValueError(f"arms {owner[id(q)]!r} and {name!r} share parameters: each arm trains its own")
            owner[id(q)] = name
        if params:  # a wholly frozen arm has nothing to step
            groups.append({"params": params, "name": name, "max_norm": clip})
    names = {id(q): n for n, q in model.named_parameters()}
    strays = sorted({arm for key, arm in owner.items() if key not in names})
    if strays:
        raise ValueError(f"arms {strays} hold parameters that are not the model's")
    orphans = [names[id(q)] for q in trainable if id(q) not in owner]
    if orphans:
        raise ValueError(f"trainable parameters in no arm (every one must belong to exactly one): {orphans[:5]}")
    return groups


class ArmsAdamW(torch.optim.AdamW):
    """AdamW whose param groups are arms: before the update, a group with a `max_norm` has its gradient clipped to
    that norm on its own (torch.nn.utils.get_total_norm and clip_grads_with_norm_, i.e. clip_grad_norm_ over the
    arm). `partitioned`: the group holds this rank's ZeRO partition of the arm, so the squared norm is summed over
    the ranks first. DeepSpeed's ZeRO optimizer steps one group at a time, in the same order on every rank (ZeRO-3
    steps sub-groups, which split a group only beyond its `sub_group_size`; tests/test_arms.py checks ZeRO 0 and 1)."""

    def __init__(self, groups: list[dict], lr: float, weight_decay: float, partitioned: bool,
                 betas: tuple[float, float] = (0.9, 0.999)):
        super().__init__(groups, lr=lr, weight_decay=weight_decay, betas=betas)
        self.partitioned = partitioned

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if group.get("max_norm") and group.get("norm") == "deepspeed":
                _clip_as_deepspeed(group["params"], group["max_norm"])
            elif group.get("max_norm"):
                grads = [q.grad for q in group["params"] if q.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)
                if self.partitioned:
                    squared = norm.square()
                    dist.all_reduce(squared)
                    norm = squared.sqrt()
                torch.nn.utils.clip_grads_with_norm_(group["params"], group["max_norm"], norm)
        return super().step(closure)


def _clip_in_optimizer(has_arms: bool, world_size: int, zero_stage: int) -> bool:
    """Whether ArmsAdamW clips (DeepSpeed's `gradient_clipping` is then 0): always for arms; for the whole model on
    one rank without ZeRO, where it clips as DeepSpeed would (`_clip_as_deepspeed`) minus the collective. Elsewhere
    DeepSpeed's clip stays: over several ranks its all-reduce is the arithmetic, and ZeRO clips its partitions."""
    return has_arms or (world_size == 1 and zero_stage == 0)


def _clip_as_deepspeed(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """DeepSpeed's global clip (deepspeed.runtime.utils.clip_grad_norm_, norm 2) on one rank, in its arithmetic, so
    the weights are bitwise what it gave, without its average of the norm over the one-process group (an identity
    in floating point) and the all-reduce that carries it: a gloo collective every step, a large share of a small
    network's step (benchmarks/step_cost.py)."""
    grads = [q.grad for q in params if q.grad is not None]
    if not grads:
        return
    total = torch.stack([g.detach().float().norm(2.0) for g in grads]).pow(2.0).sum().float().pow(0.5)
    one, limit = (torch.tensor([x], device=total.device) for x in (1.0, float(max_norm)))
    coef = torch.min(one, limit / (total + 1e-6))
    for g in grads:
        g.mul_(coef)


@dataclass
class EngineExtras:
    """What `TrainContext.engine` adds to a DeepSpeed engine (`engine.paperline`; a plain object, so the engine,
    an nn.Module, does not register the EMA as a submodule it trains): the EMA copy of its weights, or None."""

    ema: Any = None


def ema_module(engine: Any) -> torch.nn.Module | None:
    """The EMA copy of an engine's model (a module of the model's class), or None when it keeps none."""
    extras = getattr(engine, "paperline", None)
    return extras.ema.module if extras is not None and extras.ema is not None else None


class _ParametersAs:
    """A module's parameters cast to `dtype` (its buffers as they are), as AveragedModel.update_parameters reads
    them."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.module, self.dtype = module, dtype

    def parameters(self):
        return (q.detach().to(self.dtype) for q in self.module.parameters())

    def buffers(self):
        return self.module.buffers()


def ema_decay(decay: float, updates: int) -> float:
    """The decay of the EMA's update after `updates` earlier ones: min(decay, (1 + n) / (10 + n)), the warm-up of
    TensorFlow's ExponentialMovingAverage(num_updates=n). Without it the average keeps decay^n of the weights it
    copied at the first step (the initial ones, while the learning rate warms up from 0): 11 % after 220 steps at
    0.99."""
    return min(decay, (1 + updates) / (10 + updates))


def ema_with_warmup(decay: float):
    """AveragedModel's `multi_avg_fn` for an EMA with `ema_decay`'s warm-up (torch's get_ema_multi_avg_fn has a
    fixed decay); AveragedModel copies the weights at its first update and counts the updates in `n_averaged`,
    which is checkpointed with it, so a resumed run continues the same ramp."""

    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
        torch._foreach_lerp_(averaged, current, 1.0 - ema_decay(decay, int(num_averaged)))

    return update


def _update_ema(averaged: Any, model: torch.nn.Module) -> None:
    """Average the parameters, in the EMA's own precision (fp32 while DeepSpeed trains a bf16 copy: a bf16 average
    would lose the small updates); AveragedModel keeps the buffers equal to the live model's."""
    mine, live = next(averaged.module.parameters(), None), next(model.parameters(), None)
    same = mine is None or live is None or mine.dtype == live.dtype
    averaged.update_parameters(model if same else _ParametersAs(model, mine.dtype))


FIT_METRICS = "fit_metrics.json"  # per phase, what the loop measured (plateau): part of the replicate's metrics


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a training step on `device` draws from: what `torch.manual_seed` does for them, without
    its calls into every other backend (CUDA, XPU, MTIA), each of which formats a stack trace to queue a lazy
    seeding: on a CPU-only build that was most of what seeding a step cost."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def loss_plateau(tail: list[float]) -> float | None:
    """How far the loss still moved over the phase's last fifth (`tail`): |mean of its second half - mean of its
    first half| / |mean of its first half|; near 0 on a plateau. None with fewer than 2 losses or a non-finite one."""
    if len(tail) < 2:
        return None
    half = len(tail) // 2
    first, second = sum(tail[:half]) / half, sum(tail[half:]) / (len(tail) - half)
    change = abs(second - first) / max(abs(first), 1e-12)
    return change if math.isfinite(change) else None


def network_file(phase: str, ema: bool = False) -> str:
    """A phase's saved network in the run folder (its EMA copy with `ema`)."""
    return f"network.{phase}{'.ema' if ema else ''}.pt"


def record_file(name: str) -> str:
    """A record `train` keeps for `evaluate` in the run folder (statistics, shapes, a stopping log: not a network)."""
    return f"record.{name}.pt"


@dataclass
class TrainContext:
    params: PaperParams
    data_dir: Path
    out_dir: Path
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sink: MetricSink = field(default_factory=lambda: MetricSink(None, None))
    label: str = ""

    # ---- engines -------------------------------------------------------------------------------------------
    def engine(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0, *,
               arms: Mapping[str, torch.nn.Module | Iterable[torch.nn.Parameter]] | None = None,
               grad_clip: float | None = 1.0, steps: int | None = None, warmup: int = 0,
               decay: str = "constant", ema: float | None = None, betas: tuple[float, float] = (0.9, 0.999)) -> Any:
        """Wrap a single-device module in a DeepSpeed engine (client AdamW: exact resume, no fused-op build).

        `arms`: name -> submodule (or parameters) of `model`, for a model that trains several networks side by side
        (a method and its baselines, independent copies); every trainable parameter belongs to exactly one arm. Each
        arm is its own AdamW param group with its own gradient-norm clip, so with a summed loss its update is
        bitwise what it would be trained alone on the same batches; DeepSpeed's global clip is then off.
        `grad_clip`: the gradient-norm clip of each network the engine trains (None or 0: none): the whole model's
        (DeepSpeed's `gradient_clipping`) without arms, each arm's own with them. 1.0 is DeepSpeed's own default,
        kept so single-network runs are unchanged.
        `warmup`, `decay` ("constant", "cosine", "linear") and `steps` (the phase's length, needed to decay): the
        learning-rate schedule, DeepSpeed's WarmupLR / WarmupCosineLR / WarmupDecayLR (in the checkpoint), linear
        warm-up from 0; DeepSpeed warms up for at least 2 steps.
        `ema`: keep an exponential moving average of the weights with this decay (torch.optim.swa_utils; the decay
        warms up as in `ema_decay`, so the average forgets the initial weights), updated after every step by `fit`,
        checkpointed with it and saved as `network.<phase>.ema.pt`; `ema_module(engine)` reads it.
        `betas`: AdamW's (beta1, beta2), torch's defaults unless a paper needs another memory (pacer's beta2)."""
        import deepspeed

        p = self.params
        if decay not in SCHEDULES:
            raise ValueError(f"decay={decay!r}: expected one of {sorted(SCHEDULES)}")
        if decay != "constant" and not steps:
            raise ValueError(f"decay={decay!r} needs steps= (the phase's length, over which the rate decays)")
        if warmup < 0:
            raise ValueError(f"warmup={warmup}: expected a number of steps >= 0")
        if ema is not None and not 0.0 <= ema <= 1.0:
            raise ValueError(f"ema={ema}: the EMA decay lies in [0, 1]")
        if ema is not None and p.zero_stage == 3:
            raise ValueError("ema= needs the whole weights on every rank: use ZeRO stage 0-2")
        clip = float(grad_clip or 0.0)
        model = model.to(self.device)
        groups = _arm_groups(model, arms, clip)
        clip_in_optimizer = _clip_in_optimizer(arms is not None, self.world_size, p.zero_stage)
        if arms is None and clip_in_optimizer:
            groups[0].update(max_norm=clip, norm="deepspeed")
        config = {
            "train_micro_batch_size_per_gpu": 1,  # we feed batches ourselves; DeepSpeed only needs a number
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": p.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bool(p.bf16 and self.device.type == "cuda")},
            "steps_per_print": 10**9,
            "gradient_clipping": 0.0 if clip_in_optimizer else clip,
        }
        scheduler = _scheduler_config(lr, steps, warmup, decay)
        if scheduler:
            config["scheduler"] = scheduler
        averaged = None
        if ema is not None:  # copied before DeepSpeed hooks into the model
            from torch.optim.swa_utils import AveragedModel

            averaged = AveragedModel(model, multi_avg_fn=ema_with_warmup(ema))
        optimizer = ArmsAdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas,
                              partitioned=p.zero_stage >= 1 and self.world_size > 1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if arms is not None:
            assert engine.gradient_clipping() == 0.0, "arms are clipped apart, never by DeepSpeed's global clip"
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step()  # step k trains at the schedule's rate k (DeepSpeed starts it at -1)
        if self.world_size == 1 and p.zero_stage == 0:
            # averaging gradients over one rank is the identity, yet DeepSpeed would flatten them, all-reduce over
            # its one-process group and copy them back after every backward
            engine.enable_backward_allreduce = False
        engine.paperline = EngineExtras(ema=averaged)
        return engine

    # ---- the training loop ---------------------------------------------------------------------------------
    def fit(self, name: str, engine: Any, step_fn: StepFn, batch_fn: Callable[[int], Batch], num_steps: int,
            state: dict[str, torch.Tensor] | None = None, log_every: int = 10) -> None:
        """Train `num_steps` steps, resuming from this phase's committed checkpoint.

        `state`: tensors a paper fills while training (e.g. per-sample statistics), initialised with NaN; each rank
        writes the entries of its own samples and every checkpoint merges them across ranks (first non-NaN wins),
        so after `fit` returns every rank holds the complete tensors, and they survive a restart.

        At the end it logs `train/<phase>/plateau` (`loss_plateau` over the phase's last fifth, rank 0's loss; from
        10 steps on) and `timing/train/<phase>/steps_per_s` (the steps trained in this call over their wall time),
        both written to `fit_metrics.json`, which the replicate's metrics include, and saves the
        network (and its EMA copy) once: `network.<phase>.pt` (`.ema.pt`), what `EvalContext.network` loads."""
        ckpt_dir = self.out_dir / "checkpoints" / name
        # losses since the last logged step, and those of the phase's last fifth; checkpointed, so a resumed run
        # logs the same means and the same plateau
        trace: dict[str, list[float]] = {"window": [], "tail": []}
        tail_from = num_steps - num_steps // 5
        ema = getattr(getattr(engine, "paperline", None), "ema", None)
        start = self._resume(ckpt_dir, engine, state, trace)
        if start >= num_steps:
            self.progress(f"phase {name}: complete in checkpoint ({num_steps} steps), not retrained")
            self._finish(name, engine, trace["tail"])
            return
        if start:
            self.progress(f"phase {name}: resumed at step {start}/{num_steps}")
            self.sink.add({f"train/{name}/resumed_at_step": start}, start)
        every = self.params.checkpoint_every
        bar = PhaseProgress(self, name, start, num_steps)
        window, tail = trace["window"], trace["tail"]
        began = time.perf_counter()
        for step in range(start, num_steps):
            seed_step(self.params.seed * 1_000_003 + step, self.device)  # dropout etc. depend on the step only
            local = self._shard(batch_fn(step))
            loss, metrics = step_fn(engine, local, step)
            engine.backward(loss)
            engine.step()
            if ema is not None:
                _update_ema(ema, engine.module)
            _maybe_inject_fault(self.out_dir, self.rank, name, step + 1, self.params.seed)
            last = float(loss.detach())
            window.append(last)
            if step >= tail_from:
                tail.append(last)
            if (step + 1) % log_every == 0 or step + 1 == num_steps:
                logged = {"loss": sum(window) / len(window), **{k: float(v) for k, v in metrics.items()}}
                if step + 1 == num_steps and loss_plateau(tail) is not None:
                    logged["plateau"] = loss_plateau(tail)
                self.log({f"train/{name}/{k}": v for k, v in logged.items()}, step)
                window.clear()
            bar.update(step + 1, last)
            if (step + 1) % every == 0 or step + 1 == num_steps:
                self._checkpoint(ckpt_dir, engine, step + 1, state, trace)
        bar.done(last)
        self._finish(name, engine, tail, (num_steps - start) / max(time.perf_counter() - began, 1e-9))

    def _finish(self, name: str, engine: Any, tail: list[float], steps_per_s: float | None = None) -> None:
        plateau = loss_plateau(tail)
        measured = {f"train/{name}/plateau": plateau, f"timing/train/{name}/steps_per_s": steps_per_s}
        measured = {k: v for k, v in measured.items() if v is not None}
        if measured and self.rank == 0:
            path = self.out_dir / FIT_METRICS
            merged = json.loads(path.read_text()) if path.exists() else {}
            merged.update(measured)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
            os.replace(tmp, path)
        self._save_network(name, engine)

    def _save_network(self, name: str, engine: Any) -> None:
        """The phase's trained network as a whole module, `<out_dir>/network.<phase>.pt`, and its EMA copy,
        `network.<phase>.ema.pt` (rank 0; logged with the run's outputs): what `EvalContext.network` and the
        registered MLflow model (flows/serving.py) load. The module is pickled by reference to its class in the
        paper's module, without the hooks DeepSpeed put on it; a module that cannot be pickled is saved as its
        state dict (with its class name), so the weights are still there."""
        import contextlib

        gather = contextlib.nullcontext()
        if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:  # partitioned: every rank gathers
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
        with gather:
            self.save_network(name, engine.module)
            averaged = ema_module(engine)
            if averaged is not None:
                self.save_network(name, averaged, ema=True)

    def ema_network(self, engine: Any) -> torch.nn.Module | None:
        """The EMA copy of `engine`'s model as training has averaged it so far (`engine(ema=...)`), e.g. for a later
        stage to continue from; None when the engine keeps none."""
        return ema_module(engine)

    # ---- what evaluate reads ---------------------------------------------------------------------------------
    def save_network(self, name: str, module: torch.nn.Module, ema: bool = False) -> None:
        """Save a network `train` chose itself (e.g. each arm at its best validation step) as `network.<name>.pt`,
        the way `fit` saves each phase's: what `EvalContext.network(name)` and the registered model load. Rank 0."""
        if self.rank == 0:
            save_module(module, self.out_dir / network_file(name, ema))

    def save_record(self, name: str, record: Any) -> None:
        """Keep something `evaluate` needs that is not a network (per-sample statistics, shapes, a stopping log) as
        `record.<name>.pt`, atomically; `EvalContext.record(name)` reads it. Rank 0."""
        if self.rank == 0:
            path = self.out_dir / record_file(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save(record, tmp)
            os.replace(tmp, path)

    def _shard(self, batch: Batch) -> dict[str, torch.Tensor]:
        # contiguous: a strided slice would make every .view() in a step function fail with 2+ ranks
        return {k: v[self.rank :: self.world_size].contiguous().to(self.device) for k, v in batch.items()}

    def _checkpoint(self, ckpt_dir: Path, engine: Any, step: int, state: dict[str, torch.Tensor] | None,
                    trace: dict[str, list[float]]) -> None:
        tag = f"step{step}"
        self._merge_state(state)
        client = {"step": step, "state": {k: v.cpu() for k, v in (state or {}).items()},
                  **{k: list(v) for k, v in trace.items()}}
        ema = getattr(getattr(engine, "paperline", None), "ema", None)
        if ema is not None:
            client["ema"] = ema.state_dict()
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False)
        self.barrier()
        if self.rank == 0:
            marker = ckpt_dir / "committed.json"
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"tag": tag, "step": step}))
            os.replace(tmp, marker)
            self.sink.flush()  # metrics up to this step are now safe from replay
        self.barrier()

    def _merge_state(self, state: dict[str, torch.Tensor] | None) -> None:
        if self.world_size == 1 or not state:
            return
        for tensor in state.values():
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.contiguous())
            for part in parts:
                tensor.copy_(torch.where(torch.isnan(tensor), part, tensor))

    def _resume(self, ckpt_dir: Path, engine: Any, state: dict[str, torch.Tensor] | None,
                trace: dict[str, list[float]]) -> int:
        marker = ckpt_dir / "committed.json"
        if not marker.exists():
            return 0
        tag = json.loads(marker.read_text())["tag"]
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
        for key, value in client["state"].items():
            if state is not None and key in state:
                state[key].copy_(value)
        for key, values in trace.items():
            values[:] = client.get(key, [])
        ema = getattr(getattr(engine, "paperline", None), "ema", None)
        if ema is not None:
            ema.load_state_dict(client["ema"])
        self.sink.drop()
        return int(client["step"])

    # ---- communication and reporting -----------------------------------------------------------------------
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.rank == 0:
            self.sink.add(metrics, step)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def progress(self, message: str) -> None:
        if self.rank == 0:
            print(f"[{self.label or 'train'}] {message}", file=sys.stderr, flush=True)


PROGRESS_TAG = "[paperline-progress] "  # a rank's structured progress line; tasks.train renders it as a bar


class PhaseProgress:
    """Rank 0's progress through a training phase. Launched by the train task (PAPERLINE_PROGRESS=lines), it
    prints structured lines (`PROGRESS_TAG` + JSON: phase, step, total, loss), at most a few per second, which the
    launcher renders as one rich bar with ETA; run in-process (tests), a plain line about every tenth of the phase."""

    INTERVAL_S = 0.5

    def __init__(self, ctx: TrainContext, phase: str, start: int, total: int):
        self.ctx, self.phase, self.start, self.total = ctx, phase, start, total
        self.structured = os.environ.get("PAPERLINE_PROGRESS") == "lines"
        self.last_emit = 0.0
        self.t0 = time.perf_counter()
        self.every = max(1, total // 10)
        self._emit(start, None, force=True)

    def _emit(self, step: int, loss: float | None, force: bool = False) -> None:
        if self.ctx.rank != 0:
            return
        now = time.perf_counter()
        if self.structured:
            if force or now - self.last_emit >= self.INTERVAL_S:
                self.last_emit = now
                print(PROGRESS_TAG + json.dumps({"label": self.ctx.label, "phase": self.phase, "step": step,
                                                 "start": self.start, "total": self.total, "loss": loss}),
                      file=sys.stderr, flush=True)
        elif self.start < step < self.total and step % self.every == 0:
            rate = (step - self.start) / max(now - self.t0, 1e-9)
            shown = "" if loss is None else f" loss {loss:.4f}"
            self.ctx.progress(f"phase {self.phase}: step {step}/{self.total}{shown} ({rate:.1f} it/s)")

    def update(self, step: int, loss: float | None) -> None:
        self._emit(step, loss, force=step == self.total)

    def done(self, loss: float) -> None:
        """One plain line at the end of the phase, in both modes: what a log reader looks for."""
        elapsed = time.perf_counter() - self.t0
        steps = self.total - self.start
        self.ctx.progress(f"phase {self.phase}: step {self.total}/{self.total} loss {loss:.4f} ({steps} steps in "
                          f"{elapsed:.1f} s, {steps / max(elapsed, 1e-9):.1f} it/s)")


_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def save_module(module: torch.nn.Module, path: Path) -> None:
    """Save a module whole, atomically: its classes by reference (or by value when defined inside a function, as
    cloudpickle does, like the loss closures a phase module may hold), parameters on CPU, without the hooks and
    attributes DeepSpeed attached (they close over the engine). A module that still does not pickle is saved as its
    state dict (with its class name), so the weights are there."""
    import pickle

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    try:
        torch.save({"module": module, "class": _qualname(module)}, tmp, pickle_module=_network_pickle())
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as e:
        state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        torch.save({"state_dict": state, "class": _qualname(module), "why": f"{type(e).__name__}: {e}"}, tmp)
    os.replace(tmp, path)


@functools.cache
def _network_pickle():
    """A pickle module for torch.save: cloudpickle's pickler, with every nn.Module reduced without its hooks and
    every parameter as a plain CPU parameter (DeepSpeed's ids and flags left behind). Loads with plain pickle."""
    import copyreg
    import pickle
    import types
    from collections import OrderedDict

    import cloudpickle

    class NetworkPickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.nn.Parameter):
                return torch._utils._rebuild_parameter, (obj.detach().cpu(), obj.requires_grad, OrderedDict())
            if isinstance(obj, torch.nn.Module):
                state = {k: (OrderedDict() if k in _HOOKS else v) for k, v in obj.__dict__.items()}
                return copyreg._reconstructor, (type(obj), object, None), state
            return super().reducer_override(obj)

    return types.SimpleNamespace(__name__="paperline_network_pickle", Pickler=NetworkPickler,
                                 Unpickler=pickle.Unpickler, dump=pickle.dump, load=pickle.load)


def _qualname(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _maybe_inject_fault(out_dir: Path, rank: int, phase: str, step: int, seed: int) -> None:
    """Fault injection for the reliability tests: PAPERLINE_FAULT="kill:<rank>:<phase>:<step>[:seed=<s>]" SIGKILLs
    that rank once after that step (of the replicate with that seed only, when given; a marker in the run folder
    keeps the retry from dying again)."""
    fault = os.environ.get("PAPERLINE_FAULT", "")
    if fault not in (f"kill:{rank}:{phase}:{step}", f"kill:{rank}:{phase}:{step}:seed={seed}"):
        return
    marker = out_dir / f"fault-fired-{rank}-{phase}-{step}"
    if not marker.exists():
        marker.write_text("")
        os.kill(os.getpid(), 9)


@dataclass
class EvalContext:
    params: PaperParams
    data_dir: Path
    out_dir: Path
    plots_dir: Path
    label: str = ""
    shift: Any = None  # tasks.quiet.Shift of a run's evaluation; None (tests, benchmarks): timings run as they are

    def timing(self) -> contextlib.AbstractContextManager:
        """Around a loop whose wall clock a `timed` claim part reads: in a run, nothing else of paperline runs on
        this machine inside it (tasks/quiet.py); the rest of the evaluation runs beside other work."""
        return self.shift.timing() if self.shift is not None else contextlib.nullcontext()

    def network(self, phase: str, ema: bool = False) -> torch.nn.Module:
        """The network training phase `phase` ended with (`fit` saved it), in eval mode; `ema`: its EMA copy."""
        path = self.out_dir / network_file(phase, ema)
        if not path.exists():
            saved = sorted(q.name for q in self.out_dir.glob("network.*.pt"))
            raise FileNotFoundError(f"{path.name}: no such network in {self.out_dir} (saved: {saved or 'none'})"
                                    + ("; the phase's engine keeps an EMA only with engine(ema=...)" if ema else ""))
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if "module" not in saved:
            raise TypeError(f"{path.name} holds only the state dict of a {saved['class']} (it did not pickle: "
                            f"{saved['why']}); build the module and load it with load_state_dict")
        return saved["module"].eval()

    def records(self, prefix: str = "") -> list[str]:
        """The names of the records `train` kept, those starting with `prefix`, sorted."""
        names = (q.name.removeprefix("record.").removesuffix(".pt") for q in self.out_dir.glob("record.*.pt"))
        return sorted(n for n in names if n.startswith(prefix))

    def record(self, name: str) -> Any:
        """What `train` kept with `TrainContext.save_record(name, ...)`."""
        path = self.out_dir / record_file(name)
        if not path.exists():
            saved = sorted(q.name for q in self.out_dir.glob("record.*.pt"))
            raise FileNotFoundError(f"{path.name}: no such record in {self.out_dir} (saved: {saved or 'none'})")
        return torch.load(path, map_location="cpu", weights_only=False)

    def progress(self, message: str) -> None:
        print(f"[{self.label or 'evaluate'}] {message}", file=sys.stderr, flush=True)
