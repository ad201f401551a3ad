"""The contract every paper pipeline shares: `Paper`, its params base class, the claim, and the context protocols.

A paper module (`models/<id>.py`) exposes one `PAPER = Paper(...)`. It never imports Prefect, MLflow, DVC or the
DeepSpeed launcher: `tasks/` builds the contexts below and hands them in, so a paper stays plain PyTorch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # annotations only: importing the contract must not cost a torch import (fast CLI paths)
    import torch


class PaperParams(BaseModel):
    """Base of every paper's `Params`: strict (unknown keys rejected), frozen, with the runtime knobs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    seed: int = Field(0, description="Seeds data generation, initialisation and batch order.")
    ranks: int = Field(1, ge=1, le=1024, description="DeepSpeed ranks (processes) the train task launches.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage; 0-2 on CPU.")
    bf16: bool = Field(False, description="bf16 training (GPUs only; fp32 on CPU).")
    checkpoint_every: int = Field(50, ge=1, description="Training steps between committed checkpoints.")
    replicates: int = Field(1, ge=1, le=100, description="Independent replicates (seeds seed, seed+1, ...) the "
                            "claim is decided over; test 1, smoke and full >= 3 (DESIGN.md, Verdicts).")
    inputs: dict[str, InputSpec] = Field(default_factory=dict, description="Real data a (full) profile reads: "
                                         "name -> where it lies and how to get it (`paperline data <id>`).")


class InputSpec(BaseModel):
    """One real dataset or checkpoint a profile reads from disk; it enters DVC like any stage input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="Local path (file or folder), relative to the project root or absolute.")
    format: str = Field(description="On-disk format the loader reads, e.g. 'image-folder', 'cifar-binary', 'hdf5'.")
    url: str = Field("", description="Where to get it (the command `paperline data` prints uses it).")
    license: str = Field("", description="The dataset's license, as its publisher states it.")
    sha256: str = Field("", description="Checksum of a single-file input, when the publisher gives one.")


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
}


@dataclass(frozen=True)
class Compare:
    """`left op right`: left a metric name; right a metric name, a number the spec fixes (a threshold), or a tuple
    of metric names meaning "the best of these" (max for > and >=, min for < and <=)."""

    left: str
    op: Literal[">", ">=", "<", "<="]
    right: str | float | tuple[str, ...]

    def evaluate(self, metrics: Mapping[str, float]) -> tuple[bool, str]:
        if isinstance(self.right, int | float):
            if self.left not in metrics:
                raise KeyError(f"claim needs metrics that evaluate() did not return: {[self.left]}")
            left = float(metrics[self.left])
            return _OPS[self.op](left, float(self.right)), f"{self.left}={left:.4f} {self.op} {self.right:g}"
        names = (self.right,) if isinstance(self.right, str) else self.right
        missing = [n for n in (self.left, *names) if n not in metrics]
        if missing:
            raise KeyError(f"claim needs metrics that evaluate() did not return: {missing}")
        values = {n: float(metrics[n]) for n in names}
        best = max(values, key=values.get) if self.op in (">", ">=") else min(values, key=values.get)
        left, right = float(metrics[self.left]), values[best]
        holds = _OPS[self.op](left, right)
        who = best if len(names) == 1 else f"best of {len(names)}: {best}"
        return holds, f"{self.left}={left:.4f} {self.op} {right:.4f} ({who})"

    def text(self) -> str:
        if not isinstance(self.right, tuple):
            right = self.right if isinstance(self.right, str) else f"{self.right:g}"
            return f"{self.left} {self.op} {right}"
        best = "max" if self.op in (">", ">=") else "min"
        return f"{self.left} {self.op} {best}({_compact(self.right)})"


def _compact(names: tuple[str, ...]) -> str:
    """("baseline/aum/auroc", "baseline/loss/auroc") -> "baseline/{aum,loss}/auroc"."""
    parts = [n.split("/") for n in names]
    if len({len(p) for p in parts}) == 1 and len(parts[0]) >= 2:
        varying = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
        if len(varying) == 1:
            i = varying[0]
            return "/".join(parts[0][:i] + ["{" + ",".join(p[i] for p in parts) + "}"] + parts[0][i + 1 :])
    return ", ".join(names)


@dataclass(frozen=True)
class Claim:
    """A conjunction of comparisons over evaluation metrics; the framework evaluates it, never the paper."""

    all_of: tuple[Compare, ...]
    summary: str = ""

    def text(self) -> str:
        return " and ".join(c.text() for c in self.all_of)

    def evaluate(self, metrics: Mapping[str, float]) -> ClaimResult:
        parts = [c.evaluate(metrics) for c in self.all_of]
        return ClaimResult(holds=all(h for h, _ in parts), text=self.text(), numbers="; ".join(n for _, n in parts))


@dataclass(frozen=True)
class ClaimResult:
    holds: bool
    text: str
    numbers: str

    def line(self, paper_id: str) -> str:
        verdict = "holds" if self.holds else "does not hold"
        return f"claim {paper_id}: {self.text} -> {verdict}\n  {self.numbers}"


class TrainContext(Protocol):
    """What `Paper.train` gets inside every rank (implemented in `tasks/context.py`)."""

    params: Any
    data_dir: Path
    out_dir: Path  # run-scoped, shared by all ranks; only rank 0 writes unless a file name carries the rank
    rank: int
    world_size: int
    device: torch.device

    def engine(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> Any: ...
    def fit(self, name: str, engine: Any, step_fn: Callable, batch_fn: Callable, num_steps: int,
            state: dict[str, torch.Tensor] | None = None, log_every: int = 10) -> None: ...
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def progress(self, message: str) -> None: ...


class EvalContext(Protocol):
    """What `Paper.evaluate` gets: one process, no distributed setup."""

    params: Any
    data_dir: Path
    out_dir: Path  # holds what train() saved
    plots_dir: Path

    def progress(self, message: str) -> None: ...


@dataclass(frozen=True)
class Paper:
    """One paper's pipeline: a plain record the registry discovers in `models/<id>.py`."""

    id: str
    title: str
    seed: str  # "<seed file>, abstract <n>"
    Params: type[PaperParams]
    prepare: Callable[[PaperParams, Path], None]
    train: Callable[[TrainContext], None]
    evaluate: Callable[[EvalContext], dict[str, float]]
    primary: tuple[str, Literal["max", "min"]]  # the one metric that summarises the method, and its direction
    claim: Claim
    learns: bool = True  # False only where the spec says the paper has nothing to learn (train() then only computes)
    # torch threads while evaluate runs (models/common/threads.py says why one); None keeps the process default
    eval_threads: int | None = 1
    notes: dict[str, str] = field(default_factory=dict)
