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


def lookup(paper: str, profile: str, overrides: dict[str, Any]) -> PipelineResult | None:
    """The earlier finished run of exactly this work, or None (then the flow runs). Raises ConfigError like
    `registry.resolve` for an unknown id or profile; unvalidated params simply never match a finished run."""
    start = time.perf_counter()
    raw = registry.raw_params(paper, profile, overrides, settings.params_file())
    stage = data.stage_location(paper, profile, raw, is_default_run(profile, overrides))
    data_hash = data.current_hash(stage)
    if data_hash is None or not tracking.store_exists():
        return None
    found = tracking.client().get_experiment_by_name(f"paperline/{paper}")
    if found is None:
        return None
    run = tracking.find_cached(found.experiment_id, tracking.run_key(paper, profile, raw, data_hash))
    if run is None:
        return None
    tracking.mark_reused(run.info.run_id)
    print(f"[{paper}] unchanged code, params and data: reusing run {run.info.run_id} (use --force to retrain)",
          file=sys.stderr, flush=True)
    return PipelineResult.reused_run(run, paper, profile, data_hash, start)
