"""Prestarted DeepSpeed jobs (tasks.train.prestart): claimed by the launch they were started for, trained exactly
like a job started at launch, and never left behind when nothing claims them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from models import registry
from tasks import settings, train


def _sei_test_params(**overrides):
    return registry.resolve("sei", "test", {"ranks": 1, **overrides}, settings.params_file())


def _job(params, data_dir: Path, out_dir: Path) -> train.TrainJob:
    return train.TrainJob("sei", params, data_dir, out_dir, run_id=None, tracking_uri=None)


def test_prestarted_job_trains_bitwise_like_a_new_one(tmp_path):
    params = _sei_test_params()
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    registry.get("sei").prepare(params, data_dir)
    train.prestart("sei", params)
    train.launch(_job(params, data_dir, tmp_path / "prestarted"))
    train.launch(_job(params, data_dir, tmp_path / "new"))  # nothing prestarted any more: a job of its own
    logs = {name: (tmp_path / name / "train.log").read_text() for name in ("prestarted", "new")}
    assert logs["prestarted"].startswith("[launcher] prestarted job") and logs["new"].startswith("[launcher] new job")
    for name in ("model.pt", "records.pt"):
        a, b = (torch.load(tmp_path / run / name, weights_only=False) for run in ("prestarted", "new"))
        flat_a, flat_b = _tensors(a), _tensors(b)
        assert flat_a.keys() == flat_b.keys() and flat_a
        assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), name


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _tensors(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in _tensors(value, f"{prefix}/{i}").items()}
    if hasattr(obj, "shape"):
        return {prefix: torch.as_tensor(obj)}
    return {}


def test_unclaimed_or_mismatched_prestarts_are_stopped(monkeypatch):
    params = _sei_test_params()
    train.prestart("sei", params)
    waiting = train._prestarted["sei"]
    train.prestart("sei", params)  # one waiting job per paper
    assert train._prestarted["sei"] is waiting
    monkeypatch.setenv("PAPERLINE_FAULT", "kill:0:detect:1")  # the ranks would not see it: not this job
    assert train._claim("sei", params) == (None, "new job (environment changed: PAPERLINE_FAULT)")
    assert waiting.process.poll() is not None and not waiting.ticket.parent.exists()

    train.prestart("sei", params)
    cancelled = train._prestarted["sei"]
    train.cancel_prestarted("sei")
    assert cancelled.process.poll() is not None and not cancelled.ticket.parent.exists()
    assert "sei" not in train._prestarted


def test_temporary_prefect_api_starts_answers_and_stops():
    """In a fresh process (Prefect not yet imported), as the CLI uses it."""
    code = """
import os, urllib.request
from tasks.settings import configure_environment
configure_environment()
from flows import local_api
assert local_api.start()
local_api.wait_ready()
url = os.environ["PREFECT_API_URL"]
assert urllib.request.urlopen(url + "/health").status == 200
server = local_api._server
local_api.stop()
assert server.poll() is not None and "PREFECT_API_URL" not in os.environ
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=settings.root(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_suite_prestarts_the_paper_after_the_one_that_finished_training(monkeypatch):
    from flows import pipeline

    started = []
    monkeypatch.setattr(pipeline.train, "prestart", lambda pid, params: started.append((pid, params.ranks)))
    upcoming = pipeline._Upcoming({pid: registry.resolve(pid, "test", None, settings.params_file())
                                   for pid in ("sei", "ldka", "qubo_relax")})
    upcoming.start("sei")
    upcoming.prestart_next()  # sei trained: ldka is next
    upcoming.start("ldka")
    upcoming.start("qubo_relax")  # side by side, qubo_relax started before ldka finished training
    upcoming.prestart_next()
    assert [pid for pid, _ in started] == ["ldka"]
    assert started[0][1] == registry.resolve("ldka", "test", None, settings.params_file()).ranks
