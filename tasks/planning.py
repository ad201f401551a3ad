"""Plan a profile before a GPU is spent: the paper's own `train(ctx)` under a planning context, nothing allocated.

`plan(paper_id, params)` runs `Paper.train` inside `torch._subclasses.FakeTensorMode`: every tensor the paper makes
is a fake (shape and dtype, no storage), so a model of any size costs nothing. `PlanContext` stands in for
`tasks.context.TrainContext`: `engine(model)` only wraps the model, and `fit(...)` traces ONE training step of the
phase (forward + backward on the rank's slice of the global batch), counting FLOPs with `FlopCounterMode`'s formulas
and the bytes alive at once, records it with the phase's step count and returns without training; the paper then
goes on to its next phase. A Python read of a fake value (`float(loss)`, `.item()`) gets a placeholder and
`.numpy()` zeros of the right shape, so the control flow between phases runs; the first thing that cannot run on
fakes, or the time budget, ends the plan there: the phases traced so far stand and `Plan.stopped` says why.
Data-side tensors hold their real values (`_real_tables`, `_Placeholders(real_data=True)`: tensors made from the
tables, integer index bookkeeping, draws from a paper's own seeded generator, and what is computed from those
alone), so a data loop runs at NumPy speed and takes its real branches, while everything a model computes stays fake
(a matmul or convolution stays fake even on real inputs: weights drawn from a paper's own generator are real); a
trace that fails on real values is run once more with every value fake. Fields a paper declares as replicas
(`replica_counts`) are traced as one copy and scaled. A Triton launch on fakes is skipped (its FLOPs are not
counted; each phase says how many its step skipped).

Data: planning never needs the profile's real data. The paper's `prepare` writes a planning copy with the profile's
parameters except the data *amount and source* (counts such as `n_*`, dataset paths, encoders: the keys `_DATA_KEY`
matches, and fields a paper declares `{"data": True}`), which come from the paper's `test` profile; a batch drawn
from it has the profile's row shape and batch size (indices past its rows are fine: the batch is fake). The host
memory of the data is that copy's in-memory size, each table scaled by the overridden count it grows with (full /
test), times the ranks on a node (each reads the tables). Where the full profile reads a real dataset, a small
fixture in that dataset's format (`tasks/fixtures.py`: CIFAR-10 pickles, HotpotQA JSON, D4RL HDF5 ...) stands in for
the files, so the rows have the real shapes; where there is no such fixture and the profile's row shapes cannot be
prepared without the real files, the `test` profile's data is used and the plan says so.

Model states per rank follow DeepSpeed's accounting (mixed precision: 2-byte weights and gradients, 4-byte master
weights, 8 bytes of Adam moments; `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`
for stages 2 and 3); fp32 training keeps 4-byte weights and gradients and no master copy. Weights a step uses
without training them (frozen parameters, a teacher the step closes over) are added at their size. The activation
peak is traced in fp32 and halved under bf16.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from models.contract import PaperParams

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes
    peak_bf16: float  # dense FLOP/s
    peak_fp32: float  # TF32 tensor-core FLOP/s (what fp32 matmuls run at)


GPUS = {
    "h100-80gb": Gpu("h100-80gb", 80 * GIB, 989e12, 494e12),
    "h200-141gb": Gpu("h200-141gb", 141 * GIB, 989e12, 494e12),
    "a100-80gb": Gpu("a100-80gb", 80 * GIB, 312e12, 156e12),
}
DEFAULT_GPU = "h100-80gb"
DEFAULT_MFU = 0.35  # model-FLOP utilisation the GPU-hours assume (a well-tuned dense run reaches 0.35-0.5)
HOST_RAM = 1024 * GIB  # per node
GPUS_PER_NODE = 8
HEADROOM = 0.9  # a rank must fit in this share of the GPU (CUDA context, allocator fragmentation, NCCL buffers)
RETRY_WALL_S = 150  # wall seconds a forked trace may take (its CPU budget is BUDGET_S; a hung child spends none)
WALL_TARGET_H = 24.0  # wall hours a full job may take on the GPUs it asks for (`Plan.gpus_needed`)
BUDGET_S = 20.0  # CPU seconds per paper (a busy machine plans as far as an idle one); planning never trains


class PrepareFailed(RuntimeError):
    """A planning copy's `prepare` failed before (its error's type is the message): the cache remembers it. The
    copy reads no file of the user's (its path keys are the test profile's or a fixture's), so the same params and
    code fail the same way until one of them changes, which changes the cache key."""


class EmptyBatch(RuntimeError):
    """A phase's batch has no rows: its size was computed from placeholders (`int(t.max())` of a fake table), so
    the plan retries with the tables' real values."""


class PlanStop(Exception):
    """Raised inside the paper's train() to end the plan (time budget)."""


@dataclass
class Phase:
    name: str
    steps: int
    params: int  # trainable parameters of the engine's model
    largest_layer: int  # parameters of the largest leaf module (ZeRO-3 gathers one at a time)
    buffers: int  # bytes (fp32 as traced)
    batch: dict[str, list[int]]  # the rank's slice of the global batch: name -> shape
    flops_step: float  # per rank, forward + backward (FlopCounterMode; elementwise ops are not counted)
    activation_bytes: int  # peak of one step beyond weights and gradients, at the run's precision
    saved_bytes: int = 0  # of those, alive when backward starts (what a forward keeps for its backward)
    frozen_bytes: int = 0  # weights the step uses but does not train (`frozen_weight_bytes`)
    kernel_launches: int = 0  # Triton launches in the step: skipped on fakes, their FLOPs not in flops_step
    inference_bytes: int = 0  # largest no-grad module call outside steps since the phase before (the last phase:
    # also after it), at the run's precision: what sampling or evaluation between phases allocates at once
    ema: bool = False  # the engine keeps an EMA copy of its weights (fp32, on every rank)
    weights_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    rank_bytes: int = 0  # weights + grads + optimizer + EMA copy + buffers + frozen weights + activations

    @property
    def flops_total(self) -> float:
        return self.flops_step * self.steps  # per rank; x ranks for the job

    def rank_bytes_at(self, ranks: int, stage: int, bf16: bool, traced_ranks: int | None = None) -> int:
        """A rank's bytes when the job runs on `ranks` ranks: model states by DeepSpeed's accounting, and the
        activations of the rank's slice of the global batch (traced at `traced_ranks`, linear in the slice)."""
        weights, grads, optimizer = model_states(self.params, self.largest_layer, ranks, stage, bf16)
        ema = 4 * self.params if self.ema else 0
        activations = self.activation_bytes * (traced_ranks or ranks) / ranks
        return int(weights + grads + optimizer + ema + self.buffers + self.frozen_bytes + activations)

    @property
    def peak_bytes(self) -> int:
        """The larger of a training step and an inference call beside the phase's training state."""
        return max(self.rank_bytes, self.rank_bytes - self.activation_bytes + self.inference_bytes)


