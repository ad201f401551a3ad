"""The Prefect flows: `paper_pipeline` (prepare -> train -> evaluate -> claim, one MLflow run) and `suite`."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from tasks.settings import configure_environment

configure_environment()

from mlflow.entities import Metric, Param, RunStatus, RunTag  # noqa: E402
from prefect import flow, runtime, task  # noqa: E402
from prefect.concurrency.sync import concurrency  # noqa: E402

from flows import lifecycle, morning  # noqa: E402
from flows.cache import PipelineResult  # noqa: E402
from flows.launch import UPCOMING, Launcher, Upcoming  # noqa: E402
from flows.report import ui_url  # noqa: E402
from models import registry  # noqa: E402
from models.contract import PaperParams  # noqa: E402, F401 (Prefect resolves RunRequest.params here)
from models.registry import RunRequest  # noqa: E402
from tasks import evaluators, keys, ledger, settings, tracking, train  # noqa: E402
from tasks.context import send_pending  # noqa: E402
from tasks.steps import (  # noqa: E402
    conclude,
    evaluate_task,
    prepare_task,
    recorded_metrics,
    train_task,
    training_hold,
)
from tasks.threadcpu import WorkCPU  # noqa: E402
from tasks.train import TrainJob  # noqa: E402
from tasks.worker import ranks_cpu_seconds  # noqa: E402


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    to_flow_run_log(message)


def to_flow_run_log(message: str) -> None:
    """A line of paperline's own (claim, stage summaries) into the current Prefect flow run's logs at INFO, shown in
    its Logs tab. Prefect's loggers stay at PREFECT_LOGGING_LEVEL (WARNING: its engine and the tools it wraps stay
    quiet); this logger has only the API handler, so the console gets the line once, from the print."""
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return  # not in a flow run: nothing to attach the line to
    _run_logger().info(message)


@functools.cache
def _run_logger() -> logging.Logger:
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger("paperline.flow_run")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(APILogHandler())
    return logger


def run_label(paper: str, profile: str, overrides: dict[str, Any] | None) -> str:
    """`sei-smoke`, or with overrides `sei-smoke epochs=5,eta=0.3`: the MLflow run's and the Prefect flow run's
    name, so runs of different overrides tell apart in both UIs."""
    label = f"{paper}-{profile}"
    if overrides:
        label += " " + ",".join(f"{k}={v}" for k, v in overrides.items())
    return label if len(label) <= 120 else label[:119] + "…"


def _flow_run_name() -> str:
    """`sei-smoke`: from the request (the CLI, the suite) or the names a deployment passes (flows/deployed.py)."""
    parameters = runtime.flow_run.parameters
    request = parameters.get("request")
    if isinstance(request, RunRequest):
        return run_label(request.paper, request.profile, request.overrides)
    if isinstance(request, dict):  # the request as Prefect stored it
        return run_label(request.get("paper", "?"), request.get("profile", "?"), request.get("overrides"))
    return run_label(parameters.get("paper", "?"), parameters.get("profile", "smoke"), parameters.get("overrides"))


@flow(name="paper-pipeline", flow_run_name=_flow_run_name, log_prints=False)
def paper_pipeline(request: RunRequest, force: bool = False) -> dict:
    """One paper end to end: every replicate prepared, trained and evaluated, then the claim decided over them.
    Reuses the earlier MLflow run when code, params and data are unchanged (unless force); a run that was killed
    continues at the replicate it lost. `request`: resolved by the caller (`registry.ask(...).resolve()`: the CLI,
    the suite, a deployment's names in flows/deployed.py).

    Runs of one paper never overlap: they hold the Prefect global concurrency limit `paper-<id>` (1 slot), which
    `paperline serve` creates; without it (the temporary local API) there is nothing to hold."""
    start = time.perf_counter()
    spec = registry.get(request.paper)
    with Launcher(request, spec.claim.timed and not spec.times_training) as launch:
        tracking.check_reachable()
        with _one_run_per_paper(request.paper):
            return _run(request, force, start, launch)


def _one_run_per_paper(paper: str):
    """The paper's concurrency slot where `serve` created one; nothing to hold otherwise (asking for a limit that
    does not exist only makes Prefect warn)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as prefect_client:
            prefect_client.read_global_concurrency_limit_by_name(f"paper-{paper}")
    except Exception:  # noqa: BLE001 - ObjectNotFound: no limit on this API
        return contextlib.nullcontext()
    return concurrency(f"paper-{paper}", occupy=1, strict=False)


