"""Stored replicates through the real pipeline (Prefect, DVC, DeepSpeed, MLflow) on opo_cmdp's test profile (a
timed part, so its evaluations take the quiet lock): more replicates train only the missing ones, a changed claim
decides again from the stored metrics without training, and a premises-only run shows the premises alone."""

from __future__ import annotations

import dataclasses
import time

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.report import latest_run
from models import registry
from tasks import keys, settings, tracking
from tasks.replicates import machine_name
from tasks.steps import recorded_metrics

pytestmark = pytest.mark.e2e
PAPER = "opo_cmdp"


def _children(exp_id: str) -> list:
    return tracking.client().search_runs([exp_id], "tags.`paperline.kind` = 'replicate'")


@pytest.fixture
def counted_training(monkeypatch):
    """Every DeepSpeed job the pipeline starts, by seed."""
    import flows.pipeline

    seeds: list[int] = []
    real = flows.pipeline.train_task

    class Counting:
        def with_options(self, **options):
            task = real.with_options(**options)

            def run(job):
                seeds.append(job.params.seed)
                return task(job)

            return run

    monkeypatch.setattr(flows.pipeline, "train_task", Counting())
    return seeds


def test_more_replicates_train_only_the_missing_ones_a_claim_edit_trains_nothing_premises_only_is_blind(
        workspace, prefect_harness, monkeypatch, counted_training, tmp_path):
    """One workspace for the three, so the replicates train once (each DeepSpeed job costs seconds)."""
    from flows.deployed import paper as run_paper

    monkeypatch.setenv("PAPERLINE_QUIET_LOCK", str(tmp_path / "quiet"))
    first = run_paper(PAPER, "test")  # the test profile: one replicate
    assert counted_training == [0] and first["trained"] == 1 and first["replicates"] == 1
    exp_id = tracking.client().get_run(first["run_id"]).info.experiment_id
    (child,) = _children(exp_id)
    assert "timing/load_1m" in child.data.metrics and child.data.metrics["timing/quiet_wait_s"] >= 0

    # extend: exactly the two missing replicates train (seeds seed+1, seed+2), the claim is decided over three
    t0 = time.perf_counter()
    extended = run_paper(PAPER, "test", {"replicates": 3})
    extend_s = time.perf_counter() - t0
    assert counted_training == [0, 1, 2] and extended["trained"] == 2 and extended["replicates"] == 3
    assert "over 3 replicates" in extended["claim_numbers"]
    tags = tracking.client().get_run(extended["run_id"]).data.tags
    assert tags["paperline.lineage"] == "extended" and tags["paperline.trained_replicates"] == "1,2"
    assert tags["paperline.stored_replicates"] == f"0:{child.info.run_id}"
    assert tags["paperline.stored_from"] == first["run_id"]
    assert tags["paperline.replicate_runs"].split(",")[0] == child.info.run_id and len(_children(exp_id)) == 3

    # the claim changes (its premise dropped, a margin widened) and with it the verdict key: decided again from
    # the stored metrics, nothing trains, and the verdict follows the new claim
    paper = registry.get(PAPER)
    regret = dataclasses.replace(paper.claim.all_of[0], margin=1e6)  # below the best baseline's plus a million
    edited = dataclasses.replace(paper, claim=dataclasses.replace(paper.claim, premises=(), all_of=(regret,)))
    real_get, real_verdict_hash = registry.get, keys.verdict_hash
    monkeypatch.setattr(registry, "get", lambda pid: edited if pid == PAPER else real_get(pid))
    monkeypatch.setattr(keys, "verdict_hash", lambda f: real_verdict_hash(f) + "-edited")
    t0 = time.perf_counter()
    again = run_paper(PAPER, "test", {"replicates": 3})
    redecide_s = time.perf_counter() - t0
    assert counted_training == [0, 1, 2] and again["trained"] == 0 and not again["reused"]
    assert extended["verdict"] != "holds" and again["verdict"] == "holds" and "+ 1e+06" in again["claim_text"]
    stored = [tracking.client().get_run(i) for i in tags["paperline.replicate_runs"].split(",")]
    expected = edited.claim.decide([recorded_metrics(r, settings.runs_dir() / PAPER / r.info.run_id)
                                    for r in stored], machine=machine_name())
    assert again["claim_numbers"] == expected.numbers
    redecided = tracking.client().get_run(again["run_id"]).data.tags
    assert redecided["paperline.lineage"] == "re-decided" and redecided["paperline.trained_replicates"] == ""
    assert redecided["paperline.replicate_runs"] == tags["paperline.replicate_runs"]  # the same child runs
    assert len(_children(exp_id)) == 3
    monkeypatch.setattr(registry, "get", real_get)
    monkeypatch.setattr(keys, "verdict_hash", real_verdict_hash)

    # premises only: the premises' numbers and decisions, no deciding part printed or tagged, never a row
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, ["run", PAPER, "--profile", "test", "--set", "replicates=3", "--premises-only"])
    premises_s = time.perf_counter() - t0
    assert result.exit_code == 0, result.output
    assert f"premises {PAPER}: opo_learns: method/late_over_early_regret <= 0.5" in result.output
    assert "premise opo_learns: method/late_over_early_regret - 0.5 =" in result.output
    assert not any(part.left in result.output for part in paper.claim.all_of)
    assert f"claim {PAPER}:" not in result.output and counted_training == [0, 1, 2]
    parent = tracking.client().search_runs([exp_id], "tags.`paperline.premises_only` = 'true'")[0]
    ptags, pmetrics = parent.data.tags, parent.data.metrics
    assert ptags["premises.verdict"] and not ptags["paperline.claim.spec"] and "paperline.model_version" not in ptags
    assert not [k for k in ptags if k.startswith("claim.")] and not [k for k in pmetrics if k.startswith("claim/")]
    assert not any(part.left in k for k in pmetrics for part in paper.claim.all_of)
    assert latest_run(PAPER, "test").info.run_id == again["run_id"]  # the scoreboard row is not the premises run
    print(f"\nextend 1 -> 3 replicates: {extend_s:.1f} s; re-decide after a claim edit: {redecide_s:.1f} s; "
          f"premises-only from stored replicates: {premises_s:.1f} s\n{result.output}")


