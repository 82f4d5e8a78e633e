"""Quarantine: rows a source sent that could not be loaded, kept with the reason.

Nothing the source sent is silently dropped. A partition's quarantine is replaced on every load
of that partition, in the load's own transaction, exactly like its data: re-runs never pile up
stale rejections, and after a clean re-load the partition's quarantine is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import (
    Column,
    Connection,
    DateTime,
    Engine,
    Index,
    Integer,
    String,
    Table,
    Text,
    delete,
    func,
    insert,
    select,
)

from mostovik_pipelines.framework.load.lock import lock_partition
from mostovik_pipelines.framework.spec import RejectedRow
from mostovik_pipelines.warehouse.schema import metadata

quarantined_rows = Table(
    "quarantined_rows",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("source", String(128), nullable=False),
    Column("partition_key", String(255), nullable=False),
    Column("run_id", String(64), nullable=False, comment="run that rejected the row"),
    Column("row_number", Integer, nullable=False, comment="1-based position in the payload"),
    Column("raw_row", Text, nullable=False, comment="the row as the source sent it"),
    Column("reason", Text, nullable=False),
    Column("quarantined_at", DateTime(timezone=True), nullable=False),
    Index("ix_quarantined_rows_source_partition", "source", "partition_key"),
    Index("ix_quarantined_rows_run_id", "run_id"),
)


def quarantined_count(connection: Connection, source: str, partition_key: str) -> int:
    """How many of the partition's rows are quarantined."""
    return connection.execute(select(func.count()).select_from(quarantined_rows).where(
        quarantined_rows.c.source == source,
        quarantined_rows.c.partition_key == partition_key)).scalar_one()


def replace_quarantine(
    bind: Engine | Connection, source: str, partition_key: str, run_id: str,
    rejected: Sequence[RejectedRow], *, append: bool = False,
) -> None:
    """Make the partition's quarantine hold exactly ``rejected`` (or add them to it, for the
    later pages of a paged partition, ``append``): in the caller's transaction
    when given a connection (the load's, so data and quarantine commit together), else in a
    transaction of its own. Either way it takes the lock of the partition's quarantine, so two
    runs replacing it at once take turns."""
    if isinstance(bind, Engine):
        with bind.begin() as connection:
            _replace_quarantine(connection, source, partition_key, run_id, rejected, append)
    else:
        _replace_quarantine(bind, source, partition_key, run_id, rejected, append)


def _replace_quarantine(
    connection: Connection, source: str, partition_key: str, run_id: str,
    rejected: Sequence[RejectedRow], append: bool,
) -> None:
    now = datetime.now(UTC)
    lock_partition(connection, quarantined_rows.name, f"{source}/{partition_key}")
    if not append:
        connection.execute(delete(quarantined_rows).where(
            quarantined_rows.c.source == source,
            quarantined_rows.c.partition_key == partition_key,
        ))
    if rejected:
        connection.execute(insert(quarantined_rows), [
            {"source": source, "partition_key": partition_key, "run_id": run_id,
             "row_number": row.row_number, "raw_row": row.raw, "reason": row.reason,
             "quarantined_at": now}
            for row in rejected
        ])

