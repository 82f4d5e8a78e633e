"""Asset checks of every source table, run on each partition right after its load commits.

Every source's asset has these checks, each a few SQL statements against the warehouse for the
partition just loaded:

* ``natural_key_unique`` (blocking): no natural key of the partition's rows is stored twice;
* ``rows_in_partition`` (blocking): every row the run wrote is stored under a partition the run
  loaded, so none strayed outside its partition;
* ``quarantine_share`` (warns, never blocks): the partition's quarantined rows are at most the
  source's ``max_rejected_share`` of the rows it sent;
* ``source_shape`` (warns, never blocks), for a source that declares its shape: the fields the
  source sent are those its declaration expects; an added field the policy lets load
  (``warn``) is named here (:mod:`.shape`: a change the policy refuses fails the partition
  before its load);
* a merge-by-version source (a sync) also ``version_never_goes_down`` (blocking): no key the load
  received is stored with an older version than the one received (an older version received is
  ignored, never a failure);
* and the source's own (``SourceSpec.checks``).

The checks are partitioned like their asset, and the load step records one result per check per
partition it materialises, in a ranged run too, where Dagster would not evaluate them on its own
(``AssetCheckEvaluation(partition=...)``). A failed blocking check (not a warning) fails its
partition after the load: the job fails, the UI shows the check red with what it found, and
downstream assets that wait for blocking checks do not run on it. A check that cannot run fails
the same way: nothing unchecked passes for checked. The warehouse being away is no verdict of a
check: :func:`evaluate_partition` raises it, and the load step rides it out (its connection is
opened right after the partition's commit, where a crash of the warehouse often meets it) and
evaluates the checks again once the warehouse answers, up to its outage budget.
"""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetKey,
    AssetRecordsFilter,
    DagsterInstance,
    MetadataValue,
    PreviewWarning,
)
from sqlalchemy import ARRAY, Engine, all_, bindparam, func, select, text, tuple_

from mostovik_pipelines.core.dagster_compat import (
    AssetCheckEvaluationTargetMaterializationData,
)
from mostovik_pipelines.core.errors import classify
from mostovik_pipelines.core.load_target import LoadMode
from mostovik_pipelines.core.outages import Store, is_away
from mostovik_pipelines.framework.assets.view import markdown_table
from mostovik_pipelines.framework.quality.quarantine import quarantined_rows
from mostovik_pipelines.framework.quality.shape import ShapeReport
from mostovik_pipelines.framework.spec import (
    CheckRequest,
    CheckResult,
    PartitionCheck,
    ReceivedRows,
    SourceSpec,
)

if TYPE_CHECKING:
    import pandas as pd

SAMPLE_ROWS = 5
"""Offending rows shown in a failed check's metadata."""
VERSION_BATCH = 10_000
"""Keys per query when comparing received and stored versions."""


def partition_checks(spec: SourceSpec) -> list[PartitionCheck]:
    """Every check of the source's asset: the framework's, then the source's own."""
    checks = [_natural_key_unique(spec), _rows_in_partition(spec), _quarantine_share(spec)]
    if spec.shape is not None:
        checks.append(_source_shape(spec))
    if spec.load_mode is LoadMode.MERGE_BY_VERSION:
        checks.append(_version_never_goes_down(spec))
    return [*checks, *spec.checks]


def check_specs(spec: SourceSpec) -> list[AssetCheckSpec]:
    """The checks as Dagster declares them on the asset: partitioned like it."""
    with warnings.catch_warnings():
        # Partitioned asset checks are a preview in Dagster 1.13; they are what lets the UI show
        # a result per partition.
        warnings.simplefilter("ignore", PreviewWarning)
        return [
            AssetCheckSpec(check.name, asset=spec.name, description=check.description,
                           blocking=check.blocking, partitions_def=spec.partitions_def)
            for check in partition_checks(spec)
        ]


