"""`paperline list`: titles without importing the papers, verdicts from the store without importing MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from flows import listing
from models import registry
from tests.conftest import PROJECT, finished_run


def test_titles_from_source_match_the_registry():
    for pid in ("sei", "qubo_relax", "tbik"):
        assert listing.title(pid) == registry.get(pid).title


def test_verdicts_new_tag_first_then_old(workspace):
    now = int(time.time() * 1000)
    finished_run("sei", {"claim.holds": "true", "paperline.profile": "smoke"}, now - 5000)
    finished_run("sei", {"claim.verdict": "inconclusive", "paperline.profile": "smoke"}, now,
              {"cpu/replicate_mean_s": 61.25})  # the latest wins
    finished_run("qubo_relax", {"claim.holds": "false", "paperline.profile": "test"}, now)  # before claim.verdict
    finished_run("pacer", {"paperline.profile": "smoke"}, now)  # no verdict: not counted
    rows = {r.paper: r for r in listing.listing()}
    assert (rows["sei"].verdict, rows["sei"].profile, rows["sei"].cpu_s) == ("inconclusive", "smoke", 61.25)
    assert (rows["qubo_relax"].verdict, rows["qubo_relax"].profile, rows["qubo_relax"].cpu_s) == (
        "does not hold", "test", None)
    assert rows["pacer"].verdict == "-" and rows["tbik"].verdict == "-"
    assert listing._from_client() == listing._from_sqlite(workspace / "mlflow.db")  # a server answers the same

    env = {**os.environ, "PAPERLINE_ROOT": str(workspace)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "flows.cli", "list"], cwd=PROJECT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "inconclusive" in out.stdout and "61 CPU-s" in out.stdout and "sei" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "mlflow", "prefect", "deepspeed"} & imported  # what made the first list take 12.7 s
    assert not {"dvc", "models.sei"} & imported  # nor DVC nor a paper


def test_titles_are_cached_by_module_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("PAPERLINE_ROOT", str(tmp_path))
    cache_file = tmp_path / ".cache" / "titles.json"
    assert listing.titles(["sei", "tbik"]) == {pid: registry.get(pid).title for pid in ("sei", "tbik")}
    cached = json.loads(cache_file.read_text())
    stat = registry.module_file("sei").stat()
    assert cached["sei"] == [stat.st_size, stat.st_mtime_ns, registry.get("sei").title]
    cached["sei"][2] = "read from the cache"
    cache_file.write_text(json.dumps(cached))
    assert listing.titles(["sei"])["sei"] == "read from the cache"  # same stamp: the module is not parsed
    cached["sei"][1] -= 1  # the module changed since
    cache_file.write_text(json.dumps(cached))
    assert listing.titles(["sei"])["sei"] == registry.get("sei").title
