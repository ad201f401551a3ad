"""The `paperline` command: list, run, reproduce, report, data, promote, ui, serve, server.

Bad input exits with code 2 before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated

import typer

from tasks.settings import configure_environment

configure_environment()

from models import registry  # noqa: E402
from tasks import settings, tracking  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Reproduce, retrain and compare the ICML 2026 paper pipelines.")


@app.callback()
def options(verbose: Annotated[bool, typer.Option("--verbose", help="Every tool's own output on the console (DVC, "
                                                  "MLflow, transformers, DeepSpeed); otherwise it goes to the log "
                                                  "file.")] = False) -> None:
    if verbose:
        os.environ["PAPERLINE_VERBOSE"] = "1"
        for key, value in settings.QUIET_DEFAULTS.items():  # set by configure_environment before the flag was read
            if os.environ.get(key) == value:
                del os.environ[key]


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", err=True, fg="red")
    raise typer.Exit(code)


@app.command("list")
def list_papers() -> None:
    """Paper ids, titles and the latest verdict (with its run's profile and CPU seconds a replicate); imports no
    paper and no MLflow."""
    from flows.listing import listing

    for row in listing():
        cpu = "-" if row.cpu_s is None else f"{row.cpu_s:.0f} CPU-s"
        typer.echo(f"{row.paper:24s} {row.verdict:14s} {row.profile:6s} {cpu:>10s} {row.title}")


@app.command()
def run(
    papers: Annotated[list[str] | None, typer.Argument(help="Paper ids (see `paperline list`).")] = None,
    all_papers: Annotated[bool, typer.Option("--all", help="Every registered paper.")] = False,
    profile: Annotated[str, typer.Option(help="test | smoke | full")] = "smoke",
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a parameter: key=value.")] = None,
    force: Annotated[bool, typer.Option(help="Retrain even if an identical earlier run exists.")] = False,
    report: Annotated[bool, typer.Option(help="Write the scoreboard afterwards.")] = False,
    hostfile: Annotated[str | None, typer.Option(help="DeepSpeed hostfile: train across its machines.")] = None,
    nodes: Annotated[int, typer.Option(help="Split each job's ranks over N launchers on this machine, one "
                                            "rendezvous (multi-node, as on N machines).")] = 1,
    parallel: Annotated[int, typer.Option(help="Papers run side by side (several papers only).")] = 1,
    premises_only: Annotated[bool, typer.Option("--premises-only", help="Show and record only the premises "
                                                "(numbers and decisions), blind to the claim: for sizing a "
                                                "profile. Such a run never becomes a champion or a scoreboard "
                                                "row.")] = False,
) -> None:
    """Run paper pipelines (prepare -> train -> evaluate -> claim); each ends with its claim line."""
    ids = registry.paper_ids() if all_papers else list(papers or [])
    if not ids:
        _fail("name paper ids or pass --all")
    if parallel < 1:
        _fail(f"--parallel: must be at least 1, got {parallel}")
    try:
        overrides = registry.parse_overrides(set_)
        if set(overrides) - set(registry.SUITE_OVERRIDES) and len(ids) > 1:
            raise registry.ConfigError("--set applies to one paper at a time (except "
                                       f"{', '.join(registry.SUITE_OVERRIDES)}, which every paper takes)")
        if hostfile:
            from tasks.train import read_hostfile

            read_hostfile(Path(hostfile))
            os.environ["PAPERLINE_HOSTFILE"] = str(Path(hostfile).resolve())
        asks = [registry.ask(pid, profile, overrides, settings.params_file()) for pid in ids]  # nothing imported
        _say_started(ids, profile, overrides)
        if tracking.store_exists():  # a server, or the embedded store (whose first use creates it)
            tracking.check_reachable()
        # unchanged work answers from MLflow at once, before Prefect starts or any paper is imported
        from flows.cache import lookup

        reused = {} if force or premises_only else lookup(asks)
        todo = [pid for pid in ids if pid not in reused]
        # every run resolved once (values checked, real inputs present) before any work; handed down as is
        requests = [ask.resolve() for ask in asks if ask.paper not in reused]
        if premises_only:
            requests = [replace(r, premises_only=True) for r in requests]
        if nodes != 1:  # multi-node on this machine (tasks.train.launch reads PAPERLINE_NODES)
            from tasks.train import check_nodes

            if hostfile:
                raise registry.ConfigError("--nodes and --hostfile: choose one")
            for pid, req in zip(todo, requests, strict=True):
                check_nodes(req.params.ranks, nodes, pid)
            os.environ["PAPERLINE_NODES"] = str(nodes)
    except registry.ConfigError as e:
        _fail(str(e))
    except RuntimeError as e:  # the tracking store is unreachable
        _fail(str(e), code=1)
    for hit in reused.values():
        typer.echo(hit.claim_line())
    ran = {}
    if todo:
        from flows import local_api
        from tasks.train import prestart

        # both boot in the background while Prefect and the flows import (benchmarks/README.md, overhead)
        local_api.start()
        prestart(todo[0], requests[0].params)
        from flows.pipeline import run_papers

        try:
            local_api.wait_ready()
            ran = {r["paper"]: r for r in run_papers(requests, force, parallel)}
        except Exception as e:  # noqa: BLE001 - one paper's run failed: say what, not a traceback
            _fail(f"{todo[0]} failed: {type(e).__name__}: {tracking.mask(str(e))} (its MLflow run is marked FAILED; "
                  "finished work is kept and a rerun continues it)", code=1)
    results = [asdict(reused[pid]) if pid in reused else ran[pid] for pid in ids]
    failed = [r for r in results if "error" in r]
    if len(results) > 1:
        typer.echo("\nsummary:")
        for r in results:
            status = f"FAILED {r['error']}" if "error" in r else \
                f"{r['verdict']}{' (reused)' if r['reused'] else ''}"
            typer.echo(f"  {r['paper']:24s} {status}")
    if report:
        _write_report(profile)
    if failed:
        raise typer.Exit(1)


def _say_started(ids: list[str], profile: str, overrides: dict) -> None:
    """The first line of a run, within a second of the command: what follows (the earlier-run check, DVC, Prefect
    and the ranks starting) takes seconds before the first stage prints."""
    what = ids[0] if len(ids) == 1 else f"{len(ids)} papers"
    given = "".join(f" {k}={v}" for k, v in overrides.items())
    typer.echo(f"[{what}] started ({profile}{given}): looking for an identical earlier run, then DVC, Prefect and "
               "the training ranks start", err=True)


def _write_report(profile: str | None) -> None:
    from flows.report import scoreboard, write

    md, html = write(scoreboard(profile))
    typer.echo(md.read_text())
    typer.echo(f"scoreboard written to {md} and {html}")


@app.command()
def report(
    profile: Annotated[str, typer.Option(help="Latest run of this profile; 'any' for any.")] = "smoke",
    since: Annotated[str | None, typer.Option(help="Morning report of this window instead, e.g. 24h.")] = None,
) -> None:
    """Write the scoreboard (Markdown + HTML) from the latest finished run of every paper, or with --since the
    morning report: retrained / skipped / failed per paper, verdict flips first, primary metric vs champion."""
    if since is None:
        _write_report(None if profile == "any" else profile)
        return
    from flows import morning

    try:
        window = morning.parse_window(since)
    except registry.ConfigError as e:
        _fail(str(e))
    md, html = morning.write(morning.morning(window, "smoke" if profile == "any" else profile), since)
    typer.echo(md.read_text())
    typer.echo(f"morning report written to {md} and {html}")


@app.command()
def data(
    papers: Annotated[list[str] | None, typer.Argument(help="Paper ids.")] = None,
    all_papers: Annotated[bool, typer.Option("--all", help="Table of every paper; writes reports/data.md.")] = False,
    profile: Annotated[str, typer.Option(help="test | smoke | full")] = "full",
) -> None:
    """The real data a profile reads: declared inputs, which are on disk, and the commands that bring them in."""
    from flows import data_inputs

    try:
        if all_papers and profile != "full":  # reports/data.md is the full profiles' table
            typer.echo(data_inputs.table(settings.params_file(), profile))
            return
        if all_papers:
            out = data_inputs.write_report(settings.params_file(), settings.root() / "reports" / "data.md", profile)
            typer.echo(out.read_text())
            typer.echo(f"written to {out}")
            return
        if not papers:
            _fail("name paper ids or pass --all")
        for pid in papers:
            typer.echo(data_inputs.describe(pid, profile, settings.params_file()))
    except registry.ConfigError as e:
        _fail(str(e))


@app.command()
def plan(
    papers: Annotated[list[str] | None, typer.Argument(help="Paper ids.")] = None,
    all_papers: Annotated[bool, typer.Option("--all", help="Every paper; writes reports/plan.md.")] = False,
    profile: Annotated[str, typer.Option(help="test | smoke | full")] = "full",
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a parameter: key=value.")] = None,
    gpu: Annotated[str, typer.Option(help="h100-80gb | h200-141gb | a100-80gb")] = "h100-80gb",
    mfu: Annotated[float, typer.Option(help="Model-FLOP utilisation the GPU-hours assume.")] = 0.35,
    as_json: Annotated[bool, typer.Option("--json", help="JSON for tools instead of tables.")] = False,
    budget: Annotated[float | None, typer.Option(help="CPU seconds the trace of one paper may take (default 20; "
                                                      "a plan that stops on it says so).")] = None,
    gpus: Annotated[bool, typer.Option("--gpus", help="Print only the GPUs the plan's numbers need (the full-gpu "
                                                      "deployment runs that many ranks).")] = False,
) -> None:
    """Memory per rank, FLOPs and GPU-hours of a profile, from one traced step of each training phase (nothing is
    allocated or trained). Exit 1 naming the phase and the number when a rank would not fit."""
    from flows import plan as planning

    try:
        overrides = registry.parse_overrides(set_)
        if all_papers:
            if overrides or budget is not None:
                raise registry.ConfigError("--set and --budget apply to one paper at a time")
            plans = planning.plan_all(profile, gpu, mfu)
            out = planning.write_report(plans) if profile == "full" else None
            typer.echo(planning.to_json(plans) if as_json else planning.table(plans))
            if out and not as_json:
                typer.echo(f"written to {out}")
        else:
            if not papers:
                _fail("name paper ids or pass --all")
            if overrides and len(papers) > 1:
                raise registry.ConfigError("--set applies to one paper at a time")
            plans = [planning.plan_paper(pid, profile, overrides, gpu=gpu, mfu=mfu, budget_s=budget)
                     for pid in papers]
            if gpus:
                typer.echo(" ".join(str(p["gpus_needed"]) for p in plans))
            else:
                typer.echo(planning.to_json(plans if len(plans) > 1 else plans[0]) if as_json
                           else "\n\n".join(planning.phase_table(p) for p in plans))
    except registry.ConfigError as e:
        _fail(str(e))
    for p in plans:
        if "error" not in p and p["fits"] and not p["complete"]:
            typer.secho(f"{p['paper']}: plan incomplete, the trace stopped: {p['stopped']}", err=True, fg="yellow")
    failed = [p for p in plans if "error" in p or not p["fits"]]
    for p in failed:
        typer.secho(f"{p['paper']}: " + (p.get("error") or "; ".join(p["problems"])), err=True, fg="red")
    if failed:
        raise typer.Exit(1)


@app.command()
def promote(
    paper: Annotated[str, typer.Argument(help="Paper id.")],
    version: Annotated[str, typer.Argument(help="Model version to make champion.")],
    reason: Annotated[str, typer.Option(help="Why, recorded on the version.")] = "",
) -> None:
    """Make a registered model version the paper's champion by hand (recorded as such on the version)."""
    from flows import lifecycle

    try:
        registry.module_file(paper)
        decision = lifecycle.promote(paper, version, reason)
    except registry.ConfigError as e:
        _fail(str(e))
    typer.echo(f"{lifecycle.model_name(paper)} v{version}: {decision.alias} ({decision.reason})")


@app.command()
def reproduce(
    run_id: Annotated[str, typer.Argument(help="The MLflow run to reproduce.")],
    keep: Annotated[bool, typer.Option(help="Keep the scratch checkout (.cache/reproduce/<run id>).")] = False,
) -> None:
    """Rerun a recorded run from its lineage (code commit, params, profile, world size, data) in a scratch
    checkout; print metric by metric whether the new run matches bitwise. Exit 1 when it does not."""
    from flows.reproduce import reproduce as rerun

    try:
        result = rerun(run_id, keep)
    except registry.ConfigError as e:
        _fail(str(e))
    typer.echo(result.table())
    if not result.matches:
        raise typer.Exit(1)


@app.command()
def ui(port: Annotated[int, typer.Option()] = 5000) -> None:
    """Serve the MLflow UI on 127.0.0.1 over the tracking store."""
    store = settings.tracking_uri()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    # the link opens MLflow 3's model-training view (its UI starts in the GenAI view otherwise)
    typer.echo(f"MLflow UI on http://127.0.0.1:{port}/#/experiments?workflowType=machine_learning "
               f"(store {settings.mask(store)})")
    subprocess.run([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--default-artifact-root",
                    settings.artifact_root().as_uri(), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                   env=env, check=False)


@app.command()
def serve(
    cron: Annotated[str, typer.Option(help="Nightly retraining schedule.")] = "0 2 * * *",
    timezone: Annotated[str, typer.Option(help="IANA timezone of the schedule.")] = "UTC",
    papers: Annotated[list[str] | None, typer.Option("--paper", help="Papers the nightly run retrains.")] = None,
) -> None:
    """Serve the deployments (one per paper + the nightly suite) against PREFECT_API_URL."""
    from flows.serve import deployments, serve_all

    try:
        deployments(cron, timezone, papers)
    except registry.ConfigError as e:
        _fail(str(e))
    serve_all(cron, timezone, papers)


@app.command()
def server(port: Annotated[int, typer.Option()] = 4200) -> None:
    """Start a local Prefect server on 127.0.0.1 (embedded SQLite in PREFECT_HOME) for `serve` and the UI."""
    api = f"http://127.0.0.1:{port}/api"
    typer.echo(f"Prefect server on http://127.0.0.1:{port}; then: export PREFECT_API_URL={api}")
    # the UI asks /ui-settings where the API is: this port, not the default 4200 (nor a PREFECT_API_URL elsewhere)
    env = {**os.environ, "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port),
           "PREFECT_UI_API_URL": api}
    subprocess.run([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
                    "--analytics-off"], env=env, check=False)


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    else:
        code = 0
    settings.exit_without_teardown(code)


if __name__ == "__main__":
    main()
