"""The Prefect flows: `paper_pipeline` (prepare -> train -> evaluate -> claim, one MLflow run) and `suite`."""

from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from tasks.settings import configure_environment

configure_environment()

from mlflow.entities import Param, RunStatus, RunTag  # noqa: E402
from prefect import flow, get_run_logger, runtime, task  # noqa: E402
from prefect.concurrency.sync import concurrency  # noqa: E402

from flows import lifecycle, morning  # noqa: E402
from flows.cache import PipelineResult, is_default_run  # noqa: E402
from models import registry  # noqa: E402
from models.contract import PaperParams  # noqa: E402
from tasks import settings, tracking, train  # noqa: E402
from tasks.context import send_pending  # noqa: E402
from tasks.steps import evaluate_task, prepare_task, train_task  # noqa: E402
from tasks.train import TrainJob  # noqa: E402


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# set by `suite` for the papers it runs: called when a paper's training ends, to warm up the next paper's ranks
_after_training: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("after_training",
                                                                                         default=None)


@flow(name="paper-pipeline", log_prints=False)
def paper_pipeline(paper: str, profile: str = "smoke", overrides: dict[str, Any] | None = None,
                   force: bool = False) -> dict:
    """One paper end to end. Reuses the earlier MLflow run when code, params and data are unchanged (unless force).

    Runs of one paper never overlap: they hold the Prefect global concurrency limit `paper-<id>` (1 slot), which
    `paperline serve` creates; without it (the temporary local API) the guard is a no-op."""
    start = time.perf_counter()
    spec = registry.get(paper)
    overrides = registry.parse_overrides(overrides)
    params = registry.resolve(paper, profile, overrides, settings.params_file())
    train.prestart(paper, params)  # the ranks warm up while the data is checked and the MLflow run opens
    try:
        tracking.check_reachable()
        with concurrency(f"paper-{paper}", occupy=1, strict=False):
            return _run(spec, profile, overrides, params, force, start)
    finally:
        train.cancel_prestarted(paper)  # unclaimed when the run was reused or failed before training


def _run(spec, profile: str, overrides: dict[str, Any], params, force: bool, start: float) -> dict:
    paper = spec.id
    is_default = is_default_run(profile, overrides)
    raw = registry.raw_params(paper, profile, overrides, settings.params_file())

    _say(f"[{paper}] prepare: DVC stage {'prepare@' + paper if is_default else profile + ' variant'}")
    prepared = prepare_task(spec, profile, params, raw, is_default, force=False)
    _say(f"[{paper}] data {prepared.data_hash} ({'prepared' if prepared.ran else 'up to date'}, "
         f"{prepared.seconds:.1f}s)")

    exp_id = tracking.experiment_id(paper)
    tracking.mark_orphans_killed(exp_id)
    resolved = params.model_dump(mode="json")
    key = tracking.run_key(paper, profile, raw, prepared.data_hash)
    cached = None if force else tracking.find_cached(exp_id, key)
    if cached is not None:
        result = PipelineResult.reused_run(cached, paper, profile, prepared.data_hash, start)
        tracking.mark_reused(cached.info.run_id)
        _say(f"[{paper}] unchanged code, params and data: reusing run {cached.info.run_id} (use --force to retrain)")
        print(result.claim_line(), flush=True)
        return asdict(result)

    client = tracking.client()
    tags = {
        "paperline.paper": paper, "paperline.profile": profile, "paperline.cache_key": key,
        "paperline.data_hash": prepared.data_hash, "paperline.data_stage": prepared.stage.target,
        "paperline.world_size": str(params.ranks), "paperline.pid": str(os.getpid()),
        "paperline.overrides": ",".join(f"{k}={v}" for k, v in overrides.items()),
        "mlflow.source.git.commit": tracking.git_commit(),
        "prefect.flow_run_id": str(runtime.flow_run.id or ""),
        "mlflow.runName": f"{paper}-{profile}",
    }
    resumable = None if force else tracking.find_resumable(exp_id, key)
    if resumable is not None:  # a killed or failed run of the same work: continue it, lose nothing
        run_id = resumable.info.run_id
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "paperline.pid", str(os.getpid()))
        client.set_tag(run_id, "paperline.resumed_by_flow_run", str(runtime.flow_run.id or ""))
        _say(f"[{paper}] continuing interrupted run {run_id} from its checkpoints")
    else:
        if os.environ.get("PAPERLINE_REPRODUCES"):  # set by `paperline reproduce` for the rerun it starts
            tags["paperline.reproduces"] = os.environ["PAPERLINE_REPRODUCES"]
        run_id = client.create_run(exp_id, run_name=f"{paper}-{profile}", tags=tags).info.run_id
        client.log_batch(run_id, params=[Param(k, v[:6000]) for k, v in tracking.flatten(resolved).items()],
                         tags=[RunTag("paperline.claim.spec", spec.claim.text()[:5000]),
                               RunTag("paperline.code_ref", tracking.pin_code(run_id))])
        # the lineage `paperline reproduce` replays: the params as given, exactly (MLflow params are strings)
        client.log_dict(run_id, {"paper": paper, "profile": profile, "overrides": overrides, "raw_params": raw,
                                 "params": resolved, "data_hash": prepared.data_hash}, "inputs/run_inputs.json")
    try:
        out_dir = settings.runs_dir() / paper / run_id
        _say(f"[{paper}] train: {params.ranks} DeepSpeed rank(s), MLflow run {run_id}")
        job = TrainJob(paper, params, prepared.stage.out_dir, out_dir, run_id, settings.tracking_uri())
        t_train = time.perf_counter()
        train_task(job)
        if (next_up := _after_training.get()) is not None:
            next_up()
        sent = send_pending(client, run_id, out_dir)  # what the ranks could not send while tracking was down
        if sent:
            _say(f"[{paper}] sent {sent} metrics held back while the tracking server was unreachable")
        t_eval = time.perf_counter()
        _say(f"[{paper}] evaluate: method and baselines")
        _, claim = evaluate_task(spec, params, prepared.stage.out_dir, out_dir, run_id)
        now = time.perf_counter()
        for name, seconds in (("prepare", prepared.seconds), ("train", t_eval - t_train),
                              ("evaluate", now - t_eval), ("total", now - start)):
            client.log_metric(run_id, f"time/{name}_s", seconds, step=0)
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
        promote_task(paper, run_id)
    except BaseException:
        try:
            client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        except Exception:  # noqa: BLE001 - tracking itself is down: the next start marks the run KILLED
            _say(f"[{paper}] could not mark run {run_id} FAILED (tracking unreachable); checkpoints kept in "
                 f"{settings.runs_dir() / paper / run_id}, a rerun continues from them")
        raise
    result = PipelineResult(paper, profile, run_id, False, claim.holds, claim.text, claim.numbers,
                            prepared.data_hash, time.perf_counter() - start)
    try:
        get_run_logger().info("claim %s holds=%s", paper, claim.holds)
    except Exception:  # noqa: BLE001 - logging outside a run context is optional
        pass
    print(result.claim_line(), flush=True)
    return asdict(result)


