"""Declaration -> Dagster: a partitioned graph-backed asset of three ops, its job and schedule.

* ``extract_<source>`` calls the source and lands the raw bytes (retries network failures);
* ``transform_<source>`` parses the landed bytes into a typed frame and validates it (never
  retried: the same bytes parse the same way);
* ``load_<source>`` upserts each partition in a transaction of its own (retries transient
  database failures; safe because a transaction either commits whole or leaves nothing) and
  records one materialisation per partition with its figures.

A run takes one partition, or a range of them when the source's backfill policy allows it; each
op then works partition by partition. In a ranged run a partition that fails permanently is set
aside and the others go on; the run fails at the end, naming the failed partitions, with the
good ones loaded. A retried step resumes: what its run already landed or loaded is not redone,
and each partition has a retry budget of its own (:mod:`.retries`).

Recovery never goes back in time:

* a step only acts on what its own run produced. A re-execution (the UI's "from failure" or
  "from selected", ``mostovik jobs rerun RUN_ID``, a daemon run retry) starts with outputs its
  parent stored; they are history, so the first step of the re-execution fetches every
  partition again, except those the original run (or any run it repeats) already loaded;
* every load records when its payload was fetched, and a load of a payload older than what the
  partition holds is refused as superseded (:class:`.loading.PartitionSuperseded`);
* a rejected (quarantined) row keeps what is stored under its key (:class:`.loading.KeptRows`).

A source that has not published a partition yet makes it "not available yet": nothing is
loaded, the partition stays unmaterialised, and a later run picks it up.
"""

import bisect
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import pandas as pd
from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    AssetSelection,
    Config,
    DagsterEventType,
    DagsterRunStatus,
    DefaultScheduleStatus,
    Definitions,
    Failure,
    MetadataValue,
    OpExecutionContext,
    Out,
    Output,
    RetryRequested,
    RunRequest,
    RunsFilter,
    ScheduleEvaluationContext,
    define_asset_job,
    graph_asset,
    op,
    schedule,
)

from mostovik_pipelines.etl.asset_view import PREVIEW_ROWS, asset_kinds, asset_metadata, preview
from mostovik_pipelines.etl.checks import blocks, check_specs, evaluate_partition
from mostovik_pipelines.etl.errors import (
    ConcurrentRunError,
    ConfigurationError,
    PageCursorExpired,
    PartitionCheckFailed,
    PermanentError,
    classify,
)
from mostovik_pipelines.etl.loading import (
    KeptRows,
    LoadCounts,
    LoadMode,
    PartitionSuperseded,
    load_partition,
)
from mostovik_pipelines.etl.quarantine import replace_quarantine
from mostovik_pipelines.etl.retries import (
    NO_RETRY,
    RetryPolicy,
    StepContext,
    failure_for,
    retry_or_fail,
)
from mostovik_pipelines.etl.run_claims import hold_run_claim
from mostovik_pipelines.etl.runs_in_flight import (
    ConcurrentRunPolicy,
    RunClaim,
    older_runs_in_flight,
)
from mostovik_pipelines.etl.spec import (
    ExtractRequest,
    LoadedPartition,
    PageCursor,
    ParsedRows,
    PartitionNotAvailable,
    RawPayload,
    ReceivedRows,
    RejectedRow,
    SourceSpec,
    TransformRequest,
    columns_frame,
)
from mostovik_pipelines.etl.sync_progress import (
    committed_progress,
    pages_to_resume,
    save_progress,
)
from mostovik_pipelines.etl.tags import PARTITION_TAG, STATUS_TAG, business_tags
from mostovik_pipelines.etl.tracking import (
    LOAD_COUNT_KEYS,
    JobStatus,
    completed_or_partial,
    record_step,
)
from mostovik_pipelines.etl.validation import row_text, validate_partition
from mostovik_pipelines.resources.landing import LandedPayload

WAREHOUSE_KEY = "warehouse"
LANDING_KEY = "landing"
SHOWN_FAILURES = 5
CONCURRENT_RUN_POLL_SECONDS = 3.0
"""How often a run waiting for an older run of its partitions looks again. It waits between
attempts of its step, holding no worker (a Celery worker is free for the run it waits for)."""


def source_resource_key(spec: SourceSpec) -> str:
    return f"{spec.name}_source"


class ExtractConfig(Config):
    """Run config of the extract op."""

    reuse_landed: bool = False
    """Re-transform the partition's most recently landed payload instead of calling the source."""
    full_resync: bool = False
    """Paged sources: sync the whole partition again, ignoring the progress committed by an
    interrupted run (a finished partition keeps no progress: its next run is a full re-sync)."""


@dataclass(frozen=True)
class TransformedPartition:
    """What transform hands to load for one partition: rows to load, rows to quarantine."""

    frame: pd.DataFrame
    landed: LandedPayload
    duplicates_dropped: int
    rejected: tuple[RejectedRow, ...]
    row_numbers: tuple[int, ...] | None = None
    """Each row's position in the payload (what a quarantined row is numbered by)."""


@dataclass(frozen=True)
class PartitionSkipped:
    """A partition with nothing to load (not published yet, stopped for a concurrent run,
    superseded by a newer load)."""

    partition_key: str
    reason: str


