"""The decision rule (models/verdicts.py) on constructed metric sets: clear win, clear loss, tie, one replicate,
best-of-K, thresholds with margins and scales, premises, context and timed parts; the parent run's aggregates."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from models.verdicts import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    Claim,
    ClaimResult,
    Compare,
    replicates_to_decide,
    t_interval,
)
from tasks.replicates import aggregate, claim_metrics


def reps(left: list[float], right: list[float], left_name="method/a", right_name="baseline/b/a"):
    return [{left_name: a, right_name: b} for a, b in zip(left, right, strict=True)]


def test_t_interval_matches_scipy():
    values = [0.1, 0.4, 0.25, 0.3]
    mean, low, high = t_interval(values)
    expected = stats.t.interval(0.95, len(values) - 1, loc=stats.tmean(values), scale=stats.sem(values))
    assert mean == pytest.approx(0.2625) and (low, high) == pytest.approx(expected)
    assert math.isnan(t_interval([1.0])[1]) and t_interval([2.0, 2.0]) == (2.0, 2.0, 2.0)


@pytest.mark.parametrize(("left", "right", "op", "verdict"), [
    ([0.90, 0.91, 0.92], [0.80, 0.80, 0.81], ">", HOLDS),          # clear win
    ([0.70, 0.71, 0.69], [0.80, 0.80, 0.81], ">", FAILS),          # clear loss
    ([0.80, 0.90, 0.70], [0.81, 0.79, 0.80], ">", INCONCLUSIVE),   # the interval crosses zero
    ([0.80, 0.80, 0.80], [0.80, 0.80, 0.80], ">=", HOLDS),         # an exact tie satisfies >= ...
    ([0.80, 0.80, 0.80], [0.80, 0.80, 0.80], ">", FAILS),          # ... and refutes >
    ([1.0, 1.1, 0.9], [2.0, 2.1, 2.2], "<", HOLDS),                # lower is better
    ([2.5, 2.65, 2.7], [2.0, 2.1, 2.2], "<", FAILS),
])
def test_paired_rule(left, right, op, verdict):
    part = Compare("method/a", op, "baseline/b/a").decide(reps(left, right))
    assert part.verdict == verdict and part.replicates == 3
    assert part.mean == pytest.approx(sum(left) / 3 - sum(right) / 3)


def test_pairing_uses_the_replicate_not_the_means():
    # every replicate wins by 0.01 although the spread across replicates is 10x larger: paired, this holds
    left, right = [0.51, 0.81, 0.31], [0.50, 0.80, 0.30]
    assert Compare("method/a", ">", "baseline/b/a").decide(reps(left, right)).verdict == HOLDS


def test_one_replicate_is_always_inconclusive():
    claim = Claim(all_of=(Compare("method/a", ">", "baseline/b/a"),))
    result = claim.decide(reps([0.99], [0.01]))
    assert result.verdict == INCONCLUSIVE and "1 replicate" in result.reason
    assert math.isnan(result.parts[0].low) and result.parts[0].mean == pytest.approx(0.98)


def test_best_of_k_is_taken_within_each_replicate():
    names = ("baseline/x/a", "baseline/y/a")
    metrics = [{"method/a": 0.80, "baseline/x/a": 0.79, "baseline/y/a": 0.70},
               {"method/a": 0.81, "baseline/x/a": 0.70, "baseline/y/a": 0.80},
               {"method/a": 0.82, "baseline/x/a": 0.81, "baseline/y/a": 0.60}]
    part = Compare("method/a", ">", names).decide(metrics)
    assert part.mean == pytest.approx(0.01) and part.verdict == HOLDS
    assert part.best == "best: baseline/x/a, baseline/y/a"
    assert "best(baseline/{x,y}/a)" in part.effect and "max(baseline/{x,y}/a)" in Compare("method/a", ">", names).text()
    lower = Compare("method/a", "<", names).decide(metrics)  # < takes the min of the right side
    assert lower.mean == pytest.approx(0.81 - (0.70 + 0.70 + 0.60) / 3)


def test_fixed_threshold_margin_and_scale():
    ms = [{"method/acc": v, "baseline/cd/acc": 0.805} for v in (0.799, 0.798, 0.797)]
    assert Compare("method/acc", ">=", "baseline/cd/acc").decide(ms).verdict == FAILS
    within_a_point = Compare("method/acc", ">=", "baseline/cd/acc", margin=-0.01)
    assert within_a_point.decide(ms).verdict == HOLDS and within_a_point.text() == \
        "method/acc >= baseline/cd/acc - 0.01"
    fd = [{"method/fd": a, "baseline/ft/fd": b} for a, b in ((10.5, 10.0), (10.6, 10.1), (10.4, 9.9))]
    scaled = Compare("method/fd", "<=", "baseline/ft/fd", scale=1.1)
    assert scaled.decide(fd).verdict == HOLDS and scaled.text() == "method/fd <= 1.1 x baseline/ft/fd"
    assert Compare("method/fd", "<=", "baseline/ft/fd").decide(fd).verdict == FAILS
    threshold = Compare("method/acc", ">", 0.5)
    assert threshold.decide(ms).verdict == HOLDS and threshold.decide(ms).mean == pytest.approx(0.298)
    assert threshold.effect_text() == "method/acc - 0.5" and Compare("x", ">", 0.0).effect_text() == "x"
    assert Compare("x", ">=", 0.0, margin=-0.02).effect_text() == "x + 0.02"


def test_premises_make_a_claim_inconclusive_with_their_numbers():
    win = reps([0.90, 0.91, 0.92], [0.80, 0.80, 0.81])
    for m in win:
        m["detail/train_acc"] = 0.3
    claim = Claim(premises=(Compare("detail/train_acc", ">=", 0.9, name="fits"),),
                  all_of=(Compare("method/a", ">", "baseline/b/a"),))
    result = claim.decide(win)
    assert result.verdict == INCONCLUSIVE and result.reason.startswith("premise fits failed (detail/train_acc - 0.9")
    assert result.parts[1].verdict == HOLDS  # the part is still computed and shown
    for m in win:
        m["detail/train_acc"] = 0.95
    assert claim.decide(win).verdict == HOLDS
    with pytest.raises(ValueError, match="needs a name"):
        Claim(premises=(Compare("detail/train_acc", ">=", 0.9),), all_of=())


def test_any_decisive_failure_fails_the_claim_and_context_never_decides():
    metrics = [{"a": 1.0 + i / 10, "b": 0.0, "c": 5.0 + i / 10, "flops": 1.0} for i in range(3)]
    claim = Claim(all_of=(Compare("a", ">", "b"), Compare("c", "<", "b")), context=(Compare("flops", ">", 2.0),))
    result = claim.decide(metrics)
    assert result.verdict == FAILS and [p.role for p in result.parts] == ["part", "part", "context"]
    only_win = Claim(all_of=(Compare("a", ">", "b"),), context=(Compare("flops", ">", 2.0),))
    assert only_win.decide(metrics).verdict == HOLDS  # the failing context part does not count
    mixed = Claim(all_of=(Compare("a", ">", "b"), Compare("noisy", ">", "b")))
    noisy = [{**m, "noisy": v} for m, v in zip(metrics, (1.0, -1.0, 0.5), strict=True)]
    assert mixed.decide(noisy).verdict == INCONCLUSIVE


def _timings(method_s: list[float], baseline_s: list[float], load: float | None = None) -> dict[str, float]:
    m = {"method/s": sum(method_s) / len(method_s), "baseline/b/s": sum(baseline_s) / len(baseline_s)}
    m |= {f"method/s/k{i}": v for i, v in enumerate(method_s)}
    m |= {f"baseline/b/s/k{i}": v for i, v in enumerate(baseline_s)}
    return m if load is None else m | {"timing/load_1m": load}


def test_timed_parts_decide_over_replicate_medians_and_say_where_they_ran():
    metrics = [_timings([1.0, 1.1, 0.9, 1.0, 1.05], [2.0, 2.1, 1.9, 2.2, 2.0], load=0.25 * i) for i in range(3)]
    part = Compare("method/s", "<", "baseline/b/s", timed=True).decide(metrics, machine="Test CPU")
    # one value per replicate: median 1.0 minus median 2.0, identical in all three replicates
    assert part.verdict == HOLDS and part.samples == 3 and part.replicates == 3 and part.timings == 5
    assert (part.mean, part.low, part.high) == (-1.0, -1.0, -1.0)
    assert "over 3 replicates (median of 5 timings each) (timed on Test CPU, load 0.5)" in part.line()
    with pytest.raises(KeyError, match=">= 5 timings"):
        Compare("method/s", "<", "baseline/b/s", timed=True).decide([{"method/s": 1.0, "baseline/b/s": 2.0}])


def test_timed_interval_has_replicates_minus_one_degrees_of_freedom():
    """Timings within a replicate share its machine state: the interval is the t-interval over the replicates'
    medians, not over pooled timings (which would be narrower and wrong)."""
    shifts = (0.0, 0.3, -0.2)  # each replicate's machine is a little faster or slower, for both arms alike
    jitter = (0.05, -0.04, 0.0, 0.03, -0.06, 0.01, 0.02)  # k = 7 timings, median 0.01
    metrics = [_timings([1.0 + s + j for j in jitter], [1.2 + 2 * s + j for j in jitter]) for s in shifts]
    part = Compare("method/s", "<", "baseline/b/s", timed=True).decide(metrics)
    medians = [(1.0 + s + 0.01) - (1.2 + 2 * s + 0.01) for s in shifts]
    assert part.samples == 3 and part.timings == 7
    assert (part.mean, part.low, part.high) == pytest.approx(t_interval(medians))
    pooled = t_interval([(1.0 + s + j) - (1.2 + 2 * s + j) for s in shifts for j in jitter])
    assert part.high - part.low > 2 * (pooled[2] - pooled[1])  # 2 degrees of freedom, not 20
    # a ratio timed k times (speedup): the median of its k values, per replicate
    speedups = [{"method/speedup": 2.0, **{f"method/speedup/k{i}": v for i, v in enumerate((9.0, 2.1, 2.0, 1.9,
                                                                                            2.2))}}] * 2
    assert Compare("method/speedup", ">=", 2.0, timed=True).decide(speedups).mean == pytest.approx(0.1)


def test_premises_guard_only_the_parts_they_name():
    """stp's case: a sample-quality premise fails; the parts it does not guard still decide."""
    metrics = [{"quality/valid": 0.2, "method/fid": 1.0 + i / 10, "baseline/x/fid": 2.0, "method/harm": 0.5 + i / 20,
                "baseline/x/harm": 0.1} for i in range(3)]
    parts = (Compare("method/fid", "<", "baseline/x/fid", name="sample_quality"),
             Compare("method/harm", ">", "baseline/x/harm"))
    scoped = Claim(all_of=parts, premises=(Compare("quality/valid", ">=", 0.9, name="valid",
                                                   guards=("sample_quality",)),))
    result = scoped.decide(metrics)
    assert result.verdict == INCONCLUSIVE
    assert result.reason.startswith("premise valid failed (quality/valid - 0.9 = -0.7")
    assert result.reason.endswith("; undecided: method/fid - baseline/x/fid")
    fid, harm = result.parts[1], result.parts[2]
    assert fid.undecided_by == "valid" and fid.verdict == HOLDS  # its own interval is still shown ...
    assert "-> holds (undecided: premise valid not met)" in fid.line()  # ... and marked as not counting
    assert harm.undecided_by == "" and harm.verdict == HOLDS
    # an unguarded part that fails decides the claim even though a premise failed
    failing = [{**m, "method/harm": 0.0 - i / 100} for i, m in enumerate(metrics)]
    assert scoped.decide(failing).verdict == FAILS
    # guarded by left metric as well as by name; the default guards every part
    by_metric = Claim(all_of=parts, premises=(Compare("quality/valid", ">=", 0.9, name="valid",
                                                      guards=("method/harm",)),))
    assert [p.undecided_by for p in by_metric.decide(metrics).parts[1:]] == ["", "valid"]
    everything = Claim(all_of=parts, premises=(Compare("quality/valid", ">=", 0.9, name="valid"),))
    assert [p.undecided_by for p in everything.decide(failing).parts[1:]] == ["valid", "valid"]
    assert everything.decide(failing).verdict == INCONCLUSIVE and "undecided" not in everything.decide(failing).reason
    met = [{**m, "quality/valid": 0.95 + i / 100} for i, m in enumerate(metrics)]
    assert scoped.decide(met).verdict == HOLDS
    with pytest.raises(ValueError, match="guard parts the claim does not have"):
        Claim(all_of=parts, premises=(Compare("quality/valid", ">=", 0.9, name="valid", guards=("nope",)),))


