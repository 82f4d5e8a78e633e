"""A source's declaration: what it is, where its data goes, and its two plain functions.

A source module builds one :class:`SourceSpec` and nothing else; :mod:`.factory` turns it into
Dagster definitions. Sources never import Dagster's op or asset machinery.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from dagster import (
    BackfillPolicy,
    ConfigurableResource,
    PartitionsDefinition,
    TimeWindowPartitionsDefinition,
)
from sqlalchemy import Connection, Date, String, Table, UniqueConstraint

from mostovik_pipelines.core.load_target import KeyHeldElsewhere, LoadMode, LoadTarget
from mostovik_pipelines.core.retries import RetryPolicy
from mostovik_pipelines.framework.automation.policy import CatchUpPolicy, PeriodDeadline
from mostovik_pipelines.framework.quality.shape import (
    AddedFieldPolicy,
    ObservedShape,
    ShapeReport,
    SourceShape,
)
from mostovik_pipelines.warehouse.schema import BOOKKEEPING_COLUMNS

if TYPE_CHECKING:
    import pandas as pd


class ConcurrentRunPolicy(enum.StrEnum):
    """What a run does when an older run of the same source and partition is in progress."""

    WAIT = "wait"
    """Wait for it, then run: the duplicate was asked for (an operator's re-run while the
    schedule's run is going), so it should still deliver a fresh result, after the other."""

    STOP = "stop"
    """Stop at once, loading nothing, with a message naming the other run."""


class JobType(enum.StrEnum):
    """The three kinds of background job of ADR-016."""

    PARSER = "parser"
    SYNC = "sync"
    FILE = "file"


DEFAULT_ON_ADDED = {
    JobType.PARSER: AddedFieldPolicy.FREEZE,
    JobType.SYNC: AddedFieldPolicy.FREEZE,
    JobType.FILE: AddedFieldPolicy.WARN,
}
"""What a partition does with a field its source's declaration does not expect, unless the
declaration says: a published format or an API changes rarely and a new field can change the
meaning of those we load (a currency beside an amount), so it waits for a person; a site's
report gains note columns all the time, so it loads and warns."""


class PartitionNotAvailable(Exception):
    """Raised by a transform when the source has not published the partition yet.

    Not a failure: nothing is loaded, the partition stays unmaterialised and a later run picks it
    up. The message says why the partition is not available."""


@dataclass(frozen=True)
class PageCursor:
    """Where the next page of a paged source's partition starts: the source's own next-page
    token, and the sort key of the last item already received, to restart from when the token
    has expired (a window narrowed to start after that item)."""

    token: str | None = None
    resume_after: Mapping[str, Any] | None = None
    """JSON-able values (ISO text for instants): they are kept in the progress checkpoint."""


@dataclass(frozen=True)
class ExtractRequest:
    """What a source's extract function gets: the partition and the source's I/O resource; for
    a paged source, the cursor of the page to fetch (None: the first page)."""

    source: str
    partition_key: str
    resource: Any
    cursor: PageCursor | None = None


@dataclass(frozen=True)
class RawPayload:
    """Bytes exactly as the source sent them, and a description of where they came from."""

    content: bytes
    content_type: str = "application/octet-stream"
    origin: str = ""
    """Where the bytes came from (URL without credentials, file name), for the landing record."""
    next_cursor: PageCursor | None = None
    """Paged sources: where the partition's next page starts; None after the last page."""
    published_at: datetime | None = None
    """When the source published these bytes, when that is earlier than the fetch and known (a
    file's modification time): a partition never goes back to bytes published earlier."""


@dataclass(frozen=True)
class TransformRequest:
    """What a source's transform function gets: the landed bytes and their fetch context; for a
    paged source, the cursor the page was fetched with (a page fetched with a narrowed window
    may repeat items up to and including ``cursor.resume_after``: drop them)."""

    source: str
    partition_key: str
    content: bytes
    content_type: str
    fetched_at: datetime
    cursor: PageCursor | None = None
    shapes: list[ObservedShape] = field(default_factory=list, compare=False, repr=False)
    """What :meth:`report_shape` was told, for the framework to judge."""

    def report_shape(self, shape: ObservedShape) -> None:
        """Say which fields the payload holds (:mod:`.quality.shape`), before reading its rows:
        a missing or changed field is then named as such, whatever the parse makes of it."""
        self.shapes.append(shape)


@dataclass(frozen=True)
class RejectedRow:
    """A row the source sent that cannot be loaded; it goes to quarantine, never silently away."""

    row_number: int
    """1-based position in the payload (for XML: the element's position)."""
    raw: str
    reason: str
    key: Mapping[str, Any] | None = None
    """The row's natural key (column -> value, typed as the table stores it) when it could be
    read: what is stored under that key is kept as it is, never deleted or changed because of a
    rejected row. ``None`` when the key itself is unreadable."""


@dataclass(frozen=True)
class ParsedRows:
    """A transform's result when some rows had to be rejected."""

    frame: pd.DataFrame | Mapping[str, list]
    """The rows: a frame, or columns (name -> list of values, all as long) that the framework
    makes a frame of. A paged source does best with columns: its pages are joined into one
    frame per commit group, where a frame per page of 100 rows costs more than its request."""
    rejected: Sequence[RejectedRow] = ()
    row_numbers: Sequence[int] | None = None
    """Each frame row's position in the payload as the source numbers it (a file's row, title
    and header rows counted), so that rows rejected later (conflicting duplicates, keys held
    elsewhere) name the row an operator opens; by default the frame's own order."""

    def as_frame(self) -> pd.DataFrame:
        """The rows as a frame (built here, when a step or a test reads them)."""
        return columns_frame(self.frame) if isinstance(self.frame, Mapping) else self.frame



def columns_frame(columns: Mapping[str, list]) -> pd.DataFrame:
    """A frame of columns given as lists (:attr:`.ParsedRows.frame`); without rows, its columns
    hold objects (as a frame declared with no data), not floats. Pandas is imported here, when a
    step or a test builds a frame, not when a declaration is loaded."""
    import pandas as pd

    if not any(len(values) for values in columns.values()):
        return pd.DataFrame(columns=list(columns))
    return pd.DataFrame(columns)


@dataclass(frozen=True)
class LoadedPartition:
    """What a source's ``after_load`` gets: the committed partition and how it went."""

    source: str
    partition_key: str
    resource: Any
    outcome: str
    """``loaded``, or ``partial`` when rows were quarantined."""
    run_id: str


@dataclass(frozen=True)
class ReceivedRows:
    """The natural key (and version) of every row a load received, a batch at a time: a paged
    partition's batches are read back from disk one by one, so a check never holds a window
    whole."""

    read_batches: Callable[[], Iterator[pd.DataFrame]]

    @classmethod
    def of(cls, frame: pd.DataFrame, columns: Sequence[str] | None = None) -> ReceivedRows:
        """The rows of ``frame`` (its ``columns``, cut when a check reads them: most checks are
        answered by the table alone)."""
        return cls(lambda: iter([frame if columns is None else frame[list(columns)]]))

    def batches(self) -> Iterator[pd.DataFrame]:
        return self.read_batches()


@dataclass(frozen=True)
class CheckRequest:
    """What an asset check of a partition gets, right after the partition's load committed: a
    connection to the warehouse (read what is stored, never write) and what the load received."""

    connection: Connection
    table: Table
    partition_key: str
    partition_value: Any
    """The partition key as the partition column stores it."""
    run_id: str
    received: ReceivedRows
    """The natural key (and version column) of every row the load received."""
    received_rows: int
    """Rows the source sent for the partition, quarantined ones included."""
    loaded_by_run: tuple[Any, ...] = ()
    """Partition values the run has loaded so far, this one included."""
    written_since: datetime | None = None
    """When the partition's one load transaction began (its rows' ``changed_at``), or None."""
    shape: ShapeReport | None = None
    """The fields the source sent for the partition, against its declaration."""


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    description: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    warning: bool = False
    """A failure that only warns: it never blocks, whatever the check's ``blocking``."""


@dataclass(frozen=True)
class PartitionCheck:
    """An asset check run on every partition a run loads; its result is recorded per
    partition, in ranged runs too. A failed blocking check (not a warning) fails the partition,
    and so the job, after the load: the UI shows the check red, downstream assets wait."""

    name: str
    description: str
    evaluate: Callable[[CheckRequest], CheckResult]
    blocking: bool = True


@dataclass(frozen=True)
class SourceSchedule:
    """When to refresh the newest partitions, and how many of them each tick asks for."""

    cron: str
    timezone: str
    latest_partitions: int = 1


@dataclass(frozen=True)
class SourceSpec:
    """Everything the framework needs to know to extract, transform and load one source."""

    name: str
    job_type: JobType
    description: str
    """Two or three sentences of business context and the source's limits (the asset's text)."""
    partitions_def: PartitionsDefinition
    table: Table
    natural_key: Sequence[str]
    partition_column: str
    load_mode: LoadMode
    extract: Callable[[ExtractRequest], RawPayload]
    transform: Callable[[TransformRequest], pd.DataFrame | ParsedRows]
    resource: ConfigurableResource
    """The source's I/O (HTTP client, inbox, ...); the extract function receives it."""
    schedule: SourceSchedule | None = None
    version_column: str | None = None
    extract_retry: RetryPolicy = field(default_factory=RetryPolicy)
    load_retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=3))
    max_rejected_share: float | None = None
    """Share of a partition's rows that may be rejected (quarantined) with the rest still loaded,
    as a partial job. Above it the defect is systematic: nothing is loaded and the run fails.
    Every source declares it (0.0: one bad row fails the run and nothing is loaded)."""
    backfill_policy: BackfillPolicy = field(
        default_factory=lambda: BackfillPolicy.multi_run(max_partitions_per_run=31)
    )
    """How many partitions one run may take: a backfill of many small partitions should not pay
    a run's start-up cost for each one."""
    on_concurrent_run: ConcurrentRunPolicy = ConcurrentRunPolicy.WAIT
    """What a run does when an older run of the same partition is in progress (see locking)."""
    concurrent_run_wait_seconds: float = 5 * 60
    """The longest a run waits for an older run of its partitions (policy ``wait``), counted
    from its start; below ``max_runtime_seconds``, so the waiting run is not failed as hung."""
    celery_queue: str | None = None
    """The Celery queue its steps go to (e.g. workers that see the file inbox); default queue
    when unset. Only used with MOSTOVIK_EXECUTOR=celery."""
    max_runtime_seconds: int = 15 * 60
    """A run taking longer is hung: run monitoring fails it and ``jobs list --stuck`` shows it."""
    paged: bool = False
    """The source delivers a partition in pages (:class:`PageCursor`): each page is landed on
    its own, and consecutive pages are committed together (``rows_per_commit``), with the
    partition's progress checkpoint in the same transaction, so a re-run resumes after the last
    committed page (:mod:`.sync_progress`)."""
    rows_per_commit: int = 5_000
    """Paged sources: pages are validated and committed in groups of at least this many rows
    (the last group may be smaller), one transaction each with the checkpoint at the group's
    last page. A transaction costs ~0.1 s whatever its size, so a window of 100-row pages
    committed page by page spends most of its time committing; a crash re-fetches at most one
    group's pages."""
    tombstone_column: str | None = None
    """Merge-by-version: the boolean column that marks a record deleted at the source (kept and
    flagged, never deleted from the table)."""
    partition_value: Callable[[str], Any] | None = None
    """The partition column's value for a partition key, when it is not the key itself (a file
    version ``name@hash`` stores its file ``name``). Loads of one value take turns, and the
    value's last load decides what is superseded."""
    key_held_elsewhere: KeyHeldElsewhere | None = None
    """What a row does whose natural key is stored under another partition value. Declared by
    every source whose natural key does not include the partition column (and only there): such
    a key can move between partitions, so every load of the table runs alone."""
    empty_payload_is_valid: bool = False
    """Replace-partition sources: a payload that says positively that it holds no records (no
    records on a holiday, and nothing else: ``SourceShape.records``) is a legitimate delivery
    and empties the partition. Unset, or when the payload holds something else, a payload
    without rows fails the run as a contract error instead of wiping the partition."""
    url_setting: str | None = None
    """The environment variable that holds the source's endpoint URL, read by the source module
    itself; ``mostovik demo``, ``make dev`` point it at the source's stand-in endpoint."""
    sensor: Callable[[SourceSpec, Any, str], Any] | None = None
    """Builds the source's sensor from the spec, its job and its resource's key (a file inbox's
    new-file sensor, :mod:`.inbox_sensor`)."""
    after_load: Callable[[LoadedPartition], None] | None = None
    """What the source does with its input once a partition is committed (an inbox archives
    the file version). A failure here is logged; the committed load stands."""
    owners: Sequence[str] = ("team:back-office-data",)
    """Who answers for the source's data (asset owners): e-mail addresses or ``team:<name>``;
    the data team unless the source names its own."""
    protocol: str = "http"
    """How the source is reached (``http``, ``rest``, ``file``...): a kind of its asset, next to
    the warehouse's storage."""
    deadline: PeriodDeadline | None = None
    """Time-partitioned sources: when each period is due. Its check ``period_deadlines`` is red
    while a due period is not final, and a late period is alerted once
    (:mod:`.automation.deadlines`)."""
    checks: Sequence[PartitionCheck] = ()
    """The source's own asset checks, run after the framework's (:mod:`.checks`)."""
    catch_up: CatchUpPolicy = field(default_factory=CatchUpPolicy)
    """What the schedule or sensor asks for again without an operator: lookback, settle time
    of a sync's window, backoff after transient failures."""
    shape: SourceShape | None = None
    """The fields the source sends and the kinds of their values, and what an added field
    does (:mod:`.quality.shape`); its transform reports what each payload holds."""

    @property
    def added_field_policy(self) -> AddedFieldPolicy:
        """The declaration's policy for an added field, or its kind's default."""
        declared = self.shape.on_added if self.shape else None
        return declared or DEFAULT_ON_ADDED[self.job_type]

    @property
    def load_target(self) -> LoadTarget:
        return LoadTarget(
            table=self.table, natural_key=tuple(self.natural_key),
            partition_column=self.partition_column, mode=self.load_mode,
            version_column=self.version_column, tombstone_column=self.tombstone_column,
            partition_value_of=self.partition_value,
            key_held_elsewhere=self.key_held_elsewhere or KeyHeldElsewhere.MOVE,
            empty_payload_is_valid=self.empty_payload_is_valid,
        )

    def __post_init__(self) -> None:
        columns = set(self.table.columns.keys())
        missing = [c for c in (*self.natural_key, self.partition_column) if c not in columns]
        if missing:
            raise ValueError(f"source {self.name}: columns {missing} are not in {self.table.name}")
        if self.load_mode is LoadMode.MERGE_BY_VERSION and self.version_column not in columns:
            raise ValueError(f"source {self.name}: merge-by-version needs a version column")
        if self.concurrent_run_wait_seconds >= self.max_runtime_seconds:
            raise ValueError(
                f"source {self.name}: concurrent_run_wait_seconds "
                f"({self.concurrent_run_wait_seconds:.0f}) must stay below max_runtime_seconds "
                f"({self.max_runtime_seconds}), or a run waiting its turn is failed as hung")
        if self.rows_per_commit < 1:
            raise ValueError(f"source {self.name}: rows_per_commit must be at least 1")
        if self.tombstone_column is not None and self.tombstone_column not in columns:
            raise ValueError(f"source {self.name}: tombstone column {self.tombstone_column!r} "
                             f"is not in {self.table.name}")
        _refuse_implicit_rules(self)