def evaluate_partition(engine: Engine, spec: SourceSpec, partition_key: str, run_id: str,
                       received: ReceivedRows | pd.DataFrame, received_rows: int,
                       loaded_by_run: Sequence[Any], instance: DagsterInstance | None = None,
                       shape: ShapeReport | None = None, written_since: datetime | None = None,
                       ) -> list[AssetCheckEvaluation]:
    """Run every check of the source on one loaded partition; one evaluation per check.

    ``received`` holds the natural key (and version) of the rows the load received,
    ``received_rows`` counts the rows the source sent (quarantined ones included), and
    ``loaded_by_run`` the partition values the run has loaded so far, this one included;
    ``shape`` the fields the source sent, against its declaration; ``written_since`` when the
    partition's load transaction began, where it wrote in one (its rows are then told from
    those of the run's earlier partitions by their ``changed_at``).
    With the ``instance``, each evaluation names the partition's latest materialisation (just
    recorded by the load) as what it checked: the UI then counts it as the partition's
    current result."""
    asset_key = AssetKey(spec.name)
    target = _latest_materialization(instance, asset_key, partition_key) if instance else None
    evaluations = []
    with engine.connect() as connection:
        request = CheckRequest(
            connection=connection, table=spec.table, partition_key=partition_key,
            partition_value=spec.load_target.partition_value(partition_key), run_id=run_id,
            received=(received if isinstance(received, ReceivedRows)
                      else ReceivedRows.of(received)),
            received_rows=received_rows, loaded_by_run=tuple(loaded_by_run), shape=shape,
            written_since=written_since,
        )
        for check in partition_checks(spec):
            started = time.monotonic()
            try:
                result = check.evaluate(request)
            except Exception as exc:
                if is_away(Store.WAREHOUSE, exc):
                    raise  # not the check's verdict: the step rides the warehouse out
                connection.rollback()
                result = CheckResult(False, f"the check could not run: {classify(exc).reason}")
            metadata = {**result.metadata,
                        "check_seconds": MetadataValue.float(
                            round(time.monotonic() - started, 3))}
            evaluations.append(AssetCheckEvaluation(
                asset_key=asset_key, check_name=check.name, passed=result.passed,
                partition=partition_key, description=result.description, metadata=metadata,
                severity=AssetCheckSeverity.WARN if result.warning else AssetCheckSeverity.ERROR,
                blocking=check.blocking, target_materialization_data=target,
            ))
        connection.rollback()
    return evaluations


def _latest_materialization(instance: DagsterInstance, asset_key: AssetKey, partition_key: str,
                            ) -> AssetCheckEvaluationTargetMaterializationData | None:
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition_key]), limit=1,
        ascending=False).records
    if not records:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=records[0].storage_id, run_id=records[0].run_id,
        timestamp=records[0].timestamp)


def blocks(evaluation: AssetCheckEvaluation) -> bool:
    """A failed blocking check with ERROR severity: the partition fails."""
    return (not evaluation.passed and bool(evaluation.blocking)
            and evaluation.severity is AssetCheckSeverity.ERROR)


def _newest_received(frame: pd.DataFrame, key: str, version: str) -> pd.Series:
    """Key -> the newest version received for it in the batch."""
    return (frame.sort_values(version).drop_duplicates(subset=[key], keep="last")
            .set_index(key)[version])


def _compare_versions(request: CheckRequest, key: str, version: str
                      ) -> tuple[int, int, list[tuple]]:
    """(keys compared, keys stored lower, a sample of (key, stored, received)): the received
    keys are looked up a batch at a time."""
    table, compared, gone_down, sample = request.table, 0, 0, []
    for frame in request.received.batches():
        received = _newest_received(frame, key, version)
        compared += len(received)
        for start in range(0, len(received), VERSION_BATCH):
            batch = received.iloc[start:start + VERSION_BATCH]
            stored = request.connection.execute(select(table.c[key], table.c[version]).where(
                table.c[key].in_(list(batch.index))))
            lower = [(row[0], row[1], int(batch[row[0]])) for row in stored
                     if row[1] < int(batch[row[0]])]
            gone_down += len(lower)
            sample += lower[:SAMPLE_ROWS - len(sample)]
    return compared, gone_down, sample


