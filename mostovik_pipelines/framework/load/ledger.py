"""The ledger of partition loads (``partition_loads``): for every partition of every target
table, the run that last loaded it, how many rows the source delivered, and their digest.

A re-load whose rows hash to the digest recorded by the last load has nothing to do: the rows
are exactly what that load wrote, so the load returns "all unchanged" without staging them.
The digest is trusted only where the table can tell when something else wrote it, that is on
PostgreSQL, and only while the table's guard trigger is there and enabled
(``warehouse.schema.postgresql_conventions``):

* the trigger forgets a table's digests as soon as anything but the loader writes it. Loads
  hold the table's writes lock shared for their whole transaction and the trigger takes it
  exclusively, so an outside write either commits before a load starts (the load reads it) or
  forgets the digests after the load has committed them;
* a load that may move rows in from other partitions (the partition column is not part of the
  natural key) holds the writes lock exclusively, and forgets the table's digests itself when it
  does move rows;
* a migration forgets them all, in its own transaction (``warehouse/migrations/env.py``);
  ``mostovik db forget-digests`` is for writes no trigger sees.

SQLite records no digest, so every re-load there goes through the stage.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
from sqlalchemy import Connection, select, update
from sqlalchemy.dialects import postgresql, sqlite

from mostovik_pipelines.warehouse.schema import (
    GUARD_TRIGGER_SUFFIX,
    LOADING_SETTING,
    RUN_ID_SETTING,
    partition_loads,
    table_writes_lock_key,
)

LOADER_FORMAT = "1"
"""Part of every digest: bump it when the loader starts writing the same rows differently, so
that no partition loaded the old way counts as unchanged."""


class _Hashing:
    """A write-only file that hashes what is written to it (Arrow's IPC writer streams into it,
    so the rows are hashed without a serialised copy of them in memory)."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.closed = False

    def write(self, data: bytes | memoryview) -> int:
        self.hash.update(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def rows_digest(rows: pa.Table, load_mode: str) -> str:
    """The sha256 of the rows (values, types, order) and of how they are loaded. Equal digests
    mean equal rows; rows that are equal but laid out differently in memory may hash
    differently, which costs a comparison, never a wrong result."""
    sink = _Hashing()
    sink.hash.update(f"mostovik loader {LOADER_FORMAT} {load_mode}\n".encode())
    schema = rows.schema.remove_metadata()
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema) as writer:
        writer.write_table(rows.replace_schema_metadata(None))
    return sink.hash.hexdigest()


@dataclass(frozen=True)
class PostgresqlLoad:
    """What the start of a load transaction on PostgreSQL established."""

    now: datetime
    """The transaction's time: every bookkeeping timestamp of the load."""
    digests_guarded: bool
    """The table's guard trigger is there and enabled: digests may be recorded and trusted."""


def begin_postgresql_load(connection: Connection, table_name: str, run_id: str, *,
                          exclusive: bool) -> PostgresqlLoad:
    """Mark this transaction as the loader's (run id for the bookkeeping defaults, UTF-8 on
    the wire) and hold the table's writes lock until it ends: shared, or ``exclusive`` for a
    load that may move rows in from other partitions (no other load of the table is then in
    flight to record a digest of rows it takes away)."""
    lock = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
    now, guarded = connection.exec_driver_sql(
        "SELECT set_config(%(run)s, %(run_id)s, true), set_config(%(loading)s, 'on', true), "
        "set_config('client_encoding', 'UTF8', true), "
        f"{lock}({table_writes_lock_key('%(table)s')}), now(), "
        "EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass(quote_ident(%(table)s)) "
        "AND tgname = %(trigger)s AND tgenabled <> 'D')",
        {"run": RUN_ID_SETTING, "run_id": run_id, "loading": LOADING_SETTING,
         "table": table_name, "trigger": f"{table_name}{GUARD_TRIGGER_SUFFIX}"},
    ).one()[4:]
    return PostgresqlLoad(now=now, digests_guarded=guarded)


@dataclass(frozen=True)
class LastLoad:
    """What the ledger says about a partition's last load."""

    content_digest: str | None
    loaded_by_run: str
    fetched_at: datetime | None
    """In UTC; None for loads recorded before fetch times were (or with none given)."""
    row_count: int = 0
    payload_hash: str | None = None
    parser_version: str | None = None


