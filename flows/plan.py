"""`paperline plan`: what a profile will cost before a GPU is spent, and whether each rank fits.

`plan_paper` plans one paper (tasks/planning.py says how: the paper's own `train(ctx)` traced on fake tensors, one
step per `fit` phase); `plan_all` plans every paper, two at a time, each in its own process, and `write_report`
writes `reports/plan.md`. `plan_metrics(paper_id, params)` gives the `plan/*` numbers a full run logs, so a
finished run can be held against its estimate. A plan's `gpus_needed` is what the `full-gpu` deployment asks for.

Planning patches torch while it traces (fake tensors, `torch.tensor`, `Module.__call__`), so it never runs in the
caller's process: each entry point runs in a fresh `python -m flows.plan` subprocess (no threads of the caller's to
deadlock a fork, no patched torch for a flow's other threads to see) and answers in JSON.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models import registry
from tasks import settings

MAX_WORKERS = 2
LIMIT_S = 180.0  # wall seconds per paper, hard: a backstop; the trace's own CPU budget (BUDGET_S) ends plans sooner


def _cache() -> Path:
    return settings.root() / ".cache" / "plan-data"


def plan_paper(paper_id: str, profile: str = "full", overrides: Mapping[str, Any] | None = None, *,
               gpu: str | None = None, mfu: float | None = None, budget_s: float | None = None) -> dict[str, Any]:
    """Plan one paper's profile (overrides as `--set` gives them; `budget_s` CPU seconds for the trace, default
    `planning.BUDGET_S`), in a fresh process: the plan as `Plan.to_dict()`. Raises ConfigError on bad input, named
    here before the subprocess starts."""
    registry.ask(paper_id, profile, overrides, settings.params_file()).validated()  # bad keys and values first
    from tasks import planning

    if gpu is not None and gpu not in planning.GPUS:
        raise registry.ConfigError(f"unknown --gpu {gpu!r}; known: {', '.join(planning.GPUS)}")
    return _isolated("paper", {"paper": paper_id, "profile": profile, "overrides": dict(overrides or {}),
                               "gpu": gpu, "mfu": mfu, "budget_s": budget_s})


def _plan_paper_here(paper_id: str, profile: str = "full", overrides: Mapping[str, Any] | None = None, *,
                     gpu: str | None = None, mfu: float | None = None, budget_s: float | None = None):
    from tasks import planning

    params_file = settings.params_file()
    raw = registry.ask(paper_id, profile, overrides, params_file).raw
    test = registry.ask(paper_id, "test", None, params_file).raw
    return planning.plan(paper_id, raw, test, profile=profile, gpu=gpu or planning.DEFAULT_GPU,
                         mfu=mfu or planning.DEFAULT_MFU, cache=_cache(), budget_s=budget_s)


def plan_metrics(paper_id: str, params) -> dict[str, float]:
    """The `plan/*` numbers of a run's validated params (a `PaperParams`, or the dict of one), for MLflow."""
    raw = params.model_dump(mode="json") if hasattr(params, "model_dump") else dict(params)
    return _isolated("metrics", {"paper": paper_id, "raw": raw})


def _isolated(command: str, payload: dict[str, Any]) -> Any:
    """`python -m flows.plan <command>` with `payload` as JSON on stdin: its JSON answer (stdout). What the
    planner or the paper prints goes to stderr; a planner that fails says why in the raised error."""
    done = subprocess.run([sys.executable, "-m", "flows.plan", command], input=json.dumps(payload), text=True,
                          capture_output=True, cwd=settings.root())
    if done.returncode == 2:  # bad input found in the planner process: the same error as here
        raise registry.ConfigError(done.stdout.strip() or done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"the planning process failed (exit {done.returncode}): {tail}")
    return json.loads(done.stdout)


