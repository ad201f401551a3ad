"""The MLflow UI in a real browser: `paperline ui` over the embedded store, opened in headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tasks import tracking
from tasks.worker import free_port
from tests.conftest import PROJECT

pytestmark = pytest.mark.e2e
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000"]


def chromium_binary() -> str:
    """Debian's chromium. `make test` installs it when run as root; otherwise a test without it skips and says how
    to install it (as root it is an error: the install should have happened)."""
    browser = shutil.which("chromium")
    if browser:
        return browser
    if os.geteuid() != 0:
        pytest.skip("needs Debian's chromium: sudo apt-get install chromium (or run `make test` as root)")
    raise AssertionError("chromium is missing although running as root: `make test` installs it (make system-deps)")


def _chromium(url: str, profile_dir, action: str = "--dump-dom", budget_ms: int = 20_000) -> str:
    """The page's DOM after its scripts ran for `budget_ms` of virtual time (`--dump-dom`), or
    `--screenshot=<path>`."""
    browser = chromium_binary()
    out = subprocess.run([browser, *CHROMIUM_FLAGS, f"--virtual-time-budget={budget_ms}",
                          f"--user-data-dir={profile_dir}", action, url],
                         capture_output=True, text=True, timeout=180)
    return out.stdout


def _up(url: str, proc: subprocess.Popen, what: str, seconds: float = 240) -> None:
    deadline = time.time() + seconds
    while True:
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            assert time.time() < deadline and proc.poll() is None, f"{what} did not come up"
            time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_both_uis_as_a_person_sees_them(workspace, tmp_path):
    """`paperline server --port N` (Prefect, its UI talking to port N) and `paperline ui` (MLflow) after one run:
    Prefect's runs page lists the run by its name, the flow run's logs hold the claim line and its verdict artifact
    renders on the artifact's page, MLflow's run page opens in the model-training view with the claim and the metric
    charts. Screenshots of each page go to test-artifacts/ for a person to look at."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployed import paper as run_paper

    chromium_binary()  # skip before starting anything when it is missing (not root)
    prefect_port, port = free_port(), free_port()
    api = f"http://127.0.0.1:{prefect_port}/api"
    env = {**os.environ, "PAPERLINE_ROOT": str(workspace), "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "server", "--port", str(prefect_port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ui = None
    try:
        _up(f"{api}/health", server, "paperline server")
        ui_settings = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{prefect_port}/ui-settings").read())
        assert ui_settings["api_url"] == api  # the UI talks to this server, not to the default port 4200
        with temporary_settings({PREFECT_API_URL: api}):
            result = run_paper("sei", "test")
        exp_id = tracking.experiment_id("sei")
        assert tracking.client().get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"

        from prefect.client.orchestration import SyncPrefectClient
        from prefect.client.schemas.filters import (
            ArtifactFilter,
            ArtifactFilterFlowRunId,
            LogFilter,
            LogFilterFlowRunId,
        )

        with SyncPrefectClient(api) as client:
            runs = client.read_flow_runs()
            names = [r.name for r in runs]
            assert "sei-test" in names, names  # flow runs are named <paper>-<profile>
            flow_run = next(r for r in runs if r.name == "sei-test")
            log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]))
            deadline = time.time() + 60
            while True:  # Prefect's log handler sends its batch every few seconds, the claim line last
                logs = [log.message for log in client.read_logs(log_filter)]
                if any(message.startswith("claim sei:") for message in logs) or time.time() > deadline:
                    break
                time.sleep(1)
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
        # what the flow run's Logs tab shows: paperline's lines, the claim line among them
        assert any(message.startswith("claim sei:") for message in logs), logs
        assert [a.key for a in artifacts] == ["claim-sei-test"], [a.key for a in artifacts]
        assert "sei (test) claim" in artifacts[0].data and "MLflow run" in artifacts[0].data
        prefect_ui = f"http://127.0.0.1:{prefect_port}"
        for _ in range(3):  # the list renders after the API answers: a busy machine can miss the budget
            runs_page = _chromium(f"{prefect_ui}/runs", tmp_path / "chromium")
            if "sei-test" in runs_page:
                break
        assert "sei-test" in runs_page, "Prefect's runs page does not list the flow run by its name"
        artifact_url = f"{prefect_ui}/artifacts/artifact/{artifacts[0].id}"
        for _ in range(3):
            artifact_page = _chromium(artifact_url, tmp_path / "chromium")
            if "sei (test) claim" in artifact_page:
                break
        assert "sei (test) claim" in artifact_page, "the verdict artifact does not render on its page"
        shots = PROJECT / "test-artifacts"
        shots.mkdir(exist_ok=True)
        _chromium(artifact_url, tmp_path / "chromium", f"--screenshot={shots / 'prefect-artifact.png'}")
        try:  # the flow-run page streams its logs, so Chromium's virtual time may never run out: a picture only,
            # the logs it shows are asserted through the API above
            _chromium(f"{prefect_ui}/runs/flow-run/{flow_run.id}", tmp_path / "chromium",
                      f"--screenshot={shots / 'prefect-flow-run.png'}")
        except subprocess.TimeoutExpired:
            pass

        ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _up(f"http://127.0.0.1:{port}/health", ui, "paperline ui")
        base = f"http://127.0.0.1:{port}"
        overview = _chromium(tracking.ui_link(base, exp_id, result["run_id"]), tmp_path / "chromium")
        assert "sei-test" in overview and "claim." in overview and "method/cnn_auroc" in overview
        # the model-training view: runs, models and metric charts; not GenAI's judges, prompts and agents
        assert "Model metrics" in overview and "Model registry" in overview
        assert not [w for w in ("Judges", "Agent versions", "Token Usage") if w in overview]
        charts_url = tracking.ui_link(base, exp_id, result["run_id"], tab="model-metrics")
        for budget_ms in (20_000, 40_000, 80_000):  # plotly renders after the metric histories load: a busy machine
            charts = _chromium(charts_url, tmp_path / "chromium", budget_ms=budget_ms)  # can miss the first budget
            if "js-plotly-plot" in charts:
                break
        assert "js-plotly-plot" in charts, "the metric charts did not render"
        _chromium(charts_url, tmp_path / "chromium", f"--screenshot={shots / 'mlflow-ui.png'}")
        assert (shots / "mlflow-ui.png").stat().st_size > 10_000
    finally:
        for proc in (ui, server):
            if proc is not None:
                _stop(proc)
