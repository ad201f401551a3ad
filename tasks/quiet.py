"""A quiet machine for wall-clock timings (DESIGN.md, Verdicts: a timed part is measured with nothing else running).

A paper with timed parts times its loops inside `quiet()`: it waits until no paperline work (training, data
preparation, another evaluation) of any process on this machine runs, and holds everything else off while it times.
That work runs inside `busy()`, any number at once. An evaluation is a `Shift`: busy throughout, quiet only inside
the timing loops it marks (`EvalContext.timing()`), so the rest of a timed paper's evaluation runs beside other
work. A paper whose timed samples come from its training (`Paper.times_training`) trains inside `quiet()`.
Two file locks (flock: across processes and across threads of one process) make it fair: the timer first takes the
gate, so new work waits behind it instead of starving it, then the floor exclusively, which it gets once the work
already running has finished.

The locks live in the system temp folder, one pair per user (`PAPERLINE_QUIET_LOCK` names another base path), so
runs in different checkouts on one machine wait on each other too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from models.verdicts import LOAD_METRIC

WAIT_METRIC = "timing/quiet_wait_s"


def _base() -> Path:
    return Path(os.environ.get("PAPERLINE_QUIET_LOCK") or Path(tempfile.gettempdir()) /
                f"paperline-quiet-{os.getuid()}")


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:  # one open file description per holder: flock then excludes threads too
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Work that loads the machine: waits while a timing holds the gate, then runs beside other work."""
    base = _base()
    with _flock(base.with_suffix(".gate"), fcntl.LOCK_EX):
        pass  # through the gate: a timer waiting for the floor holds it, so this waits behind the timer
    with _flock(base.with_suffix(".floor"), fcntl.LOCK_SH):
        yield


@contextlib.contextmanager
def quiet() -> Iterator[dict[str, float]]:
    """Nothing else of paperline runs on this machine while inside; yields how long it waited for that."""
    base = _base()
    start = time.perf_counter()
    with _flock(base.with_suffix(".gate"), fcntl.LOCK_EX), _flock(base.with_suffix(".floor"), fcntl.LOCK_EX):
        yield {WAIT_METRIC: time.perf_counter() - start}


class Shift:
    """A stretch of work (an evaluation) that holds `busy()` throughout, except inside `timing()`, which trades
    that hold for `quiet()` (a `quiet()` taken while holding `busy()` would wait for itself). Counts its timings,
    how long they waited for the machine, and the highest load any of them ended at."""

    def __init__(self) -> None:
        self.timings = 0
        self.waited_s = 0.0
        self.load = 0.0
        self._hold: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> Shift:
        self._take_busy()
        return self

    def __exit__(self, *exc) -> None:
        self._drop_busy()

    def _take_busy(self) -> None:
        self._hold = busy()
        self._hold.__enter__()

    def _drop_busy(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.__exit__(None, None, None)

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        if self._hold is None:
            raise RuntimeError("timing() outside its shift, or inside another timing()")
        self._drop_busy()
        try:
            with quiet() as waited:
                yield
                self.load = max(self.load, load_1m())
            self.timings += 1
            self.waited_s += waited[WAIT_METRIC]
        finally:
            self._take_busy()

    def metrics(self) -> dict[str, float]:
        """What a timed claim part records of its timings: the waits and the load (none when nothing was timed)."""
        return {WAIT_METRIC: self.waited_s, LOAD_METRIC: self.load} if self.timings else {}


def load_1m() -> float:
    """The machine's 1-minute load average (what the timings were taken under)."""
    return os.getloadavg()[0]