def _serve(command: str, payload: dict[str, Any]) -> Any:
    """What `_isolated` runs in the fresh process."""
    if command == "paper":
        return _plan_paper_here(payload["paper"], payload["profile"], payload["overrides"], gpu=payload["gpu"],
                                mfu=payload["mfu"], budget_s=payload["budget_s"]).to_dict()
    if command == "metrics":
        from tasks import planning

        test = registry.ask(payload["paper"], "test", None, settings.params_file()).raw
        return planning.plan(payload["paper"], payload["raw"], test, cache=_cache()).metrics()
    if command == "all":
        return _plan_all_here(payload["profile"], payload["gpu"], payload["mfu"], payload["ids"])
    raise ValueError(f"unknown planning command {command!r}")


def _plan_one(args: tuple) -> dict[str, Any]:
    paper_id, profile, gpu, mfu = args
    try:
        return _plan_paper_here(paper_id, profile, gpu=gpu, mfu=mfu).to_dict()
    except Exception as e:  # noqa: BLE001 - one paper's failure is a row of the table, not the end of the table
        return {"paper": paper_id, "error": f"{type(e).__name__}: {e}"}


def plan_all(profile: str = "full", gpu: str | None = None, mfu: float | None = None,
             ids: list[str] | None = None) -> list[dict[str, Any]]:
    """Every paper's plan as dicts (`Plan.to_dict`), in id order; a paper that failed to plan has `error`.
    Planned by a fresh process (`_plan_all_here`), which forks one planner per paper."""
    return _isolated("all", {"profile": profile, "gpu": gpu, "mfu": mfu, "ids": ids})


def _plan_all_here(profile: str = "full", gpu: str | None = None, mfu: float | None = None,
                   ids: list[str] | None = None, workers: int = MAX_WORKERS,
                   limit_s: float = LIMIT_S) -> list[dict[str, Any]]:
    """Each paper plans in its own process forked from this fresh, single-threaded one (`workers` at a time),
    ended after `limit_s` seconds: a paper whose planning hangs in native code becomes a row saying so instead of
    stalling the table. The papers that took longest last time (`reports/plan.json`) start first, so no long one
    is left alone at the end."""
    ids = ids or registry.paper_ids()
    import torch  # noqa: F401 - imported once here, inherited by every forked planner

    from tasks import planning

    planning.warm_up(_cache())  # what the first trace loads and caches, loaded once here for every planner
    ctx = multiprocessing.get_context("fork")
    results: dict[str, dict[str, Any]] = {}
    running: dict[str, tuple[Any, Any, float]] = {}
    todo = _longest_first(ids, _last_seconds())
    while todo or running:
        while todo and len(running) < workers:
            pid = todo.pop(0)
            registry.get(pid)  # its module imported here, inherited: the parent imports while children plan
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_plan_child, args=(send, (pid, profile, gpu, mfu)), daemon=True)
            proc.start()
            send.close()
            running[pid] = (proc, receive, time.monotonic() + limit_s)
        for pid, (proc, receive, deadline) in list(running.items()):
            if receive.poll(0.05):
                try:
                    results[pid] = receive.recv()
                except EOFError:  # the child died without answering
                    results[pid] = {"paper": pid, "error": f"planning process died (exit code {proc.exitcode})"}
            elif not proc.is_alive() and not receive.poll(0):
                results[pid] = {"paper": pid, "error": f"planning process died (exit code {proc.exitcode})"}
            elif time.monotonic() > deadline:
                proc.kill()
                results[pid] = {"paper": pid, "error": f"planning took over {limit_s:.0f} s"}
            else:
                continue
            proc.join()
            receive.close()
            del running[pid]
    return [results[pid] for pid in ids]


def _longest_first(ids: list[str], seconds: Mapping[str, float]) -> list[str]:
    """`ids` by the seconds each took last time, longest first (unknown ones last, in their order)."""
    return sorted(ids, key=lambda pid: -seconds.get(pid, 0.0))


