# Every target sets itself up on a fresh machine: it creates .venv and installs what it needs.
# The interpreter of .venv: Debian's python3.11 where it is installed with its venv module, else
# the first python3.11 on PATH. Debian builds it with profile-guided and link-time optimisation, a
# build from source (pyenv's) has neither, and the test suite starts about 150 Dagster processes
# (the figures: docs/testing.md, Timings). An existing .venv is kept; `rm -rf .venv` to re-create it.
SYSTEM_PYTHON := /usr/bin/python3.11
PYTHON ?= $(shell $(SYSTEM_PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1 \
                  && echo $(SYSTEM_PYTHON) || echo python3.11)
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME := $(CURDIR)

.PHONY: install install-dev demo dev test check system-deps bench chaos lint clean screenshots

# The package and what it runs with (enough for make demo and make dev).
$(BIN)/mostovik: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

# The test, lint and dg tools on top (pytest, xdist, ruff, openpyxl, dagster-dg-cli).
$(VENV)/.dev-installed: $(BIN)/mostovik
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/mostovik
install-dev: $(VENV)/.dev-installed

## Every job kind once into the local SQLite warehouse: 7 days of each parser and 3 sync windows
## from the stand-in sources, and sample delivery reports through the inbox sensor.
demo: install
	$(BIN)/mostovik demo --days 7

## The Dagster UI on http://127.0.0.1:3000 with the stand-in sources running.
dev: install
	$(BIN)/mostovik db upgrade
	$(BIN)/mostovik standin --port 8765 & trap "kill $$!" EXIT; \
	env $$($(BIN)/mostovik standin --port 8765 --print-env) \
	$(BIN)/dagster dev -h 127.0.0.1 -p 3000 -w workspace.yaml

## The test suite, whole modules spread over TEST_WORKERS processes (each starts the throw-away
## PostgreSQL and Redis servers its tests need). Four on two cores: the webserver, daemon, Celery
## and outage tests spend much of their time waiting on daemons, workers and restarts. The cases
## of the 60 s outages and past a budget are make chaos's (marker long_outage). Its wall time,
## with its command and date: docs/testing.md. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 4
test: install-dev system-deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  -m 'not long_outage' $(PYTEST_ARGS)

## The developer's quick loop, no servers: ruff, then the tests that start no PostgreSQL, Redis,
## S3 API server or Dagster process (the layering test among them); conftest marks the others
## `servers` and a test that starts one here fails, naming the marker.
check: install-dev
	$(BIN)/ruff check mostovik_pipelines mostovik_pipelines_tests
	MOSTOVIK_TESTS_NO_SERVERS=1 $(BIN)/python -m pytest -n 4 -m 'not servers' -q $(PYTEST_ARGS)

## What the test servers need on this machine, once, before any test worker starts: the Debian
## packages postgresql, redis-server and faketime (installed with apt when run as root; otherwise named)
## and, as root, the system user that owns the throw-away PostgreSQL clusters; then checked.
system-deps: install-dev
	$(BIN)/python -m mostovik_pipelines_tests.support.machine

## Loader and orchestration benchmarks against a throw-away PostgreSQL (see benchmarks/README.md).
bench: install-dev
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

## The randomized reliability suite: crashes, faults and duplicates against real PostgreSQL, then
## restarts of the warehouse, run storage, broker and daemon and a full disk under the production
## deployment (webserver, daemon, Celery workers, Redis).
chaos: install-dev
	$(BIN)/python -m mostovik_pipelines_tests.chaos $(CHAOS_ARGS)

## Screenshots of the Dagster UI on 30 days of demo data into docs/screenshots/ (headless
## Chromium, the Debian package chromium; installed with apt when run as root).
screenshots: install-dev
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "install the Debian package chromium first" >&2; exit 1; fi; }
	$(BIN)/mostovik demo --days 30
	$(BIN)/python scripts/screenshots.py --out docs/screenshots

lint: install-dev
	$(BIN)/ruff check mostovik_pipelines mostovik_pipelines_tests

clean:
	rm -rf .mostovik
