"""The production Dagster instance (deploy/dagster.yaml) on the throw-away PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from unittest import mock

import psycopg
import yaml
from dagster import DagsterInstance

from mostovik_pipelines.core.dagster_compat import run_event_log_dir
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

REPO = Path(__file__).resolve().parents[2]
RUN_QUEUE_INTERVAL_SECONDS = 1
"""How often the tests' daemon launches queued runs: the run coordinator's
``dequeue_interval_seconds``, set in the tests' copy of deploy/dagster.yaml (its default: 5 s)."""
TEMPLATE_DB = "mostovik_template"
"""The migrated warehouse every test's database is cloned from (made once per test worker)."""


def production_instance(postgres: ThrowawayPostgres, database: str,
                        work_dir: Path) -> tuple[Path, dict[str, str]]:
    """A DAGSTER_HOME with deploy/dagster.yaml on a new database, and the environment it reads;
    the one change: the run queue is read every :data:`RUN_QUEUE_INTERVAL_SECONDS`."""
    with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {database}")
    home = work_dir / "dagster_home_pg"
    home.mkdir()
    settings = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())
    settings["run_coordinator"].setdefault("config", {})[
        "dequeue_interval_seconds"] = RUN_QUEUE_INTERVAL_SECONDS
    (home / "dagster.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    return home, {
        "DAGSTER_HOME": str(home),
        "MOSTOVIK_DAGSTER_PG_USER": "mostovik",
        "MOSTOVIK_DAGSTER_PG_PASSWORD": postgres.password,
        "MOSTOVIK_DAGSTER_PG_HOST": "127.0.0.1",
        "MOSTOVIK_DAGSTER_PG_PORT": str(postgres.port),
        "MOSTOVIK_DAGSTER_PG_DB": database,
        "MOSTOVIK_DAGSTER_ARTIFACT_DIR": str(work_dir / "artifacts"),
        "MOSTOVIK_DAGSTER_LOG_DIR": str(work_dir / "compute_logs"),
    }


def create_instance_storage(home: Path, environment: Mapping[str, str]) -> None:
    """Create the instance's tables on its fresh database once, as the deployment's first
    webserver or daemon start does: processes started together on an empty database (the
    webserver and the daemon, or runs) race to create them, and the loser fails on a duplicate
    ``CREATE TABLE``."""
    with mock.patch.dict(os.environ, environment):
        DagsterInstance.from_config(str(home)).dispose()


def runs_with_event_log_files(instance: DagsterInstance) -> set[str] | None:
    """The runs a local (SQLite) instance keeps an event-log file of (``<run>.db`` and its
    ``-wal``/``-shm``); ``None`` for an instance with no file per run (PostgreSQL)."""
    shards = run_event_log_dir(instance)
    if shards is None:
        return None
    return {path.name.partition(".db")[0] for path in shards.iterdir()} - {"index"}


@contextlib.contextmanager
def fresh_warehouse(postgres: ThrowawayPostgres, name: str) -> Iterator[str]:
    """The URL of a new warehouse database ``name`` cloned from the migrated template; dropped
    after."""
    with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    try:
        yield postgres.url(name)
    finally:
        with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
            connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextlib.contextmanager
def fresh_deployment(postgres: ThrowawayPostgres, standin_server: StandinServer, work_dir: Path,
                     name: str, instance_server: ThrowawayPostgres | None = None,
                     ) -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh production instance database and a fresh warehouse cloned from the template, for
    the Dagster processes of one test module: the DAGSTER_HOME, and the environment they read
    (the instance's settings, the warehouse, the stand-in's CBR and ERP, a data directory, the
    in-process executor) for the module to add its own to. The instance database is on
    ``instance_server`` when given (a server of its own, for a test to stop), else beside the
    warehouse. Both databases are dropped after."""
    suffix = uuid.uuid4().hex[:8]
    dagster_db = f"dagster_{name}_{suffix}"
    instance_server = instance_server or postgres
    with fresh_warehouse(postgres, f"wh_{name}_{suffix}") as warehouse_url:
        try:
            home, environment = production_instance(instance_server, dagster_db, work_dir)
            environment.update({
                "MOSTOVIK_DATABASE_URL": warehouse_url,
                "MOSTOVIK_CBR_URL": standin_server.cbr_url,
                "MOSTOVIK_ERP_URL": standin_server.erp_url,
                "MOSTOVIK_DATA_DIR": str(work_dir / "data"),
                "MOSTOVIK_EXECUTOR": "in_process",
            })
            yield home, environment
        finally:
            with psycopg.connect(instance_server.dsn(), autocommit=True) as connection:
                connection.execute(f"DROP DATABASE IF EXISTS {dagster_db} WITH (FORCE)")