def last_load(connection: Connection, table_name: str, partition_key: str) -> LastLoad | None:
    row = connection.execute(select(
        partition_loads.c.content_digest, partition_loads.c.loaded_by_run,
        partition_loads.c.fetched_at, partition_loads.c.row_count,
        partition_loads.c.payload_hash, partition_loads.c.parser_version,
    ).where(
        partition_loads.c.table_name == table_name,
        partition_loads.c.partition_key == partition_key,
    )).one_or_none()
    if row is None:
        return None
    return LastLoad(row.content_digest, row.loaded_by_run, _utc(row.fetched_at), row.row_count,
                    row.payload_hash, row.parser_version)


def record_load(connection: Connection, table_name: str, partition_key: str, row_count: int,
                digest: str | None, run_id: str, loaded_at: datetime,
                fetched_at: datetime | None = None, *, loaded_partition_key: str | None = None,
                payload_hash: str | None = None, parser_version: str | None = None) -> None:
    """Record the partition's load, in the load's transaction: with the partition key it was
    loaded under (``partition_key`` is the partition column's value: a file version's file
    name), the landed payload's hash and the code that parsed it, the ledger alone names every
    loaded partition and its payload (:mod:`..verification`, the tracker's rebuild), and a
    re-load of that payload by that code need not be made into rows again
    (:mod:`..steps.unchanged`)."""
    dialect_insert = postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert
    values = {"row_count": row_count, "content_digest": digest, "loaded_by_run": run_id,
              "loaded_at": loaded_at,
              "fetched_at": fetched_at.astimezone(UTC) if fetched_at else None,
              "loaded_partition_key": loaded_partition_key,
              "payload_hash": payload_hash, "parser_version": parser_version}
    statement = dialect_insert(partition_loads).values(
        table_name=table_name, partition_key=partition_key, **values)
    connection.execute(statement.on_conflict_do_update(
        index_elements=[partition_loads.c.table_name, partition_loads.c.partition_key],
        set_=values,
    ))


def note_payload(connection: Connection, table_name: str, partition_key: str,
                 payload_hash: str | None, parser_version: str | None) -> None:
    """A load that found the stored rows equal to its rows (the digest's step 4) came from this
    payload, read by this code: the ledger says so, and keeps the last load's run and fetch."""
    connection.execute(update(partition_loads).values(
        payload_hash=payload_hash, parser_version=parser_version).where(
        partition_loads.c.table_name == table_name,
        partition_loads.c.partition_key == partition_key))


def _utc(value: datetime | None) -> datetime | None:
    """SQLite hands timestamps back without their zone; the ledger writes them in UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def forget_digests(connection: Connection, table_name: str | None = None) -> int:
    """Forget the digests of one table's partitions (or of all tables): their next loads
    go through the stage. Returns how many were forgotten."""
    statement = update(partition_loads).values(content_digest=None).where(
        partition_loads.c.content_digest.is_not(None))
    if table_name is not None:
        statement = statement.where(partition_loads.c.table_name == table_name)
    return connection.execute(statement).rowcount


@dataclass(frozen=True)
class LedgerEntry:
    """A partition's line in the ledger, whole: what verification and the tracker's rebuild
    read (a load recorded before a column existed has None there)."""

    table_name: str
    partition_key: str
    """The partition column's value (a file version's file name)."""
    loaded_partition_key: str | None
    """The partition key it was loaded under (a file version ``<name>@<hash>``)."""
    row_count: int
    content_digest: str | None
    loaded_by_run: str
    loaded_at: datetime
    fetched_at: datetime | None
    payload_hash: str | None
    parser_version: str | None = None

    @property
    def key(self) -> str:
        """The partition key of the last load."""
        return self.loaded_partition_key or self.partition_key


def ledger_entries(connection: Connection, table_name: str,
                   partition_keys: list[str] | None = None) -> list[LedgerEntry]:
    """The ledger's lines for a table (those of ``partition_keys``, the partition column's
    values, when given), in partition order."""
    statement = select(partition_loads).where(partition_loads.c.table_name == table_name)
    if partition_keys is not None:
        statement = statement.where(partition_loads.c.partition_key.in_(partition_keys))
    rows = connection.execute(statement.order_by(partition_loads.c.partition_key)).all()
    return [LedgerEntry(
        table_name=row.table_name, partition_key=row.partition_key,
        loaded_partition_key=row.loaded_partition_key, row_count=row.row_count,
        content_digest=row.content_digest, loaded_by_run=row.loaded_by_run,
        loaded_at=_utc(row.loaded_at), fetched_at=_utc(row.fetched_at),
        payload_hash=row.payload_hash, parser_version=row.parser_version) for row in rows]