def _run(request: RunRequest, force: bool, start: float, launch: Launcher) -> dict:
    """The pipeline's four steps: prepare every replicate's data, read the ledger (what MLflow already holds),
    train and evaluate what it leaves to do, conclude over all replicates."""
    prepared = _prepare(request)
    exp_id = tracking.experiment_id(request.paper)
    tracking.mark_orphans_killed(exp_id)
    book = ledger.read(request, [p.data_hash for p in prepared], exp_id, force)
    if book.cached is not None:
        return _reuse(request, book.cached, prepared, exp_id, start)
    _say_stored(request, book)
    if book.trains_nothing:
        launch.nothing_to_train()
    run_id = _open_run(request, exp_id, book, prepared, force)
    with _failing(run_id, request.paper):
        done = _train_and_evaluate(request, prepared, book, run_id, exp_id, launch)
        claim = _conclude(request, prepared, done, run_id, start)
    result = PipelineResult(request.paper, request.profile, run_id, False, claim.verdict, claim.text, claim.numbers,
                            claim.reason, claim.replicates, _data_hash(prepared), time.perf_counter() - start,
                            request.premises_only, book.trained)
    return _publish(result, exp_id)


def _prepare(request: RunRequest) -> list:
    """Every replicate's DVC data stage, brought up to date."""
    paper, count = request.paper, request.replicates
    where = f"DVC stage {'prepare@' + paper if request.is_default else request.profile + ' variant'}"
    _say(f"[{paper}] prepare: {where}" + (f" and {count - 1} replicate variant(s)" if count > 1 else ""))
    spec = registry.get(paper)
    prepared = [prepare_task.with_options(task_run_name=f"prepare {paper} r{i}")(spec, request, i)
                for i in range(count)]
    ran = sum(p.ran for p in prepared)
    _say(f"[{paper}] data {_short(_data_hash(prepared))} ({f'{ran} prepared' if ran else 'up to date'}, "
         f"{sum(p.seconds for p in prepared):.1f}s)")
    return prepared


def _data_hash(prepared) -> str:
    return ",".join(p.data_hash for p in prepared)


def _reuse(request: RunRequest, cached, prepared, exp_id: str, start: float) -> dict:
    tracking.mark_reused(cached.info.run_id)
    _say(f"[{request.paper}] unchanged code, params and data: reusing run {cached.info.run_id} "
         "(use --force to retrain)")
    return _publish(PipelineResult.reused_run(cached.info.run_id, cached.data.tags, request.paper, request.profile,
                                              _data_hash(prepared), start), exp_id)


def _say_stored(request: RunRequest, book: ledger.Ledger) -> None:
    reused, count, paper = book.reused, request.replicates, request.paper
    if len(reused) == count:
        _say(f"[{paper}] all {count} replicates trained earlier with this code, params, data and seeds: deciding "
             "from their stored metrics (no training)")
    elif reused:
        missing = [f"r{e.index}" for e in book.replicates if e.action != "reuse"]
        _say(f"[{paper}] {len(reused)} of {count} replicates trained earlier: training the {len(missing)} missing "
             f"({', '.join(missing)}) and deciding over all {count}")


