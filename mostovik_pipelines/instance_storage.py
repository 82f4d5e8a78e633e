"""The production instance's storage: dagster-postgres, keeping its connections open.

Outside the webserver, dagster-postgres opens a new connection for every storage call and
closes it after (SQLAlchemy's ``NullPool``). A run makes a hundred such calls or more (every
event it logs, every tag, every materialisation lookup): a delivery report's run made 108, each
~10 ms with password authentication, a quarter of the run. ``PooledPostgresStorage`` is
dagster-postgres with the pooling dagster-postgres itself applies inside the webserver
(``optimize_for_webserver``: one kept connection per storage, more only while calls overlap,
closed again when returned), without the webserver's statement timeout. Its connections close
with the instance (when it is collected) or with the process: nothing is held for a dead one.
``deploy/dagster.yaml`` configures it exactly as ``storage: postgres:``.
"""

from __future__ import annotations

from typing import Any

from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.utils import get_token_provider_from_config, pg_url_from_config

POOL_RECYCLE_SECONDS = 3600
"""A kept connection is replaced after an hour (as the webserver's default)."""
MAX_OVERFLOW = 10
"""Connections beyond the kept one while storage calls overlap (daemon threads, a webserver)."""


class PooledPostgresStorage(DagsterPostgresStorage):
    """``DagsterPostgresStorage`` whose run, event-log and schedule storages keep one
    connection each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for storage in (self.run_storage, self.event_log_storage, self.schedule_storage):
            # statement_timeout 0: no timeout (a webserver sets its own when it optimises).
            storage.optimize_for_webserver(statement_timeout=0,
                                           pool_recycle=POOL_RECYCLE_SECONDS,
                                           max_overflow=MAX_OVERFLOW)

    @classmethod
    def from_config_value(cls, inst_data, config_value) -> PooledPostgresStorage:
        return cls(
            inst_data=inst_data,
            postgres_url=pg_url_from_config(config_value),
            should_autocreate_tables=config_value.get("should_autocreate_tables", True),
            token_provider=get_token_provider_from_config(config_value),
        )
