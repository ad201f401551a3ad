"""Wall time and peak memory of each paper's smoke pipeline through `paperline run` (sequential, one at a time).

    python benchmarks/suite_times.py [paper ...]     # default: every registered paper

Writes benchmarks/results/suite_times.json after every paper (so a partial run keeps its numbers). Each entry:
wall seconds of the whole command, the flow's own stage times from MLflow (time/*_s), the peak RSS of the
command's process tree, the verdict and the exit code.
"""

from __future__ import annotations

import json
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
        start = time.perf_counter()
        proc = subprocess.run([str(ROOT / ".venv" / "bin" / "paperline"), "run", pid, "--force"], cwd=ROOT,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # largest child so far
        run = latest_run(pid, "smoke")
        stages = {k: round(v, 1) for k, v in (run.data.metrics.items() if run else []) if k.startswith("time/")}
        verdict = run.data.tags.get("claim.holds") if run else None
        results[pid] = {"wall_s": round(wall, 1), "stages": stages, "peak_rss_mb_so_far": round(peak_mb),
                        "exit_code": proc.returncode, "claim_holds": verdict}
        OUT.write_text(json.dumps(results, indent=1))
        print(pid, results[pid], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
