"""The partition load: one transaction that makes the table hold what the source says.

:func:`load_partition` runs these statements, in this order, in one transaction, so that a
failure at any point leaves the partition, the ledger and the quarantine as they were:

1. ``pg_advisory_xact_lock(table, partition)``: the business lock (:mod:`.lock`). Two loads of
   one partition take turns; loads of other partitions never wait. SQLite's ``BEGIN
   IMMEDIATE`` is the same guarantee, coarser.
2. ``SELECT`` the partition's row of the ledger (:mod:`.ledger`): a payload fetched before the
   one the partition holds is refused (:class:`PartitionSuperseded`); the partition never goes
   back in time. A replace-partition payload of no rows is refused if the partition holds rows
   (one ``count(*)``): a source that answers with nothing is more likely broken than
   withdrawing what it published.
3. PostgreSQL: one ``SELECT`` sets the run id the bookkeeping column defaults read and the flag
   that tells the table's guard trigger the loader is writing, takes the table's writes lock
   (shared; exclusive when rows may move in from other partitions), reads ``now()`` (every
   bookkeeping timestamp of the load) and whether the guard trigger is enabled.
4. PostgreSQL, no statement: the frame is hashed; if the digest equals the one the last load
   recorded, the rows are exactly what that load wrote and the trigger has seen no other
   write since: the load returns "all unchanged" (an unchanged re-run: rates, deliveries),
   noting in the ledger the payload and parser it came from when they are new.
5. PostgreSQL, a partition that holds nothing yet (``SELECT EXISTS``; for a sync's page group,
   a probe of 16 of its keys in the whole table): ``SAVEPOINT``, ``COPY`` the rows straight
   into the table in key order, bookkeeping from the column defaults, ``RELEASE``. Every row
   is new, so nothing needs comparing (a first load; a first sync's page groups). If a key is
   held in another partition the unique index refuses the ``COPY``: ``ROLLBACK TO SAVEPOINT``
   and step 6 decides.
6. Otherwise the stage (:mod:`.sql`, each statement named for what it does):
   ``CREATE TEMPORARY TABLE`` shaped as the table; ``COPY`` the rows in (SQLite: inserts);
   ``ANALYZE`` it; with policy ``reject``, take out and report the rows whose keys another
   partition holds (:attr:`LoadCounts.held_elsewhere`, quarantined by the caller); one
   ``census_of_stage`` join counts the staged keys already stored, older versions, new
   tombstones and rows moving in (those forget the other partitions' digests); then
   ``update_changed_rows`` rewrites only rows that differ (``IS DISTINCT FROM``; in
   merge-by-version only a newer version wins), ``insert_new_rows`` adds new keys, and in
   replace-partition mode ``delete_vanished_rows`` deletes the partition's rows the source no
   longer sends, except those of rows rejected this time (:class:`KeptRows`). The census skips
   the update when no key is stored and the insert when every key is.
7. ``INSERT ... ON CONFLICT UPDATE`` the ledger: row count, digest (none on SQLite, none when
   rows were kept or held elsewhere: the table then holds something else than the frame), the
   run, the fetch time, the partition key and the landed payload's hash. A page group of a sync
   records nothing here: the ledger describes whole partitions, and the step records a window
   with its last page group (``steps/load.py``).
8. ``within_transaction``: what must commit with the rows (the quarantine, a sync's progress
   checkpoint); the fence: the run still holds its claim (:func:`.runs.claims.ensure_run_claim`),
   else :class:`.errors.RunClaimLost` rolls it all back; then ``COMMIT``. Checked once, just
   before the commit: nothing the load does is visible before it, so an earlier check only
   cost a round trip per partition.

:func:`confirm_unchanged` is the same transaction for a partition whose landed payload is the
one its stored rows came from, by the same parser (:mod:`..steps.unchanged`): steps 1-3, the
ledger's line confirmed under the locks, step 8; no row is sent.

Merge-by-version never deletes by absence: deletions arrive as tombstone rows. Unchanged rows
are never rewritten, so a re-run writes no tuple and keeps every row's bookkeeping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Connection, Engine, Table, bindparam, func, select, text

from mostovik_pipelines.core.errors import ConfigurationError, DataValidationError
from mostovik_pipelines.core.load_target import KeyHeldElsewhere, LoadMode, LoadTarget
from mostovik_pipelines.framework.load import sql, transfer
from mostovik_pipelines.framework.load.ledger import (
    LastLoad,
    begin_postgresql_load,
    forget_digests,
    last_load,
    note_payload,
    record_load,
    rows_digest,
)
from mostovik_pipelines.framework.load.lock import lock_partition
from mostovik_pipelines.platform.claims import ensure_run_claim
from mostovik_pipelines.warehouse.schema import BOOKKEEPING_COLUMNS

KEY_PROBES = 16
"""Natural keys of a page group looked up before copying it straight into the table."""


@dataclass(frozen=True)
class LoadCounts:
    """What one load did to the table; these figures go into the materialisation metadata."""

    inserted: int
    updated: int
    unchanged: int
    deleted: int
    ignored_older: int = 0
    """Merge-by-version: rows not written because the table holds a newer version."""
    tombstoned: int = 0
    """Merge-by-version: records this load marked deleted."""
    held_elsewhere: tuple[dict, ...] = ()
    """Rows not loaded because their key is stored under another partition value (policy
    ``reject``): each the row's natural key and ``held_by``, the value holding it."""
    loaded_at: datetime | None = None
    """The load transaction's time: every row it wrote carries it as ``changed_at`` (the
    ``rows_in_partition`` check reads the rows written since)."""

    @property
    def written(self) -> int:
        return self.inserted + self.updated + self.deleted

    def as_dict(self, merge: bool = False) -> dict[str, int]:
        """The counts a load reports (its materialisation's metadata); ``merge`` adds those of
        merge-by-version."""
        return {name: getattr(self, name) for name in self.figures(merge)}

    @staticmethod
    def figures(merge: bool = False) -> tuple[str, ...]:
        base = ("inserted", "updated", "unchanged", "deleted")
        return (*base, "ignored_older", "tombstoned") if merge else base


