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
import sys
import time
from contextlib import chdir, contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from models.contract import Paper, PaperParams
from models.inputs import input_path
from tasks import settings


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


def stage_location(paper_id: str, profile: str, raw_params: dict, is_default: bool) -> DataStage:
    """Where a run's data stage lives; writes nothing. Variants are named by a digest of the params as given."""
    root = settings.root()
    if is_default:
        return DataStage(root / "dvc.yaml", f"prepare@{paper_id}", root / "data" / paper_id)
    digest = hashlib.sha256(json.dumps(raw_params, sort_keys=True, default=str).encode()).hexdigest()[:10]
    folder = root / "variants" / paper_id / f"{profile}-{digest}"
    return DataStage(folder / "dvc.yaml", "prepare", folder / "data")


def stage_for(paper: Paper, profile: str, params: PaperParams, raw_params: dict, is_default: bool) -> DataStage:
    """The run's data stage; a variant's generated `dvc.yaml` + `params.yaml` (resolved params) are (re)written."""
    stage = stage_location(paper.id, profile, raw_params, is_default)
    if is_default:
        return stage
    folder = stage.dvc_file.parent
    folder.mkdir(parents=True, exist_ok=True)
    root = settings.root()
    deps = [os.path.relpath(root / "models" / f"{paper.id}.py", folder),
            os.path.relpath(root / "models" / "common", folder),  # shared generators
            os.path.relpath(root / "tasks" / "prepare_stage.py", folder)]
    # the profile's real data (models/inputs.py): replacing it reruns prepare, like any other stage input
    deps += [os.path.relpath(p, folder) if p.is_relative_to(root) else str(p)
             for p in (input_path(spec.path) for spec in params.inputs.values())]
    # the variant's params.yaml is a file dependency, not DVC params: it holds only this variant's resolved params,
    # so any change reruns the stage all the same, and `dvc params diff` / `dvc exp show` list the project's
    # params.yaml alone instead of every variant's copy of a paper's params
    stage_spec = {"cmd": f"python -m tasks.prepare_stage {paper.id} params data",
                  "deps": [*deps, "params.yaml"], "outs": ["data"]}
    _write_if_changed(folder / "params.yaml", yaml.safe_dump({"params": params.model_dump(mode="json")},
                                                             sort_keys=True))
    _write_if_changed(folder / "dvc.yaml", yaml.safe_dump({"stages": {"prepare": stage_spec}}, sort_keys=False))
    return stage


def _follow_current_streams() -> None:
    """DVC binds its log handlers to sys.stdout/sys.stderr as they are when `dvc` is first imported; a runner that
    swaps those streams (pytest, typer's CliRunner, notebooks) later closes them and every DVC log line then fails
    the stage. Point the handlers at the streams of now."""
    import logging

    for name in ("dvc", "dvc_objects", "dvc_data"):
        for handler in logging.getLogger(name).handlers:
            # DVC's own console handlers (and plain ones) only: a test runner's capture handler that reached these
            # loggers must keep its own stream (pytest reads its StringIO back after every test)
            own = type(handler) is logging.StreamHandler or type(handler).__module__.startswith("dvc")
            if own and isinstance(handler, logging.StreamHandler):
                # not setStream: it flushes the old, closed stream
                handler.stream = sys.stderr if handler.level >= logging.WARNING else sys.stdout
    # DVC's stage messages and its git advice ("git add dvc.lock", "autostage") into the log file, not the console
    settings.route_chatter("dvc", "dvc_objects", "dvc_data")