def test_default_run_ignores_replicates_and_timed_claims_are_known():
    assert registry.is_default_run("smoke", {"replicates": 5}) and not registry.is_default_run("smoke", {"seed": 1})
    assert registry.get(PAPER).claim.timed and not registry.get("sei").claim.timed


def test_training_key_follows_what_training_imports_and_not_the_claim():
    paper_file = registry.module_file("token_sparse_attention")
    files = {keys.project_path(f) for f in keys.training_files(paper_file)}
    assert {"models/token_sparse_attention.py", "kernels/token_sparse.py", "tasks/worker.py", "tasks/context.py",
            "tasks/steps.py", "models/contract.py", "models/inputs.py"} <= files
    assert not files & {"models/verdicts.py", "tasks/planning.py", "tasks/tracking.py", "tasks/replicates.py",
                        "models/sei.py"}
    assert not any(f.startswith("flows/") for f in files)
    sei = {keys.project_path(f) for f in keys.training_files(registry.module_file("sei"))}
    assert "kernels/token_sparse.py" not in sei  # only what the paper imports from kernels/ and models/common

    source = registry.module_file(PAPER).read_text()
    module, claim = keys.split_claim(source)
    assert claim.startswith("Claim(premises=(") and "timed=True" in claim and "Claim(...)" in module
    assert "def evaluate(" in module and "baseline/layerwise/episode_ms\", timed=True" not in module
    edited_claim = source.replace('"<=", 0.5, name="opo_learns"', '"<=", 0.4, name="opo_learns"')
    edited_code = source.replace("def evaluate(", "def evaluate(  ", 1)
    assert keys.split_claim(edited_claim)[0] == module and keys.split_claim(edited_claim)[1] != claim
    assert keys.split_claim(edited_code)[0] != module and keys.split_claim(edited_code)[1] == claim


def test_quiet_timing_waits_for_running_work_and_holds_new_work_off(tmp_path, monkeypatch):
    import threading

    from tasks import quiet

    monkeypatch.setenv("PAPERLINE_QUIET_LOCK", str(tmp_path / "quiet"))
    events: list[str] = []
    training = threading.Event()
    release = threading.Event()

    def train():
        with quiet.busy():
            training.set()
            release.wait(5)
            events.append("training ends")

    def timed():
        with quiet.quiet() as waited:
            events.append("timing starts")
            time.sleep(0.2)
            events.append(f"timing ends after waiting {waited[quiet.WAIT_METRIC] > 0.1}")

    def later_training():
        with quiet.busy():
            events.append("later training starts")

    first = threading.Thread(target=train)
    first.start()
    training.wait(5)
    timer = threading.Thread(target=timed)
    timer.start()
    time.sleep(0.2)  # the timer now holds the gate and waits for the training that runs
    later = threading.Thread(target=later_training)
    later.start()
    time.sleep(0.2)
    assert events == []  # neither the timing nor the later training started while the first trains
    release.set()
    for t in (first, timer, later):
        t.join(5)
    assert events == ["training ends", "timing starts", "timing ends after waiting True", "later training starts"]


