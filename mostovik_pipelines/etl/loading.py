"""The partition load: one transaction that makes the table hold what the source says.

Steps, all in one transaction so that a failure at any point leaves the partition as it was:

1. take the partition's business lock (:mod:`.locking`);
2. stage the incoming rows in a temporary table (``COPY`` on PostgreSQL);
3. update rows whose data changed, and only those;
4. insert rows whose natural key is new;
5. replace-partition mode only: delete the partition's rows the source no longer has.

Merge-by-version mode skips step 5 and lets a row win only with a newer version; deletions in
that mode arrive as tombstone rows (a flag column of the source), never by absence.

Every load ends by recording the partition's row count and a digest of its rows in the ledger
of partition loads (:mod:`.load_ledger`).

On PostgreSQL three shortcuts keep large partitions cheap without changing what a load does:

* a re-load whose rows hash to the digest the last load recorded returns "all unchanged" at
  once: the table's trigger has forgotten that digest if anything but the loader wrote it since;
* otherwise the partition's stored rows are read back (``COPY ... TO STDOUT``) and compared
  with the frame in Arrow; a row whose every value reads back equal is unchanged and is not
  staged at all. Only rows that may differ go through the staged SQL above, which decides
  exactly (``IS DISTINCT FROM``, version guard). Merge-by-version reads back only keys and
  versions: a row that is not newer never wins anyway;
* when the partition holds no rows yet, the frame is copied straight into the table under a
  savepoint (bookkeeping from the column defaults); if any natural key already exists
  elsewhere the savepoint is rolled back and the staged path runs instead. A sync's page
  group is copied the same way when a few of its keys, probed, are not in the table (a first
  sync: every key new), which spares the stage, its census and the insert that reads it.

Rows reach the server by ``COPY`` a chunk at a time, so memory stays bounded by the frame plus
one chunk: in PostgreSQL's binary format when every column's Arrow type matches its SQL type
exactly (encoded by ``pgpq``), else through Arrow's CSV writer.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import numpy as np
import pandas as pd
import pgpq
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
from sqlalchemy import (
    CHAR,
    REAL,
    BigInteger,
    Boolean,
    Column,
    Connection,
    Date,
    DateTime,
    Engine,
    Enum,
    Float,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    func,
    select,
    text,
)
from sqlalchemy.sql.expression import bindparam

from mostovik_pipelines.etl import loading_sql
from mostovik_pipelines.etl.errors import ConfigurationError, DataValidationError
from mostovik_pipelines.etl.load_ledger import (
    LastLoad,
    PostgresqlLoad,
    begin_postgresql_load,
    forget_digests,
    last_load,
    record_load,
    rows_digest,
)
from mostovik_pipelines.etl.load_target import KeyHeldElsewhere, LoadMode, LoadTarget
from mostovik_pipelines.etl.locking import lock_partition
from mostovik_pipelines.warehouse.schema import BOOKKEEPING_COLUMNS
from mostovik_pipelines.warehouse.types import ExactDecimal

COPY_CHUNK_ROWS = 50_000
"""Rows serialised per ``COPY`` write (and per bulk insert on SQLite)."""
KEY_PROBES = 16
"""Natural keys of a page group looked up before copying it straight into the table."""
READ_BACK_BATCH_BYTES = 1 << 20
"""Read-back text parsed and compared at a time (with its share of the frame): bigger batches
save little time and cost memory the allocator keeps."""


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
    whole_partition: bool = True,
) -> LoadCounts:
    """Make ``target`` hold exactly ``frame`` for the partition, in one transaction, keeping the
    ``kept`` rows; ``within_transaction`` writes what must commit with it (the partition's
    quarantine, a sync's progress checkpoint), given the load's counts. ``fetched_at`` is when
    the frame's payload was fetched: if the partition already holds a later fetch,
    :class:`PartitionSuperseded` is raised and nothing is written.

    ``whole_partition=False`` loads one page of a partition (merge-by-version only): no digest
    is trusted or recorded and the ledger keeps the partition's last whole load."""
    frame = frame[target.columns]
    table_name = target.table.name
    scope = target.partition_scope(partition_key)
    kept = kept if kept is not None and kept.any else None
    if not whole_partition and target.mode is not LoadMode.MERGE_BY_VERSION:
        raise ValueError(f"{table_name}: only merge-by-version loads a partition page by page")
    with engine.begin() as connection:
        lock_partition(connection, table_name, scope)
        previous = last_load(connection, table_name, scope)
        if whole_partition:
            _refuse_older_payload(previous, fetched_at, target, partition_key)
            _refuse_emptying(connection, target, frame, partition_key, kept)
        if connection.dialect.name == "postgresql":
            session = begin_postgresql_load(
                connection, table_name, run_id,
                exclusive=target.partition_column not in target.natural_key)
            rows = _arrow_rows(frame)
            # A load that keeps rejected rows' stored versions leaves more than its rows: no
            # digest describes that, so none is recorded or trusted.
            digest = (rows_digest(rows, target.mode)
                      if session.digests_guarded and kept is None and whole_partition else None)
            if digest is not None and previous is not None and digest == previous.content_digest:
                # Exactly what the last load wrote: nothing to write, not even the ledger (the
                # fetch it records is as good a bound as this one, for these very rows).
                counts = LoadCounts(inserted=0, updated=0, unchanged=rows.num_rows, deleted=0)
            else:
                counts = _load_postgresql(connection, target, rows, partition_key, session,
                                          {"run_id": run_id, "now": session.now}, kept,
                                          compare_stored=whole_partition)
                if whole_partition:
                    # Rows left out because another partition holds their keys: the partition
                    # holds less than the frame, so no digest describes it, and the next load
                    # of the same rows must find them held again (for its quarantine).
                    record_load(connection, table_name, scope, rows.num_rows,
                                None if counts.held_elsewhere else digest,
                                run_id, session.now, fetched_at)
        else:
            now = datetime.now(UTC)
            stage = _create_stage(connection, target.table, target.columns)
            _insert_into_stage(connection, stage, frame)
            counts = _merge_stage(connection, target, stage, len(frame), partition_key,
                                  {"run_id": run_id, "now": now}, kept=kept)
            if whole_partition:
                record_load(connection, table_name, scope, len(frame), None, run_id, now,
                            fetched_at)
        if within_transaction is not None:
            within_transaction(connection, counts)
    return counts


def _refuse_emptying(connection: Connection, target: LoadTarget, frame: pd.DataFrame,
                     partition_key: str, kept: KeptRows | None) -> None:
    """A payload of no rows (legitimate for a source that declares ``empty_payload_is_valid``:
    a holiday) never empties a partition that holds rows: a source that published rows and now
    answers with none is more likely broken for a moment than withdrawing what it published."""
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


def _load_postgresql(connection: Connection, target: LoadTarget, rows: pa.Table,
                     partition_key: str, session: PostgresqlLoad,
                     bookkeeping: dict[str, Any], kept: KeptRows | None, *,
                     compare_stored: bool = True) -> LoadCounts:
    partition_value = target.partition_value(partition_key)
    if not compare_stored and not _any_key_stored(connection, target, rows):
        # A page group of keys the table has never held (a first sync): every row is new.
        copied = _copy_into_empty_partition(connection, target, rows, None)
        if copied is not None:
            return copied
    if not (compare_stored and session.utf8 and _comparable_key(target, rows)):
        # Keys Arrow cannot match as the database does: stage everything, the SQL decides.
        pending, vanished = None, None
    else:
        order = _key_order(rows, target.natural_key)
        stored = _read_back(connection, target, rows, partition_value)
        first = next(stored, None)
        copied = (_copy_into_empty_partition(connection, target, rows, order)
                  if first is None else None)
        if copied is not None:
            return copied
        stored = itertools.chain([first] if first is not None else [], stored)
        maybe_changed, vanished = _compare_in_key_order(target, rows, order, stored)
        vanished = _without_kept(target, vanished, kept)
        pending = np.flatnonzero(maybe_changed)
    counts = LoadCounts(inserted=0, updated=0, unchanged=0, deleted=0)
    if vanished is None or len(pending):
        stage = _create_stage(connection, target.table, target.columns)
        _copy(connection, stage, rows, target.natural_key, only=pending)
        connection.exec_driver_sql(f"ANALYZE {_quote(connection, stage.name)}")
        staged = rows.num_rows if pending is None else len(pending)
        counts = _merge_stage(connection, target, stage, staged, partition_key,
                              bookkeeping, delete_vanished=vanished is None, kept=kept)
    deleted = counts.deleted
    if vanished is not None and vanished.num_rows:
        deleted = _delete_listed(connection, target, vanished, partition_value)
    return dataclasses.replace(
        counts, deleted=deleted,
        unchanged=(rows.num_rows - counts.inserted - counts.updated - counts.ignored_older
                   - len(counts.held_elsewhere)))


def _any_key_stored(connection: Connection, target: LoadTarget, rows: pa.Table) -> bool:
    """Whether the table holds some of the rows' natural keys, in any partition, judged by up
    to ``KEY_PROBES`` keys spread over the rows: a re-sync's page group holds them all, a first
    sync's none. A guess only: a key the probes miss makes the direct ``COPY`` fail on the
    unique key, and the staged path runs. True for a key of several columns or one Arrow
    cannot match exactly."""
    if len(target.natural_key) != 1 or not _comparable_key(target, rows):
        return True
    key = rows.column(target.natural_key[0])
    probes = key.take(np.unique(np.linspace(0, len(key) - 1, KEY_PROBES, dtype=np.int64)))
    return connection.exec_driver_sql(
        loading_sql.any_key_stored(connection.dialect, target.table, target.natural_key),
        (probes.to_pylist(),)).scalar_one()


def _tombstones(target: LoadTarget, rows: pa.Table) -> int:
    if target.mode is not LoadMode.MERGE_BY_VERSION or not target.tombstone_column:
        return 0
    return pc.sum(pc.fill_null(rows.column(target.tombstone_column), False)).as_py() or 0


def _merge_stage(connection: Connection, target: LoadTarget, stage: Table, staged: int,
                 partition_key: str, bookkeeping: dict[str, Any], *,
                 delete_vanished: bool = True, kept: KeptRows | None = None) -> LoadCounts:
    """Steps 3-5 against a filled stage; the stage is dropped afterwards."""
    columns = target.columns
    dialect = connection.dialect
    held_elsewhere: tuple[dict, ...] = ()
    moves = target.partition_column not in target.natural_key
    if moves and target.key_held_elsewhere is KeyHeldElsewhere.REJECT:
        held_elsewhere = _unstage_keys_held_elsewhere(connection, target, stage)
        moves = False
    versioned = target.mode is LoadMode.MERGE_BY_VERSION and target.version_column
    census = connection.execute(text(loading_sql.census_of_stage(
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
    # Neither statement can touch a row when no staged key is stored (a first sync's pages),
    # or when every one is (a re-sync): the census saves their join.
    updated = 0 if not census["stored"] else _execute(connection, loading_sql.update_changed_rows(
        dialect, target.table, stage, target.natural_key, columns, target.version_column
    ), bookkeeping)
    inserted = 0 if census["stored"] == census["staged"] else _execute(
        connection, loading_sql.insert_new_rows(
            dialect, target.table, stage, target.natural_key, columns), bookkeeping)
    deleted = 0
    if (delete_vanished and target.mode is LoadMode.REPLACE_PARTITION
            and not (kept and kept.all_vanished)):
        partition_column = target.table.c[target.partition_column]
        kept_keys = _stage_kept_keys(connection, target, kept)
        deleted = _execute(connection, loading_sql.delete_vanished_rows(
            dialect, target.table, stage, target.natural_key, target.partition_column,
            kept=kept_keys,
        ), {"partition_value": target.partition_value(partition_key)},
            partition_type=partition_column.type)
        if kept_keys is not None:
            connection.exec_driver_sql(f"DROP TABLE {_quote(connection, kept_keys.name)}")
    connection.exec_driver_sql(f"DROP TABLE {_quote(connection, stage.name)}")
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
    held = connection.execute(text(loading_sql.select_keys_held_elsewhere(
        dialect, target.table, stage, target.natural_key, target.partition_column)))
    rows = tuple({**dict(zip(target.natural_key, row[:-1], strict=True)), "held_by": row[-1]}
                 for row in held)
    if rows:
        connection.execute(text(loading_sql.delete_staged_keys_held_elsewhere(
            dialect, target.table, stage, target.natural_key, target.partition_column)))
    return rows


def _stage_kept_keys(connection: Connection, target: LoadTarget,
                     kept: KeptRows | None) -> Table | None:
    """A temporary table of the natural keys whose stored rows stay (rejected rows' keys)."""
    if kept is None or kept.keys.empty:
        return None
    keys = _create_stage(connection, target.table, target.natural_key, prefix="kept")
    frame = kept.keys[list(target.natural_key)]
    if connection.dialect.name == "postgresql":
        _copy(connection, keys, _arrow_rows(frame))
    else:
        _insert_into_stage(connection, keys, frame)
    return keys


def _without_kept(target: LoadTarget, vanished: pa.Table, kept: KeptRows | None) -> pa.Table:
    """The vanished keys less those of rejected rows (none at all if a key was unreadable)."""
    if kept is None or not vanished.num_rows:
        return vanished
    if kept.all_vanished:
        return vanished.slice(0, 0)
    kept_keys = _arrow_rows(kept.keys[list(target.natural_key)])
    kept_text = _key_text(kept_keys, target.natural_key)
    return vanished.filter(pc.invert(pc.is_in(_key_text(vanished, target.natural_key),
                                              value_set=kept_text)))


def _create_stage(connection: Connection, table: Table, columns: Sequence[str],
                  prefix: str = "stage") -> Table:
    """A temporary table with the given columns of ``table``, private to this session. On
    PostgreSQL it copies the columns' exact types and collations from the table itself, so
    stage and table compare without a collation conflict."""
    stage = Table(
        f"{prefix}_{table.name}",
        MetaData(),
        *(Column(c, table.c[c].type) for c in columns),
        prefixes=["TEMPORARY"],
    )
    name = _quote(connection, stage.name)
    connection.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    if connection.dialect.name == "postgresql":
        selected = ", ".join(_quote(connection, c) for c in columns)
        connection.exec_driver_sql(
            f"CREATE TEMPORARY TABLE {name} AS SELECT {selected} "
            f"FROM {_quote(connection, table.name)} WITH NO DATA"
        )
    else:
        stage.create(connection)
    return stage


# --- PostgreSQL: COPY in and out through Arrow ------------------------------------------------


def _arrow_rows(frame: pd.DataFrame) -> pa.Table:
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


def _key_order(rows: pa.Table, natural_key: Sequence[str]) -> np.ndarray:
    """Row positions in natural-key order: Arrow orders text by its bytes, as the "C"
    collation does."""
    return pc.sort_indices(rows.select(list(natural_key)),
                           [(name, "ascending") for name in natural_key]).to_numpy()


def _copy(connection: Connection, table: Table, rows: pa.Table,
          natural_key: Sequence[str] = (), *, only: np.ndarray | None = None,
          order: np.ndarray | None = None) -> None:
    """``COPY`` the rows (``only`` those positions, if given) into ``table``, a chunk at a
    time, in natural-key order when a key is given: the key's index then grows at its right
    edge instead of splitting pages all over (twice as fast for a million rows). Rows go in
    PostgreSQL's binary format when every column's Arrow type is exactly the column's SQL type
    (the server then parses nothing: half the server's time of CSV), else as CSV."""
    positions = only
    if natural_key:
        if order is None:
            keys = rows.select(list(natural_key))
            order = _key_order(keys if only is None else keys.take(only), natural_key)
        positions = order if only is None else only[order]
    binary = _binary_rows(table, rows)
    cursor = connection.connection.driver_connection.cursor()
    if binary is not None:
        encoder = pgpq.ArrowToPostgresBinaryEncoder(binary.schema)
        statement = loading_sql.copy_into(connection.dialect, table.name, binary.column_names,
                                          binary=True)
        with cursor.copy(statement) as copy:
            copy.write(encoder.write_header())
            for chunk in _chunks(binary, positions):
                for batch in chunk.to_batches():
                    copy.write(encoder.write_batch(batch))
            copy.write(encoder.finish())
        return
    statement = loading_sql.copy_into(connection.dialect, table.name, rows.column_names)
    options = pa_csv.WriteOptions(include_header=False, quoting_style="needed")
    with cursor.copy(statement) as copy:
        for chunk in _chunks(rows, positions):
            # Strings are always quoted, so an unquoted empty field is NULL and "" the empty
            # string; tabs, newlines, backslashes and quotes are plain data.
            buffer = io.BytesIO()
            pa_csv.write_csv(chunk, buffer, options)
            copy.write(buffer.getbuffer())


def _chunks(rows: pa.Table, positions: np.ndarray | None) -> Iterator[pa.Table]:
    """The rows (at ``positions``, in that order, if given), a chunk at a time."""
    count = rows.num_rows if positions is None else len(positions)
    for start in range(0, count, COPY_CHUNK_ROWS):
        yield (rows.slice(start, COPY_CHUNK_ROWS) if positions is None
               else rows.take(positions[start:start + COPY_CHUNK_ROWS]))


def _binary_rows(table: Table, rows: pa.Table) -> pa.Table | None:
    """The rows with every column in the Arrow type whose binary ``COPY`` form is exactly its
    SQL type's, or None if any column has no such exact form (``Decimal`` objects sent as
    text, a value out of the column type's range, a type not listed here)."""
    columns = {}
    for name in rows.column_names:
        wanted = _binary_arrow_type(table.c[name].type, rows.schema.field(name).type)
        if wanted is None:
            return None
        try:
            columns[name] = rows.column(name).cast(wanted, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
    return pa.table(columns)


def _binary_arrow_type(sql_type: Any, arrow_type: pa.DataType) -> pa.DataType | None:
    if isinstance(sql_type, String):
        return arrow_type if _is_text(arrow_type) else None
    if isinstance(sql_type, ExactDecimal):
        return arrow_type if pa.types.is_decimal128(arrow_type) else None
    if isinstance(sql_type, Boolean):
        return arrow_type if pa.types.is_boolean(arrow_type) else None
    if isinstance(sql_type, Float):
        # double precision only, from float64 only: a float32 widened to float64 would store
        # 0.10000000149011612 where the CSV path stores its shortest text, 0.1.
        single = isinstance(sql_type, REAL) or (sql_type.precision or 53) <= 24
        return pa.float64() if pa.types.is_float64(arrow_type) and not single else None
    if isinstance(sql_type, Integer):
        width = (pa.int64() if isinstance(sql_type, BigInteger)
                 else pa.int16() if isinstance(sql_type, SmallInteger) else pa.int32())
        return width if pa.types.is_integer(arrow_type) else None
    if isinstance(sql_type, Date):
        return pa.date32() if pa.types.is_date(arrow_type) else None
    if isinstance(sql_type, DateTime) and pa.types.is_timestamp(arrow_type):
        if bool(sql_type.timezone) != (arrow_type.tz is not None):
            return None
        return pa.timestamp("us", arrow_type.tz)
    return None


def _copy_into_empty_partition(connection: Connection, target: LoadTarget, rows: pa.Table,
                               order: np.ndarray | None) -> LoadCounts | None:
    """Copy straight into the table (bookkeeping from the column defaults): every row new, a
    tombstone row a new tombstone, as the staged census counts them; None, and nothing
    written, if a natural key exists in another partition."""
    try:
        with connection.begin_nested():
            _copy(connection, target.table, rows, target.natural_key, order=order)
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
    return LoadCounts(inserted=rows.num_rows, updated=0, unchanged=0, deleted=0,
                      tombstoned=_tombstones(target, rows))


# Column types whose text PostgreSQL prints in exactly one way, so text equality is value
# equality: safe to match natural keys by, and to parse back into Arrow's own types.
_ARROW_TYPES = {Integer: pa.int64(), Float: pa.float64(), Date: pa.date32(), Boolean: pa.bool_()}


def _arrow_type(table: Table, name: str, frame_type: pa.DataType) -> pa.DataType | None:
    """The Arrow type to compare a column in, or None to compare it as text."""
    sql_type = table.c[name].type
    for sql_class, arrow_type in _ARROW_TYPES.items():
        if isinstance(sql_type, sql_class) and frame_type.equals(arrow_type):
            return arrow_type
    return None


def _comparable_key(target: LoadTarget, rows: pa.Table) -> bool:
    """Whether natural keys can be matched and ordered in Arrow exactly as the database matches
    and orders them (complete, and not floating point, whose NaN orders differently)."""
    for name in target.natural_key:
        frame_type = rows.schema.field(name).type
        if rows.column(name).null_count or pa.types.is_floating(frame_type):
            return False
        if isinstance(target.table.c[name].type, CHAR | Enum):
            return False  # blank-padded or enum text does not read back as it was sent
        if not (_arrow_type(target.table, name, frame_type) is not None or (
            isinstance(target.table.c[name].type, String) and _is_text(frame_type)
        )):
            return False
    return True


def _is_text(arrow_type: pa.DataType) -> bool:
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _read_back(connection: Connection, target: LoadTarget, rows: pa.Table,
               partition_value: Any) -> Iterator[pa.Table]:
    """The partition's stored rows in natural-key order, a batch at a time: every data column
    in replace-partition mode, natural key and version in merge-by-version mode. Values come
    back as the text PostgreSQL prints (ISO dates, shortest exact floats), parsed into Arrow's
    type where that type prints one way only."""
    if target.mode is LoadMode.MERGE_BY_VERSION and target.version_column:
        columns = [*target.natural_key, target.version_column]
    else:
        columns = list(rows.column_names)
    types = {name: _arrow_type(target.table, name, rows.schema.field(name).type) or pa.string()
             for name in columns}
    connection.execute(text(loading_sql.set_canonical_output()))
    cursor = connection.connection.driver_connection.cursor()
    text_keys = [k for k in target.natural_key if isinstance(target.table.c[k].type, String)]
    statement = loading_sql.copy_partition_out(
        connection.dialect, target.table, columns, target.partition_column,
        target.natural_key, text_keys,
    )
    received = _read_back_buffer()
    with cursor.copy(statement, (partition_value,)) as copy:
        # One COPY message is one row, so every batch of messages parses on its own.
        for block in copy:
            received.write(block)
            if received.tell() >= READ_BACK_BATCH_BYTES:
                yield _parse_csv(received, columns, types)
                received = _read_back_buffer()
    if received.tell() > 1:
        yield _parse_csv(received, columns, types)


def _read_back_buffer() -> io.BytesIO:
    """A buffer that starts with an empty line, which the CSV reader skips: the reader drops a
    byte-order mark at the very start of its input, and a stored value may begin with one."""
    buffer = io.BytesIO()
    buffer.write(b"\n")
    return buffer


def _compare_in_key_order(target: LoadTarget, rows: pa.Table, order: np.ndarray,
                          stored: Iterator[pa.Table]) -> tuple[np.ndarray, pa.Table]:
    """Walk the stored batches and the frame side by side in natural-key order, so memory holds
    one batch and its share of the frame, never the whole partition twice. Returns which frame
    rows may differ from what is stored (those are staged) and the keys of the stored rows the
    frame no longer has (replace-partition mode)."""
    maybe_changed = np.ones(rows.num_rows, dtype=bool)
    keys = rows.select(list(target.natural_key))

    def key_at(position: int) -> tuple:
        return tuple(column[order[position]].as_py() for column in keys.columns)

    vanished = []
    start = 0
    for batch in stored:
        last = tuple(batch.column(name)[batch.num_rows - 1].as_py()
                     for name in target.natural_key)
        end = bisect.bisect_right(range(rows.num_rows), last, lo=start, key=key_at)
        window = order[start:end]
        changed, gone = _compare(target, rows.select(batch.column_names).take(window), batch)
        maybe_changed[window] = changed.to_numpy(zero_copy_only=False)
        vanished.append(batch.filter(gone).select(list(target.natural_key)))
        start = end
        # Arrow's allocator keeps what a window freed for reuse; a thousand windows would
        # otherwise keep tens of megabytes the next window does not need.
        pa.default_memory_pool().release_unused()
    if not vanished:
        return maybe_changed, keys.schema.empty_table()
    return maybe_changed, pa.concat_tables(vanished)


def _parse_csv(received: io.BytesIO, columns: list[str], types: dict[str, pa.DataType]
               ) -> pa.Table:
    return pa_csv.read_csv(
        pa.BufferReader(received.getbuffer()),
        # One block for the whole batch: a row never straddles blocks, however long it is.
        read_options=pa_csv.ReadOptions(column_names=columns,
                                        block_size=max(received.tell(), 1 << 16)),
        parse_options=pa_csv.ParseOptions(newlines_in_values=True),
        convert_options=pa_csv.ConvertOptions(
            column_types=types, null_values=[""], strings_can_be_null=True,
            quoted_strings_can_be_null=False, true_values=["t"], false_values=["f"],
        ),
    )


def _compare(target: LoadTarget, rows: pa.Table, stored: pa.Table
             ) -> tuple[pa.Array, pa.Array]:
    """Which frame rows may differ from what is stored (those are staged), and which stored rows
    the frame no longer has. A row counts as unchanged only if every read-back value equals the
    frame's; anything uncertain is staged, and the SQL decides."""
    position = pc.index_in(_key_text(rows, target.natural_key),
                           value_set=_key_text(stored, target.natural_key))
    found = pc.is_valid(position)
    stored_at = pc.drop_null(position)
    unchanged = np.ones(len(stored_at), dtype=bool)
    candidates = rows if len(stored_at) == rows.num_rows else rows.filter(found)
    for name in stored.column_names:
        if name in target.natural_key:
            continue
        mine, theirs = candidates.column(name), stored.column(name).take(stored_at)
        if name == target.version_column:
            # Merge-by-version: only a newer version can win, so an equal or older one is
            # unchanged whatever its data. Versions read back as text (timestamps, strings)
            # do not order as the database orders them: those rows are staged.
            if mine.type.equals(theirs.type) and not _is_text(theirs.type):
                equal = pc.less_equal(mine, theirs)
            else:
                equal = pa.array(np.zeros(len(theirs), dtype=bool))
        else:
            equal = _equal(mine if mine.type.equals(theirs.type) else mine.cast(pa.string()),
                           theirs)
        unchanged &= pc.fill_null(equal, False).to_numpy(zero_copy_only=False)
    maybe_changed = np.ones(rows.num_rows, dtype=bool)
    maybe_changed[np.flatnonzero(found.to_numpy(zero_copy_only=False))[unchanged]] = False
    vanished = np.zeros(stored.num_rows, dtype=bool)
    if target.mode is LoadMode.REPLACE_PARTITION and len(stored_at) < stored.num_rows:
        vanished[:] = True
        vanished[stored_at.to_numpy(zero_copy_only=False)] = False
    return pa.array(maybe_changed), pa.array(vanished)


def _equal(mine: Any, theirs: Any) -> Any:
    """Equality in which two missing values are equal."""
    both_missing = pc.and_(pc.is_null(mine), pc.is_null(theirs))
    return pc.or_kleene(pc.fill_null(pc.equal(mine, theirs), False), both_missing)


def _key_text(rows: pa.Table, natural_key: Sequence[str]) -> pa.Array:
    """One value per row that is equal exactly when the natural keys are. Key parts are joined
    with NUL, a character PostgreSQL text can never hold."""
    parts = [pc.cast(rows.column(name), pa.string()) for name in natural_key]
    if len(parts) == 1:
        return parts[0].combine_chunks()
    return pc.binary_join_element_wise(*parts, "\x00").combine_chunks()


def _delete_listed(connection: Connection, target: LoadTarget, vanished: pa.Table,
                   partition_value: Any) -> int:
    """Delete the partition's rows whose natural keys are listed (read back, no longer sent)."""
    keys = _create_stage(connection, target.table, target.natural_key, prefix="vanished")
    _copy(connection, keys, vanished.select(list(target.natural_key)))
    partition_type = target.table.c[target.partition_column].type
    deleted = _execute(connection, loading_sql.delete_listed_rows(
        connection.dialect, target.table, keys, target.natural_key, target.partition_column
    ), {"partition_value": partition_value}, partition_type=partition_type)
    connection.exec_driver_sql(f"DROP TABLE {_quote(connection, keys.name)}")
    return deleted


# --- elsewhere (SQLite): a bulk insert into the stage -----------------------------------------


def _insert_into_stage(connection: Connection, stage: Table, frame: pd.DataFrame) -> None:
    for start in range(0, len(frame), COPY_CHUNK_ROWS):
        chunk = frame.iloc[start:start + COPY_CHUNK_ROWS]
        records = [dict(zip(chunk.columns, row, strict=True)) for row in _rows(chunk)]
        if records:
            connection.execute(stage.insert(), records)


def _rows(frame: pd.DataFrame) -> Iterator[tuple]:
    """Plain Python rows with ``None`` for every kind of missing value."""
    converted = {
        name: frame[name].astype(object).where(frame[name].notna(), None) for name in frame.columns
    }
    return zip(*converted.values(), strict=True)


def _quote(connection: Connection, name: str) -> str:
    return connection.dialect.identifier_preparer.quote(name)


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
