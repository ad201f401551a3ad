"""A pipeline run's result, and the cached-rerun check that answers without starting Prefect or importing a paper.

An unchanged rerun (same code, params as given, and data that DVC finds up to date) returns the earlier MLflow
run's result. The flow does the same check inside `paper_pipeline`; `lookup` is the fast path the CLI tries first,
so `paperline run <id>` on unchanged work costs an MLflow query and a DVC status, not a Prefect start (issue 6).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from models import registry
from tasks import data, settings, tracking


@dataclass
class PipelineResult:
    paper: str
    profile: str
    run_id: str
    reused: bool
    holds: bool
    claim_text: str
    claim_numbers: str
    data_hash: str
    seconds: float

    def claim_line(self) -> str:
        verdict = "holds" if self.holds else "does not hold"
        return f"claim {self.paper}: {self.claim_text} -> {verdict}\n  {self.claim_numbers}"

    @classmethod
    def reused_run(cls, run, paper: str, profile: str, data_hash: str, start: float) -> PipelineResult:
        tags = run.data.tags
        return cls(paper, profile, run.info.run_id, True, tags.get("claim.holds") == "true",
                   tags.get("claim.text", ""), tags.get("claim.numbers", ""), data_hash, time.perf_counter() - start)


def is_default_run(profile: str, overrides: dict[str, Any]) -> bool:
    return profile == data.DEFAULT_PROFILE and not overrides


def lookup(papers: list[str], profile: str, overrides: dict[str, Any]) -> dict[str, PipelineResult]:
    """The earlier finished run of exactly this work, per paper that has one (the others then run). Raises
    ConfigError like `registry.resolve` for an unknown id or profile; unvalidated params simply never match a
    finished run. One DVC repository (and one read of dvc.lock) serves every paper."""
    start = time.perf_counter()
    raw = {pid: registry.raw_params(pid, profile, overrides, settings.params_file()) for pid in papers}
    stages = {pid: data.stage_location(pid, profile, raw[pid], is_default_run(profile, overrides)) for pid in papers}
    hashes = data.current_hashes(list(stages.values()))
    if not any(hashes.values()) or not tracking.store_exists():
        return {}
    found: dict[str, PipelineResult] = {}
    for pid in papers:
        data_hash = hashes[stages[pid].target]
        experiment = tracking.client().get_experiment_by_name(f"paperline/{pid}") if data_hash else None
        if experiment is None:
            continue
        run = tracking.find_cached(experiment.experiment_id, tracking.run_key(pid, profile, raw[pid], data_hash))
        if run is None:
            continue
        tracking.mark_reused(run.info.run_id)
        print(f"[{pid}] unchanged code, params and data: reusing run {run.info.run_id} (use --force to retrain)",
              file=sys.stderr, flush=True)
        found[pid] = PipelineResult.reused_run(run, pid, profile, data_hash, start)
    return found