def _refuse_implicit_rules(spec: SourceSpec) -> None:
    """The rules a declaration used to learn only by failing at its first load, each refused
    here with the source, the column and the fix."""
    where = f"source {spec.name} (mostovik_pipelines/sources/{spec.name}/source.py)"
    table = spec.table
    missing = [c for c in BOOKKEEPING_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"{where}: table {table.name} lacks the load bookkeeping {missing}: "
                         "build it with warehouse_table(name, *columns, natural_key=...)")
    unique = [tuple(c.columns.keys()) for c in table.constraints
              if isinstance(c, UniqueConstraint)]
    if tuple(spec.natural_key) not in unique:
        raise ValueError(
            f"{where}: natural_key {list(spec.natural_key)} is not a unique constraint of "
            f"{table.name} (it has {[list(u) for u in unique]}): give warehouse_table(..., "
            "natural_key=...) and SourceSpec(natural_key=...) the same columns")
    column = spec.partition_column
    column_type = table.c[column].type
    if not isinstance(column_type, Date | String):
        raise ValueError(
            f"{where}: partition column {column!r} is {column_type!r}; a partition column is a "
            "Date (a daily partition's day) or a String (a file name, a key): declare it "
            "Column(..., Date) or Column(..., String(n))")
    if (isinstance(column_type, Date) and spec.partition_value is None
            and not _keys_are_iso_days(spec.partitions_def)):
        raise ValueError(
            f"{where}: partition column {column!r} is a Date but the partition keys are not "
            "days (YYYY-MM-DD): use a DailyPartitionsDefinition, or give partition_value= a "
            "function from a partition key to its date")
    if column not in spec.natural_key and spec.key_held_elsewhere is None:
        raise ValueError(
            f"{where}: the natural key {list(spec.natural_key)} does not include the partition "
            f"column {column!r}, so a key can be stored under another partition and every load "
            f"of {table.name} must run alone. Add {column!r} to the natural key, or declare what "
            "such a row does: key_held_elsewhere=KeyHeldElsewhere.MOVE (it moves to the "
            "partition loading it: synced records) or KeyHeldElsewhere.REJECT (it goes to "
            "quarantine: two files claiming one line)")
    if spec.deadline is not None and not isinstance(spec.partitions_def,
                                                    TimeWindowPartitionsDefinition):
        raise ValueError(f"{where}: a deadline needs time-window partitions (a file version "
                         "is due when it arrives: declare none)")
    if spec.empty_payload_is_valid and (spec.shape is None or not spec.shape.records):
        raise ValueError(
            f"{where}: empty_payload_is_valid needs the records named in its shape "
            "(shape=SourceShape(..., records='Record')): a payload without rows is an empty "
            "period only when it says so, holding no record and nothing else")
    if spec.max_rejected_share is None:
        raise ValueError(
            f"{where}: declare max_rejected_share, the share of a partition's rows that may go "
            "to quarantine with the rest loaded (e.g. 0.1); 0.0 means one unreadable row fails "
            "the run and nothing is loaded")
    if not 0.0 <= spec.max_rejected_share < 1.0:
        raise ValueError(f"{where}: max_rejected_share must be in [0, 1)")


def _keys_are_iso_days(partitions_def: PartitionsDefinition) -> bool:
    return isinstance(partitions_def, TimeWindowPartitionsDefinition) and (
        partitions_def.fmt == "%Y-%m-%d")
