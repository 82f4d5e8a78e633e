"""Verify one partition: the ledger says what was loaded, :mod:`.source_rows` what the source
says, :mod:`.compare` how they differ. Every read of the warehouse is a read-only transaction
(PostgreSQL ``READ ONLY``; SQLite ``query_only``), so a verification cannot write, and it takes
no lock a load waits for."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine, event

from mostovik_pipelines.framework.load.ledger import LedgerEntry, ledger_entries
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.framework.verification.compare import (
    PartitionVerdict,
    Status,
    compare_partition,
    stored_row_count,
)
from mostovik_pipelines.framework.verification.source_rows import (
    Unverifiable,
    from_landing,
    from_source,
)

if TYPE_CHECKING:
    from dagster import DagsterInstance

    from mostovik_pipelines.resources.landing import LandingStoreResource

LANDED = "landed"
SOURCE = "source"
AGAINST = (SOURCE, LANDED)


@contextlib.contextmanager
def read_only(engine: Engine) -> Iterator[Connection]:
    """A connection whose transaction cannot write, rolled back at the end."""
    with _reading_engine(engine.url.render_as_string(hide_password=False)).connect() as connection:
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql("SET TRANSACTION READ ONLY")
        yield connection
        connection.rollback()


@functools.cache
def _reading_engine(url: str) -> Engine:
    """An engine of its own for reading: the warehouse's SQLite engine starts every transaction
    with ``BEGIN IMMEDIATE`` (a load's write lock), which a verification must not take."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _query_only(dbapi_connection, _record) -> None:
        dbapi_connection.execute("PRAGMA query_only = ON")

    return engine


def verify_partition(engine: Engine, spec: SourceSpec, key: str, against: str, *,
                     resource: Any = None, landing: LandingStoreResource | None = None,
                     instance: DagsterInstance | None = None,
                     sleep: Callable[[float], None] = time.sleep) -> PartitionVerdict:
    """The verdict on partition ``key`` against the ``source`` (through ``resource``) or the
    payload ``landed`` (in ``landing``); ``instance`` names the payload of a load the ledger
    recorded without one (its latest materialisation's)."""
    scope = spec.load_target.partition_scope(key)
    with read_only(engine) as connection:
        entries = ledger_entries(connection, spec.table.name, [scope])
    loaded = entries[0] if entries else None
    if loaded is not None and loaded.loaded_partition_key not in (None, key):
        return PartitionVerdict(
            spec.name, key, against, Status.SUPERSEDED,
            note=f"the table holds {scope} as loaded from {loaded.key} (run "
                 f"{loaded.loaded_by_run[:8]}): verify that partition")
    try:
        if against == LANDED:
            if loaded is None:
                return PartitionVerdict(spec.name, key, against, Status.NOT_LOADED,
                                        note="never loaded: no payload to compare with")
            assert landing is not None
            rows = from_landing(spec, landing, key, loaded, _payload_hash(instance, spec, key,
                                                                          loaded))
        else:
            rows = from_source(spec, resource, key, sleep)
    except Unverifiable as refused:
        return PartitionVerdict(spec.name, key, against, Status.UNVERIFIABLE, note=str(refused))
    with read_only(engine) as connection:
        if rows.frame is None:
            stored = stored_row_count(connection, spec, key)
            status = Status.DIFFERS if stored else Status.MATCHES
            return PartitionVerdict(
                spec.name, key, against, status, payload=rows.payload, stored_rows=stored,
                note=f"the source says {rows.not_available}"
                     + (f", the table holds {stored} row(s)" if stored else "; nothing stored"))
        newer = rows.partition_key if rows.partition_key != key else None
        return compare_partition(
            connection, spec, key, rows.frame, rows.rejected, against=against,
            payload=rows.payload,
            note=f"the source holds a newer version, {newer}, not loaded" if newer else "",
            version_of=(key, newer) if newer else None)


def _payload_hash(instance: DagsterInstance | None, spec: SourceSpec, key: str,
                  loaded: LedgerEntry) -> str | None:
    if loaded.payload_hash is not None or instance is None:
        return loaded.payload_hash
    from mostovik_pipelines.framework.assets.stored_payload import stored_payload_hashes

    return stored_payload_hashes(instance, spec.name, [key]).get(key)