@dataclass
class Plan:
    paper: str
    profile: str
    gpu: str
    ranks: int
    zero_stage: int
    bf16: bool
    mfu: float
    phases: list[Phase] = field(default_factory=list)
    data_bytes: int = 0  # host memory of a node for the data (tables at the profile's size x ranks on the node)
    data_note: str = ""
    stopped: str = ""  # why the trace ended before train() returned ("" when it returned)
    replicas: dict[str, int] = field(default_factory=dict)  # declared replica counts, traced as one copy each
    passes: list[str] = field(default_factory=list)  # declared epoch fields: steps are passes over the planning rows
    seconds: float = 0.0

    @property
    def steps_lower_bound(self) -> bool:
        """The paper's step counts are passes (epochs) over its rows, and the planning copy has the test profile's
        rows, not the profile's data: its FLOPs and GPU-hours are a lower bound (memory per rank is not)."""
        return bool(self.passes)

    @property
    def traced_as(self) -> str:
        """How the trace was reduced and scaled back; "" when traced as it is."""
        if not self.replicas:
            return ""
        return (", ".join(f"{k} = {n} replicas traced as 1" for k, n in self.replicas.items())
                + ": every phase's parameters, buffers, FLOPs and saved activations x "
                + str(math.prod(self.replicas.values())))

    @property
    def peak_rank_bytes(self) -> int:
        return max((ph.peak_bytes for ph in self.phases), default=0)

    @property
    def flops_total(self) -> float:
        return sum(ph.flops_total for ph in self.phases) * self.ranks

    @property
    def gpu_hours(self) -> float:
        g = GPUS[self.gpu]
        peak = g.peak_bf16 if self.bf16 else g.peak_fp32
        return self.flops_total / (peak * self.mfu) / 3600

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.ranks / GPUS_PER_NODE))

    @property
    def gpus_needed(self) -> int:
        """The fewest GPUs (a power of two, at most the profile's ranks) on which every traced phase fits a rank
        and the job ends within `WALL_TARGET_H` at the plan's MFU: what the job should ask for. The profile's
        global batch is split over fewer ranks, so each rank holds more of its activations."""
        limit = GPUS[self.gpu].memory * HEADROOM
        n = 1
        while n < self.ranks:
            fits = all(ph.rank_bytes_at(n, self.zero_stage, self.bf16, traced_ranks=self.ranks)
                       + max(0, ph.inference_bytes - ph.activation_bytes * self.ranks / n) <= limit
                       for ph in self.phases)
            if fits and self.gpu_hours / n <= WALL_TARGET_H:
                return n
            n *= 2
        return self.ranks

    def problems(self) -> list[str]:
        """Each reason the profile would not run, naming the phase and the number; [] when it fits."""
        limit = GPUS[self.gpu].memory * HEADROOM
        out = [f"phase {ph.name}: {gib(ph.rank_bytes)} per rank > {gib(limit)} usable on {self.gpu} "
               f"(weights {gib(ph.weights_bytes)}, grads {gib(ph.grads_bytes)}, optimizer {gib(ph.optimizer_bytes)}, "
               f"frozen weights {gib(ph.frozen_bytes)}, activations {gib(ph.activation_bytes)})"
               for ph in self.phases if ph.rank_bytes > limit]
        out += [f"phase {ph.name}: an inference call outside its steps needs {gib(ph.inference_bytes)} beside the "
                f"phase's training state: {gib(ph.peak_bytes)} per rank > {gib(limit)} usable on {self.gpu}"
                for ph in self.phases if ph.rank_bytes <= limit < ph.peak_bytes]
        if self.data_bytes > HOST_RAM * HEADROOM:
            out.append(f"data: {gib(self.data_bytes)} of host memory a node > {gib(HOST_RAM * HEADROOM)} usable")
        return out

    @property
    def fits(self) -> bool:
        """No traced phase is too large: a plan that stopped early (`complete` false) vouches only for those."""
        return not self.problems()

    @property
    def complete(self) -> bool:
        """train() ran to its end under the trace: every phase is in the plan."""
        return not self.stopped

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for ph, raw in zip(self.phases, d["phases"], strict=True):
            raw["flops_total"], raw["peak_bytes"] = ph.flops_total, ph.peak_bytes
        d.update(peak_rank_bytes=self.peak_rank_bytes, flops_total=self.flops_total, gpu_hours=self.gpu_hours,
                 nodes=self.nodes, gpus_needed=self.gpus_needed, fits=self.fits, complete=self.complete,
                 problems=self.problems(),
                 traced_as=self.traced_as, steps_lower_bound=self.steps_lower_bound)
        return d

    def metrics(self) -> dict[str, float]:
        """The `plan/*` numbers a full run logs, to be held against what the run measured."""
        out = {"plan/ranks": float(self.ranks), "plan/gpus_needed": float(self.gpus_needed),
               "plan/gpu_hours": self.gpu_hours, "plan/flops_total": self.flops_total,
               "plan/peak_rank_gib": self.peak_rank_bytes / GIB, "plan/data_gib": self.data_bytes / GIB,
               "plan/mfu": self.mfu, "plan/fits": float(self.fits), "plan/complete": float(self.complete),
               "plan/phases": float(len(self.phases))}
        for ph in self.phases:
            key = re.sub(r"[^\w\-.]", "_", ph.name)
            out |= {f"plan/{key}/params": float(ph.params), f"plan/{key}/flops_step": ph.flops_step,
                    f"plan/{key}/steps": float(ph.steps), f"plan/{key}/rank_gib": ph.rank_bytes / GIB,
                    f"plan/{key}/activation_gib": ph.activation_bytes / GIB,
                    f"plan/{key}/inference_gib": ph.inference_bytes / GIB}
        return out


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.1f} MiB"


