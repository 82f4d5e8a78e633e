"""Rows into the server: the frame as Arrow, ``COPY`` in natural-key order (PostgreSQL), bulk
inserts (SQLite), and the temporary stage tables the load's SQL reads."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from decimal import Decimal
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
from sqlalchemy import Column, Connection, DateTime, MetaData, String, Table, text
from sqlalchemy.sql.expression import bindparam

from mostovik_pipelines.framework.load import sql

COPY_CHUNK_ROWS = 50_000
"""Rows serialised per ``COPY`` write (and per bulk insert on SQLite): memory holds the frame
plus one chunk."""


def arrow_rows(frame: pd.DataFrame) -> pa.Table:
    """The frame as Arrow columns. ``Decimal`` values become their own text: Arrow would pad
    them all to one scale, and ``NUMERIC`` keeps the scale it is given."""
    columns = {}
    for name in frame.columns:
        series = frame[name]
        if series.dtype == object and isinstance(_first_value(series), Decimal):
            missing = series.isna()
            columns[name] = pa.array(
                [None if gap else str(v) for v, gap in zip(series, missing, strict=True)],
                pa.string())
        else:
            columns[name] = pa.array(series, from_pandas=True)
    return pa.table(columns)


def _first_value(series: pd.Series) -> Any:
    return next((v for v in series if not pd.isna(v)), None)


def copy_rows(connection: Connection, table: Table, rows: pa.Table,
              natural_key: Sequence[str] = ()) -> None:
    """``COPY`` the rows into ``table`` as CSV, a chunk at a time, in natural-key order when a
    key is given: the key's unique index then grows at its right edge instead of splitting
    pages all over (twice as fast for a million rows; Arrow orders text by its bytes, as the
    key's ``"C"`` collation does)."""
    positions = None
    if natural_key:
        positions = pc.sort_indices(rows.select(list(natural_key)),
                                    [(name, "ascending") for name in natural_key]).to_numpy()
    statement = sql.copy_into(connection.dialect, table.name, rows.column_names)
    options = pa_csv.WriteOptions(include_header=False, quoting_style="needed")
    cursor = connection.connection.driver_connection.cursor()
    with cursor.copy(statement) as copy:
        for chunk in _chunks(rows, positions):
            # Strings are always quoted, so an unquoted empty field is NULL and "" the empty
            # string; tabs, newlines, backslashes and quotes are plain data.
            buffer = io.BytesIO()
            pa_csv.write_csv(chunk, buffer, options)
            copy.write(buffer.getbuffer())


def _chunks(rows: pa.Table, positions: np.ndarray | None) -> Iterator[pa.Table]:
    """The rows (at ``positions``, in that order, if given), a chunk at a time."""
    for start in range(0, rows.num_rows, COPY_CHUNK_ROWS):
        yield (rows.slice(start, COPY_CHUNK_ROWS) if positions is None
               else rows.take(positions[start:start + COPY_CHUNK_ROWS]))


def insert_rows(connection: Connection, table: Table, frame: pd.DataFrame) -> None:
    """SQLite: the frame into ``table`` by bulk inserts, a chunk at a time."""
    for start in range(0, len(frame), COPY_CHUNK_ROWS):
        chunk = frame.iloc[start:start + COPY_CHUNK_ROWS]
        records = [dict(zip(chunk.columns, row, strict=True)) for row in _python_rows(chunk)]
        if records:
            connection.execute(table.insert(), records)


def _python_rows(frame: pd.DataFrame) -> Iterator[tuple]:
    """Plain Python rows with ``None`` for every kind of missing value."""
    converted = {
        name: frame[name].astype(object).where(frame[name].notna(), None) for name in frame.columns
    }
    return zip(*converted.values(), strict=True)


def create_stage(connection: Connection, table: Table, columns: Sequence[str],
                 prefix: str = "stage") -> Table:
    """An empty temporary table with the given columns of ``table``, private to this session
    (one left by an earlier load of the session is dropped first)."""
    stage = Table(
        f"{prefix}_{table.name}",
        MetaData(),
        *(Column(c, table.c[c].type) for c in columns),
        prefixes=["TEMPORARY"],
    )
    dialect = connection.dialect
    connection.exec_driver_sql(sql.drop_table(dialect, stage.name, if_exists=True))
    if dialect.name == "postgresql":
        connection.exec_driver_sql(sql.create_stage(dialect, table, stage, columns))
    else:
        stage.create(connection)
    return stage


def fill(connection: Connection, stage: Table, frame: pd.DataFrame,
         rows: pa.Table | None = None, natural_key: Sequence[str] = ()) -> None:
    """Fill a stage: by ``COPY`` of ``rows`` on PostgreSQL, by inserts of ``frame`` on SQLite."""
    if connection.dialect.name == "postgresql":
        copy_rows(connection, stage, arrow_rows(frame) if rows is None else rows, natural_key)
        connection.exec_driver_sql(sql.analyze(connection.dialect, stage.name))
    else:
        insert_rows(connection, stage, frame)


def drop(connection: Connection, stage: Table) -> None:
    connection.exec_driver_sql(sql.drop_table(connection.dialect, stage.name))


def execute(connection: Connection, statement_sql: str, params: dict[str, Any], *,
            partition_type: Any = None) -> int:
    """Run one of the load's statements with its bound values; the rows it touched."""
    statement = text(statement_sql)
    if "now" in params:
        statement = statement.bindparams(
            bindparam("now", type_=DateTime(timezone=True)), bindparam("run_id", type_=String())
        )
    if partition_type is not None:
        statement = statement.bindparams(bindparam("partition_value", type_=partition_type))
    return connection.execute(statement, params).rowcount
