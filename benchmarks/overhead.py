"""What orchestration costs: a paper's smoke pipeline through `paperline run` against the same prepare / train /
evaluate called in one bare process, side by side, median of several repeats; plus the cached rerun and 1 vs 2 ranks.

    python benchmarks/overhead.py [paper] [--repeats 3]        # default: sei

Each repeat runs, in this order and each in a fresh process:
- bare: prepare into a temporary folder, `train_in_process` (one rank, no MLflow), evaluate (no logging);
- pipeline, 1 rank: `paperline run <paper> --set ranks=1 --force` (Prefect + DVC check + torchrun/DeepSpeed + MLflow);
- cached: the same command without --force (answered from MLflow and a DVC status);
- pipeline, 2 ranks: `paperline run <paper> --set ranks=2 --force`.
The pipeline's own stage times (time/*_s in MLflow) break its wall time down. Writes benchmarks/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "overhead.json"
PAPERLINE = [sys.executable, "-m", "flows.cli"]

BARE = """
import sys, tempfile
from pathlib import Path
from models import registry
from tasks import settings
from tasks.steps import evaluate
from tasks.worker import train_in_process
pid = sys.argv[1]
params = registry.resolve(pid, "smoke", {"ranks": 1}, settings.params_file())
with tempfile.TemporaryDirectory() as tmp:
    data, out = Path(tmp) / "data", Path(tmp) / "out"
    data.mkdir()
    registry.get(pid).prepare(params, data)
    train_in_process(pid, params, data, out)
    evaluate(registry.get(pid), params, data, out, run_id=None)
"""


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def stage_times(paper: str, ranks: int) -> dict[str, float]:
    from tasks import tracking

    client = tracking.client()
    exp = client.get_experiment_by_name(f"paperline/{paper}")
    run = client.search_runs([exp.experiment_id], filter_string=f"params.ranks = '{ranks}'",
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    return {k: round(v, 2) for k, v in run.data.metrics.items() if k.startswith("time/")}


def main(paper: str, repeats: int) -> None:
    samples: dict[str, list[float]] = {"bare_s": [], "pipeline_1rank_s": [], "cached_s": [], "pipeline_2ranks_s": []}
    stages: dict[str, list[dict]] = {"1": [], "2": []}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(BARE)
    for i in range(repeats):
        samples["bare_s"].append(timed([sys.executable, script.name, paper]))
        samples["pipeline_1rank_s"].append(timed([*PAPERLINE, "run", paper, "--set", "ranks=1", "--force"]))
        stages["1"].append(stage_times(paper, 1))
        samples["cached_s"].append(timed([*PAPERLINE, "run", paper, "--set", "ranks=1"]))
        samples["pipeline_2ranks_s"].append(timed([*PAPERLINE, "run", paper, "--set", "ranks=2", "--force"]))
        stages["2"].append(stage_times(paper, 2))
        print(f"repeat {i + 1}/{repeats}:", {k: round(v[-1], 1) for k, v in samples.items()}, flush=True)
    median = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    train = {r: statistics.median(s["time/train_s"] for s in stages[r]) for r in stages}
    result = {
        "paper": paper, "repeats": repeats, "median": median, "samples": samples, "stage_times": stages,
        "ratio_pipeline_to_bare": round(median["pipeline_1rank_s"] / median["bare_s"], 3),
        "fixed_cost_s": round(median["pipeline_1rank_s"] - median["bare_s"], 1),
        "train_speedup_2_vs_1_ranks": round(train["1"] / train["2"], 3),
        "scaling_efficiency_2_ranks": round(train["1"] / train["2"] / 2, 3),
    }
    OUT.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "stage_times")}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paper", nargs="?", default="sei")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    main(args.paper, args.repeats)
