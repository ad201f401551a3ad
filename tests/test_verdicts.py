"""The decision rule (models/verdicts.py) on constructed metric sets: clear win, clear loss, tie, one replicate,
best-of-K, thresholds with margins and scales, premises, context and timed parts; the parent run's aggregates."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from models.verdicts import FAILS, HOLDS, INCONCLUSIVE, Claim, ClaimResult, Compare, t_interval
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


def test_timed_parts_pool_their_repeats_and_say_where_they_ran():
    def timings(method_s, baseline_s):
        m = {"method/s": sum(method_s) / 5, "baseline/b/s": sum(baseline_s) / 5}
        m |= {f"method/s/k{i}": v for i, v in enumerate(method_s)}
        return m | {f"baseline/b/s/k{i}": v for i, v in enumerate(baseline_s)}

    metrics = [timings([1.0, 1.1, 0.9, 1.0, 1.05], [2.0, 2.1, 1.9, 2.2, 2.0]) for _ in range(3)]
    part = Compare("method/s", "<", "baseline/b/s", timed=True).decide(metrics, machine="Test CPU")
    assert part.verdict == HOLDS and part.samples == 15 and part.replicates == 3
    assert "x 5 timings (timed on Test CPU)" in part.line()
    with pytest.raises(KeyError, match=">= 5 timings"):
        Compare("method/s", "<", "baseline/b/s", timed=True).decide([{"method/s": 1.0, "baseline/b/s": 2.0}])


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
