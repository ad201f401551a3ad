"""What replicates cost: `paperline run <id> --force --set replicates=1` against `--set replicates=3`, one right
after the other on the same machine, per paper; the ratio of wall times, and where the time went.

    python benchmarks/replicates.py sei ldka qubo_relax     # the papers to measure, in order

Run it on a quiet machine (nothing else training): timings under load are not worth keeping. Each setting runs
with an override, so both use variant data stages; a setting whose worlds were prepared before finds them up to
date (DVC), so run it twice to compare training and evaluation alone (`time/prepare_s` is reported apart).
Writes benchmarks/results/replicates.json: per paper and setting the command's wall seconds and the parent run's
`time/{prepare,replicates,conclude,total}_s`, and the ratios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "replicates.json"


def one(paper: str, replicates: int) -> dict:
    command = [str(ROOT / ".venv" / "bin" / "paperline"), "run", paper, "--force", "--set", f"replicates={replicates}"]
    started_ms = int(time.time() * 1000)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    from tasks import tracking

    client = tracking.client()
    experiment = client.get_experiment_by_name(f"paperline/{paper}")
    (run,) = client.search_runs([experiment.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
                                filter_string=f"attributes.start_time >= {started_ms} and "
                                              "tags.`paperline.kind` = 'pipeline'")
    stages = {k: round(v, 1) for k, v in run.data.metrics.items() if k.startswith("time/")}
    return {"wall_s": round(wall, 1), "load_at_start": round(os.getloadavg()[0], 1), "verdict":
            run.data.tags.get("claim.verdict"), **stages}


def main() -> None:
    papers = sys.argv[1:] or ["sei"]
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    for paper in papers:
        single, triple = one(paper, 1), one(paper, 3)
        results[paper] = {"replicates_1": single, "replicates_3": triple,
                          "ratio_wall": round(triple["wall_s"] / single["wall_s"], 2),
                          "ratio_without_prepare": round((triple["wall_s"] - triple.get("time/prepare_s", 0)) /
                                                         (single["wall_s"] - single.get("time/prepare_s", 0)), 2)}
        print(paper, json.dumps(results[paper]), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    total = {k: sum(r[k]["wall_s"] for r in results.values()) for k in ("replicates_1", "replicates_3")}
    print(f"{len(results)} papers: {total['replicates_1']:.0f} s with 1 replicate, {total['replicates_3']:.0f} s "
          f"with 3: {total['replicates_3'] / total['replicates_1']:.2f}x")


if __name__ == "__main__":
    main()
