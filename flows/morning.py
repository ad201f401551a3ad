"""The morning report: what the last night (any window) changed, per paper, from MLflow alone.

Per paper: retrained, skipped (an unchanged rerun reuses its run and stamps it `paperline.reused_at`), failed or
not run; the verdict now vs the run before: a flip between decisive verdicts (holds <-> does not hold) is flagged
and sorted first, a decisive verdict that became inconclusive is listed next, apart (lost evidence, not a
reversal); the primary metric now vs the champion (flows/lifecycle.py) with the difference; wall time; links to
both MLflow runs. Markdown + HTML, the HTML with a small trend plot of each paper's primary metric over its last
finished runs.
"""

from __future__ import annotations

import base64
import html
import io
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from flows import lifecycle
from flows.report import ui_url
from models import registry
from tasks import settings, tracking

TREND_RUNS = 10
_ORDER = {"FLIP": 0, "became inconclusive": 1, "failed": 2, "retrained": 3, "skipped": 4, "not run": 5}
DECISIVE = ("holds", "does not hold")


def parse_window(text: str) -> float:
    """'24h', '90m', '2d', '3600s' -> seconds; ConfigError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text or "")
    if not match:
        raise registry.ConfigError(f"--since {text!r}: expected a number with s, m, h or d (e.g. 24h)")
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


@dataclass
class Line:
    paper: str
    status: str                  # retrained | skipped | failed | not run
    why: str = ""
    verdict_now: str = ""
    verdict_before: str = ""
    metric: str = ""
    value_now: float | None = None
    champion_value: float | None = None
    champion_version: str = ""
    wall_s: float | None = None
    run_url: str = ""
    champion_url: str = ""
    trend: list[float] = field(default_factory=list)

    @property
    def flipped(self) -> bool:
        """Only a reversal between decisive verdicts is a flip."""
        return self.verdict_before in DECISIVE and self.verdict_now in DECISIVE and \
            self.verdict_now != self.verdict_before

    @property
    def became_inconclusive(self) -> bool:
        return self.verdict_before in DECISIVE and self.verdict_now == "inconclusive"

    @property
    def delta(self) -> float | None:
        return None if self.value_now is None or self.champion_value is None else self.value_now - self.champion_value


def _verdict(run) -> str:
    return tracking.verdict_of(run.data.tags)


def paper_line(paper_id: str, since_ms: int, profile: str) -> Line:
    client, ui = tracking.client(), ui_url()
    exp = client.get_experiment_by_name(f"paperline/{paper_id}")
    if exp is None:
        return Line(paper_id, "not run", "no runs yet")

    def url(run_id: str) -> str:  # opens in MLflow's model-training view
        return tracking.ui_link(ui, exp.experiment_id, run_id)

    # pipeline (parent) runs only: each replicate's child run starts just after its parent and holds no verdict
    in_profile = f"tags.`paperline.profile` = '{profile}' and tags.`paperline.kind` = 'pipeline'"
    # a premises-only run decides no claim: it is neither what retrained a paper nor a verdict before
    started = [r for r in client.search_runs([exp.experiment_id],
                                             f"{in_profile} and attributes.start_time >= {since_ms}",
                                             order_by=["attributes.start_time DESC"], max_results=20)
               if r.data.tags.get("paperline.premises_only") != "true"][:1]
    finished = client.search_runs([exp.experiment_id], f"{in_profile} and attributes.status = 'FINISHED' and "
                                  "tags.`claim.verdict` != ''", order_by=["attributes.start_time DESC"],
                                  max_results=TREND_RUNS)
    metric, _ = registry.get(paper_id).primary
    reused = sorted((r for r in finished if int(r.data.tags.get("paperline.reused_at", 0)) >= since_ms),
                    key=lambda r: int(r.data.tags["paperline.reused_at"]), reverse=True)
    if started and reused and int(reused[0].data.tags["paperline.reused_at"]) > started[0].info.start_time:
        started = []  # the latest event in the window is a reuse: the paper was skipped last
    if started and started[0].info.status != "FINISHED":
        line = Line(paper_id, "failed", f"run {started[0].info.status.lower()}", run_url=url(started[0].info.run_id))
        now = None
    elif started:
        now, line = started[0], Line(paper_id, "retrained", "")
    elif reused:
        now, line = reused[0], Line(paper_id, "skipped", "unchanged code, params and data: earlier run reused")
    else:
        return Line(paper_id, "not run", "not run in this window", trend=_trend(finished, metric))
    if now is not None:
        before = [r for r in finished if r.info.start_time < now.info.start_time]
        # the run before of the same overrides (the one an unchanged rerun would have reused), if there is one
        overrides = now.data.tags.get("paperline.overrides", "")
        before = [r for r in before if r.data.tags.get("paperline.overrides", "") == overrides] or before
        line.verdict_now = _verdict(now)
        line.verdict_before = _verdict(before[0]) if before and line.status == "retrained" else ""
        if line.status == "retrained":
            line.why = retrain_reason(now, before[0] if before else None)
        line.value_now = now.data.metrics.get(metric)
        line.wall_s = now.data.metrics.get("time/total_s") if line.status == "retrained" else None
        line.run_url = url(now.info.run_id)
    line.metric, line.trend = metric, _trend(finished, metric)
    champ = lifecycle.champion(paper_id, profile)
    if champ:
        line.champion_value, line.champion_version = champ["value"], champ["version"]
        line.champion_url = url(champ["run_id"])
    return line


# what the cache key is made of, each recorded on the pipeline run (flows/pipeline.py, `_open_run`)
# (code: what training imports; claim: the claim and the decision rule, which re-decide without training)
_KEY_PARTS = (("code", "paperline.code_hash"), ("params", "paperline.params_hash"), ("data", "paperline.data_hash"),
              ("claim", "paperline.claim_hash"))


def retrain_reason(run, before) -> str:
    """Why `run` trained instead of reusing an earlier run: --force, or which of code, params and data differ from
    the paper's run before it (a run without the hashes, from before they were recorded, says all three may)."""
    tags = run.data.tags
    if tags.get("paperline.forced") == "true":
        return "--force"
    if tags.get("paperline.lineage") == "re-decided":
        return "claim or decision rule changed: re-decided from stored replicates, no training"
    if before is None:
        return "first run of this profile"
    old = before.data.tags
    if any(key not in tags or key not in old for _, key in _KEY_PARTS[:3]):
        return "code, params or data changed, or --force"
    changed = [part for part, key in _KEY_PARTS if tags.get(key) != old.get(key)]
    return (" and ".join(changed) + " changed") if changed else "same code, params and data as the run before"


