# Two entry points (see README): `make run` and `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint ui clean

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 first: the CPU build on this machine's disk (never let a dependency pull a CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	test -d .dvc || $(BIN)/dvc init -q
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/paperline run --all --profile smoke --report

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

ui: $(STAMP)
	$(BIN)/paperline ui
