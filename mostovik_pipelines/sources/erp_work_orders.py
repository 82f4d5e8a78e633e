"""Work orders from the project-management (ERP) API, synced incrementally by day of change.

Each daily partition is the window [day, day + 1) of ``updated_at`` in Moscow time (by
default). The API pages a window by opaque tokens that expire (410) and is rate-limited (429
with Retry-After); items come ordered by (``updated_at``, ``id``). Only a record's latest
version is visible, in the window of its latest change: a record updated again later moves to
its newer window, and a deletion arrives as a tombstone (``deleted: true``) there. So the table
is merged by version: a record wins only with a newer ``version`` (64-bit), tombstones mark the
record deleted and keep it, and nothing is deleted because it is absent from a window.
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation
from zoneinfo import ZoneInfo

import orjson
from dagster import BackfillPolicy, EnvVar, FreshnessPolicy
from sqlalchemy import BigInteger, Boolean, Column, Date, DateTime, Index, String, Text

from mostovik_pipelines.etl.errors import (
    PageCursorExpired,
    SourceContractError,
    SourceRequestRejected,
)
from mostovik_pipelines.etl.load_target import KeyHeldElsewhere, LoadMode
from mostovik_pipelines.etl.retries import RetryPolicy
from mostovik_pipelines.etl.spec import (
    ExtractRequest,
    JobType,
    PageCursor,
    ParsedRows,
    RawPayload,
    RejectedRow,
    SourceSchedule,
    SourceSpec,
    TransformRequest,
)
from mostovik_pipelines.partitions import erp_work_orders_daily_partition
from mostovik_pipelines.resources.http import HttpSourceResource
from mostovik_pipelines.settings import setting
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal

URL_SETTING = "MOSTOVIK_ERP_URL"
WORK_ORDERS_PATH = "api/v1/work-orders"
PAGE_SIZE = int(setting("MOSTOVIK_ERP_PAGE_SIZE", "100"))
ROWS_PER_COMMIT = int(setting("MOSTOVIK_ERP_ROWS_PER_COMMIT", "5000"))
"""Work orders per transaction (50 pages of 100): a crash re-fetches at most that many."""
TIMEZONE = ZoneInfo(erp_work_orders_daily_partition.timezone)
STATUSES = ("planned", "in_progress", "done", "cancelled")
FIELDS = ("id", "object_code", "title", "status", "planned_start", "planned_finish", "amount",
          "updated_at", "version", "deleted")

erp_work_orders = warehouse_table(
    "erp_work_orders",
    Column("id", String(64), nullable=False, comment="the ERP's work order id"),
    Column("object_code", String(64), nullable=False, comment="construction site or bridge"),
    Column("title", Text, nullable=False),
    Column("status", String(16), nullable=False, comment=", ".join(STATUSES)),
    Column("planned_start", Date, nullable=True),
    Column("planned_finish", Date, nullable=True),
    Column("amount", ExactDecimal(), nullable=False, comment="roubles, exact"),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("version", BigInteger, nullable=False, comment="grows with every change"),
    Column("deleted", Boolean, nullable=False, comment="a tombstone: deleted at the source"),
    Column("window_date", Date, nullable=False,
           comment="the sync window (day of updated_at) the record's version came in"),
    Index("ix_erp_work_orders_window_date", "window_date"),
    natural_key=("id",),
)


def window_bounds(partition_key: str) -> tuple[datetime, datetime]:
    day = date.fromisoformat(partition_key)
    start = datetime.combine(day, time(), TIMEZONE)
    return start, datetime.combine(day + timedelta(days=1), time(), TIMEZONE)


def extract(request: ExtractRequest) -> RawPayload:
    """One page of the window: the first, the one a token points to, or (the token expired)
    the window narrowed to start at the last item already received."""
    start, end = window_bounds(request.partition_key)
    cursor = request.cursor or PageCursor()
    resume = cursor.resume_after or {}
    params = {"updated_to": end.isoformat(), "page_size": str(PAGE_SIZE)}
    if cursor.token:
        # A token continues the very query that issued it.
        params["page_token"] = cursor.token
        params["updated_from"] = resume.get("query_from") or start.isoformat()
    else:
        params["updated_from"] = resume.get("updated_at") or start.isoformat()
    try:
        response = request.resource.get(params=params, path=WORK_ORDERS_PATH)
    except SourceRequestRejected as rejected:
        if rejected.status == 410 and cursor.token:
            raise PageCursorExpired(f"the page token has expired: {rejected}") from rejected
        raise
    page = _page(response.content)
    items = page["items"]
    next_token = page.get("next_page_token")
    last = items[-1] if items else None
    resume_after = {"query_from": params["updated_from"]}
    if last:
        resume_after.update(updated_at=last["updated_at"], id=last["id"])
    elif resume.get("updated_at"):
        resume_after.update(updated_at=resume["updated_at"], id=resume["id"])
    return RawPayload(
        content=response.content, content_type="application/json", origin=response.url,
        next_cursor=PageCursor(next_token, resume_after) if next_token else None,
    )


def transform(request: TransformRequest) -> ParsedRows:
    """The page's items as rows; an item that cannot be read is rejected with the reason."""
    items = _page(request.content)["items"]
    after = _sort_key_of((request.cursor.resume_after if request.cursor else None) or {})
    columns: dict[str, list] = {name: [] for name in FIELDS}
    rejected, numbers = [], []
    for position, item in enumerate(items, 1):
        try:
            row = _row(item)
        except (KeyError, TypeError, ValueError, InvalidOperation) as defect:
            rejected.append(RejectedRow(
                position, json.dumps(item, ensure_ascii=False, default=str)[:4000],
                f"work order #{position}: {defect}",
                key={"id": str(item["id"])} if isinstance(item, dict) and item.get("id") else None,
            ))
            continue
        if after and (row[UPDATED_AT], row[0]) <= after:
            continue  # a narrowed window repeats what was already received
        for values, value in zip(columns.values(), row, strict=True):
            values.append(value)
        numbers.append(position)
    columns["window_date"] = [date.fromisoformat(request.partition_key)] * len(numbers)
    return ParsedRows(columns, rejected, numbers)  # columns: the framework builds the frame


