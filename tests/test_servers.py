"""A real Prefect server on loopback: serve the deployments, check the nightly cron, trigger a paper, see it run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tasks import tracking
from tasks.worker import free_port

pytestmark = pytest.mark.e2e


def _wait(predicate, seconds: float, what: str, logs=()):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(p.read_text()[-2000:] for p in logs))


def test_serve_schedules_nightly_and_runs_a_triggered_paper(workspace, tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": api,
           "PAPERLINE_ROOT": str(workspace)}
    server_log, serve_log = tmp_path / "server.log", tmp_path / "serve.log"
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port), "--analytics-off"], env=env, stdout=server_log.open("w"),
                              stderr=subprocess.STDOUT)
    served = None
    try:
        _wait(lambda: urllib.request.urlopen(f"{api}/health", timeout=2).status == 200, 240, "Prefect server",
              [server_log])
        served = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--paper", "sei", "--cron",
                                   "30 3 * * *", "--timezone", "Europe/Paris"], env=env,
                                  stdout=serve_log.open("w"), stderr=subprocess.STDOUT)
        from prefect.client.orchestration import SyncPrefectClient
        from prefect.deployments import run_deployment

        with SyncPrefectClient(api) as client:
            _wait(lambda: client.read_deployment_by_name("suite/nightly"), 180, "deployments", [serve_log])
            nightly = client.read_deployment_by_name("suite/nightly")
            (schedule,) = nightly.schedules
            assert schedule.schedule.cron == "30 3 * * *" and schedule.schedule.timezone == "Europe/Paris"
            assert schedule.active
            assert client.read_global_concurrency_limit_by_name("paper-sei").limit == 1
        os.environ["PREFECT_API_URL"] = api
        try:
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings({PREFECT_API_URL: api}):
                flow_run = run_deployment("paper-pipeline/sei", parameters={"paper": "sei", "profile": "test"},
                                          timeout=600)
        finally:
            os.environ.pop("PREFECT_API_URL", None)
        assert flow_run.state.is_completed(), (flow_run.state, serve_log.read_text()[-3000:])
        runs = tracking.client().search_runs([tracking.experiment_id("sei")],
                                             filter_string=f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    finally:
        for proc in (served, server):  # the runner first, or the server blocks ~65 s pausing deployments
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def test_work_pool_worker_runs_a_deployment_from_prefect_yaml(workspace, tmp_path):
    """The many-machines path: `prefect deploy --all` from prefect.yaml, a process work pool, a worker that picks up
    a triggered run (here with --run-once) and runs the pipeline in the project folder."""
    import shutil

    from tests.conftest import PROJECT

    shutil.copytree(PROJECT / "flows", workspace / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT / "prefect.yaml", workspace / "prefect.yaml")
    shutil.copytree(PROJECT / "infra" / "pools", workspace / "infra" / "pools")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": api,
           "PAPERLINE_ROOT": str(workspace)}
    server_log = tmp_path / "server.log"
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port), "--analytics-off"], env=env, stdout=server_log.open("w"),
                              stderr=subprocess.STDOUT)
    prefect = [sys.executable, "-m", "prefect"]
    try:
        _wait(lambda: urllib.request.urlopen(f"{api}/health", timeout=2).status == 200, 240, "Prefect server",
              [server_log])
        for command in (["work-pool", "create", "paperline-process", "--type", "process"],
                        # the container pools from their templates: the server validates them and, on deploy, the
                        # deployments' job variables against them (no worker runs for these here)
                        ["work-pool", "create", "paperline-docker", "--type", "docker", "--base-job-template",
                         "infra/pools/docker.json"],
                        ["work-pool", "create", "paperline-k8s", "--type", "kubernetes", "--base-job-template",
                         "infra/pools/kubernetes.json"],
                        ["--no-prompt", "deploy", "--all"],
                        ["deployment", "run", "paper-pipeline/on-demand", "--param", "paper=sei", "--param",
                         "profile=test"]):
            done = subprocess.run(prefect + command, cwd=workspace, env=env, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        worker = subprocess.run(prefect + ["worker", "start", "--pool", "paperline-process", "--run-once"],
                                cwd=workspace, env=env, capture_output=True, text=True, timeout=900)
        assert worker.returncode == 0, worker.stdout[-3000:] + worker.stderr[-3000:]
        from prefect.client.orchestration import SyncPrefectClient

        with SyncPrefectClient(api) as client:
            deployed = {d.name: d for d in client.read_deployments()}
            # no fixed GPU count: a run passes its plan's (-jv gpus=$(paperline plan <id> --gpus))
            assert deployed["full-gpu"].work_pool_name == "paperline-k8s"
            assert "gpus" not in deployed["full-gpu"].job_variables
            assert [s.active for s in deployed["nightly-docker"].schedules] == [False]
            # the nightly deployment's upcoming runs are there too, still scheduled
            (flow_run,) = [r for r in client.read_flow_runs() if not r.state.is_scheduled()]
            assert flow_run.state.is_completed(), flow_run.state
        runs = tracking.client().search_runs([tracking.experiment_id("sei")],
                                             filter_string=f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