# ---- model states: DeepSpeed's accounting ------------------------------------------------------------------------
def model_states(params: int, largest_layer: int, ranks: int, stage: int, bf16: bool) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per rank. Mixed precision (bf16): 2-byte weights and gradients,
    fp32 master weights (4) + fp32 gradients (4, stages >= 1 keep them for the update) + Adam moments (8); stages 1-3
    partition the fp32 part over the ranks, stage 2 also the gradients, stage 3 also the weights. Stages 2 and 3
    under bf16 are DeepSpeed's own estimators (`..._zero2_/_zero3_model_states_mem_needs`, no offload)."""
    p, g = params, ranks
    if bf16 and stage in (2, 3):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        if stage == 2:  # 2P bf16 weights + 18P/G (bf16 + fp32 grads, fp32 master, Adam)
            _, total = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=min(g, GPUS_PER_NODE),
                                                             num_nodes=math.ceil(g / GPUS_PER_NODE), cpu_offload=False)
            weights, grads = 2 * p, 6 * p // g
        else:  # the largest layer gathered in fp32 + 18P/G
            _, total, _ = estimate_zero3_model_states_mem_needs(
                p, largest_layer, num_gpus_per_node=min(g, GPUS_PER_NODE), num_nodes=math.ceil(g / GPUS_PER_NODE),
                cpu_offload=False, cpu_offload_params=False)
            weights, grads = 4 * largest_layer + 2 * p // g, 6 * p // g
        return weights, grads, max(0, total - weights - grads)
    w = 2 if bf16 else 4
    master = 4 if bf16 else 0
    shard = g if stage >= 1 else 1
    weights = w * p // (g if stage == 3 else 1) + master * p // shard
    grads = w * p // (g if stage >= 2 else 1)
    return weights, grads, 8 * p // shard


# ---- the planning context -----------------------------------------------------------------------------------------
class _Engine:
    """What a paper sees of a DeepSpeed engine while planning: forward, `.module`, a no-op step."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float):
        self.module = model
        self.ema = False
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def __getattr__(self, name: str):  # train() / eval() / parameters() ... of the module
        return getattr(self.__dict__["module"], name)


@dataclass
class PlanContext:
    params: PaperParams
    data_dir: Path
    out_dir: Path
    world_size: int
    deadline: float
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    label: str = "plan"
    phases: list[Phase] = field(default_factory=list)
    _traced: dict[tuple, Phase] = field(default_factory=dict, repr=False)
    stepping: bool = False  # inside a traced step (every op counts: `_reuse_inference_calls` stands aside)
    kernel_launches: int = 0  # Triton launches skipped on fakes inside traced steps so far
    inference_bytes: int = 0  # largest no-grad module call outside steps since the last phase (fp32 as traced)
    measuring: bool = False  # inside such a call, whose counter sees the ops of the calls nested in it

    def engine(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0, *, grad_clip: float | None = None,
               arms: Any = None, steps: int | None = None, warmup: int = 0, decay: str = "constant",
               ema: float | None = None, betas: tuple[float, float] = (0.9, 0.999)) -> _Engine:
        """The training engine's signature (tasks.context.TrainContext.engine); clipping, arms and the schedule
        cost no memory, an EMA copy of the weights does (`Phase.ema`)."""
        engine = _Engine(model, lr, weight_decay)
        engine.ema = ema is not None
        return engine

    def ema_network(self, engine: _Engine) -> None:
        """No EMA is kept while tracing (its memory is counted from `engine(ema=...)`)."""
        return None

    def fit(self, name: str, engine: _Engine, step_fn: Callable, batch_fn: Callable[[int], Mapping[str, Any]],
            num_steps: int, state: dict | None = None, log_every: int = 10) -> None:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
        from torch.nn.utils.stateless import _reparametrize_module

        if time.process_time() > self.deadline:
            raise PlanStop(f"time budget spent before phase {name}")
        if num_steps <= 0:
            return
        model = engine.module
        torch.manual_seed(self.params.seed * 1_000_003)
        step = _StepCounter()
        mode = torch._guards.detect_fake_mode() or FakeTensorMode(allow_non_fake_inputs=True)
        with contextlib.ExitStack() as stack:
            if not torch._guards.detect_fake_mode():  # called outside `plan` (tests): fake it here
                stack.enter_context(mode)
                stack.enter_context(_Placeholders())
                stack.enter_context(_fake_reads())
            # a fake batch: its indices may point past the planning data's rows, its shape is the profile's. Step 1,
            # not 0: a paper's step 0 often does what later steps do not (evaluation when step % k == 0, snapshots)
            probe = 1 if num_steps > 1 else 0
            local = {k: v[self.rank :: self.world_size].contiguous() for k, v in batch_fn(probe).items()}
            empty = [k for k, v in local.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 0]
            if empty:  # the batch's size came from placeholder values: a step on it would plan nothing
                raise EmptyBatch(f"phase {name}: batch {', '.join(empty)} has no rows on placeholder values")
            key = _step_signature(model, step_fn, local)
            if key in self._traced:  # the same step as a phase traced before (another arm, chunk, task step)
                self.phases.append(replace(self._traced[key], name=name, steps=int(num_steps),
                                           inference_bytes=self.take_inference_bytes()))
                engine.step()
                return
            real = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]
                    if not isinstance(t, FakeTensor)}  # weights made before the fake mode: fake copies for the step
            fakes = {n: mode.from_tensor(t, static_shapes=True).requires_grad_(t.requires_grad)
                     for n, t in real.items()}
            self.stepping, launches = True, self.kernel_launches
            try:
                with _reparametrize_module(model, fakes, strict=False), step:
                    loss, _ = step_fn(engine, local, probe)
                    step.mark()
                    loss.backward()
            finally:
                self.stepping = False
            weights = [*fakes.values(), *(p for p in model.parameters() if isinstance(p, FakeTensor))]
            grads = step.allocations(t.grad for t in weights if t.grad is not None)
        transient, saved = step.peak(exclude=grads)
        scale = self.run_precision
        trainable = [p for p in model.parameters() if p.requires_grad]
        largest = max((sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad)
                       for m in model.modules()), default=0)
        self.phases.append(Phase(
            name=name, steps=int(num_steps), params=sum(p.numel() for p in trainable), largest_layer=largest,
            buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
            batch={k: list(v.shape) for k, v in local.items() if isinstance(v, torch.Tensor)},
            flops_step=float(step.flops), frozen_bytes=frozen_weight_bytes(model, step_fn, self.params),
            kernel_launches=self.kernel_launches - launches, inference_bytes=self.take_inference_bytes(),
            activation_bytes=int(transient * scale), saved_bytes=int(saved * scale), ema=engine.ema))
        self._traced[key] = self.phases[-1]
        engine.step()

    @property
    def run_precision(self) -> float:
        """Bytes at the run's precision per byte traced (in fp32): half under bf16."""
        return 0.5 if self.params.bf16 else 1.0

    def take_inference_bytes(self) -> int:
        """The largest inference call since the last phase, at the run's precision; the next phase starts from 0."""
        taken, self.inference_bytes = int(self.inference_bytes * self.run_precision), 0
        return taken

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place, as DeepSpeed's: the sum over `world_size` ranks that hold what the traced rank holds."""
        return tensor.mul_(self.world_size)

    def barrier(self) -> None:
        pass

    def save_network(self, name: str, module: torch.nn.Module, ema: bool = False) -> None:
        pass  # a plan saves nothing (its networks are untrained fakes)

    def save_record(self, name: str, record: Any) -> None:
        pass

    def progress(self, message: str) -> None:
        if time.process_time() > self.deadline:
            raise PlanStop("time budget spent")


