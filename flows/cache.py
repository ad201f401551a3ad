"""A pipeline run's result, and the cached-rerun check that answers without starting Prefect or importing a paper.

An unchanged rerun (same code, params as given, and data that DVC finds up to date) returns the earlier MLflow
run's result. The flow does the same check inside `paper_pipeline`; `lookup` is the fast path the CLI tries first,
so `paperline run <id>` on unchanged work costs a DVC status and one query, not a Prefect start: on the embedded
store the query reads its SQLite file directly (`tasks.embedded_store`), so MLflow is not even imported.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from models import registry
from tasks import data, embedded_store, ledger, tracking


@dataclass
class PipelineResult:
    paper: str
    profile: str
    run_id: str
    reused: bool
    verdict: str         # holds | does not hold | inconclusive
    claim_text: str
    claim_numbers: str   # one line per claim part: effect, interval, verdict
    reason: str          # why inconclusive, when it is
    replicates: int
    data_hash: str       # the replicates' data hashes, comma-separated
    seconds: float
    premises_only: bool = False  # the verdict and numbers are the premises' alone (`--premises-only`)
    trained: int = 0     # replicates this run trained (the others were stored, or the run was reused)

    def claim_line(self) -> str:
        head = self.verdict + (f": {self.reason}" if self.reason else "")
        body = "\n".join(f"  {line}" for line in self.claim_numbers.splitlines())
        return f"{'premises' if self.premises_only else 'claim'} {self.paper}: {self.claim_text} -> {head}\n{body}"

    @classmethod
    def reused_run(cls, run_id: str, tags: dict[str, str], paper: str, profile: str, data_hash: str,
                   start: float) -> PipelineResult:
        premises = tags.get("paperline.premises_only") == "true"
        prefix = "premises" if premises else "claim"
        return cls(paper, profile, run_id, True, tags.get("premises.verdict", "") if premises else
                   tracking.verdict_of(tags), tags.get(f"{prefix}.text", ""), tags.get(f"{prefix}.numbers", ""),
                   tags.get(f"{prefix}.reason", ""), int(tags.get(f"{prefix}.replicates", "1") or 1), data_hash,
                   time.perf_counter() - start, premises)


def _find_cached(paper: str, key: str) -> tuple[str, dict[str, str]] | None:
    """(run id, tags) of the finished run of `paper` with this cache key: straight from the embedded store's
    file where it can be read (no MLflow import), through MLflow otherwise."""
    if path := embedded_store.usable():
        stored = embedded_store.find_cached(path, f"paperline/{paper}", key)
        return (stored.run_id, stored.tags) if stored else None
    experiment = tracking.client().get_experiment_by_name(f"paperline/{paper}")
    run = tracking.find_cached(experiment.experiment_id, key) if experiment else None
    return (run.info.run_id, run.data.tags) if run else None


def reusable(asks: list[registry.RawRequest]) -> dict[str, tuple[str, dict[str, str], str]]:
    """Per paper that has one, the earlier finished run of exactly this work: (run id, tags, data hash). Reads
    only; unvalidated params simply never match a finished run. One DVC repository (and one read of dvc.lock)
    serves every paper."""
    stages = {ask.paper: [data.stage_location(ask.paper, ask.profile, ask.replicate_raw(i), ask.is_default and i == 0)
                          for i in range(ask.replicates)] for ask in asks}
    hashes = data.current_hashes([stage for per_paper in stages.values() for stage in per_paper])
    if not any(hashes.values()) or not tracking.store_exists():
        return {}
    found = {}
    for ask in asks:
        replicate_hashes = [hashes[stage.target] for stage in stages[ask.paper]]
        data_hash = ",".join(replicate_hashes) if all(replicate_hashes) else None
        cached = _find_cached(ask.paper, ledger.pipeline_key(ask, data_hash)) if data_hash else None
        if cached is not None:
            found[ask.paper] = (*cached, data_hash)
    return found


def lookup(asks: list[registry.RawRequest]) -> dict[str, PipelineResult]:
    """The earlier finished run of exactly this work, per paper that has one (the others then run), stamped as
    reused."""
    start = time.perf_counter()
    profiles = {ask.paper: ask.profile for ask in asks}
    found: dict[str, PipelineResult] = {}
    for pid, (run_id, tags, data_hash) in reusable(asks).items():
        tracking.mark_reused(run_id)
        print(f"[{pid}] unchanged code, params and data: reusing run {run_id} (use --force to retrain)",
              file=sys.stderr, flush=True)
        found[pid] = PipelineResult.reused_run(run_id, tags, pid, profiles[pid], data_hash, start)
    return found