def test_premises_only_result_never_names_the_deciding_parts():
    claim = Claim(all_of=(Compare("method/a", ">", "baseline/b/a"),),
                  premises=(Compare("detail/fit", ">=", 0.9, name="fits"),))
    metrics = [{"method/a": 0.9, "baseline/b/a": 0.1, "detail/fit": 0.95 + i / 100} for i in range(3)]
    result = claim.decide_premises(metrics)
    assert result.verdict == HOLDS and [p.role for p in result.parts] == ["premise"]
    assert "method/a" not in result.text + result.numbers + result.reason
    low = [{**m, "detail/fit": 0.5 + i / 100} for i, m in enumerate(metrics)]
    assert claim.decide_premises(low).verdict == FAILS and claim.decide_premises(low).reason == "not met: fits"
    assert Claim(all_of=claim.all_of).decide_premises(metrics).reason == "the claim declares no premises"


@pytest.mark.parametrize(("mean", "sd", "expected"), [
    (1.0, 0.0, 2),
    (0.0, 1.0, None),
    (1e-6, 1.0, None),   # would need millions of replicates: the effect is about zero
])
def test_replicates_to_decide_edge_cases(mean, sd, expected):
    assert replicates_to_decide(mean, sd) == expected


def test_replicates_to_decide_is_the_first_count_whose_interval_excludes_zero():
    mean, sd = 0.5, 0.6
    n = replicates_to_decide(mean, sd)
    half = [stats.t.ppf(0.975, k - 1) * sd / math.sqrt(k) for k in (n - 1, n)]
    assert half[0] >= mean > half[1] and n == 9
    assert replicates_to_decide(-mean, sd) == n  # a decisive failure counts as decided too
    # on a part: three replicates leave it undecided, the hint says where it would be decided
    diffs = (0.2, 0.9, 0.4)
    part = Compare("a", ">", "b").decide([{"a": d, "b": 0.0} for d in diffs])
    assert part.verdict == INCONCLUSIVE and part.sd == pytest.approx(stats.tstd(diffs))
    expected = replicates_to_decide(sum(diffs) / 3, stats.tstd(diffs))
    assert part.decided_at == f"decided at ~{expected} replicates" and part.decided_at in part.line()
    flat = Compare("a", ">", "b").decide([{"a": d, "b": 0.0} for d in (0.5, -0.5, 0.001)])
    assert flat.decided_at == "effect ~ 0"
    assert Compare("a", ">", "b").decide([{"a": 1 + d, "b": 0.0} for d in diffs]).decided_at == ""  # decided


