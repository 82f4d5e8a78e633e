"""Reading the warehouse the way an operator checks it: rows, in key order."""

from __future__ import annotations

from sqlalchemy import Engine, MetaData, Table, UniqueConstraint, create_engine, select, text

import mostovik_pipelines.sources  # noqa: F401 - registers the tables
from mostovik_pipelines.framework.quality.quarantine import quarantined_rows
from mostovik_pipelines.warehouse.schema import metadata


def create_tables(url: str, tables: MetaData) -> None:
    """Create a test's own tables (the warehouse's come from the migrations)."""
    engine = create_engine(url)
    try:
        tables.create_all(engine)
    finally:
        engine.dispose()


def table_rows(url: str, table: str | Table) -> list[dict]:
    """Rows typed as the table declares them (dates, exact decimals), in natural-key order; a
    table of the warehouse by name, any other by its definition."""
    declared = metadata.tables[table] if isinstance(table, str) else table
    key = next(c for c in declared.constraints if isinstance(c, UniqueConstraint))
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            result = connection.execute(select(declared).order_by(*key.columns))
            return [dict(row._mapping) for row in result]
    finally:
        engine.dispose()


def physical_snapshot(url: str, table: str, order_by: str = "partition_date, char_code") -> list:
    """Every row as stored, with its physical identity (PostgreSQL: ctid and xmin, which change
    whenever a row is rewritten; SQLite: rowid), so equal snapshots mean nothing was rewritten."""
    identity = "ctid::text, xmin::text" if url.startswith("postgresql") else "rowid"
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            result = connection.execute(
                text(f"SELECT {identity}, * FROM {table} ORDER BY {order_by}")
            )
            return [tuple(row) for row in result]
    finally:
        engine.dispose()


def quarantined_by_run(engine: Engine, run_id: str) -> list[dict]:
    """The rows a run quarantined, in payload order."""
    query = (select(quarantined_rows).where(quarantined_rows.c.run_id == run_id)
             .order_by(quarantined_rows.c.partition_key, quarantined_rows.c.row_number))
    with engine.connect() as connection:
        return [dict(row._mapping) for row in connection.execute(query)]