def _last_seconds(path: Path | None = None) -> dict[str, float]:
    """Each paper's planning seconds in the last `--all` run (`write_report`'s JSON); {} when there is none."""
    path = path or settings.root() / "reports" / "plan.json"
    try:
        return {p["paper"]: float(p.get("seconds", 0.0)) for p in json.loads(path.read_text())}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _plan_child(send, job: tuple) -> None:
    import torch
    from threadpoolctl import threadpool_limits  # scikit-learn's dependency

    torch.set_num_threads(1)  # one core per planner: `workers` of them share the machine
    threadpool_limits(1)  # BLAS too: its idle threads spin (pacer's NumPy moments spent ~12% of CPU there)
    os.dup2(2, 1)  # whatever the paper or native code prints goes to stderr: the parent's stdout is the table/JSON
    try:
        send.send(_plan_one(job))
    finally:
        send.close()
        os._exit(0)  # skip the interpreter's teardown: the parent has the answer


# ---- rendering ----------------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _hours(h: float) -> str:
    return f"{h:.1f}" if h >= 0.1 else f"{h:.2f}"


def table(plans: list[dict[str, Any]]) -> str:
    """Markdown: one row per paper (GPUs, GPU-hours, peak memory per rank, host memory for the data, fits), and
    how far the trace got: the phases traced, and where it stopped and why when train() did not return (then
    "fits" says "so far": the GPU-hours and peak cover the traced phases only)."""
    rows = ["| paper | GPUs needed | GPU-hours | peak GiB/rank | data GiB/node | ZeRO | phases traced | fits |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for p in plans:
        if "error" in p:
            rows.append(f"| {p['paper']} | | | | | | not planned: {p['error'][:80]} | ? |")
            continue
        # "so far": the phases traced before the trace stopped fit; the rest of train() is not planned
        verdict = ("yes" if p["complete"] else "so far") if p["fits"] else "NO: " + "; ".join(p["problems"])[:120]
        traced = ", ".join(ph["name"] for ph in p["phases"]) or "none"
        if p["stopped"]:
            traced += f" (then: {p['stopped'][:60]})"
        if p.get("replicas"):
            traced += " (" + ", ".join(f"{k} = {n} replicas traced as 1" for k, n in p["replicas"].items()) + ")"
        hours = (">= " if p.get("steps_lower_bound") else "") + _hours(p["gpu_hours"])
        gpus = str(p["gpus_needed"]) + (f" (profile: {p['ranks']})" if p["gpus_needed"] != p["ranks"] else "")
        rows.append(f"| {p['paper']} | {gpus} | {hours} | {_gib(p['peak_rank_bytes'])} | "
                    f"{_gib(p['data_bytes'])} | {p['zero_stage']} | {traced.replace('|', '/')} | {verdict} |")
    return "\n".join(rows)


def phase_table(p: dict[str, Any]) -> str:
    """One paper's phases: what each rank holds and what the phase costs."""
    from tasks import planning
    from tasks.planning import GIB

    lines = [f"plan {p['paper']} ({p['profile']}): {p['ranks']} x {p['gpu']}, ZeRO {p['zero_stage']}, "
             f"{'bf16' if p['bf16'] else 'fp32'}, MFU {p['mfu']:.2f}",
             f"{'phase':22s} {'params':>12s} {'steps':>8s} {'weights':>8s} {'grads':>8s} {'optim':>8s} "
             f"{'frozen':>8s} {'activ':>8s} {'infer':>8s} {'rank GiB':>9s} {'TFLOP/step':>11s} {'PFLOP total':>12s}"]
    for ph in p["phases"]:
        lines.append(f"{ph['name'][:22]:22s} {ph['params']:12,d} {ph['steps']:8d} {ph['weights_bytes'] / GIB:8.2f} "
                     f"{ph['grads_bytes'] / GIB:8.2f} {ph['optimizer_bytes'] / GIB:8.2f} "
                     f"{ph['frozen_bytes'] / GIB:8.2f} "
                     f"{ph['activation_bytes'] / GIB:8.2f} {ph['inference_bytes'] / GIB:8.2f} "
                     f"{ph['peak_bytes'] / GIB:9.2f} "
                     f"{ph['flops_step'] / 1e12:11.4f} {ph['flops_total'] * p['ranks'] / 1e15:12.3f}")
    lines.append(f"peak per rank {_gib(p['peak_rank_bytes'])} GiB; {p['flops_total'] / 1e15:.2f} PFLOP; "
                 f"{_hours(p['gpu_hours'])} GPU-hours ({p['ranks']} GPUs: {p['gpu_hours'] / p['ranks']:.2f} h wall)")
    if p["gpus_needed"] < p["ranks"]:
        lines.append(f"needs {p['gpus_needed']} GPU(s): every phase fits a rank there and the job ends within "
                     f"{planning.WALL_TARGET_H:g} h (`--set ranks={p['gpus_needed']}`; `--gpus` prints it)")
    lines += [f"phase {ph['name']}: {ph['kernel_launches']} Triton launches a step, skipped on fakes (their FLOPs are "
              "not counted)" for ph in p["phases"] if ph["kernel_launches"]]
    if p.get("steps_lower_bound"):
        lines.append(f"steps are passes ({', '.join(p['passes'])}) over the planning copy's rows, which are the test "
                     "profile's amount: the FLOPs and GPU-hours are a lower bound (memory per rank is not)")
    lines.append(f"host memory for the data: {_gib(p['data_bytes'])} GiB ({p['data_note']})")
    if p.get("traced_as"):
        lines.append(f"traced as: {p['traced_as']}")
    if p["stopped"]:
        budget = p["stopped"].startswith("time budget")
        more = f"; `paperline plan {p['paper']} --budget <CPU s>` goes further" if budget else ""
        lines.append(f"trace ended early: {p['stopped']} (the phases after it are not planned{more})")
    lines += [f"DOES NOT FIT: {problem}" for problem in p["problems"]] or [
        "fits" if p["complete"] else "the traced phases fit; the plan is incomplete"]
    return "\n".join(lines)


def write_report(plans: list[dict[str, Any]], path: Path | None = None) -> Path:
    from tasks import planning

    path = path or settings.root() / "reports" / "plan.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    gpu = next((p["gpu"] for p in plans if "gpu" in p), planning.DEFAULT_GPU)
    mfu = next((p["mfu"] for p in plans if "mfu" in p), planning.DEFAULT_MFU)
    head = (f"# Plan of the full profiles\n\nGenerated by `paperline plan --all` (one traced step per training "
            f"phase on fake tensors; nothing trained). GPU {gpu} ({planning.HEADROOM:.0%} of its memory usable per "
            f"rank), GPU-hours at MFU {mfu:.2f}, host RAM {planning.HOST_RAM // planning.GIB} GiB per node of "
            f"{planning.GPUS_PER_NODE} GPUs. `paperline plan <id>` shows a paper's phases.\n\n")
    path.write_text(head + table(plans) + "\n")
    path.with_suffix(".json").write_text(to_json(plans) + "\n")  # for tools, and the next run's order
    return path


def to_json(plans: list[dict[str, Any]] | dict[str, Any]) -> str:
    return json.dumps(plans, indent=1, default=float)


def main() -> None:
    """`python -m flows.plan <command>`: the planning process `_isolated` starts (JSON in, JSON out)."""
    settings.configure_environment()
    payload = json.loads(sys.stdin.read())
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the planner or a paper prints: stdout is the answer
    try:
        answer = _serve(sys.argv[1], payload)
    except registry.ConfigError as e:
        out.write(str(e))
        sys.exit(2)
    out.write(to_json(answer))
    out.flush()


if __name__ == "__main__":
    main()