@task(name="promote")
def promote_task(paper: str, run_id: str) -> None:
    """Register the run's model version; `champion` moves to it only if it is at least as good (flows/lifecycle)."""
    version, decision = lifecycle.register_and_promote(paper, run_id)
    tracking.client().set_tag(run_id, "paperline.model_version", f"{lifecycle.model_name(paper)}/{version}")
    _say(f"[{paper}] model {lifecycle.model_name(paper)} v{version}: {decision.alias} ({decision.reason})")


@flow(name="suite")
def suite(papers: list[str] | None = None, profile: str = "smoke", force: bool = False,
          parallel: int = 1) -> list[dict]:
    """Every given paper (default: all registered); one paper's failure is reported, not fatal.

    `parallel` papers run side by side (threads of this process; training is a subprocess per paper, evaluation
    one paper at a time): one paper's single-threaded stretches (prepare, evaluate, start-up) then use the cores
    another paper's training leaves idle (benchmarks/README.md, suite)."""
    started = time.time()
    ids = papers or registry.paper_ids()
    if parallel < 1:
        raise registry.ConfigError(f"parallel: must be at least 1, got {parallel}")
    # validate every id and profile before any work
    upcoming = _Upcoming({pid: registry.resolve(pid, profile, None, settings.params_file()) for pid in ids})
    token = _after_training.set(upcoming.prestart_next)  # the papers' contexts are copies holding it
    calls = [(f"[{i}/{len(ids)}] {pid}", pid, profile, _in_context(pid, profile, force, upcoming))
             for i, pid in enumerate(ids, 1)]
    _after_training.reset(token)
    if parallel == 1:
        results = [_one(*call) for call in calls]
    else:
        with ThreadPoolExecutor(parallel, thread_name_prefix="suite") as pool:
            results = list(pool.map(lambda call: _one(*call), calls))
    # the report covers this suite run: what it retrained, skipped or lost
    window = time.time() - started + 1
    md, _ = morning.write(morning.morning(window, profile), f"{window / 60:.0f} min (this suite run)",
                          stem=f"morning-{time.strftime('%Y-%m-%d')}")
    _say(f"morning report: {md}")
    return results


class _Upcoming:
    """The suite's papers not started yet, in order. When one paper's training ends, the next paper's ranks are
    prestarted: they import and join their process group while this paper evaluates on one thread."""

    def __init__(self, params: dict[str, PaperParams]):
        self._params, self._lock = dict(params), threading.Lock()  # insertion order: the suite's order

    def start(self, pid: str) -> None:
        with self._lock:
            del self._params[pid]

    def prestart_next(self) -> None:
        with self._lock:  # held while it starts, so the next paper cannot start (and miss it) in between
            if self._params:
                train.prestart(*next(iter(self._params.items())))


def _in_context(pid: str, profile: str, force: bool, upcoming: _Upcoming):
    """The paper's pipeline as a subflow of this suite run, callable from any thread (Prefect's run context lives
    in context variables, which a worker thread does not inherit)."""
    context = contextvars.copy_context()

    def run() -> dict:
        upcoming.start(pid)
        return context.run(paper_pipeline, pid, profile, None, force)

    return run


def _one(title: str, pid: str, profile: str, run) -> dict:
    _say(f"=== {title} ({profile}) ===")
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - report and continue with the next paper
        _say(f"[{pid}] FAILED: {type(e).__name__}: {e}")
        return {"paper": pid, "profile": profile, "error": f"{type(e).__name__}: {e}"}


def run_papers(ids: list[str], profile: str, overrides: Mapping[str, Any] | None, force: bool,
               parallel: int = 1) -> list[dict]:
    """CLI entry: one flow run per paper, or the suite flow for several."""
    if len(ids) == 1:
        return [paper_pipeline(ids[0], profile, dict(overrides or {}), force)]
    if overrides:
        raise registry.ConfigError("--set applies to one paper at a time")
    return suite(ids, profile, force, parallel)