@dataclass(frozen=True)
class PartitionFailure:
    """A partition of a ranged run that failed for good; the other partitions go on."""

    partition_key: str
    step: str
    message: str


@dataclass(frozen=True)
class PartitionLoaded:
    """A partition a re-execution finds already loaded by the run it repeats: nothing to do."""

    partition_key: str
    run_id: str


@dataclass(frozen=True)
class LandedPages:
    """A paged partition's pages landed by this run, from where its committed progress left
    off (``resumed_after_page`` pages were committed before; 0: from the start)."""

    pages: tuple[LandedPayload, ...]
    resumed_after_page: int


@dataclass(frozen=True)
class TransformedPageGroup:
    """Consecutive pages validated together, to be committed in one transaction with the
    checkpoint at ``last_page`` (:attr:`.SourceSpec.rows_per_commit`)."""

    first_page: int
    last_page: int
    frame_path: str
    """The group's validated rows, kept next to the landed pages (memory holds one group)."""
    rows: int
    rejected: tuple[RejectedRow, ...]
    duplicates_dropped: int
    next_cursor: dict | None
    """Where the page after the group starts; None: the group ends the partition."""


@dataclass(frozen=True)
class TransformedPages:
    groups: tuple[TransformedPageGroup, ...]
    resumed_after_page: int
    pages: int
    payload_bytes: int
    content_hash: str
    """The digest of the partition's pages' hashes, in page order."""
    fetched_at: datetime | None
    """When the first page was fetched."""


@dataclass(frozen=True)
class StepOutcomes:
    """What a step hands to the next, per partition, and the run that produced it: a step of
    another run (a re-execution's inherited input) is history, never acted upon."""

    run_id: str
    partitions: dict = field(default_factory=dict)


def build_source_definitions(spec: SourceSpec) -> Definitions:
    """Everything Dagster needs for one source: its asset, job and schedule. The resources,
    the source's own included (:func:`source_resource_key`), are bound by the code location."""
    checks = check_specs(spec)
    extract, transform = _extract_op(spec), _transform_op(spec)
    load = _load_op(spec, [check.get_python_identifier() for check in checks])

    @graph_asset(
        name=spec.name,
        description=spec.description,
        partitions_def=spec.partitions_def,
        backfill_policy=spec.backfill_policy,
        group_name=spec.job_type.value,
        kinds=asset_kinds(spec),
        owners=list(spec.owners) or None,
        metadata=asset_metadata(spec),
        tags={"mostovik/job_type": spec.job_type.value},
        check_specs=checks,
    )
    def source_asset():
        # The load step records the materialisation and the check results of every partition
        # it loads; its outputs only say to Dagster that it produced them.
        loaded = load(transform(extract()))
        return {name: getattr(loaded, name) for name in ("result", *(
            check.get_python_identifier() for check in checks))}

    if spec.freshness_policy is not None:
        source_asset = source_asset.map_asset_specs(
            lambda asset: asset.replace_attributes(freshness_policy=spec.freshness_policy))

    job = define_asset_job(
        name=f"{spec.name}_job",
        description=f"Extract, transform and load partitions of {spec.name}.",
        selection=AssetSelection.assets(source_asset),
        partitions_def=spec.partitions_def,
        tags={**business_tags(spec), "dagster/max_runtime": str(spec.max_runtime_seconds)},
    )
    schedules = [_schedule(spec, job)] if spec.schedule else []
    sensors = [spec.sensor(spec, job, source_resource_key(spec))] if spec.sensor else []
    return Definitions(assets=[source_asset], jobs=[job], schedules=schedules, sensors=sensors)


def _op_tags(spec: SourceSpec) -> dict[str, str]:
    """Routes the source's steps to its Celery queue, when it declares one."""
    return {"dagster-celery/queue": spec.celery_queue} if spec.celery_queue else {}


# --- what every step does around its work ------------------------------------------------------


@contextlib.contextmanager
def _step(context: OpExecutionContext, spec: SourceSpec) -> Iterator[None]:
    """Hold the run's claim while the step works (the run is alive: :mod:`.run_claims`), tag
    the run as a business job, and mark the job failed when the step fails for good."""
    with hold_run_claim(context.instance, context.run_id):
        record_step(context, spec)
        try:
            yield
        except RetryRequested:
            raise
        except BaseException:
            context.instance.add_run_tags(context.run_id, {STATUS_TAG: JobStatus.FAILED.value})
            raise


