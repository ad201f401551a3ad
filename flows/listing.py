"""`paperline list` in well under a second: titles read from the paper modules' source (importing them all brings in
torch and every paper's libraries: seconds), verdicts from the tracking store in one query.

The verdict is the latest finished run's tag `claim.verdict` (holds / does not hold / inconclusive), or for runs
from before verdicts had three values, `claim.holds` (true / false); beside it, what a replicate of that run cost
(`cpu/replicate_mean_s`: CPU seconds of all its processes, mean over replicates), so a profile's budget is in view.
"""

from __future__ import annotations

import ast
import json
import os
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

from models import registry
from tasks import embedded_store, settings, tracking


@dataclass(frozen=True)
class Listed:
    paper: str
    title: str
    verdict: str  # "-" when no finished run has one
    profile: str  # the profile of the run the verdict comes from
    cpu_s: float | None = None  # that run's CPU seconds a replicate (mean), when it recorded them


def title(paper_id: str) -> str | None:
    """`PAPER = Paper(..., title="...")` read from the module's source, without importing it; None for a module
    that defines no paper."""
    source = registry.module_file(paper_id).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Paper":
            for kw in node.keywords:
                if kw.arg == "title" and isinstance(kw.value, ast.Constant):
                    return str(kw.value.value)
            return registry.get(paper_id).title  # a title computed at import: ask the module
    return None


def titles(paper_ids: list[str]) -> dict[str, str | None]:
    """`title` of each paper, from `.cache/titles.json` where the module's size and mtime are the ones recorded
    (parsing 38 modules costs ~0.6 s; reading one JSON file, milliseconds); parsed and recorded otherwise."""
    cache_file = settings.root() / ".cache" / "titles.json"
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    out, fresh = {}, {}
    for pid in paper_ids:
        stat = registry.module_file(pid).stat()
        stamp = [stat.st_size, stat.st_mtime_ns]
        entry = cached.get(pid)
        if isinstance(entry, list) and len(entry) == 3 and entry[:2] == stamp:
            out[pid] = entry[2]
        else:
            out[pid] = title(pid)
        fresh[pid] = [*stamp, out[pid]]
    if fresh != cached:
        _write_atomically(cache_file, json.dumps(fresh, indent=0))
    return out


def _write_atomically(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            handle.write(text)
        os.replace(handle.name, path)
    except OSError:  # a read-only checkout: the titles are parsed each time, nothing else changes
        pass


Latest = tuple[str, str, float | None]  # verdict, profile, CPU-s a replicate


def latest_verdicts() -> dict[str, Latest]:
    """paper id -> (verdict, profile, CPU-s a replicate) of its latest finished run that has a verdict."""
    if path := embedded_store.usable():
        return _from_sqlite(path)
    if not tracking.store_exists():  # an embedded store not created yet: nothing ran (MLflow would create it)
        return {}
    return _from_client()


# MLflow's own tables (experiments, runs, tags), read-only: importing mlflow alone takes ~2 s
_LATEST = """
SELECT e.name, r.run_uuid, t.key, t.value FROM runs r
JOIN experiments e ON e.experiment_id = r.experiment_id
JOIN tags t ON t.run_uuid = r.run_uuid
WHERE e.name LIKE 'paperline/%' AND e.lifecycle_stage = 'active' AND r.lifecycle_stage = 'active'
  AND r.status = 'FINISHED' AND t.key IN ('claim.verdict', 'claim.holds', 'paperline.profile')
ORDER BY r.start_time DESC, r.run_uuid
"""
_CPU = "SELECT run_uuid, value FROM latest_metrics WHERE key = 'cpu/replicate_mean_s' AND run_uuid IN ({})"


def _from_sqlite(path: Path) -> dict[str, Latest]:
    try:
        with embedded_store.connect(path) as db:
            rows = db.execute(_LATEST).fetchall()
            runs: dict[str, tuple[str, dict[str, str]]] = {}
            order: list[str] = []
            for name, run_id, key, value in rows:
                if run_id not in runs:
                    runs[run_id] = (name.removeprefix("paperline/"), {})
                    order.append(run_id)
                runs[run_id][1][key] = value
            chosen: dict[str, str] = {}  # paper -> its latest run with a verdict
            for run_id in order:  # newest first
                paper, tags = runs[run_id]
                if paper not in chosen and tracking.verdict_of(tags):
                    chosen[paper] = run_id
            ids = list(chosen.values())
            cpu = dict(db.execute(_CPU.format(",".join("?" * len(ids))), ids).fetchall()) if ids else {}
    except sqlite3.DatabaseError:  # unreadable after all (e.g. changed under us): ask MLflow
        return _from_client()
    return {paper: (tracking.verdict_of(runs[run_id][1]), runs[run_id][1].get("paperline.profile", ""), cpu.get(run_id))
            for paper, run_id in chosen.items()}


def _from_client() -> dict[str, Latest]:
    c, out = tracking.client(), {}
    for exp in c.search_experiments(filter_string="name LIKE 'paperline/%'"):
        for run in c.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'",
                                 order_by=["attributes.start_time DESC"], max_results=20):
            verdict = tracking.verdict_of(run.data.tags)
            if verdict:
                out[exp.name.removeprefix("paperline/")] = (verdict, run.data.tags.get("paperline.profile", ""),
                                                            run.data.metrics.get("cpu/replicate_mean_s"))
                break
    return out


def listing() -> list[Listed]:
    verdicts = latest_verdicts()
    return [Listed(pid, t, *verdicts.get(pid, ("-", "", None))) for pid, t in titles(registry.paper_ids()).items()
            if t is not None]