def test_claim_line_and_round_trip():
    claim = Claim(all_of=(Compare("method/a", ">", ("baseline/x/a", "baseline/y/a")),))
    result = claim.decide([{"method/a": 0.7, "baseline/x/a": 0.72, "baseline/y/a": 0.71},
                           {"method/a": 0.71, "baseline/x/a": 0.73, "baseline/y/a": 0.7},
                           {"method/a": 0.69, "baseline/x/a": 0.715, "baseline/y/a": 0.69}])
    line = result.line("toy")
    assert line.startswith("claim toy: method/a > max(baseline/{x,y}/a) -> does not hold\n")
    assert "method/a - best(baseline/{x,y}/a) = -0.0" in line and "over 3 replicates" in line
    assert type(result).from_dict(result.to_dict()) == result


def test_parent_aggregates_each_metric_with_its_interval():
    out = aggregate([{"m": 1.0, "only_once": 3.0}, {"m": 2.0}, {"m": 3.0}])
    assert out["m"] == 2.0 and out["stats/m/n"] == 3 and out["stats/m/std"] == 1.0
    assert (out["stats/m/ci95_low"], out["stats/m/ci95_high"]) == pytest.approx(t_interval([1.0, 2.0, 3.0])[1:])
    assert out["only_once"] == 3.0 and out["stats/only_once/n"] == 1 and "stats/only_once/std" not in out
    result = Claim(all_of=(Compare("m", ">", 0.0),)).decide([{"m": 1.0}, {"m": 1.5}, {"m": 2.0}])
    assert claim_metrics(result)["claim/verdict"] == 1.0 and claim_metrics(result)["claim/part0/effect"] == 1.5


def test_morning_report_flags_only_reversals_between_decisive_verdicts():
    from flows.morning import Line

    def line(before, now):
        return Line("sei", "retrained", verdict_before=before, verdict_now=now)

    assert line("holds", "does not hold").flipped and line("does not hold", "holds").flipped
    lost = line("holds", "inconclusive")
    assert not lost.flipped and lost.became_inconclusive
    assert not line("inconclusive", "holds").flipped and not line("inconclusive", "holds").became_inconclusive
    assert not line("", "holds").flipped


def test_a_claims_note_is_part_of_its_text_and_of_every_result():
    """`Claim.note` (what stands in for what) travels with the numbers: the claim line and the scoreboard print it."""
    claim = Claim((Compare("method/a", ">", "baseline/b/a"),), note="MiniLM stands in for CLIP")
    assert claim.text() == "method/a > baseline/b/a [MiniLM stands in for CLIP]"
    result = claim.decide([{"method/a": 1.0 + i / 10, "baseline/b/a": 0.5} for i in range(3)])
    assert result.text == claim.text() and ClaimResult.from_dict(result.to_dict()).text == claim.text()
    assert Claim((Compare("method/a", ">", "baseline/b/a"),)).text() == "method/a > baseline/b/a"
