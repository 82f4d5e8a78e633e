"""The production Dagster instance (deploy/dagster.yaml) on the throw-away PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from unittest import mock

import psycopg
import yaml
from dagster import DagsterInstance

from mostovik_pipelines.framework.dagster_compat import run_event_log_dir
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

REPO = Path(__file__).resolve().parents[2]
RUN_QUEUE_INTERVAL_SECONDS = 1
"""How often the tests' daemon launches queued runs: the run coordinator's
``dequeue_interval_seconds``, set in the tests' copy of deploy/dagster.yaml (its default: 5 s)."""


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
