"""Shared fixtures. Tests never touch the user's workspace: pipeline tests run in a temporary copy of the project's
DVC/params files (`workspace`), with their own MLflow store and Prefect home."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
# Under pytest-xdist (`make test` runs `-n auto`) worker gwN owns one core: its tests and every process they start
# inherit the affinity mask (training reads its thread count from it), so two workers never oversubscribe the cores;
# each worker keeps its own Prefect home and quiet-timing lock, so a timed test waits only on its own worker's work.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER:
    _cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cores[int(WORKER.removeprefix("gw")) % len(_cores)]})
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PAPERLINE_QUIET_LOCK"] = str(PROJECT / ".cache" / f"test-quiet-{WORKER}")
os.environ["PREFECT_HOME"] = str(PROJECT / ".cache" / f"test-prefect-home{'-' + WORKER if WORKER else ''}")
# Prefect creates its home without parents: on a fresh clone .cache/ does not exist yet
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "true")
os.environ.pop("MLFLOW_TRACKING_URI", None)

from tasks.settings import configure_environment  # noqa: E402

configure_environment()


def make_workspace(path: Path) -> Path:
    """A DVC project holding this project's dvc.yaml, params.yaml and the files its stages depend on."""
    for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(PROJECT / name, path / name)
    shutil.copytree(PROJECT / "models", path / "models", ignore=shutil.ignore_patterns("__pycache__"))
    (path / "tasks").mkdir()
    shutil.copy(PROJECT / "tasks" / "prepare_stage.py", path / "tasks" / "prepare_stage.py")
    # a git repository like a user's clone: DVC then refuses stages in git-ignored files, as it would for users
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=path, check=True)
    return path


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAPERLINE_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path / ".dvc" / "site-cache"))
    return make_workspace(tmp_path)


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for the whole session (starting one costs seconds)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def finished_run(paper: str, tags: dict[str, str], start_ms: int, metrics: dict[str, float] | None = None) -> str:
    """A finished run of `paper` in the tracking store with these tags (and metrics at step 0); its run id."""
    from tasks import tracking

    client = tracking.client()
    run = client.create_run(tracking.experiment_id(paper), start_time=start_ms, tags=tags)
    for key, value in (metrics or {}).items():
        client.log_metric(run.info.run_id, key, value, step=0)
    client.set_terminated(run.info.run_id, "FINISHED", end_time=start_ms + 1)
    return run.info.run_id
