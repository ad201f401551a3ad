"""`paperline reproduce <run id>`: rerun a recorded run from its lineage in a scratch checkout and compare, metric
by metric, with the original.

The lineage a run records (see `flows/pipeline.py`): the commit holding exactly its tracked code (`paperline.code_ref`,
kept alive by `refs/paperline/<run id>`), the params as given with the profile (`inputs/run_inputs.json`; the world
size is `params.ranks`), the torch threads each rank trained with (`paperline.threads_per_rank`: the rerun is pinned
to as many cores), and the DVC data hash. The scratch is a shared clone of this repository at that commit with
the recorded params written into its `params.yaml`; it uses this project's DVC cache and MLflow store, so the new
run lands beside the original, tagged `paperline.reproduces=<run id>`. Timings (`time/*`), CPU seconds (`cpu/*`)
and the wall-clock rates, loads and waits (`timing/*`: training steps a second, the load and waits timed parts were
measured under) are not compared.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from models.registry import ConfigError
from tasks import settings, tracking

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Comparison:
    original_run: str
    new_run: str
    data_hash: tuple[str, str]  # original, new
    rows: list[tuple[str, float | None, float | None]]  # metric, original, new

    @property
    def mismatched(self) -> list[str]:
        return [name for name, a, b in self.rows if a is None or b is None or a != b]

    @property
    def matches(self) -> bool:
        return not self.mismatched and self.data_hash[0] == self.data_hash[1]

    def table(self) -> str:
        lines = [f"reproduce {self.original_run} -> {self.new_run}",
                 f"data hash: {self.data_hash[0]} vs {self.data_hash[1]} "
                 f"({'same' if self.data_hash[0] == self.data_hash[1] else 'DIFFERENT'})",
                 "| metric | original | reproduced | bitwise |", "| --- | --- | --- | --- |"]
        for name, a, b in self.rows:
            if a is None or b is None:
                verdict = "missing"
            else:
                verdict = "yes" if a == b else f"no ({b - a:+.3g})"
            lines.append(f"| {name} | {a!r} | {b!r} | {verdict} |")
        lines.append(f"{len(self.rows) - len(self.mismatched)}/{len(self.rows)} metrics identical: "
                     + ("REPRODUCED" if self.matches else "NOT reproduced"))
        return "\n".join(lines)


def recorded_inputs(run_id: str) -> tuple[dict, str]:
    """The run's recorded inputs and code commit; ConfigError when the run lacks them."""
    client = tracking.client()
    try:
        run = client.get_run(run_id)
    except Exception as e:  # noqa: BLE001 - MLflow raises its own exception types for an unknown id
        raise ConfigError(f"no MLflow run {run_id!r} in {settings.mask(settings.tracking_uri())}: {e}") from None
    code_ref = run.data.tags.get("paperline.code_ref")
    if not code_ref:
        raise ConfigError(f"run {run_id} records no code commit (paperline.code_ref): it was not started by a "
                          "paperline pipeline, or before reproduction existed")
    with tempfile.TemporaryDirectory() as tmp:
        inputs = json.loads(Path(client.download_artifacts(run_id, "inputs/run_inputs.json", tmp)).read_text())
    return inputs, code_ref


def scratch_checkout(code_ref: str, inputs: dict, folder: Path) -> Path:
    """A shared clone at `code_ref` whose params.yaml holds the recorded params under the recorded profile."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    git = ["git", "-c", "advice.detachedHead=false"]
    subprocess.run([*git, "clone", "-q", "--shared", "--no-checkout", str(PACKAGE_ROOT), str(folder)], check=True)
    subprocess.run([*git, "-C", str(folder), "checkout", "-q", "--detach", code_ref], check=True)
    params_file = folder / "params.yaml"
    params = yaml.safe_load(params_file.read_text())
    params["papers"].setdefault(inputs["paper"], {})[inputs["profile"]] = inputs["raw_params"]
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    cache = subprocess.run([sys.executable, "-m", "dvc", "cache", "dir"], cwd=settings.root(), capture_output=True,
                           text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "dvc", "cache", "dir", "--local", cache], cwd=folder, check=True,
                   capture_output=True)
    return folder


def replay_cores(recorded_threads: str | None, params: dict) -> list[int] | None:
    """The cores the rerun is pinned to so that each rank gets the recorded torch thread count (a run without a
    `threads` param takes its cores over its ranks: one core in a `--parallel 2` suite, two alone, and the results
    move at rounding level with it); None where nothing needs pinning or this machine has too few cores (said)."""
    if params.get("threads") or not recorded_threads:
        return None  # pinned by the params, or recorded before the thread count was
    wanted = int(recorded_threads) * int(params.get("ranks") or 1)
    cores = sorted(os.sched_getaffinity(0))
    if wanted > len(cores):
        print(f"reproduce: the run used {recorded_threads} torch threads a rank; this machine has {len(cores)} "
              "cores for all ranks, so metrics may differ at rounding level")
        return None
    return cores[:wanted]


def reproduce(run_id: str, keep: bool = False) -> Comparison:
    inputs, code_ref = recorded_inputs(run_id)
    paper, profile = inputs["paper"], inputs["profile"]
    scratch = scratch_checkout(code_ref, inputs, settings.root() / ".cache" / "reproduce" / run_id)
    env = {**os.environ, "PAPERLINE_ROOT": str(scratch), "PYTHONPATH": str(scratch),
           "MLFLOW_TRACKING_URI": settings.tracking_uri(), "PAPERLINE_REPRODUCES": run_id}
    client = tracking.client()
    original = client.get_run(run_id)
    cores = replay_cores(original.data.tags.get("paperline.threads_per_rank"), inputs["params"])
    started = int(time.time() * 1000)
    try:
        subprocess.run([sys.executable, "-m", "flows.cli", "run", paper, "--profile", profile, "--force"],
                       cwd=scratch, env=env, check=True,
                       preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores))
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
    found = client.search_runs([original.info.experiment_id],
                               filter_string=f"tags.`paperline.reproduces` = '{run_id}' and "
                                             f"attributes.start_time >= {started}",
                               order_by=["attributes.start_time DESC"], max_results=1)
    if not found:
        raise RuntimeError(f"the rerun of {run_id} finished but recorded no MLflow run tagged paperline.reproduces")
    new = found[0]
    a, b = original.data.metrics, new.data.metrics
    rows = [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if not _measured_cost(k)]
    result = Comparison(run_id, new.info.run_id, (original.data.tags.get("paperline.data_hash", ""),
                                                  new.data.tags.get("paperline.data_hash", "")), rows)
    client.set_tag(new.info.run_id, "paperline.reproduced", str(result.matches).lower())
    client.log_text(new.info.run_id, result.table(), "reproduce.md")
    return result


def _measured_cost(metric: str) -> bool:
    """Wall time, rates and CPU seconds (and their statistics over replicates) differ run to run by nature."""
    return metric.removeprefix("stats/").startswith(("time/", "timing/", "cpu/"))
