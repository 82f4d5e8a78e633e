"""The warehouse database every source loads into (PostgreSQL in production, SQLite locally)."""

from __future__ import annotations

import functools

from dagster import ConfigurableResource
from sqlalchemy import Engine, create_engine, event

from mostovik_pipelines.core.outages import Store, answered


class WarehouseResource(ConfigurableResource):
    """Connection to the warehouse. ``database_url`` is ``postgresql+psycopg://...`` or
    ``sqlite:///path``; configure it with ``EnvVar("MOSTOVIK_DATABASE_URL")``."""

    database_url: str

    def engine(self) -> Engine:
        return warehouse_engine(self.database_url)


@functools.cache
def warehouse_engine(database_url: str) -> Engine:
    """One engine per URL and process. SQLite transactions start with ``BEGIN IMMEDIATE`` so that
    a load holds the database's write lock from its first statement (SQLite's partition lock)."""
    if database_url.startswith("sqlite"):
        engine = create_engine(database_url, connect_args={"timeout": 60})
        event.listen(engine, "connect", _sqlite_manual_transactions)
        event.listen(engine, "begin", _sqlite_begin_immediate)
        return engine
    engine = create_engine(database_url, pool_pre_ping=True)
    # A new connection is the warehouse answering: an outage the steps timed is over.
    event.listen(engine, "connect", lambda *_: answered(Store.WAREHOUSE))
    return engine


def _sqlite_manual_transactions(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None
    dbapi_connection.execute("PRAGMA journal_mode=WAL")
    dbapi_connection.execute("PRAGMA foreign_keys=ON")


def _sqlite_begin_immediate(connection) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")