def _older_run_stops_this_one(context: OpExecutionContext, spec: SourceSpec) -> str | None:
    """Apply the source's concurrent-run policy at the run's first step: the reason this run
    stops (policy ``stop``), or None to go on. With ``wait`` the step retries later, holding
    nothing, until the older runs are over, for at most ``concurrent_run_wait_seconds`` from the
    run's start."""
    keys = context.partition_keys
    claim = RunClaim(context.run_id, f"{spec.name}_job", AssetKey(spec.name), frozenset(keys))
    older = [run.run_id for run in older_runs_in_flight(context.instance, claim,
                                                         spec.partitions_def)]
    if not older:
        return None
    if spec.on_concurrent_run is ConcurrentRunPolicy.STOP:
        reason = (f"stopped: run(s) {', '.join(older)} of the same partition(s) in progress; "
                  "nothing loaded by this run")
        context.log.warning(f"{spec.name}: {reason}")
        return reason
    record = context.instance.get_run_record_by_id(context.run_id)
    started = (record.start_time if record and record.start_time
               else record.create_timestamp.timestamp() if record else time.time())
    waited = time.time() - started
    scope = keys[0] if len(keys) == 1 else f"{keys[0]}...{keys[-1]}"
    if waited > spec.concurrent_run_wait_seconds:
        raise failure_for(StepContext(spec.name, scope, "wait"), classify(ConcurrentRunError(
            f"run(s) {', '.join(older)} of the same partition(s) still in progress after "
            f"{waited:.0f}s")), context.retry_number + 1, NO_RETRY)
    context.log.info(f"{spec.name} [{scope}]: waiting for run(s) {', '.join(older)} of the same "
                     f"partition(s) to finish ({waited:.0f}s so far)")
    raise RetryRequested(max_retries=context.retry_number + 1,
                         seconds_to_wait=CONCURRENT_RUN_POLL_SECONDS)


def _fail_or_set_aside(
    context: OpExecutionContext, step: StepContext, policy: RetryPolicy, exc: Exception,
    ranged: bool,
) -> PartitionFailure:
    """Retry the step while the failure is transient; else fail the run (one partition) or set
    the partition aside (a range), logging why."""
    decision = retry_or_fail(context, step, policy, exc)
    if isinstance(decision, RetryRequested) or not ranged:
        raise decision from exc
    context.log.error(decision.description)
    return PartitionFailure(step.partition_key, step.step, decision.description or str(exc))


# --- one partition, one stage at a time ----------------------------------------------------------


def _extract_partition(context: OpExecutionContext, spec: SourceSpec, key: str,
                       reuse_landed: bool, full_resync: bool = False,
                       ) -> LandedPayload | LandedPages | PartitionFailure:
    if spec.paged:
        if reuse_landed:
            return _fail_or_set_aside(
                context, StepContext(spec.name, key, "extract"), NO_RETRY, ConfigurationError(
                    "reuse_landed re-transforms one payload; a paged source lands many: "
                    "run it again (it resumes after its committed pages) or with full_resync"),
                len(context.partition_keys) > 1)
        return _extract_pages(context, spec, key, full_resync)
    landing = getattr(context.resources, LANDING_KEY)
    ranged = len(context.partition_keys) > 1
    latest = landing.latest(spec.name, key)
    if reuse_landed or (latest is not None and latest.run_id == context.run_id):
        if latest is not None:
            return latest
        return _fail_or_set_aside(context, StepContext(spec.name, key, "extract"), NO_RETRY,
                                  PermanentError("nothing landed yet to re-transform"), ranged)
    try:
        raw = spec.extract(ExtractRequest(
            source=spec.name, partition_key=key,
            resource=getattr(context.resources, source_resource_key(spec)),
        ))
        return landing.land(
            spec.name, key, raw.content, content_type=raw.content_type,
            origin=raw.origin, fetched_at=raw.published_at or datetime.now(UTC),
            run_id=context.run_id,
        )
    except Exception as exc:
        return _fail_or_set_aside(context, StepContext(spec.name, key, "extract"),
                                  spec.extract_retry, exc, ranged)


def _extract_pages(context: OpExecutionContext, spec: SourceSpec, key: str,
                   full_resync: bool) -> LandedPages | PartitionFailure:
    """Land the partition's pages, starting after its committed progress (or after what this
    run already landed, in a retried step): a committed page is never fetched again. An expired
    page token restarts the page with the window narrowed to after the last item received."""
    landing = getattr(context.resources, LANDING_KEY)
    mine = landing.pages_landed_by(spec.name, key, context.run_id)
    if mine:
        resumed_after = (mine[0].page or 1) - 1
        cursor = _cursor(mine[-1].next_cursor)
        if cursor is None:
            return LandedPages(tuple(mine), resumed_after)
    else:
        engine = getattr(context.resources, WAREHOUSE_KEY).engine()
        progress = None if full_resync else committed_progress(engine, spec.name, key)
        resumed_after = progress.pages_committed if progress else 0
        cursor = progress.next_cursor if progress else None
        if progress:
            context.log.info(f"{spec.name} [{key}]: resuming after page {resumed_after} "
                             f"(committed by run {progress.run_id})")
        stopped = None if full_resync else _stopped_midway(context, key)
        if stopped is not None:
            mine = pages_to_resume(landing.pages_landed_by(spec.name, key, stopped),
                                   resumed_after, cursor, landing.is_whole)
        if mine:
            context.log.info(
                f"{spec.name} [{key}]: taking up pages {mine[0].page}-{mine[-1].page} landed by "
                f"run {mine[0].run_id}, which stopped before committing them")
            cursor = _cursor(mine[-1].next_cursor)
            if cursor is None:
                return LandedPages(tuple(mine), resumed_after)
    pages = list(mine)
    number = resumed_after + len(pages) + 1
    resource = getattr(context.resources, source_resource_key(spec))

    def fetch(cursor: PageCursor | None) -> RawPayload:
        return spec.extract(ExtractRequest(source=spec.name, partition_key=key,
                                           resource=resource, cursor=cursor))

    # One page ahead: the next page is requested as soon as this one names it, and lands
    # while the source prepares it (the pages are still asked for one at a time, in order).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fetch-{spec.name}") as ahead:
        fetching = ahead.submit(fetch, cursor)
        while True:
            try:
                raw = fetching.result()
            except PageCursorExpired as expired:
                context.log.warning(f"{spec.name} [{key}] page {number}: {expired}; fetching "
                                    "it again from after the last item received")
                cursor = PageCursor(None, cursor.resume_after if cursor else None)
                fetching = ahead.submit(fetch, cursor)
                continue
            except Exception as exc:
                return _fail_or_set_aside(context, StepContext(spec.name, key, "extract"),
                                          spec.extract_retry, exc,
                                          len(context.partition_keys) > 1)
            if raw.next_cursor is not None:
                fetching = ahead.submit(fetch, raw.next_cursor)
            pages.append(landing.land(
                spec.name, key, raw.content, content_type=raw.content_type, origin=raw.origin,
                fetched_at=datetime.now(UTC), run_id=context.run_id, page=number,
                cursor=asdict(cursor) if cursor else None,
                next_cursor=asdict(raw.next_cursor) if raw.next_cursor else None,
                durable=False,
            ))
            if raw.next_cursor is None:
                return LandedPages(tuple(pages), resumed_after)
            cursor, number = raw.next_cursor, number + 1