class PartitionSuperseded(Exception):
    """The partition already holds data fetched later than the payload being loaded (a replayed
    output of an old run, a duplicate that fetched earlier but reached the load later): the load
    is refused, so a partition never goes back in time."""


@dataclass(frozen=True)
class KeptRows:
    """Stored rows a replace-partition load must not delete although the frame lacks them: the
    rows whose incoming version was rejected (quarantined). A rejected row is not an absent
    row, so what is stored under its key stays until a readable version arrives."""

    keys: pd.DataFrame
    """Natural keys of rejected rows, typed as the table stores them."""
    all_vanished: bool = False
    """A rejected row's key could not be read: no stored row is deleted by absence at all."""

    @property
    def any(self) -> bool:
        return self.all_vanished or not self.keys.empty


def load_partition(
    engine: Engine, target: LoadTarget, frame: pd.DataFrame, partition_key: str, run_id: str,
    within_transaction: Callable[[Connection, LoadCounts], None] | None = None, *,
    fetched_at: datetime | None = None, kept: KeptRows | None = None,
    whole_partition: bool = True, payload_hash: str | None = None,
    parser_version: str | None = None,
) -> LoadCounts:
    """Make ``target`` hold exactly ``frame`` for the partition, in one transaction, keeping the
    ``kept`` rows; ``within_transaction`` writes what must commit with it (the partition's
    quarantine, a sync's progress checkpoint), given the load's counts. ``fetched_at`` is when
    the frame's payload was fetched: if the partition already holds a later fetch,
    :class:`PartitionSuperseded` is raised and nothing is written; ``payload_hash`` names that
    payload in the ledger, ``parser_version`` the code that made the frame of it.

    ``whole_partition=False`` loads one page of a partition (merge-by-version only): no digest
    is trusted or recorded and the ledger keeps the partition's last whole load."""
    if list(frame.columns) != list(target.columns):  # validated frames already are
        frame = frame[target.columns]
    table_name = target.table.name
    scope = target.partition_scope(partition_key)
    kept = kept if kept is not None and kept.any else None
    if not whole_partition and target.mode is not LoadMode.MERGE_BY_VERSION:
        raise ValueError(f"{table_name}: only merge-by-version loads a partition page by page")
    with engine.begin() as connection:
        lock_partition(connection, table_name, scope)  # 1
        previous = last_load(connection, table_name, scope)  # 2
        if whole_partition:
            _refuse_older_payload(previous, fetched_at, target, partition_key)
            _refuse_emptying(connection, target, frame, partition_key, kept)
        counts, rows, digest = None, None, None
        if connection.dialect.name == "postgresql":
            session = begin_postgresql_load(  # 3
                connection, table_name, run_id,
                exclusive=target.partition_column not in target.natural_key)
            now = session.now
            rows = transfer.arrow_rows(frame)
            # A load that keeps rejected rows' stored versions leaves more than its rows: no
            # digest describes that, so none is recorded or trusted.
            if session.digests_guarded and kept is None and whole_partition:
                digest = rows_digest(rows, target.mode)
            if digest is not None and previous is not None and digest == previous.content_digest:
                # 4: exactly what the last load wrote. Nothing to write but, when they are new,
                # the payload and parser the rows came from (the run and fetch the ledger
                # records are as good a bound as this one, for these very rows).
                if (previous.payload_hash, previous.parser_version) != (
                        payload_hash, parser_version):
                    note_payload(connection, table_name, scope, payload_hash, parser_version)
                return _finish(connection, within_transaction, run_id, LoadCounts(
                    inserted=0, updated=0, unchanged=rows.num_rows, deleted=0, loaded_at=now))
            if _looks_new(connection, target, rows, partition_key, whole_partition):
                counts = _copy_straight_in(connection, target, rows)  # 5
        else:
            now = datetime.now(UTC)
        if counts is None:
            counts = _load_through_stage(connection, target, frame, rows, partition_key,  # 6
                                         {"run_id": run_id, "now": now}, kept)
        if whole_partition:
            # Rows left out because another partition holds their keys: the partition holds
            # less than the frame, so no digest describes it, and the next load of the same
            # rows must find them held again (for its quarantine).
            record_load(connection, table_name, scope, len(frame),  # 7
                        None if counts.held_elsewhere else digest, run_id, now, fetched_at,
                        loaded_partition_key=partition_key, payload_hash=payload_hash,
                        parser_version=parser_version)
        return _finish(connection, within_transaction, run_id,  # 8
                       dataclasses.replace(counts, loaded_at=now))