def _train_and_evaluate(request: RunRequest, prepared, book: ledger.Ledger, run_id: str, exp_id: str,
                        launch: Launcher) -> list:
    """Every replicate as the ledger says; each evaluation runs on the launcher's evaluator thread while the next
    replicate trains (not where the paper's timed parts need a quiet machine: tasks/quiet.py)."""
    spec = registry.get(request.paper)
    _say(f"[{request.paper}] MLflow run {tracking.ui_link(ui_url(), exp_id, run_id)}")
    _say(f"[{request.paper}] Prefect flow run {prefect_link()}")
    pending = [_replicate(spec, request, entry, prepared[entry.index], run_id, exp_id, launch,
                          trains_later=book.trains_after(entry.index)) for entry in book.replicates]
    done = [future.result() for future in pending]
    tracking.client().set_tag(run_id, "paperline.replicate_runs", ",".join(d.run_id for d in done))
    return done


def _conclude(request: RunRequest, prepared, done: list, run_id: str, start: float):
    """The claim decided over all replicates, the run's stage times and CPU budget, its model version."""
    paper, client = request.paper, tracking.client()
    t_conclude = time.perf_counter()
    runs = settings.runs_dir() / paper
    claim = conclude(registry.get(paper), run_id, [d.metrics for d in done], runs / run_id, runs / done[0].run_id,
                     request.premises_only)
    now = time.perf_counter()
    for name, seconds in (("prepare", sum(p.seconds for p in prepared)), ("replicates", sum(d.seconds for d in done)),
                          ("conclude", now - t_conclude), ("total", now - start)):
        client.log_metric(run_id, f"time/{name}_s", seconds, step=0)
    measured = [d.cpu_s for d in done if d.cpu_s is not None]
    if measured:  # the budget a paper issue sizes its profile by (smoke: <= 120 a replicate)
        client.log_metric(run_id, "cpu/replicate_mean_s", sum(measured) / len(measured), step=0)
        client.log_metric(run_id, "cpu/replicate_max_s", max(measured), step=0)
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    if not request.premises_only:  # a premises-only run never becomes a model version, let alone champion
        promote_task(paper, run_id)
    return claim


def _publish(result: PipelineResult, exp_id: str) -> dict:
    """The claim line on the console and in the flow run's log, and the verdict as a Prefect artifact."""
    print(result.claim_line(), flush=True)
    to_flow_run_log(result.claim_line())
    publish_artifact(result, exp_id)
    return asdict(result)


def prefect_link() -> str:
    """The current flow run in Prefect's UI. The temporary local API has no UI; its runs are in the project's
    Prefect database, which `paperline server` serves (port 4200 by default)."""
    from prefect.settings import PREFECT_UI_URL

    from flows import local_api

    flow_run_id = runtime.flow_run.id or ""
    if local_api.started():
        return f"http://127.0.0.1:4200/runs/flow-run/{flow_run_id} (once `paperline server` runs)"
    base = PREFECT_UI_URL.value() or "http://127.0.0.1:4200"
    return f"{base.rstrip('/')}/runs/flow-run/{flow_run_id}"


def publish_artifact(result: PipelineResult, exp_id: str) -> None:
    """The run's verdict as a Prefect markdown artifact (the flow run's Artifacts tab, and by key across runs): the
    claim, each part's effect and interval, and the MLflow run."""
    from prefect.artifacts import create_markdown_artifact

    url = tracking.ui_link(ui_url(), exp_id, result.run_id)
    kind = "premises" if result.premises_only else "claim"  # a premises-only run shows no verdict of the claim
    verdict = result.verdict + (f": {result.reason}" if result.reason else "")
    parts = "\n".join(f"- `{line.strip()}`" for line in result.claim_numbers.splitlines())
    markdown = (f"## {result.paper} ({result.profile}) {kind}: {verdict}\n\n`{result.claim_text}`\n\n{parts}\n\n"
                f"{result.replicates} replicate(s){', reused an earlier run' if result.reused else ''}. "
                f"MLflow run: [{result.run_id}]({url})\n")
    key = f"{kind}-{result.paper}-{result.profile}".replace("_", "-")
    try:
        create_markdown_artifact(markdown, key=key, description=f"{result.paper}: {result.verdict}")
    except Exception as e:  # noqa: BLE001 - the artifact describes the run; its failure must not fail it
        _say(f"[{result.paper}] no Prefect artifact: {type(e).__name__}: {e}")


