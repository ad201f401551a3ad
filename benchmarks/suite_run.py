"""The whole suite in one command, `paperline run --all --force [--parallel N]` (every paper's smoke profile, its
replicates), timed on a quiet machine: wall, CPU seconds of all its processes and how busy the cores were, and per
paper what its MLflow pipeline run recorded.

    python benchmarks/suite_run.py --parallel 2     # each setting given, in order (default: 1, then 2)
    python benchmarks/suite_run.py --cached 3       # then the cached rerun: the suite and one paper, 3 times each

Writes benchmarks/results/suite_run.json (`python benchmarks/tables.py suite_run` renders it): per setting the
wall seconds, user + system CPU seconds of every process of the command (`/usr/bin/time -v`), core busyness
(CPU / (wall x cores)), the largest process's peak RSS, the machine's load average before it started, what else
the machine ran meanwhile (`other_cpu_s`: its busy CPU seconds less the suite's; `niced_cpu_s`: of the machine's,
in niced processes; the kernel's autogroup setting, which decides whether nice keeps such work off), and per
paper its pipeline run's wall, `time/{prepare,train,evaluate,total}_s`, CPU seconds a replicate (mean, max), the
training steps a second of each phase (`timing/train/<phase>/steps_per_s`, mean over replicates), the replicate
count and the verdict with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "suite_run.json"


def collect(started_ms: int, ended_ms: int) -> dict[str, dict]:
    """What every paper's smoke pipeline run that started inside the window recorded (the latest one)."""
    from models import registry
    from tasks import tracking

    client, papers = tracking.client(), {}
    for pid in registry.paper_ids():
        experiment = client.get_experiment_by_name(f"paperline/{pid}")
        runs = [] if experiment is None else client.search_runs(
            [experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1,
            filter_string=f"attributes.start_time >= {started_ms} and attributes.start_time <= {ended_ms} "
                          "and tags.`paperline.profile` = 'smoke' and tags.`paperline.kind` = 'pipeline'")
        if not runs:
            continue
        run, metrics, tags = runs[0], runs[0].data.metrics, runs[0].data.tags
        rates = {k.removeprefix("timing/train/").removesuffix("/steps_per_s"): round(v, 1)
                 for k, v in metrics.items() if k.startswith("timing/train/") and k.endswith("/steps_per_s")}
        papers[pid] = {
            "wall_s": round((run.info.end_time - run.info.start_time) / 1000, 1) if run.info.end_time else None,
            **{k: round(v, 1) for k, v in metrics.items() if k.startswith("time/")},
            **{k: round(v, 1) for k, v in metrics.items() if k in ("cpu/replicate_mean_s", "cpu/replicate_max_s")},
            "steps_per_s": rates, "replicates": tags.get("paperline.replicates"), "status": run.info.status,
            "verdict": tags.get("claim.verdict"), "reason": (tags.get("claim.reason") or "")[:160]}
    return papers


def _seconds(stderr: str, label: str) -> float:
    found = re.search(rf"{label} \(seconds\): ([\d.]+)", stderr)
    return float(found.group(1)) if found else float("nan")


def _commit() -> str:
    """HEAD's short hash, marked `+dirty` when code differs from it (the numbers are then not HEAD's); what the run
    itself writes (dvc.lock, reports/, variants/) does not count, as for the runs' own commit tags."""
    from tasks import tracking

    commit = tracking.git_commit()
    return commit[:7] + ("+dirty" if commit.endswith("-dirty") else "")


def cpu_seconds(proc_stat: str, hz: int) -> dict[str, float]:
    """CPU seconds the machine has spent since boot, from /proc/stat's aggregate `cpu` line: busy (user, nice,
    system, irq, softirq: every state but idle, iowait and time stolen by the hypervisor) and, of it, niced."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, proc_stat.split("\n", 1)[0].split()[1:8])
    return {"busy_s": (user + nice + system + irq + softirq) / hz, "niced_s": nice / hz}


def machine_cpu() -> dict[str, float]:
    return cpu_seconds(Path("/proc/stat").read_text(), os.sysconf("SC_CLK_TCK"))


def autogroup() -> str:
    """The kernel's autogroup scheduling (1: each session gets a fair share whatever its nice value, so a `nice`d
    job elsewhere still takes up to a core from the suite)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "absent"


def run_suite(parallel: int) -> dict:
    command = ["/usr/bin/time", "-v", str(ROOT / ".venv" / "bin" / "paperline"), "run", "--all", "--force",
               "--parallel", str(parallel)]
    load_before, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    if autogroup() == "1":
        print("warning: kernel autogroup is on, so a niced job in another session still shares the cores fairly: "
              "run nothing else, or `echo 0 > /proc/sys/kernel/sched_autogroup_enabled`", flush=True)
    started_ms = int(time.time() * 1000)
    machine_before = machine_cpu()
    start = time.perf_counter()
    (ROOT / "runs").mkdir(exist_ok=True)
    with open(ROOT / "runs" / f"suite_run.parallel_{parallel}.log", "w") as log:  # the console, to follow it
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    machine_after = machine_cpu()
    cpu = _seconds(done.stderr, "User time") + _seconds(done.stderr, "System time")
    # what else the machine ran meanwhile: its busy CPU less the suite's own (kernel threads and this script make a
    # few seconds on a quiet machine; a helper's job shows here, and under `niced` when it ran niced)
    other = machine_after["busy_s"] - machine_before["busy_s"] - cpu
    niced = machine_after["niced_s"] - machine_before["niced_s"]
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    papers = collect(started_ms, int(time.time() * 1000))
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cores": cores,
            "core_busy": round(cpu / (wall * cores), 3), "load_1m_before": round(load_before, 2),
            "other_cpu_s": round(other, 1), "niced_cpu_s": round(niced, 1), "sched_autogroup": autogroup(),
            "exit_code": done.returncode, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": _commit(),
            "peak_rss_mb_largest_process": round(int(peak.group(1)) / 1024) if peak else None,
            "papers_finished": sum(p["status"] == "FINISHED" for p in papers.values()), "papers": papers}


def cached_rerun(repeats: int) -> dict:
    """Right after a suite: `paperline run --all` and `paperline run sei` with nothing changed, wall seconds each."""
    def wall(*args: str) -> float:
        start = time.perf_counter()
        subprocess.run([str(ROOT / ".venv" / "bin" / "paperline"), "run", *args], cwd=ROOT, check=True,
                       capture_output=True)
        return round(time.perf_counter() - start, 2)

    return {"all_s": [wall("--all") for _ in range(repeats)], "one_paper_s": [wall("sei") for _ in range(repeats)],
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit(),
            "load_1m_before": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", type=int, action="append", default=[])
    parser.add_argument("--cached", type=int, default=0, metavar="N",
                        help="only time the cached rerun (suite and one paper), N times each")
    args = parser.parse_args()
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    if args.cached:
        results["cached_rerun"] = cached_rerun(args.cached)
        OUT.write_text(json.dumps(results, indent=1))
        print(results["cached_rerun"], flush=True)
        return
    for parallel in args.parallel or [1, 2]:
        results[f"parallel_{parallel}"] = run_suite(parallel)
        OUT.write_text(json.dumps(results, indent=1))
        print(parallel, {k: v for k, v in results[f"parallel_{parallel}"].items() if k != "papers"}, flush=True)


if __name__ == "__main__":
    main()