def confirm_unchanged(
    engine: Engine, target: LoadTarget, partition_key: str, run_id: str, *, content_digest: str,
    payload_hash: str, parser_version: str, fetched_at: datetime | None,
    within_transaction: Callable[[Connection, LoadCounts], None] | None = None,
) -> LoadCounts | None:
    """The load of a partition whose landed payload (``payload_hash``) the ledger says its
    stored rows came from, by the same parser, with their digest ``content_digest``: under the
    partition's locks the ledger still says so and the table's guard trigger still vouches for
    the digest, so the table holds exactly what a load of the payload would make it hold.
    Nothing is written; ``within_transaction`` runs and the fence is checked before the commit,
    as for any load. None, and nothing done, when the ledger says otherwise by then (another
    load, a write by hand): the caller loads the payload's rows as usual."""
    table_name = target.table.name
    scope = target.partition_scope(partition_key)
    with engine.begin() as connection:
        if connection.dialect.name != "postgresql":
            return None
        lock_partition(connection, table_name, scope)  # 1
        previous = last_load(connection, table_name, scope)  # 2
        _refuse_older_payload(previous, fetched_at, target, partition_key)
        session = begin_postgresql_load(  # 3
            connection, table_name, run_id,
            exclusive=target.partition_column not in target.natural_key)
        if (not session.digests_guarded or previous is None
                or previous.content_digest != content_digest
                or previous.payload_hash != payload_hash
                or previous.parser_version != parser_version):
            return None  # nothing was written: the transaction ends as it began
        return _finish(connection, within_transaction, run_id, LoadCounts(  # 8
            inserted=0, updated=0, unchanged=previous.row_count, deleted=0,
            loaded_at=session.now))


def _finish(connection: Connection,
            within_transaction: Callable[[Connection, LoadCounts], None] | None,
            run_id: str, counts: LoadCounts) -> LoadCounts:
    if within_transaction is not None:
        within_transaction(connection, counts)
    ensure_run_claim(run_id)  # the fence, just before the commit
    return counts