def _short(data_hash: str) -> str:
    hashes = data_hash.split(",")
    return hashes[0] if len(hashes) == 1 else f"{hashes[0][:12]} +{len(hashes) - 1}"


def _open_run(request: RunRequest, exp_id: str, book: ledger.Ledger, prepared, force: bool) -> str:
    """The pipeline's parent run: the ledger's resumable run continues (its finished replicates are kept),
    otherwise a new one with the lineage `paperline reproduce` replays. Either way it is tagged with where its
    replicates come from (`_tag_lineage`)."""
    paper, profile, client = request.paper, request.profile, tracking.client()
    key, data_hash = book.key, _data_hash(prepared)
    if book.resumable is not None:
        run_id = book.resumable.info.run_id
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "paperline.pid", str(os.getpid()))
        client.set_tag(run_id, "paperline.resumed_by_flow_run", str(runtime.flow_run.id or ""))
        _say(f"[{paper}] continuing interrupted run {run_id}: finished replicates are kept")
        _tag_lineage(run_id, request, book)
        return run_id
    tags = {
        "paperline.paper": paper, "paperline.profile": profile, "paperline.cache_key": key,
        "paperline.kind": "pipeline", "paperline.replicates": str(request.replicates),
        "paperline.data_hash": data_hash, "paperline.data_stage": prepared[0].stage.target,
        "paperline.world_size": str(request.params.ranks), "paperline.pid": str(os.getpid()),
        # results move with torch's thread count (float reduction order): `paperline reproduce` replays it
        "paperline.threads_per_rank": str(train.threads_per_rank(request.params)),
        "paperline.overrides": ",".join(f"{k}={v}" for k, v in request.overrides.items()),
        "mlflow.source.git.commit": (commit := tracking.git_commit()),
        "prefect.flow_run_id": str(runtime.flow_run.id or ""),
        "mlflow.runName": run_label(paper, profile, request.overrides),
        **lineage_tags(request, force, commit),
    }
    if os.environ.get("PAPERLINE_REPRODUCES"):  # set by `paperline reproduce` for the rerun it starts
        tags["paperline.reproduces"] = os.environ["PAPERLINE_REPRODUCES"]
    run_id = client.create_run(exp_id, run_name=tags["mlflow.runName"], tags=tags).info.run_id
    resolved = request.params.model_dump(mode="json")
    client.log_batch(run_id, params=[Param(k, v[:6000]) for k, v in tracking.flatten(resolved).items()],
                     tags=[RunTag("paperline.claim.spec", "" if request.premises_only else  # blind to the claim
                                  registry.get(paper).claim.text()[:5000]),
                           RunTag("paperline.code_ref", tracking.pin_code(run_id))])
    # the lineage `paperline reproduce` replays: the params as given, exactly (MLflow params are strings)
    client.log_dict(run_id, {"paper": paper, "profile": profile, "overrides": request.overrides,
                             "raw_params": request.raw, "params": resolved, "data_hash": data_hash},
                    "inputs/run_inputs.json")
    log_datasets(run_id, prepared)
    if profile == "full":  # the estimate a finished full run is held against (`paperline plan`)
        _log_plan(run_id, request)
    _tag_lineage(run_id, request, book)
    return run_id


def lineage_tags(request: RunRequest, force: bool, commit: str) -> dict[str, str]:
    """The run's source as MLflow's UI shows it (its Source column prints the name after the last "/": the flow's
    file and the commit; its Version column the commit alone) and the parts of the cache key on their own, so the
    morning report can say which one made a paper retrain."""
    return {"mlflow.source.name": f"flows/pipeline.py @ {commit[:12]}{'-dirty' if commit.endswith('-dirty') else ''}",
            "mlflow.source.type": "LOCAL",
            "paperline.code_hash": keys.training_hash(registry.module_file(request.paper)),
            "paperline.claim_hash": keys.verdict_hash(registry.module_file(request.paper)),
            "paperline.params_hash": tracking.params_hash(request.profile, request.raw),
            "paperline.forced": str(bool(force)).lower()}


