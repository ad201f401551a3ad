"""When a paper's training ranks start and where its evaluations run, decided in one place.

A training job pays seconds before its first step (tasks/train.py: `prestart`); a replicate's evaluation runs on
one thread. A `Launcher` hides both overlaps from the pipeline's steps:
- the paper's ranks are prestarted as the run begins (while the data is checked and the MLflow run opens);
- when a replicate's training ends, the next replicate's ranks are prestarted, or in a suite the next paper's
  (`Upcoming`), while this replicate evaluates on the launcher's evaluator thread;
- a paper that times loops in its evaluation prestarts nothing after a training: nothing may run beside its
  timings (tasks/quiet.py holds other papers' work back; one that times its training trains quietly instead);
- what no training claimed is cancelled when the run ends (a cached result, a failure before training).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from models.registry import RunRequest
from tasks import train

T = TypeVar("T")


class Upcoming:
    """A suite's papers not started yet, in order: when one paper's training ends, the next one's ranks start."""

    def __init__(self, requests: list[RunRequest]):
        self._params = {r.paper: r.params for r in requests}  # insertion order: the suite's order
        self._lock = threading.Lock()

    def start(self, paper: str) -> None:
        with self._lock:
            self._params.pop(paper, None)

    def prestart_next(self) -> None:
        with self._lock:  # held while it starts, so the next paper cannot start (and miss it) in between
            if self._params:
                train.prestart(*next(iter(self._params.items())))


# set by the suite for the papers it runs (their contexts are copies holding it); None for a single paper
UPCOMING: contextvars.ContextVar[Upcoming | None] = contextvars.ContextVar("upcoming_papers", default=None)


class Launcher:
    """One paper run's launches: `with Launcher(request, timed) as launch:` prestarts the paper's ranks; on exit
    it waits for the evaluations it was given and cancels a prestarted job nothing claimed."""

    def __init__(self, request: RunRequest, timed: bool):
        self._paper, self._params, self._timed = request.paper, request.params, timed
        self._evaluator = ThreadPoolExecutor(1, thread_name_prefix=f"evaluate-{request.paper}")

    def __enter__(self) -> Launcher:
        train.prestart(self._paper, self._params)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._evaluator.shutdown(wait=True)
        finally:
            train.cancel_prestarted(self._paper)

    def nothing_to_train(self) -> None:
        """Every replicate is stored: the prestarted ranks are not needed."""
        train.cancel_prestarted(self._paper)

    def trained(self, trains_later: bool) -> None:
        """A replicate's training ended: warm up what trains next while it evaluates."""
        if self._timed:
            return
        if trains_later:
            train.prestart(self._paper, self._params)
        elif (upcoming := UPCOMING.get()) is not None:
            upcoming.prestart_next()

    def evaluate(self, work: Callable[[], T]) -> Future[T]:
        """`work` on the evaluator thread (one evaluation at a time), in the caller's context (Prefect's flow run
        lives in context variables, which a thread does not inherit); the next replicate trains meanwhile."""
        return self._evaluator.submit(contextvars.copy_context().run, work)

    @staticmethod
    def stored(value: T) -> Future[T]:
        """A replicate that does not train: its result, already there."""
        done: Future[T] = Future()
        done.set_result(value)
        return done
