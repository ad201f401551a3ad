"""The flows Prefect deployments run: the same `paper-pipeline` and `suite` flows, taking the names a deployment
can pass (`prefect deployment run 'paper-pipeline/sei' -p profile=test`) and resolving them at run time, with the
resolver the CLI uses (`registry.request`), so that an edit of params.yaml reaches the next scheduled run.
flows/pipeline.py's flows take only resolved requests."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows import pipeline
from models import registry
from tasks import settings


@flow(name="paper-pipeline", flow_run_name=pipeline._flow_run_name, log_prints=False)
def paper(paper: str, profile: str = "smoke", overrides: dict[str, Any] | None = None, force: bool = False) -> dict:
    """One paper's pipeline (pipeline.paper_pipeline), its params resolved now."""
    return pipeline.paper_pipeline.fn(registry.request(paper, profile, overrides, settings.params_file()), force)


@flow(name="suite", flow_run_name="suite-{profile}")
def nightly(papers: list[str] | None = None, profile: str = "smoke", force: bool = False, parallel: int = 1) -> list:
    """The given papers' pipelines (default: every registered paper), all resolved before any work starts."""
    requests = [registry.request(pid, profile, None, settings.params_file()) for pid in papers or registry.paper_ids()]
    return pipeline.suite.fn(requests, force, parallel)
