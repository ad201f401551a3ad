"""What orchestration costs: a paper's smoke pipeline through `paperline run` against the same prepare / train /
evaluate called in one bare process, side by side, median of several repeats; plus the cached rerun and 1 vs 2 ranks.

    python benchmarks/overhead.py [paper] [--repeats 3]        # default: sei

Each repeat runs, in this order and each in a fresh process:
- bare: prepare into a temporary folder, `train_in_process` (one rank, no MLflow), evaluate (no logging);
- pipeline, 1 rank: `paperline run <paper> --set ranks=1 --force` (Prefect + DVC check + torchrun/DeepSpeed + MLflow);
- cached: the same command without --force (answered from MLflow and a DVC status);
- pipeline, 2 ranks: `paperline run <paper> --set ranks=2 --force`.
The pipeline's own stage times (time/*_s in MLflow) break its wall time down. The training loops' own time (steps /
rate of each phase's last progress line, printed by both) is subtracted from each wall time: what is left is the
fixed cost, without the loops' run-to-run spread on a shared machine. Writes benchmarks/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import re
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
import json, sys, tempfile, time
from pathlib import Path
from models import registry
from tasks import settings
from tasks.steps import evaluate
from tasks.worker import train_in_process
pid, profile = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "smoke")
params = registry.resolve(pid, profile, {"ranks": 1}, settings.params_file())
with tempfile.TemporaryDirectory() as tmp:
    data, out = Path(tmp) / "data", Path(tmp) / "out"
    data.mkdir()
    t0 = time.perf_counter()
    registry.get(pid).prepare(params, data)
    t1 = time.perf_counter()
    train_in_process(pid, params, data, out)
    t2 = time.perf_counter()
    evaluate(registry.get(pid), params, data, out, run_id=None)
    t3 = time.perf_counter()
print(json.dumps({"time/prepare_s": t1 - t0, "time/train_s": t2 - t1, "time/evaluate_s": t3 - t2}))
"""


PROGRESS = re.compile(r"phase (\S+): step (\d+)/(\d+) .*\(([\d.]+) it/s\)")


def timed(command: list[str]) -> tuple[float, str, float]:
    """Wall seconds, stdout, and the seconds spent in training loops (from the progress lines on stderr)."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    last: dict[str, float] = {}
    for phase, step, total, rate in PROGRESS.findall(done.stderr):
        if step == total:  # the rate is averaged over the whole phase: steps / rate is the loop's time
            last[phase] = int(total) / float(rate)
    return wall, done.stdout, sum(last.values())


def stage_times(paper: str, ranks: int) -> dict[str, float]:
    from tasks import tracking

    client = tracking.client()
    exp = client.get_experiment_by_name(f"paperline/{paper}")
    run = client.search_runs([exp.experiment_id], filter_string=f"params.ranks = '{ranks}'",
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    return {k: round(v, 2) for k, v in run.data.metrics.items() if k.startswith("time/")}


def main(paper: str, repeats: int) -> None:
    samples: dict[str, list[float]] = {"bare_s": [], "pipeline_1rank_s": [], "cached_s": [], "pipeline_2ranks_s": []}
    loops: dict[str, list[float]] = {"bare_s": [], "pipeline_1rank_s": [], "pipeline_2ranks_s": []}
    stages: dict[str, list[dict]] = {"bare": [], "1": [], "2": []}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(BARE)
    for i in range(repeats):
        wall, out, loop = timed([sys.executable, script.name, paper])
        samples["bare_s"].append(wall)
        loops["bare_s"].append(loop)
        stages["bare"].append(json.loads(out.strip().splitlines()[-1]))
        for ranks in (1, 2):
            wall, _, loop = timed([*PAPERLINE, "run", paper, "--set", f"ranks={ranks}", "--force"])
            name = f"pipeline_{ranks}rank{'s' if ranks > 1 else ''}_s"
            samples[name].append(wall)
            loops[name].append(loop)
            stages[str(ranks)].append(stage_times(paper, ranks))
            if ranks == 1:
                samples["cached_s"].append(timed([*PAPERLINE, "run", paper, "--set", "ranks=1"])[0])
        print(f"repeat {i + 1}/{repeats}:", {k: round(v[-1], 1) for k, v in samples.items()}, flush=True)
    median = {k: round(statistics.median(v), 2) for k, v in samples.items()}

    def stage(run: str, name: str) -> float:
        return round(statistics.median(s[f"time/{name}_s"] for s in stages[run]), 2)

    # where the pipeline's extra time goes, stage by stage against the bare run (one rank each)
    breakdown = {name: {"bare_s": stage("bare", name), "pipeline_s": stage("1", name)}
                 for name in ("prepare", "train", "evaluate")}
    breakdown["outside_flow"] = {  # interpreter, imports, CLI checks, the temporary Prefect API start and stop
        "bare_s": round(median["bare_s"] - sum(stage("bare", n) for n in ("prepare", "train", "evaluate")), 2),
        "pipeline_s": round(median["pipeline_1rank_s"] - stage("1", "total"), 2)}
    # wall minus training loops, run by run: the fixed cost without the loops' spread
    outside = {k: [w - loop for w, loop in zip(samples[k], loops[k], strict=True)] for k in loops}
    rest = {k: round(statistics.median(v), 2) for k, v in outside.items()}
    minute = 60.0
    result = {
        "paper": paper, "repeats": repeats, "median": median, "breakdown": breakdown, "samples": samples,
        "loop_s": loops, "outside_loops_median_s": rest,
        "fixed_cost_outside_loops_s": round(rest["pipeline_1rank_s"] - rest["bare_s"], 2),
        "ratio_at_one_minute_of_loops": round((minute + rest["pipeline_1rank_s"]) / (minute + rest["bare_s"]), 3),
        "stage_times": stages,
        "ratio_pipeline_to_bare": round(median["pipeline_1rank_s"] / median["bare_s"], 3),
        "fixed_cost_s": round(median["pipeline_1rank_s"] - median["bare_s"], 1),
        "train_speedup_2_vs_1_ranks": round(stage("1", "train") / stage("2", "train"), 3),
        "scaling_efficiency_2_ranks": round(stage("1", "train") / stage("2", "train") / 2, 3),
    }
    OUT.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "stage_times", "loop_s")}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paper", nargs="?", default="sei")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    main(args.paper, args.repeats)
