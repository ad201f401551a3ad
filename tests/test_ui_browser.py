"""The MLflow UI in a real browser: `paperline ui` over the embedded store, opened in headless Chromium."""

from __future__ import annotations

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
                  "--virtual-time-budget=20000", "--window-size=1400,1000"]


def chromium_binary() -> str:
    """Debian's chromium. `make test` installs it when run as root; otherwise a test without it skips and says how
    to install it (as root it is an error: the install should have happened)."""
    browser = shutil.which("chromium")
    if browser:
        return browser
    if os.geteuid() != 0:
        pytest.skip("needs Debian's chromium: sudo apt-get install chromium (or run `make test` as root)")
    raise AssertionError("chromium is missing although running as root: `make test` installs it (make system-deps)")


def _chromium(url: str, profile_dir, action: str = "--dump-dom") -> str:
    """The page's DOM after its scripts ran (`--dump-dom`), or `--screenshot=<path>`."""
    browser = chromium_binary()
    out = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", action, url],
                         capture_output=True, text=True, timeout=180)
    return out.stdout


def test_mlflow_ui_shows_run_claim_and_metric_chart(workspace, tmp_path, prefect_harness):
    from flows.pipeline import paper_pipeline

    result = paper_pipeline("sei", "test")
    exp_id = tracking.experiment_id("sei")
    port = free_port()
    env = {**os.environ, "PAPERLINE_ROOT": str(workspace)}
    ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 240
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                assert time.time() < deadline and ui.poll() is None, "paperline ui did not come up"
                time.sleep(0.5)
        run_url = f"http://127.0.0.1:{port}/#/experiments/{exp_id}/runs/{result['run_id']}"
        overview = _chromium(run_url, tmp_path / "chromium")
        assert "sei-test" in overview and "claim.holds" in overview and "method/cnn_auroc" in overview
        for _ in range(3):  # plotly renders after the metric histories load: a busy machine can miss the budget
            charts = _chromium(run_url + "/model-metrics", tmp_path / "chromium")
            if "js-plotly-plot" in charts:
                break
        assert "js-plotly-plot" in charts, "the metric charts did not render"
        shots = PROJECT / "test-artifacts"
        shots.mkdir(exist_ok=True)
        _chromium(run_url + "/model-metrics", tmp_path / "chromium", f"--screenshot={shots / 'mlflow-ui.png'}")
        assert (shots / "mlflow-ui.png").stat().st_size > 10_000
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=60)
