"""Nightly lifecycle: model versions in MLflow's registry, promote-if-better, the morning report."""

from __future__ import annotations

import time
from types import SimpleNamespace

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
                  profile: str = "smoke", replicates: int = 2, lineage: dict[str, str] | None = None) -> str:
    """A pipeline run as the flow leaves it: the parent (kind `pipeline`, the verdict and the means) and one child
    run per replicate, each started just after its parent, finished before it, with its own metrics and no verdict."""
    client = tracking.client()
    start_ms = start_ms or int(time.time() * 1000)
    metric = registry.get(paper).primary[0]
    run = client.create_run(tracking.experiment_id(paper), start_time=start_ms,
                            tags={"paperline.profile": profile, "paperline.data_hash": data_hash,
                                  "paperline.kind": "pipeline", **(lineage or {})})
    parent = run.info.run_id
    for index in range(replicates):
        child = client.create_run(run.info.experiment_id, start_time=start_ms + 100 * (index + 1),
                                  tags={"mlflow.parentRunId": parent, "paperline.kind": "replicate",
                                        "paperline.replicate": str(index), "paperline.profile": profile,
                                        "paperline.data_hash": data_hash}).info.run_id
        client.log_metric(child, metric, value + 0.01 * index)
        client.log_metric(child, "time/train_s", 20.0)
        client.set_terminated(child, "FINISHED", end_time=start_ms + 100 * (index + 2))
    client.set_tag(parent, "claim.verdict", "holds" if holds else "does not hold")
    client.log_metric(parent, metric, value)
    client.log_metric(parent, "time/total_s", 61.0)
    client.log_text(parent, "weights", "outputs/model.txt")
    client.set_terminated(parent, "FINISHED", end_time=start_ms + 100 * (replicates + 3))
    return parent


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


def test_morning_report_reads_pipeline_runs_not_their_replicates(workspace):
    day_ago = int((time.time() - 30 * 3600) * 1000)
    lineage = {"paperline.code_hash": "c", "paperline.params_hash": "p", "paperline.forced": "false"}
    before = _finished_run("sei", 0.90, False, start_ms=day_ago, lineage=lineage)
    lifecycle.register_and_promote("sei", before)
    # an override run in between is not the run before of the default one
    _finished_run("sei", 0.99, True, start_ms=day_ago + 1000, lineage={**lineage, "paperline.overrides": "epochs=1",
                                                                          "paperline.params_hash": "o"})
    now = _finished_run("sei", 0.95, True, lineage={**lineage, "paperline.params_hash": "q"})  # retrained last night
    reused = _finished_run("qubo_relax", 0.5, False, start_ms=day_ago)
    tracking.mark_reused(reused)  # the nightly run found it unchanged
    _finished_run("pacer", 0.4, True, start_ms=day_ago, lineage=lineage)
    _finished_run("pacer", 0.4, True, lineage={**lineage, "paperline.forced": "true"})

    lines = {ln.paper: ln for ln in morning.morning(24 * 3600)}
    sei, qubo, pacer = lines["sei"], lines["qubo_relax"], lines["pacer"]
    assert sei.status == "retrained" and sei.why == "params changed"
    # the pipeline run, not its newest replicate: its verdict, its wall time, the run before it and its own link
    assert sei.flipped and (sei.verdict_before, sei.verdict_now) == ("does not hold", "holds")
    assert sei.wall_s == 61.0 and sei.run_url.split("/runs/")[1].startswith(now)
    assert sei.delta == pytest.approx(0.05) and sei.champion_version == "1"
    assert pacer.status == "retrained" and pacer.why == "--force" and not pacer.flipped
    assert qubo.status == "skipped" and "unchanged" in qubo.why and not qubo.flipped
    assert lines["stp"].status == "not run"
    ordered = [ln.paper for ln in morning.morning(24 * 3600)]
    assert ordered[0] == "sei"  # the flip comes first
    md, page = morning.write(morning.morning(24 * 3600), "24h")
    assert "| sei | retrained (params changed) | **FLIP** holds | does not hold |" in md.read_text()
    assert "data:image/png;base64" in page.read_text()
    with pytest.raises(registry.ConfigError, match="--since"):
        morning.parse_window("yesterday")


def test_retrain_reason_names_the_changed_parts():
    def run(**tags):
        return SimpleNamespace(data=SimpleNamespace(tags=tags))

    base = {"paperline.code_hash": "c", "paperline.params_hash": "p", "paperline.data_hash": "d"}
    assert morning.retrain_reason(run(**{**base, "paperline.data_hash": "e"}), run(**base)) == "data changed"
    both = run(**{**base, "paperline.code_hash": "x", "paperline.data_hash": "e"})
    assert morning.retrain_reason(both, run(**base)) == "code and data changed"
    assert morning.retrain_reason(run(**base), None) == "first run of this profile"
    assert "or --force" in morning.retrain_reason(run(**base), run())  # a run from before the hashes were tagged
    redecided = run(**{**base, "paperline.claim_hash": "k2", "paperline.lineage": "re-decided"})
    assert "re-decided from stored replicates" in morning.retrain_reason(redecided, run(**base))
    assert morning.retrain_reason(run(**{**base, "paperline.claim_hash": "k2"}),
                                  run(**{**base, "paperline.claim_hash": "k1"})) == "claim changed"


@pytest.mark.e2e
def test_two_nightly_suites_in_a_row(workspace, prefect_harness):
    from flows.deployed import nightly

    papers = ["sei", "qubo_relax"]
    first = nightly(papers, "test")
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
    second = nightly(papers, "test")
    assert [r.get("reused") for r in second] == [True, False]

    report = next((workspace / "reports").glob("morning-*.md")).read_text()
    lines = {ln.paper: ln for ln in morning.morning(24 * 3600, "test")}
    assert lines["sei"].status == "skipped" and lines["qubo_relax"].status == "retrained"
    assert "| sei | skipped (unchanged code, params and data" in report
    assert "| qubo_relax | retrained" in report
    versions = client.search_model_versions(f"name = '{lifecycle.model_name('qubo_relax')}'")
    assert len(versions) == 2  # one per finished run; the reused sei run registered nothing new
    assert len(client.search_model_versions(f"name = '{lifecycle.model_name('sei')}'")) == 1