def frozen_weight_bytes(model: torch.nn.Module, step_fn: Callable, params: PaperParams) -> int:
    """Bytes a rank holds of weights the step uses without training them: the engine's frozen parameters (cast to
    bf16 with the rest of the engine under mixed precision, partitioned under ZeRO-3), and the parameters and
    buffers of the modules the step function closes over outside the engine (a teacher, the previous step's
    models, a reference policy: at their own dtype, on every rank), each storage once."""
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    total = frozen * (2 if params.bf16 else 4) // (params.ranks if params.zero_stage == 3 else 1)
    seen = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}  # the engine's own
    for module in _closed_over_modules(step_fn):
        for t in [*module.parameters(), *module.buffers()]:
            address = t.untyped_storage()._cdata
            if address not in seen:
                seen.add(address)
                total += t.numel() * t.element_size()
    return total


def _closed_over_modules(fn: Callable) -> list[torch.nn.Module]:
    """Modules in a function's closure cells, directly or as values of a dict, list or tuple there."""
    out = []
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned after the function was made)
            continue
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        out.extend(v for v in values if isinstance(v, torch.nn.Module))
    return out


def _cpu_attention_flops():
    """FLOPs of SDPA's fused CPU kernels, which `flop_registry` leaves out (it knows the CUDA ones): the plan traces
    on CPU fakes, so without these a paper's attention would cost nothing. Same formulas as the CUDA kernels'."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *_: sdpa_flop_count(q.shape, k.shape, v.shape),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *_: sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape),
    }


_CPU_ATTENTION = _cpu_attention_flops()


def _model_compute() -> frozenset:
    """Ops the FLOP counter counts (matmuls, convolutions, attention): model compute, which stays fake even on real
    inputs (weights a paper draws from its own seeded generator are real, and a real forward at the profile's size
    would cost what the plan exists to avoid, e.g. fedgr's evaluation between rounds is real convolutions)."""
    from torch.utils.flop_counter import flop_registry

    return frozenset(flop_registry) | frozenset(_CPU_ATTENTION)


_MODEL_COMPUTE = _model_compute()


def _step_signature(model: torch.nn.Module, step_fn: Callable, batch: Mapping[str, Any]) -> tuple:
    """What one traced step's numbers depend on: the model's modules and tensor shapes, the batch's shapes, the step
    function's code and the plain values it closes over (an arm's mode, a loss weight). Two phases with the same
    signature (15 networks of one architecture, the chunks of one run) cost the same: traced once."""
    def plain(v):
        return v if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__

    shapes = lambda named: tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in named)  # noqa: E731
    return (tuple(type(m).__name__ for m in model.modules()), shapes(model.named_parameters()),
            shapes(model.named_buffers()),
            tuple((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, plain(v))
                  for k, v in batch.items()),
            step_fn.__code__, tuple(plain(c.cell_contents) for c in step_fn.__closure__ or ()))


