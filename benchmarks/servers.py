"""Server start-up times: command to healthy, for the servers paperline starts (median of `--repeats`).

    python benchmarks/servers.py [--repeats 3]

- Prefect server (`prefect server start`, what `paperline server` runs): with a fresh database, then existing;
- MLflow tracking server on the embedded SQLite store (what `paperline ui` runs), fresh store;
Writes benchmarks/results/servers.json.
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
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "servers.json"
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    from tasks.worker import free_port as port

    return port()


def until_healthy(command: list[str], url: str, env: dict) -> float:
    start = time.perf_counter()
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        while time.perf_counter() - start < 300:
            try:
                if urllib.request.urlopen(url, timeout=2).status == 200:
                    return time.perf_counter() - start
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{command[:4]} not healthy after 300 s")
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=120)


def main(repeats: int) -> None:
    samples: dict[str, list[float]] = {"prefect_fresh_db_s": [], "prefect_existing_db_s": [],
                                       "mlflow_sqlite_fresh_s": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "PREFECT_HOME": tmp, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
            port = free_port()
            prefect = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
                       "--analytics-off"]
            health = f"http://127.0.0.1:{port}/api/health"
            samples["prefect_fresh_db_s"].append(until_healthy(prefect, health, env))
            samples["prefect_existing_db_s"].append(until_healthy(prefect, health, env))
            port = free_port()
            mlflow = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
                      "--default-artifact-root", Path(tmp, "art").as_uri(), "--host", "127.0.0.1", "--port",
                      str(port), "--workers", "1"]
            samples["mlflow_sqlite_fresh_s"].append(until_healthy(mlflow, f"http://127.0.0.1:{port}/health", env))
        print({k: round(v[-1], 2) for k, v in samples.items()}, flush=True)
    result = {"repeats": repeats, "median_s": {k: round(statistics.median(v), 2) for k, v in samples.items()},
              "samples_s": samples}
    OUT.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["median_s"], indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    main(parser.parse_args().repeats)
