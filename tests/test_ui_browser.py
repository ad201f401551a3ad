"""The MLflow UI in a real browser: `paperline ui` over the embedded store, opened in headless Chromium."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import websockets.sync.client

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


def _has(*texts: str) -> str:
    """A JavaScript expression: the page's DOM holds every one of `texts`."""
    return f"{json.dumps(list(texts))}.every(t => document.documentElement.outerHTML.includes(t))"


def _render(url: str, profile_dir: Path, ready: str, seconds: float = 240, screenshot: Path | None = None) -> str:
    """The page's DOM once the JavaScript expression `ready` holds in it, or at the deadline; a PNG of the page to
    `screenshot`. Headless Chromium is driven over its DevTools protocol and polled in real time, so a busy machine
    makes the page slower, not the check wrong (a virtual-time budget ran out before the charts drew on a loaded CI
    machine)."""
    profile_dir.mkdir(parents=True, exist_ok=True)
    port_file = profile_dir / "DevToolsActivePort"
    port_file.unlink(missing_ok=True)
    browser = subprocess.Popen([chromium_binary(), *CHROMIUM_FLAGS, "--remote-debugging-port=0",
                                f"--user-data-dir={profile_dir}", url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + seconds
    try:
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.time() < deadline and browser.poll() is None, "Chromium did not open its DevTools port"
            time.sleep(0.2)
        devtools = f"http://127.0.0.1:{int(port_file.read_text().split()[0])}"
        page = next(t for t in json.loads(urllib.request.urlopen(f"{devtools}/json/list", timeout=30).read())
                    if t["type"] == "page")
        with websockets.sync.client.connect(page["webSocketDebuggerUrl"], max_size=None) as devtools_socket:
            ids = itertools.count(1)

            def call(method: str, **params) -> dict:
                call_id = next(ids)
                devtools_socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
                while True:  # skip the events and any late answer
                    message = json.loads(devtools_socket.recv(timeout=120))
                    if message.get("id") == call_id:
                        return message.get("result", {})

            def evaluate(expression: str):
                answer = call("Runtime.evaluate", expression=expression, returnByValue=True)
                return answer.get("result", {}).get("value")

            while not evaluate(f"Boolean({ready})") and time.time() < deadline:
                time.sleep(1)
            if screenshot is not None:
                screenshot.write_bytes(base64.b64decode(call("Page.captureScreenshot", format="png")["data"]))
            return evaluate("document.documentElement.outerHTML") or ""
    finally:
        _stop(browser)


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
        profile = tmp_path / "chromium"
        shots = PROJECT / "test-artifacts"
        shots.mkdir(exist_ok=True)
        runs_page = _render(f"{prefect_ui}/runs", profile, _has("sei-test"))
        assert "sei-test" in runs_page, "Prefect's runs page does not list the flow run by its name"
        artifact_page = _render(f"{prefect_ui}/artifacts/artifact/{artifacts[0].id}", profile,
                                _has("sei (test) claim"), screenshot=shots / "prefect-artifact.png")
        assert "sei (test) claim" in artifact_page, "the verdict artifact does not render on its page"
        # the flow-run page: a picture for a person; the logs it shows are asserted through the API above
        _render(f"{prefect_ui}/runs/flow-run/{flow_run.id}", profile, _has("claim sei:"), seconds=60,
                screenshot=shots / "prefect-flow-run.png")

        ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _up(f"http://127.0.0.1:{port}/health", ui, "paperline ui")
        base = f"http://127.0.0.1:{port}"
        overview = _render(tracking.ui_link(base, exp_id, result["run_id"]), profile,
                           _has("sei-test", "claim.", "method/cnn_auroc", "Model metrics", "Model registry"))
        assert "sei-test" in overview and "claim." in overview and "method/cnn_auroc" in overview
        # the model-training view: runs, models and metric charts; not GenAI's judges, prompts and agents
        assert "Model metrics" in overview and "Model registry" in overview
        assert not [w for w in ("Judges", "Agent versions", "Token Usage") if w in overview]
        # plotly draws after the metric histories load
        charts = _render(tracking.ui_link(base, exp_id, result["run_id"], tab="model-metrics"), profile,
                         "document.querySelector('.js-plotly-plot')", screenshot=shots / "mlflow-ui.png")
        assert "js-plotly-plot" in charts, "the metric charts did not render"
        assert (shots / "mlflow-ui.png").stat().st_size > 10_000
    finally:
        for proc in (ui, server):
            if proc is not None:
                _stop(proc)