def _stopped_midway(context: OpExecutionContext, key: str) -> str | None:
    """The partition's latest run before this one, if its landed pages may be taken up: it
    neither finished (a window synced since is synced afresh) nor failed for a permanent reason
    (a bad page is fetched again, not parsed again); it was killed, or failed transiently."""
    earlier = [record.dagster_run for record in context.instance.get_run_records(
        RunsFilter(tags={PARTITION_TAG: key}), limit=2)
        if record.dagster_run.run_id != context.run_id]
    if not earlier or earlier[0].status is DagsterRunStatus.SUCCESS:
        return None
    run_id = earlier[0].run_id
    for entry in context.instance.all_logs(run_id, of_type=DagsterEventType.STEP_FAILURE):
        failure = entry.dagster_event.step_failure_data.user_failure_data
        error_class = failure.metadata.get("mostovik/error_class") if failure else None
        if error_class is None or error_class.value != "transient":
            return None
    return run_id


def _cursor(record: dict | None) -> PageCursor | None:
    return PageCursor(**record) if record else None


def _transform_partition(context: OpExecutionContext, spec: SourceSpec, key: str,
                         landed: LandedPayload | LandedPages
                         ) -> TransformedPartition | TransformedPages | PartitionSkipped | (
                             PartitionFailure):
    if isinstance(landed, LandedPages):
        return _transform_pages(context, spec, key, landed)
    landing = getattr(context.resources, LANDING_KEY)
    try:
        parsed = spec.transform(TransformRequest(
            source=spec.name, partition_key=key, content=landing.read(landed),
            content_type=landed.content_type, fetched_at=landed.fetched_at,
        ))
        validated = validate_partition(parsed, spec.load_target, key, spec.max_rejected_share)
    except PartitionNotAvailable as not_yet:
        context.log.info(f"{spec.name} [{key}] not available yet: {not_yet}; "
                         "nothing loaded, a later run will pick it up")
        return PartitionSkipped(key, f"not available yet: {not_yet}")
    except Exception as exc:
        return _fail_or_set_aside(context, StepContext(spec.name, key, "transform"), NO_RETRY,
                                  exc, len(context.partition_keys) > 1)
    if validated.rejected:
        context.log.warning(
            f"{spec.name} [{key}]: {len(validated.rejected)} rows rejected to quarantine, "
            f"first: row {validated.rejected[0].row_number}: {validated.rejected[0].reason}"
        )
    return TransformedPartition(
        validated.frame, landed, validated.duplicates_dropped, validated.rejected,
        None if validated.row_numbers is None else tuple(validated.row_numbers.tolist()))


