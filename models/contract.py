"""The contract every paper pipeline shares: `Paper`, its params base class, the claim, and the context protocols.

A paper module (`models/<id>.py`) exposes one `PAPER = Paper(...)`. It never imports Prefect, MLflow, DVC or the
DeepSpeed launcher: `tasks/` builds the contexts below and hands them in, so a paper stays plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from models.verdicts import Claim, ClaimResult, Compare  # noqa: F401 - the contract's public names

if TYPE_CHECKING:  # annotations only: importing the contract must not cost a torch import (fast CLI paths)
    import torch


class InputSpec(BaseModel):
    """One real dataset or checkpoint a profile reads from disk; it enters DVC like any stage input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="Local path (file or folder), relative to the project root or absolute.")
    format: str = Field(description="On-disk format the loader reads, e.g. 'image-folder', 'cifar-binary', 'hdf5'.")
    url: str = Field("", description="Where to get it (the command `paperline data` prints uses it).")
    license: str = Field("", description="The dataset's license, as its publisher states it.")
    sha256: str = Field("", description="Checksum of a single-file input, when the publisher gives one.")


class PaperParams(BaseModel):
    """Base of every paper's `Params`: strict (unknown keys rejected), frozen, with the runtime knobs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)

    seed: int = Field(0, description="Seeds data generation, initialisation and batch order.")
    ranks: int = Field(1, ge=1, le=1024, description="DeepSpeed ranks (processes) the train task launches.")
    threads: int | None = Field(None, ge=1, description="Torch intra-op threads of each rank while training; "
                                "None: the job's cores split over its ranks. 1 where a step's ops are too small to "
                                "split (thread hand-offs and spin-waits cost more CPU than they save).")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage; 0-2 on CPU.")
    bf16: bool = Field(False, description="bf16 training (GPUs only; fp32 on CPU).")
    checkpoint_every: int = Field(50, ge=1, description="Training steps between committed checkpoints.")
    replicates: int = Field(1, ge=1, le=100, description="Independent replicates (seeds seed, seed+1, ...) the "
                            "claim is decided over; test 1, smoke and full >= 3 (DESIGN.md, Verdicts).")
    inputs: dict[str, InputSpec] = Field(default_factory=dict, description="Real data a (full) profile reads: "
                                         "name -> where it lies and how to get it (`paperline data <id>`).")


Decay = Literal["constant", "cosine", "linear"]  # the engine's learning-rate decays after warm-up (tasks/context.py)


class ScheduledParams(PaperParams):
    """`PaperParams` plus the engine's learning-rate schedule, for a paper that passes them to
    `ctx.engine(..., steps=, warmup=, decay=)`."""

    warmup: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    decay: Decay = Field("constant", description="Learning-rate decay after warm-up, down to the last step.")


class TrainContext(Protocol):
    """What `Paper.train` gets inside every rank (implemented in `tasks/context.py`)."""

    params: Any
    data_dir: Path
    out_dir: Path  # run-scoped, shared by all ranks; only rank 0 writes unless a file name carries the rank
    rank: int
    world_size: int
    device: torch.device

    def engine(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0, *,
               arms: Mapping[str, Any] | None = None, grad_clip: float | None = 1.0, steps: int | None = None,
               warmup: int = 0, decay: Decay = "constant", ema: float | None = None,
               betas: tuple[float, float] = (0.9, 0.999)) -> Any: ...
    def fit(self, name: str, engine: Any, step_fn: Callable, batch_fn: Callable, num_steps: int,
            state: dict[str, torch.Tensor] | None = None, log_every: int = 10) -> None: ...
    def ema_network(self, engine: Any) -> torch.nn.Module | None: ...  # the EMA `engine(ema=...)` keeps
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def progress(self, message: str) -> None: ...


class EvalContext(Protocol):
    """What `Paper.evaluate` gets: one process, no distributed setup."""

    params: Any
    data_dir: Path
    out_dir: Path  # holds what train() saved
    plots_dir: Path

    def network(self, phase: str, ema: bool = False) -> torch.nn.Module: ...  # what ctx.fit saved of that phase
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
    # the claim's timed samples are taken in train() (not inside evaluate's ctx.timing()): it trains on a quiet machine
    times_training: bool = False
