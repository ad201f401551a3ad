"""The whole suite in one command, sequential against papers side by side: `paperline run --all --force
[--parallel N]`, its wall time and peak memory, and every paper's stage times from the MLflow runs it made.

    python benchmarks/suite_run.py --parallel 1 --parallel 2     # each setting once, in the order given

Run it on a quiet machine with the data stages up to date (`dvc repro` first), so that both settings do the same
work. Writes benchmarks/results/suite_run.json: per setting the wall seconds, the largest process's peak RSS, and
per paper `time/{prepare,train,evaluate,total}_s` and the verdict.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "suite_run.json"


def collect(started_ms: int, ended_ms: int) -> dict[str, dict]:
    """Stage times and verdict of every paper's smoke run that started inside the window."""
    from models import registry
    from tasks import tracking

    client, papers = tracking.client(), {}
    for pid in registry.paper_ids():
        experiment = client.get_experiment_by_name(f"paperline/{pid}")
        runs = [] if experiment is None else client.search_runs(
            [experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1,
            filter_string=f"attributes.start_time >= {started_ms} and attributes.start_time <= {ended_ms} "
                          "and tags.`paperline.profile` = 'smoke' and tags.`paperline.kind` = 'pipeline'")
        if runs:
            run = runs[0]
            papers[pid] = {**{k: round(v, 1) for k, v in run.data.metrics.items() if k.startswith("time/")},
                           "status": run.info.status, "verdict": run.data.tags.get("claim.verdict")}
    return papers


def run_suite(parallel: int) -> dict:
    command = ["/usr/bin/time", "-v", str(ROOT / ".venv" / "bin" / "paperline"), "run", "--all", "--force",
               "--parallel", str(parallel)]
    started_ms = int(time.time() * 1000)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    papers = collect(started_ms, int(time.time() * 1000))
    return {"wall_s": round(wall, 1), "exit_code": done.returncode,
            "peak_rss_mb_largest_process": round(int(peak.group(1)) / 1024) if peak else None,
            "papers_finished": sum(p["status"] == "FINISHED" for p in papers.values()), "papers": papers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", type=int, action="append", default=[])
    args = parser.parse_args()
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    for parallel in args.parallel or [1, 2]:
        results[f"parallel_{parallel}"] = run_suite(parallel)
        OUT.write_text(json.dumps(results, indent=1))
        print(parallel, {k: v for k, v in results[f"parallel_{parallel}"].items() if k != "papers"}, flush=True)


if __name__ == "__main__":
    main()