class _StepCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """FLOPs and memory of one step. FLOPs: `FlopCounterMode`'s own per-op formulas (`flop_registry`: matmuls,
    convolutions, attention), without its module hooks, which break a paper's `torch.autograd.grad`. Memory: bytes
    of the storages an op creates, freed when the storage dies (weak references); `peak(exclude)` is the largest
    total alive at once, leaving out the given allocations (the gradients)."""

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.events: list[tuple[int, int]] = []  # (allocation number, +bytes / -bytes)
        # live storages: address -> (allocation number, weak reference); a freed storage's address is reused by a
        # later one (a gradient), so events are keyed by allocation, not by address
        self._seen: dict[int, tuple[int, weakref.ref]] = {}
        self._backward_at = None  # index into events where backward starts

    def mark(self) -> None:
        self._backward_at = len(self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **kwargs, out_val=out)
        elif func._overloadpacket in _CPU_ATTENTION:
            self.flops += _CPU_ATTENTION[func._overloadpacket](*args)
        # a view or an in-place result shares its input's storage: nothing new (a weight's transpose in every
        # linear layer is not an activation)
        inputs = {t.untyped_storage()._cdata for t in _tensor_args(args, kwargs)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                address = st._cdata
                if address not in self._seen and address not in inputs:
                    size, number = st.nbytes(), len(self.events)
                    self.events.append((number, size))
                    self._seen[address] = (number, weakref.ref(
                        st, lambda _, a=address, n=number, s=size: self._free(a, n, s)))
        return out

    def _free(self, address: int, number: int, size: int) -> None:
        self.events.append((number, -size))
        self._seen.pop(address, None)

    def allocations(self, tensors) -> set[int]:
        """Allocation numbers of the (live) storages of `tensors`."""
        return {self._seen[t.untyped_storage()._cdata][0] for t in tensors
                if t.untyped_storage()._cdata in self._seen}

    def peak(self, exclude: set[int]) -> tuple[int, int]:
        """(largest total alive at once, total alive when backward started), leaving out the allocations
        `exclude`."""
        now = best = saved = 0
        for i, (number, delta) in enumerate(self.events):
            if i == self._backward_at:
                saved = now
            if number not in exclude:
                now += delta
                best = max(best, now)
        return best, (now if self._backward_at is None or self._backward_at >= len(self.events) else saved)


def _same_metadata_ops() -> frozenset:
    """In-place ops whose result is their first argument with its shape, dtype and strides unchanged: on a fake
    they only change values, which fakes do not have, so they are answered without the fake-tensor machinery
    (~0.3 ms an op: weight initialisation and `load_state_dict` were a large part of planning many networks)."""
    aten = torch.ops.aten
    return frozenset({aten.uniform_, aten.normal_, aten.zero_, aten.fill_, aten.copy_, aten.bernoulli_,
                      aten.random_, aten.exponential_, aten.log_normal_, aten.add_, aten.sub_, aten.mul_,
                      aten.div_, aten.lerp_, aten.addcmul_, aten.addcdiv_, aten.clamp_, aten.clamp_min_,
                      aten.clamp_max_, aten.masked_fill_})


_SAME_METADATA = _same_metadata_ops()


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments (one level of lists: `cat`, `index`), cheaper than a pytree walk."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _factory_size(args: tuple) -> int | None:
    """Elements a factory op makes, read from its size argument (a list of ints, or `randperm`'s n); None if unsure."""
    for a in args:
        if isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
            return math.prod(a)
    return args[0] if len(args) == 1 and isinstance(args[0], int) else None


class _Placeholders(torch.utils._python_dispatch.TorchDispatchMode):
    """Above FakeTensorMode: a Python read of a fake value gets a placeholder (0.5, 1, False), and ops whose output
    size depends on values (`nonzero`, boolean masks) get their upper bound, so the paper's control flow goes on."""

    def __init__(self, real_data: bool = False):
        super().__init__()
        self.real_data = real_data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func._overloadpacket in _SAME_METADATA and args and isinstance(args[0], FakeTensor) \
                and getattr(args[0], "constant", None) is None:
            return args[0]  # an in-place fill or update of a fake changes values only: nothing to compute
        if self.real_data:  # an op on real tensors only (the tables, constants) runs for real: data-side values
            inputs = _tensor_args(args, kwargs)
            if inputs and not any(isinstance(t, FakeTensor) for t in inputs) \
                    and sum(t.numel() for t in inputs) <= _MAX_READ and func._overloadpacket not in _MODEL_COMPUTE:
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            if not inputs:  # an integer factory (arange, randperm: index bookkeeping) or a draw from a paper's own
                # generator (data-side noise) is data-side too; weights (floating point, global RNG) stay fake
                size = _factory_size(args)
                if kwargs.get("generator") is not None and size is not None and size <= _MAX_READ:
                    with unset_fake_temporarily():
                        return func(*args, **kwargs)
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.numel() <= _MAX_READ and not (
                        out.dtype.is_floating_point or out.is_complex() or kwargs.get("generator") is not None):
                    with unset_fake_temporarily():
                        return func(*args, **kwargs)
                return out
        if func is aten._local_scalar_dense.default:
            x = args[0]
            return False if x.dtype == torch.bool else (1 if not x.dtype.is_floating_point else 0.5)
        if func is aten.nonzero.default:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
            idx = []
            for i in args[1]:
                if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                    idx.extend(torch.empty((i.numel(),), dtype=torch.long, device=i.device).fill_(0)
                               for _ in range(i.dim()))
                else:
                    idx.append(i)
            return func(args[0], idx, *args[2:], **kwargs)
        if func is aten.masked_select.default:
            return torch.empty((args[0].numel(),), dtype=args[0].dtype, device=args[0].device)
        if func is aten.bincount.default:  # counts of values 0..minlength-1 (the common use: class counts)
            size = max(int(kwargs.get("minlength", args[2] if len(args) > 2 else 0)), 1)
            dtype = torch.long if (kwargs.get("weights") if "weights" in kwargs else (args[1] if len(args) > 1
                                                                                      else None)) is None else \
                torch.double
            return torch.zeros((size,), dtype=dtype, device=args[0].device)
        if func in (aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default):
            x = args[0]  # every value distinct: the upper bound
            flat = x.reshape(-1)
            extras = [torch.zeros_like(flat, dtype=torch.long), torch.ones_like(flat, dtype=torch.long)]
            return (flat.clone(), *extras)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _fake_reads():
    """`.numpy()` / `.tolist()` of a fake give zeros of its shape (results a paper keeps between phases), up to
    `_MAX_READ` elements (a larger read would allocate for real, so it ends the plan)."""
    import numpy as np
    from torch._subclasses.fake_tensor import FakeTensor

    def numpy(self, *args, **kwargs):
        if self.numel() > _MAX_READ:
            raise PlanStop(f"a paper reads a {list(self.shape)} tensor into NumPy")
        dtype = {torch.bool: np.bool_, torch.int64: np.int64, torch.int32: np.int32, torch.float64: np.float64,
                 torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16}.get(self.dtype, np.float32)
        return np.zeros(tuple(self.shape), dtype=dtype)

    saved = {name: FakeTensor.__dict__.get(name) for name in ("numpy", "tolist")}
    FakeTensor.numpy = numpy
    FakeTensor.tolist = lambda self: numpy(self).tolist()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(FakeTensor, name)
            else:
                setattr(FakeTensor, name, value)


_MAX_READ = 50_000_000


@contextlib.contextmanager
def _reuse_inference_calls(ctx: PlanContext):
    """Outside a traced step, a module called again without gradients on inputs of the same shapes (sampling loops,
    ODE solvers, evaluation between phases) returns fresh fakes shaped like its first such call's result, instead of
    running every op again on fakes: only shapes flow between phases, and no cost outside a step is counted. Inside
    a step (`ctx.stepping`) every call runs, since its FLOPs and memory are what the plan measures."""
    from torch._subclasses.fake_tensor import FakeTensor

    call = torch.nn.Module.__call__
    results: dict[tuple, Any] = {}

    def shape_of(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype, x.stride(), isinstance(x, FakeTensor))
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, *map(shape_of, x))
        if isinstance(x, dict):
            return ("dict", *((k, shape_of(v)) for k, v in x.items()))
        return x if isinstance(x, (int, float, str, bool, type(None))) else ("object", id(x))

    def fresh(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype) if isinstance(x, torch.Tensor) else x

    def reused(module, *args, **kwargs):
        if ctx.stepping or torch.is_grad_enabled():
            return call(module, *args, **kwargs)
        if not any(isinstance(t, FakeTensor) for t in _tensor_args(args, kwargs)) and not isinstance(
                next(module.parameters(), None), FakeTensor):  # real weights on real data: its values matter
            return call(module, *args, **kwargs)
        key = (id(module), module.training, shape_of(args), shape_of(kwargs))
        if key in results:
            return torch.utils._pytree.tree_map(fresh, results[key][1])
        if ctx.measuring:  # nested in a call being measured: its counter sees these ops
            out = call(module, *args, **kwargs)
        else:
            ctx.measuring, counter = True, _StepCounter()
            try:
                with counter:
                    out = call(module, *args, **kwargs)
            finally:
                ctx.measuring = False
            ctx.inference_bytes = max(ctx.inference_bytes, counter.peak(exclude=set())[0])
        if all(isinstance(t, FakeTensor) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)):
            results[key] = (module, out)  # the module is kept, so its id is not reused by another while planning
        return out

    torch.nn.Module.__call__ = reused
    try:
        yield
    finally:
        torch.nn.Module.__call__ = call


