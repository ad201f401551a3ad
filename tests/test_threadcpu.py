"""A replicate's evaluation is charged its own CPU, not that of the flow's other threads (tasks/threadcpu.py)."""

from __future__ import annotations

import threading
import time

import pytest

from tasks.threadcpu import WorkCPU, thread_cpu_seconds

pytestmark = pytest.mark.skipif(thread_cpu_seconds() is None, reason="needs Linux's /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_neighbour_thread_is_not_charged_and_the_works_own_threads_are():
    stop = threading.Event()

    def neighbour():  # another paper's flow thread, busy all along
        while not stop.is_set():
            _spin(0.01)

    other = threading.Thread(target=neighbour)
    other.start()
    try:
        time.sleep(0.05)
        with WorkCPU() as cpu:
            _spin(0.4)  # the work itself
            helper = threading.Thread(target=_spin, args=(0.3,))  # a pool the work starts and joins
            helper.start()
            helper.join()
        process_wide = time.process_time()
    finally:
        stop.set()
        other.join()
    assert process_wide > 0  # (read before the neighbour stopped)
    assert cpu.seconds == pytest.approx(0.7, abs=0.12)  # 0.4 own + 0.3 of the thread it started; ticks of 10 ms


def test_idle_work_costs_nothing_while_a_neighbour_burns():
    stop = threading.Event()
    other = threading.Thread(target=lambda: [_spin(0.01) for _ in iter(stop.is_set, True)])
    other.start()
    try:
        with WorkCPU() as cpu:
            time.sleep(0.5)  # waiting on a lock or a sleep: no CPU of its own
    finally:
        stop.set()
        other.join()
    assert cpu.seconds < 0.08


def test_a_thread_other_work_starts_during_the_block_is_not_charged():
    go = threading.Event()
    neighbour = threading.Thread(target=_spin, args=(0.4,))  # the next paper's flow

    def suite():  # the suite's thread, alive before the block: it starts the next paper while an evaluation runs
        go.wait()
        neighbour.start()
        neighbour.join()

    launcher = threading.Thread(target=suite)
    launcher.start()
    with WorkCPU() as cpu:
        go.set()
        launcher.join()  # the neighbour started and ended inside the block
        _spin(0.1)
    assert cpu.seconds == pytest.approx(0.1, abs=0.06)


def test_threads_of_threads_and_threads_left_running_are_charged():
    done = threading.Event()

    def grandchild():
        _spin(0.2)
        done.wait()  # still alive when the block ends

    def child():
        threading.Thread(target=grandchild).start()
        _spin(0.2)

    with WorkCPU() as cpu:
        worker = threading.Thread(target=child)
        worker.start()
        worker.join()
        time.sleep(0.3)  # the grandchild spins meanwhile
    done.set()
    assert cpu.seconds == pytest.approx(0.4, abs=0.08)
