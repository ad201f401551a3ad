"""The scoreboard: one row per paper from its latest finished pipeline run (Markdown + HTML in `reports/`), with
each claim part's effect and 95 % interval over replicates and the paper's forest plot."""

from __future__ import annotations

import base64
import html
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from models import registry
from tasks import settings, tracking


@dataclass
class Row:
    paper: str
    title: str
    claim: str
    numbers: str
    verdict: str
    data_hash: str
    run_id: str
    profile: str
    experiment_id: str = ""
    replicates: str = ""
    reason: str = ""
    forest: Path | None = None
    # the commit holding exactly the code the run used: `paperline.code_ref` (HEAD, or a snapshot of a dirty tree,
    # pinned as the run opened), else `mlflow.source.git.commit`
    commit: str = ""
    cpu_s: float | None = None  # mean CPU seconds a replicate (training ranks + evaluation), when measured
    overrides: str = ""  # the run's --set overrides (k=v,...), empty for the profile as params.yaml has it

    def url(self, ui: str) -> str:
        return tracking.ui_link(ui, self.experiment_id, self.run_id) if self.run_id else ""


def latest_run(paper_id: str, profile: str | None = None):
    c = tracking.client()
    exp = c.get_experiment_by_name(f"paperline/{paper_id}")
    if exp is None:
        return None
    query = "attributes.status = 'FINISHED' and tags.`claim.verdict` != ''"
    if profile:
        query += f" and tags.`paperline.profile` = '{profile}'"
    runs = c.search_runs([exp.experiment_id], filter_string=query, order_by=["attributes.start_time DESC"],
                         max_results=1)
    return runs[0] if runs else None


def scoreboard(profile: str | None = "smoke", plots_dir: Path | None = None) -> list[Row]:
    plots_dir = plots_dir or settings.root() / "reports" / "plots"
    rows = []
    for pid, paper in registry.papers().items():
        run = latest_run(pid, profile)
        if run is None:
            rows.append(Row(pid, paper.title, paper.claim.text(), "", NOT_RUN, "", "", profile or ""))
            continue
        t = run.data.tags
        rows.append(Row(pid, paper.title, t.get("claim.text", ""), t.get("claim.numbers", ""), tracking.verdict_of(t),
                        t.get("paperline.data_hash", ""), run.info.run_id, t.get("paperline.profile", ""),
                        run.info.experiment_id, t.get("claim.replicates", ""), t.get("claim.reason", ""),
                        _forest(run.info.run_id, plots_dir / f"{pid}-forest.png"),
                        commit=t.get("paperline.code_ref") or t.get("mlflow.source.git.commit", ""),
                        cpu_s=run.data.metrics.get("cpu/replicate_mean_s"),
                        overrides=t.get("paperline.overrides", "")))
    return rows


NOT_RUN = "not run here"  # no finished run of the paper in this tracking store (never a row from elsewhere)


def commit_summary(rows: list[Row], current: str, unchanged: frozenset[str] = frozenset()) -> str:
    """How many rows are current, and which are stale (with their commits). A row is current when it ran at the
    commit checked out, or when `paperline run` would reuse its run now (`unchanged`: run ids whose code, params
    and data are those of the checkout, as the cache key reads them): a later commit that only touched reports or
    benchmarks leaves it current. A checkout with uncommitted changes is named `<commit>-dirty`."""
    ran = [r for r in rows if r.verdict != NOT_RUN]
    stale = [r for r in ran if r.commit != current and r.run_id not in unchanged]
    shown = current[:12] + ("-dirty" if current.endswith("-dirty") else "")
    head = (f"{len(ran) - len(stale)} of {len(ran)} rows current at `{shown}` (run at this commit, or with the same "
            "code, params and data, so `paperline run` would reuse them)")
    if not stale:
        return head + "."
    return head + "; stale: " + ", ".join(f"{r.paper} (`{r.commit[:12] or 'unknown'}`)" for r in stale) + "."


