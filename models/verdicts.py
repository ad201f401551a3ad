"""Claims and their verdicts over replicates (../shared/DESIGN.md, "Verdicts").

A claim is a conjunction of comparisons between evaluation metrics. Each comparison is decided on its paired
per-replicate difference d_r = left_r - (scale * best right_r + margin), where the best right side is the max over
the named metrics for `>`/`>=` and the min for `<`/`<=`, taken within each replicate. A 95 % t-interval over the
d_r says `holds` when it lies on the claimed side, `does not hold` when it lies on the other side, `inconclusive`
otherwise; one replicate is always inconclusive. Premises are comparisons that must hold for the experiment to
test the paper at all; a premise that does not hold makes the claim inconclusive. Context comparisons are logged
and shown but never decide (an analytic count, a part that holds by construction).

A `timed` comparison (wall clock) carries its own repeats: the paper returns k >= 5 samples per replicate as
`<metric>/k0 ... <metric>/k{k-1}`, paired by index, and the interval pools them over replicates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

Verdict = Literal["holds", "does not hold", "inconclusive"]
HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
VERDICTS: tuple[str, ...] = (HOLDS, FAILS, INCONCLUSIVE)
MIN_TIMINGS = 5
LEVEL = 0.95


@dataclass(frozen=True)
class Compare:
    """`left op scale x right + margin`, written as the spec writes it (`left >= right - 0.01` is margin=-0.01,
    `left <= 1.1 x right` is scale=1.1). `right`: a metric name, a number the spec fixes (a threshold), or a tuple
    of metric names meaning "the best of these" (max for > and >=, min for < and <=). `name` labels a premise."""

    left: str
    op: Literal[">", ">=", "<", "<="]
    right: str | float | tuple[str, ...]
    margin: float = 0.0
    scale: float = 1.0
    timed: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.op not in (">", ">=", "<", "<="):
            raise ValueError(f"Compare: unknown operator {self.op!r}")
        if self.scale <= 0:
            raise ValueError(f"Compare: scale must be positive, got {self.scale}")

    @property
    def upward(self) -> bool:
        return self.op in (">", ">=")

    @property
    def right_names(self) -> tuple[str, ...]:
        if isinstance(self.right, int | float):
            return ()
        return (self.right,) if isinstance(self.right, str) else tuple(self.right)

    def text(self) -> str:
        if isinstance(self.right, int | float):
            right = f"{self.right:g}"
        elif isinstance(self.right, str):
            right = self.right
        else:
            right = f"{'max' if self.upward else 'min'}({_compact(self.right)})"
        if self.scale != 1.0:
            right = f"{self.scale:g} x {right}"
        if self.margin:
            right = f"{right} {'+' if self.margin > 0 else '-'} {abs(self.margin):g}"
        return f"{self.left} {self.op} {right}" + (" (timed)" if self.timed else "")

    def effect_text(self) -> str:
        """What the interval is about: 'left - best(right)' in short."""
        names = self.right_names
        if not names:  # a threshold: "left - 0.9", "left + 0.02", or just "left" against zero
            value = self.scale * float(self.right) + self.margin  # type: ignore[arg-type]
            return self.left if value == 0 else f"{self.left} {'-' if value > 0 else '+'} {abs(value):g}"
        else:
            right = names[0] if len(names) == 1 else f"best({_compact(names)})"
            right = f"{self.scale:g} x {right}" if self.scale != 1.0 else right
            right = f"({right} {'+' if self.margin > 0 else '-'} {abs(self.margin):g})" if self.margin else right
        return f"{self.left} - {right}"

    def differences(self, metrics: Mapping[str, float]) -> tuple[list[float], list[str]]:
        """The paired differences of one replicate (one value; k values when timed) and the right-hand metric that
        was best in each."""
        if not self.timed:
            return [self._difference(metrics, "")], [self._best(metrics, "")[1]]
        k = 0
        while f"{self.left}/k{k}" in metrics:
            k += 1
        if k < MIN_TIMINGS:
            raise KeyError(f"timed comparison {self.text()!r} needs >= {MIN_TIMINGS} timings per replicate "
                           f"({self.left}/k0 ...), evaluate() returned {k}")
        suffixes = [f"/k{i}" for i in range(k)]
        return [self._difference(metrics, s) for s in suffixes], [self._best(metrics, s)[1] for s in suffixes]

    def _best(self, metrics: Mapping[str, float], suffix: str) -> tuple[float, str]:
        names = self.right_names
        if not names:
            return float(self.right), ""  # type: ignore[arg-type]
        missing = [n + suffix for n in names if n + suffix not in metrics]
        if missing:
            raise KeyError(f"claim needs metrics that evaluate() did not return: {missing}")
        values = {n: float(metrics[n + suffix]) for n in names}
        best = (max if self.upward else min)(values, key=values.get)
        return values[best], best

    def _difference(self, metrics: Mapping[str, float], suffix: str) -> float:
        if self.left + suffix not in metrics:
            raise KeyError(f"claim needs metrics that evaluate() did not return: {[self.left + suffix]}")
        right, _ = self._best(metrics, suffix)
        return float(metrics[self.left + suffix]) - (self.scale * right + self.margin)

    def decide(self, replicates: Sequence[Mapping[str, float]], role: str = "part", machine: str = "") -> PartResult:
        diffs, bests = [], []
        for metrics in replicates:
            d, b = self.differences(metrics)
            diffs += d
            bests += b
        mean, low, high = t_interval(diffs)
        verdict = INCONCLUSIVE if len(replicates) < 2 or math.isnan(low) else decide_interval(low, high, self.op)
        winners = sorted({b for b in bests if b})
        best = "" if len(self.right_names) < 2 else f"best: {', '.join(winners)}"
        return PartResult(role=role, name=self.name, text=self.text(), effect=self.effect_text(), mean=mean, low=low,
                          high=high, replicates=len(replicates), samples=len(diffs), verdict=verdict, best=best,
                          machine=machine if self.timed else "")


def decide_interval(low: float, high: float, op: str) -> str:
    """Which side of zero the interval of d lies on, read against the claimed direction. A non-strict claim
    (>=, <=) holds on an interval that touches zero from its side (a tie in every replicate); a strict one fails."""
    if op in ("<", "<="):  # claimed side negative: mirror it
        low, high, op = -high, -low, {"<": ">", "<=": ">="}[op]
    strict = op == ">"
    if low > 0 or (low == 0 and not strict):
        return HOLDS
    if high < 0 or (high == 0 and strict):
        return FAILS
    return INCONCLUSIVE


def t_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float, float]:
    """Mean and the two-sided t-interval of the mean; (mean, nan, nan) for fewer than two values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = math.fsum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    from scipy import stats

    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _compact(names: Sequence[str]) -> str:
    """("baseline/aum/auroc", "baseline/loss/auroc") -> "baseline/{aum,loss}/auroc"."""
    parts = [n.split("/") for n in names]
    if len({len(p) for p in parts}) == 1 and len(parts[0]) >= 2:
        varying = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
        if len(varying) == 1:
            i = varying[0]
            return "/".join(parts[0][:i] + ["{" + ",".join(p[i] for p in parts) + "}"] + parts[0][i + 1 :])
    return ", ".join(names)


