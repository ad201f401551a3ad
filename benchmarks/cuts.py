"""Each cut of the orchestration's fixed cost, measured side by side: `paperline run <paper> --force` at several
commits, one after the other in each repeat, plus the bare in-process run of the same work as the reference.

    python benchmarks/cuts.py <commit> [<commit> ...] [--paper sei] [--profile test] [--repeats 5]

The test profile trains a few steps, so what is measured is almost only the fixed cost (interpreter and imports,
Prefect's API, the DVC check, the DeepSpeed launch, MLflow, exit). Each commit runs from its own git worktree
(`.cache/cuts/<commit>`, own MLflow store and data), sharing this checkout's .venv and DeepSpeed op build; a
first untimed run per worktree prepares its data. Writes benchmarks/results/cuts-<profile>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.overhead import BARE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def worktree(commit: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = ROOT / ".cache" / "cuts" / sha
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def timed(command: list[str], cwd: Path) -> float:
    env = dict(os.environ)
    env.pop("PAPERLINE_ROOT", None)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command} in {cwd} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def main(commits: list[str], paper: str, profile: str, repeats: int) -> None:
    trees = {commit: worktree(commit) for commit in commits}
    # one rank, as the bare reference trains
    pipeline = [sys.executable, "-m", "flows.cli", "run", paper, "--profile", profile, "--set", "ranks=1", "--force"]
    for tree in trees.values():  # untimed: prepares the data, builds nothing else
        timed(pipeline[:-1], tree)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(BARE)
    samples: dict[str, list[float]] = {"bare": [], **{c: [] for c in commits}}
    for i in range(repeats):
        samples["bare"].append(timed([sys.executable, script.name, paper, profile], ROOT))
        for commit, tree in trees.items():
            samples[commit].append(timed(pipeline, tree))
        print(f"repeat {i + 1}/{repeats}:", {k: round(v[-1], 2) for k, v in samples.items()}, flush=True)
    median = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    result = {"paper": paper, "profile": profile, "repeats": repeats, "median_s": median,
              "fixed_cost_s": {c: round(median[c] - median["bare"], 2) for c in commits},
              "samples": samples}
    out = ROOT / "benchmarks" / "results" / f"cuts-{profile}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--paper", default="sei")
    parser.add_argument("--profile", default="test")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    main(args.commits, args.paper, args.profile, args.repeats)