def unchanged_runs(rows: list[Row]) -> frozenset[str]:
    """The run ids among the rows that `paperline run` would reuse as they stand (rows run with `--set` overrides
    are judged by their commit alone)."""
    from flows import cache

    asks = []
    for r in rows:
        if r.verdict != NOT_RUN and r.profile and not r.overrides:
            try:
                asks.append(registry.ask(r.paper, r.profile, None, settings.params_file()))
            except registry.ConfigError:  # a profile params.yaml no longer has: judged by its commit
                continue
    try:
        found = cache.reusable(asks)
    except Exception:  # noqa: BLE001 - DVC or the store unreadable: the header falls back to commits
        return frozenset()
    return frozenset(run_id for run_id, _, _ in found.values())


def _forest(run_id: str, target: Path) -> Path | None:
    """The run's forest plot, copied next to the scoreboard (None when the run has none)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            got = Path(tracking.client().download_artifacts(run_id, "plots/forest.png", tmp))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(got, target)
        return target
    except Exception:  # noqa: BLE001 - an older run without the plot
        return None


# inconclusive rows by why, in this order; any other reason after them
_INCONCLUSIVE_KINDS = ("premise failed", "premise not shown", "interval crosses zero", "one replicate, no interval")


def group(row: Row) -> str:
    """The scoreboard section of a row: `decisive`, `inconclusive: <why>` or `not run here`."""
    if row.verdict in ("holds", "does not hold"):
        return "decisive"
    if row.verdict == NOT_RUN:
        return NOT_RUN
    if not row.reason:
        return "inconclusive: interval crosses zero"
    premise = re.match(r"premise \S+ (failed|not shown)", row.reason)
    if premise:
        return f"inconclusive: premise {premise[1]}"
    if "no interval" in row.reason:
        return "inconclusive: one replicate, no interval"
    return "inconclusive: " + row.reason.split(" (")[0]


def ordered(rows: list[Row]) -> list[Row]:
    """Decisive rows first, then inconclusive ones grouped by why, then papers not run; by paper within a group."""
    def key(row: Row) -> tuple[int, str, str]:
        name = group(row)
        kind = name.removeprefix("inconclusive: ")
        rank = 0 if name == "decisive" else 99 if name == NOT_RUN else \
            1 + (_INCONCLUSIVE_KINDS.index(kind) if kind in _INCONCLUSIVE_KINDS else len(_INCONCLUSIVE_KINDS))
        return rank, name, row.paper
    return sorted(rows, key=key)


def ui_url() -> str:
    """Where run links point: the tracking server itself, or the embedded store's `paperline ui` default."""
    uri = settings.tracking_uri()
    return settings.mask(uri).rstrip("/") if uri.startswith("http") else "http://127.0.0.1:5000"


