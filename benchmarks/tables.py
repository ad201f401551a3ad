"""Markdown tables from benchmarks/results/*.json, for benchmarks/README.md.

    python benchmarks/tables.py suite          # smoke wall/CPU/stage times per paper, slowest first
    python benchmarks/tables.py suite_run      # the whole suite in one command: per setting, then per paper
    python benchmarks/tables.py suite_run --write   # into its generated block in benchmarks/README.md
    python benchmarks/tables.py step_cost      # the platform's cost a training step against a plain loop
    python benchmarks/tables.py reproduce      # which papers reproduce bitwise
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def suite() -> str:
    rows = json.loads((RESULTS / "suite_times.json").read_text())
    lines = ["| paper | wall s | CPU s | load at start | prepare s | train s | evaluate s | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for paper, r in sorted(rows.items(), key=lambda kv: -kv[1]["wall_s"]):
        s = r["stages"]
        verdict = r.get("verdict") or {"true": "holds", "false": "does not hold"}.get(r.get("claim_holds"), "")
        lines.append(f"| {paper} | {r['wall_s']} | {r.get('cpu_s', '')} | {r.get('load_at_start', '')} | "
                     f"{s.get('time/prepare_s', '')} | {s.get('time/train_s', '')} | "
                     f"{s.get('time/evaluate_s', '')} | {verdict} |")
    total = sum(r["wall_s"] for r in rows.values())
    lines.append(f"\n{len(rows)} papers, {total / 60:.1f} min of wall time in all; "
                 f"{sum(r['wall_s'] > 90 for r in rows.values())} over 90 s.")
    return "\n".join(lines)


def suite_run() -> str:
    results = json.loads((RESULTS / "suite_run.json").read_text())
    lines = ["| setting | commit | measured | wall min | CPU s | cores busy | load before | other CPU s (niced) | "
             "papers finished | exit |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    settings = {k: v for k, v in results.items() if k.startswith("parallel_") and "cpu_s" in v}
    for key, r in settings.items():
        lines.append(f"| {key.replace('_', ' ')} | {r['commit']} | {r['measured_at']} | {r['wall_s'] / 60:.1f} | "
                     f"{r['cpu_s']:.0f} | {100 * r['core_busy']:.0f} % | {r['load_1m_before']} | {_other(r)} | "
                     f"{r['papers_finished']} | {r.get('exit_code', '')} |")
    lines += [f"\n`{key}`: {r['note']}" for key, r in settings.items() if r.get("note")]
    for key, r in ((k, r) for k, r in settings.items() if r.get("papers")):
        lines += [f"\n`{key}`, per paper (slowest first; CPU s a replicate: mean / max; steps a second per phase, "
                  "mean over replicates):\n",
                  "| paper | wall s | replicates | CPU s a replicate | prepare s | replicates s | "
                  "steps a second | verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for paper, p in sorted(r["papers"].items(), key=lambda kv: -(kv[1].get("wall_s") or 0)):
            rates = ", ".join(f"{phase} {rate:g}" for phase, rate in p.get("steps_per_s", {}).items())
            cpu = f"{p.get('cpu/replicate_mean_s', '')} / {p.get('cpu/replicate_max_s', '')}"
            verdict = (p.get("verdict") or "") + (f": {p['reason']}" if p.get("reason") else "")
            lines.append(f"| {paper} | {p.get('wall_s', '')} | {p.get('replicates', '')} | {cpu} | "
                         f"{p.get('time/prepare_s', '')} | {p.get('time/replicates_s', '')} | {rates} | "
                         f"{verdict.replace('|', '/')} |")
        means = [p["cpu/replicate_mean_s"] for p in r["papers"].values() if "cpu/replicate_mean_s" in p]
        if means:
            lines.append(f"\n{len(means)} papers measured: {sum(means) / len(means):.0f} CPU s a replicate on "
                         f"average (target about 60), {sum(m > 120 for m in means)} over the 120 s budget.")
    if cached := results.get("cached_rerun"):
        lines.append(f"\nCached rerun (nothing changed; {cached['commit']}, {cached['measured_at']}, load "
                     f"{cached['load_1m_before']}): `paperline run --all` {' / '.join(map(str, cached['all_s']))} s "
                     f"(target 30), `paperline run sei` {' / '.join(map(str, cached['one_paper_s']))} s (target 2).")
    return "\n".join(lines)


def _other(r: dict) -> str:
    """What else the machine ran during a suite (recorded since 2026-12-08; blank before)."""
    if "other_cpu_s" not in r:
        return ""
    return f"{r['other_cpu_s']:.0f} ({r['niced_cpu_s']:.0f}), autogroup {r['sched_autogroup']}"


def step_cost() -> str:
    results = json.loads((RESULTS / "step_cost.json").read_text())
    lines = [f"{results['commit']}, {results['measured_at']}: {results['steps']} steps, batch {results['batch']}, "
             f"{results['threads']} threads, median of {results['repeats']} alternating repeats\n",
             "| model | plain PyTorch ms a step | engine + ctx.fit ms a step | ratio (target <= 1.2) |",
             "| --- | --- | --- | --- |"]
    for name, r in results["models"].items():
        lines.append(f"| {name} | {r['plain_ms']} | {r['platform_ms']} | {r['ratio']} |")
    return "\n".join(lines)


def reproduce() -> str:
    results = json.loads((RESULTS / "reproducibility.json").read_text())
    lines = []
    for key, rows in results.items():
        lines += [f"\n`{key}`:\n", "| paper | bitwise | metrics | differing (original → reproduced) |",
                  "| --- | --- | --- | --- |"]
        for paper, r in sorted(rows.items()):
            if "bitwise" not in r:
                lines.append(f"| {paper} | error | | {r.get('error', '')[:120]} |")
                continue
            diff = "; ".join(f"{k} {v['original']:.6g} → {v['reproduced']:.6g}" if None not in v.values()
                             else f"{k} missing" for k, v in list(r["differing"].items())[:3])
            more = f" (+{len(r['differing']) - 3} more)" if len(r["differing"]) > 3 else ""
            lines.append(f"| {paper} | {'yes' if r['bitwise'] else 'NO'} | {r['metrics']} | {diff}{more} |")
    return "\n".join(lines)


README = Path(__file__).resolve().parent / "README.md"


def write(name: str, readme: Path = README) -> None:
    """Replace the README's generated block of table `name` (between its two marker lines) with the table."""
    begin, end = f"<!-- generated: python benchmarks/tables.py {name} --write -->", f"<!-- end: {name} -->"
    text = readme.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{readme}: no block {begin!r} ... {end!r}")
    head, rest = text.split(begin, 1)
    readme.write_text(f"{head}{begin}\n{TABLES[name]()}\n{end}{rest.split(end, 1)[1]}")


TABLES = {"suite": suite, "suite_run": suite_run, "step_cost": step_cost, "reproduce": reproduce}

if __name__ == "__main__":
    if sys.argv[2:] == ["--write"]:
        write(sys.argv[1])
    else:
        print(TABLES[sys.argv[1]]())
