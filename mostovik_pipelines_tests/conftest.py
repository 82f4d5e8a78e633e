"""Shared fixtures: a real PostgreSQL server, the stand-in sources, and the code location wired
to both. Every test gets a database of its own, cloned from a migrated template."""

from __future__ import annotations

import dataclasses
import inspect
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from dagster import DagsterInstance

from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.support.instances import (
    TEMPLATE_DB,
    fresh_warehouse,
    production_instance,
)
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.redis import ThrowawayRedis
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until
from mostovik_pipelines_tests.support.webhook import WebhookReceiver

LONGEST_FIRST = ("test_calendar_parser_daemon.py", "test_chaos_platform.py",
                 "test_chaos_calendar.py", "test_dead_runs.py",
                 "test_rerun_range.py", "test_signals_truth.py",
                 "test_dead_runs_on_the_code_server.py", "test_rerun_killed_on_celery.py",
                 "test_docs_commands_run.py", "test_chaos_sync_and_files.py",
                 "test_docs_operator_commands_run.py", "test_runbook.py",
                 "test_daemon_continuation_and_monitoring.py",
                 "test_celery_deployment.py", "test_calendar_sync_daemon.py",
                 "test_recovery_after_prune.py", "test_prune_killed.py",
                 "test_object_store_faults.py", "test_webserver.py",
                 "test_code_server_deployment.py",
                 "test_inbox_on_s3_deployment.py", "test_prometheus_scrape.py",
                 "test_erp_work_orders.py", "test_chaos.py", "test_recovery.py", "test_cli.py",
                 "test_prune.py", "test_verify.py", "test_tracker_rebuild.py",
                 "test_scheduled_verification.py", "test_verification_schedule_ticks.py",
                 "test_fence_processes.py", "test_production_instance.py",
                 "test_prune_on_s3.py", "test_rerun_on_celery.py",
                 "test_stores_on_s3.py", "test_celery_deployment_on_s3.py", "test_bad_input.py",
                 "test_retries.py", "test_locking.py",
                 "test_inbox_daemon.py", "test_tracking.py", "test_security.py",
                 "test_material_deliveries.py", "test_fake_clock.py")
"""Test modules of 30 s or more (summed ``--durations=0`` of a whole ``make test``; the daemon,
re-run, code server, metrics and object-store modules by their own runs), longest first.
``make test`` hands whole modules to its workers in this order (``--dist loadfile
--no-loadscope-reorder``: xdist would otherwise order modules by their number of tests); started
first, the long ones do not end up alone at the tail while the other workers idle. The signals
truth test starts in the second wave, not beside the three other fake-clock daemon modules: its
operator's re-run is held in flight by a 30 s fetch timeout, which that contention outlasted."""


SERVER_FIXTURES = frozenset({"postgres", "redis_server", "s3", "production_home", "calendar"})
"""Fixtures that start PostgreSQL, Redis or an S3 API server (directly or through another)."""
SERVER_MARKERS = frozenset({"postgres", "slow", "long_outage"})
SERVER_STARTS = ("ThrowawayPostgres(", "ThrowawayRedis(", "S3ApiServer(", "s3_in_environment(",
                 "mounted_buckets(", "S3Front(", "subprocess.", "start_job_execute(")
"""What a test or one of its fixtures calls when it starts a server or a Dagster process."""


def _starts_servers(function) -> bool:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return any(start in source for start in SERVER_STARTS)


