"""Deployments: one on-demand `paper-pipeline/<id>` per paper and the nightly `suite/nightly` on a cron schedule.

`paperline serve` runs them in this process against the Prefect API in `PREFECT_API_URL` (see infra/README.md
for starting a server). Trigger with `prefect deployment run 'paper-pipeline/sei'`.
"""

from __future__ import annotations

from prefect import serve
from prefect.client.schemas.schedules import CronSchedule

from flows.deployed import nightly, paper
from models import registry

DEFAULT_CRON = "0 2 * * *"


def deployments(cron: str = DEFAULT_CRON, timezone: str = "UTC", papers: list[str] | None = None) -> list:
    try:
        schedule = CronSchedule(cron=cron, timezone=timezone)
    except ValueError as e:
        raise registry.ConfigError(f"cron schedule {cron!r} / timezone {timezone!r} does not parse "
                                   f"(expected e.g. '0 2 * * *' and 'Europe/Paris'): {e}") from None
    ids = papers or registry.paper_ids()
    for pid in ids:
        registry.get(pid)
    on_demand = [paper.to_deployment(name=pid, parameters={"paper": pid, "profile": "smoke"},
                                     tags=["paperline", pid]) for pid in ids]
    scheduled = nightly.to_deployment(name="nightly", schedule=schedule,
                                      parameters={"papers": ids, "profile": "smoke"}, tags=["paperline", "nightly"])
    return [*on_demand, scheduled]


def ensure_paper_limits(papers: list[str]) -> None:
    """One slot per paper: overlapping schedules (nightly + on-demand) never run the same paper twice at once."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        for pid in papers:
            client.upsert_global_concurrency_limit_by_name(f"paper-{pid}", 1)


def serve_all(cron: str = DEFAULT_CRON, timezone: str = "UTC", papers: list[str] | None = None) -> None:
    ensure_paper_limits(papers or registry.paper_ids())
    serve(*deployments(cron, timezone, papers), pause_on_shutdown=False)