def write(rows: list[Row], out_dir: Path | None = None) -> tuple[Path, Path]:
    out_dir = out_dir or settings.root() / "reports"
    ui = ui_url()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = ordered(rows)
    counts = {v: sum(r.verdict == v for r in rows) for v in ("holds", "does not hold", "inconclusive", NOT_RUN)}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    commits = commit_summary(rows, tracking.git_commit(), unchanged_runs(rows))
    md = ["# paperline scoreboard", "", f"Tracking: `{settings.mask(settings.tracking_uri())}`. {summary}.", "",
          commits, "",
          "Each claim part: the paired effect (left minus the best right side, per replicate) with its 95 % "
          "t-interval over replicates; `inconclusive` when the interval crosses zero or a premise is not met "
          "(../shared/DESIGN.md, Verdicts). Generated by `paperline report` from the runs.", "",
          "| paper | verdict | replicates (CPU-s each) | claim parts: effect [95 % interval] | claim | profile | "
          "data hash | MLflow run | commit | plot |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        verdict = r.verdict + (f": {r.reason}" if r.reason else "")
        parts = "<br>".join(line.replace("|", "/") for line in r.numbers.splitlines())
        plot = f"[forest]({r.forest.relative_to(out_dir)})" if r.forest and r.forest.is_relative_to(out_dir) else ""
        md.append(f"| {r.paper} | {verdict.replace('|', '/')} | {_replicates(r)} | {parts} | `{r.claim}` | "
                  f"{_profile(r)} | {r.data_hash[:12]} | {f'[{r.run_id[:8]}]({r.url(ui)})' if r.run_id else ''} | "
                  f"{r.commit[:12]} | {plot} |")
    md_path = out_dir / "scoreboard.md"
    md_path.write_text("\n".join(md) + "\n")
    html_path = out_dir / "scoreboard.html"
    html_path.write_text(page(rows, summary + ". " + commits.rstrip("."), ui))
    return md_path, html_path


def _replicates(row: Row) -> str:
    return row.replicates + (f" ({row.cpu_s:.0f})" if row.cpu_s is not None else "")


def _profile(row: Row) -> str:
    return row.profile + (f" with {row.overrides}" if row.overrides else "")


_CSS = ("body{font-family:sans-serif;font-size:14px;margin:1em;max-width:1400px}"
        "table{border-collapse:collapse;width:100%;table-layout:fixed}"
        "td,th{border:1px solid #ccc;padding:4px;vertical-align:top;overflow-wrap:anywhere}"
        "th{background:#f4f4f4;text-align:left}.parts{font-size:12px;font-family:monospace}"
        "tr.group td{background:#333;color:#fff;font-weight:bold}.holds{background:#dfd}"
        ".does-not-hold{background:#fdd}.inconclusive{background:#eee}.override{color:#a60}"
        "details img{max-width:100%;display:block;margin:4px 0}summary{cursor:pointer;color:#06c}")
_WIDTHS = (("paper", "13%"), ("verdict", "20%"), ("replicates (CPU-s each)", "6%"),
           ("claim parts: effect [95 % interval]", "43%"), ("profile", "8%"), ("MLflow run", "10%"))


def page(rows: list[Row], summary: str, ui: str) -> str:
    """The scoreboard as one HTML page that fits a laptop screen: a section per group (decisive, inconclusive by
    why, not run), the claim and the forest plot (at full size) folded under each paper."""
    head = "".join(f"<th style='width:{w}'>{h}</th>" for h, w in _WIDTHS)
    body, current = [], None
    for r in rows:
        if group(r) != current:
            current = group(r)
            count = sum(group(x) == current for x in rows)
            body.append(f"<tr class='group'><td colspan='{len(_WIDTHS)}'>{html.escape(current)} ({count})</td></tr>")
        claim = f"<details><summary>claim</summary><code>{html.escape(r.claim)}</code></details>"
        plot = _inline_png(r.forest)
        forest = f"<details><summary>forest plot</summary>{plot}</details>" if plot else ""
        profile = html.escape(r.profile) + (f"<br><span class='override'>{html.escape(r.overrides)}</span>"
                                            if r.overrides else "")
        link = (f"<a href='{html.escape(r.url(ui))}'>{r.run_id[:8]}</a><br>data {r.data_hash[:12]}"
                f"<br>commit {html.escape(r.commit[:12])}") if r.run_id else ""
        verdict = html.escape(r.verdict + (f": {r.reason}" if r.reason else ""))
        body.append(
            f"<tr><td><b>{html.escape(r.paper)}</b><br><small>{html.escape(r.title)}</small>{claim}</td>"
            f"<td class='{r.verdict.replace(' ', '-')}'>{verdict}</td><td>{_replicates(r)}</td><td class='parts'>"
            f"{'<br>'.join(html.escape(x) for x in r.numbers.splitlines())}{forest}</td><td>{profile}</td>"
            f"<td>{link}</td></tr>")
    return ("<!doctype html><meta charset='utf-8'><meta name='viewport' content='width=device-width'>"
            f"<title>paperline scoreboard</title><style>{_CSS}</style><h1>paperline scoreboard</h1>"
            f"<p>{html.escape(summary)}. A forest plot shades each part's claimed side of zero.</p>"
            f"<table><tr>{head}</tr>{''.join(body)}</table>")


def _inline_png(path: Path | None) -> str:
    if not path or not path.exists():
        return ""
    return f"<img alt='forest plot' src='data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}'>"