def _transform_pages(context: OpExecutionContext, spec: SourceSpec, key: str,
                     landed: LandedPages) -> TransformedPages | PartitionFailure:
    """Parse every landed page and validate them in groups of ``rows_per_commit`` rows, each
    group's rows kept on disk for the load: memory holds one group, never the window. Rows are
    numbered by their place among the items this run received for the window; a quarantined
    row's reason names its page."""
    landing = getattr(context.resources, LANDING_KEY)
    groups: list[TransformedPageGroup] = []
    group = _PageGroup()
    received = 0
    digest = hashlib.sha256()
    for position, page in enumerate(landed.pages, 1):
        number = page.page or position
        try:
            parsed = spec.transform(TransformRequest(
                source=spec.name, partition_key=key, content=landing.read(page),
                content_type=page.content_type, fetched_at=page.fetched_at,
                cursor=_cursor(page.cursor),
            ))
        except Exception as exc:
            return _fail_or_set_aside(
                context, StepContext(spec.name, key, f"transform (page {number})"), NO_RETRY,
                exc, len(context.partition_keys) > 1)
        received = group.add(number, parsed, received)
        digest.update(page.content_hash.encode())
        if group.rows < spec.rows_per_commit and position < len(landed.pages):
            continue
        pages = f"pages {group.first_page}-{number}" if group.first_page != number else (
            f"page {number}")
        try:
            validated = validate_partition(group.parsed(), spec.load_target, key,
                                           spec.max_rejected_share)
        except Exception as exc:
            return _fail_or_set_aside(
                context, StepContext(spec.name, key, f"transform ({pages})"), NO_RETRY, exc,
                len(context.partition_keys) > 1)
        groups.append(TransformedPageGroup(
            group.first_page, number, landing.keep_frame(page, validated.frame),
            len(validated.frame), group.on_their_pages(validated.rejected),
            validated.duplicates_dropped, page.next_cursor))
        group = _PageGroup()
    if any(g.rejected for g in groups):
        first = next(r for g in groups for r in g.rejected)
        context.log.warning(
            f"{spec.name} [{key}]: {sum(len(g.rejected) for g in groups)} rows rejected to "
            f"quarantine, first: row {first.row_number}: {first.reason}")
    return TransformedPages(
        tuple(groups), landed.resumed_after_page, len(landed.pages),
        sum(page.size_bytes for page in landed.pages), digest.hexdigest(),
        landed.pages[0].fetched_at if landed.pages else None)


@dataclass
class _PageGroup:
    """Pages parsed, not yet validated: their rows, row numbers and rejected rows."""

    first_page: int = 0
    rows: int = 0
    frames: list = field(default_factory=list)
    columns: dict[str, list] | None = None
    """Rows of the latest pages given as columns, not yet a frame: one frame per group."""
    numbers: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    """(first row number, page number) of each page, to tell which page a row came from."""

    def add(self, page: int, parsed, received: int) -> int:
        """Take a parsed page whose rows are numbered from ``received`` + 1; returns the
        numbering's next start."""
        parsed = parsed if isinstance(parsed, ParsedRows) else ParsedRows(parsed)
        rows = parsed.frame
        if isinstance(rows, pd.DataFrame):
            self._columns_to_frame()
            self.frames.append(rows)
            count = len(rows)
        else:
            if self.columns is not None and list(self.columns) != list(rows):
                self._columns_to_frame()
            if self.columns is None:
                self.columns = {name: [] for name in rows}
            for name, values in rows.items():
                self.columns[name].extend(values)
            count = len(next(iter(rows.values()), ()))
        local = (list(parsed.row_numbers) if parsed.row_numbers is not None
                 else list(range(1, count + 1)))
        self.first_page = self.first_page or page
        self.rows += count
        self.numbers += [received + n for n in local]
        self.rejected += [dataclasses.replace(r, row_number=received + r.row_number)
                          for r in parsed.rejected]
        self.starts.append((received + 1, page))
        return received + max(count + len(parsed.rejected), *local,
                              *(r.row_number for r in parsed.rejected), 0)

    def _columns_to_frame(self) -> None:
        if self.columns is not None:
            self.frames.append(columns_frame(self.columns))
            self.columns = None

    def parsed(self) -> ParsedRows:
        self._columns_to_frame()
        frame = (pd.concat(self.frames, ignore_index=True) if len(self.frames) > 1
                 else self.frames[0].reset_index(drop=True))
        return ParsedRows(frame, self.rejected, self.numbers)

    def on_their_pages(self, rejected: tuple[RejectedRow, ...]) -> tuple[RejectedRow, ...]:
        firsts = [start for start, _ in self.starts]

        def page_of(row: RejectedRow) -> int:
            return self.starts[max(bisect.bisect_right(firsts, row.row_number) - 1, 0)][1]

        return tuple(dataclasses.replace(row, reason=f"page {page_of(row)}: {row.reason}")
                     for row in rejected)


def _kept_rows(spec: SourceSpec, rejected: tuple[RejectedRow, ...]) -> KeptRows | None:
    """The stored rows the load keeps for the rejected ones: a rejected row is not absent."""
    if not rejected:
        return None
    keys = [row.key for row in rejected if row.key is not None]
    frame = pd.DataFrame(keys, columns=list(spec.natural_key))
    return KeptRows(frame, all_vanished=len(keys) < len(rejected))


def _inherited(context: OpExecutionContext, received) -> bool:
    return not (isinstance(received, StepOutcomes) and received.run_id == context.run_id)


def _redo(context: OpExecutionContext, spec: SourceSpec, *, transform: bool) -> dict:
    """The first step of a re-execution: every partition the runs it repeats did not load is
    fetched again (and transformed, for the load step); their stored outputs are history."""
    loaded = _partitions_loaded_by_lineage(context, AssetKey(spec.name))
    outcomes: dict = {}
    for key in context.partition_keys:
        if key in loaded:
            outcomes[key] = PartitionLoaded(key, loaded[key])
            continue
        landed = _extract_partition(context, spec, key, reuse_landed=False)
        outcomes[key] = (_transform_partition(context, spec, key, landed)
                         if transform and isinstance(landed, LandedPayload | LandedPages)
                         else landed)
    if loaded:
        context.log.info(f"{spec.name}: re-execution; {len(loaded)} partition(s) already loaded "
                         f"by the run it repeats, {len(outcomes) - len(loaded)} fetched again")
    return outcomes


