"""A torch extension-build lock left by a killed build is cleared; a build in progress keeps its lock."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tasks.settings import ORPHAN_BUILD_LOCK_S, STALE_BUILD_LOCK_S, clear_stale_build_locks


def _lock(extensions: Path, op: str, age_s: float = 0.0) -> Path:
    """An op's build lock in `extensions`, last touched `age_s` ago."""
    lock = extensions / op / "lock"
    lock.parent.mkdir()
    lock.touch()
    past = time.time() - age_s
    os.utime(lock, (past, past))
    return lock


def test_only_locks_older_than_any_build_are_removed(tmp_path: Path) -> None:
    killed = _lock(tmp_path, "deepspeed_shm_comm", STALE_BUILD_LOCK_S + 60)
    building = _lock(tmp_path, "cpu_adam")
    assert clear_stale_build_locks(tmp_path) == [killed]
    assert not killed.exists() and building.exists()


def test_a_missing_extensions_folder_is_fine(tmp_path: Path) -> None:
    assert clear_stale_build_locks(tmp_path / "never-built") == []


def test_an_orphaned_lock_goes_early_and_a_lock_with_its_compiler_running_stays(tmp_path: Path) -> None:
    """Both locks are past the orphan age: one op's folder has a process working in it (the compiler, here a
    sleep), the other none (its build was killed)."""
    orphan, compiling = (_lock(tmp_path, op, ORPHAN_BUILD_LOCK_S + 60) for op in ("deepspeed_shm_comm", "cpu_adam"))
    compiler = subprocess.Popen(["sleep", "30"], cwd=compiling.parent)
    try:
        assert clear_stale_build_locks(tmp_path) == [orphan]
    finally:
        compiler.kill()
        compiler.wait()
    assert not orphan.exists() and compiling.exists()
    fresh = _lock(tmp_path, "fused_adam")  # a build that has just begun: its compiler may not run yet
    assert clear_stale_build_locks(tmp_path) == [compiling] and fresh.exists()  # (its compiler has ended now)
