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


def postgres_bin() -> str:
    """The folder of PostgreSQL's server binaries (Debian keeps them off PATH, in /usr/lib/postgresql/<v>/bin).
    `make test` installs PostgreSQL when run as root; otherwise a test without it skips and says how to install it."""
    found = shutil.which("pg_ctl")
    if found:
        return str(Path(found).parent)
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if versions:
        return str(versions[-1].parent)
    if os.geteuid() != 0:
        pytest.skip("needs PostgreSQL's server: sudo apt-get install postgresql (or run `make test` as root)")
    raise AssertionError("PostgreSQL is missing although running as root: `make test` installs it (make system-deps)")


def test_pipeline_tracks_into_mlflow_server_on_postgres(workspace, monkeypatch, prefect_harness):
    pg_env = {**os.environ, "PATH": postgres_bin() + os.pathsep + os.environ["PATH"]}
    # not under tmp_path: pytest's folders are private to root, and PostgreSQL runs as its own user
    state, pg_port, ml_port = Path(tempfile.mkdtemp(prefix="paperline-tracking-")), free_port(), free_port()
    state.chmod(0o755)
    out = subprocess.run([str(PROJECT / "infra" / "postgres-mlflow.sh"), str(state), str(pg_port), str(ml_port)],
                         capture_output=True, text=True, timeout=600, env=pg_env)
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        uri = out.stdout.strip().split("=", 1)[1]
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        from flows.deployed import paper as run_paper

        result = run_paper("sei", "test")
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
                       capture_output=True, timeout=60, env=pg_env)
        shutil.rmtree(state, ignore_errors=True)


def test_missing_packages_skip_with_how_to_install_when_not_root(monkeypatch):
    """A user who is not root and lacks a Debian package gets a skip that says how to install it, not a failure."""
    import tests.test_ui_browser as browser_test

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(()))
    with pytest.raises(pytest.skip.Exception, match="apt-get install postgresql"):
        postgres_bin()
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        browser_test.chromium_binary()
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root: `make test` should have installed it
    with pytest.raises(AssertionError, match="make system-deps"):
        postgres_bin()


def test_unreachable_tracking_server_fails_before_any_work(workspace, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(RuntimeError, match="unreachable.*Start the server or unset MLFLOW_TRACKING_URI"):
        tracking.check_reachable()
    assert not (workspace / "runs").exists() and not (workspace / "data").exists()


def _mlflow_server(store: Path, port: int) -> subprocess.Popen:
    import sys
    import time
    import urllib.request

    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}",
                               "--default-artifact-root", store.with_suffix(".artifacts").as_uri(), "--host",
                               "127.0.0.1", "--port", str(port), "--workers", "1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return server
        time.sleep(0.5)
    server.kill()
    raise AssertionError("mlflow server did not start")


def _stop(server: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


def test_tracking_lost_mid_run_keeps_metrics_on_disk_and_sends_them_when_back(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from tasks.context import PENDING_METRICS, MetricSink

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    port, store = free_port(), tmp_path / "mlflow.db"
    uri = f"http://127.0.0.1:{port}"
    server = _mlflow_server(store, port)
    try:
        client = MlflowClient(uri)
        run_id = client.create_run(client.create_experiment("lost")).info.run_id
        sink = MetricSink(uri, run_id, spill_dir=tmp_path)
        sink.add({"train/x/loss": 1.0}, 1)
        sink.flush()
        assert not (tmp_path / PENDING_METRICS).exists()
        _stop(server)  # the server dies mid-run

        for step in (2, 3):  # training goes on; what it logs waits on disk
            sink.add({"train/x/loss": float(step)}, step)
            sink.flush()
        assert len((tmp_path / PENDING_METRICS).read_text().splitlines()) == 2

        server = _mlflow_server(store, port)  # back, same store
        sink.add({"train/x/loss": 4.0}, 4)
        sink.flush()
        assert not (tmp_path / PENDING_METRICS).exists()
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/x/loss"))
        assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]  # everything, once, in order
    finally:
        _stop(server)