def _page(content: bytes) -> dict:
    try:
        page = orjson.loads(content)
    except orjson.JSONDecodeError:
        try:  # orjson refuses integers beyond 64 bits: such a version is the row's defect
            page = json.loads(content)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SourceContractError(f"the work-orders page is not JSON: {exc}") from exc
    if not isinstance(page, dict) or not isinstance(page.get("items"), list):
        raise SourceContractError("the work-orders page has no 'items' list")
    return page


UPDATED_AT = FIELDS.index("updated_at")


def _row(item: dict) -> tuple:
    """An item's values in the order of :data:`FIELDS`, or ValueError saying what is wrong."""
    missing = [name for name in FIELDS if name not in item]
    if missing:
        raise ValueError(f"fields {missing} are missing")
    status = item["status"]
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
    try:
        amount = Decimal(str(item["amount"]))
    except InvalidOperation:
        amount = Decimal("NaN")
    if not amount.is_finite():
        raise ValueError(f"amount {str(item['amount'])[:40]!r} is not a decimal number")
    version = int(item["version"])
    if not 0 <= version < 2**63:
        raise ValueError(f"version {version} is beyond a 64-bit integer")
    if not isinstance(item["deleted"], bool):
        raise ValueError(f"deleted {item['deleted']!r} is not a boolean")
    return (str(item["id"]), str(item["object_code"]), str(item["title"]), status,
            _date(item.get("planned_start")), _date(item.get("planned_finish")), amount,
            _instant(item["updated_at"]), version, item["deleted"])


def _sort_key_of(resume_after: dict) -> tuple | None:
    if not resume_after.get("updated_at"):
        return None
    return _instant(resume_after["updated_at"]), str(resume_after["id"])


def _instant(value: str) -> datetime:
    """An ISO-8601 instant with its offset, in UTC (microseconds, as the table keeps it)."""
    try:
        instant = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(f"updated_at {str(value)[:40]!r} is not an ISO-8601 instant") from None
    if instant.tzinfo is None:
        raise ValueError(f"updated_at {value!r} has no offset")
    return instant.astimezone(UTC)


def _date(value: str | None) -> date | None:
    return date.fromisoformat(value) if value else None


SOURCE = SourceSpec(
    name="erp_work_orders",
    job_type=JobType.SYNC,
    description=__doc__.split("\n\n")[0].replace("\n", " "),
    partitions_def=erp_work_orders_daily_partition,
    table=erp_work_orders,
    natural_key=("id",),
    partition_column="window_date",
    load_mode=LoadMode.MERGE_BY_VERSION,
    version_column="version",
    tombstone_column="deleted",
    # A record updated again later moves to the window of its newer change.
    key_held_elsewhere=KeyHeldElsewhere.MOVE,
    paged=True,
    rows_per_commit=ROWS_PER_COMMIT,
    extract=extract,
    transform=transform,
    url_setting=URL_SETTING,
    resource=HttpSourceResource(
        base_url=setting(URL_SETTING, "http://127.0.0.1:8765/erp"),
        timeout_seconds=float(setting("MOSTOVIK_ERP_TIMEOUT_SECONDS", "30")),
        token=EnvVar("MOSTOVIK_ERP_TOKEN") if setting("MOSTOVIK_ERP_TOKEN", "") else None,
    ),
    schedule=SourceSchedule(cron="5 * * * *", timezone=TIMEZONE.key, latest_partitions=1),
    extract_retry=RetryPolicy(max_attempts=5, base_delay_seconds=2.0, max_delay_seconds=60.0),
    max_rejected_share=0.01,
    backfill_policy=BackfillPolicy.multi_run(max_partitions_per_run=31),
    max_runtime_seconds=60 * 60,
    protocol="rest",
    # The schedule syncs today's window every hour: two hours without a sync means it stopped.
    freshness_policy=FreshnessPolicy.time_window(
        fail_window=timedelta(hours=2), warn_window=timedelta(minutes=90)),
)
