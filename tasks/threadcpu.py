"""The CPU seconds one piece of work in a shared process costs: a replicate's evaluation runs in the flow's process,
beside the threads of another paper's flow (`--parallel`), the launcher's progress rendering and MLflow's clients,
and `time.process_time()` over the evaluation charged all of them to it.

`WorkCPU` counts the process's CPU over a block minus what its other threads that were alive at both ends spent
meanwhile: so the calling thread and every thread started during the block (a thread pool it shut down included: a
thread that ended took its CPU into the process's total) are charged, and threads that ran before and after it are
not. Two approximations: a thread alive before the block that the work itself used (a pool made earlier) is not
charged (evaluations run torch and BLAS on one thread, so none is); a thread that *other* work starts during the
block is (the next paper's flow starting beside an evaluation). Linux's /proc, at the scheduler's tick (10 ms);
elsewhere it falls back to the process's CPU."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_TASKS = Path("/proc/self/task")


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


class WorkCPU:
    """`with WorkCPU() as cpu: work()`, then `cpu.seconds`: the CPU seconds charged to the work (module docstring)."""

    seconds: float = 0.0

    def __enter__(self) -> WorkCPU:
        self._me = threading.get_native_id()
        self._threads = thread_cpu_seconds()
        self._process = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        process = time.process_time() - self._process
        after = thread_cpu_seconds()
        if self._threads is None or after is None:
            self.seconds = process
            return
        others = sum(after[tid] - before for tid, before in self._threads.items() if tid != self._me and tid in after)
        self.seconds = max(process - others, 0.0)
