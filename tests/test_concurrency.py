"""Concurrency: runs of one paper side by side keep separate folders, checkpoints and MLflow runs; DVC's repository
lock is waited for with a message, never a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from mlflow import MlflowClient

from models import registry
from tasks import data, settings
from tests.conftest import PROJECT

pytestmark = pytest.mark.e2e


def test_dvc_lock_contention_waits_and_says_so(workspace, capfd):
    raw = registry.ask("sei", "test", {}, settings.params_file()).raw
    stage = data.stage_for(registry.get("sei"), "test", registry.resolve("sei", "test", {}, settings.params_file()),
                           raw, is_default=False)
    result = {}
    with data.dvc_lock():  # another process's DVC run, as far as the lock can tell
        worker = threading.Thread(target=lambda: result.update(prepared=data.reproduce(stage)))
        worker.start()
        time.sleep(2)
        assert worker.is_alive() and not stage.lock_file.exists()  # waiting, not failing, not running DVC
        assert data.current_hash(stage) is None  # the cached-rerun check does not wait: it says "unknown"
    worker.join(timeout=300)
    assert "waiting for its lock" in capfd.readouterr().err
    assert result["prepared"].data_hash == data.locked_hash(stage)


def test_two_runs_of_one_paper_at_once_keep_everything_apart(workspace):
    cli = [sys.executable, "-m", "flows.cli", "run", "sei", "--profile", "test", "--set"]
    runs = [subprocess.Popen([*cli, f"n_samples={n}"], cwd=workspace, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for n in (150, 160)]
    outputs = [p.communicate(timeout=900)[0] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    client = MlflowClient(settings.tracking_uri())
    found = _pipeline_runs(client, "sei")
    assert len(found) == 2 and {r.info.status for r in found} == {"FINISHED"}
    assert {r.data.params["n_samples"] for r in found} == {"150", "160"}
    assert len({r.data.tags["paperline.data_hash"] for r in found}) == 2
    for run in found:  # each run's own folders with its own committed checkpoints and claim
        _assert_own_folders(client, workspace, run)
    assert len(list((workspace / "variants" / "sei").iterdir())) == 2


def test_suite_beside_a_single_run_of_one_of_its_papers(workspace):
    """The suite (two papers side by side) and a user's run of one of them, same params, at the same moment: the data
    stage is prepared once (the others wait for DVC's lock), and each run trains in its own folder under its own
    MLflow run."""
    cli = [sys.executable, "-m", "flows.cli", "run", "--profile", "test"]
    runs = [subprocess.Popen(command, cwd=workspace, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for command in ([*cli, "sei", "ldka", "--parallel", "2"], [*cli, "sei"])]
    outputs = [p.communicate(timeout=900)[0] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert all("claim sei:" in o for o in outputs) and "claim ldka:" in outputs[0]
    client = MlflowClient(settings.tracking_uri())
    sei = _pipeline_runs(client, "sei")
    assert len(sei) == 2 and {r.info.status for r in sei} == {"FINISHED"}
    assert len({r.data.tags["paperline.data_hash"] for r in sei}) == 1  # the same work, the same data
    for run in sei:
        _assert_own_folders(client, workspace, run)
    assert len(list((workspace / "variants" / "sei").iterdir())) == 1
    ldka = _pipeline_runs(client, "ldka")
    assert [r.info.status for r in ldka] == ["FINISHED"]


def _pipeline_runs(client, paper: str) -> list:
    experiment = client.get_experiment_by_name(f"paperline/{paper}").experiment_id
    return client.search_runs([experiment], "tags.`paperline.kind` = 'pipeline'")


def _assert_own_folders(client, workspace, run) -> None:
    """The pipeline run's folder holds its claim; its replicate's folder its committed checkpoints."""
    assert (workspace / "runs" / "sei" / run.info.run_id / "claim.json").exists()
    (child,) = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
    assert list((workspace / "runs" / "sei" / child.info.run_id).glob("checkpoints/*/committed.json"))



def test_the_flow_process_runs_blas_on_one_thread():
    """Evaluations run in the flow's process; OpenBLAS's thread server hung one of them for 20 minutes in a suite
    (tasks/steps.single_threaded_blas), so every BLAS library there runs on one thread. In a fresh interpreter on
    every core (a test worker is pinned to one, where OpenBLAS would start one thread anyway)."""
    probe = ("import json, numpy; from threadpoolctl import threadpool_info\n"
             "blas = lambda: [i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas']\n"
             "before = blas(); import tasks.steps; print(json.dumps([before, blas()]))")
    every_core = lambda: os.sched_setaffinity(0, range(os.cpu_count()))  # noqa: E731
    unlimited = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}  # a test worker sets them
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=unlimited,
                         cwd=PROJECT,
                         preexec_fn=every_core)
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert after and set(after) == {1}, after
    if os.cpu_count() > 1:
        assert max(before) > 1, "the probe should start where OpenBLAS runs a thread server"


def test_a_stage_reproduces_without_dvc_reading_the_other_stages(workspace):
    """Each `--set` variant adds a dvc.yaml; a prepare reads only its own stage, so its cost does not grow with them
    (and a variant folder broken by hand does not stop another paper's data)."""
    broken = workspace / "variants" / "sei" / "smoke-broken"
    broken.mkdir(parents=True)
    (broken / "dvc.yaml").write_text("stages: {prepare: {cmd: [unclosed\n")
    raw = registry.ask("sei", "test", {}, settings.params_file()).raw
    stage = data.stage_for(registry.get("sei"), "test", registry.resolve("sei", "test", {}, settings.params_file()),
                           raw, is_default=False)
    prepared = data.reproduce(stage)
    assert prepared.ran and prepared.data_hash == data.locked_hash(stage)
    assert data.reproduce(stage).ran is False  # up to date the second time
