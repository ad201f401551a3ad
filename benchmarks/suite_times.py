"""Wall time and peak memory of each paper's smoke pipeline through `paperline run` (sequential, one at a time).

    python benchmarks/suite_times.py [paper ...]     # default: every registered paper

Writes benchmarks/results/suite_times.json after every paper (so a partial run keeps its numbers). Each entry:
wall seconds of the whole command, the flow's own stage times from MLflow (time/*_s), the peak RSS of the
command's process tree, its CPU seconds (user + system of all its processes; a machine shared with other work
inflates wall time far more than CPU time), the 1-minute load average at the start, the verdict and the exit code.
Run it at a high priority when other work shares the machine: `nice -n -10 python benchmarks/suite_times.py`.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "suite_times.json"


def main(ids: list[str]) -> None:
    from flows.report import latest_run
    from models import registry

    ids = ids or list(registry.papers())
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    for pid in ids:
        load = os.getloadavg()[0]
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([str(ROOT / ".venv" / "bin" / "paperline"), "run", pid, "--force"], cwd=ROOT,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = sum(getattr(cpu_after, f) - getattr(cpu_before, f) for f in ("ru_utime", "ru_stime"))
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # largest child so far
        run = latest_run(pid, "smoke")
        stages = {k: round(v, 1) for k, v in (run.data.metrics.items() if run else []) if k.startswith("time/")}
        verdict = run.data.tags.get("claim.verdict") if run else None
        results[pid] = {"wall_s": round(wall, 1), "cpu_s": round(cpu_s, 1), "load_at_start": round(load, 1),
                        "stages": stages, "peak_rss_mb_so_far": round(peak_mb),
                        "exit_code": proc.returncode, "verdict": verdict}
        OUT.write_text(json.dumps(results, indent=1))
        print(pid, results[pid], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
