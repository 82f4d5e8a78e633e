"""The progress checkpoint of a paged partition (a sync window): which pages are committed, and
where the next one starts.

The checkpoint is written by the load of each page, in that page's own transaction, so it can
never run ahead of the data it vouches for (the classic failure of sync tools: state saved
before data, rows lost on resume). A retry or re-run starts after the last committed page: with
the committed next-page token while the source still honours it, else with a window narrowed to
start after the last committed item. The load of the last page deletes the checkpoint, so a
finished window leaves nothing behind and its next run is a full re-sync.

Pages are landed before they are committed (in groups, :attr:`SourceSpec.rows_per_commit`), so
a run that stopped (killed, or failed for a transient reason) may have landed pages past its
checkpoint. The partition's next run takes them up (:func:`pages_to_resume`) instead of
fetching them again: the chain of that run's pages that starts exactly where the checkpoint says
the next page starts and follows page to page by cursor. It fetches from the end of that chain;
the checkpoint still moves only with the committed rows.

A source with a settle time (:attr:`.CatchUpPolicy.settle`) makes a change visible up to that
long after its ``updated_at``, so a page fetched before the window's close plus the settle time
(:func:`settle_moment`) may lack a change stamped inside its range. A run that starts after that
moment takes up neither committed progress nor landed pages fetched before it: it syncs the
window from its start (the merge by version makes the pages read again harmless), so the run
that makes the window final has read all of it after it settled. Progress and pages from after
the settle moment are taken up as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from dagster import TimeWindowPartitionsDefinition
from sqlalchemy import Connection, Engine, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from mostovik_pipelines.framework.spec import JobType, PageCursor, SourceSpec
from mostovik_pipelines.resources.landing import LandedPayload
from mostovik_pipelines.warehouse.schema import sync_progress


@dataclass(frozen=True)
class Progress:
    """A partition's committed progress."""

    pages_committed: int
    next_cursor: PageCursor
    run_id: str


def committed_progress(engine: Engine, source: str, partition_key: str) -> Progress | None:
    with engine.connect() as connection:
        row = connection.execute(select(sync_progress).where(
            sync_progress.c.source == source,
            sync_progress.c.partition_key == partition_key,
        )).one_or_none()
    if row is None:
        return None
    resume_after = json.loads(row.resume_after) if row.resume_after else None
    return Progress(row.pages_committed, PageCursor(row.next_page_token, resume_after),
                    row.run_id)


def save_progress(connection: Connection, source: str, partition_key: str, pages_committed: int,
                  next_cursor: PageCursor | None, run_id: str) -> None:
    """Record that ``pages_committed`` pages are in, in the caller's (the page load's)
    transaction; ``next_cursor`` None means the partition is complete: the checkpoint goes."""
    where = (sync_progress.c.source == source, sync_progress.c.partition_key == partition_key)
    if next_cursor is None:
        connection.execute(delete(sync_progress).where(*where))
        return
    values = {
        "pages_committed": pages_committed, "next_page_token": next_cursor.token,
        "resume_after": (json.dumps(dict(next_cursor.resume_after), sort_keys=True)
                         if next_cursor.resume_after else None),
        "run_id": run_id, "committed_at": datetime.now(UTC),
    }
    dialect_insert = postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert
    connection.execute(dialect_insert(sync_progress).values(
        source=source, partition_key=partition_key, **values,
    ).on_conflict_do_update(
        index_elements=[sync_progress.c.source, sync_progress.c.partition_key], set_=values))


def pages_to_resume(landed: list[LandedPayload], pages_committed: int,
                    next_cursor: PageCursor | None,
                    whole: Callable[[LandedPayload], bool]) -> list[LandedPayload]:
    """The chain of ``landed`` pages (one run's, in page order) that continues the committed
    progress: its first page is page ``pages_committed + 1``, fetched with ``next_cursor`` (the
    window's start when nothing is committed), each next page fetched with the cursor the one
    before named, each one ``whole``. Empty when the run's pages do not continue it."""
    pages = {page.page: page for page in landed if page.page is not None}
    chain: list[LandedPayload] = []
    cursor = asdict(next_cursor) if next_cursor is not None else None
    number = pages_committed + 1
    while number in pages and pages[number].cursor == cursor and whole(pages[number]):
        chain.append(pages[number])
        if pages[number].next_cursor is None:
            break
        cursor, number = pages[number].next_cursor, number + 1
    return chain


def settle_moment(spec: SourceSpec, partition_key: str) -> datetime | None:
    """When the sync window ``partition_key`` has settled: its close plus the source's settle
    time, after which every change stamped inside it is visible. None for a source without a
    settle time (what it has fetched of a window stays true), or one that is not a sync."""
    if (spec.job_type is not JobType.SYNC or not spec.catch_up.settle
            or not isinstance(spec.partitions_def, TimeWindowPartitionsDefinition)):
        return None
    return spec.partitions_def.time_window_for_partition_key(partition_key).end + (
        spec.catch_up.settle)
