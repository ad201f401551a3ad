"""Model lifecycle on MLflow's model registry: every finished run registers a version, and the alias
`champion-<profile>` moves only to a version of that profile at least as good as its current champion on the same
evaluation data.

Registered model `paperline-<id>`, one version per finished pipeline run; its source is an MLflow pyfunc model
logged into the run's `model/` artifact (flows/serving.py: the run's `outputs/`, i.e. the trained networks, records
and result files, restored on load), so `mlflow.pyfunc.load_model("models:/paperline-<id>@champion-smoke")` works.
Each version carries the run's lineage (profile, data hash, code commit) and the claim verdict as tags.

A champion per profile: aliases `champion-<profile>` and `challenger-<profile>` (test, smoke, full), so a
test-profile run (plumbing only) never takes a real profile's champion. Promotion rule (`decide`), within a profile:
- no champion yet -> champion;
- the champion was evaluated on other data (another profile, or replicates' data hashes that are not the same
  worlds, `same_worlds`) -> challenger: the primary metrics are not comparable, a person decides
  (`paperline promote <id> <version>`);
- the primary metric (`Paper.primary`, with its direction) at least as good as the champion's -> champion;
- otherwise challenger. The reason is written on the version (`promotion.reason`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlflow.exceptions import MlflowException

from models import registry
from models.registry import DEFAULT_PROFILE
from tasks import tracking

CHAMPION, CHALLENGER = "champion", "challenger"
LINEAGE_TAGS = ("paperline.profile", "paperline.data_hash", "paperline.world_size", "mlflow.source.git.commit",
                "paperline.code_ref", "claim.verdict", "claim.replicates")


def model_name(paper_id: str) -> str:
    return f"paperline-{paper_id}"


def alias(kind: str, profile: str) -> str:
    """`champion-smoke`, `challenger-test`: one champion per profile."""
    return f"{kind}-{profile}"


@dataclass(frozen=True)
class Decision:
    alias: str  # champion / challenger from `decide`; `champion-<profile>` once applied to a version
    reason: str


def decide(primary: tuple[str, str], new: dict, champion: dict | None) -> Decision:
    """`new` / `champion`: {"value": float, "data_hash": str, "profile": str}. Pure, so the rule is testable."""
    metric, direction = primary
    if champion is None:
        return Decision(CHAMPION, "first version of this paper")
    if new["profile"] != champion["profile"] or not same_worlds(new["data_hash"], champion["data_hash"]):
        return Decision(CHALLENGER, f"champion v{champion['version']} was evaluated on other data "
                                    f"({champion['profile']} {champion['data_hash'][:12]} vs {new['profile']} "
                                    f"{new['data_hash'][:12]}): not comparable, promote by hand if intended")
    a, b = new["value"], champion["value"]
    better_or_equal = a >= b if direction == "max" else a <= b
    if math.isfinite(a) and better_or_equal:
        return Decision(CHAMPION, f"{metric} {a:.6g} vs champion v{champion['version']} {b:.6g} ({direction}): "
                                  "at least as good")
    return Decision(CHALLENGER, f"{metric} {a:.6g} vs champion v{champion['version']} {b:.6g} ({direction}): worse")


def same_worlds(a: str, b: str) -> bool:
    """Whether two runs' data hashes (one per replicate, comma-separated) are the same worlds: a run with more
    replicates (`--set replicates=5`) shares the first ones with the run it extends, so their primary metrics
    compare; any other difference is other data."""
    short, long = sorted((a.split(","), b.split(",")), key=len)
    return long[: len(short)] == short


def champion(paper_id: str, profile: str = DEFAULT_PROFILE) -> dict | None:
    """The profile's current champion version as {"version", "run_id", "value", "data_hash", "profile"}, or None."""
    client = tracking.client()
    try:
        version = client.get_model_version_by_alias(model_name(paper_id), alias(CHAMPION, profile))
    except MlflowException:
        return None
    return _describe(paper_id, version)


def _describe(paper_id: str, version) -> dict:
    metric, _ = registry.get(paper_id).primary
    run = tracking.client().get_run(version.run_id)
    return {"version": str(version.version), "run_id": version.run_id, "value": run.data.metrics.get(metric, math.nan),
            "data_hash": run.data.tags.get("paperline.data_hash", ""),
            "profile": run.data.tags.get("paperline.profile", "")}


def register_and_promote(paper_id: str, run_id: str) -> tuple[str, Decision]:
    """Log the finished run's model (pyfunc), register it as a new version, then set `champion-<profile>` or
    `challenger-<profile>` on it by the rule above, against that profile's champion only."""
    from flows import serving

    client = tracking.client()
    name = model_name(paper_id)
    description = f"{registry.get(paper_id).title}\n\n{serving.predict_input(paper_id)}"
    try:
        if client.get_registered_model(name).description != description:  # registered before predict was described
            client.update_registered_model(name, description=description)
    except MlflowException:
        client.create_registered_model(name, tags={"paperline.paper": paper_id}, description=description)
    run = client.get_run(run_id)
    tags = {k: run.data.tags[k] for k in LINEAGE_TAGS if k in run.data.tags}
    profile = run.data.tags.get("paperline.profile") or DEFAULT_PROFILE
    source = serving.log_run_model(paper_id, run_id)
    version = client.create_model_version(name, source=source, run_id=run_id, tags=tags,
                                          description=serving.predict_input(paper_id))
    current = champion(paper_id, profile)
    decision = decide(registry.get(paper_id).primary, _describe(paper_id, version), current)
    return str(version.version), _apply(paper_id, version.version, decision, "pipeline", profile)


def promote(paper_id: str, version: str, reason: str = "") -> Decision:
    """Make `version` the champion of its profile by hand (`paperline promote`); recorded as such on the version."""
    client = tracking.client()
    try:
        found = client.get_model_version(model_name(paper_id), version)
    except MlflowException as e:
        raise registry.ConfigError(f"no version {version!r} of {model_name(paper_id)}: {e.message}") from None
    profile = found.tags.get("paperline.profile") or DEFAULT_PROFILE
    decision = Decision(CHAMPION, f"promoted by hand{': ' + reason if reason else ''}")
    return _apply(paper_id, version, decision, "hand", profile)


def _apply(paper_id: str, version: str, decision: Decision, by: str, profile: str) -> Decision:
    client, name = tracking.client(), model_name(paper_id)
    applied = Decision(alias(decision.alias, profile), decision.reason)
    client.set_registered_model_alias(name, applied.alias, version)
    client.set_model_version_tag(name, version, "promotion.reason", applied.reason)
    client.set_model_version_tag(name, version, "promotion.by", by)
    client.set_model_version_tag(name, version, "promotion.alias", applied.alias)
    return applied
