"""Where things live: the project root, the embedded MLflow store, and the tool state kept inside the project.

`PAPERLINE_ROOT` points the whole pipeline at another workspace (tests use a temporary copy). Everything the tools
would write under `~` by default (Prefect home, torch extension builds, DVC site cache) stays inside the root.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import time
from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def root() -> Path:
    return Path(os.environ.get("PAPERLINE_ROOT", _PACKAGE_ROOT)).resolve()


def params_file() -> Path:
    return root() / "params.yaml"


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set (a server), else the embedded SQLite store (absolute: four slashes)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root() / 'mlflow.db'}"


def artifact_root() -> Path:
    return root() / "mlartifacts"


def runs_dir() -> Path:
    """Run-scoped output folders (checkpoints, train outputs), one per MLflow run id."""
    return root() / "runs"


def mask(text: str) -> str:
    """A URI or message with any password in it replaced (`scheme://user:***@host`): secrets come from the
    environment and never reach a log, a tag or the terminal."""
    return re.sub(r"(\w[\w+.-]*://[^:/@\s]*):[^@\s]*@", r"\1:***@", text)


def extensions_dir() -> Path:
    """The build cache of torch extensions (DeepSpeed's CPU ops), which are compiled against the interpreter's torch
    and DeepSpeed: one per virtual environment, shared by every checkout and workspace that runs it (a second git
    worktree on the same venv would otherwise compile the op again inside its first replicate); the project's own
    folder outside a venv."""
    in_venv = sys.prefix != sys.base_prefix
    return (Path(sys.prefix).resolve() if in_venv else _PACKAGE_ROOT) / ".cache" / "torch_extensions"


def configure_environment() -> None:
    """Keep tool state inside the project and quiet; called once by the CLI and the flows before any tool import."""
    r = root()
    cuda = _has_cuda()
    defaults = {
        "PREFECT_HOME": str(r / ".prefect"),
        "TORCH_EXTENSIONS_DIR": str(extensions_dir()),
        "DVC_SITE_CACHE_DIR": str(r / ".dvc" / "site-cache"),
        "DS_ACCELERATOR": "cuda" if cuda else "cpu",
        # Triton reads this once, at its first import (DeepSpeed imports it early): kernels run interpreted on CPU
        "TRITON_INTERPRET": "0" if cuda else "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        # DVC's analytics daemon opens the repository in the background after a command (e.g. `dvc init`) and
        # writes its state databases at a time of its own: besides reporting to the network, that broke
        # "bad input writes nothing" now and then
        "DVC_NO_ANALYTICS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        # the temporary local API can take long to start on a loaded 2-core machine (default 20 s)
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "GIT_PYTHON_REFRESH": "quiet",
        # what scikit-learn and threadpoolctl set at their import anyway: set first, the environment a prestarted
        # rank was launched with still matches when its job comes, instead of the rank being replaced
        "KMP_DUPLICATE_LIB_OK": "True",
    }
    if not verbose():  # third-party progress bars and advisories stay off the console (`paperline --verbose`)
        defaults |= QUIET_DEFAULTS
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # Prefect creates its home folder without parents, and then cannot open its database
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    # DVC stages run `python ...` through a shell: make that the interpreter running paperline, venv or not.
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


# a DeepSpeed CPU-op build takes minutes (~11 on a 2-core machine at load 20): a lock this old outlived its build
STALE_BUILD_LOCK_S = 3600
# a build runs its compiler (ninja, c++) in the op's folder; a lock this old with no process working there was left
# by a build that was killed (a prestarted rank replaced mid-build, a Ctrl-C)
ORPHAN_BUILD_LOCK_S = 60


def _processes_working_in(folder: Path) -> bool:
    """Whether any process this user can see has its working directory in `folder` (Linux's /proc)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = Path(os.readlink(proc / "cwd"))
        except OSError:  # another user's, or it ended meanwhile
            continue
        if cwd == folder or folder in cwd.parents:
            return True
    return False


def clear_stale_build_locks(extensions_dir: Path, max_age_s: float = STALE_BUILD_LOCK_S,
                            orphan_age_s: float = ORPHAN_BUILD_LOCK_S) -> list[Path]:
    """Remove torch's extension-build lock files left by killed builds: older than `max_age_s`, or older than
    `orphan_age_s` with no process working in the op's folder. torch waits on `<op>/lock` for as long as it exists,
    and a build killed half-way never removes it: every later run then hangs before its first step."""
    now = time.time()
    stale = []
    for lock in extensions_dir.glob("*/lock"):
        age = now - lock.stat().st_mtime
        if age > max_age_s or (age > orphan_age_s and not _processes_working_in(lock.parent.resolve())):
            stale.append(lock)
    for lock in stale:
        lock.unlink(missing_ok=True)
    return stale


# ---- a console a person wants to read -------------------------------------------------------------------------
QUIET_DEFAULTS = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bar (and the hub's download bars)
    "TRANSFORMERS_VERBOSITY": "error",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # "Downloading artifacts" bars when a model is logged
}
# loggers whose INFO lines are chatter on the console (DVC's stage messages and git advice, MLflow's "Creating
# initial MLflow database tables", alembic's migrations): kept in the log file, warnings still on the console
CHATTER = ("dvc", "dvc_objects", "dvc_data", "mlflow", "alembic", "transformers", "sentence_transformers")


def verbose() -> bool:
    """`paperline --verbose` (PAPERLINE_VERBOSE=1): every tool's own output on the console, as they print it."""
    return os.environ.get("PAPERLINE_VERBOSE", "") not in ("", "0")


def chatter_log() -> Path:
    """Where third-party INFO lines go instead of the console: PAPERLINE_LOG (a run's log file) if set, else
    `runs/paperline.log` in the workspace."""
    return Path(os.environ.get("PAPERLINE_LOG") or runs_dir() / "paperline.log")


_chatter_handlers: dict[Path, logging.Handler] = {}


def route_chatter(*names: str) -> None:
    """Send the INFO lines of these loggers to the log file instead of the console; warnings and errors still reach
    the console, once (not also through Prefect's or the root logger's handlers). Call after the tool is imported
    (its handlers exist then); a no-op with --verbose."""
    if verbose():
        return
    path = chatter_log()
    handler = _chatter_handlers.get(path)
    if handler is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # the run folder is unusable: the run says so where it writes there; keep the console
            return
        handler = logging.FileHandler(path, delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        handler.setLevel(logging.INFO)
        _chatter_handlers[path] = handler
    for name in names or CHATTER:
        log = logging.getLogger(name)
        consoles = [h for h in log.handlers if isinstance(h, logging.StreamHandler)
                    and not isinstance(h, logging.FileHandler)]
        for console in consoles:
            console.setLevel(max(console.level, logging.WARNING))
        if not consoles:
            console = logging.StreamHandler(sys.stderr)
            console.setLevel(logging.WARNING)
            log.addHandler(console)
        for old in [h for h in log.handlers if h in _chatter_handlers.values() and h is not handler]:
            log.removeHandler(old)  # another workspace's log (tests switch PAPERLINE_ROOT)
        if handler not in log.handlers:
            log.addHandler(handler)
        if log.level == logging.NOTSET or log.level > logging.INFO:
            log.setLevel(logging.INFO)
        log.propagate = False  # DVC's lines appeared twice: its own handler's and Prefect's copy via the root


def _has_cuda() -> bool:
    """Whether a CUDA GPU is usable, without importing torch (1.5 s): a CUDA build of torch and an NVIDIA device."""
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False
    if "+cpu" in version or os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def exit_without_teardown(code: int) -> None:
    """End the process now, after its exit handlers: the interpreter's teardown of torch, DeepSpeed, Prefect and
    MLflow (1-3 s of freeing modules one by one) does nothing a finished run needs. Files are closed by then (every
    write here is in a `with` block); the exit handlers flush logging and stop Prefect's temporary API."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
