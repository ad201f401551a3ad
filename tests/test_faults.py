"""Fault injection on the real pipeline (no mocks of the failing part): a SIGKILLed rank, a SIGKILLed pipeline,
corrupted data. The goal in each case: nothing lost, nothing trained twice, results equal to an undisturbed run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks import settings, tracking
from tests.conftest import PROJECT

pytestmark = pytest.mark.e2e
FAST = {"ranks": 2, "checkpoint_every": 2, "epochs": 3}  # sei test profile: 2 steps per epoch -> 6 steps


def _eval_metrics(run_id: str) -> dict[str, float]:
    metrics = tracking.client().get_run(run_id).data.metrics
    return {k: v for k, v in metrics.items() if k.split("/")[0] in ("method", "baseline", "detail", "claim")}


def _replicates(parent_id: str) -> list:
    client = tracking.client()
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return sorted(runs, key=lambda r: int(r.data.tags["paperline.replicate"]))


def test_killed_rank_in_replicate_2_of_3_resumes_that_replicate_bitwise(workspace, prefect_harness, monkeypatch):
    from flows.deployed import paper as run_paper

    clean = run_paper("sei", "test", {**FAST, "replicates": 3})
    # rank 1 of replicate 2 (seed 1) dies after step 3; its step 2 is committed; the train task's retry continues it
    monkeypatch.setenv("PAPERLINE_FAULT", "kill:1:detect:3:seed=1")
    faulted = run_paper("sei", "test", {**FAST, "replicates": 3}, force=True)
    children = _replicates(faulted["run_id"])
    fired = [(settings.runs_dir() / "sei" / c.info.run_id / "fault-fired-1-detect-3").exists() for c in children]
    assert fired == [False, True, False], "the fault must have fired in replicate 2 only"
    # bitwise on CPU: same world size, batches and dropout seeded by the step, gloo reductions in a fixed order
    assert _eval_metrics(faulted["run_id"]) == _eval_metrics(clean["run_id"])
    client = tracking.client()
    resumed = [[m.value for m in client.get_metric_history(c.info.run_id, "train/detect/resumed_at_step")]
               for c in children]
    assert resumed == [[], [2.0], []]  # only the killed replicate resumed; the others trained once
    for a, b in zip(_replicates(clean["run_id"]), children, strict=True):
        history = client.get_metric_history(b.info.run_id, "train/detect/loss")
        clean_history = client.get_metric_history(a.info.run_id, "train/detect/loss")
        assert [(m.step, m.value) for m in history] == [(m.step, m.value) for m in clean_history]


def test_killed_phase_with_arms_a_schedule_and_an_ema_resumes_bitwise(tmp_path):
    """The same SIGKILL in a phase whose engine has two arms, warm-up + cosine decay and an EMA: the resumed run
    restores the rate schedule, the AdamW state and the EMA from the checkpoint and ends bitwise like a clean one."""
    import json

    import torch

    from tasks.context import FIT_METRICS, network_file

    code = ("import sys; from pathlib import Path; from tasks.worker import _init_distributed; _init_distributed(); "
            "from tests.test_arms import SCHEDULE, train_phase; "
            "train_phase(Path(sys.argv[1]), 0, ('a', 'b'), checkpoint_every=3, **SCHEDULE)")
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")  # an in-process test's group
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "PYTHONPATH": str(PROJECT)}

    def train(folder, **extra):
        return subprocess.run([sys.executable, "-c", code, str(folder)], env={**env, **extra}, capture_output=True,
                              text=True)

    assert train(tmp_path / "clean").returncode == 0
    killed = train(tmp_path / "killed", PAPERLINE_FAULT="kill:0:arms:7")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert json.loads((tmp_path / "killed/checkpoints/arms/committed.json").read_text())["step"] == 6
    resumed = train(tmp_path / "killed", PAPERLINE_FAULT="kill:0:arms:7")  # the marker keeps it from firing again
    assert resumed.returncode == 0 and "resumed at step 6/12" in resumed.stderr, resumed.stderr[-2000:]
    for ema in (False, True):
        clean, again = (torch.load(d / network_file("arms", ema), weights_only=False)["module"].state_dict()
                        for d in (tmp_path / "clean", tmp_path / "killed"))
        assert clean.keys() == again.keys() and all(torch.equal(clean[k], again[k]) for k in clean)
    clean, again = (json.loads((d / FIT_METRICS).read_text()) for d in (tmp_path / "clean", tmp_path / "killed"))
    assert {k: v for k, v in clean.items() if not k.startswith("timing/")} == {  # a rate is wall-clock
        k: v for k, v in again.items() if not k.startswith("timing/")} and "train/arms/plateau" in clean


def test_killed_pipeline_is_continued_at_the_replicate_it_lost(workspace, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    from flows.deployed import paper as run_paper

    env = {**os.environ, "PAPERLINE_ROOT": str(workspace), "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    code = "from flows.deployed import paper as run_paper; run_paper('sei', 'test', {'replicates': 2})"
    log = workspace / "killed-pipeline.log"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while len(list(workspace.glob("runs/sei/*/TRAIN_DONE"))) < 2:  # kill it between replicate 2's train and evaluate
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    logs = [d / "train.log" for d in workspace.glob("runs/sei/*")]
    trained = {log.parent.name: log.read_text() for log in logs if log.exists()}
    assert len(trained) == 2
    result = run_paper("sei", "test", {"replicates": 2})
    assert not result["reused"] and tracking.client().get_run(result["run_id"]).info.status == "FINISHED"
    children = _replicates(result["run_id"])
    assert {c.info.run_id for c in children} == set(trained) and {c.info.status for c in children} == {"FINISHED"}
    for run_id, log_before in trained.items():
        train_log = (workspace / "runs" / "sei" / run_id / "train.log").read_text()
        assert train_log == log_before, "no replicate trains again"
        assert train_log.count("phase detect: step 4/4") == 1


def test_corrupted_data_is_detected_and_regenerated(workspace, prefect_harness):
    from flows.deployed import paper as run_paper

    first = run_paper("sei", "test")
    (table,) = workspace.glob("variants/sei/test-*/data/samples.parquet")  # one replicate: one stage
    table.write_bytes(table.read_bytes()[:100])  # truncated
    second = run_paper("sei", "test")
    assert second["data_hash"] == first["data_hash"] and second["reused"]
    import pyarrow.parquet as pq

    assert pq.read_table(table).num_rows > 0


def test_unwritable_run_folder_fails_clearly_and_marks_the_run_failed(workspace, prefect_harness):
    (workspace / "runs").write_text("not a folder")  # stands for a full disk or an unwritable mount
    result = CliRunner().invoke(app, ["run", "sei", "--profile", "test"])
    assert result.exit_code == 1
    assert "error: sei failed:" in result.output and "runs" in result.output
    runs = tracking.client().search_runs([tracking.experiment_id("sei")])
    assert {r.data.tags["paperline.kind"] for r in runs} == {"pipeline", "replicate"}
    assert {r.info.status for r in runs} == {"FAILED"}  # the parent and its replicate: not left RUNNING


def test_full_disk_fails_clearly_and_marks_the_run_failed(workspace, prefect_harness, tmp_path):
    """A real ENOSPC: the run folder is a 64 KiB tmpfs, too small for the first checkpoint."""
    runs = workspace / "runs"
    runs.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(runs)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        result = CliRunner().invoke(app, ["run", "sei", "--profile", "test"])
        assert result.exit_code == 1
        assert "error: sei failed:" in result.output and "No space left on device" in result.output
        recorded = tracking.client().search_runs([tracking.experiment_id("sei")])
        assert len(recorded) == 2 and {r.info.status for r in recorded} == {"FAILED"}  # the parent and its replicate
    finally:
        subprocess.run(["umount", "-l", str(runs)])


def test_the_failure_reason_is_the_last_rank_error_not_torchruns_summary(tmp_path):
    from tasks.train import last_error

    log = tmp_path / "train.log"
    log.write_text("step 3/6\n[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\"\n"
                   "[rank1]: OSError: [Errno 28] No space left on device\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert last_error(log) == "OSError: [Errno 28] No space left on device"
    assert last_error(tmp_path / "missing.log") is None