@contextmanager
def project_on_pythonpath():
    """Put the project root first on PYTHONPATH while DVC runs stage commands: a variant stage runs in
    variants/<id>/<profile>-<hash>/, where `python -m tasks.prepare_stage` would otherwise import whatever
    `paperline` is installed (another checkout's code, for a git worktree sharing one editable install)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(settings.root()), before) if p)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def reproduce(stage: DataStage, force: bool = False) -> PreparedData:
    """Run the stage through DVC's Python API (a no-op when up to date) and read its data hash from dvc.lock."""
    from dvc.repo import Repo

    start = time.perf_counter()
    _follow_current_streams()
    # DVC resolves stage paths against the current directory, so work from the repo root (under the lock,
    # which also serialises every DVC call of this process and others).
    with dvc_lock(), chdir(settings.root()), project_on_pythonpath(), Repo(str(settings.root())) as repo:
        before = locked_hash(stage)
        # single_item: the stage alone, without DVC parsing every dvc.yaml of the project (each variant's too) into
        # its pipeline graph; a prepare stage depends on code and params, never on another stage's output
        ran = bool(repo.reproduce(targets=[stage.target], force=force, single_item=True))
    data_hash = locked_hash(stage)
    if data_hash is None:
        raise RuntimeError(f"DVC ran {stage.target} but {stage.lock_file} records no output hash")
    return PreparedData(stage, data_hash, time.perf_counter() - start, ran or before != data_hash)


def locked_hash(stage: DataStage, locks: dict[Path, dict] | None = None) -> str | None:
    """The output hash dvc.lock records for the stage. `locks`: lock files already read (path -> parsed), so that
    many stages sharing the project's dvc.lock parse it once (a parse is ~0.1 s)."""
    if not stage.lock_file.exists():
        return None
    locks = {} if locks is None else locks
    if stage.lock_file not in locks:
        locks[stage.lock_file] = yaml.load(stage.lock_file.read_text(), Loader=yaml.CSafeLoader) or {}
    entry = locks[stage.lock_file].get("stages", {}).get(stage.name)
    if not entry or not entry.get("outs"):
        return None
    return entry["outs"][0]["md5"]


def current_hash(stage: DataStage) -> str | None:
    """The stage's data hash if DVC finds it up to date (code, params and data unchanged), else None. Never
    reproduces anything, and gives up at once (None) when another process holds the DVC lock."""
    return current_hashes([stage])[stage.target]


def current_hashes(stages: list[DataStage]) -> dict[str, str | None]:
    """`current_hash` of several stages (by target) through one DVC repository: a whole suite's cached rerun
    opens DVC once, not once per paper."""
    hashes: dict[str, str | None] = {stage.target: None for stage in stages}
    locks: dict[Path, dict] = {}
    recorded = {stage.target: h for stage in stages if (h := locked_hash(stage, locks)) is not None}
    if not recorded:
        return hashes
    from dvc.dvcfile import load_file
    from dvc.repo import Repo, lock_repo

    by_target = {stage.target: stage for stage in stages}
    with dvc_lock(wait=False) as got, chdir(settings.root()):
        if not got:
            return hashes
        _follow_current_streams()
        with Repo(str(settings.root())) as repo, lock_repo(repo), _params_files_read_once():
            dvc_files = {}  # each dvc.yaml (and its lock and vars) parsed once, not once per stage in it
            for target, recorded_hash in recorded.items():
                stage = by_target[target]
                if stage.dvc_file not in dvc_files:
                    dvc_files[stage.dvc_file] = load_file(repo, str(stage.dvc_file))
                if not dvc_files[stage.dvc_file].stages[stage.name].status(check_updates=True):  # `dvc status`
                    hashes[target] = recorded_hash
    return hashes


@contextmanager
def _params_files_read_once():
    """While checking many stages, DVC parses a params file once (not once per stage that reads it: the root
    params.yaml holds every paper's profiles, and parsing it costs ~0.1 s). Keyed by path, size and mtime, so an
    edited file is read again."""
    from dvc.dependency import param

    load_path, parsed = param.load_path, {}

    def load_once(path, fs, **kwargs):
        info = fs.info(path)
        key = (path, info.get("size"), info.get("mtime"), tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = load_path(path, fs, **kwargs)
        return parsed[key]

    param.load_path = load_once
    try:
        yield
    finally:
        param.load_path = load_path


@contextmanager
def dvc_lock(wait: bool = True):
    """DVC locks the whole repository, so parallel repros fail: serialise them across threads and processes.
    Yields whether the lock is held (always True when waiting)."""
    path = settings.root() / ".dvc" / "tmp" / "paperline.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            print(f"[dvc] another paperline process is running DVC in {settings.root()}: waiting for its lock "
                  f"({path})", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
