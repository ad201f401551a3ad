# Two entry points (see README): `make run` and `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup system-deps run test lint ui clean

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 first: the CPU build on this machine's disk (never let a dependency pull a CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	test -d .dvc || $(BIN)/dvc init -q
	# DeepSpeed's CPU collective op, compiled once here (~75 CPU-s) instead of inside the first run's budget
	$(BIN)/python -c 'import tasks.worker; tasks.worker.build_ops()'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/paperline run --all --profile smoke --report

# Debian packages the server tests start: PostgreSQL (MLflow's backend store) and Chromium (the UIs in a browser).
# Installed when missing and running as root; otherwise the tests that need them skip and say how to install them.
system-deps:
	@need=""; \
	command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need="$$need postgresql"; \
	command -v chromium >/dev/null || need="$$need chromium"; \
	if [ -z "$$need" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
	  echo "note: missing Debian packages:$$need (sudo apt-get install$$need); the tests that need them skip"; exit 0; fi; \
	echo "installing Debian packages:$$need"; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q $$need >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q $$need >/dev/null; }

# The suite, then the linter: exactly what CI runs (.ci/run)
# (one pytest-xdist worker per core, each pinned to its core: tests/conftest.py)
test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q -n auto --dist worksteal
	$(BIN)/ruff check .

lint: $(STAMP)
	$(BIN)/ruff check .

ui: $(STAMP)
	$(BIN)/paperline ui
