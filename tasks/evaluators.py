"""Evaluations in processes of their own, for a suite that runs papers side by side (`--parallel N`).

In the flow's process evaluations take turns (tasks/steps.py `_EVALUATING`: torch's thread count and pyplot's
figures are process-wide), so one paper's heavy evaluation held back the other paper's, and the core that one would
have used idled. A suite of N papers side by side starts N evaluator processes, spawned once (each imports torch
and the papers once, not once a replicate) and replaced after `TASKS_PER_PROCESS` evaluations (what a paper caches
at module level goes with them). `tasks.steps.evaluate` runs the paper's own `evaluate` in one of them and does the
rest (what training measured, the checks, the logging) in the flow; the CPU seconds the evaluator spent are charged
to the replicate (tasks/threadcpu.py `charge`). A single paper's run evaluates in the flow's process, as before.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import resource
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextvars import ContextVar
from pathlib import Path

from tasks import threadcpu

POOL: ContextVar[ProcessPoolExecutor | None] = ContextVar("paperline_evaluators", default=None)
TASKS_PER_PROCESS = 12


@contextlib.contextmanager
def evaluators(count: int) -> Iterator[ProcessPoolExecutor]:
    """`count` evaluator processes for the papers run in this context (contexts copied inside it see them)."""
    pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                               max_tasks_per_child=TASKS_PER_PROCESS)
    token = POOL.set(pool)
    try:
        yield pool
    finally:
        POOL.reset(token)
        pool.shutdown(wait=True, cancel_futures=True)


def _start() -> None:
    from tasks import settings

    settings.configure_environment()
    import tasks.steps  # noqa: F401 - BLAS on one thread before any evaluation calls it (steps.single_threaded_blas)


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


class NoEvaluator(Exception):
    """No evaluator process serves this context: evaluate in the flow's process."""


def submit(paper_id: str, params, data_dir: Path, out_dir: Path) -> tuple[dict, dict]:
    """The paper's `evaluate` of one replicate in an evaluator process: its metrics and its timings' metrics; the
    process's CPU seconds are charged to the calling thread's work. NoEvaluator where
    none serves, or where the processes died (the pool is then dropped, and the suite evaluates in the flow)."""
    pool = POOL.get()
    if pool is None:
        raise NoEvaluator
    try:
        metrics, timed, cpu_s = pool.submit(evaluate_here, paper_id, params.model_dump(mode="json"),
                                                     str(data_dir), str(out_dir)).result()
    except BrokenProcessPool as e:
        POOL.set(None)
        print(f"[{paper_id}] the evaluator processes died ({e}); evaluating in the flow's process",
              file=sys.stderr, flush=True)
        raise NoEvaluator from e
    threadcpu.charge(cpu_s)
    return metrics, timed


def evaluate_here(paper_id: str, params: dict, data_dir: str, out_dir: str) -> tuple[dict, dict, float]:
    """In an evaluator process: the paper's `evaluate` as `tasks.steps.paper_metrics` runs it; returns its metrics,
    its timings' metrics (tasks/quiet.py Shift) and the CPU seconds it cost."""
    from models import registry
    from tasks.steps import paper_metrics

    paper = registry.get(paper_id)
    before = _cpu_seconds()
    metrics, shift = paper_metrics(paper, paper.Params.model_validate(params), Path(data_dir), Path(out_dir))
    return metrics, shift.metrics(), _cpu_seconds() - before
