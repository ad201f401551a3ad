"""Nightly lifecycle: model versions in MLflow's registry, promote-if-better, the morning report."""

from __future__ import annotations

import time

import pytest
import yaml

from flows import lifecycle, morning
from models import registry
from tasks import tracking


def test_promotion_rule():
    primary = ("method/auroc", "max")
    first = lifecycle.decide(primary, {"value": 0.8, "data_hash": "h", "profile": "smoke"}, None)
    assert first.alias == "champion"
    champ = {"version": "1", "value": 0.8, "data_hash": "h", "profile": "smoke"}
    assert lifecycle.decide(primary, {"value": 0.8, "data_hash": "h", "profile": "smoke"}, champ).alias == "champion"
    worse = lifecycle.decide(primary, {"value": 0.7, "data_hash": "h", "profile": "smoke"}, champ)
    assert worse.alias == "challenger" and "worse" in worse.reason
    other = lifecycle.decide(primary, {"value": 0.99, "data_hash": "g", "profile": "smoke"}, champ)
    assert other.alias == "challenger" and "other data" in other.reason
    assert lifecycle.decide(("m", "min"), {"value": 0.7, "data_hash": "h", "profile": "smoke"},
                            champ).alias == "champion"  # lower is better there
    assert lifecycle.decide(primary, {"value": float("nan"), "data_hash": "h", "profile": "smoke"},
                            champ).alias == "challenger"
    # more replicates of the same worlds compare (the 3-replicate champion's data, two replicates more) ...
    three = {"version": "2", "value": 0.8, "data_hash": "a,b,c", "profile": "smoke"}
    assert lifecycle.decide(primary, {"value": 0.81, "data_hash": "a,b,c,d,e", "profile": "smoke"},
                            three).alias == "champion"
    # ... other worlds do not
    assert lifecycle.decide(primary, {"value": 0.81, "data_hash": "a,x,c,d,e", "profile": "smoke"},
                            three).alias == "challenger"


def _finished_run(paper: str, value: float, holds: bool, start_ms: int | None = None, data_hash: str = "h",
                  profile: str = "smoke") -> str:
    client = tracking.client()
    run = client.create_run(tracking.experiment_id(paper), start_time=start_ms,
                            tags={"paperline.profile": profile, "paperline.data_hash": data_hash,
                                  "claim.verdict": "holds" if holds else "does not hold"})
    client.log_metric(run.info.run_id, registry.get(paper).primary[0], value)
    client.log_metric(run.info.run_id, "time/total_s", 61.0)
    client.log_text(run.info.run_id, "weights", "outputs/model.txt")
    client.set_terminated(run.info.run_id, "FINISHED", end_time=(start_ms or int(time.time() * 1000)) + 1)
    return run.info.run_id


def test_versions_and_aliases_in_the_mlflow_registry(workspace):
    name = lifecycle.model_name("sei")
    v1, d1 = lifecycle.register_and_promote("sei", _finished_run("sei", 0.90, True))
    v2, d2 = lifecycle.register_and_promote("sei", _finished_run("sei", 0.85, True))
    assert (d1.alias, d2.alias) == ("champion-smoke", "challenger-smoke")
    client = tracking.client()
    assert str(client.get_model_version_by_alias(name, "champion-smoke").version) == v1
    assert "worse" in client.get_model_version(name, v2).tags["promotion.reason"]
    v3, d3 = lifecycle.register_and_promote("sei", _finished_run("sei", 0.95, False))
    assert d3.alias == "champion-smoke"
    assert str(client.get_model_version_by_alias(name, "champion-smoke").version) == v3
    version = client.get_model_version(name, v3)
    assert version.tags["paperline.data_hash"] == "h" and version.tags["claim.verdict"] == "does not hold"
    assert version.source.endswith("/model")  # an MLflow pyfunc model holding the run's outputs

    lifecycle.promote("sei", v2, "rollback")  # by hand, recorded as such
    assert str(client.get_model_version_by_alias(name, "champion-smoke").version) == v2
    assert client.get_model_version(name, v2).tags["promotion.by"] == "hand"
    with pytest.raises(registry.ConfigError, match="no version"):
        lifecycle.promote("sei", "99")


def test_morning_report_flags_flips_first_and_explains_skips(workspace):
    day_ago = int((time.time() - 30 * 3600) * 1000)
    lifecycle.register_and_promote("sei", _finished_run("sei", 0.90, False, start_ms=day_ago))
    _finished_run("sei", 0.95, True)  # retrained last night, and now the claim holds
    reused = _finished_run("qubo_relax", 0.5, False, start_ms=day_ago)
    tracking.mark_reused(reused)  # the nightly run found it unchanged

    lines = {ln.paper: ln for ln in morning.morning(24 * 3600)}
    sei, qubo = lines["sei"], lines["qubo_relax"]
    assert sei.status == "retrained" and sei.flipped and (sei.verdict_before, sei.verdict_now) == ("does not hold",
                                                                                                   "holds")
    assert sei.delta == pytest.approx(0.05) and sei.champion_version == "1" and sei.wall_s == 61.0
    assert qubo.status == "skipped" and "unchanged" in qubo.why and not qubo.flipped
    assert lines["pacer"].status == "not run"
    ordered = [ln.paper for ln in morning.morning(24 * 3600)]
    assert ordered[0] == "sei"  # the flip comes first
    md, page = morning.write(morning.morning(24 * 3600), "24h")
    assert "**FLIP** holds" in md.read_text() and "data:image/png;base64" in page.read_text()
    with pytest.raises(registry.ConfigError, match="--since"):
        morning.parse_window("yesterday")


@pytest.mark.e2e
def test_two_nightly_suites_in_a_row(workspace, prefect_harness):
    from flows.pipeline import suite

    papers = ["sei", "qubo_relax"]
    first = suite(papers, "test")
    assert [r.get("reused") for r in first] == [False, False]
    # started while sei evaluated (or by its own flow): either way the job it trained in was waiting for it
    client = tracking.client()
    parent = client.get_run(first[1]["run_id"])
    (replicate,) = client.search_runs([parent.info.experiment_id],
                                      f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    qubo_log = (workspace / "runs" / "qubo_relax" / replicate.info.run_id / "train.log").read_text()
    assert qubo_log.startswith("[launcher] prestarted job")
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["papers"]["qubo_relax"]["test"]["starts"] = 12  # one paper's params change during the day
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    second = suite(papers, "test")
    assert [r.get("reused") for r in second] == [True, False]

    report = next((workspace / "reports").glob("morning-*.md")).read_text()
    lines = {ln.paper: ln for ln in morning.morning(24 * 3600, "test")}
    assert lines["sei"].status == "skipped" and lines["qubo_relax"].status == "retrained"
    assert "| sei | skipped (unchanged code, params and data" in report
    assert "| qubo_relax | retrained" in report
    versions = client.search_model_versions(f"name = '{lifecycle.model_name('qubo_relax')}'")
    assert len(versions) == 2  # one per finished run; the reused sei run registered nothing new
    assert len(client.search_model_versions(f"name = '{lifecycle.model_name('sei')}'")) == 1