@dataclass(frozen=True)
class PartResult:
    role: str           # premise | part | context
    name: str           # a premise's name
    text: str           # the comparison as written
    effect: str         # what the interval is about
    mean: float
    low: float
    high: float
    replicates: int
    samples: int
    verdict: str
    best: str = ""      # which right-hand metric was best, where there were several
    machine: str = ""   # where a timed part was measured

    def line(self) -> str:
        interval = "no interval" if math.isnan(self.low) else f"[{self.low:.4g}, {self.high:.4g}]"
        over = f"over {self.replicates} replicate{'s' if self.replicates != 1 else ''}"
        if self.samples != self.replicates:
            over += f" x {self.samples // max(self.replicates, 1)} timings"
        timed = f" (timed on {self.machine})" if self.machine else ""
        label = {"premise": f"premise {self.name}: ", "context": "context: "}.get(self.role, "")
        best = f" ({self.best})" if self.best else ""
        return f"{label}{self.effect} = {self.mean:.4g} {interval} {over}{timed}{best} -> {self.verdict}"


@dataclass(frozen=True)
class ClaimResult:
    verdict: str
    text: str
    replicates: int
    reason: str = ""    # why inconclusive, when it is
    parts: tuple[PartResult, ...] = field(default_factory=tuple)

    @property
    def holds(self) -> bool:
        return self.verdict == HOLDS

    @property
    def numbers(self) -> str:
        return "\n".join(p.line() for p in self.parts)

    def headline(self) -> str:
        return self.verdict + (f": {self.reason}" if self.reason else "")

    def line(self, paper_id: str) -> str:
        body = "\n".join(f"  {p.line()}" for p in self.parts)
        return f"claim {paper_id}: {self.text} -> {self.headline()}\n{body}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> ClaimResult:
        parts = tuple(PartResult(**p) for p in data.get("parts", ()))
        return cls(data["verdict"], data["text"], data["replicates"], data.get("reason", ""), parts)