def test_an_evaluation_is_quiet_only_inside_its_timing_loops(tmp_path, monkeypatch):
    """A Shift holds busy() (other work runs beside it, a timer elsewhere waits for it); inside timing() it holds
    quiet() (other work waits), and afterwards busy() again."""
    import threading

    from tasks import quiet

    monkeypatch.setenv("PAPERLINE_QUIET_LOCK", str(tmp_path / "quiet"))
    events: list[str] = []

    def other_work(name: str):
        with quiet.busy():
            events.append(name)

    with quiet.Shift() as shift:
        beside = threading.Thread(target=other_work, args=("work beside the evaluation",))
        beside.start()
        beside.join(5)
        assert events == ["work beside the evaluation"]  # busy() is shared
        with shift.timing():
            held_off = threading.Thread(target=other_work, args=("work after the timing",))
            held_off.start()
            time.sleep(0.3)
            events.append("timing ends")
            with pytest.raises(RuntimeError, match="inside another timing"), shift.timing():
                pass
        held_off.join(5)
        assert events[1:] == ["timing ends", "work after the timing"]
        assert shift.timings == 1 and shift.metrics()[quiet.WAIT_METRIC] >= 0 and quiet.LOAD_METRIC in shift.metrics()
    assert quiet.Shift().metrics() == {}  # nothing timed, nothing recorded


def test_cpu_spent_in_an_evaluator_process_is_charged_to_the_work_that_sent_it():
    from tasks import threadcpu

    threadcpu.charge(5.0)  # no work charges this thread: nothing to add to
    with threadcpu.WorkCPU() as cpu:
        threadcpu.charge(2.5)
    assert 2.5 <= cpu.seconds < 3.0


def test_scoreboard_header_names_stale_rows_and_papers_not_run_here():
    from flows.report import NOT_RUN, Row, commit_summary

    rows = [Row("a", "", "", "", "holds", "", "r1", "smoke", commit="c" * 40),
            Row("b", "", "", "", "inconclusive", "", "r2", "smoke", commit="d" * 40),
            Row("c", "", "", "", NOT_RUN, "", "", "smoke")]
    assert commit_summary(rows, "c" * 40) == \
        f"1 of 2 rows current at `{'c' * 12}` (run at this commit, or with the same code, params and data, so " \
        f"`paperline run` would reuse them); stale: b (`{'d' * 12}`)."
    # a later commit that changed no training code, params or data: b's run would be reused, so it is current
    assert commit_summary(rows, "c" * 40, frozenset({"r2"})).startswith("2 of 2 rows current")
    assert commit_summary(rows[:1], "c" * 40).startswith("1 of 1 rows current at `cccccccccccc`")
    # uncommitted changes: the rows of that commit are not the checkout's, and the header shows the suffix
    assert commit_summary(rows[:1], "c" * 40 + "-dirty").startswith("0 of 1 rows current at "
                                                                     "`cccccccccccc-dirty`")
    assert commit_summary(rows[:1], "c" * 40 + "-dirty").endswith("; stale: a (`cccccccccccc`).")
    assert NOT_RUN == "not run here"


def test_several_papers_take_a_replicates_override_and_nothing_else():
    refused = CliRunner().invoke(app, ["run", "sei", "qubo_relax", "--set", "seed=1"])
    assert refused.exit_code == 2 and "one paper at a time (except replicates" in refused.output
    from flows.pipeline import run_papers

    requests = [registry.request(pid, "test", {"seed": 1}, settings.params_file()) for pid in ("sei", "qubo_relax")]
    with pytest.raises(registry.ConfigError, match="one paper at a time"):
        run_papers(requests, force=False)


def test_outputs_written_in_the_tree_leave_the_code_clean_and_code_changes_do_not(tmp_path, monkeypatch):
    """A run's commit is HEAD's while only paperline's outputs changed (a benchmark's results, the scoreboard),
    and HEAD-dirty once code changed."""
    import subprocess

    from tasks import tracking

    def git(*args: str, env=None) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True,
                              env=env).stdout.strip()

    git("init", "-q")
    for folder, name in (("models", "paper.py"), ("benchmarks/results", "suite_run.json"), ("reports", "s.md")):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / name).write_text("0\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    monkeypatch.setattr(tracking, "_git", git)
    head = git("rev-parse", "HEAD")
    (tmp_path / "benchmarks/results/suite_run.json").write_text("1\n")
    (tmp_path / "reports/s.md").write_text("1\n")
    assert tracking.git_commit() == head
    (tmp_path / "models/paper.py").write_text("1\n")
    assert tracking.git_commit() == head + "-dirty"
