"""The embedded store read straight from its SQLite file answers exactly as MLflow does, and only for the schema
it was written against."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

from tasks import embedded_store, tracking
from tests.conftest import PROJECT, finished_run


def test_schema_revision_is_the_installed_mlflows(workspace):
    tracking.client().search_experiments(max_results=1)  # MLflow creates the store at its own head revision
    with sqlite3.connect(workspace / "mlflow.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchone()[0] == embedded_store.SCHEMA_REVISION


def test_finds_what_mlflow_finds_and_stamps_what_mlflow_reads(workspace):
    now = int(time.time() * 1000)
    key = "k" * 64
    finished_run("sei", {"paperline.cache_key": key, "claim.verdict": "holds"}, now - 5000)
    newest = finished_run("sei", {"paperline.cache_key": key, "claim.verdict": "inconclusive"}, now)
    finished_run("sei", {"paperline.cache_key": "other"}, now + 1000)
    running = tracking.client().create_run(tracking.experiment_id("sei"), start_time=now + 2000,
                                           tags={"paperline.cache_key": key})  # not finished: never a cache hit
    assert running.info.status == "RUNNING"
    finished_run("qubo_relax", {"paperline.cache_key": key}, now + 3000)  # another paper's experiment

    path = embedded_store.usable()
    assert path == workspace / "mlflow.db"
    stored = embedded_store.find_cached(path, "paperline/sei", key)
    through_mlflow = tracking.find_cached(tracking.experiment_id("sei"), key)
    assert stored.run_id == newest == through_mlflow.info.run_id
    assert stored.tags == through_mlflow.data.tags
    assert embedded_store.find_cached(path, "paperline/sei", "missing") is None
    assert embedded_store.find_cached(path, "paperline/tbik", key) is None  # no such experiment

    tracking.mark_reused(newest)  # through the file
    stamped = tracking.client().get_run(newest).data.tags["paperline.reused_at"]
    assert abs(int(stamped) - time.time() * 1000) < 60_000


def test_other_schema_or_file_or_server_goes_through_mlflow(workspace, monkeypatch):
    tracking.client().search_experiments(max_results=1)
    assert embedded_store.usable() is not None
    with sqlite3.connect(workspace / "mlflow.db") as db:
        db.execute("UPDATE alembic_version SET version_num = 'a_newer_one'")
    assert embedded_store.usable() is None  # a migrated store: MLflow knows its schema, these queries may not

    not_a_store = workspace / "notes.db"
    not_a_store.write_bytes(b"plain text, not SQLite")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{not_a_store}")
    assert embedded_store.usable() is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'absent.db'}")
    assert embedded_store.usable() is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert embedded_store.usable() is None


def test_the_cache_check_imports_no_mlflow_or_prefect():
    out = subprocess.run([sys.executable, "-c", "import sys, flows.cache; "
                          "print(sorted({'mlflow', 'prefect', 'torch'} & set(sys.modules)))"],
                         cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