def log_datasets(run_id: str, prepared, first_index: int = 0) -> None:
    """Each replicate's data as an MLflow dataset input (the run's Datasets column): named by its DVC stage, digest =
    the DVC output hash, source = the stage and its output folder."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = []
    for index, data in enumerate(prepared, first_index):
        stage = data.stage
        source = json.dumps({"dvc_stage": stage.target, "path": str(stage.out_dir.relative_to(settings.root()))})
        dataset = Dataset(name=stage.target, digest=data.data_hash[:36], source_type="dvc", source=source)
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", f"replicate {index}")]))
    tracking.client().log_inputs(run_id, datasets=inputs)


def _log_plan(run_id: str, request: RunRequest) -> None:
    from flows.plan import plan_metrics

    try:
        metrics = plan_metrics(request.paper, request.params)
    except Exception as e:  # noqa: BLE001 - an estimate: its failure must not stop the run it describes
        tracking.client().set_tag(run_id, "plan.error", f"{type(e).__name__}: {e}"[:5000])
        return
    tracking.client().log_batch(run_id, metrics=[Metric(k, float(v), int(time.time() * 1000), 0)
                                                 for k, v in metrics.items()])


@dataclass(frozen=True)
class ReplicateDone:
    run_id: str                 # the replicate's child run (its folder under runs/<id>/ holds its outputs)
    metrics: dict[str, float]   # its evaluation metrics
    seconds: float
    cpu_s: float | None = None  # CPU seconds of its training ranks and evaluation (None: not measured)


def _replicate(spec, request: RunRequest, entry: ledger.ReplicateEntry, prepared, parent_id: str, exp_id: str,
               launch: Launcher, trains_later: bool = True) -> Future[ReplicateDone]:
    """Replicate `entry.index` as a child run of the pipeline's run, as the ledger says: kept or reused (its
    stored metrics), continued from its checkpoints, or trained; its evaluation goes to the launcher, so it runs
    while the next replicate trains, except where the paper's timed parts need a quiet machine."""
    paper, client, index = request.paper, tracking.client(), entry.index
    rep = request.replicate(index)
    label = f"{paper} r{index}"
    if not entry.trains:
        earlier = entry.earlier
        _say(f"[{label}] finished earlier in this run: kept" if entry.action == "keep" else
             f"[{label}] trained earlier with this code, params, data and seed (run {earlier.info.run_id}): its "
             "stored metrics are reused")
        return Launcher.stored(ReplicateDone(earlier.info.run_id, recorded_metrics(
            earlier, settings.runs_dir() / paper / earlier.info.run_id), 0.0,
            earlier.data.metrics.get("cpu/replicate_s")))
    if entry.action == "resume":
        child_id = entry.earlier.info.run_id
        client.update_run(child_id, status="RUNNING")
        client.set_tag(child_id, "paperline.pid", str(os.getpid()))
        _say(f"[{label}] continuing from its checkpoints (run {child_id})")
    else:
        key = entry.key
        tags = {"mlflow.parentRunId": parent_id, "paperline.kind": "replicate", "paperline.replicate": str(index),
                "paperline.paper": paper, "paperline.profile": request.profile, "paperline.cache_key": key,
                "paperline.training_key": key,
                "paperline.data_hash": prepared.data_hash, "paperline.data_stage": prepared.stage.target,
                "paperline.seed": str(rep.params.seed), "paperline.pid": str(os.getpid()),
                "mlflow.runName": f"{paper}-{request.profile}-r{index}",
                **{k: v for k, v in client.get_run(parent_id).data.tags.items() if k.startswith("mlflow.source.")}}
        child_id = client.create_run(exp_id, run_name=tags["mlflow.runName"], tags=tags).info.run_id
        client.log_batch(child_id, params=[Param(k, v[:6000]) for k, v in
                                           tracking.flatten(rep.params.model_dump(mode="json")).items()])
        log_datasets(child_id, [prepared], index)
    out_dir = settings.runs_dir() / paper / child_id
    with _failing(child_id):
        _say(f"[{label}] train: {rep.params.ranks} DeepSpeed rank(s), seed {rep.params.seed}, MLflow run {child_id}")
        job = TrainJob(paper, rep.params, prepared.stage.out_dir, out_dir, child_id, settings.tracking_uri())
        t_train = time.perf_counter()
        with training_hold(spec, out_dir):  # a timing elsewhere waits for it
            train_task.with_options(task_run_name=f"train {label}")(job)
        trained_s = time.perf_counter() - t_train
        launch.trained(trains_later)
        sent = send_pending(client, child_id, out_dir)  # what the ranks could not send while tracking was down
        if sent:
            _say(f"[{label}] sent {sent} metrics held back while the tracking server was unreachable")

    def evaluate() -> ReplicateDone:
        with _failing(child_id):
            t_eval = time.perf_counter()
            _say(f"[{label}] evaluate: method and baselines")
            with WorkCPU() as cpu_eval:  # not the CPU of the flow's other threads (another paper's, progress)
                metrics = evaluate_task.with_options(task_run_name=f"evaluate {label}")(
                    spec, rep.params, prepared.stage.out_dir, out_dir, child_id)
            evaluated_s = time.perf_counter() - t_eval
            cpu = {"evaluate": cpu_eval.seconds, "train": ranks_cpu_seconds(out_dir)}
            if cpu["train"] is not None:
                cpu["replicate"] = cpu["train"] + cpu["evaluate"]
            for name, seconds in (("train", trained_s), ("evaluate", evaluated_s)):
                client.log_metric(child_id, f"time/{name}_s", seconds, step=0)
            for name, seconds in cpu.items():
                if seconds is not None:
                    client.log_metric(child_id, f"cpu/{name}_s", seconds, step=0)
            client.set_terminated(child_id, RunStatus.to_string(RunStatus.FINISHED))
        return ReplicateDone(child_id, metrics, trained_s + evaluated_s, cpu.get("replicate"))

    return launch.evaluate(evaluate)


