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

A kept connection can be dead: the database restarted or failed over since it was last used.
One that has been idle for a second or more is checked as it is taken from the pool
(SQLAlchemy's pessimistic disconnect handling: a ``SELECT 1``, a new connection if it fails); one
returned just before is not (a run logs its events back to back: a ping before each was a third
of its storage round trips), and a call on it that finds it dead is made again, as below. A new
connection that the database refuses
because it is away (refused, starting up, shutting down, closed) is tried again with backoff for
``MOSTOVIK_DAGSTER_PG_OUTAGE_SECONDS`` (90 s) of one outage, each wait logged: the run rides out
a restart of its run storage instead of failing on its next event. This is the project's one
outage rule (``core/outages.py``, ``ride_out``), timed on one clock with the run's claim;
past the budget a call fails at once with its ``StoreAway``, naming the setting. That is no
driver error on purpose: dagster-postgres makes a call whose driver fails again five times over
about 6 s, and a failing run makes a score of calls, so a run past the budget went on failing
for two more minutes. A storage call whose
statement the restart cut off in flight (a run's process writes events back to back, so one
often is) is made again on a new connection, within the same budget: the call that failed was
rolled back, unless the database had committed it just before it went away and the answer was
lost, when an event can be stored twice (a window of microseconds, against a failed run).
Dagster asks whether the check-executions table exists before it stores every check result (four
per partition of a ranged run); a table once there stays, so that answer is kept.
The webserver replaces each storage's engine with its own (``optimize_for_webserver``); the
new engine is guarded the same way. Building the storages, which connects, waits out an outage
too: a code server the daemon started during a restart failed to load for a minute otherwise,
and every backfill the daemon evaluated meanwhile failed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.utils import get_token_provider_from_config, pg_url_from_config

from mostovik_pipelines.core.dagster_compat import storage_engine
from mostovik_pipelines.core.errors import ConfigurationError, refused_by_the_server
from mostovik_pipelines.core.outages import (
    BUDGETS,
    Store,
    database_of,
    ride_out,
    wait_message,
)

POOL_RECYCLE_SECONDS = 3600
"""A kept connection is replaced after an hour (as the webserver's default)."""
MAX_OVERFLOW = 10
"""Connections beyond the kept one while storage calls overlap (daemon threads, a webserver)."""
OUTAGE_ENV = BUDGETS[Store.RUN_STORAGE].setting
DEFAULT_OUTAGE_SECONDS = BUDGETS[Store.RUN_STORAGE].default_seconds
IDLE_BEFORE_PING_SECONDS = 1.0
"""A kept connection idle this long is pinged before use; one returned more recently is used as
it is (a call that finds it dead is made again on a new one)."""

logger = logging.getLogger(__name__)
T = TypeVar("T")


class PooledPostgresStorage(DagsterPostgresStorage):
    """``DagsterPostgresStorage`` whose run, event-log and schedule storages keep one
    connection each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        outage = _Outage(database_of(kwargs.get("postgres_url") or ""))
        try:
            outage.building(lambda: super(PooledPostgresStorage, self).__init__(*args, **kwargs))
        except Exception as error:
            cause = error if isinstance(error, sqlalchemy.exc.OperationalError) else (
                error.__cause__)
            if not isinstance(cause, sqlalchemy.exc.OperationalError):
                raise
            message = str(cause.orig or cause).strip().splitlines()[0]
            if not refused_by_the_server(message):
                raise
            settings = _settings_read(kwargs.get("inst_data"))
            raise ConfigurationError(
                f"the run storage database refused the instance's connection: {message}. Check "
                f"the run storage settings ({', '.join(settings) or 'dagster.yaml'}); waiting "
                "would not help") from error
        _remember_tables(self.event_log_storage)
        for storage in (self.run_storage, self.event_log_storage, self.schedule_storage):
            _ride_out_outages(storage, outage)
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


def _settings_read(inst_data: Any) -> list[str]:
    """The environment variables dagster.yaml's storage section reads (never their values)."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if set(node) == {"env"}:
                found.append(str(node["env"]))
            for value in node.values():
                walk(value)

    walk(getattr(inst_data, "config_dict", None))
    return sorted(found)


def _remember_tables(storage: Any) -> None:
    """``has_table`` answers True once per table and process: Dagster asks it before storing
    each check result (``supports_asset_checks``), and no migration drops a table. False is
    asked again (a migration may add the table meanwhile)."""
    ask = storage.has_table
    present: set[str] = set()

    @functools.wraps(ask)
    def has_table(table_name: str) -> bool:
        if table_name in present:
            return True
        found = ask(table_name)
        if found:
            present.add(table_name)
        return found

    storage.has_table = has_table


def _ride_out_outages(storage: Any, outage: _Outage) -> None:
    """Every public call of ``storage`` made again when its connection was lost in flight, and
    every engine it is given (now and by a webserver) checked on checkout and connecting
    through ``outage``."""
    optimize = storage.optimize_for_webserver

    def optimize_and_guard(*args: Any, **kwargs: Any) -> None:
        optimize(*args, **kwargs)
        engine = storage_engine(storage)
        sqlalchemy.event.listen(engine, "checkout", _ping_on_checkout)
        sqlalchemy.event.listen(engine, "checkin", _note_checkin)
        sqlalchemy.event.listen(engine, "do_connect", outage.connect)

    for name, function in inspect.getmembers(type(storage), inspect.isfunction):
        if name.startswith("_") or inspect.isgeneratorfunction(function):
            continue
        setattr(storage, name, outage.retrying(getattr(storage, name)))
    storage.optimize_for_webserver = optimize_and_guard


def _note_checkin(dbapi_connection, connection_record) -> None:
    connection_record.info["returned_at"] = time.monotonic()


def _ping_on_checkout(dbapi_connection, connection_record, connection_proxy) -> None:
    """A pooled connection idle for :data:`IDLE_BEFORE_PING_SECONDS` is checked before use; a
    dead one is replaced, not failed on."""
    returned_at = connection_record.info.get("returned_at")
    if returned_at is not None and time.monotonic() - returned_at < IDLE_BEFORE_PING_SECONDS:
        return
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as error:
        raise sqlalchemy.exc.DisconnectionError(str(error)) from error


class _Outage:
    """The instance's calls to its database, ridden out while it is away
    (:func:`.core.outages.ride_out`, the run storage's budget, on the process's clock of
    that database, which the run's claim shares: :mod:`.platform.claims`)."""

    def __init__(self, database: str) -> None:
        self.database = database

    def connect(self, dialect, connection_record, cargs, cparams):
        """A new connection (SQLAlchemy's ``do_connect``), tried again while the database is
        away; a server that refuses us fails at once (the one classifier)."""
        return ride_out(Store.RUN_STORAGE, lambda: dialect.connect(*cargs, **cparams),
                        target=self.database, answers=True)

    def building(self, build: Callable[[], None]) -> None:
        """``build`` (dagster-postgres' storages, which connect to check or create their tables
        and give up after about 6 s of their own retries), again while the database is away:
        a process started during an outage (a code server the daemon starts again, a run, a
        webserver) waits it out instead of failing to load."""
        ride_out(Store.RUN_STORAGE, build, target=self.database, answers=True,
                 on_wait=_starting)

    def retrying(self, call: Callable[..., T]) -> Callable[..., T]:
        """``call``, made again while it fails because the database is away: a connection lost
        in flight (the pool has dropped that connection; the next one connects through
        :meth:`connect`), within the same budget."""

        @functools.wraps(call)
        def retried(*args: Any, **kwargs: Any) -> T:
            return ride_out(Store.RUN_STORAGE, lambda: call(*args, **kwargs),
                            target=self.database)

        return retried


def _starting(store: Store, error: BaseException, seconds: float, wait: float) -> None:
    logger.warning("%s, as the instance starts", wait_message(store, error, seconds, wait))
