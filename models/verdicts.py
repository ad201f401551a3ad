"""Claims and their verdicts over replicates (../shared/DESIGN.md, "Verdicts").

A claim is a conjunction of comparisons between evaluation metrics. Each comparison is decided on its paired
per-replicate difference d_r = left_r - (scale * best right_r + margin), where the best right side is the max over
the named metrics for `>`/`>=` and the min for `<`/`<=`, taken within each replicate. A 95 % t-interval over the
d_r says `holds` when it lies on the claimed side, `does not hold` when it lies on the other side, `inconclusive`
otherwise; one replicate is always inconclusive. Premises are comparisons that must hold for the experiment to
test the paper at all; a premise that does not hold leaves the parts it guards undecided (`guards`: the parts'
names or left metrics; default every part), and the claim inconclusive unless a part it does not guard fails.
Context comparisons are logged and shown but never decide (an analytic count, a part that holds by construction).

A `timed` comparison (wall clock) carries its own repeats: the paper returns k >= 5 samples per replicate as
`<metric>/k0 ... <metric>/k{k-1}`. Timings within one replicate share its machine state, so they are not
independent samples: each replicate contributes the median of its k timings of each metric, and the interval is
the t-interval over replicates.

An undecided part says how many replicates would decide it if its observed effect and spread stayed as they are
(`replicates_to_decide`), or that its effect is about zero: whether more replicates or a better experiment is what
is missing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

Verdict = Literal["holds", "does not hold", "inconclusive"]
HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
VERDICTS: tuple[str, ...] = (HOLDS, FAILS, INCONCLUSIVE)
MIN_TIMINGS = 5
LEVEL = 0.95
MAX_REPLICATES = 100  # PaperParams.replicates' bound: an effect not decided within it reads as "effect ~ 0"
LOAD_METRIC = "timing/load_1m"  # the machine's 1-minute load average when a replicate's timings were taken


@dataclass(frozen=True)
class Compare:
    """`left op scale x right + margin`, written as the spec writes it (`left >= right - 0.01` is margin=-0.01,
    `left <= 1.1 x right` is scale=1.1). `right`: a metric name, a number the spec fixes (a threshold), or a tuple
    of metric names meaning "the best of these" (max for > and >=, min for < and <=). `name` labels a premise
    (and may label a part). `guards`, on a premise only: the parts it guards, by their name or left metric; empty
    means every part."""

    left: str
    op: Literal[">", ">=", "<", "<="]
    right: str | float | tuple[str, ...]
    margin: float = 0.0
    scale: float = 1.0
    timed: bool = False
    name: str = ""
    guards: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.op not in (">", ">=", "<", "<="):
            raise ValueError(f"Compare: unknown operator {self.op!r}")
        if self.scale <= 0:
            raise ValueError(f"Compare: scale must be positive, got {self.scale}")
        if isinstance(self.guards, str):
            raise ValueError(f"Compare: guards must be a tuple of part names, got the string {self.guards!r}")

    def guarded_by(self, premise: Compare) -> bool:
        """Whether this part is one the premise guards."""
        return not premise.guards or bool({self.name, self.left} & set(premise.guards) - {""})

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

    def replicate_view(self, metrics: Mapping[str, float]) -> Mapping[str, float]:
        """The metrics one replicate contributes: as they are; for a timed comparison, each named metric is the
        median of its k timings (`<metric>/k0 ...`, k >= MIN_TIMINGS)."""
        if not self.timed:
            return metrics
        view = {}
        for name in (self.left, *self.right_names):
            k = 0
            while f"{name}/k{k}" in metrics:
                k += 1
            if k < MIN_TIMINGS:
                raise KeyError(f"timed comparison {self.text()!r} needs >= {MIN_TIMINGS} timings per replicate "
                               f"({name}/k0 ...), evaluate() returned {k}")
            view[name] = statistics.median(float(metrics[f"{name}/k{i}"]) for i in range(k))
            view[f"{name}/timings"] = float(k)
        return view

    def difference(self, metrics: Mapping[str, float]) -> tuple[float, str]:
        """One replicate's paired difference and the right-hand metric that was best in it."""
        view = self.replicate_view(metrics)
        if self.left not in view:
            raise KeyError(f"claim needs metrics that evaluate() did not return: {[self.left]}")
        right, best = self._best(view)
        return float(view[self.left]) - (self.scale * right + self.margin), best

    def _best(self, metrics: Mapping[str, float]) -> tuple[float, str]:
        names = self.right_names
        if not names:
            return float(self.right), ""  # type: ignore[arg-type]
        missing = [n for n in names if n not in metrics]
        if missing:
            raise KeyError(f"claim needs metrics that evaluate() did not return: {missing}")
        values = {n: float(metrics[n]) for n in names}
        best = (max if self.upward else min)(values, key=values.get)
        return values[best], best

    def decide(self, replicates: Sequence[Mapping[str, float]], role: str = "part", machine: str = "") -> PartResult:
        pairs = [self.difference(metrics) for metrics in replicates]
        diffs, bests = [d for d, _ in pairs], [b for _, b in pairs]
        mean, low, high = t_interval(diffs)
        verdict = INCONCLUSIVE if len(replicates) < 2 or math.isnan(low) else decide_interval(low, high, self.op)
        winners = sorted({b for b in bests if b})
        best = "" if len(self.right_names) < 2 else f"best: {', '.join(winners)}"
        timings = min(int(self.replicate_view(m)[f"{self.left}/timings"]) for m in replicates) if self.timed \
            and replicates else 0
        loads = [float(m[LOAD_METRIC]) for m in replicates if LOAD_METRIC in m] if self.timed else []
        return PartResult(role=role, name=self.name, text=self.text(), effect=self.effect_text(), mean=mean, low=low,
                          high=high, replicates=len(replicates), samples=len(diffs), verdict=verdict, best=best,
                          machine=machine if self.timed else "", sd=_sd(diffs), timings=timings,
                          load=max(loads) if loads else math.nan)


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