def _refuse_older_payload(previous: LastLoad | None, fetched_at: datetime | None,
                          target: LoadTarget, partition_key: str) -> None:
    if previous is None or previous.fetched_at is None or fetched_at is None:
        return
    if fetched_at < previous.fetched_at:
        raise PartitionSuperseded(
            f"{target.table.name} [{partition_key}] holds data fetched at "
            f"{previous.fetched_at.isoformat()} (run {previous.loaded_by_run}), later than this "
            f"payload, fetched at {fetched_at.isoformat()}: not loaded"
        )


def _refuse_emptying(connection: Connection, target: LoadTarget, frame: pd.DataFrame,
                     partition_key: str, kept: KeptRows | None) -> None:
    """A payload of no rows (legitimate for a source that declares ``empty_payload_is_valid``:
    a holiday) never empties a partition that holds rows."""
    if target.mode is not LoadMode.REPLACE_PARTITION or len(frame) or kept is not None:
        return
    column = target.table.c[target.partition_column]
    stored = connection.execute(select(func.count()).select_from(target.table).where(
        column == target.partition_value(partition_key))).scalar_one()
    if stored:
        raise DataValidationError(
            f"{target.table.name} [{partition_key}]: the source sent no rows for a partition "
            f"that holds {stored}; nothing deleted. If it really withdrew them, delete them "
            "in the warehouse and run the partition again")


def _looks_new(connection: Connection, target: LoadTarget, rows: pa.Table, partition_key: str,
               whole_partition: bool) -> bool:
    """Whether every row is likely new: a whole partition that holds no row, or a page group
    none of whose probed keys (up to ``KEY_PROBES``, spread over it) the table holds in any
    partition: a first sync's group holds none, a re-sync's all. A guess only: a key the
    probes miss makes the direct ``COPY`` fail on the unique key, and the stage decides."""
    if whole_partition:
        partition_type = target.table.c[target.partition_column].type
        statement = text(sql.partition_holds_rows(
            connection.dialect, target.table, target.partition_column,
        )).bindparams(bindparam("partition_value", type_=partition_type))
        return not connection.execute(
            statement, {"partition_value": target.partition_value(partition_key)}).scalar_one()
    if len(target.natural_key) != 1:
        return False
    key = rows.column(target.natural_key[0])
    if key.null_count or not (pa.types.is_integer(key.type) or pa.types.is_string(key.type)
                              or pa.types.is_large_string(key.type)):
        return False
    if not len(key):
        return True
    probes = key.take(np.unique(np.linspace(0, len(key) - 1, KEY_PROBES, dtype=np.int64)))
    return not connection.exec_driver_sql(
        sql.any_key_stored(connection.dialect, target.table, target.natural_key),
        (probes.to_pylist(),)).scalar_one()


def _copy_straight_in(connection: Connection, target: LoadTarget, rows: pa.Table
                      ) -> LoadCounts | None:
    """Copy straight into the table under a savepoint: every row new, a tombstone row a new
    tombstone, as the census would count them; None, and nothing written, if a natural key
    exists in another partition."""
    try:
        with connection.begin_nested():
            transfer.copy_rows(connection, target.table, rows, target.natural_key)
    except psycopg.errors.UniqueViolation:
        return None
    except psycopg.errors.NotNullViolation as violation:
        if violation.diag.column_name in BOOKKEEPING_COLUMNS:
            raise ConfigurationError(
                f"table {target.table.name} has no default for {violation.diag.column_name}: "
                "its migration did not apply the PostgreSQL conventions (bookkeeping defaults, "
                'natural-key text in the "C" collation, the digest trigger). Write the '
                "migration with `mostovik new-source NAME --migration-only`, which freezes them "
                "in it as POSTGRESQL_CONVENTIONS (docs/adding-a-source.md)") from violation
        raise
    tombstoned = 0
    if target.mode is LoadMode.MERGE_BY_VERSION and target.tombstone_column:
        tombstones = pc.fill_null(rows.column(target.tombstone_column), False)
        tombstoned = pc.sum(tombstones).as_py() or 0
    return LoadCounts(inserted=rows.num_rows, updated=0, unchanged=0, deleted=0,
                      tombstoned=tombstoned)


