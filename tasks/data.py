"""The DVC data stage of a paper run: which stage, reproducing it, and the data hash it recorded in its lock file.

The default run (profile `smoke`, no overrides) uses the hand-written `prepare@<id>` stage of the root `dvc.yaml`,
so `dvc repro prepare@sei` from the shell is the same stage. Any other profile or a parameter override gets its own
stage in `variants/<id>/<profile>-<hash>/` (generated `dvc.yaml` + `params.yaml` holding the resolved params):
its own versioned data, sharing the DVC cache, and the user's `params.yaml` and `data/` stay untouched. These
folders must not be git-ignored (DVC refuses stages in ignored files); DVC ignores their `data/` itself, and
committing a variant's `dvc.yaml`/`dvc.lock` versions that data like any other stage.
DVC alone decides whether a stage reruns (code + params + outputs); nothing here caches on top of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from contextlib import chdir, contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from models.contract import Paper, PaperParams
from tasks import settings

DEFAULT_PROFILE = "smoke"


@dataclass(frozen=True)
class DataStage:
    dvc_file: Path   # the dvc.yaml holding the stage
    name: str        # stage name inside it
    out_dir: Path    # where the parquet tables land

    @property
    def target(self) -> str:
        return f"{self.dvc_file.relative_to(settings.root())}:{self.name}"

    @property
    def lock_file(self) -> Path:
        return self.dvc_file.with_name("dvc.lock")


@dataclass(frozen=True)
class PreparedData:
    stage: DataStage
    data_hash: str   # the output's md5 from dvc.lock (a ".dir" hash for a folder)
    seconds: float
    ran: bool        # whether DVC executed the stage (or restored it) rather than finding it up to date


def stage_for(paper: Paper, profile: str, params: PaperParams, is_default: bool) -> DataStage:
    root = settings.root()
    if is_default:
        return DataStage(root / "dvc.yaml", f"prepare@{paper.id}", root / "data" / paper.id)
    resolved = params.model_dump(mode="json")
    digest = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:10]
    folder = root / "variants" / paper.id / f"{profile}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    module = Path(__import__(f"models.{paper.id}", fromlist=["_"]).__file__)
    deps = [os.path.relpath(root / "models" / module.name, folder),
            os.path.relpath(root / "tasks" / "prepare_stage.py", folder)]
    stage = {"cmd": f"python -m tasks.prepare_stage {paper.id} params data",
             "deps": deps, "params": ["params"], "outs": ["data"]}
    _write_if_changed(folder / "params.yaml", yaml.safe_dump({"params": resolved}, sort_keys=True))
    _write_if_changed(folder / "dvc.yaml", yaml.safe_dump({"stages": {"prepare": stage}}, sort_keys=False))
    return DataStage(folder / "dvc.yaml", "prepare", folder / "data")


def reproduce(stage: DataStage, force: bool = False) -> PreparedData:
    """Run the stage through DVC's Python API (a no-op when up to date) and read its data hash from dvc.lock."""
    from dvc.repo import Repo

    start = time.perf_counter()
    # DVC resolves stage paths against the current directory, so work from the repo root (under the lock,
    # which also serialises every DVC call of this process and others).
    with dvc_lock(), chdir(settings.root()), Repo(str(settings.root())) as repo:
        before = locked_hash(stage)
        ran = bool(repo.reproduce(targets=[stage.target], force=force))
    data_hash = locked_hash(stage)
    if data_hash is None:
        raise RuntimeError(f"DVC ran {stage.target} but {stage.lock_file} records no output hash")
    return PreparedData(stage, data_hash, time.perf_counter() - start, ran or before != data_hash)


def locked_hash(stage: DataStage) -> str | None:
    if not stage.lock_file.exists():
        return None
    lock = yaml.safe_load(stage.lock_file.read_text()) or {}
    entry = lock.get("stages", {}).get(stage.name)
    if not entry or not entry.get("outs"):
        return None
    return entry["outs"][0]["md5"]


@contextmanager
def dvc_lock():
    """DVC locks the whole repository, so parallel repros fail: serialise them across threads and processes."""
    path = settings.root() / ".dvc" / "tmp" / "paperline.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
