"""A source's declaration: what it is, where its data goes, and its two plain functions.

A source module builds one :class:`SourceSpec` and nothing else; :mod:`.factory` turns it into
Dagster definitions. Sources never import Dagster's op or asset machinery.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pandas as pd
from dagster import BackfillPolicy, ConfigurableResource, PartitionsDefinition
from sqlalchemy import Table

from mostovik_pipelines.etl.loading import KeyHeldElsewhere, LoadMode, LoadTarget
from mostovik_pipelines.etl.retries import RetryPolicy
from mostovik_pipelines.etl.runs_in_flight import ConcurrentRunPolicy


class JobType(enum.StrEnum):
    """The three kinds of background job of ADR-016."""

    PARSER = "parser"
    SYNC = "sync"
    FILE = "file"


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

    frame: pd.DataFrame
    rejected: Sequence[RejectedRow] = ()


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
    max_rejected_share: float = 0.0
    """Share of a partition's rows that may be rejected (quarantined) with the rest still loaded,
    as a partial job. Above it the defect is systematic: nothing is loaded and the run fails."""
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
    """The source delivers a partition in pages (:class:`PageCursor`): each page is landed,
    transformed and committed on its own, with the partition's progress checkpoint in the same
    transaction, so a re-run resumes after the last committed page (:mod:`.sync_progress`)."""
    tombstone_column: str | None = None
    """Merge-by-version: the boolean column that marks a record deleted at the source (kept and
    flagged, never deleted from the table)."""
    partition_value: Callable[[str], Any] | None = None
    """The partition column's value for a partition key, when it is not the key itself (a file
    version ``name@hash`` stores its file ``name``). Loads of one value take turns, and the
    value's last load decides what is superseded."""
    key_held_elsewhere: KeyHeldElsewhere = KeyHeldElsewhere.MOVE
    """What a row does whose natural key is stored under another partition value (possible only
    when the partition column is not part of the key)."""
    sensor: Callable[[SourceSpec, Any, str], Any] | None = None
    """Builds the source's sensor from the spec, its job and its resource's key (a file inbox's
    new-file sensor, :mod:`.inbox_sensor`)."""
    after_load: Callable[[LoadedPartition], None] | None = None
    """What the source does with its input once a partition is committed (an inbox archives
    the file version). A failure here is logged; the committed load stands."""

    @property
    def load_target(self) -> LoadTarget:
        return LoadTarget(
            table=self.table, natural_key=tuple(self.natural_key),
            partition_column=self.partition_column, mode=self.load_mode,
            version_column=self.version_column, tombstone_column=self.tombstone_column,
            partition_value_of=self.partition_value, key_held_elsewhere=self.key_held_elsewhere,
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
        if self.tombstone_column is not None and self.tombstone_column not in columns:
            raise ValueError(f"source {self.name}: tombstone column {self.tombstone_column!r} "
                             f"is not in {self.table.name}")
        if not 0.0 <= self.max_rejected_share < 1.0:
            raise ValueError(f"source {self.name}: max_rejected_share must be in [0, 1)")
