"""Launch a paper's training as a DeepSpeed job: `torchrun` with `ranks` processes running `tasks.worker`.

The job runs in a subprocess so a crashed rank never takes the orchestrator down; a retry of the train task starts
a fresh torchrun (torchrun's own restarts hang with gloo on torch 2.13) and the worker resumes from the newest
committed checkpoint in the run-scoped folder. The ranks die with the orchestrator (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from models.contract import PaperParams
from tasks.settings import mask
from tasks.worker import DONE_MARKER, free_port

ERROR_LINE = re.compile(r"^(\[[^\]]*\]:)?\s*[A-Za-z_.]*(Error|Exception|Interrupt): ")


@dataclass(frozen=True)
class TrainJob:
    paper_id: str
    params: PaperParams
    data_dir: Path
    out_dir: Path
    run_id: str | None
    tracking_uri: str | None


def launch(job: TrainJob) -> None:
    job.out_dir.mkdir(parents=True, exist_ok=True)
    if (job.out_dir / DONE_MARKER).exists():
        return  # finished earlier (e.g. the pipeline was killed after training): nothing to redo
    spec_path = job.out_dir / "worker_spec.json"
    ranks = job.params.ranks
    cpus = len(os.sched_getaffinity(0))
    spec = {"paper": job.paper_id, "params": job.params.model_dump(mode="json"), "data_dir": str(job.data_dir),
            "out_dir": str(job.out_dir), "run_id": job.run_id,
            # a URI holding a password stays out of files: the ranks then read it from their environment
            "tracking_uri": job.tracking_uri if job.tracking_uri == mask(job.tracking_uri or "") else None,
            "threads_per_rank": max(1, cpus // ranks)}
    spec_path.write_text(json.dumps(spec, indent=1))
    command = launcher_command(ranks, spec_path, os.environ.get("PAPERLINE_HOSTFILE"))
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads_per_rank"]), "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_SIZE", None)  # its presence leaves DeepSpeed shm segments behind in /dev/shm
    log_path = job.out_dir / "train.log"
    with open(log_path, "a", buffering=1) as log:  # line-buffered: a killed orchestrator loses no log lines
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                   preexec_fn=_die_with_parent)
        assert process.stdout is not None
        for line in process.stdout:  # stream progress to the terminal and keep it in the run folder
            log.write(line)
            if not _is_noise(line):
                print(line, end="", file=sys.stderr, flush=True)
        code = process.wait()
    if code != 0 or not (job.out_dir / DONE_MARKER).exists():
        reason = last_error(log_path)
        raise RuntimeError(f"DeepSpeed job of {job.paper_id} failed (exit {code})"
                           f"{': ' + reason if reason else ''}; see {log_path}")


def last_error(log_path: Path) -> str | None:
    """The last exception line a rank printed (`SomeError: message`), so the failure reads without opening the log."""
    lines = log_path.read_text(errors="replace").splitlines()[-400:] if log_path.exists() else []
    errors = [line.split("]:", 1)[-1].strip() for line in lines
              if ERROR_LINE.search(line) and "ChildFailedError" not in line]  # torchrun's own summary says less
    return errors[-1][:500] if errors else None


def launcher_command(ranks: int, spec_path: Path, hostfile: str | None) -> list[str]:
    """torchrun on this machine; with a hostfile, the `deepspeed` launcher across its hosts (same worker code;
    the run folder must then be on storage every host mounts at the same path)."""
    if hostfile:
        read_hostfile(Path(hostfile))
        return [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={hostfile}",
                f"--master_port={free_port()}", "--module", "tasks.worker", str(spec_path)]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--max_restarts=0",
            "-m", "tasks.worker", str(spec_path)]


def read_hostfile(path: Path) -> dict[str, int]:
    """DeepSpeed hostfile: `<host> slots=<n>` per line, `#` comments. Raises ConfigError naming the problem."""
    from models.registry import ConfigError

    if not path.is_file():
        raise ConfigError(f"hostfile {path} does not exist")
    hosts: dict[str, int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit() or parts[1][6:] == "0":
            raise ConfigError(f"hostfile {path}, line {number}: expected '<host> slots=<n>', got {raw.strip()!r}")
        hosts[parts[0]] = int(parts[1][6:])
    if not hosts:
        raise ConfigError(f"hostfile {path} names no hosts")
    return hosts


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_NOISE = ("[INFO]", "[WARNING]", "UserWarning", "warnings.warn", "[RANK", "FutureWarning", "Setting OMP_NUM_THREADS")


def _is_noise(line: str) -> bool:
    return any(marker in line for marker in _NOISE) or not line.strip()