def _compare_versions_postgresql(request: CheckRequest, key: str, version: str
                                 ) -> tuple[int, int, list[tuple]]:
    """The same on PostgreSQL: the received versions are copied into a temporary table a
    batch at a time and compared in one join (a join per batch hashed the whole table each
    time: 2 s for a window of 100,000)."""
    import pyarrow as pa  # the loader's, loaded already (declaring the checks needs none)
    import pyarrow.csv as pa_csv

    connection, table = request.connection, request.table
    quote = connection.dialect.identifier_preparer.quote
    key_type = table.c[key].type.compile(dialect=connection.dialect)
    version_type = table.c[version].type.compile(dialect=connection.dialect)
    cursor = connection.connection.driver_connection.cursor()
    cursor.execute(f"CREATE TEMPORARY TABLE received_versions (k {key_type}, v {version_type}) "
                   "ON COMMIT DROP")
    compared = 0
    options = pa_csv.WriteOptions(include_header=False, quoting_style="needed")
    with cursor.copy("COPY received_versions (k, v) FROM STDIN (FORMAT csv)") as copy:
        for frame in request.received.batches():
            # Every row as CSV (Arrow writes it; the join below keeps each key's newest).
            compared += frame[key].nunique()
            buffer = io.BytesIO()
            pa_csv.write_csv(pa.table({"k": pa.array(frame[key]),
                                       "v": pa.array(frame[version], pa.int64())}),
                             buffer, options)
            copy.write(buffer.getbuffer())
    lower = (f"SELECT r.k, t.{quote(version)} AS stored, max(r.v) AS received "
             f"FROM received_versions r JOIN {quote(table.name)} t ON t.{quote(key)} = r.k "
             f"GROUP BY r.k, t.{quote(version)} HAVING t.{quote(version)} < max(r.v)")
    gone_down = connection.execute(text(f"SELECT count(*) FROM ({lower}) AS lower")).scalar_one()
    sample = [tuple(row) for row in connection.execute(text(
        f"{lower} ORDER BY r.k LIMIT {SAMPLE_ROWS}"))] if gone_down else []
    connection.exec_driver_sql("DROP TABLE received_versions")
    return compared, gone_down, sample


def _unique_index_on(connection, table: str, columns: Sequence[str]) -> str | None:
    """PostgreSQL: a valid unique index of ``table`` on exactly ``columns`` (no predicate, no
    expression), by name; with it no key can be stored twice, and counting copies of every key
    of a partition (a third of a second for 100,000 rows) would find nothing. None elsewhere:
    the check then counts."""
    if connection.dialect.name != "postgresql":
        return None
    return connection.execute(text(
        "SELECT i.relname FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "WHERE x.indrelid = to_regclass(:table) AND x.indisunique AND x.indisvalid "
        "AND x.indpred IS NULL AND x.indexprs IS NULL AND x.indnkeyatts = :count "
        "AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute a "
        "     WHERE a.attrelid = x.indrelid AND a.attnum = ANY(x.indkey::int2[])) "
        "    = CAST(:columns AS text[]) "
        "ORDER BY i.relname LIMIT 1"),
        {"table": connection.dialect.identifier_preparer.quote(table), "count": len(columns),
         "columns": sorted(columns)}).scalar()


# --- the framework's checks -------------------------------------------------------------------

NATURAL_KEY_UNIQUE = "natural_key_unique"
ROWS_IN_PARTITION = "rows_in_partition"
QUARANTINE_SHARE = "quarantine_share"
SOURCE_SHAPE = "source_shape"
VERSION_NEVER_GOES_DOWN = "version_never_goes_down"


