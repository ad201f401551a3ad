"""MLflow tracking with explicit run ids (never the per-thread "active run"): one experiment per paper, one run per
pipeline run, and the cache lookup that lets an unchanged rerun reuse its earlier result.

The cache key (documented in the README) is sha256 over: the code training imports (tasks/keys.py), the claim and
the decision rule, the params as given (profile + overrides), and the DVC data hash. It is the only "already ran"
check above DVC. A replicate's child run is keyed by training alone (`training_key`), so a run whose claim or
decision rule changed, or that asks for more replicates, finds the replicates already trained (`find_trained`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from models.registry import module_file
from tasks import embedded_store, keys, settings
from tasks.settings import mask

TAG = "paperline."


def client():
    """An `MlflowClient` on the tracking store (mlflow is imported here, not at module import: ~2 s that commands
    such as `paperline list` do without)."""
    from mlflow import MlflowClient

    _quiet_mlflow()
    # explicit client only: mlflow.set_tracking_uri would also export MLFLOW_TRACKING_URI to every later
    # subprocess and workspace of this process
    uri = settings.tracking_uri()
    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    # opening the embedded store creates or migrates its tables; two processes doing that at once corrupt the
    # migration (alembic "expected to match one row"), so the first opening per process is serialised by a lock
    with open(Path(uri.removeprefix("sqlite:///")).with_suffix(".db.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        return MlflowClient(uri)


@functools.cache
def _quiet_mlflow() -> None:
    """MLflow's INFO lines ("Creating initial MLflow database tables", alembic's migrations) to the log file."""
    settings.route_chatter("mlflow", "alembic")


def store_exists() -> bool:
    """False only for an embedded SQLite store not created yet (opening it would create it)."""
    uri = settings.tracking_uri()
    return not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).exists()


def check_reachable() -> None:
    """Fail before any work when the tracking server is down, with what to do about it. A server's port is probed
    first, so a dead server fails in milliseconds instead of after MLflow's retries with backoff (minutes). An
    embedded store that `embedded_store` can read is reachable without starting MLflow."""
    if embedded_store.usable():
        return
    uri = settings.tracking_uri()
    try:
        parsed = urlparse(uri)
        if parsed.scheme in ("http", "https"):
            socket.create_connection((parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)),
                                     timeout=5).close()
        client().search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 - any failure here means "cannot track"
        raise RuntimeError(mask(f"MLflow tracking at {uri} is unreachable ({type(e).__name__}: {e}). "
                                "Start the server or unset MLFLOW_TRACKING_URI to use the embedded store.")) from None


# MLflow's UI opens an experiment by its kind: without this tag, 3.x shows the GenAI view (traces, token usage);
# with it, runs, metric charts and plots
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def verdict_of(tags: Mapping[str, str]) -> str:
    """A run's verdict from its tags ("" when it has none); runs from before three verdicts recorded only
    `claim.holds`."""
    if tags.get("claim.verdict"):
        return tags["claim.verdict"]
    return {"true": "holds", "false": "does not hold"}.get(tags.get("claim.holds", ""), "")


def ui_link(base: str, exp_id: str, run_id: str | None = None, tab: str = "") -> str:
    """A link into the MLflow UI that opens in the model-training view. MLflow 3.17's UI picks its view from the
    link (`workflowType`) or the browser's last choice, GenAI by default; the experiment tag above is what MLflow
    records about the experiment, and what the UI reads where that switch is off."""
    page = f"{base.rstrip('/')}/#/experiments/{exp_id}" + (f"/runs/{run_id}" if run_id else "")
    page += f"/{tab}" if tab else ""
    return f"{page}?workflowType=machine_learning"


def experiment_id(paper_id: str) -> str:
    c, name = client(), f"paperline/{paper_id}"
    found = c.get_experiment_by_name(name)
    if found:
        if found.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:  # created before the tag: set it on opening
            c.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
        return found.experiment_id
    location = (settings.artifact_root() / paper_id).as_uri()
    return c.create_experiment(name, artifact_location=location,
                               tags={"paperline.paper": paper_id, EXPERIMENT_KIND[0]: EXPERIMENT_KIND[1]})


def cache_key(code: str, params: Mapping, data_hash: str) -> str:
    blob = json.dumps({"code": code, "params": params, "data": data_hash}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_key(paper_id: str, profile: str, raw_params: Mapping, data_hash: str) -> str:
    """The cache key of a pipeline run. It takes the params as given (profile section + overrides), not the
    validated model: the paper's code is in the key, so both identify the same work, and this way a cached rerun
    is found without importing the paper (torch and friends: seconds)."""
    paper_file = module_file(paper_id)
    code = f"{keys.training_hash(paper_file)}:{keys.verdict_hash(paper_file)}"
    return cache_key(code, {"profile": profile, "params": dict(raw_params)}, data_hash)


def training_key(paper_id: str, profile: str, replicate_raw: Mapping, data_hash: str) -> str:
    """The key of one replicate's training and evaluation: the code training imports (the claim stripped), the
    replicate's params as given (its seed; `replicates` is not among them) and its data hash."""
    return cache_key(keys.training_hash(module_file(paper_id)), {"profile": profile, "params": dict(replicate_raw)},
                     data_hash)


