"""Where the project keeps its local state, and how the environment chooses local or production.

Every setting comes from an environment variable with a local default; secrets (database URLs
with passwords, API tokens) are passed to resources as ``dagster.EnvVar`` so that they never
appear in run config, the UI or the event log.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dagster import EnvVar

DATA_DIR_ENV = "MOSTOVIK_DATA_DIR"
DATABASE_URL_ENV = "MOSTOVIK_DATABASE_URL"
ALERT_WEBHOOK_ENV = "MOSTOVIK_ALERT_WEBHOOK_URL"
EXECUTOR_ENV = "MOSTOVIK_EXECUTOR"
LANDING_DIR_ENV = "MOSTOVIK_LANDING_DIR"
STORAGE_DIR_ENV = "MOSTOVIK_STORAGE_DIR"
KEEP_FAILED_RUN_OUTPUTS_ENV = "MOSTOVIK_KEEP_FAILED_RUN_OUTPUTS_DAYS"
RETENTION_GRACE_ENV = "MOSTOVIK_RETENTION_GRACE_DAYS"
KEEP_LANDED_ENV = "MOSTOVIK_KEEP_LANDED_DAYS"
KEEP_RUNS_ENV = "MOSTOVIK_KEEP_RUNS_DAYS"


def data_dir() -> Path:
    """The base directory of local state: SQLite warehouse, landing store, demo instance."""
    return Path(os.environ.get(DATA_DIR_ENV, ".mostovik")).resolve()


def landing_dir() -> str:
    """The landing store's root (raw payloads), shared by every worker: a directory, or a bucket
    of an S3-compatible store as ``s3://bucket/prefix`` (its credentials from ``AWS_*``)."""
    return setting(LANDING_DIR_ENV, str(data_dir() / "landing"))


def storage_dir() -> str:
    """The op-output storage's root (what a step hands the next), shared by every worker: a
    directory or ``s3://bucket/prefix``, as :func:`landing_dir`."""
    return setting(STORAGE_DIR_ENV, str(data_dir() / "storage"))


def default_database_url() -> str:
    return f"sqlite:///{data_dir() / 'warehouse.sqlite'}"


def database_url_setting() -> str | EnvVar:
    """The warehouse URL: ``EnvVar`` when configured (it may hold a password), else local SQLite."""
    from dagster import EnvVar

    if os.environ.get(DATABASE_URL_ENV):
        return EnvVar(DATABASE_URL_ENV)
    return default_database_url()


def alert_webhook_setting() -> EnvVar | None:
    """The alert webhook (its URL carries a token): ``EnvVar`` when set, else alerts are only
    logged."""
    from dagster import EnvVar

    return EnvVar(ALERT_WEBHOOK_ENV) if os.environ.get(ALERT_WEBHOOK_ENV) else None


def resolved_database_url() -> str:
    """The warehouse URL itself, for code that runs outside Dagster (CLI, migrations)."""
    return os.environ.get(DATABASE_URL_ENV) or default_database_url()


def setting(name: str, default: str) -> str:
    """A non-secret setting read when the code location loads."""
    return os.environ.get(name) or default
