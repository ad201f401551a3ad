"""MLflow as a server on PostgreSQL (infra/postgres-mlflow.sh), and a tracking server that is down."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from tasks import tracking
from tasks.worker import free_port
from tests.conftest import PROJECT

pytestmark = pytest.mark.e2e


def test_pipeline_tracks_into_mlflow_server_on_postgres(workspace, monkeypatch, prefect_harness):
    assert shutil.which("initdb") or shutil.which("pg_ctl"), "PostgreSQL server binaries missing (.ci/run installs)"
    # not under tmp_path: pytest's folders are private to root, and PostgreSQL runs as its own user
    state, pg_port, ml_port = Path(tempfile.mkdtemp(prefix="paperline-tracking-")), free_port(), free_port()
    state.chmod(0o755)
    out = subprocess.run([str(PROJECT / "infra" / "postgres-mlflow.sh"), str(state), str(pg_port), str(ml_port)],
                         capture_output=True, text=True, timeout=600)
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        uri = out.stdout.strip().split("=", 1)[1]
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        from flows.pipeline import paper_pipeline

        result = paper_pipeline("sei", "test")
        run = tracking.client().get_run(result["run_id"])
        assert run.info.status == "FINISHED" and "method/cnn_auroc" in run.data.metrics
        assert tracking.client().list_artifacts(result["run_id"], "plots")
        assert not (workspace / "mlflow.db").exists(), "nothing may go to the embedded store"
    finally:
        pid_file = state / "mlflow.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
        stop = ["pg_ctl", "-D", str(state / "pg"), "-m", "fast", "stop"]
        subprocess.run((["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []) + stop,
                       capture_output=True, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def test_unreachable_tracking_server_fails_before_any_work(workspace, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(RuntimeError, match="unreachable.*Start the server or unset MLFLOW_TRACKING_URI"):
        tracking.check_reachable()
    assert not (workspace / "runs").exists() and not (workspace / "data").exists()