@contextlib.contextmanager
def _no_kernel_launches_on_fakes(ctx: PlanContext):
    """A Triton launch with a fake argument does nothing (the interpreter cannot read a fake's values, and on a GPU
    a fake has no memory): the paper's wrapper has already made its output tensors, the fakes the plan needs. The
    kernel's FLOPs are not counted; `Phase.kernel_launches` says how many launches a step skipped."""
    try:
        from triton.runtime import autotuner, interpreter, jit
    except ImportError:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    classes = (jit.JITFunction, interpreter.InterpretedFunction, autotuner.Autotuner, autotuner.Heuristics)
    saved = {cls: cls.__dict__["run"] for cls in classes if "run" in cls.__dict__}

    def skipping(run):
        def launch(self, *args, **kwargs):
            if any(isinstance(a, FakeTensor) for a in (*args, *kwargs.values())):
                ctx.kernel_launches += ctx.stepping
                return None
            return run(self, *args, **kwargs)
        return launch

    for cls, run in saved.items():
        cls.run = skipping(run)
    try:
        yield
    finally:
        for cls, run in saved.items():
            cls.run = run


@contextlib.contextmanager
def _shared_mode_on_deepcopy():
    """`copy.deepcopy` of a fake (a target network, an EMA copy, `nn.TransformerEncoder`'s layer clones) keeps the
    one fake mode: by default it deep-copies the mode too, and every later op then converts the copy's weights into
    the live mode again (~3 ms an op), counting the converted copies as activations. The copied mode's table of
    constants also released one weak reference twice, which corrupted the heap (skeleton_llm, motionmar died)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved = FakeTensorMode.__dict__.get("__deepcopy__")
    FakeTensorMode.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if saved is None:
            del FakeTensorMode.__deepcopy__
        else:
            FakeTensorMode.__deepcopy__ = saved


@contextlib.contextmanager
def _quiet():
    """The paper's progress lines and warnings about fakes (and fake-tensor error logs) are not the plan's output."""
    import logging
    import warnings

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _no_saves():
    """`torch.save` writes nothing while a paper is planned (what it would save is an untrained fake model); a
    `torch.load` of a path saved during the plan gets the object back, so a later phase that reloads runs on."""
    saved: dict[str, Any] = {}
    save, load = torch.save, torch.load

    def plan_save(obj, f, *args, **kwargs):
        saved[str(f)] = obj

    def plan_load(f, *args, **kwargs):
        return saved[str(f)] if str(f) in saved else load(f, *args, **kwargs)

    torch.save, torch.load = plan_save, plan_load
    try:
        yield
    finally:
        torch.save, torch.load = save, load


@contextlib.contextmanager
def _alarm(deadline: float):
    """SIGPROF when the budget of CPU time is spent (main thread only): a paper loop that never reaches `fit` still
    ends. CPU time, not wall time: a plan gets as far on a busy machine as on an idle one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise PlanStop("time budget spent")

    old = signal.signal(signal.SIGPROF, _raise)
    signal.setitimer(signal.ITIMER_PROF, max(0.01, deadline - time.process_time()))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


_WEIGHTS_KEY = re.compile(r"\w+_weights|\w+_ckpt")  # a local file of pretrained weights (ldka's backbone)


# ---- planning data ------------------------------------------------------------------------------------------------
# keys that say how much data there is or where it comes from, not the shape of a row or of the model
_DATA_KEY = re.compile(
    r"(n_samples|n_sources|n_obs|per_regime|n_questions|n_pairs|n_pairs_heldout|n_intents|n_attacked|docs|prompts|"
    r"tv_contexts|lexicon|n_videos|test_contexts|n_train|n_test|n_val|n_eval|holdout|n_images|cells|n_docs|"
    r"n_clips|n_molecules|n_transitions|toy_train|toy_exact|n_entities|n_seed|pool_size|n_external|n_drawings|"
    r"n_sequences|n_nodes|n_mc|n_curve|train_M|n_targets|examples|eval_pairs|transfer_pairs|n_train_graphs|"
    r"n_test_graphs|n_val_graphs|nodes_train|nodes_test|review_instances|gate2_instances|n_questions|"
    r"n_fit|n_eval_families|dataset|\w+_dir|\w+_path|\w+_file|data_root|source|\w*encoder|embedder|body_model|karate|n_f|n_p|"
    r"episodes|\w+_episodes)")
_SOURCE_KEY = re.compile(r"dataset|\w+_dir|\w+_path|\w+_file|data_root|source|body_model")


