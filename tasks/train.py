"""Launch a paper's training as a DeepSpeed job: `torchrun` with `ranks` processes running `tasks.worker`.

The job runs in a subprocess so a crashed rank never takes the orchestrator down; a retry of the train task starts
a fresh torchrun (torchrun's own restarts hang with gloo on torch 2.13) and the worker resumes from the newest
committed checkpoint in the run-scoped folder. The ranks die with the orchestrator (PR_SET_PDEATHSIG).

Starting a job costs seconds before its first step (a torchrun agent, then per rank an interpreter importing torch,
DeepSpeed, the paper and MLflow, and the gloo rendezvous). `prestart` pays that while the flow does other work
(Prefect's API start, the DVC check, opening the MLflow run; in a suite, the previous paper's one-thread
evaluation): the ranks warm up, then wait for their spec, which `launch` hands them. A prestarted job that no
launch claims (a cached result, a failure before training) is cancelled by `cancel_prestarted` or at exit.
"""

from __future__ import annotations

import atexit
import contextvars
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from models.contract import PaperParams
from tasks.context import PROGRESS_TAG
from tasks.settings import mask, verbose
from tasks.worker import DONE_MARKER, free_port

PHASE_DONE = re.compile(r"\] phase \S+: step (\d+)/\1 loss ")  # PhaseProgress.done's line
ERROR_LINE = re.compile(r"^(\[[^\]]*\]:)?\s*[A-Za-z_.]*(Error|Exception|Interrupt): ")
# The CPU cores the training jobs started in this context run on: a suite slot's with `--parallel` (set by the
# suite flow), None for all of this process's. The ranks share them out (threads per rank) and pin themselves.
CORES: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("train_cores", default=None)


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
    spec = {"paper": job.paper_id, "params": job.params.model_dump(mode="json"), "data_dir": str(job.data_dir),
            "out_dir": str(job.out_dir), "run_id": job.run_id,
            # a URI holding a password stays out of files: the ranks then read it from their environment
            "tracking_uri": job.tracking_uri if job.tracking_uri == mask(job.tracking_uri or "") else None,
            "threads_per_rank": threads_per_rank(job.params), "cores": list(_cores())}
    spec_path.write_text(json.dumps(spec, indent=1))  # the record of what ran, in the run folder
    nodes = nodes_from_env()
    others: list[subprocess.Popen] = []  # the launchers of nodes 1.. (node 0's output is streamed below)
    if nodes > 1:
        cancel_prestarted(job.paper_id)  # a prestarted job is one node's: a multi-node job starts anew
        warm, how = None, f"new job across {nodes} nodes (one launcher each, one rendezvous on 127.0.0.1)"
        port = free_port()
        for node_rank in range(1, nodes):
            command = launcher_command(job.params.ranks, spec_path, None, nodes, node_rank, port)
            with open(job.out_dir / f"train.node{node_rank}.log", "a") as node_log:
                others.append(subprocess.Popen(command, stdout=node_log, stderr=subprocess.STDOUT, text=True,
                                               env=_rank_env(job.params),
                                               preexec_fn=die_with_parent))
        process = _spawn(launcher_command(job.params.ranks, spec_path, None, nodes, 0, port),
                         _rank_env(job.params))
    else:
        warm, how = _claim(job.paper_id, job.params)
        if warm is not None:
            process = warm.hand_over(spec)
        else:
            command = launcher_command(job.params.ranks, spec_path, os.environ.get("PAPERLINE_HOSTFILE"))
            process = _spawn(command, _rank_env(job.params))
    log_path = job.out_dir / "train.log"
    bars = PhaseBars()
    try:
        with open(log_path, "a", buffering=1) as log:  # line-buffered: a killed orchestrator loses no log lines
            log.write(f"[launcher] {how}, {job.params.ranks} rank(s)\n")
            assert process.stdout is not None
            for line in process.stdout:  # stream progress to the terminal and keep it in the run folder
                log.write(line)
                info = parse_progress(line)
                if info is not None:
                    bars.show(info)
                elif verbose() or not _is_noise(line):
                    bars.print(line)
            code = process.wait()
            for other in others:  # every node's launcher must succeed
                code = code or other.wait()
    finally:
        bars.close()
        for other in others:
            if other.poll() is None:
                other.terminate()
                other.wait()
        if warm is not None:
            warm.remove_ticket()
    if code != 0 or not (job.out_dir / DONE_MARKER).exists():
        reason = last_error(log_path)
        raise RuntimeError(f"DeepSpeed job of {job.paper_id} failed (exit {code})"
                           f"{': ' + reason if reason else ''}; see {log_path}")