def _stopped(context: OpExecutionContext, reason: str) -> StepOutcomes:
    return StepOutcomes(context.run_id,
                        {key: PartitionSkipped(key, reason) for key in context.partition_keys})


# --- the three ops -------------------------------------------------------------------------------


def _extract_op(spec: SourceSpec):
    @op(
        name=f"extract_{spec.name}",
        description=f"Fetch partitions of {spec.name} and land the raw payloads.",
        required_resource_keys={source_resource_key(spec), LANDING_KEY, WAREHOUSE_KEY},
        tags=_op_tags(spec),
    )
    def extract(context: OpExecutionContext, config: ExtractConfig) -> StepOutcomes:
        with _step(context, spec):
            reason = _older_run_stops_this_one(context, spec)
            if reason:
                return _stopped(context, reason)
            outcomes = {key: _extract_partition(context, spec, key, config.reuse_landed,
                                                config.full_resync)
                        for key in context.partition_keys}
            landed = [payload for o in outcomes.values()
                      for payload in (o.pages if isinstance(o, LandedPages) else [o])
                      if isinstance(payload, LandedPayload)]
            context.log.info(
                f"{spec.name}: landed {len(landed)} payload(s) for {len(outcomes)} partition(s), "
                f"{sum(o.size_bytes for o in landed)} bytes"
            )
            return StepOutcomes(context.run_id, outcomes)

    return extract


def _transform_op(spec: SourceSpec):
    @op(
        name=f"transform_{spec.name}",
        description=f"Parse and validate the landed payloads of {spec.name}.",
        required_resource_keys={source_resource_key(spec), LANDING_KEY, WAREHOUSE_KEY},
        tags=_op_tags(spec),
    )
    def transform(context: OpExecutionContext, extracted) -> StepOutcomes:
        with _step(context, spec):
            if _inherited(context, extracted):
                reason = _older_run_stops_this_one(context, spec)
                if reason:
                    return _stopped(context, reason)
                return StepOutcomes(context.run_id, _redo(context, spec, transform=True))
            outcomes = {
                key: _transform_partition(context, spec, key, landed)
                if isinstance(landed, LandedPayload | LandedPages) else landed
                for key, landed in extracted.partitions.items()
            }
            return StepOutcomes(context.run_id, outcomes)

    return transform


def _load_op(spec: SourceSpec, check_outputs: list[str]):
    asset_key = AssetKey(spec.name)

    @op(
        name=f"load_{spec.name}",
        description=f"Upsert partitions of {spec.name} into {spec.table.name} and check them.",
        required_resource_keys={WAREHOUSE_KEY, source_resource_key(spec), LANDING_KEY},
        out={"result": Out(is_required=False),
             **{name: Out(is_required=False) for name in check_outputs}},
        tags=_op_tags(spec),
    )
    def load(context: OpExecutionContext, transformed):
        with _step(context, spec):
            if _inherited(context, transformed):
                reason = _older_run_stops_this_one(context, spec)
                outcomes = (_stopped(context, reason).partitions if reason
                            else _redo(context, spec, transform=True))
            else:
                outcomes = transformed.partitions
            summary = _load_partitions(context, spec, asset_key, outcomes)
        # The materialisations and check results are the explicit, per-partition ones above,
        # never one for the whole range: no asset output. The checks' outputs say they ran.
        for name in check_outputs:
            if name in context.selected_output_names:
                yield Output(None, output_name=name)
        context.log.info(summary)  # the job's ADR status and figures, last on the run page

    return load


@dataclass(frozen=True)
class PartitionLoad:
    """What loading one partition did, for its materialisation and its checks."""

    figures: dict
    received: ReceivedRows
    """Natural key (and version) of every row loaded."""
    received_rows: int
    """Rows the source sent, quarantined ones included."""
    payload_bytes: int
    content_hash: str
    sample: pd.DataFrame
    scratch: tuple[str, ...] = ()
    """Kept frames (paged partitions) to discard once the partition is checked."""