@dataclass(frozen=True)
class Claim:
    """What a paper claims (`all_of`, a conjunction), what must be true for the experiment to test it
    (`premises`, each named) and what is shown beside it without deciding (`context`). `note` says what stands in
    for what, or what is left out; it is part of the claim's text, so the claim line and the scoreboard print it
    beside the numbers (the `summary` is the claim in words, for the module's reader)."""

    all_of: tuple[Compare, ...]
    summary: str = ""
    premises: tuple[Compare, ...] = ()
    context: tuple[Compare, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        unnamed = [p.text() for p in self.premises if not p.name]
        if unnamed:
            raise ValueError(f"every premise needs a name: {unnamed}")

    def text(self) -> str:
        parts = " and ".join(c.text() for c in self.all_of)
        return f"{parts} [{self.note}]" if self.note else parts

    def metric_names(self) -> set[str]:
        return {n for c in (*self.premises, *self.all_of, *self.context) for n in (c.left, *c.right_names)}

    def decide(self, replicates: Sequence[Mapping[str, float]], machine: str = "") -> ClaimResult:
        """The verdict over replicates (one metrics mapping per replicate)."""
        premises = [c.decide(replicates, "premise", machine) for c in self.premises]
        parts = [c.decide(replicates, "part", machine) for c in self.all_of]
        context = [c.decide(replicates, "context", machine) for c in self.context]
        everything = (*premises, *parts, *context)
        n = len(replicates)
        unmet = [p for p in premises if p.verdict != HOLDS]
        if n < 2:
            return ClaimResult(INCONCLUSIVE, self.text(), n, f"{n} replicate, no interval", everything)
        if unmet:
            p = unmet[0]
            state = "failed" if p.verdict == FAILS else "not shown"
            reason = f"premise {p.name} {state} ({p.effect} = {p.mean:.4g} [{p.low:.4g}, {p.high:.4g}])"
            return ClaimResult(INCONCLUSIVE, self.text(), n, reason, everything)
        verdicts = [p.verdict for p in parts]
        verdict = FAILS if FAILS in verdicts else HOLDS if all(v == HOLDS for v in verdicts) else INCONCLUSIVE
        return ClaimResult(verdict, self.text(), n, "", everything)

    def evaluate(self, metrics: Mapping[str, float]) -> ClaimResult:
        """One replicate's view (always inconclusive as a verdict): checks the metrics the claim needs exist."""
        return self.decide([metrics])
