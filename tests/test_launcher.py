"""Prestarted DeepSpeed jobs (tasks.train.prestart): claimed by the launch they were started for, trained exactly
like a job started at launch, and never left behind when nothing claims them."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from models import registry
from models.contract import PaperParams
from tasks import settings, train


def _sei_test_params(**overrides):
    return registry.resolve("sei", "test", {"ranks": 1, **overrides}, settings.params_file())


def _job(params, data_dir: Path, out_dir: Path) -> train.TrainJob:
    return train.TrainJob("sei", params, data_dir, out_dir, run_id=None, tracking_uri=None)


def test_prestarted_job_trains_bitwise_like_a_new_one(tmp_path):
    params = _sei_test_params()
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    registry.get("sei").prepare(params, data_dir)
    train.prestart("sei", params)
    train.launch(_job(params, data_dir, tmp_path / "prestarted"))
    train.launch(_job(params, data_dir, tmp_path / "new"))  # nothing prestarted any more: a job of its own
    logs = {name: (tmp_path / name / "train.log").read_text() for name in ("prestarted", "new")}
    assert logs["prestarted"].startswith("[launcher] prestarted job") and logs["new"].startswith("[launcher] new job")
    for name in ("network.detect.pt", "record.detection.pt"):
        a, b = (torch.load(tmp_path / run / name, weights_only=False) for run in ("prestarted", "new"))
        a, b = (x["module"].state_dict() if "module" in x else x for x in (a, b))
        flat_a, flat_b = _tensors(a), _tensors(b)
        assert flat_a.keys() == flat_b.keys() and flat_a
        assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), name
    from tasks.worker import ranks_cpu_seconds

    # each rank recorded what its job cost in CPU seconds: at least the training, at most the job's wall x cores
    assert all(0.5 < ranks_cpu_seconds(tmp_path / run) < 600 for run in ("prestarted", "new"))
    assert ranks_cpu_seconds(tmp_path) is None  # nothing recorded there


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _tensors(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in _tensors(value, f"{prefix}/{i}").items()}
    if hasattr(obj, "shape"):
        return {prefix: torch.as_tensor(obj)}
    return {}


def test_unclaimed_or_mismatched_prestarts_are_stopped(monkeypatch):
    params = _sei_test_params()
    train.prestart("sei", params)
    waiting = train._prestarted["sei"]
    train.prestart("sei", params)  # one waiting job per paper
    assert train._prestarted["sei"] is waiting
    monkeypatch.setenv("PAPERLINE_FAULT", "kill:0:detect:1")  # the ranks would not see it: not this job
    assert train._claim("sei", params) == (None, "new job (environment changed: PAPERLINE_FAULT)")
    assert waiting.process.poll() is not None and not waiting.ticket.parent.exists()

    train.prestart("sei", params)
    cancelled = train._prestarted["sei"]
    train.cancel_prestarted("sei")
    assert cancelled.process.poll() is not None and not cancelled.ticket.parent.exists()
    assert "sei" not in train._prestarted


_START_API = """
import os, urllib.request
from tasks.settings import configure_environment
configure_environment()
from flows import local_api
assert local_api.start()
local_api.wait_ready()
url = os.environ["PREFECT_API_URL"]
assert urllib.request.urlopen(url + "/health").status == 200
server = local_api._server
local_api.stop()
assert server.poll() is not None and "PREFECT_API_URL" not in os.environ
"""


def _start_api(prefect_home: Path) -> subprocess.Popen:
    """The CLI's use of the temporary API, in a fresh process (Prefect not yet imported)."""
    env = {**os.environ, "PREFECT_HOME": str(prefect_home)}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen([sys.executable, "-c", _START_API], cwd=settings.root(), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_temporary_prefect_api_starts_answers_and_stops(tmp_path):
    run = _start_api(tmp_path)
    err = run.communicate(timeout=300)[1]
    assert run.returncode == 0, err[-3000:]
    assert (tmp_path / "prefect.db").exists()


def test_temporary_apis_started_at_once_on_a_fresh_database_take_turns(tmp_path):
    """Each migrates the same new database while it boots: without turns, one of three failed in about one try of
    four here (alembic: "expected to match one row"); two runs at once failed CI (stop 18)."""
    runs = [_start_api(tmp_path) for _ in range(3)]
    errs = [run.communicate(timeout=300)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0], "\n".join(e[-3000:] for e in errs)


def test_an_api_waits_while_another_boots_on_its_prefect_home(tmp_path):
    with open(tmp_path / "api-boot.lock", "w") as other_boot:  # another run's server is booting
        fcntl.flock(other_boot, fcntl.LOCK_EX)
        run = _start_api(tmp_path)
        first_line = run.stderr.readline()
        assert "waiting for another run's temporary Prefect API" in first_line
        time.sleep(1)
        assert run.poll() is None and not (tmp_path / "prefect.db").exists()  # its server not launched yet
    run.communicate(timeout=300)
    assert run.returncode == 0 and (tmp_path / "prefect.db").exists()


def test_a_suite_prestarts_the_paper_after_the_one_that_finished_training(monkeypatch):
    from flows import launch

    started = []
    monkeypatch.setattr(launch.train, "prestart", lambda pid, params: started.append((pid, params.ranks)))
    upcoming = launch.Upcoming([registry.request(pid, "test", None, settings.params_file())
                                for pid in ("sei", "ldka", "qubo_relax")])
    upcoming.start("sei")
    upcoming.prestart_next()  # sei trained: ldka is next
    upcoming.start("ldka")
    upcoming.start("qubo_relax")  # side by side, qubo_relax started before ldka finished training
    upcoming.prestart_next()
    assert [pid for pid, _ in started] == ["ldka"]
    assert started[0][1] == registry.resolve("ldka", "test", None, settings.params_file()).ranks


def test_a_launcher_warms_up_what_trains_next_and_cancels_what_nothing_claimed(monkeypatch):
    """After a replicate trains: the paper's next replicate, else the suite's next paper, else nothing; a timed
    paper prestarts nothing after a training; leaving the run cancels the paper's waiting job; an evaluation runs
    on the launcher's thread in the caller's context."""
    import contextvars
    import threading

    from flows import launch

    events = []
    monkeypatch.setattr(launch.train, "prestart", lambda pid, params: events.append(("prestart", pid)))
    monkeypatch.setattr(launch.train, "cancel_prestarted", lambda pid=None: events.append(("cancel", pid)))
    sei, ldka = (registry.request(pid, "test", None, settings.params_file()) for pid in ("sei", "ldka"))
    marker = contextvars.ContextVar("marker", default="unset")
    marker.set("caller")
    with launch.Launcher(sei, timed=False) as launcher:
        launcher.trained(trains_later=True)
        launcher.trained(trains_later=False)  # no suite: nothing comes next
        token = launch.UPCOMING.set(launch.Upcoming([ldka]))
        launcher.trained(trains_later=False)
        launch.UPCOMING.reset(token)
        seen = launcher.evaluate(lambda: (marker.get(), threading.current_thread().name)).result()
    assert seen == ("caller", "evaluate-sei_0")
    assert events == [("prestart", "sei"), ("prestart", "sei"), ("prestart", "ldka"), ("cancel", "sei")]
    events.clear()
    with launch.Launcher(sei, timed=True) as launcher:
        launcher.trained(trains_later=True)
    assert events == [("prestart", "sei"), ("cancel", "sei")]
    assert launch.Launcher.stored(7).result() == 7


def test_papers_side_by_side_train_on_cores_of_their_own(monkeypatch):
    """`--parallel 2` on 4 cores: two slots of 2; each paper's trainings see their slot's cores (threads per rank
    and the cores the ranks pin themselves to); more papers than cores share them all, as one paper does."""
    from flows import launch, pipeline

    monkeypatch.setattr(train.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert train.core_slots(2) == [(0, 1), (2, 3)] and train.core_slots(1) == [None]
    assert train.core_slots(5) == [None] * 5 and train.core_slots(4) == [(0,), (1,), (2,), (3,)]

    seen = []

    def pipeline_stub(request, force):
        seen.append((request.paper, train.CORES.get(), train.threads_per_rank(PaperParams()), train._cores()))
        return {}

    monkeypatch.setattr(pipeline, "paper_pipeline", pipeline_stub)
    requests = [registry.request(pid, "test", None, settings.params_file()) for pid in ("sei", "ldka")]
    upcoming = launch.Upcoming(requests)
    pipeline._in_context(requests[0], False, upcoming)((2, 3))
    pipeline._in_context(requests[1], False, upcoming)()
    assert seen == [("sei", (2, 3), 2, (2, 3)), ("ldka", None, 4, (0, 1, 2, 3))]
    assert train.CORES.get() is None  # set in the paper's own context only


def test_a_profiles_threads_set_each_ranks_threads(monkeypatch):
    """`threads` in a profile fixes each rank's torch threads (the spec's threads_per_rank and OMP_NUM_THREADS);
    without it the job's cores are split over its ranks."""
    monkeypatch.setattr(train.os, "sched_getaffinity", lambda pid: {0, 1})
    assert train.threads_per_rank(PaperParams(ranks=2)) == 1 and train.threads_per_rank(PaperParams()) == 2
    one = PaperParams(threads=1)
    assert train.threads_per_rank(one) == 1 and train._rank_env(one)["OMP_NUM_THREADS"] == "1"
    assert train._fixed_env(one) != train._fixed_env(PaperParams())  # a prestarted job of other threads is not reused


def test_a_rank_pins_all_its_threads(tmp_path):
    code = ("import os, threading, time; from tasks.worker import pin_to; "
            "t = threading.Thread(target=time.sleep, args=(2,)); t.start(); core = min(os.sched_getaffinity(0)); "
            "pin_to([core]); print(sorted({tuple(sorted(os.sched_getaffinity(int(tid)))) "
            "for tid in os.listdir('/proc/self/task')}) == [(core,)])")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "True"