@contextlib.contextmanager
def _failing(run_id: str, paper: str | None = None):
    """Mark the run FAILED when what it wraps raises: the ledger then offers it to the next run to continue.
    `paper`: it is the paper's pipeline run (the console says where its checkpoints are when tracking is down)."""
    try:
        yield
    except BaseException:
        try:
            tracking.client().set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        except Exception:  # noqa: BLE001 - tracking down: the next start marks the run KILLED
            if paper is not None:
                _say(f"[{paper}] could not mark run {run_id} FAILED (tracking unreachable); checkpoints kept in "
                     f"{settings.runs_dir() / paper}, a rerun continues from them")
        raise


def _tag_lineage(run_id: str, request: RunRequest, book: ledger.Ledger) -> None:
    """Where the parent's replicates come from: `paperline.lineage` says trained / extended / re-decided,
    `paperline.stored_replicates` names the earlier child runs it points at, `paperline.stored_from` their
    parents (the runs it re-decides or extends); `paperline.premises_only` marks a run blind to its claim."""
    reused = book.reused
    tags = [RunTag("paperline.lineage", book.lineage),
            RunTag("paperline.trained_replicates", ",".join(str(e.index) for e in book.replicates
                                                            if e.action != "reuse")),
            RunTag("paperline.stored_replicates", ",".join(f"{i}:{r.info.run_id}" for i, r in sorted(reused.items()))),
            RunTag("paperline.stored_from", ",".join(sorted({r.data.tags.get("mlflow.parentRunId", "")
                                                              for r in reused.values()})))]
    if request.premises_only:
        tags.append(RunTag("paperline.premises_only", "true"))
    tracking.client().log_batch(run_id, tags=tags)