def _sd(values: Sequence[float]) -> float:
    if len(values) < 2:
        return math.nan
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def replicates_to_decide(mean: float, sd: float, level: float = LEVEL) -> int | None:
    """The fewest replicates whose t-interval would exclude zero, were the observed mean and spread of the paired
    differences to stay as they are; None when no count up to MAX_REPLICATES would (the effect is about zero)."""
    if not (math.isfinite(mean) and math.isfinite(sd)) or mean == 0:
        return None
    if sd == 0:
        return 2
    from scipy import stats

    for n in range(2, MAX_REPLICATES + 1):
        if float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n) < abs(mean):
            return n
    return None


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
    sd: float = math.nan        # spread of the paired differences over replicates
    timings: int = 0            # timed: the timings per replicate whose median it contributed
    load: float = math.nan      # timed: the highest 1-minute load average its replicates were timed at
    undecided_by: str = ""      # a part: the premises that failed to hold and so leave it undecided

    @property
    def decided_at(self) -> str:
        """For an undecided part or premise with an interval: the replicate count that would decide its observed
        effect given its observed spread, or "effect ~ 0"; "" otherwise."""
        if self.verdict != INCONCLUSIVE or self.role == "context" or math.isnan(self.low):
            return ""
        n = replicates_to_decide(self.mean, self.sd)
        return "effect ~ 0" if n is None else f"decided at ~{n} replicates"

    def line(self) -> str:
        interval = "no interval" if math.isnan(self.low) else f"[{self.low:.4g}, {self.high:.4g}]"
        over = f"over {self.replicates} replicate{'s' if self.replicates != 1 else ''}"
        if self.timings:
            over += f" (median of {self.timings} timings each)"
        elif self.samples != self.replicates:  # recorded before timed parts were decided over replicates
            over += f" x {self.samples // max(self.replicates, 1)} timings"
        load = f", load {self.load:.2g}" if not math.isnan(self.load) else ""
        timed = f" (timed on {self.machine}{load})" if self.machine else ""
        label = {"premise": f"premise {self.name}: ", "context": "context: "}.get(self.role, "")
        best = f" ({self.best})" if self.best else ""
        notes = [n for n in (self.decided_at, f"undecided: premise {self.undecided_by} not met"
                             if self.undecided_by else "") if n]
        note = f" ({'; '.join(notes)})" if notes else ""
        return f"{label}{self.effect} = {self.mean:.4g} {interval} {over}{timed}{best} -> {self.verdict}{note}"


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
        labels = {label for c in self.all_of for label in (c.name, c.left) if label}
        unknown = [f"{p.name}: {g}" for p in self.premises for g in p.guards if g not in labels]
        if unknown:
            raise ValueError(f"premises guard parts the claim does not have (a part's name or left metric): {unknown}")
        stray = [c.text() for c in (*self.all_of, *self.context) if c.guards]
        if stray:
            raise ValueError(f"only premises guard parts: {stray}")

    @property
    def timed(self) -> bool:
        """Whether any comparison is a wall-clock one (its evaluation is then timed on a quiet machine)."""
        return any(c.timed for c in (*self.premises, *self.all_of, *self.context))

    def text(self) -> str:
        parts = " and ".join(c.text() for c in self.all_of)
        return f"{parts} [{self.note}]" if self.note else parts

    def metric_names(self) -> set[str]:
        return {n for c in (*self.premises, *self.all_of, *self.context) for n in (c.left, *c.right_names)}

    def premise_names(self) -> set[str]:
        """The metrics the premises read (what a `--premises-only` run may show)."""
        return {n for c in self.premises for n in (c.left, *c.right_names)}

    def decide(self, replicates: Sequence[Mapping[str, float]], machine: str = "") -> ClaimResult:
        """The verdict over replicates (one metrics mapping per replicate). A part guarded by a premise that did
        not hold is left undecided: it cannot make the claim hold or fail, and the reason names it."""
        premises = [c.decide(replicates, "premise", machine) for c in self.premises]
        unmet = {c.name: p for c, p in zip(self.premises, premises, strict=True) if p.verdict != HOLDS}
        parts = []
        for c in self.all_of:
            part = c.decide(replicates, "part", machine)
            blockers = [p.name for p in self.premises if p.name in unmet and c.guarded_by(p)]
            parts.append(replace(part, undecided_by=", ".join(blockers)) if blockers else part)
        context = [c.decide(replicates, "context", machine) for c in self.context]
        everything = (*premises, *parts, *context)
        n = len(replicates)
        if n < 2:
            return ClaimResult(INCONCLUSIVE, self.text(), n, f"{n} replicate, no interval", everything)
        open_verdicts = [p.verdict for p in parts if not p.undecided_by]
        if FAILS in open_verdicts:  # a part no failed premise guards is evidence on its own
            return ClaimResult(FAILS, self.text(), n, "", everything)
        if unmet:
            reasons = [f"premise {p.name} {'failed' if p.verdict == FAILS else 'not shown'} "
                       f"({p.effect} = {p.mean:.4g} [{p.low:.4g}, {p.high:.4g}])" for p in unmet.values()]
            undecided = [p.effect for p in parts if p.undecided_by]
            if len(undecided) < len(parts):
                reasons.append(f"undecided: {', '.join(undecided)}")
            return ClaimResult(INCONCLUSIVE, self.text(), n, "; ".join(reasons), everything)
        verdict = HOLDS if all(v == HOLDS for v in open_verdicts) else INCONCLUSIVE
        return ClaimResult(verdict, self.text(), n, "", everything)

    def decide_premises(self, replicates: Sequence[Mapping[str, float]], machine: str = "") -> ClaimResult:
        """The premises alone, blind to the claim (`paperline run <id> --premises-only`): `holds` when every
        premise holds, `does not hold` when one decisively fails, `inconclusive` otherwise; the deciding parts
        are neither computed nor named."""
        premises = tuple(c.decide(replicates, "premise", machine) for c in self.premises)
        text = " and ".join(f"{c.name}: {c.text()}" for c in self.premises) or "no premises declared"
        n = len(replicates)
        if not premises:
            return ClaimResult(INCONCLUSIVE, text, n, "the claim declares no premises", premises)
        if n < 2:
            return ClaimResult(INCONCLUSIVE, text, n, f"{n} replicate, no interval", premises)
        verdicts = [p.verdict for p in premises]
        verdict = FAILS if FAILS in verdicts else HOLDS if all(v == HOLDS for v in verdicts) else INCONCLUSIVE
        unmet = ", ".join(p.name for p in premises if p.verdict != HOLDS)
        return ClaimResult(verdict, text, n, f"not met: {unmet}" if unmet else "", premises)

    def evaluate(self, metrics: Mapping[str, float]) -> ClaimResult:
        """One replicate's view (always inconclusive as a verdict): checks the metrics the claim needs exist."""
        return self.decide([metrics])
