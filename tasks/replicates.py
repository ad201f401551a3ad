"""What the parent run of a replicated pipeline holds: each metric's mean with its spread and 95 % interval over
replicates, the claim's parts as metrics, and the forest plot of the claim (DESIGN.md, "Verdicts")."""

from __future__ import annotations

import math
import platform
import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from models.verdicts import FAILS, HOLDS, ClaimResult, t_interval

VERDICT_CODE = {HOLDS: 1.0, FAILS: -1.0}  # inconclusive: 0


def aggregate(replicates: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """`<metric>`: the mean over the replicates that returned it; `stats/<metric>/{std,ci95_low,ci95_high,n}`
    beside it (std and interval only from two replicates on)."""
    out: dict[str, float] = {}
    for name in sorted({k for metrics in replicates for k in metrics}):
        values = [float(m[name]) for m in replicates if name in m]
        mean, low, high = t_interval(values)
        out[name] = mean
        out[f"stats/{name}/n"] = float(len(values))
        if len(values) > 1:
            out[f"stats/{name}/std"] = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
            out[f"stats/{name}/ci95_low"], out[f"stats/{name}/ci95_high"] = low, high
    return out


def claim_metrics(result: ClaimResult, prefix: str = "claim") -> dict[str, float]:
    """The verdict (1 holds, -1 does not hold, 0 inconclusive) and each part's effect and interval."""
    out = {f"{prefix}/verdict": VERDICT_CODE.get(result.verdict, 0.0), f"{prefix}/replicates": float(result.replicates)}
    for i, part in enumerate(result.parts):
        key = f"{prefix}/{part.role}{i}"
        out[f"{key}/effect"] = part.mean
        if not math.isnan(part.low):
            out[f"{key}/ci95_low"], out[f"{key}/ci95_high"] = part.low, part.high
    return out


@cache
def machine_name() -> str:
    """Where timed parts were measured: the GPU's name when one is present, else the CPU model."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover - torch is always installed with paperline
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _claimed_op(text: str) -> str:
    """The comparison of a part as written (`a > b`, `a <= 2 x b + 0.1`): its operator, `>` if none is found."""
    match = re.search(r"\s(<=|>=|<|>)\s", text)
    return match[1] if match else ">"


def forest_plot(result: ClaimResult, path: Path, title: str) -> Path:
    """Each claim part's effect with its 95 % interval, zero marked: premises, deciding parts and context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {HOLDS: "tab:green", FAILS: "tab:red"}
    parts = list(result.parts)
    if not parts:  # a premises-only result of a claim without premises: nothing to plot
        return path
    # one row per part: each effect has its own unit, so each its own x axis
    fig, axes = plt.subplots(len(parts), 1, figsize=(7, 0.8 * len(parts) + 1.0), squeeze=False,
                             layout="constrained")
    for ax, part in zip(axes[:, 0], parts, strict=True):
        colour = colours.get(part.verdict, "tab:grey")
        if math.isnan(part.low):
            ax.plot([part.mean], [0], "o", color=colour)
            lo, hi = part.mean, part.mean
        else:
            ax.errorbar([part.mean], [0], xerr=[[part.mean - part.low], [part.high - part.mean]], fmt="o",
                        color=colour, capsize=4)
            lo, hi = part.low, part.high
        span = max(abs(lo), abs(hi), 1e-12) * 1.15
        left, right = min(-span, lo * 1.15), max(span, hi * 1.15)
        ax.set_xlim(left, right)
        # the side of zero where the part holds, shaded: right of zero for > and >=, left of it for < and <=
        claimed_negative = _claimed_op(part.text) in ("<", "<=")
        ax.axvspan(*((left, 0) if claimed_negative else (0, right)), color="tab:green", alpha=0.08, linewidth=0)
        ax.text(0.99 if not claimed_negative else 0.01, 0.95, "claimed side", transform=ax.transAxes, fontsize=6,
                color="tab:green", va="top", ha="right" if not claimed_negative else "left")
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_yticks([])
        label = {"premise": f"premise {part.name}", "context": "context"}.get(part.role, "claim")
        ax.set_title(f"{label}: {part.effect} -> {part.verdict}", fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{title}: {result.headline()} ({result.replicates} replicates, 95% t-intervals)", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