@task(name="promote")
def promote_task(paper: str, run_id: str) -> None:
    """Register the run's model version; `champion` moves to it only if it is at least as good (flows/lifecycle)."""
    version, decision = lifecycle.register_and_promote(paper, run_id)
    tracking.client().set_tag(run_id, "paperline.model_version", f"{lifecycle.model_name(paper)}/{version}")
    _say(f"[{paper}] model {lifecycle.model_name(paper)} v{version}: {decision.alias} ({decision.reason})")


def _suite_run_name() -> str:
    requests = runtime.flow_run.parameters.get("requests") or []
    profiles = {r.profile if isinstance(r, RunRequest) else r.get("profile", "?") for r in requests}
    return f"suite-{'+'.join(sorted(profiles)) or 'empty'}"


@flow(name="suite", flow_run_name=_suite_run_name)
def suite(requests: list[RunRequest], force: bool = False, parallel: int = 1) -> list[dict]:
    """Every requested paper's pipeline (resolved by the caller: the CLI, the nightly deployment in
    flows/deployed.py); one paper's failure is reported, not fatal.

    `parallel` papers run side by side (threads of this process; training is a subprocess per paper, evaluation
    runs in `parallel` evaluator processes, tasks/evaluators.py): one paper's single-threaded stretches (prepare,
    evaluate, start-up) then use the cores another paper's training leaves idle (benchmarks/README.md, suite)."""
    started = time.time()
    if parallel < 1:
        raise registry.ConfigError(f"parallel: must be at least 1, got {parallel}")
    if not requests:
        raise registry.ConfigError("a suite needs at least one paper")
    with contextlib.ExitStack() as stack:
        if parallel > 1:  # papers side by side evaluate in processes of their own, not in turns in this one
            stack.enter_context(evaluators.evaluators(parallel))
        return _suite(requests, force, parallel, started)


def _suite(requests: list[RunRequest], force: bool, parallel: int, started: float) -> list[dict]:
    profile = requests[0].profile
    upcoming = Upcoming(requests)
    eta = _Eta(requests)
    token = UPCOMING.set(upcoming)  # the papers' contexts are copies holding it (and the evaluators)
    calls = [(f"[{i}/{len(requests)}] {r.paper}", r, _in_context(r, force, upcoming))
             for i, r in enumerate(requests, 1)]
    UPCOMING.reset(token)

    slots: queue.SimpleQueue[tuple[int, ...] | None] = queue.SimpleQueue()
    for cores in train.core_slots(parallel):  # papers side by side train on cores of their own
        slots.put(cores)

    def one(call) -> dict:
        title, request, run = call
        _say(f"=== {title} ({request.profile}){eta.left()} ===")
        cores = slots.get()
        try:
            return run(cores)
        except Exception as e:  # noqa: BLE001 - report and continue with the next paper
            _say(f"[{request.paper}] FAILED: {type(e).__name__}: {e}")
            return {"paper": request.paper, "profile": request.profile, "error": f"{type(e).__name__}: {e}"}
        finally:
            slots.put(cores)
            eta.done(request.paper)

    if parallel == 1:
        results = [one(call) for call in calls]
    else:
        with ThreadPoolExecutor(parallel, thread_name_prefix="suite") as pool:
            results = list(pool.map(one, calls))
    # the report covers this suite run: what it retrained, skipped or lost
    window = time.time() - started + 1
    md, _ = morning.write(morning.morning(window, profile), f"{window / 60:.0f} min (this suite run)",
                          stem=f"morning-{time.strftime('%Y-%m-%d')}")
    _say(f"morning report: {md}")
    publish_suite_artifact(results, profile, md)
    return results


