"""The scoreboard page: decisive rows first, inconclusive ones by why, papers not run last; overrides shown."""

from __future__ import annotations

from flows import report
from tasks.replicates import _claimed_op


def _row(paper: str, verdict: str, reason: str = "", overrides: str = "", run_id: str = "r") -> report.Row:
    return report.Row(paper, f"{paper} title", f"{paper}/x > y", "part -> " + verdict, verdict, "d" * 32,
                      run_id if verdict != report.NOT_RUN else "", "smoke", "1", "3", reason, overrides=overrides)


def test_scoreboard_orders_decisive_then_inconclusive_by_why_then_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PAPERLINE_ROOT", str(tmp_path))
    rows = [_row("a_not_run", report.NOT_RUN),
            _row("b_zero", "inconclusive"),
            _row("c_shown", "inconclusive", "premise p not shown (x = 0.1 [-0.2, 0.3])"),
            _row("d_holds", "holds", overrides="epochs=5"),
            _row("e_failed", "inconclusive", "premise q failed (y = -1 [-2, -0.5])"),
            _row("f_fails", "does not hold"),
            _row("g_one", "inconclusive", "1 replicate, no interval")]
    order = [r.paper for r in report.ordered(rows)]
    assert order == ["d_holds", "f_fails", "e_failed", "c_shown", "b_zero", "g_one", "a_not_run"]
    assert [report.group(r) for r in report.ordered(rows)][2:5] == [
        "inconclusive: premise failed", "inconclusive: premise not shown", "inconclusive: interval crosses zero"]

    md, page = report.write(rows, tmp_path)
    table = [line for line in md.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0].removeprefix("| ") for line in table] == order
    assert "| smoke with epochs=5 |" in md.read_text()  # an override run says so
    html = page.read_text()
    assert html.index("d_holds") < html.index("e_failed") < html.index("a_not_run")
    assert "decisive (2)" in html and "not run here (1)" in html and "epochs=5" in html
    assert "table-layout:fixed" in html and "max-width:420px" not in html  # no wide table, no shrunken plots


def test_forest_plot_reads_the_claimed_side_from_the_comparison():
    assert _claimed_op("method/a > max(baseline/{b,c}/a)") == ">"
    assert _claimed_op("method/risk <= 2 x baseline/bayes/risk + 0.1") == "<="
    assert _claimed_op("baseline/fedavg/mem_auc_global < baseline/fedavg/mem_auc_local") == "<"


def test_pipeline_runs_are_named_by_their_overrides_and_publish_their_verdict(monkeypatch, tmp_path):
    import dataclasses

    import prefect.artifacts

    from flows import pipeline
    from flows.cache import PipelineResult

    assert pipeline.run_label("sei", "smoke", None) == "sei-smoke"
    assert pipeline.run_label("sei", "test", {"epochs": 5, "eta": 0.3}) == "sei-test epochs=5,eta=0.3"
    published = []
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact",
                        lambda markdown, key, description: published.append((key, markdown, description)))
    result = PipelineResult("quantile_mia", "smoke", "abc123", False, "holds", "method/a > baseline/b/a",
                            "method/a - baseline/b/a = 0.1 [0.05, 0.15] over 3 replicates -> holds", "", 3, "h", 1.0)
    pipeline.publish_artifact(result, "7")
    key, markdown, description = published[0]
    assert key == "claim-quantile-mia-smoke" and description == "quantile_mia: holds"
    assert markdown.startswith("## quantile_mia (smoke) claim: holds")
    assert "- `method/a - baseline/b/a = 0.1 [0.05, 0.15] over 3 replicates -> holds`" in markdown
    assert "[abc123](http://127.0.0.1:5000/#/experiments/7/runs/abc123?workflowType=machine_learning)" in markdown
    premises = dataclasses.replace(result, premises_only=True, verdict="premises met")
    pipeline.publish_artifact(premises, "7")
    key, markdown, _ = published[1]  # a premises-only run never publishes under the claim's key
    assert key == "premises-quantile-mia-smoke" and markdown.startswith("## quantile_mia (smoke) premises:")


def test_each_replicates_data_is_an_mlflow_dataset(workspace):
    import json

    from flows.pipeline import log_datasets
    from tasks import tracking
    from tasks.data import DataStage, PreparedData

    client = tracking.client()
    run_id = client.create_run(tracking.experiment_id("sei")).info.run_id
    stage = DataStage(workspace / "dvc.yaml", "prepare@sei", workspace / "data" / "sei")
    log_datasets(run_id, [PreparedData(stage, "a" * 32 + ".dir", 0.1, False)], first_index=2)
    (got,) = client.get_run(run_id).inputs.dataset_inputs
    assert (got.dataset.name, got.dataset.digest, got.dataset.source_type) == ("dvc.yaml:prepare@sei",
                                                                               "a" * 32 + ".dir", "dvc")
    assert json.loads(got.dataset.source) == {"dvc_stage": "dvc.yaml:prepare@sei", "path": "data/sei"}
    assert [t.value for t in got.tags] == ["replicate 2"]
