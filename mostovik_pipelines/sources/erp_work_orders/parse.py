"""The ERP's work-orders API as it answers: a day's window of ``updated_at`` asked page by
page, page tokens that expire (410, the window then narrowed to resume after the last item
received), and the items read into rows (64-bit versions, tombstones, instants with offsets).
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation
from zoneinfo import ZoneInfo

import orjson

from mostovik_pipelines.core.errors import (
    PageCursorExpired,
    SourceContractError,
    SourceRequestRejected,
)
from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.framework.quality.shape import observe_records
from mostovik_pipelines.framework.spec import (
    ExtractRequest,
    PageCursor,
    ParsedRows,
    RawPayload,
    RejectedRow,
    TransformRequest,
)

WORK_ORDERS_PATH = "api/v1/work-orders"
PAGE_SIZE = int(setting("MOSTOVIK_ERP_PAGE_SIZE", "100"))
TIMEZONE = ZoneInfo(setting("MOSTOVIK_ERP_TIMEZONE", "Europe/Moscow"))
"""The ERP's days: the daily partitions' and their windows' timezone."""
STATUSES = ("planned", "in_progress", "done", "cancelled")
FIELDS = ("id", "object_code", "title", "status", "planned_start", "planned_finish", "amount",
          "updated_at", "version", "deleted")


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
    if items:
        request.report_shape(observe_records(items))
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
