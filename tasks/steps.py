"""The Prefect tasks of a paper pipeline: prepare (DVC), train (DeepSpeed job), evaluate (+ claim, plots, MLflow).

The prepare task is never cached by Prefect (stale results, see STACK-NOTES): DVC's own no-op check decides.
Train retries once on a transient fault and resumes from its checkpoint; evaluate is a pure function of the train
outputs and the data, so it simply reruns.
"""

from __future__ import annotations

import errno
import json
import math
import os
import threading
from pathlib import Path

from prefect import task

from models.common.threads import torch_threads
from models.contract import ClaimResult, Paper, PaperParams
from tasks import data, tracking
from tasks.context import EvalContext
from tasks.train import TrainJob, launch


@task(name="prepare", retries=1, retry_delay_seconds=2)
def prepare_task(paper: Paper, profile: str, params: PaperParams, raw_params: dict, is_default: bool,
                 force: bool = False) -> data.PreparedData:
    stage = data.stage_for(paper, profile, params, raw_params, is_default)
    return data.reproduce(stage, force=force)


def _worth_retrying(task, task_run, state) -> bool:
    """A killed rank or a lost connection may not happen twice; a full disk will."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - the failure being judged
        return os.strerror(errno.ENOSPC) not in str(exc)
    return True


@task(name="train", retries=1, retry_delay_seconds=2, retry_condition_fn=_worth_retrying)
def train_task(job: TrainJob) -> Path:
    launch(job)
    return job.out_dir


@task(name="evaluate")
def evaluate_task(paper: Paper, params: PaperParams, data_dir: Path, out_dir: Path,
                  run_id: str | None) -> tuple[dict[str, float], ClaimResult]:
    return evaluate(paper, params, data_dir, out_dir, run_id)


# evaluate runs inside the flow's process, where torch's thread count and pyplot's figures are process-wide: papers
# that a suite runs side by side (`--parallel`) evaluate one at a time
_EVALUATING = threading.Lock()


def evaluate(paper: Paper, params: PaperParams, data_dir: Path, out_dir: Path,
             run_id: str | None) -> tuple[dict[str, float], ClaimResult]:
    """Run the paper's evaluation, compute its claim, and (with a run id) log everything to that MLflow run."""
    with _EVALUATING:
        return _evaluate(paper, params, data_dir, out_dir, run_id)


def _evaluate(paper: Paper, params: PaperParams, data_dir: Path, out_dir: Path,
              run_id: str | None) -> tuple[dict[str, float], ClaimResult]:
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    ctx = EvalContext(params=params, data_dir=data_dir, out_dir=out_dir, plots_dir=plots_dir,
                      label=f"{paper.id} evaluate")
    with torch_threads(paper.eval_threads):
        metrics = {k: float(v) for k, v in paper.evaluate(ctx).items()}
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{paper.id}.evaluate returned non-finite metrics: {bad}")
    claim = paper.claim.evaluate(metrics)
    (out_dir / "claim.json").write_text(json.dumps({"holds": claim.holds, "text": claim.text,
                                                    "numbers": claim.numbers}, indent=1))
    if run_id:
        _log_evaluation(run_id, metrics, claim, out_dir, plots_dir)
    return metrics, claim


def _log_evaluation(run_id: str, metrics: dict[str, float], claim: ClaimResult, out_dir: Path,
                    plots_dir: Path) -> None:
    import time

    from mlflow.entities import Metric, RunTag

    c = tracking.client()
    now = int(time.time() * 1000)
    entries = [Metric(k, v, now, 0) for k, v in metrics.items()] + [Metric("claim/holds", float(claim.holds), now, 0)]
    for i in range(0, len(entries), 900):
        c.log_batch(run_id, metrics=entries[i : i + 900])
    c.log_batch(run_id, tags=[RunTag("claim.holds", str(claim.holds).lower()), RunTag("claim.text", claim.text),
                              RunTag("claim.numbers", claim.numbers[:5000])])
    c.log_artifacts(run_id, str(plots_dir), "plots")
    for path in sorted(out_dir.iterdir()):
        if path.is_file() and path.name not in {"worker_spec.json"}:
            c.log_artifact(run_id, str(path), "outputs")