def _load_partitions(context: OpExecutionContext, spec: SourceSpec, asset_key: AssetKey,
                     outcomes: dict) -> str:
    """Load every partition, record its materialisation and check results, tag the run with
    its ADR status; the status and figures as one line."""
    engine = getattr(context.resources, WAREHOUSE_KEY).engine()
    already_loaded = _partitions_materialized_by_run(context, asset_key)
    ranged = len(outcomes) > 1
    skipped = [o for o in outcomes.values() if isinstance(o, PartitionSkipped)]
    failed = [o for o in outcomes.values() if isinstance(o, PartitionFailure)]
    loaded_values = [spec.load_target.partition_value(key) for key in already_loaded]
    checked = {key.name for key in context.selected_asset_check_keys}
    rejected = 0
    totals: dict[str, int] = {}
    for key, outcome in outcomes.items():
        if not isinstance(outcome, TransformedPartition | TransformedPages) or (
                key in already_loaded):
            continue
        started = time.monotonic()
        try:
            if isinstance(outcome, TransformedPages):
                loaded = _load_pages(context, spec, engine, key, outcome)
            else:
                loaded = _load_whole(context, spec, engine, key, outcome)
        except PartitionSuperseded as superseded:
            context.log.warning(f"{spec.name} [{key}] superseded: {superseded}")
            skipped.append(PartitionSkipped(key, f"superseded: {superseded}"))
            continue
        except Exception as exc:
            failed.append(_fail_or_set_aside(
                context, StepContext(spec.name, key, "load"), spec.load_retry, exc, ranged))
            continue
        figures = loaded.figures
        rejected += figures["rejected"]
        for name, n in figures.items():
            if isinstance(n, int):
                totals[name] = totals.get(name, 0) + n
        context.log.info(f"{spec.name} [{key}] loaded: {figures}")
        context.log_event(AssetMaterialization(
            asset_key=asset_key, partition=key,
            metadata={
                **{name: MetadataValue.int(n) if isinstance(n, int) else n
                   for name, n in figures.items()},
                "duration_seconds": MetadataValue.float(round(time.monotonic() - started, 3)),
                "payload_bytes": MetadataValue.int(loaded.payload_bytes),
                "content_hash": loaded.content_hash,
                "preview": preview(loaded.sample),
            },
        ))
        loaded_values.append(spec.load_target.partition_value(key))
        evaluations = [evaluation for evaluation in evaluate_partition(
            engine, spec, key, context.run_id, loaded.received, loaded.received_rows,
            loaded_values, context.instance) if evaluation.check_name in checked]
        for evaluation in evaluations:
            context.log_event(evaluation)
        for path in loaded.scratch:
            getattr(context.resources, LANDING_KEY).discard_frame(path)
        blocked = [e for e in evaluations if blocks(e)]
        if blocked:
            failed.append(_fail_or_set_aside(
                context, StepContext(spec.name, key, "check"), NO_RETRY, PartitionCheckFailed(
                    "; ".join(f"{e.check_name}: {e.description}" for e in blocked)), ranged))
            continue
        _after_load(context, spec, key, "partial" if figures["rejected"] else "loaded")
    if skipped or failed:
        context.log_event(AssetObservation(asset_key=asset_key, metadata={
            "mostovik/skipped": MetadataValue.json({o.partition_key: o.reason for o in skipped}),
            "mostovik/failed": MetadataValue.json({o.partition_key: o.message for o in failed}),
        }))
    if failed:
        shown = "; ".join(f.message for f in failed[:SHOWN_FAILURES])
        raise Failure(
            description=f"{spec.name}: {len(failed)} of {len(outcomes)} partitions "
                        f"failed: {shown}",
            metadata={"mostovik/failed_partitions": MetadataValue.json(
                [f.partition_key for f in failed])},
            allow_retries=False,
        )
    status = completed_or_partial(rejected, {o.partition_key: o.reason for o in skipped},
                                  ranged=ranged)
    context.instance.add_run_tags(context.run_id, {STATUS_TAG: status.value})
    figures = ", ".join(f"{name} {n}" for name, n in totals.items() if name in LOAD_COUNT_KEYS)
    return (f"{spec.name}: job {status.value}; {len(outcomes)} partition(s)"
            + (f"; {figures}" if figures else ""))


def _after_load(context: OpExecutionContext, spec: SourceSpec, key: str, outcome: str) -> None:
    if spec.after_load is None:
        return
    try:
        spec.after_load(LoadedPartition(spec.name, key,
                                        getattr(context.resources, source_resource_key(spec)),
                                        outcome, context.run_id))
    except Exception as exc:  # the load is committed; what follows it must not undo the job
        context.log.warning(f"{spec.name} [{key}]: after the load: {classify(exc).reason}")


def _load_whole(context: OpExecutionContext, spec: SourceSpec, engine, key: str,
                outcome: TransformedPartition) -> PartitionLoad:
    """One transaction: the partition's rows, its quarantine (rows rejected by transform, and
    rows whose key another partition value holds, when the source rejects those)."""
    quarantined: list[RejectedRow] = []

    def quarantine(connection, counts: LoadCounts) -> None:
        quarantined[:] = [*outcome.rejected,
                          *_held_elsewhere(outcome.frame, outcome.row_numbers, counts)]
        replace_quarantine(connection, spec.name, key, context.run_id, quarantined)

    counts = load_partition(
        engine, spec.load_target, outcome.frame, key, context.run_id,
        within_transaction=quarantine, fetched_at=outcome.landed.fetched_at,
        kept=_kept_rows(spec, outcome.rejected),
    )
    figures = counts.as_dict(merge=spec.load_mode is LoadMode.MERGE_BY_VERSION)
    return PartitionLoad(
        figures={
            **figures, "rejected": len(quarantined),
            "duplicates_dropped": outcome.duplicates_dropped,
            "dagster/row_count": len(outcome.frame), "table": spec.table.name,
            "fetched_at": outcome.landed.fetched_at.isoformat(),
        },
        received=ReceivedRows.of(outcome.frame[_received_columns(spec)]),
        received_rows=len(outcome.frame) + len(outcome.rejected),
        payload_bytes=outcome.landed.size_bytes,
        content_hash=outcome.landed.content_hash,
        sample=outcome.frame.head(PREVIEW_ROWS),
    )


def _received_columns(spec: SourceSpec) -> list[str]:
    """What the checks compare with the table: the natural key, and the version."""
    return [*spec.natural_key, *([spec.version_column] if spec.version_column else [])]


