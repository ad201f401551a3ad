"""The CPU seconds one piece of work in a shared process costs: a replicate's evaluation runs in the flow's process,
beside the threads of another paper's flow (`--parallel`), the launcher's progress rendering and MLflow's clients,
and `time.process_time()` over the evaluation would charge all of them to it.

`WorkCPU` charges the thread that runs the block and every Python thread started from a charged thread while the
block runs (a thread pool the work makes, and the threads those threads start), whether it ends inside the block or
not: `threading.Thread.start` is wrapped, once, so that a thread started from a charged thread runs charged too and
adds its `time.thread_time()` when it ends; one still alive at the block's end is read from Linux's /proc (at the
scheduler's tick, 10 ms). A thread that other work starts meanwhile (the next paper's flow beside an evaluation) is
not charged, whatever it spends. Not charged either: a thread alive before the block that the work uses (a pool
made earlier; evaluations run torch and BLAS on one thread, so none is) and native threads no Python code started
(a torch OpenMP pool a block widens with `torch_threads`). Without /proc, a still-alive thread counts nothing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_TASKS = Path("/proc/self/task")

_charged: dict[int, WorkCPU] = {}  # native thread id -> the work its CPU is charged to
_lock = threading.Lock()
_thread_start = threading.Thread.start


def thread_cpu_seconds() -> dict[int, float] | None:
    """user + system CPU seconds of every live thread of this process by native id; None without /proc."""
    if not _TASKS.is_dir():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for entry in os.listdir(_TASKS):
        try:  # fields after the command's closing parenthesis: state is 3rd, utime 14th, stime 15th
            fields = (_TASKS / entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def _start_charged(thread: threading.Thread) -> None:
    """`threading.Thread.start`, which makes a thread started from a charged thread charged to the same work."""
    work = _charged.get(threading.get_native_id())
    if work is not None:
        thread.run = work._charging(thread.run)
    _thread_start(thread)


threading.Thread.start = _start_charged


def charge(seconds: float) -> None:
    """CPU seconds the calling thread's work spent in another process (an evaluator: tasks/evaluators.py), added to
    the WorkCPU that charges this thread; nothing when none does."""
    with _lock:
        work = _charged.get(threading.get_native_id())
        if work is not None:
            work._ended += seconds


class WorkCPU:
    """`with WorkCPU() as cpu: work()`, then `cpu.seconds`: the CPU seconds charged to the work (module docstring)."""

    seconds: float = 0.0

    def __enter__(self) -> WorkCPU:
        self._me = threading.get_native_id()
        self._ended = 0.0  # what charged threads that have ended spent
        self._alive: set[int] = set()  # charged threads running now, other than the caller
        with _lock:
            self._outer = _charged.get(self._me)  # a WorkCPU around this one: it is the caller's again after
            _charged[self._me] = self
        self._start = time.thread_time()
        return self

    def _charging(self, run):
        def run_charged():
            me = threading.get_native_id()
            with _lock:
                _charged[me] = self
                self._alive.add(me)
            try:
                run()
            finally:
                with _lock:
                    self._ended += time.thread_time()
                    self._alive.discard(me)
                    del _charged[me]
        return run_charged

    def __exit__(self, *exc) -> None:
        own = time.thread_time() - self._start
        with _lock:
            if self._outer is None:
                del _charged[self._me]
            else:
                _charged[self._me] = self._outer
            alive, ended = set(self._alive), self._ended
        threads = thread_cpu_seconds() if alive else {}
        self.seconds = own + ended + sum((threads or {}).get(tid, 0.0) for tid in alive)
