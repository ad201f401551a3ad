"""The temporary local Prefect API of one `paperline run`, started as soon as the input is validated.

Without `PREFECT_API_URL`, Prefect starts a temporary API itself when the first flow runs: it imports its whole
server app into this process (~3 s) only to launch it as a subprocess, then waits for it to answer (~4 s) with
nothing else to do. Launching that subprocess here instead, before the flow modules are imported, lets the server
boot while this process imports Prefect and the paper's ranks warm up (benchmarks/README.md, orchestration
overhead). It is the same server Prefect would start: the command and environment of Prefect's own
`SubprocessASGIServer` (prefect/server/api/server.py), stopped at exit.

Runs side by side share one Prefect home, hence one database, and each server migrates it while it boots; two
migrations of a fresh database at once fail (alembic: "expected to match one row"). Prefect takes no lock there, so
boots on one home take turns under a file lock, held until the server answers (its migrations are done); a run
that finds the lock taken launches its server when the other one is up. Alone, the lock costs nothing.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import subprocess
import sys
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path

from tasks.train import die_with_parent
from tasks.worker import free_port

_server: subprocess.Popen | None = None
_port: int | None = None
_boot_lock = None  # the open lock file while this process's server boots


def start() -> bool:
    """Start the server in the background and point `PREFECT_API_URL` at it. False (nothing started) when an API
    is configured already or Prefect was imported before (its settings are read once, at import). While another
    run's server boots on the same Prefect home, only the URL is set here and `wait_ready` launches the server."""
    global _port, _boot_lock
    if _port is not None or os.environ.get("PREFECT_API_URL") or "prefect" in sys.modules:
        return False
    _port = free_port()
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_port}/api"
    atexit.register(stop)
    _boot_lock = open(Path(os.environ["PREFECT_HOME"]) / "api-boot.lock", "w")  # noqa: SIM115 - held across calls
    try:
        fcntl.flock(_boot_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # another run's server is migrating this database: launch ours once it answers
    _launch()
    return True


def started() -> bool:
    """Whether this process runs on its own temporary API (which serves no UI)."""
    return _port is not None


def _launch() -> None:
    global _server
    prefect_dir = Path(find_spec("prefect").origin).parent
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    _server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_dir.parent), "--factory",
         "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(_port), "--log-level", "error",
         "--lifespan", "on"], env=env, preexec_fn=die_with_parent)  # never outlives this process


def wait_ready(timeout_s: float | None = None) -> None:
    """Block until the server answers its health check; raise with what to do if it does not."""
    if _port is None:
        return
    timeout_s = timeout_s or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 180))
    try:
        if _server is None:  # deferred by start(): wait for the other run's server to finish its migrations
            print("waiting for another run's temporary Prefect API to set up its database", file=sys.stderr)
            fcntl.flock(_boot_lock, fcntl.LOCK_EX)
            _launch()
        _wait_healthy(timeout_s)
    finally:
        _release_boot_lock()


def _wait_healthy(timeout_s: float) -> None:
    url, deadline = f"{os.environ['PREFECT_API_URL']}/health", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _server.poll() is not None:
            raise RuntimeError(f"the temporary Prefect API exited with code {_server.returncode} while starting; "
                               "run `paperline server` and set PREFECT_API_URL, or see its output above")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the temporary Prefect API did not answer within {timeout_s:.0f} s "
                       "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")


def _release_boot_lock() -> None:
    global _boot_lock
    if _boot_lock is not None:
        _boot_lock.close()  # closing the file releases its lock
        _boot_lock = None


def stop() -> None:
    global _server, _port
    _release_boot_lock()
    if _port is None:
        return
    if _server is not None:
        _server.terminate()
        try:
            _server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait()
    _server = _port = None
    os.environ.pop("PREFECT_API_URL", None)
