"""The entry point every DeepSpeed rank runs: `python -m tasks.worker <spec.json>` (launched by `tasks.train`).

It joins the process group, builds the paper's `TrainContext` and calls `paper.train(ctx)`. Only rank 0 talks to
MLflow. `train_in_process` runs the same thing as a single rank inside the caller (tests, benchmarks).

`python -m tasks.worker <spec.json> --prestarted <paper>`: a rank started before its work is known
(`tasks.train.prestart`). It imports the paper, DeepSpeed and MLflow and joins the process group, then waits for
the spec file to appear (an unclaimed job is stopped by the launcher, or gives up after PRESTART_WAIT_S).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tasks.settings import configure_environment, exit_without_teardown

configure_environment()  # before any import that may import triton or deepspeed

from models import registry  # noqa: E402
from tasks import settings  # noqa: E402
from tasks.context import MetricSink, TrainContext  # noqa: E402

DONE_MARKER = "TRAIN_DONE"
CPU_FILE_PREFIX = "cpu.rank"  # cpu.rank<r>.json: a rank's CPU seconds over the whole training job
PRESTART_WAIT_S = 3600


def _device(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _init_distributed() -> None:
    """Join (or, in-process, create) the process group: gloo on CPU, NCCL on GPUs, a short timeout so a dead
    rank fails the job in minutes instead of gloo's 30-minute default."""
    import deepspeed

    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:  # single in-process rank: a private one-member group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    # a fresh group: DeepSpeed's cached world group may be one an earlier in-process job destroyed (tests)
    from deepspeed.utils import groups

    groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(backend, timeout=timedelta(seconds=int(os.environ.get("PAPERLINE_DIST_TIMEOUT", 120))))


def build_ops() -> None:
    """Compile DeepSpeed's CPU shared-memory collective op into the extensions cache now (`make setup` calls this),
    so the first training on a fresh clone does not pay the build inside its replicate's CPU budget, and parallel
    test workers do not race to build it. A no-op on GPUs and where the op is built already."""
    from tasks import settings

    settings.configure_environment()
    if os.environ["DS_ACCELERATOR"] != "cpu":
        return
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_to(cores: list[int] | None) -> None:
    """Every thread of this rank (gloo's, a warm job's thread pools too) onto `cores`; threads started later
    inherit it. None leaves the affinity as it is."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def run(spec: dict) -> None:
    paper = registry.get(spec["paper"])
    params = paper.Params.model_validate(spec["params"])
    _init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.manual_seed(params.seed)
    pin_to(spec.get("cores"))
    torch.set_num_threads(max(1, int(spec.get("threads_per_rank", 1))))
    out_dir = Path(spec["out_dir"])
    # a tracking server that went away stalls a rank for seconds, not MLflow's default minutes of retries
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    sink = MetricSink(spec.get("tracking_uri") or settings.tracking_uri(), spec.get("run_id") if rank == 0 else None,
                      spill_dir=out_dir)
    ctx = TrainContext(params=params, data_dir=Path(spec["data_dir"]), out_dir=out_dir, rank=rank,
                       world_size=world, device=_device(local_rank), sink=sink, label=f"{paper.id} train")
    paper.train(ctx)
    sink.flush()
    ctx.barrier()
    _record_cpu(out_dir, rank)
    if rank == 0:
        (out_dir / DONE_MARKER).write_text("ok")


def _record_cpu(out_dir: Path, rank: int) -> None:
    """This rank's CPU seconds (user + system, all its threads and children, start-up included) in the run folder:
    what a replicate's training cost, whatever else the machine was doing."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    (out_dir / f"{CPU_FILE_PREFIX}{rank}.json").write_text(json.dumps({"cpu_s": seconds}))


def ranks_cpu_seconds(out_dir: Path) -> float | None:
    """The CPU seconds every rank of a finished training recorded, summed; None when none did (an older run)."""
    files = sorted(out_dir.glob(f"{CPU_FILE_PREFIX}*.json"))
    return sum(json.loads(f.read_text())["cpu_s"] for f in files) if files else None


def train_in_process(paper_id: str, params, data_dir: Path, out_dir: Path) -> None:
    """One rank in this process, no MLflow: the registry-wide test and benchmarks' bare reference."""
    out_dir.mkdir(parents=True, exist_ok=True)
    run({"paper": paper_id, "params": params.model_dump(mode="json"), "data_dir": str(data_dir),
         "out_dir": str(out_dir), "threads_per_rank": torch.get_num_threads()})


def wait_for_spec(spec_path: Path, paper_id: str) -> dict | None:
    """Do the start-up work that needs no spec, then wait for it; None when nothing claimed the job in time."""
    import deepspeed  # noqa: F401 - imported now, while nothing waits for this rank

    if os.environ.get("RANK", "0") == "0":  # only rank 0 talks to MLflow
        from mlflow import MlflowClient  # noqa: F401
    registry.get(paper_id)
    _init_distributed()
    deadline = time.monotonic() + PRESTART_WAIT_S
    while not spec_path.exists():  # written atomically (os.replace) by tasks.train
        if time.monotonic() > deadline:  # forgotten: the launcher finds it gone and starts a fresh job
            return None
        time.sleep(0.02)
    return json.loads(spec_path.read_text())


def main(argv: list[str]) -> None:
    spec_path = Path(argv[0])
    if len(argv) == 3 and argv[1] == "--prestarted":
        spec = wait_for_spec(spec_path, argv[2])
    else:
        spec = json.loads(spec_path.read_text())
    if spec is not None:
        run(spec)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    # everything is on disk and sent (checkpoints, TRAIN_DONE, metrics): skip the interpreter's ~1 s teardown
    exit_without_teardown(0)
