"""The extract op's work: call the source for each partition and land the raw bytes; a paged
source's pages from where its committed progress (or a killed run's landed pages) left off."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import UTC, datetime

from dagster import DagsterEventType, DagsterRunStatus, OpExecutionContext, RunsFilter

from mostovik_pipelines.core.errors import (
    ConfigurationError,
    PageCursorExpired,
    PermanentError,
)
from mostovik_pipelines.core.retries import NO_RETRY, StepContext
from mostovik_pipelines.core.tags import PARTITION_TAG
from mostovik_pipelines.framework.assets.resource_keys import (
    LANDING_KEY,
    WAREHOUSE_KEY,
    source_resource_key,
)
from mostovik_pipelines.framework.assets.stored_payload import stored_payload_hashes
from mostovik_pipelines.framework.spec import ExtractRequest, PageCursor, RawPayload, SourceSpec
from mostovik_pipelines.framework.steps.lifecycle import (
    fail_or_set_aside,
    ranged_run,
    riding_out,
)
from mostovik_pipelines.framework.steps.outcomes import LandedPages, PartitionFailure, page_cursor
from mostovik_pipelines.framework.steps.sync_progress import (
    committed_progress,
    pages_to_resume,
    settle_moment,
)
from mostovik_pipelines.resources.landing import LandedPayload


def extract_partition(context: OpExecutionContext, spec: SourceSpec, key: str,
                       reuse_landed: bool, full_resync: bool = False,
                       ) -> LandedPayload | LandedPages | PartitionFailure:
    """The partition fetched and landed (what this run landed of it already is kept), riding
    out the landing store or the warehouse being away."""
    return riding_out(context, StepContext(spec.name, key, "extract"), lambda: _extract(
        context, spec, key, reuse_landed, full_resync))


def _extract(context: OpExecutionContext, spec: SourceSpec, key: str, reuse_landed: bool,
             full_resync: bool) -> LandedPayload | LandedPages | PartitionFailure:
    if spec.paged:
        if reuse_landed:
            return fail_or_set_aside(
                context, StepContext(spec.name, key, "extract"), NO_RETRY, ConfigurationError(
                    "reuse_landed re-transforms one payload; a paged source lands many: "
                    "run it again (it resumes after its committed pages) or with full_resync"),
                ranged_run(context))
        return _extract_pages(context, spec, key, full_resync)
    landing = getattr(context.resources, LANDING_KEY)
    ranged = ranged_run(context)
    if reuse_landed:
        return _reuse_landed(context, spec, key, ranged)
    latest = landing.latest(spec.name, key)
    if latest is not None and latest.run_id == context.run_id:
        return latest
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
        return fail_or_set_aside(context, StepContext(spec.name, key, "extract"),
                                  spec.extract_retry, exc, ranged)


def _reuse_landed(context: OpExecutionContext, spec: SourceSpec, key: str,
                  ranged: bool) -> LandedPayload | PartitionFailure:
    """The payload the partition's stored rows came from (not a later fetch that was
    rejected); for a partition never loaded, its latest fetch. Refused, the stored rows left as
    they are, when that payload is no longer landed whole."""
    landing = getattr(context.resources, LANDING_KEY)
    stored = stored_payload_hashes(context.instance, spec.name, [key]).get(key)
    payload = (landing.latest(spec.name, key) if stored is None
               else landing.landed_with(spec.name, key, stored))
    if payload is not None and landing.is_whole(payload):
        return payload
    if stored is None:
        error = PermanentError(f"reuse_landed: {spec.name} [{key}]: nothing landed yet to "
                               "re-transform")
    else:
        error = PermanentError(
            f"reuse_landed: {spec.name} [{key}]: the payload the stored rows came from "
            f"(content hash {stored[:12]}) is no longer in the landing store, so it cannot be "
            "re-transformed; the stored rows are left as they are. Run the partition without "
            "reuse_landed to fetch it from the source again")
    return fail_or_set_aside(context, StepContext(spec.name, key, "extract"), NO_RETRY, error,
                             ranged)


def _extract_pages(context: OpExecutionContext, spec: SourceSpec, key: str,
                   full_resync: bool) -> LandedPages | PartitionFailure:
    """Land the partition's pages, starting after its committed progress (or after what this
    run already landed, in a retried step): a committed page is never fetched again, unless it
    was fetched before the window settled and this run started after (:func:`settle_moment`).
    An expired page token restarts the page with the window narrowed to after the last item
    received."""
    landing = getattr(context.resources, LANDING_KEY)
    mine = landing.pages_landed_by(spec.name, key, context.run_id)
    if mine:
        resumed_after = (mine[0].page or 1) - 1
        cursor = page_cursor(mine[-1].next_cursor)
        if cursor is None:
            return LandedPages(tuple(mine), resumed_after)
    else:
        engine = getattr(context.resources, WAREHOUSE_KEY).engine()
        settled = _settled_before_this_run(context, spec, key)
        progress = None if full_resync else committed_progress(engine, spec.name, key)
        if progress and settled and not _started_after(context, progress.run_id, settled):
            context.log.info(
                f"{spec.name} [{key}]: not resuming after page {progress.pages_committed} "
                f"committed by run {progress.run_id}: that run started before the window "
                f"settled ({settled.isoformat()}), so a change made visible late behind those "
                "pages would be missed; syncing the window from its start")
            progress = None
        resumed_after = progress.pages_committed if progress else 0
        cursor = progress.next_cursor if progress else None
        if progress:
            context.log.info(f"{spec.name} [{key}]: resuming after page {resumed_after} "
                             f"(committed by run {progress.run_id})")
        stopped = None if full_resync else _stopped_midway(context, key)
        if stopped is not None:
            mine = pages_to_resume(landing.pages_landed_by(spec.name, key, stopped),
                                   resumed_after, cursor, landing.is_whole)
        if mine and settled and min(page.fetched_at for page in mine) < settled:
            context.log.info(
                f"{spec.name} [{key}]: not taking up pages {mine[0].page}-{mine[-1].page} "
                f"landed by run {mine[0].run_id}: they were fetched before the window settled "
                f"({settled.isoformat()}), so a change made visible late behind them would be "
                "missed; fetching them again")
            mine = []
        if mine:
            context.log.info(
                f"{spec.name} [{key}]: taking up pages {mine[0].page}-{mine[-1].page} landed by "
                f"run {mine[0].run_id}, which stopped before committing them")
            cursor = page_cursor(mine[-1].next_cursor)
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
                return fail_or_set_aside(context, StepContext(spec.name, key, "extract"),
                                          spec.extract_retry, exc,
                                          ranged_run(context))
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


def _settled_before_this_run(context: OpExecutionContext, spec: SourceSpec,
                             key: str) -> datetime | None:
    """The window's settle moment if this run started after it (what was fetched before it may
    then lack late changes), else None."""
    settled = settle_moment(spec, key)
    if settled is None or not _started_after(context, context.run_id, settled):
        return None
    return settled


def _started_after(context: OpExecutionContext, run_id: str, moment: datetime) -> bool:
    """Whether run ``run_id`` started at or after ``moment`` (a run no longer in run storage
    counts as earlier: reading its window again is safe, trusting it is not)."""
    record = context.instance.get_run_record_by_id(run_id)
    if record is None:
        return False
    started = record.start_time or record.create_timestamp.timestamp()
    return started >= moment.timestamp()
