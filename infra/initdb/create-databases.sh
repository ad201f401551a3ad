#!/bin/bash
# PostgreSQL's image runs this once on an empty volume: one database per name in POSTGRES_MULTIPLE_DATABASES
# (comma-separated), owned by POSTGRES_USER. MLflow and Prefect each get their own.
set -euo pipefail
for db in ${POSTGRES_MULTIPLE_DATABASES//,/ }; do
  echo "creating database $db"
  psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
    -c "CREATE DATABASE \"$db\" OWNER \"$POSTGRES_USER\";"
done
