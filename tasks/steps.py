"""The Prefect tasks of a paper pipeline: prepare (DVC), train (DeepSpeed job), evaluate, per replicate; and
`conclude`, which decides the claim over the replicates and logs it to the pipeline's parent run.

The prepare task is never cached by Prefect (stale results, see STACK-NOTES): DVC's own no-op check decides.
Train retries once on a transient fault and resumes from its checkpoint; evaluate is a pure function of the train
outputs and the data, so it simply reruns.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from prefect import task

from models.common.threads import torch_threads
from models.contract import ClaimResult, Paper, PaperParams
from models.registry import RunRequest
from tasks import data, evaluators, quiet, replicates, tracking
from tasks.context import FIT_METRICS, EvalContext
from tasks.train import TrainJob, launch

QUIET_FILE = "quiet.json"  # a training that took timed samples: how long it waited for a quiet machine
METRICS_FILE = "metrics.json"  # a replicate's metrics: what evaluate() returned and what fit measured (plateaus)


@task(name="prepare", retries=1, retry_delay_seconds=2)
def prepare_task(paper: Paper, request: RunRequest, index: int, force: bool = False) -> data.PreparedData:
    """Replicate `index`'s data: its own DVC stage (a synthetic world drawn with seed + index; a fixed dataset
    that ignores the seed comes out with the same hash and is shared through the DVC cache)."""
    rep = request.replicate(index)
    stage = data.stage_for(paper, request.profile, rep.params, rep.raw, rep.is_default)
    with quiet.busy():  # a stage that runs loads the machine: a timing elsewhere waits for it
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
                  run_id: str | None) -> dict[str, float]:
    return evaluate(paper, params, data_dir, out_dir, run_id)


# an evaluation in the flow's process, where torch's thread count and pyplot's figures are process-wide, runs alone
# (a suite of papers side by side evaluates in evaluator processes instead: tasks/evaluators.py)
_EVALUATING = threading.Lock()


def single_threaded_blas() -> None:
    """NumPy's OpenBLAS in this (the flow's) process on one thread, as evaluations run their torch ops
    (`eval_threads`): with its default thread server a suite's evaluation hung for 20 minutes in exec_blas, spinning
    on a worker thread that slept in a futex (spectral_schedule's scikit-learn MLP, 29 papers into a `--parallel 2`
    suite). Set once, at import, before any thread of the flow calls BLAS (changing it while a call runs is unsafe)."""
    import numpy  # noqa: F401 - loads the BLAS library that threadpoolctl limits
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


single_threaded_blas()


def evaluate(paper: Paper, params: PaperParams, data_dir: Path, out_dir: Path,
             run_id: str | None) -> dict[str, float]:
    """Run the paper's evaluation of one replicate and add what its training loop measured (`fit_metrics`); with a
    run id, log the metrics, plots and outputs there. A paper with timed parts times its loops on a quiet machine
    (`ctx.timing()`, tasks/quiet.py) and records the load they were timed at and how long they waited for it. In a
    suite of papers side by side, the paper's `evaluate` runs in an evaluator process (tasks/evaluators.py)."""
    try:
        metrics, timed = evaluators.submit(paper.id, params, data_dir, out_dir)
    except evaluators.NoEvaluator:  # a single paper's run, or the suite's evaluators died (an out-of-memory kill)
        with _EVALUATING:
            metrics, shift = paper_metrics(paper, params, data_dir, out_dir)
        timed = shift.metrics()
    plots_dir = out_dir / "plots"
    # what the timings waited and the load they ran at; none where this evaluation timed nothing (a re-evaluation
    # that reads the timings its replicate kept: tests/test_papers.py checks that a first evaluation times)
    metrics |= timed
    metrics = {**fit_metrics(out_dir), **quiet_metrics(out_dir), **metrics}
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{paper.id}.evaluate returned non-finite metrics: {bad}")
    paper.claim.evaluate(metrics)  # every metric the claim names is there (KeyError naming the missing ones)
    (out_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=1, sort_keys=True))
    if run_id:
        _log(run_id, metrics, {}, out_dir, plots_dir)
    return metrics


def paper_metrics(paper: Paper, params: PaperParams, data_dir: Path,
                  out_dir: Path) -> tuple[dict[str, float], quiet.Shift]:
    """The paper's own `evaluate` of one replicate (plots into out_dir/plots), busy beside other work except in its
    timing loops; its metrics as floats, and the Shift that counted its timings."""
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    with quiet.Shift() as shift:
        ctx = EvalContext(params=params, data_dir=data_dir, out_dir=out_dir, plots_dir=plots_dir,
                          label=f"{paper.id} evaluate", shift=shift)
        with torch_threads(paper.eval_threads):
            metrics = {k: float(v) for k, v in paper.evaluate(ctx).items()}
    return metrics, shift


