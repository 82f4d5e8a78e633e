"""One run per source and partition, whatever launched it (ADR-011's concurrency policy).

In the ADR's order of preference:

1. the business lock: the load of a partition holds a lock on (target table, partition) for its
   whole transaction (below);
2. the run-status check: before extract, a run looks in run storage for an older run of the same
   source and partition still in progress, and waits for it or stops
   (:mod:`mostovik_pipelines.platform.in_flight`);
3. unique constraints on every natural key (the warehouse migrations);
4. safe re-execution: every load is an idempotent upsert.

The run queue's limit in ``dagster.yaml`` adds a fifth layer for queued runs only.

The business lock
-----------------

Dagster's run queue does not see runs started by ``dagster job execute``, so the lock lives in
the load transaction itself. On PostgreSQL it is a transaction-scoped advisory lock: released
at commit, at rollback, and when the process holding it dies, so a killed run never leaves a
stale lock behind. Loads of different partitions take different locks and never wait for each
other. SQLite has one writer at a time; its load transactions start with ``BEGIN IMMEDIATE``
(see :mod:`mostovik_pipelines.resources.warehouse`), which is the same guarantee, coarser.
"""

from __future__ import annotations

import zlib

from sqlalchemy import Connection, text


def partition_lock_keys(table: str, partition_key: str) -> tuple[int, int]:
    """Two stable signed 32-bit keys for ``pg_advisory_xact_lock(int, int)``."""
    return _signed32(zlib.crc32(table.encode())), _signed32(zlib.crc32(partition_key.encode()))


def lock_partition(connection: Connection, table: str, partition_key: str) -> None:
    """Block until this transaction holds the lock of ``table``'s ``partition_key``."""
    if connection.dialect.name != "postgresql":
        return
    table_key, partition_lock = partition_lock_keys(table, partition_key)
    connection.execute(
        text("SELECT pg_advisory_xact_lock(:table_key, :partition_key)"),
        {"table_key": table_key, "partition_key": partition_lock},
    )


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= (1 << 31) else value
