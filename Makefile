# Every target sets itself up on a fresh machine: it creates .venv and installs what it needs.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME := $(CURDIR)

.PHONY: install demo dev test bench chaos lint clean

$(BIN)/mostovik: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/mostovik

## Load the newest 7 days of CBR rates into the local SQLite warehouse, via the stand-in source.
demo: install
	$(BIN)/mostovik demo --days 7

## The Dagster UI on http://127.0.0.1:3000 with the stand-in sources running.
dev: install
	$(BIN)/mostovik db upgrade
	$(BIN)/mostovik standin --port 8765 & trap "kill $$!" EXIT; \
	MOSTOVIK_CBR_URL=http://127.0.0.1:8765/cbr/XML_daily.asp \
	$(BIN)/dagster dev -h 127.0.0.1 -p 3000 -w workspace.yaml

## The test suite. The tests start the throw-away PostgreSQL (and Redis) servers they need.
test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## Loader and orchestration benchmarks against a throw-away PostgreSQL (see benchmarks/README.md).
bench: install
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

## The randomized reliability suite: crashes, faults and duplicates against real PostgreSQL.
chaos: install
	$(BIN)/python -m mostovik_pipelines_tests.chaos $(CHAOS_ARGS)

lint: install
	$(BIN)/ruff check mostovik_pipelines mostovik_pipelines_tests

clean:
	rm -rf .mostovik
