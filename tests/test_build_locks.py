"""A torch extension-build lock left by a killed build is cleared; a build in progress keeps its lock."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tasks.settings import STALE_BUILD_LOCK_S, clear_stale_build_locks


def test_only_locks_older_than_any_build_are_removed(tmp_path: Path) -> None:
    killed, building = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (killed, building):
        lock.parent.mkdir()
        lock.touch()
    past = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(killed, (past, past))
    assert clear_stale_build_locks(tmp_path) == [killed]
    assert not killed.exists() and building.exists()


def test_a_missing_extensions_folder_is_fine(tmp_path: Path) -> None:
    assert clear_stale_build_locks(tmp_path / "never-built") == []
