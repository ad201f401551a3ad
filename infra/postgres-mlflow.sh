#!/usr/bin/env bash
# An MLflow tracking server on PostgreSQL, bound to loopback: infra/postgres-mlflow.sh <state dir> [pg port] [mlflow port]
# Starts a private PostgreSQL cluster in <state dir>/pg (as the `postgres` user when run as root), creates the
# `mlflow` database, and serves MLflow with artifacts in <state dir>/artifacts. Prints the tracking URI to export.
# Stop: pg_ctl -D <state dir>/pg stop; kill the mlflow server (its pid is in <state dir>/mlflow.pid).
set -euo pipefail
state=$(realpath -m "$1"); pg_port=${2:-5433}; mlflow_port=${3:-5000}
venv_bin=$(dirname "$(realpath "$0")")/../.venv/bin
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
mkdir -p "$state/pg" "$state/artifacts"
[ "$(id -u)" = 0 ] && chown postgres "$state/pg"
[ -f "$state/pg/PG_VERSION" ] || as_pg initdb -D "$state/pg" -A trust -U postgres >/dev/null
as_pg pg_ctl -D "$state/pg" -l "$state/pg/server.log" -w \
  -o "-p $pg_port -k $state/pg -c listen_addresses=127.0.0.1" start >/dev/null
as_pg createdb -h 127.0.0.1 -p "$pg_port" -U postgres mlflow 2>/dev/null || true
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false nohup "$venv_bin/mlflow" server \
  --backend-store-uri "postgresql+psycopg2://postgres@127.0.0.1:$pg_port/mlflow" \
  --default-artifact-root "file://$state/artifacts" --host 127.0.0.1 --port "$mlflow_port" --workers 1 \
  >"$state/mlflow.log" 2>&1 &
echo $! > "$state/mlflow.pid"
for _ in $(seq 240); do
  curl -fs "http://127.0.0.1:$mlflow_port/health" >/dev/null 2>&1 && break; sleep 0.5
done
curl -fs "http://127.0.0.1:$mlflow_port/health" >/dev/null || { tail -20 "$state/mlflow.log"; exit 1; }
echo "export MLFLOW_TRACKING_URI=http://127.0.0.1:$mlflow_port"