def needs_servers(item: pytest.Item) -> bool:
    """Whether a test starts a server or a real Dagster process: by its markers, the fixtures
    it asks for, what it or one of its fixtures calls, or a backend parameter
    (``warehouse_url``'s and ``dagster_home``'s ``postgresql``)."""
    if SERVER_MARKERS & {mark.name for mark in item.iter_markers()}:
        return True
    if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "postgresql" in callspec.params.values():
        return True
    info = getattr(item, "_fixtureinfo", None)
    fixtures = [definition.func for definitions in (info.name2fixturedefs.values() if info else ())
                for definition in definitions]
    return any(_starts_servers(function)
               for function in [getattr(item, "function", None), *fixtures])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test that needs servers ``servers`` (``make check`` runs the others), and
    orders the modules longest first."""
    for item in items:
        if needs_servers(item):
            item.add_marker(pytest.mark.servers)

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every module keeps its own order


@pytest.fixture(scope="session")
def postgres() -> Iterator[ThrowawayPostgres]:
    server = ThrowawayPostgres().start()
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {TEMPLATE_DB}")
        migrate.upgrade(server.url(TEMPLATE_DB))
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_warehouse_url(postgres: ThrowawayPostgres) -> Iterator[str]:
    with fresh_warehouse(postgres, f"wh_{uuid.uuid4().hex[:12]}") as url:
        yield url


@pytest.fixture
def sqlite_warehouse_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'warehouse.sqlite'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def warehouse_url(request: pytest.FixtureRequest) -> str:
    """Both warehouse backends."""
    fixture = "pg_warehouse_url" if request.param == "postgresql" else "sqlite_warehouse_url"
    return request.getfixturevalue(fixture)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[ThrowawayRedis]:
    """A Redis for a module's Celery deployment: persistent, as deploy/README sets it up (a
    restart keeps the queue and the results)."""
    server = ThrowawayRedis(persistent=True).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def webhook() -> Iterator[WebhookReceiver]:
    """The team's alert webhook for a module's deployment, on 127.0.0.1; its URL carries a
    secret token."""
    with WebhookReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def standin_server() -> Iterator[StandinServer]:
    server = StandinServer().start()
    yield server
    server.stop()


@pytest.fixture
def standin(standin_server: StandinServer) -> Iterator[StandinClient]:
    """The stand-in, with no faults, no changes, no request hanging from an earlier test and no
    remembered requests."""
    client = StandinClient(standin_server.url)
    routes = [endpoint.route for endpoint in standin_server.endpoints.values()]
    client.clear_faults()
    client.release_hangs()
    for route in routes:
        client.reset(route)
    wait_until(lambda: not client.hanging(), PROCESS_START_MARGIN_SECONDS,
               "the requests hanging at the stand-in answered")
    client.forget_requests()
    yield client
    client.clear_faults()
    client.release_hangs()
    for route in routes:
        client.reset(route)


@pytest.fixture
def cbr_source():
    """The CBR source with short retry delays, so retry tests take seconds, not minutes."""
    return dataclasses.replace(cbr_daily_rates.SOURCE, extract_retry=FAST_RETRY,
                               load_retry=FAST_RETRY)


@pytest.fixture
def cbr_job(warehouse_url, standin_server, standin, tmp_path, cbr_source):
    """The CBR job wired to the warehouse under test and the stand-in."""
    location = code_location_for(warehouse_url, standin_server, tmp_path, [cbr_source])
    return location.resolve_job_def("cbr_daily_rates_job")


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with DagsterInstance.ephemeral() as ephemeral:
        yield ephemeral


@pytest.fixture
def production_home(postgres, tmp_path) -> tuple[Path, dict[str, str]]:
    """A DAGSTER_HOME with deploy/dagster.yaml (PostgreSQL run storage) and its environment,
    on a fresh database."""
    return production_instance(postgres, f"dagster_{uuid.uuid4().hex[:12]}", tmp_path)


@pytest.fixture(params=["sqlite", "postgresql"])
def dagster_home(request, tmp_path, monkeypatch) -> str:
    """Both run storages: the DAGSTER_HOME of a local instance (SQLite), and of the production
    one (deploy/dagster.yaml, PostgreSQL) with the environment it reads set."""
    if request.param == "sqlite":
        return str(local_dagster_home(tmp_path))
    home, environment = request.getfixturevalue("production_home")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return str(home)


@pytest.fixture
def run_storage(dagster_home: str) -> Iterator[DagsterInstance]:
    """A persistent instance on each run storage (:func:`dagster_home`)."""
    with DagsterInstance.from_config(dagster_home) as instance:
        yield instance


@pytest.fixture
def calendar(tmp_path, pg_warehouse_url, standin_server, standin):
    """Makes a source calendar run by the real daemon on a fake clock
    (:func:`.support.schedule_calendar.calendars`); the stand-in's ERP is reset after it."""
    from mostovik_pipelines_tests.support.schedule_calendar import calendars

    with calendars(tmp_path, pg_warehouse_url, standin_server, standin) as start:
        yield start
    standin.reset_erp()


@pytest.fixture
def s3(monkeypatch) -> Iterator:
    """An S3 API server of this test's own, its credentials and endpoint in this process's
    environment (``AWS_*``), as a deployment hands them to the stores."""
    from mostovik_pipelines_tests.support.object_store import s3_in_environment, why_no_s3_api

    if reason := why_no_s3_api():
        pytest.skip(reason)
    with s3_in_environment(monkeypatch) as server:
        yield server
