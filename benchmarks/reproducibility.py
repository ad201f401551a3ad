"""Which papers reproduce bitwise: each paper's run, then `paperline reproduce <run>` on it (a scratch checkout at
the recorded commit, the recorded params, the same world size), metric by metric.

    python benchmarks/reproducibility.py [paper ...] [--profile test] [--set ranks=2]

Writes benchmarks/results/reproducibility.json after every paper: exit codes, how many metrics were compared, which
differed and by how much. The `test` profile keeps this to about a minute a paper; `--set ranks=2` asks the
multi-rank question (gloo all-reduce order, sharded data) where a paper's test profile allows two ranks. With no
papers named it skips those already compared under the same profile and overrides.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "reproducibility.json"
PAPERLINE = [sys.executable, "-m", "flows.cli"]


def check(paper: str, profile: str, overrides: list[str]) -> dict:
    from flows import reproduce
    from flows.report import latest_run

    sets = [arg for o in overrides for arg in ("--set", o)]
    first = subprocess.run([*PAPERLINE, "run", paper, "--profile", profile, "--force", *sets], cwd=ROOT,
                           capture_output=True, text=True)
    if first.returncode != 0:
        return {"run_exit": first.returncode, "error": first.stdout[-500:] + first.stderr[-500:]}
    original = latest_run(paper, profile).info.run_id
    try:
        result = reproduce.reproduce(original)
    except Exception as e:  # noqa: BLE001 - a failed rerun is a result to record, not a reason to stop
        return {"run_exit": 0, "original": original, "error": f"{type(e).__name__}: {e}"[:500]}
    differing = {name: {"original": a, "reproduced": b} for name, a, b in result.rows
                 if name in result.mismatched}
    return {"run_exit": 0, "original": original, "reproduced": result.new_run, "bitwise": result.matches,
            "metrics": len(result.rows), "same_data": result.data_hash[0] == result.data_hash[1],
            "differing": differing}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("papers", nargs="*")
    parser.add_argument("--profile", default="test")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    from models import registry

    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    key = ",".join([args.profile, *args.overrides])
    # with no papers named, continue where an interrupted run stopped (and retry the ones that errored)
    done = {paper for paper, entry in results.get(key, {}).items() if "bitwise" in entry}
    for paper in args.papers or [p for p in registry.paper_ids() if p not in done]:
        results.setdefault(key, {})[paper] = check(paper, args.profile, args.overrides)
        OUT.write_text(json.dumps(results, indent=1, sort_keys=True))
        entry = results[key][paper]
        print(paper, "bitwise" if entry.get("bitwise") else f"NOT bitwise: {sorted(entry.get('differing', {}))}"
              if "bitwise" in entry else f"error: {entry.get('error', '')[:200]}", flush=True)


if __name__ == "__main__":
    main()
