"""The scoreboard: one row per paper from its latest finished MLflow run (Markdown + HTML in `reports/`)."""

from __future__ import annotations

import html
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

    def url(self, ui: str) -> str:
        return f"{ui}/#/experiments/{self.experiment_id}/runs/{self.run_id}" if self.run_id else ""


def latest_run(paper_id: str, profile: str | None = None):
    c = tracking.client()
    exp = c.get_experiment_by_name(f"paperline/{paper_id}")
    if exp is None:
        return None
    query = "attributes.status = 'FINISHED' and tags.`claim.holds` != ''"
    if profile:
        query += f" and tags.`paperline.profile` = '{profile}'"
    runs = c.search_runs([exp.experiment_id], filter_string=query, order_by=["attributes.start_time DESC"],
                         max_results=1)
    return runs[0] if runs else None


def scoreboard(profile: str | None = "smoke") -> list[Row]:
    rows = []
    for pid, paper in registry.papers().items():
        run = latest_run(pid, profile)
        if run is None:
            rows.append(Row(pid, paper.title, paper.claim.text(), "", "not run", "", "", profile or ""))
            continue
        t = run.data.tags
        verdict = "holds" if t.get("claim.holds") == "true" else "does not hold"
        rows.append(Row(pid, paper.title, t.get("claim.text", ""), t.get("claim.numbers", ""), verdict,
                        t.get("paperline.data_hash", ""), run.info.run_id, t.get("paperline.profile", ""),
                        run.info.experiment_id))
    return rows


def ui_url() -> str:
    """Where run links point: the tracking server itself, or the embedded store's `paperline ui` default."""
    uri = settings.tracking_uri()
    return settings.mask(uri).rstrip("/") if uri.startswith("http") else "http://127.0.0.1:5000"


def write(rows: list[Row], out_dir: Path | None = None) -> tuple[Path, Path]:
    out_dir = out_dir or settings.root() / "reports"
    ui = ui_url()
    out_dir.mkdir(parents=True, exist_ok=True)
    md = ["# paperline scoreboard", "", f"Tracking: `{settings.mask(settings.tracking_uri())}`", "",
          "| paper | verdict | method vs baseline | claim | profile | data hash | MLflow run |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r.paper} | {r.verdict} | {r.numbers.replace('|', '/')} | `{r.claim}` | {r.profile} | "
                  f"{r.data_hash[:12]} | {f'[{r.run_id[:8]}]({r.url(ui)})' if r.run_id else ''} |")
    md_path = out_dir / "scoreboard.md"
    md_path.write_text("\n".join(md) + "\n")
    cells = "".join(
        f"<tr><td>{html.escape(r.paper)}</td><td class='{r.verdict.replace(' ', '-')}'>{r.verdict}</td>"
        f"<td>{html.escape(r.numbers)}</td><td><code>{html.escape(r.claim)}</code></td><td>{r.profile}</td>"
        f"<td>{r.data_hash[:12]}</td><td><a href='{r.url(ui)}'>{r.run_id[:8]}</a></td></tr>" for r in rows)
    page = ("<!doctype html><meta charset='utf-8'><title>paperline scoreboard</title><style>"
            "body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:4px;vertical-align:top}"
            "table{border-collapse:collapse}.holds{background:#dfd}.does-not-hold{background:#fdd}</style>"
            "<h1>paperline scoreboard</h1><table><tr><th>paper</th><th>verdict</th><th>method vs baseline</th>"
            f"<th>claim</th><th>profile</th><th>data hash</th><th>MLflow run</th></tr>{cells}</table>")
    html_path = out_dir / "scoreboard.html"
    html_path.write_text(page)
    return md_path, html_path
