"""End to end through Prefect, DVC, DeepSpeed (2 ranks) and MLflow, in a temporary workspace."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from models.verdicts import VERDICTS
from tasks import data, tracking

pytestmark = pytest.mark.e2e


def _lock_hash(workspace, stage="prepare@sei"):
    return yaml.safe_load((workspace / "dvc.lock").read_text())["stages"][stage]["outs"][0]["md5"]


def _children(parent_id: str) -> list:
    client = tracking.client()
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return sorted(runs, key=lambda r: int(r.data.tags["paperline.replicate"]))


def test_sei_smoke_pipeline_tracks_reuses_and_versions_overrides(workspace, prefect_harness):
    from flows.deployed import paper as run_paper

    # two replicates instead of the profile's three keep this test's time down; still the default run
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["papers"]["sei"]["smoke"]["replicates"] = 2
    params["papers"]["sei"]["smoke"]["ranks"] = 2  # smoke trains on 1 rank; this test keeps DeepSpeed's 2 in use
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # the stage the flow runs is the one `dvc repro` runs from the shell
    subprocess.run([sys.executable, "-m", "dvc", "repro", "prepare@sei"], cwd=workspace, check=True,
                   capture_output=True)
    shell_hash = _lock_hash(workspace)

    first = run_paper("sei", "smoke")
    # replicate 0 is the hand-written stage; replicate 1 (seed + 1) draws its own world in a variant stage
    assert not first["reused"] and first["data_hash"].split(",")[0] == shell_hash == _lock_hash(workspace)
    assert len(set(first["data_hash"].split(","))) == 2 and first["replicates"] == 2
    run = tracking.client().get_run(first["run_id"])
    tags, metrics, params = run.data.tags, run.data.metrics, run.data.params
    assert run.info.status == "FINISHED"
    assert tags["paperline.data_hash"] == first["data_hash"] and tags["paperline.kind"] == "pipeline"
    assert tags["paperline.world_size"] == "2" and params["ranks"] == "2"
    assert tags["claim.verdict"] in VERDICTS and tags["claim.text"].startswith("method/cnn_auroc >")
    assert tags["claim.replicates"] == "2" and "over 2 replicates" in tags["claim.numbers"]
    assert tags["prefect.flow_run_id"] and tags["mlflow.source.git.commit"]
    assert {"method/cnn_auroc", "method/clip_auroc", "baseline/aum/cnn_auroc", "claim/verdict"} <= set(metrics)
    assert {"stats/method/cnn_auroc/ci95_low", "stats/method/cnn_auroc/std"} <= set(metrics)
    assert any(re.fullmatch(r"claim/part\d+/effect", k) for k in metrics)  # each deciding part's effect
    children = _children(first["run_id"])
    assert [c.data.tags["paperline.seed"] for c in children] == ["0", "1"]
    assert {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags["mlflow.source.name"] for c in children} == {tags["mlflow.source.name"]}  # the Source column
    cpu = [c.data.metrics for c in children]  # the budget: training ranks' and evaluation's CPU seconds
    assert all(m["cpu/replicate_s"] == m["cpu/train_s"] + m["cpu/evaluate_s"] and m["cpu/train_s"] > 1 for m in cpu)
    assert metrics["cpu/replicate_mean_s"] == pytest.approx(sum(m["cpu/replicate_s"] for m in cpu) / 2)
    per_replicate = [c.data.metrics["method/cnn_auroc"] for c in children]
    assert metrics["method/cnn_auroc"] == sum(per_replicate) / 2 and min(per_replicate) > 0.8  # far above chance
    history = tracking.client().get_metric_history(children[0].info.run_id, "train/detect/loss")
    assert len(history) > 5 and len({m.step for m in history}) == len(history)  # per-step, no duplicates
    artifacts = {a.path for a in tracking.client().list_artifacts(first["run_id"], "plots")}
    assert {"plots/forest.png", "plots/roc_sym0.4-r0_cnn.png", "plots/sei_asy0.2-r0_clip.png"} <= artifacts

    second = run_paper("sei", "smoke")
    assert second["reused"] and second["run_id"] == first["run_id"]

    params_before = (workspace / "params.yaml").read_bytes()
    third = run_paper("sei", "smoke", {"n_samples": 300, "epochs": 2, "downstream_epochs": 1, "ranks": 1})
    assert not third["reused"] and set(third["data_hash"].split(",")).isdisjoint(first["data_hash"].split(","))
    assert (workspace / "params.yaml").read_bytes() == params_before
    assert _lock_hash(workspace) == shell_hash  # the default stage's data is untouched
    variant = tracking.client().get_run(third["run_id"]).data.tags["paperline.data_stage"]
    assert variant.startswith("variants/sei/smoke-")
    assert data.locked_hash(data.DataStage(workspace / variant.split(":")[0], "prepare", workspace)) == \
        third["data_hash"].split(",")[0]


def test_cli_run_prints_claim_line_and_report(workspace, prefect_harness, monkeypatch):
    result = CliRunner().invoke(app, ["run", "sei", "--profile", "test", "--report"])
    assert result.exit_code == 0, result.output
    assert "claim sei: method/cnn_auroc >" in result.output
    assert result.output.startswith("[sei] started (test)")  # said before the checks and start-ups that take seconds
    run_id = tracking.client().search_runs([tracking.experiment_id("sei")], "tags.`paperline.kind` = 'pipeline'")[0]
    assert f"/runs/{run_id.info.run_id}?workflowType=machine_learning" in result.output  # the pipeline run's link
    assert "Prefect flow run http" in result.output
    # an unchanged rerun is answered from MLflow + DVC status alone: no flow is started for it
    import flows.pipeline

    def no_flow(*args, **kwargs):
        raise AssertionError("a cached rerun must not start a Prefect flow")

    monkeypatch.setattr(flows.pipeline, "run_papers", no_flow)
    again = CliRunner().invoke(app, ["run", "sei", "--profile", "test"])
    assert again.exit_code == 0, again.output
    assert "reusing run" in again.output and again.output.count("claim sei:") == 1
    assert "-> inconclusive: 1 replicate, no interval" in result.output  # the test profile: one replicate
    board = (workspace / "reports" / "scoreboard.md").read_text()
    assert "| sei |" in board
    # a later commit that changed no training code, params or data (reports, benchmarks) leaves the row current
    from flows import report

    rows = [r for r in report.scoreboard("test") if r.paper == "sei"]
    assert report.commit_summary(rows, "f" * 40, report.unchanged_runs(rows)).startswith("1 of 1 rows current")
    assert "stale: sei" in report.commit_summary(rows, "f" * 40)
    listed = CliRunner().invoke(app, ["list"])
    assert listed.exit_code == 0 and "sei" in listed.output