def _held_elsewhere(frame: pd.DataFrame, row_numbers: tuple[int, ...] | None,
                    counts: LoadCounts) -> list[RejectedRow]:
    """The rows the load left out because another partition value holds their keys, numbered
    by their place in the payload."""
    rejected = []
    for held in counts.held_elsewhere:
        key = {k: v for k, v in held.items() if k != "held_by"}
        match = frame.index[(frame[list(key)] == pd.Series(key)).all(axis=1)]
        index = int(match[0]) if len(match) else None
        position = (0 if index is None else row_numbers[index] if row_numbers is not None
                    else index + 1)
        raw = row_text(frame.loc[index]) if index is not None else str(key)
        rejected.append(RejectedRow(
            position, raw, f"key {key} is already held by {held['held_by']}: not overwritten",
            key=None))
    return rejected


def _load_pages(context: OpExecutionContext, spec: SourceSpec, engine, key: str,
                outcome: TransformedPages) -> PartitionLoad:
    """Each group of pages in a transaction of its own, with the partition's progress
    checkpoint at the group's last page: the checkpoint never runs ahead of the rows it vouches
    for."""
    landing = getattr(context.resources, LANDING_KEY)
    progress = committed_progress(engine, spec.name, key)
    done = (progress.pages_committed
            if progress is not None and progress.run_id == context.run_id else 0)
    totals: dict[str, int] = {}
    rows = rejected = 0
    sample = None
    for group in outcome.groups:
        rows += group.rows
        rejected += len(group.rejected)
        if group.last_page <= done:
            continue  # committed by this run before its load step was retried
        frame = landing.read_frame(group.frame_path)
        if sample is None:
            sample = frame.head(PREVIEW_ROWS)

        def commit_progress(connection, counts: LoadCounts, group=group) -> None:
            replace_quarantine(connection, spec.name, key, context.run_id, group.rejected,
                               append=group.first_page > 1)
            save_progress(connection, spec.name, key, group.last_page,
                          _cursor(group.next_cursor), context.run_id)

        counts = load_partition(engine, spec.load_target, frame, key, context.run_id,
                                within_transaction=commit_progress, whole_partition=False)
        del frame
        for name, n in counts.as_dict(merge=True).items():
            totals[name] = totals.get(name, 0) + n
    columns = _received_columns(spec)
    paths = tuple(group.frame_path for group in outcome.groups)
    return PartitionLoad(
        figures={
            **{name: totals.get(name, 0) for name in LoadCounts.figures(merge=True)},
            "rejected": rejected, "pages": outcome.pages,
            "resumed_after_page": outcome.resumed_after_page,
            "dagster/row_count": rows, "table": spec.table.name,
            "fetched_at": outcome.fetched_at.isoformat() if outcome.fetched_at else "",
        },
        received=ReceivedRows(lambda: (landing.read_frame(path, columns) for path in paths)),
        received_rows=rows + rejected,
        payload_bytes=outcome.payload_bytes,
        content_hash=outcome.content_hash,
        sample=sample if sample is not None else pd.DataFrame(columns=spec.load_target.columns),
        scratch=paths,
    )


def _materialized_partitions(context: OpExecutionContext, run_id: str,
                             asset_key: AssetKey) -> set[str]:
    records = context.instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION
    ).records
    return {
        record.event_log_entry.asset_materialization.partition for record in records
        if record.event_log_entry.asset_materialization.asset_key == asset_key
    }


def _partitions_materialized_by_run(context: OpExecutionContext, asset_key: AssetKey) -> set:
    """Partitions this run already loaded (before a retry of the load step)."""
    if context.retry_number == 0:
        return set()
    return _materialized_partitions(context, context.run_id, asset_key)


def _partitions_loaded_by_lineage(context: OpExecutionContext,
                                  asset_key: AssetKey) -> dict[str, str]:
    """Partition -> run, for the partitions the runs this run re-executes (its parent, its
    parent's parent, ...) loaded."""
    loaded: dict[str, str] = {}
    run_id = context.run.parent_run_id
    while run_id:
        for key in _materialized_partitions(context, run_id, asset_key):
            loaded.setdefault(key, run_id)
        parent = context.instance.get_run_by_id(run_id)
        run_id = parent.parent_run_id if parent else None
    return loaded


def _schedule(spec: SourceSpec, job):
    assert spec.schedule is not None
    latest = spec.schedule.latest_partitions

    @schedule(
        name=f"{spec.name}_schedule",
        cron_schedule=spec.schedule.cron,
        execution_timezone=spec.schedule.timezone,
        job=job,
        default_status=DefaultScheduleStatus.RUNNING,
        description=f"Refresh the {latest} newest partition(s) of {spec.name}.",
    )
    def refresh_latest_partitions(context: ScheduleEvaluationContext):
        keys = spec.partitions_def.get_partition_keys(
            current_time=context.scheduled_execution_time
        )
        tick = (context.scheduled_execution_time or datetime.now(UTC)).isoformat()
        for key in keys[-latest:]:
            yield RunRequest(partition_key=key, run_key=f"{key}@{tick}")

    return refresh_latest_partitions