def _cores() -> tuple[int, ...]:
    return CORES.get() or tuple(sorted(os.sched_getaffinity(0)))


def core_slots(parallel: int) -> list[tuple[int, ...] | None]:
    """This process's cores split into `parallel` equal slots, one per job side by side; None (share them all)
    when there are fewer cores than jobs."""
    cores = sorted(os.sched_getaffinity(0))
    if parallel <= 1 or len(cores) < parallel:
        return [None] * max(parallel, 1)
    size = len(cores) // parallel
    return [tuple(cores[i * size:(i + 1) * size]) for i in range(parallel)]


def threads_per_rank(params: PaperParams) -> int:
    """The profile's `threads`, else this job's cores split over its ranks."""
    return params.threads or max(1, len(_cores()) // params.ranks)


def _rank_env(params: PaperParams) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(params)), "PYTHONUNBUFFERED": "1",
           "PAPERLINE_PROGRESS": "lines"}  # rank 0 reports progress as structured lines (PhaseBars renders them)
    env.pop("LOCAL_SIZE", None)  # its presence leaves DeepSpeed shm segments behind in /dev/shm
    return env


# ---- progress on the console --------------------------------------------------------------------------------------
def parse_progress(line: str) -> dict | None:
    """A rank's structured progress line (tasks.context.PhaseProgress), or None for any other line."""
    at = line.find(PROGRESS_TAG)
    if at < 0:
        return None
    try:
        return json.loads(line[at + len(PROGRESS_TAG):])
    except json.JSONDecodeError:
        return None