def data_overrides(profile: Mapping[str, Any], test: Mapping[str, Any],
                   declared: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The profile's data-amount/source keys (`_DATA_KEY`, or fields the paper declares `{"data": True}`) replaced
    by the test profile's (absent there: the default)."""
    out = dict(profile)
    for key in set(profile) | set(test):
        if _DATA_KEY.fullmatch(key) or key in declared:
            if key in test:
                out[key] = test[key]
            else:
                out.pop(key, None)
    return out


def _counts(profile: Mapping[str, Any], planned: Mapping[str, Any],
            declared: frozenset[str] = frozenset()) -> list[tuple[int, int]]:
    """(planning value, profile value) of every overridden data count that grows (an int, or a list's largest)."""
    def count(v):
        if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            v = max(v)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    out = []
    for key, value in profile.items():
        big, small = count(value), count(planned.get(key))
        if (_DATA_KEY.fullmatch(key) or key in declared) and big is not None and small is not None and 0 < small < big:
            out.append((small, big))
    return out


def _table_scale(rows: int, counts: list[tuple[int, int]]) -> float:
    """How much larger a table of `rows` planning rows is at the profile's size: it grows with the largest count
    whose planning value divides its rows (rows = k x count), else with the largest ratio of any (an upper bound)."""
    dividing = [(small, big) for small, big in counts if rows and rows % small == 0]
    if dividing:
        small, big = max(dividing)
        return big / small
    return max((big / small for small, big in counts), default=1.0)


def _prepare_cached(paper, params: PaperParams, cache: Path) -> Path:
    key = hashlib.sha256(json.dumps(params.model_dump(mode="json"), sort_keys=True).encode()
                         + Path(paper.train.__code__.co_filename).read_bytes()).hexdigest()[:16]
    out = cache / f"{paper.id}-{key}"
    if (out / ".failed").exists():  # failed before with these params and this code: not worth the time again
        raise PrepareFailed((out / ".failed").read_text())
    if not (out / ".done").exists():
        out.mkdir(parents=True, exist_ok=True)
        try:
            paper.prepare(params, out)
        except Exception as e:
            (out / ".failed").write_text(type(e).__name__)
            raise
        (out / ".done").write_text("")
    return out


def _table_bytes(folder: Path, counts: list[tuple[int, int]]) -> int:
    """In-memory (uncompressed) bytes of the folder's tables, each scaled to the profile's size."""
    import pyarrow.parquet as pq

    total = 0.0
    for f in folder.glob("*.parquet"):
        md = pq.ParquetFile(f).metadata
        size = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
        total += size * _table_scale(md.num_rows, counts)
    return int(total)


def planning_data(paper, raw: Mapping[str, Any], test_raw: Mapping[str, Any], cache: Path) -> tuple[Path, int, str]:
    """(folder of planning data, host bytes the profile's data needs, note)."""
    from models.registry import validate
    from tasks.fixtures import real_format

    declared = frozenset(declared_fields(paper.Params, "data"))
    small = data_overrides(raw, test_raw, declared)
    fixture = real_format(paper.id, raw, cache / f"fixture-{paper.id}")
    small.update(fixture or {})
    try:
        params = validate(paper, small, where=f"plan data of {paper.id}")
        folder = _prepare_cached(paper, params, cache)
        note = "profile's row shapes, test profile's data amount"
        swapped = sorted(k for k in raw if _SOURCE_KEY.fullmatch(k) and getattr(params, k, None) != raw[k])
        if fixture:  # the real data's format and row shapes, random values (tasks/fixtures.py)
            note = f"a fixture in the real data's format ({', '.join(sorted(fixture))}), test profile's data amount"
        elif swapped:  # a real dataset's rows are its own: the stand-in's may be smaller (sei: 8x8, not 224x224)
            note = f"the test profile's stand-in for the real data ({', '.join(swapped)}): activations a lower bound"
        counts = _counts(raw, small, declared)
    except Exception as e:  # noqa: BLE001 - a prepare that needs the real files: the test profile's data
        params = validate(paper, test_raw, where=f"papers.{paper.id}.test")
        folder = _prepare_cached(paper, params, cache)
        reason = str(e) if isinstance(e, PrepareFailed) else type(e).__name__
        note = f"test profile's data ({reason} with the profile's row shapes)"
        counts = _counts(raw, test_raw, declared)
    return folder, _table_bytes(folder, counts), note


# ---- planning one paper -------------------------------------------------------------------------------------------
def plan(paper_id: str, raw: Mapping[str, Any], test_raw: Mapping[str, Any], *, profile: str = "full",
         gpu: str = DEFAULT_GPU, mfu: float = DEFAULT_MFU, cache: Path, budget_s: float | None = None) -> Plan:
    """Plan one paper's profile (`raw`: its validated-to-be params as a dict; `test_raw`: its test profile)."""

    from models import registry

    if gpu not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; known: {', '.join(GPUS)}")
    paper = registry.get(paper_id)
    params = registry.validate(paper, raw, where=f"papers.{paper_id}.{profile}")
    replicas = replica_counts(paper, params)
    if replicas:  # independent copies trained side by side cost the same each: one is traced (and its data
        raw = {**raw, **dict.fromkeys(replicas, 1)}  # prepared), its costs scaled back
        params = registry.validate(paper, raw, where=f"papers.{paper_id}.{profile}")
    # pretrained weights from a local file change values, not shapes or costs: traced without them
    unread = sorted(k for k in raw if _WEIGHTS_KEY.fullmatch(k) and raw[k])
    if unread:
        params = registry.validate(paper, {k: v for k, v in raw.items() if k not in unread}, where=paper_id)
    t0 = time.monotonic()
    data_dir, table_bytes, note = planning_data(paper, raw, test_raw, cache)
    per_node = min(params.ranks, GPUS_PER_NODE)  # every rank of a node reads the tables into its own memory
    result = Plan(paper=paper_id, profile=profile, gpu=gpu, ranks=params.ranks, zero_stage=params.zero_stage,
                  bf16=params.bf16, mfu=mfu, data_bytes=table_bytes * per_node,
                  data_note=f"{gib(table_bytes)} of tables x {per_node} rank(s) a node; {note}"
                  + (f"; pretrained weights not read ({', '.join(unread)})" if unread else ""))
    if not paper.learns:  # nothing trains, so nothing to trace: the plan is the data
        result.seconds = time.monotonic() - t0
        return result
    out_dir = cache / "out" / paper_id
    out_dir.mkdir(parents=True, exist_ok=True)
    budget_s = BUDGET_S if budget_s is None else budget_s
    result.replicas, result.passes = dict(replicas), declared_fields(type(params), "passes")

    def trace(real_data: bool) -> tuple[list[Phase], str]:  # real values may abort native code: in a child
        if real_data:  # a hung child spends no CPU: a wall-clock limit ends it, well above the CPU budget
            return _forked(_trace, paper, params, data_dir, out_dir, budget_s, real_data=True,
                           wall_s=max(RETRY_WALL_S, int(3 * budget_s)))
        return _trace(paper, params, data_dir, out_dir, budget_s, real_data=False)

    # data-side tensors (tables, replay buffers, index bookkeeping, a paper's seeded draws) hold their real values,
    # so a paper's data loops run at NumPy speed and its data-dependent control flow is the real one; a trace that
    # fails on them (a batch indexed past the planning tables' rows) is run once more with every value fake
    phases, result.stopped = trace(real_data=True)
    if result.stopped and not result.stopped.startswith("time budget"):
        again, stopped = trace(real_data=False)
        if (not stopped, len(again)) > (False, len(phases)):
            phases, result.stopped = again, stopped
    scale = math.prod(replicas.values())
    for ph in phases:
        ph.params, ph.buffers, ph.frozen_bytes = ph.params * scale, ph.buffers * scale, ph.frozen_bytes * scale
        # lock-step copies: every copy's saved activations are alive when backward starts, one copy's transients
        ph.flops_step, ph.activation_bytes = ph.flops_step * scale, ph.activation_bytes + (scale - 1) * ph.saved_bytes
        ph.saved_bytes *= scale
        ph.weights_bytes, ph.grads_bytes, ph.optimizer_bytes = model_states(
            ph.params, ph.largest_layer, params.ranks, params.zero_stage, params.bf16)
        ph.rank_bytes = ph.rank_bytes_at(params.ranks, params.zero_stage, params.bf16)
    result.phases = phases
    result.seconds = time.monotonic() - t0
    return result


def declared_fields(params_type: type[PaperParams], kind: str) -> list[str]:
    """Fields a paper marks `Field(..., json_schema_extra={kind: True})`: "replicas", "data" (an amount of data
    that the planning copy takes from the test profile, like the counts `_DATA_KEY` matches by name), or "passes"
    (epochs: a phase's steps are these passes over the rows, so they are counted at the planning copy's rows)."""
    return [name for name, spec in params_type.model_fields.items()
            if isinstance(spec.json_schema_extra, dict) and spec.json_schema_extra.get(kind)]


def warm_up(folder: Path) -> None:
    """Trace a toy step (convolution, attention, embedding, norms, a loss), all-fake and on real values, in this
    process: the lazy imports and per-op caches the fake-tensor machinery fills on first use are then inherited by
    every planner `plan_all` forks, instead of each paying them again (~1.3 CPU s a paper)."""
    import types

    def train(ctx):
        net = torch.nn.ModuleDict({"conv": torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                                                torch.nn.ReLU(), torch.nn.Flatten(1)),
                                   "emb": torch.nn.Embedding(16, 8), "norm": torch.nn.LayerNorm(8),
                                   "attn": torch.nn.MultiheadAttention(8, 2, batch_first=True),
                                   "head": torch.nn.Linear(8 * 36 + 8, 4)})

        def step_fn(engine, b, step):
            m = engine.module
            h = m["norm"](m["emb"](b["tok"]))
            h = torch.nn.functional.gelu(m["attn"](h, h, h, need_weights=False)[0]).mean(1)
            logits = m["head"](torch.cat([m["conv"](b["x"]), h], 1))
            return torch.nn.functional.cross_entropy(logits, b["y"]), {"acc": float((logits.argmax(1) == b["y"])
                                                                                    .float().mean())}

        ctx.fit("warm-up", ctx.engine(net, 1e-3), step_fn, lambda step: {
            "x": torch.randn(4, 3, 8, 8), "tok": torch.randint(0, 16, (4, 5)), "y": torch.tensor([0, 1, 2, 3])}, 2)

    for real in (True, False):
        _trace(types.SimpleNamespace(train=train), PaperParams(), folder, folder, BUDGET_S, real_data=real)


