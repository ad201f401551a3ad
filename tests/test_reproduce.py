"""`paperline reproduce`: a recorded run rerun from its lineage in a scratch checkout matches it bitwise (CPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.reproduce import Comparison

PROJECT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e


def _project_clone(path):
    """This project as a user's clone, with the working tree's uncommitted changes (so tests run on them too)."""
    subprocess.run(["git", "clone", "-q", "--shared", str(PROJECT), str(path)], check=True)
    changed = subprocess.run(["git", "ls-files", "-m", "-o", "--exclude-standard"], cwd=PROJECT, check=True,
                             capture_output=True, text=True).stdout.split()
    for name in changed:
        if (PROJECT / name).is_file():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(PROJECT / name, path / name)
    return path


def test_reproduce_reruns_a_recorded_run_and_matches_bitwise(tmp_path):
    clone = _project_clone(tmp_path / "clone")
    env = {**os.environ, "PAPERLINE_ROOT": str(clone), "PYTHONPATH": str(clone),
           "DVC_SITE_CACHE_DIR": str(clone / ".dvc" / "site-cache")}
    cli = [sys.executable, "-m", "flows.cli"]
    subprocess.run([*cli, "run", "sei", "--profile", "test", "--set", "epochs=2", "--set", "replicates=2"], cwd=clone,
                   env=env, check=True, capture_output=True)
    client = MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("paperline/sei").experiment_id
    (original,) = client.search_runs([experiment], "tags.`paperline.kind` = 'pipeline'")
    assert client.get_run(original.info.run_id).data.tags["paperline.code_ref"]
    assert int(original.data.tags["paperline.threads_per_rank"]) >= 1  # what the rerun pins
    pinned = subprocess.run(["git", "rev-parse", f"refs/paperline/{original.info.run_id}"], cwd=clone, check=True,
                            capture_output=True, text=True).stdout.strip()
    assert pinned == original.data.tags["paperline.code_ref"]

    done = subprocess.run([*cli, "reproduce", original.info.run_id], cwd=clone, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "REPRODUCED" in done.stdout and "| method/cnn_auroc |" in done.stdout
    assert "| stats/method/cnn_auroc/ci95_low |" in done.stdout  # the interval over the two replicates too
    rerun = client.search_runs([original.info.experiment_id],
                               filter_string=f"tags.`paperline.reproduces` = '{original.info.run_id}'")
    assert len(rerun) == 1 and rerun[0].data.tags["paperline.reproduced"] == "true"
    assert rerun[0].data.params == original.data.params
    assert not (clone / ".cache" / "reproduce" / original.info.run_id).exists()  # the scratch is cleaned up


def test_rerun_is_pinned_to_the_recorded_threads_of_each_rank(capsys):
    from flows.reproduce import replay_cores

    cores = sorted(os.sched_getaffinity(0))
    assert replay_cores("1", {"ranks": 1, "threads": None}) == cores[:1]  # a `--parallel 2` suite's paper
    assert replay_cores("1", {"ranks": 1, "threads": 1}) is None  # the params pin it already
    assert replay_cores(None, {"ranks": 1}) is None  # recorded before threads were
    assert replay_cores(str(len(cores)), {"ranks": 2, "threads": None}) is None  # more than this machine has
    assert "may differ at rounding level" in capsys.readouterr().out


def test_comparison_reports_every_difference():
    same = Comparison("a", "b", ("h", "h"), [("m/x", 0.5, 0.5), ("time/total_s", 1.0, 1.0)])
    assert same.matches and not same.mismatched
    differs = Comparison("a", "b", ("h", "h"), [("m/x", 0.5, 0.5 + 1e-12), ("m/y", 1.0, None)])
    assert not differs.matches and differs.mismatched == ["m/x", "m/y"]
    assert "NOT reproduced" in differs.table()
    assert not Comparison("a", "b", ("h", "g"), [("m/x", 0.5, 0.5)]).matches  # other data: not a reproduction


def test_snapshot_of_a_dirty_tree_holds_new_files_and_leaves_the_index_alone():
    from tasks import tracking

    probe = PROJECT / "models" / "common" / "_snapshot_probe.py"  # a new module a run could import
    index = PROJECT / ".git" / "index"
    before = index.read_bytes() if index.is_file() else None
    probe.write_text("VALUE = 1\n")
    try:
        commit = tracking._snapshot()
        shown = subprocess.run(["git", "show", f"{commit}:models/common/_snapshot_probe.py"], cwd=PROJECT,
                               capture_output=True, text=True, check=True).stdout
        assert shown == "VALUE = 1\n"
        parent = subprocess.run(["git", "rev-parse", f"{commit}^"], cwd=PROJECT, capture_output=True, text=True,
                                check=True).stdout.strip()
        assert parent == subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT, capture_output=True, text=True,
                                        check=True).stdout.strip()
        assert (index.read_bytes() if index.is_file() else None) == before  # nothing staged
    finally:
        probe.unlink()