def find_trained(exp_id: str, paper_id: str, profile: str, key: str, data_hash: str, seed: object):
    """The newest finished replicate run of any pipeline run that trained exactly this (paper, profile, training
    key, data, seed): its stored metrics decide again without training."""
    runs = client().search_runs([exp_id], filter_string=f"tags.`{TAG}training_key` = '{key}' and "
                                f"tags.`{TAG}kind` = 'replicate' and tags.`{TAG}paper` = '{paper_id}' and "
                                f"tags.`{TAG}profile` = '{profile}' and tags.`{TAG}data_hash` = '{data_hash}' and "
                                f"tags.`{TAG}seed` = '{seed}' and attributes.status = 'FINISHED'",
                                order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def params_hash(profile: str, raw_params: Mapping) -> str:
    """The params part of the cache key on its own (the morning report names which part changed)."""
    blob = json.dumps({"profile": profile, "params": dict(raw_params)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def find_cached(exp_id: str, key: str):
    runs = client().search_runs([exp_id], filter_string=f"tags.`{TAG}cache_key` = '{key}' and "
                                f"attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                                max_results=1)
    return runs[0] if runs else None


def mark_reused(run_id: str) -> None:
    """Stamp a reused run, so the morning report can tell "skipped: unchanged" from "not run"."""
    stamp = str(int(time.time() * 1000))
    if path := embedded_store.usable():
        embedded_store.set_tag(path, run_id, f"{TAG}reused_at", stamp)
    else:
        client().set_tag(run_id, f"{TAG}reused_at", stamp)


def find_resumable(exp_id: str, key: str):
    """The newest run with this cache key that was killed or failed: its run folder holds the finished work
    (data, checkpoints, train outputs), so a rerun continues it instead of starting over."""
    runs = client().search_runs([exp_id], filter_string=f"tags.`{TAG}cache_key` = '{key}' and "
                                "attributes.status != 'FINISHED' and attributes.status != 'RUNNING'",
                                order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def find_replicate(exp_id: str, parent_id: str, index: int, key: str):
    """Replicate `index` of the pipeline run `parent_id`, newest first, if it started with the same work."""
    runs = client().search_runs([exp_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and "
                                f"tags.`{TAG}replicate` = '{index}' and tags.`{TAG}cache_key` = '{key}'",
                                order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def _git(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                         timeout=30, check=True, env=env)
    return out.stdout.strip()


# paperline's own outputs inside the tree (data locks, generated stages, reports it rewrites, what the benchmarks
# measured): never "dirty" (benchmarks/suite_run.py writes its results while the code it times is checked out)
GENERATED = ("dvc.lock", "variants", "reports", "benchmarks/results")


def git_commit() -> str:
    """HEAD of the code that runs, `-dirty` when tracked files other than paperline's outputs differ from it."""
    try:
        dirty = _git("status", "--porcelain", "--untracked-files=normal", "--", ".",
                     *(f":!{path}" for path in GENERATED))
        return _git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pin_code(run_id: str) -> str:
    """A commit holding exactly the code this run used, kept alive by `refs/paperline/<run id>`: HEAD when the tree
    is clean, else a snapshot of the working tree, new files included (ignored outputs are not code).
    `paperline reproduce` checks it out."""
    try:
        commit = git_commit()
        snapshot = _snapshot() if commit.endswith("-dirty") else commit
        _git("update-ref", f"refs/paperline/{run_id}", snapshot)
        return snapshot
    except (OSError, subprocess.SubprocessError):
        return ""


def _snapshot() -> str:
    """A commit of the working tree on top of HEAD, built in a scratch index: nothing checked out or staged changes
    (`git stash create` would leave out files not yet added, e.g. a new shared module the run imported)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_AUTHOR_NAME": "paperline", "GIT_AUTHOR_EMAIL": "paperline@localhost",
               "GIT_COMMITTER_NAME": "paperline", "GIT_COMMITTER_EMAIL": "paperline@localhost",
               **os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git("read-tree", "HEAD", env=env)
        _git("add", "-A", "--", ".", ":!variants", env=env)
        tree = _git("write-tree", env=env)
        return _git("commit-tree", tree, "-p", "HEAD", "-m", "paperline: working tree of a run", env=env)


def flatten(params: Mapping, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in params.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def mark_orphans_killed(exp_id: str) -> list[str]:
    """Runs left RUNNING by a killed pipeline are marked KILLED on the next start, so the UI tells the truth."""
    c = client()
    stale = c.search_runs([exp_id], filter_string="attributes.status = 'RUNNING'", max_results=100)
    alive = _alive_pids()
    killed = []
    for run in stale:
        pid = run.data.tags.get(f"{TAG}pid")
        if pid and int(pid) in alive:
            continue
        c.set_terminated(run.info.run_id, "KILLED")
        killed.append(run.info.run_id)
    return killed


def _alive_pids() -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