def publish_suite_artifact(results: list[dict], profile: str, morning_md) -> None:
    """The suite's scoreboard as one Prefect markdown artifact: per paper its verdict, whether it retrained, reused
    an earlier run or failed, and its MLflow run; then the morning report's table (why each paper retrained)."""
    from prefect.artifacts import create_markdown_artifact

    ui = ui_url()
    rows = ["| paper | verdict | this run | MLflow run |", "| --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['paper']} | | FAILED: {r['error'].replace('|', '/')[:200]} | |")
            continue
        url = tracking.ui_link(ui, tracking.experiment_id(r["paper"]), r["run_id"])
        verdict = r["verdict"] + (f": {r['reason']}" if r["reason"] else "")
        rows.append(f"| {r['paper']} | {verdict.replace('|', '/')} | {'reused' if r['reused'] else 'retrained'} | "
                    f"[{r['run_id'][:8]}]({url}) |")
    # the morning report's lines of this suite's papers (it lists every paper: the others are "not run")
    morning = [line for line in morning_md.read_text().splitlines() if "| not run (" not in line]
    markdown = f"## suite ({profile}): {len(results)} paper(s)\n\n" + "\n".join(rows + [""] + morning) + "\n"
    try:
        create_markdown_artifact(markdown, key=f"suite-{profile}", description=f"suite {profile} scoreboard")
    except Exception as e:  # noqa: BLE001 - the artifact describes the suite; its failure must not fail it
        _say(f"no Prefect artifact for the suite: {type(e).__name__}: {e}")


class _Eta:
    """Time left in a suite, from each paper's last finished run of the same profile (`time/total_s`, scaled by
    the replicates now vs then); a paper never run counts as the median of the others."""

    def __init__(self, requests: list[RunRequest]):
        self._expected = {r.paper: _earlier_seconds(r) for r in requests}
        known = sorted(v for v in self._expected.values() if v is not None)
        fallback = known[len(known) // 2] if known else None
        self._expected = {k: (v if v is not None else fallback) for k, v in self._expected.items()}
        self._lock = threading.Lock()

    def done(self, paper: str) -> None:
        with self._lock:
            self._expected.pop(paper, None)

    def left(self) -> str:
        with self._lock:
            values = list(self._expected.values())
        if not values or any(v is None for v in values):
            return ""
        return f", about {math.ceil(sum(values) / 60)} min left (from earlier runs)"


def _earlier_seconds(request: RunRequest) -> float | None:
    try:
        experiment = tracking.client().get_experiment_by_name(f"paperline/{request.paper}")
        if experiment is None:
            return None
        runs = tracking.client().search_runs(
            [experiment.experiment_id], f"tags.`paperline.profile` = '{request.profile}' and "
            "tags.`paperline.kind` = 'pipeline' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"], max_results=1)
    except Exception:  # noqa: BLE001 - an estimate only
        return None
    if not runs or "time/total_s" not in runs[0].data.metrics:
        return None
    then = int(runs[0].data.tags.get("paperline.replicates", "1") or 1)
    return runs[0].data.metrics["time/total_s"] * request.replicates / max(then, 1)


def _in_context(request: RunRequest, force: bool, upcoming: Upcoming):
    """The paper's pipeline as a subflow of this suite run, callable from any thread (Prefect's run context lives
    in context variables, which a worker thread does not inherit)."""
    context = contextvars.copy_context()

    def pipeline(cores: tuple[int, ...] | None) -> dict:
        train.CORES.set(cores)
        return paper_pipeline(request, force)

    def run(cores: tuple[int, ...] | None = None) -> dict:
        upcoming.start(request.paper)
        return context.run(pipeline, cores)

    return run


def run_papers(requests: list[RunRequest], force: bool, parallel: int = 1) -> list[dict]:
    """CLI entry: one flow run per paper, or the suite flow for several."""
    if len(requests) == 1:
        return [paper_pipeline(requests[0], force)]
    if any(set(r.overrides) - set(registry.SUITE_OVERRIDES) for r in requests):
        raise registry.ConfigError("--set applies to one paper at a time "
                                   f"(except {', '.join(registry.SUITE_OVERRIDES)})")
    return suite(requests, force, parallel)