def _natural_key_unique(spec: SourceSpec) -> PartitionCheck:
    def evaluate(request: CheckRequest) -> CheckResult:
        table = request.table
        enforced_by = _unique_index_on(request.connection, table.name, spec.natural_key)
        if enforced_by:
            return CheckResult(True, f"every natural key ({', '.join(spec.natural_key)}) is "
                                     f"stored once: the unique index {enforced_by} enforces it",
                               {"duplicated_keys": MetadataValue.int(0),
                                "enforced_by": MetadataValue.text(enforced_by)})
        keys = [table.c[name] for name in spec.natural_key]
        in_partition = select(*keys).where(
            table.c[spec.partition_column] == request.partition_value)
        # A key of the partition stored twice anywhere in the table: the partition column is
        # not always part of the key (a sync's record moves between windows).
        key_of_partition = (keys[0].in_(in_partition) if len(keys) == 1
                            else tuple_(*keys).in_(in_partition))
        duplicated = (select(*keys, func.count().label("copies")).where(key_of_partition)
                      .group_by(*keys).having(func.count() > 1))
        count = request.connection.scalar(select(func.count()).select_from(
            duplicated.subquery()))
        if not count:
            return CheckResult(True, f"every natural key ({', '.join(spec.natural_key)}) of the "
                                     "partition is stored once",
                               {"duplicated_keys": MetadataValue.int(0)})
        sample = request.connection.execute(duplicated.limit(SAMPLE_ROWS)).fetchall()
        return CheckResult(
            False, f"{count} natural key(s) of the partition are stored more than once",
            {"duplicated_keys": MetadataValue.int(count),
             "sample": MetadataValue.md(markdown_table([*spec.natural_key, "copies"], sample))})

    return PartitionCheck(
        NATURAL_KEY_UNIQUE,
        f"No natural key ({', '.join(spec.natural_key)}) of the partition's rows is stored twice "
        f"in {spec.table.name}.", evaluate)


def _rows_in_partition(spec: SourceSpec) -> PartitionCheck:
    def evaluate(request: CheckRequest) -> CheckResult:
        table = request.table
        column = table.c[spec.partition_column]
        if request.written_since is not None and request.connection.dialect.name == "postgresql":
            # The partition's load wrote in one transaction, and a ranged run loads and checks
            # its partitions one after another: the run's rows written since that transaction
            # began are this load's, and each partition's check answers for its own rows (all
            # of them for every row the run wrote). The index on (changed_by_run, changed_at)
            # reads only those, whatever the range.
            stray = (table.c.changed_by_run == request.run_id,
                     table.c.changed_at >= request.written_since,
                     column.is_distinct_from(request.partition_value))
        else:
            # Rows written by the run carry its id; in a ranged run, by the time this
            # partition is checked, the run has written only the partitions it loaded so far.
            stray = (table.c.changed_by_run == request.run_id,
                     _not_among(column, request.loaded_by_run, request.connection.dialect.name))
        outside = select(column, *(table.c[name] for name in spec.natural_key)).where(*stray)
        count = request.connection.scalar(select(func.count()).select_from(outside.subquery()))
        if not count:
            return CheckResult(True, f"every row the run wrote is under {spec.partition_column} "
                                     f"{request.partition_value} or another partition it loaded",
                               {"rows_outside": MetadataValue.int(0)})
        sample = request.connection.execute(outside.limit(SAMPLE_ROWS)).fetchall()
        return CheckResult(
            False, f"{count} row(s) the run wrote are outside every partition it loaded",
            {"rows_outside": MetadataValue.int(count),
             "sample": MetadataValue.md(markdown_table(
                 [spec.partition_column, *spec.natural_key], sample))})

    return PartitionCheck(
        ROWS_IN_PARTITION,
        f"Every row the run wrote to {spec.table.name} is stored under a partition the run "
        f"loaded ({spec.partition_column}): none strayed outside its partition.", evaluate)


