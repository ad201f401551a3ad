"""The run ledger (tasks/ledger.py) on constructed MLflow answers: which step each replicate takes, and why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tasks import ledger


class Request(SimpleNamespace):
    """What the ledger reads of a registry.RunRequest."""

    def replicate(self, index):
        return SimpleNamespace(raw={**self.raw, "seed": index}, params=SimpleNamespace(seed=index))


def _run(run_id, status="FINISHED", parent="p-old"):
    return SimpleNamespace(info=SimpleNamespace(run_id=run_id, status=status),
                           data=SimpleNamespace(tags={"mlflow.parentRunId": parent}))


@pytest.fixture
def store(monkeypatch):
    """An MLflow store answering from dicts: cached / resumable pipeline runs by key, a resumable run's
    replicates by index, and replicates trained by any run by seed."""
    held = SimpleNamespace(cached={}, resumable={}, started={}, trained={})
    tracking = ledger.tracking
    monkeypatch.setattr(tracking, "find_cached", lambda exp, key: held.cached.get(key))
    monkeypatch.setattr(tracking, "find_resumable", lambda exp, key: held.resumable.get(key))
    monkeypatch.setattr(tracking, "find_replicate", lambda exp, parent, index, key: held.started.get((parent, index)))
    monkeypatch.setattr(tracking, "find_trained",
                        lambda exp, paper, profile, key, data_hash, seed: held.trained.get(seed))
    return held


REQUEST = Request(paper="sei", profile="test", raw={"replicates": 4}, premises_only=False)
HASHES = ["h0", "h1", "h2", "h3"]


def test_a_killed_run_keeps_resumes_reuses_and_trains(store):
    key = ledger.pipeline_key(REQUEST, ",".join(HASHES))
    store.resumable[key] = _run("p-killed", "KILLED")
    store.started[("p-killed", 0)] = _run("r0", "FINISHED", "p-killed")
    store.started[("p-killed", 1)] = _run("r1", "KILLED", "p-killed")
    store.trained[2] = _run("r2-elsewhere")
    book = ledger.read(REQUEST, HASHES, "exp", force=False)
    assert [e.action for e in book.replicates] == ["keep", "resume", "reuse", "train"]
    assert [e.earlier.info.run_id if e.earlier else None for e in book.replicates] == ["r0", "r1", "r2-elsewhere",
                                                                                       None]
    assert book.resumable.info.run_id == "p-killed" and book.cached is None
    assert book.reused.keys() == {2} and book.lineage == "extended" and not book.trains_nothing
    assert book.trains_after(0) and book.trains_after(2) and not book.trains_after(3)
    assert len({e.key for e in book.replicates}) == 4  # every replicate's seed and data in its training key


def test_all_replicates_stored_re_decides_without_training(store):
    for seed in range(4):
        store.trained[seed] = _run(f"r{seed}")
    book = ledger.read(REQUEST, HASHES, "exp", force=False)
    assert book.lineage == "re-decided" and book.trains_nothing and book.resumable is None


def test_a_finished_run_of_the_same_work_is_reused_whole(store):
    store.cached[ledger.pipeline_key(REQUEST, ",".join(HASHES))] = _run("p-done")
    store.trained[0] = _run("r0")
    book = ledger.read(REQUEST, HASHES, "exp", force=False)
    assert book.cached.info.run_id == "p-done" and book.replicates == ()


def test_force_trains_everything_and_premises_only_has_its_own_key(store):
    key = ledger.pipeline_key(REQUEST, ",".join(HASHES))
    store.cached[key] = store.resumable[key] = _run("p-done")
    store.trained.update({seed: _run(f"r{seed}") for seed in range(4)})
    book = ledger.read(REQUEST, HASHES, "exp", force=True)
    assert book.cached is None and book.resumable is None and book.lineage == "trained"
    assert [e.action for e in book.replicates] == ["train"] * 4
    premises = Request(**{**vars(REQUEST), "premises_only": True})
    assert ledger.pipeline_key(premises, ",".join(HASHES)) == f"premises-{key}"
    raw_request = SimpleNamespace(paper="sei", profile="test", raw={"replicates": 4})  # the CLI's, unvalidated
    assert ledger.pipeline_key(raw_request, ",".join(HASHES)) == key
