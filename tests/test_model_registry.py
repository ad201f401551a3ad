"""Registered models are MLflow models (a pyfunc restoring the paper's trained networks), one champion per profile."""

from __future__ import annotations

import time

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import torch

from flows import lifecycle, serving
from models import registry
from models.common.tables import read_table
from tasks import settings, tracking
from tasks.worker import train_in_process
from tests.conftest import PROJECT


def _run(paper: str, profile: str, value: float, outputs=None) -> str:
    """A finished pipeline run as the pipeline leaves it: lineage tags, the primary metric, `outputs/`."""
    client = tracking.client()
    run = client.create_run(tracking.experiment_id(paper),
                            tags={"paperline.profile": profile, "paperline.data_hash": f"data-{profile}",
                                  "claim.holds": "false"})
    run_id = run.info.run_id
    client.log_metric(run_id, registry.get(paper).primary[0], value)
    if outputs is None:
        client.log_text(run_id, "records", "outputs/records.txt")
    else:
        for path in sorted(outputs.iterdir()):
            if path.is_file():
                client.log_artifact(run_id, str(path), "outputs")
    client.set_terminated(run_id, "FINISHED", end_time=int(time.time() * 1000))
    return run_id


def test_a_test_run_never_takes_the_smoke_champion(workspace):
    name, client = lifecycle.model_name("sei"), tracking.client()
    v_test, d_test = lifecycle.register_and_promote("sei", _run("sei", "test", 0.99))
    assert d_test.alias == "champion-test" and lifecycle.champion("sei", "smoke") is None
    v1, d1 = lifecycle.register_and_promote("sei", _run("sei", "smoke", 0.90))
    v2, d2 = lifecycle.register_and_promote("sei", _run("sei", "smoke", 0.95))
    assert (d1.alias, d2.alias) == ("champion-smoke", "champion-smoke")  # neither compared with the test run
    assert "first version" in d1.reason and "at least as good" in d2.reason
    assert str(client.get_model_version_by_alias(name, "champion-smoke").version) == v2  # the better smoke run
    assert str(client.get_model_version_by_alias(name, "champion-test").version) == v_test
    assert lifecycle.champion("sei", "smoke")["value"] == pytest.approx(0.95)
    assert lifecycle.champion("sei", "test")["value"] == pytest.approx(0.99)
    v3, d3 = lifecycle.register_and_promote("sei", _run("sei", "smoke", 0.91))
    assert d3.alias == "challenger-smoke" and "worse" in d3.reason
    assert str(client.get_model_version_by_alias(name, "champion-smoke").version) == v2
    assert lifecycle.promote("sei", v3, "by hand").alias == "champion-smoke"  # its own profile's champion
    assert str(client.get_model_version_by_alias(name, "champion-test").version) == v_test


@pytest.mark.parametrize("paper_id", ["sei", "spectral_schedule", "induction_smoothing", "qubo_relax"])
def test_champion_loads_as_mlflow_pyfunc(paper_id, workspace, monkeypatch, tmp_path):
    """A classifier (sei: predict on its data's table), a generator given a seed (spectral_schedule), a language
    model (networks, no predict) and a paper with nothing to learn (qubo_relax: its result files), each trained on
    the test profile and registered."""
    paper = registry.get(paper_id)
    params = registry.resolve(paper_id, "test", None, PROJECT / "params.yaml")
    data_dir, out_dir = tmp_path / "data", tmp_path / "out"
    data_dir.mkdir()
    paper.prepare(params, data_dir)
    train_in_process(paper_id, params, data_dir, out_dir)
    run_id = _run(paper_id, "test", 0.5, out_dir)
    version, decision = lifecycle.register_and_promote(paper_id, run_id)
    assert decision.alias == "champion-test"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", settings.tracking_uri())  # what a user's tools read
    model = mlflow.pyfunc.load_model(f"models:/{lifecycle.model_name(paper_id)}@champion-test")
    unwrapped = model.unwrap_python_model()
    assert unwrapped.paper_id == paper_id and unwrapped.outputs.is_dir()
    if paper.learns:
        assert unwrapped.modules and all(isinstance(m, torch.nn.Module) for m in unwrapped.modules.values())
        for phase, module in unwrapped.modules.items():  # the trained weights, not a fresh initialisation
            saved = torch.load(out_dir / f"network.{phase}.pt", weights_only=False)["module"]
            assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(),
                                                          saved.state_dict().values(), strict=True))
    else:
        assert not unwrapped.networks and any(unwrapped.outputs.iterdir())
    if paper_id == "sei":
        table = pd.DataFrame({"pixels": list(read_table(data_dir / "samples.parquet")["pixels"][:16])})
        pred = model.predict(table)
        assert len(pred) == 16 and pred["label"].between(0, 9).all()
        probs = pred[[c for c in pred.columns if c.startswith("p")]].to_numpy()
        assert abs(probs.sum(1) - 1).max() < 1e-5
        wrong = pd.DataFrame({"image": list(table["pixels"][:2])})
        with pytest.raises(Exception, match="pixels"):  # MLflow checks the table against the signature first
            model.predict(wrong)
        with pytest.raises(ValueError, match="no column 'pixels'.*predict input: SEI's downstream classifier"):
            unwrapped.predict(None, wrong)
    elif paper_id == "spectral_schedule":
        spectra = read_table(data_dir / "spectra.parquet")
        table = pd.DataFrame({"logA": spectra["logA"][:3], "alpha": spectra["alpha"][:3], "seed": [7, 8, 7]})
        images = model.predict(table, params={"nfe": 3})
        side = registry.resolve(paper_id, "test", None, PROJECT / "params.yaml").image_size
        assert list(images["seed"]) == [7, 8, 7] and all(len(x) % (side * side) == 0 for x in images["pixels"])
        assert all(np.isfinite(x).all() for x in images["pixels"])
        again = model.predict(table.iloc[[0]], params={"nfe": 3})  # a seed names its sample
        assert np.array_equal(again["pixels"][0], images["pixels"][0])
        with pytest.raises(ValueError, match="no column 'alpha', 'seed'"):
            unwrapped.predict(None, table[["logA"]])
    else:
        with pytest.raises(NotImplementedError, match="no predict for this paper"):
            model.predict(pd.DataFrame({"x": [0.0]}))
    # what predict takes is on the registered model, its versions and (where it has one) the model's signature
    client = tracking.client()
    described = client.get_registered_model(lifecycle.model_name(paper_id)).description
    assert paper.title in described and client.get_model_version(lifecycle.model_name(paper_id), version).description
    signature = model.metadata.get_input_schema()
    assert (signature.input_names() if signature else []) == list(serving.PREDICT_COLUMNS.get(paper_id, []))