def _not_among(column, values: Sequence[Any], dialect: str):
    """``column`` holds none of ``values``. On PostgreSQL the values go as one array parameter:
    a ranged run's list grows by a partition at each check, and a parameter per value made a
    year's checks bind 66,000 of them."""
    if dialect != "postgresql":
        return column.not_in(list(values))
    return column != all_(bindparam("loaded_values", list(values), type_=ARRAY(column.type)))


def _quarantine_share(spec: SourceSpec) -> PartitionCheck:
    threshold = spec.max_rejected_share or 0.0

    def evaluate(request: CheckRequest) -> CheckResult:
        quarantined = request.connection.scalar(
            select(func.count()).select_from(quarantined_rows).where(
                quarantined_rows.c.source == spec.name,
                quarantined_rows.c.partition_key == request.partition_key)) or 0
        share = quarantined / request.received_rows if request.received_rows else 0.0
        metadata = {"quarantined": MetadataValue.int(quarantined),
                    "received": MetadataValue.int(request.received_rows),
                    "share": MetadataValue.float(round(share, 4)),
                    "threshold": MetadataValue.float(threshold)}
        if share <= threshold:
            return CheckResult(True, f"{quarantined} of {request.received_rows} rows quarantined "
                                     f"({share:.1%}, at most {threshold:.0%})", metadata)
        return CheckResult(False, f"{quarantined} of {request.received_rows} rows quarantined: "
                                  f"{share:.1%}, above the source's {threshold:.0%}",
                           metadata, warning=True)

    return PartitionCheck(
        QUARANTINE_SHARE,
        f"At most {threshold:.0%} of the rows the source sent for the partition are quarantined "
        "(warns; never blocks).", evaluate, blocking=False)


def _source_shape(spec: SourceSpec) -> PartitionCheck:
    declaration = f"mostovik_pipelines/sources/{spec.name}/source.py"

    def evaluate(request: CheckRequest) -> CheckResult:
        report = request.shape
        if report is None:
            return CheckResult(True, "the partition's shape was not reported")
        metadata = {"fields": MetadataValue.text(
            ", ".join(f.shown() for f in report.observed.fields))}
        if not report.drift:
            return CheckResult(True, f"the source sent the {len(report.observed.fields)} "
                                     "fields its declaration expects", metadata)
        return CheckResult(
            False, f"{report.drift.describe()}: loaded as usual (policy "
                   f"{report.policy.value}); declare the field in {declaration} to accept it",
            {**metadata, "change": MetadataValue.text(report.drift.describe())}, warning=True)

    return PartitionCheck(
        SOURCE_SHAPE,
        "The source sent the fields its declaration expects; a field it added, loaded under "
        "the policy 'warn', is named here (warns; never blocks).", evaluate, blocking=False)


def _version_never_goes_down(spec: SourceSpec) -> PartitionCheck:
    key, version = spec.natural_key[0], spec.version_column
    assert len(spec.natural_key) == 1 and version is not None

    def evaluate(request: CheckRequest) -> CheckResult:
        compare = (_compare_versions_postgresql if request.connection.dialect.name ==
                   "postgresql" else _compare_versions)
        compared, gone_down, sample = compare(request, key, version)
        metadata = {"keys_compared": MetadataValue.int(compared),
                    "versions_gone_down": MetadataValue.int(gone_down)}
        if not gone_down:
            return CheckResult(True, f"no {key} of the load is stored with an older {version} "
                                     "than the one received", metadata)
        return CheckResult(
            False, f"{gone_down} {key}(s) are stored with an older {version} than the load "
                   "received",
            {**metadata, "sample": MetadataValue.md(markdown_table(
                [key, f"stored {version}", f"received {version}"], sample))})

    return PartitionCheck(
        VERSION_NEVER_GOES_DOWN,
        f"No {key} the load received is stored with an older {version}: a version never goes "
        "down (an older one received is ignored).", evaluate)