@contextlib.contextmanager
def training_hold(paper: Paper, out_dir: Path):
    """Around a replicate's training: `busy()`, or for a paper that takes its timed samples in training
    (`times_training`) `quiet()`, whose wait and load go to `QUIET_FILE` for the evaluation to record."""
    if not paper.times_training:
        with quiet.busy():
            yield
        return
    with quiet.quiet() as waited:
        yield
        load = quiet.load_1m()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / QUIET_FILE).write_text(json.dumps({**waited, quiet.LOAD_METRIC: load}))


def quiet_metrics(out_dir: Path) -> dict[str, float]:
    """The wait and load of a training that took the timed samples (`training_hold`); {} for any other."""
    path = out_dir / QUIET_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def fit_metrics(out_dir: Path) -> dict[str, float]:
    """What the training loop measured per phase (`train/<phase>/plateau`, `timing/train/<phase>/steps_per_s`), so
    a premise can read it."""
    path = out_dir / FIT_METRICS
    return json.loads(path.read_text()) if path.exists() else {}


def recorded_metrics(run, out_dir: Path) -> dict[str, float]:
    """A finished replicate's evaluation metrics, bitwise as evaluate() returned them: from its run folder, or
    from the run's artifacts when the folder is gone."""
    path = out_dir / METRICS_FILE
    if not path.exists():
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tracking.client().download_artifacts(run.info.run_id, f"outputs/{METRICS_FILE}", tmp))
            return json.loads(path.read_text())
    return json.loads(path.read_text())


def conclude(paper: Paper, run_id: str | None, per_replicate: Sequence[dict[str, float]], out_dir: Path,
             first_replicate_dir: Path, premises_only: bool = False) -> ClaimResult:
    """Decide the claim over the replicates; write `claim.json` and the forest plot; with a run id, log the
    aggregated metrics, the claim and replicate 0's outputs and plots (the registered model's source) there.
    `premises_only`: the premises alone, blind to the claim: only the premises' metrics are aggregated, and the
    result is tagged `premises.*` (never `claim.*`, which champions, the scoreboard and listings read)."""
    if premises_only:
        claim = paper.claim.decide_premises(per_replicate, machine=replicates.machine_name())
        shown = paper.claim.premise_names() | {quiet.LOAD_METRIC}
        per_replicate = [{k: v for k, v in m.items() if k in shown} for m in per_replicate]
    else:
        claim = paper.claim.decide(per_replicate, machine=replicates.machine_name())
    plots_dir = out_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "claim.json").write_text(json.dumps(claim.to_dict(), indent=1))
    replicates.forest_plot(claim, plots_dir / "forest.png", paper.id)
    if run_id:
        from mlflow.entities import RunTag

        prefix = "premises" if premises_only else "claim"
        metrics = {**replicates.aggregate(per_replicate), **replicates.claim_metrics(claim, prefix)}
        tags = [RunTag(f"{prefix}.verdict", claim.verdict), RunTag(f"{prefix}.text", claim.text[:5000]),
                RunTag(f"{prefix}.reason", claim.reason[:5000]), RunTag(f"{prefix}.numbers", claim.numbers[:5000]),
                RunTag(f"{prefix}.replicates", str(claim.replicates))]
        client = tracking.client()
        if premises_only:  # replicate 0's own metrics and outputs would show the deciding parts: they stay there
            _log(run_id, metrics, tags, out_dir, plots_dir)
        else:
            _log(run_id, metrics, tags, first_replicate_dir, first_replicate_dir / "plots")
            client.log_artifacts(run_id, str(plots_dir), "plots")
        client.log_artifact(run_id, str(out_dir / "claim.json"), "outputs")
    return claim


def _log(run_id: str, metrics: dict[str, float], tags: list, out_dir: Path, plots_dir: Path) -> None:
    from mlflow.entities import Metric

    c = tracking.client()
    now = int(time.time() * 1000)
    entries = [Metric(k, v, now, 0) for k, v in metrics.items()]
    for i in range(0, len(entries), 900):
        c.log_batch(run_id, metrics=entries[i : i + 900])
    if tags:
        c.log_batch(run_id, tags=tags)
    if plots_dir.is_dir():
        c.log_artifacts(run_id, str(plots_dir), "plots")
    for path in sorted(out_dir.iterdir()) if out_dir.is_dir() else ():  # a stored replicate's folder may be gone
        if path.is_file() and path.name not in {"worker_spec.json"}:
            c.log_artifact(run_id, str(path), "outputs")
