"""How long `paperline plan --all` takes: this tree against a reference revision, side by side, cold and warm cache.

    python benchmarks/plan_speed.py [--reference REV] [--repeats 1]      # default reference: fe581ef

For each repeat, in this order: the reference cold, this tree cold, the reference warm, this tree warm. The
reference is a `git worktree` of REV (sharing this tree's `.venv`); "cold" moves the tree's planning cache
(`.cache/plan-data`) away first, as on a fresh clone; "warm" runs again on the cache the cold run left. Each run is
`paperline plan --all --json` in a fresh process: its wall seconds, the user and system CPU seconds of it and its
children, and from its JSON how many papers traced to the end and how many fit. Run it on a quiet machine: the
planners use both cores. Writes benchmarks/results/plan_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "plan_speed.json"
REFERENCE = "fe581ef"  # the end of the fourth session (2026-12-02): 151 s cold, 114 s warm in its closing note


def plan_all(tree: Path, cold: bool) -> dict[str, float]:
    """One `paperline plan --all --json` in `tree`: wall, CPU and what it planned."""
    cache = tree / ".cache" / "plan-data"
    if cold and cache.exists():
        shutil.rmtree(cache)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "--all", "--json"], cwd=tree, text=True,
                          capture_output=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(tree), "PAPERLINE_ROOT": str(tree)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    plans = json.loads(done.stdout[done.stdout.index("["):])
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime,
            "complete": sum(bool(p.get("complete")) for p in plans), "fits": sum(bool(p.get("fits")) for p in plans),
            "papers": len(plans)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default=REFERENCE)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "reference"
        subprocess.run(["git", "worktree", "add", "--detach", str(ref), args.reference], cwd=ROOT, check=True,
                       capture_output=True)
        (ref / ".venv").symlink_to(ROOT / ".venv")
        saved = ROOT / ".cache" / "plan-data"
        aside = Path(tmp) / "plan-data"
        if saved.exists():  # this tree's cache is put back afterwards
            shutil.move(saved, aside)
        runs: dict[str, list[dict]] = {f"{who} {cache}": [] for cache in ("cold", "warm") for who in ("reference",
                                                                                                      "this tree")}
        try:
            for i in range(args.repeats):
                for cache in ("cold", "warm"):
                    for who, tree in (("reference", ref), ("this tree", ROOT)):
                        runs[f"{who} {cache}"].append(result := plan_all(tree, cold=cache == "cold"))
                        print(f"repeat {i + 1} {who} {cache}: {result['wall_s']:.1f} s wall, "
                              f"{result['user_s'] + result['sys_s']:.0f} CPU s, {result['complete']} complete, "
                              f"{result['fits']} fit", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref)], cwd=ROOT, capture_output=True)
            if aside.exists():
                shutil.rmtree(saved, ignore_errors=True)
                shutil.move(aside, saved)

    def median(rows: list[dict], key: str) -> float:
        return sorted(r[key] for r in rows)[len(rows) // 2]

    summary = {cache: {"reference_wall_s": median(runs[f"reference {cache}"], "wall_s"),
                       "this_wall_s": median(runs[f"this tree {cache}"], "wall_s"),
                       "ratio": median(runs[f"this tree {cache}"], "wall_s") / median(runs[f"reference {cache}"],
                                                                                      "wall_s")}
               for cache in ("cold", "warm")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"reference": args.reference, "this": head, "cores": os.cpu_count(),
                               "load_at_start": load, "summary": summary, "runs": runs}, indent=1) + "\n")
    for cache, s in summary.items():
        print(f"{cache}: {s['this_wall_s']:.1f} s against {s['reference_wall_s']:.1f} s (x{s['ratio']:.2f})")
    print(f"written to {OUT}")


if __name__ == "__main__":
    main()