class PhaseBars:
    """The training phases' progress as the person at the terminal sees it: one rich bar per phase with steps, loss,
    elapsed time and ETA, updated in place; other lines print above it. Not a terminal (a pipe, CI, a log): one
    plain line per tenth of a phase, with the ETA."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.progress = None
        self.tasks: dict[str, int] = {}
        self.shown: dict[str, int] = {}  # plain mode: the last tenth printed per phase
        self.started: dict[str, tuple[float, int]] = {}

    def _bar(self):
        if self.progress is None:
            import rich.progress as rp
            from rich.console import Console

            self.progress = rp.Progress(rp.TextColumn("{task.description}", markup=False), rp.BarColumn(),
                                        rp.MofNCompleteColumn(), rp.TextColumn("loss {task.fields[loss]}"),
                                        rp.TimeElapsedColumn(), rp.TextColumn("ETA"), rp.TimeRemainingColumn(),
                                        console=Console(file=self.stream), transient=False, refresh_per_second=4)
            self.progress.start()
        return self.progress

    def show(self, info: dict) -> None:
        key = f"{info.get('label') or 'train'} {info['phase']}"
        loss = "-" if info.get("loss") is None else f"{info['loss']:.4f}"
        step, total = int(info["step"]), int(info["total"])
        if self.live:
            bar = self._bar()
            if key not in self.tasks:
                self.tasks[key] = bar.add_task(f"[{key}]", total=total, completed=int(info.get("start", 0)),
                                               loss=loss)
            bar.update(self.tasks[key], completed=step, loss=loss)
            return
        import time

        tenth = step * 10 // max(total, 1)
        if key not in self.started:  # the phase starts (or resumes) here
            self.started[key], self.shown[key] = (time.monotonic(), step), tenth
            return
        t0, s0 = self.started[key]
        if tenth <= self.shown[key] or step >= total:  # the phase's own last line says the end
            return
        self.shown[key] = tenth
        elapsed = time.monotonic() - t0
        eta = elapsed / max(step - s0, 1) * (total - step)
        print(f"[{key}] step {step}/{total} loss {loss} ({elapsed:.0f} s, ETA {eta:.0f} s)", file=self.stream,
              flush=True)

    def print(self, line: str) -> None:
        if self.progress is not None:
            if PHASE_DONE.search(line):  # the finished bar says it already (the line stays in train.log)
                return
            self.progress.console.print(line.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _spawn(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=die_with_parent)


# ---- prestarted jobs --------------------------------------------------------------------------------------------
class _Prestarted:
    """A job whose ranks run `tasks.worker --prestarted`: warming up or waiting for the spec file `ticket`."""

    def __init__(self, paper_id: str, params: PaperParams):
        self.ranks, self.env = params.ranks, _fixed_env(params)
        self.ticket = Path(tempfile.mkdtemp(prefix=f"paperline-{paper_id}-")) / "worker_spec.json"
        command = launcher_command(params.ranks, self.ticket, None) + ["--prestarted", paper_id]
        self.process = _spawn(command, _rank_env(params))

    def hand_over(self, spec: dict) -> subprocess.Popen:
        tmp = self.ticket.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, self.ticket)  # atomic: a rank never reads half a spec
        return self.process

    def cancel(self) -> None:
        """Stop it at once, warming up or waiting (torchrun passes SIGTERM on to its ranks)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.communicate(timeout=30)  # drain its output so it cannot block on a full pipe
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.remove_ticket()

    def remove_ticket(self) -> None:
        shutil.rmtree(self.ticket.parent, ignore_errors=True)


_prestarted: dict[str, _Prestarted] = {}  # by paper id; at most one waiting job per paper
_prestarted_lock = threading.Lock()


def _fixed_env(params: PaperParams) -> dict[str, str]:
    """The environment a rank fixes at start-up (fault injection, tracking credentials, PAPERLINE_ROOT ...);
    Prefect's own variables do not reach the ranks' work."""
    return {k: v for k, v in _rank_env(params).items() if not k.startswith("PREFECT_")}


def prestart(paper_id: str, params: PaperParams) -> None:
    """Start the paper's ranks now, ahead of `launch`; a no-op when one is already waiting or a hostfile spreads
    the job over machines (the ticket would have to be on storage every host mounts)."""
    if os.environ.get("PAPERLINE_HOSTFILE"):
        return
    with _prestarted_lock:
        if paper_id not in _prestarted:
            _prestarted[paper_id] = _Prestarted(paper_id, params)


def _claim(paper_id: str, params: PaperParams) -> tuple[_Prestarted | None, str]:
    """The prestarted job for this launch if it matches and is still alive (a stale one is cancelled), and what
    the train log says about it."""
    with _prestarted_lock:
        warm = _prestarted.pop(paper_id, None)
    if warm is None:
        return None, "new job"
    env = _fixed_env(params)
    if warm.ranks == params.ranks and warm.env == env and warm.process.poll() is None:
        return warm, "prestarted job"
    warm.cancel()
    if warm.ranks != params.ranks:
        return None, "new job (the prestarted one had another world size)"
    # e.g. RDBASE, which importing rdkit sets in this process: a new job sees it as a fresh launch would
    changed = sorted(k for k in env.keys() | warm.env.keys() if env.get(k) != warm.env.get(k))
    return None, f"new job ({'environment changed: ' + ', '.join(changed) if changed else 'the prestarted one died'})"


def cancel_prestarted(paper_id: str | None = None) -> None:
    """Cancel the waiting job of `paper_id` (every paper's when None): nothing will claim it."""
    with _prestarted_lock:
        ids = list(_prestarted) if paper_id is None else [paper_id]
        jobs = [_prestarted.pop(pid) for pid in ids if pid in _prestarted]
    for job in jobs:
        job.cancel()


