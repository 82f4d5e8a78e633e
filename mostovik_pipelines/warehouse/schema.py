"""Conventions every warehouse table follows: natural-key uniqueness and load bookkeeping."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Column, DateTime, MetaData, String, Table, UniqueConstraint
from sqlalchemy.schema import SchemaItem

metadata = MetaData(
    naming_convention={
        "uq": "uq_%(table_name)s_natural_key",
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)

BOOKKEEPING_COLUMNS = ("loaded_by_run", "loaded_at", "changed_by_run", "changed_at")


def warehouse_table(name: str, *columns: SchemaItem, natural_key: Sequence[str]) -> Table:
    """A target table: the source's columns, a unique constraint on the natural key, and the
    bookkeeping of which run inserted the row and which run last changed it."""
    return Table(
        name,
        metadata,
        *columns,
        Column("loaded_by_run", String(64), nullable=False, comment="run that inserted the row"),
        Column("loaded_at", DateTime(timezone=True), nullable=False),
        Column("changed_by_run", String(64), nullable=False,
               comment="run that last changed the row's data"),
        Column("changed_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint(*natural_key),
    )


def data_columns(table: Table) -> list[str]:
    """The columns a source provides (everything but the load bookkeeping)."""
    return [c.name for c in table.columns if c.name not in BOOKKEEPING_COLUMNS]
