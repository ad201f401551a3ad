"""The suite benchmark's record of what else the machine ran while it was timed (benchmarks/suite_run.py)."""

from benchmarks import suite_run, tables


def test_cpu_seconds_reads_busy_and_niced_time_from_proc_stat():
    # user nice system idle iowait irq softirq steal guest guest_nice: idle, iowait and steal are not busy
    stat = "cpu  1000 200 300 5000 40 10 20 7 0 0\ncpu0 500 100 150 2500 20 5 10 3 0 0\n"
    assert suite_run.cpu_seconds(stat, hz=100) == {"busy_s": 15.3, "niced_s": 2.0}


def test_machine_cpu_counts_work_done_in_between():
    before = suite_run.machine_cpu()
    sum(i * i for i in range(2_000_000))  # ~0.1 CPU-s of this process
    after = suite_run.machine_cpu()
    assert after["busy_s"] > before["busy_s"] and after["niced_s"] >= before["niced_s"]
    assert suite_run.autogroup() in ("0", "1", "absent")


def test_suite_table_shows_other_cpu_where_it_was_recorded():
    assert tables._other({"wall_s": 1}) == ""  # settings measured before it was recorded
    assert tables._other({"other_cpu_s": 12.34, "niced_cpu_s": 4.0, "sched_autogroup": "0"}) == "12 (4), autogroup 0"
