"""The partition load: one transaction that makes the table hold what the source says.

Steps, all in one transaction so that a failure at any point leaves the partition as it was:

1. take the partition's business lock (:mod:`.locking`);
2. stage the incoming rows in a temporary table (``COPY`` on PostgreSQL);
3. update rows whose data changed, and only those;
4. insert rows whose natural key is new;
5. replace-partition mode only: delete the partition's rows the source no longer has.

Merge-by-version mode skips step 5 and lets a row win only with a newer version; deletions in
that mode arrive as tombstone rows (a flag column of the source), never by absence.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from typing import Any

import pandas as pd
from sqlalchemy import Column, Connection, Date, DateTime, Engine, MetaData, String, Table, text
from sqlalchemy.sql.expression import bindparam

from mostovik_pipelines.etl import loading_sql
from mostovik_pipelines.etl.locking import lock_partition
from mostovik_pipelines.warehouse.schema import data_columns

COPY_CHUNK_ROWS = 50_000


class LoadMode(enum.StrEnum):
    """How a partition's rows reach the target table."""

    REPLACE_PARTITION = "replace_partition"
    """The source gives the whole truth for the partition: rows it no longer has are deleted."""

    MERGE_BY_VERSION = "merge_by_version"
    """Incremental: newer versions win, older ones never overwrite; nothing deleted by absence."""


@dataclass(frozen=True)
class LoadTarget:
    """Where and how a source's rows are written."""

    table: Table
    natural_key: Sequence[str]
    partition_column: str
    mode: LoadMode
    version_column: str | None = None

    @property
    def columns(self) -> list[str]:
        return data_columns(self.table)

    def partition_value(self, partition_key: str) -> Any:
        """The partition key as the partition column stores it."""
        if isinstance(self.table.c[self.partition_column].type, Date):
            return date.fromisoformat(partition_key)
        return partition_key


@dataclass(frozen=True)
class LoadCounts:
    """What one load did to the table; these figures go into the materialisation metadata."""

    inserted: int
    updated: int
    unchanged: int
    deleted: int

    @property
    def written(self) -> int:
        return self.inserted + self.updated + self.deleted

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def load_partition(
    engine: Engine, target: LoadTarget, frame: pd.DataFrame, partition_key: str, run_id: str
) -> LoadCounts:
    """Make ``target`` hold exactly ``frame`` for the partition, in one transaction."""
    columns = target.columns
    now = datetime.now(UTC)
    with engine.begin() as connection:
        lock_partition(connection, target.table.name, partition_key)
        stage = _create_stage(connection, target.table, columns)
        staged = _copy_into_stage(connection, stage, frame[columns])
        dialect = connection.dialect
        params = {"run_id": run_id, "now": now}
        updated = _execute(connection, loading_sql.update_changed_rows(
            dialect, target.table, stage, target.natural_key, columns, target.version_column
        ), params)
        inserted = _execute(connection, loading_sql.insert_new_rows(
            dialect, target.table, stage, target.natural_key, columns
        ), params)
        deleted = 0
        if target.mode is LoadMode.REPLACE_PARTITION:
            partition_column = target.table.c[target.partition_column]
            deleted = _execute(connection, loading_sql.delete_vanished_rows(
                dialect, target.table, stage, target.natural_key, target.partition_column
            ), {"partition_value": target.partition_value(partition_key)},
                partition_type=partition_column.type)
        connection.exec_driver_sql(f"DROP TABLE {_quote(connection, stage.name)}")
    return LoadCounts(
        inserted=inserted, updated=updated, unchanged=staged - inserted - updated, deleted=deleted
    )


def _create_stage(connection: Connection, table: Table, columns: Sequence[str]) -> Table:
    """A temporary table with the target's data columns and types, private to this session."""
    stage = Table(
        f"stage_{table.name}",
        MetaData(),
        *(Column(c, table.c[c].type) for c in columns),
        prefixes=["TEMPORARY"],
    )
    connection.exec_driver_sql(f"DROP TABLE IF EXISTS {_quote(connection, stage.name)}")
    stage.create(connection)
    return stage


def _copy_into_stage(connection: Connection, stage: Table, frame: pd.DataFrame) -> int:
    """Stage every row: ``COPY`` on PostgreSQL, a bulk insert elsewhere. Returns the row count."""
    if connection.dialect.name == "postgresql":
        cursor = connection.connection.driver_connection.cursor()
        column_list = ", ".join(_quote(connection, c) for c in frame.columns)
        quoted_stage = _quote(connection, stage.name)
        with cursor.copy(f"COPY {quoted_stage} ({column_list}) FROM STDIN") as copy:
            for row in _rows(frame):
                copy.write_row(row)
        connection.exec_driver_sql(f"ANALYZE {quoted_stage}")
    else:
        for start in range(0, len(frame), COPY_CHUNK_ROWS):
            chunk = frame.iloc[start:start + COPY_CHUNK_ROWS]
            records = [dict(zip(chunk.columns, row, strict=True)) for row in _rows(chunk)]
            if records:
                connection.execute(stage.insert(), records)
    return len(frame)


def _quote(connection: Connection, name: str) -> str:
    return connection.dialect.identifier_preparer.quote(name)


def _rows(frame: pd.DataFrame) -> Iterator[tuple]:
    """Plain Python rows with ``None`` for every kind of missing value."""
    converted = {
        name: frame[name].astype(object).where(frame[name].notna(), None) for name in frame.columns
    }
    return zip(*converted.values(), strict=True)


def _execute(connection: Connection, sql: str, params: dict[str, Any], *,
             partition_type: Any = None) -> int:
    statement = text(sql)
    if "now" in params:
        statement = statement.bindparams(
            bindparam("now", type_=DateTime(timezone=True)), bindparam("run_id", type_=String())
        )
    if partition_type is not None:
        statement = statement.bindparams(bindparam("partition_value", type_=partition_type))
    return connection.execute(statement, params).rowcount
