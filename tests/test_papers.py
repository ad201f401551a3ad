"""Registry-wide: every paper's `test` profile through prepare, train (one in-process rank) and evaluate."""

from __future__ import annotations

import json
import math

import pytest

from models import registry
from models.verdicts import VERDICTS
from tasks.steps import evaluate
from tasks.worker import train_in_process
from tests.conftest import PROJECT


@pytest.mark.parametrize("paper_id", list(registry.papers()))
def test_paper_test_profile_end_to_end(paper_id, tmp_path):
    paper = registry.get(paper_id)
    params = registry.resolve(paper_id, "test", None, PROJECT / "params.yaml")
    data_dir, out_dir = tmp_path / "data", tmp_path / "out"
    data_dir.mkdir()
    paper.prepare(params, data_dir)
    assert list(data_dir.glob("*.parquet")), "prepare must write parquet tables"

    train_in_process(paper_id, params, data_dir, out_dir)
    metrics = evaluate(paper, params, data_dir, out_dir, run_id=None)
    assert metrics and all(math.isfinite(v) for v in metrics.values())
    # a paper with timed parts times them on a quiet machine: inside ctx.timing(), or in a training that runs in
    # quiet() (Paper.times_training; the pipeline's training_hold, not this in-process training)
    assert ("timing/quiet_wait_s" in metrics) == (paper.claim.timed and not paper.times_training)
    assert paper.primary[0] in metrics and paper.primary[1] in ("max", "min")
    assert json.loads((out_dir / "metrics.json").read_text()) == metrics
    claim = paper.claim.decide([metrics, metrics])  # two identical replicates: every part decisive, no NaN
    assert claim.verdict in VERDICTS and len(claim.parts) >= len(paper.claim.all_of)
    # a timed part pools its own timings, which differ within a replicate: only the others must be decisive here
    assert all(p.verdict != "inconclusive" for p in claim.parts if p.samples == p.replicates)

    # the registered model: a pyfunc whose context restores every phase's trained network (flows/serving.py)
    import mlflow.pyfunc

    from flows.serving import save_model

    save_model(paper_id, out_dir, tmp_path / "model")
    restored = mlflow.pyfunc.load_model(str(tmp_path / "model")).unwrap_python_model()
    saved = [p.name.removeprefix("network.") for p in out_dir.glob("network.*.pt")]
    phases = sorted(n.removesuffix(".pt") for n in saved if not n.endswith(".ema.pt"))
    assert sorted(restored.modules) == phases and (phases or not paper.learns), restored.networks.keys()
    assert sorted(restored.ema_networks) == sorted(n.removesuffix(".ema.pt") for n in saved if n.endswith(".ema.pt"))

    # checkpoint round-trip: a rerun in the same folder resumes every finished phase instead of retraining
    committed = sorted(out_dir.glob("checkpoints/*/committed.json"))
    assert committed or not paper.learns, "train() must train through ctx.fit (or the paper declares learns=False)"
    before = {p: p.read_text() for p in committed}
    (out_dir / "TRAIN_DONE").unlink()
    train_in_process(paper_id, params, data_dir, out_dir)
    assert {p: p.read_text() for p in committed} == before
    again = evaluate(paper, params, data_dir, out_dir, run_id=None)
    results = lambda m: {k: v for k, v in m.items() if not k.startswith("timing/")}  # noqa: E731 (steps a second, the load, waits)
    assert results(again) == results(metrics)


def test_prepare_is_deterministic(tmp_path):
    for paper_id, paper in registry.papers().items():
        params = registry.resolve(paper_id, "test", None, PROJECT / "params.yaml")
        (tmp_path / paper_id / "a").mkdir(parents=True)
        (tmp_path / paper_id / "b").mkdir(parents=True)
        paper.prepare(params, tmp_path / paper_id / "a")
        paper.prepare(params, tmp_path / paper_id / "b")
        for table in (tmp_path / paper_id / "a").glob("*.parquet"):
            import pyarrow.parquet as pq

            assert pq.read_table(table).equals(pq.read_table(tmp_path / paper_id / "b" / table.name)), table


def test_an_evaluator_process_evaluates_as_the_flow_does_and_its_cpu_is_charged(tmp_path):
    """A suite of papers side by side evaluates in evaluator processes (tasks/evaluators.py): the same metrics,
    files and plots as in the flow's process, and the evaluator's CPU charged to the replicate's evaluation."""
    from tasks import evaluators
    from tasks.threadcpu import WorkCPU

    paper = registry.get("ldka")
    params = registry.resolve("ldka", "test", None, PROJECT / "params.yaml")
    data_dir, out_dir = tmp_path / "data", tmp_path / "out"
    data_dir.mkdir()
    paper.prepare(params, data_dir)
    train_in_process("ldka", params, data_dir, out_dir)
    here = evaluate(paper, params, data_dir, out_dir, run_id=None)
    plots = sorted(p.name for p in (out_dir / "plots").iterdir())
    for p in (out_dir / "plots").iterdir():
        p.unlink()
    with evaluators.evaluators(1) as pool, WorkCPU() as cpu:
        there = evaluate(paper, params, data_dir, out_dir, run_id=None)
        assert pool._processes, "evaluated in an evaluator process"
    assert there == here and json.loads((out_dir / "metrics.json").read_text()) == here
    assert sorted(p.name for p in (out_dir / "plots").iterdir()) == plots
    assert cpu.seconds > 0.05
    assert evaluators.POOL.get() is None
