"""Read and stamp the embedded MLflow store (SQLite) directly, for the cached-rerun check.

`paperline run <id>` on unchanged work asks one question: is there a finished run with this cache key? Through
MLflow that costs its import and store start-up (~2 CPU-seconds) for one indexed query. On the embedded store we
ask SQLite directly, but only where the file carries exactly the schema revision these queries were written
against (MLflow's alembic head, `SCHEMA_REVISION`, checked by a test against the installed MLflow); any other
revision, a missing file or a tracking server goes through MLflow as before. Writes are limited to the one tag a
reuse stamps, in MLflow's own `tags` table.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks import settings

SCHEMA_REVISION = "dc11669786a5"  # MLflow's alembic head the queries below were written against
WORKSPACE = "default"  # MLflow's workspace of every paperline experiment


@dataclass(frozen=True)
class StoredRun:
    run_id: str
    tags: dict[str, str]


@contextmanager
def connect(path: Path, writable: bool = False) -> Iterator[sqlite3.Connection]:
    db = sqlite3.connect(f"file:{path}?mode={'rw' if writable else 'ro'}", uri=True, timeout=30)
    try:
        with db:  # commits on success, rolls back on error
            yield db
    finally:
        db.close()


def usable() -> Path | None:
    """The embedded store's file when the tracking URI is SQLite, the file exists and its schema is the one these
    queries know; None otherwise (then MLflow answers)."""
    uri = settings.tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None
    path = Path(uri.removeprefix("sqlite:///"))
    if not path.is_file():
        return None
    try:
        with connect(path) as db:
            revision = db.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.DatabaseError:  # not an MLflow store, or one without alembic's table
        return None
    return path if revision and revision[0] == SCHEMA_REVISION else None


_CACHED = """
SELECT r.run_uuid FROM runs r
JOIN experiments e ON e.experiment_id = r.experiment_id
JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'paperline.cache_key'
WHERE e.name = ? AND e.workspace = ? AND r.lifecycle_stage = 'active' AND r.status = 'FINISHED' AND t.value = ?
ORDER BY r.start_time DESC, r.run_uuid LIMIT 1
"""


def find_cached(path: Path, experiment: str, key: str) -> StoredRun | None:
    """The newest finished, not deleted run of `experiment` whose tag `paperline.cache_key` is `key`, with all
    its tags: what `tracking.find_cached` returns through MLflow."""
    with connect(path) as db:
        row = db.execute(_CACHED, (experiment, WORKSPACE, key)).fetchone()
        if row is None:
            return None
        tags = dict(db.execute("SELECT key, value FROM tags WHERE run_uuid = ?", row).fetchall())
    return StoredRun(row[0], tags)


def set_tag(path: Path, run_id: str, key: str, value: str) -> None:
    """Set one tag of an existing run, as `MlflowClient.set_tag` does on this schema."""
    with connect(path, writable=True) as db:
        db.execute("INSERT OR REPLACE INTO tags (key, value, run_uuid) VALUES (?, ?, ?)", (key, value, run_id))