def replica_counts(paper, params: PaperParams) -> dict[str, int]:
    """Counts (> 1) of the fields a paper declares as replicas (`Field(..., json_schema_extra={"replicas": True})`):
    that many independent copies of every network, trained side by side in the same phases on the same batches,
    so each phase's parameters, buffers, FLOPs and saved activations are that many times one copy's."""
    counts = {name: getattr(params, name) for name in declared_fields(type(params), "replicas")}
    return {name: n for name, n in counts.items() if isinstance(n, int) and n > 1}


def _trace(paper, params: PaperParams, data_dir: Path, out_dir: Path, budget_s: float,
           real_data: bool) -> tuple[list[Phase], str]:
    """Run `paper.train` under the planning context: (the phases traced, why it stopped or "")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ctx = PlanContext(params=params, data_dir=data_dir, out_dir=out_dir, world_size=params.ranks,
                      deadline=time.process_time() + budget_s)
    threads = torch.get_num_threads()
    stopped = ""
    try:
        with _alarm(ctx.deadline + 1), _quiet(), _no_saves(), _fake_reads(), _shared_mode_on_deepcopy(), \
                _reuse_inference_calls(ctx), _no_kernel_launches_on_fakes(ctx), \
                FakeTensorMode(allow_non_fake_inputs=True), _Placeholders(real_data), \
                (_real_tables() if real_data else contextlib.nullcontext()):
            paper.train(ctx)
        if ctx.phases:  # sampling or evaluation after the last phase
            last = ctx.phases[-1]
            ctx.phases[-1] = replace(last, inference_bytes=max(last.inference_bytes, ctx.take_inference_bytes()))
    except PlanStop as e:
        stopped = str(e)
        if os.environ.get("PAPERLINE_PLAN_DEBUG"):  # where the budget ran out
            traceback.print_exc()
    except Exception as e:  # noqa: BLE001 - the first thing fakes cannot do ends the plan; traced phases stand
        stopped = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if time.process_time() > ctx.deadline:  # the budget's PlanStop, re-raised as another error by a paper's
            stopped = "time budget spent"  # callee (`load_state_dict` reports what failed inside a copy)
        if os.environ.get("PAPERLINE_PLAN_DEBUG"):
            traceback.print_exc()
    finally:
        torch.set_num_threads(threads)
    return ctx.phases, stopped


@contextlib.contextmanager
def _real_tables():
    """Tensors made from NumPy arrays or Python lists (the planning tables, constants) are real, up to
    `_MAX_READ` elements, and so is what ops compute from real tensors only (`_Placeholders(real_data=True)`);
    everything a model computes stays fake. The planning data is small (the test profile's amount), so this costs
    little; a batch indexed past its rows fails, and the plan then traces again with every value fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(make):
        def made(data, *args, **kwargs):
            if isinstance(data, torch.Tensor) or getattr(data, "size", 0) > _MAX_READ:
                return make(data, *args, **kwargs)
            with unset_fake_temporarily():
                return make(data, *args, **kwargs)
        return made

    saved = {name: getattr(torch, name) for name in ("tensor", "as_tensor", "from_numpy")}
    for name, make in saved.items():
        setattr(torch, name, real(make))
    try:
        yield
    finally:
        for name, make in saved.items():
            setattr(torch, name, make)


def _forked(fn: Callable, *args, wall_s: int = RETRY_WALL_S, **kwargs) -> tuple[list[Phase], str]:
    """`fn(*args, **kwargs)` in a forked child: real values fed to native code (LAPACK, k-means) may abort the
    process, which must not take the plan with it. A bare `os.fork`, since `plan_all`'s planners are daemonic
    processes, which multiprocessing forbids to have children."""
    import pickle

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, then leave without the interpreter's teardown
        os.close(read)
        os.dup2(2, 1)  # native code's messages (LAPACK's) go to stderr: stdout is the plan's, and `--json` is parsed
        # a fork of a process with threads can deadlock on a lock another thread held (no CPU is spent, so the
        # budget's SIGPROF never comes): a wall-clock alarm ends such a child, and the retry counts as died
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(wall_s)
        try:
            with os.fdopen(write, "wb") as out:
                pickle.dump(fn(*args, **kwargs), out)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        data = answer.read()
    _, status = os.waitpid(pid, 0)
    try:
        return pickle.loads(data)
    except (EOFError, pickle.UnpicklingError):
        return [], f"the trace on real table values died (wait status {status})"