def _load_through_stage(connection: Connection, target: LoadTarget, frame: pd.DataFrame,
                        rows: pa.Table | None, partition_key: str,
                        bookkeeping: dict[str, Any], kept: KeptRows | None) -> LoadCounts:
    stage = transfer.create_stage(connection, target.table, target.columns)
    transfer.fill(connection, stage, frame, rows, target.natural_key)
    return _merge_from_stage(connection, target, stage, len(frame), partition_key,
                             bookkeeping, kept)


def _merge_from_stage(connection: Connection, target: LoadTarget, stage: Table, staged: int,
                      partition_key: str, bookkeeping: dict[str, Any],
                      kept: KeptRows | None) -> LoadCounts:
    """The statements of step 6 after the stage is filled; the stage is dropped afterwards."""
    dialect = connection.dialect
    held_elsewhere: tuple[dict, ...] = ()
    moves = target.partition_column not in target.natural_key
    if moves and target.key_held_elsewhere is KeyHeldElsewhere.REJECT:
        held_elsewhere = _unstage_keys_held_elsewhere(connection, target, stage)
        moves = False
    versioned = target.mode is LoadMode.MERGE_BY_VERSION and target.version_column
    census = connection.execute(text(sql.census_of_stage(
        dialect, target.table, stage, target.natural_key,
        partition_column=target.partition_column if moves else None,
        version_column=target.version_column if versioned else None,
        tombstone_column=target.tombstone_column if versioned else None,
    ))).mappings().one()
    if moves and census["moving_in"]:
        # The update below moves rows out of other partitions: their digests no longer
        # describe them. (Such a load holds the table's writes lock exclusively: no other
        # load of the table is in flight to record a digest this check cannot see.)
        forget_digests(connection, target.table.name)
    ignored_older = int(census["older"]) if versioned else 0
    tombstoned = int(census["new_tombstones"]) if versioned and target.tombstone_column else 0
    updated = 0 if not census["stored"] else transfer.execute(connection, sql.update_changed_rows(
        dialect, target.table, stage, target.natural_key, target.columns, target.version_column
    ), bookkeeping)
    inserted = 0 if census["stored"] == census["staged"] else transfer.execute(
        connection, sql.insert_new_rows(
            dialect, target.table, stage, target.natural_key, target.columns), bookkeeping)
    deleted = 0
    if target.mode is LoadMode.REPLACE_PARTITION and not (kept and kept.all_vanished):
        kept_keys = None
        if kept is not None and not kept.keys.empty:
            kept_keys = transfer.create_stage(connection, target.table, target.natural_key,
                                            prefix="kept")
            transfer.fill(connection, kept_keys, kept.keys[list(target.natural_key)])
        deleted = transfer.execute(connection, sql.delete_vanished_rows(
            dialect, target.table, stage, target.natural_key, target.partition_column,
            kept=kept_keys,
        ), {"partition_value": target.partition_value(partition_key)},
            partition_type=target.table.c[target.partition_column].type)
        if kept_keys is not None:
            transfer.drop(connection, kept_keys)
    transfer.drop(connection, stage)
    return LoadCounts(
        inserted=inserted, updated=updated, deleted=deleted, ignored_older=ignored_older,
        unchanged=staged - inserted - updated - ignored_older - len(held_elsewhere),
        tombstoned=tombstoned, held_elsewhere=held_elsewhere,
    )


def _unstage_keys_held_elsewhere(connection: Connection, target: LoadTarget,
                                 stage: Table) -> tuple[dict, ...]:
    """Take out of the stage the rows whose keys another partition value holds, and say which
    (policy ``reject``): they go to quarantine, the stored rows stay where they are."""
    dialect = connection.dialect
    held = connection.execute(text(sql.select_keys_held_elsewhere(
        dialect, target.table, stage, target.natural_key, target.partition_column)))
    rows = tuple({**dict(zip(target.natural_key, row[:-1], strict=True)), "held_by": row[-1]}
                 for row in held)
    if rows:
        connection.execute(text(sql.delete_staged_keys_held_elsewhere(
            dialect, target.table, stage, target.natural_key, target.partition_column)))
    return rows