def _trend(runs, metric: str) -> list[float]:
    return [r.data.metrics[metric] for r in reversed(runs) if metric in r.data.metrics]


def morning(since_s: float, profile: str = "smoke") -> list[Line]:
    since_ms = int((time.time() - since_s) * 1000)
    lines = [paper_line(pid, since_ms, profile) for pid in registry.paper_ids()]
    return sorted(lines, key=lambda ln: (_ORDER["FLIP"] if ln.flipped else _ORDER["became inconclusive"]
                                         if ln.became_inconclusive else _ORDER[ln.status], ln.paper))


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def write(lines: list[Line], since: str, out_dir: Path | None = None, stem: str = "morning") -> tuple[Path, Path]:
    out_dir = out_dir or settings.root() / "reports"
    out_dir.mkdir(parents=True, exist_ok=True)
    head = ["paper", "status", "verdict now", "before", "primary metric", "now", "champion", "diff", "wall s", "runs"]
    md = [f"# paperline: what changed in the last {since}", "",
          f"{sum(ln.flipped for ln in lines)} verdict flip(s) (holds <-> does not hold), "
          f"{sum(ln.became_inconclusive for ln in lines)} became inconclusive, "
          f"{sum(ln.status == 'retrained' for ln in lines)} "
          f"retrained, {sum(ln.status == 'skipped' for ln in lines)} skipped, "
          f"{sum(ln.status == 'failed' for ln in lines)} failed.", "",
          "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    rows_html = []
    for ln in lines:
        flag = "**FLIP** " if ln.flipped else "became " if ln.became_inconclusive else ""
        links = " ".join(f"[{name}]({u})" for name, u in (("run", ln.run_url), ("champion", ln.champion_url)) if u)
        champ = f"v{ln.champion_version} {_fmt(ln.champion_value)}" if ln.champion_version else ""
        cells = [ln.paper, f"{ln.status} ({ln.why})", flag + ln.verdict_now, ln.verdict_before, ln.metric,
                 _fmt(ln.value_now), champ, _fmt(ln.delta), _fmt(ln.wall_s), links]
        md.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        rows_html.append("<tr class='flip'>" if ln.flipped else "<tr>")
        rows_html[-1] += "".join(f"<td>{html.escape(c)}</td>" for c in cells[:-1])
        rows_html[-1] += ("<td>" + " ".join(f"<a href='{html.escape(u)}'>{name}</a>" for name, u in
                                            (("run", ln.run_url), ("champion", ln.champion_url)) if u) + "</td>")
        rows_html[-1] += f"<td>{_sparkline(ln.trend)}</td></tr>"
    md_path = out_dir / f"{stem}.md"
    md_path.write_text("\n".join(md) + "\n")
    page = ("<!doctype html><meta charset='utf-8'><title>paperline morning report</title><style>"
            "body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:4px}table{border-collapse:collapse}"
            f".flip{{background:#fdd}}</style><h1>{html.escape(md[0][2:])}</h1><p>{html.escape(md[2])}</p><table><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "<th>trend</th></tr>" + "".join(rows_html) + "</table>")
    html_path = out_dir / f"{stem}.html"
    html_path.write_text(page)
    return md_path, html_path


def _sparkline(values: list[float]) -> str:
    """A small inline PNG of the primary metric over the last finished runs (oldest left)."""
    if len(values) < 2:
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.8, 0.5), dpi=80)
    ax.plot(values, marker=".", linewidth=1)
    ax.axis("off")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    return f"<img alt='trend' src='data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}'>"