atexit.register(cancel_prestarted)


def last_error(log_path: Path) -> str | None:
    """The last exception line a rank printed (`SomeError: message`), so the failure reads without opening the log."""
    lines = log_path.read_text(errors="replace").splitlines()[-400:] if log_path.exists() else []
    errors = [line.split("]:", 1)[-1].strip() for line in lines
              if ERROR_LINE.search(line) and "ChildFailedError" not in line]  # torchrun's own summary says less
    return errors[-1][:500] if errors else None


def nodes_from_env() -> int:
    """`paperline run --nodes N` (PAPERLINE_NODES): the job's ranks split over N launchers ("nodes") on this
    machine, which rendezvous like N machines would."""
    return int(os.environ.get("PAPERLINE_NODES", "1") or 1)


def check_nodes(ranks: int, nodes: int, paper_id: str = "") -> None:
    from models.registry import ConfigError

    if nodes < 1 or ranks % nodes:
        raise ConfigError(f"--nodes {nodes}: {paper_id + ' has ' if paper_id else ''}ranks={ranks}, which must "
                          "split evenly over the nodes (set ranks=<a multiple> with --set)")


def launcher_command(ranks: int, spec_path: Path, hostfile: str | None, nodes: int = 1, node_rank: int = 0,
                     master_port: int | None = None, master_addr: str = "127.0.0.1") -> list[str]:
    """torchrun on this machine; with `nodes` > 1, one torchrun per node (`--nnodes`, `--node_rank`, `ranks /
    nodes` ranks each) meeting at one rendezvous, `master_addr:master_port` (node 0's TCP store): the same
    command on N machines, or N launchers on loopback here. With a hostfile, the `deepspeed` launcher across its
    hosts over SSH (same worker code; the run folder must then be on storage every host mounts at the same path)."""
    if hostfile:
        read_hostfile(Path(hostfile))
        return [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={hostfile}",
                f"--master_port={free_port()}", "--module", "tasks.worker", str(spec_path)]
    check_nodes(ranks, nodes)
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks // nodes}", f"--nnodes={nodes}",
            f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port or free_port()}",
            "--max_restarts=0", "-m", "tasks.worker", str(spec_path)]


def k8s_multinode_job(job_name: str, ranks: int, nodes: int, spec_path: str, image: str = "paperline:latest",
                      gpus_per_node: int | None = None, master_port: int = 29500) -> list[dict]:
    """infra/k8s/multinode-job.yaml rendered: the headless Service and the Indexed Job whose pods run
    `launcher_command` with `--node_rank=$(NODE_RANK)` (each pod's completion index) against pod 0."""
    import yaml
    from prefect.utilities.templating import apply_values

    template = Path(__file__).resolve().parents[1] / "infra" / "k8s" / "multinode-job.yaml"
    command = launcher_command(ranks, Path(spec_path), None, nodes, 0, master_port,
                               master_addr=f"{job_name}-0.{job_name}")
    command = ["python", *command[1:]]  # the image's interpreter
    command[command.index("--node_rank=0")] = "--node_rank=$(NODE_RANK)"
    values = {"job_name": job_name, "nodes": nodes, "nodes_text": str(nodes), "master_port": master_port,
              "image": image, "command": command,
              "gpus_per_node": ranks // nodes if gpus_per_node is None else gpus_per_node}
    return [apply_values(doc, values) for doc in yaml.safe_load_all(template.read_text())]


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


def die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_NOISE = ("[INFO]", "[WARNING]", "UserWarning", "warnings.warn", "[RANK", "FutureWarning", "Setting OMP_NUM_THREADS",
          "built successfully")  # DeepSpeed's "deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"


def _is_noise(line: str) -> bool:
    return any(marker in line for marker in _NOISE) or not line.strip()
