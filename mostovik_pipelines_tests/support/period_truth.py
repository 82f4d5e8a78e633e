"""The truth about a source's periods, from the warehouse and the stand-ins alone, for any
source as its declaration describes it: what one clean load of a period gives (the stand-in's
answer now, every page, read by the source's own transform and validated as the loader does),
whether the warehouse holds it, and so which due periods are not final.

The stand-ins are asked in this process, through their endpoints' own state: the faults a
test queued for the code location's runs play no part either.

* a replace-partition period (a day's rates, a day's prices, a file) is final when the ledger
  (``partition_loads``) has a load of it and the table holds exactly what a clean load gives
  (an empty day is final only once it was loaded, empty);
* a merge-by-version window (a sync's day) is final when its stand-in served its first page at
  an instant after its close and settle time (its request log, on the fake clock it was told),
  and every record the source now has in it is stored under it with its version (records
  changed again later have moved to later windows, at the source and in the warehouse alike).

What run storage, the checks, the alerts or the metrics say plays no part here: they are what
is compared with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qs, urlencode

from dagster import DagsterInstance, RunsFilter, TimeWindowPartitionsDefinition
from sqlalchemy import Boolean, Date, DateTime, Numeric, Table, select

from mostovik_pipelines.core.load_target import LoadMode
from mostovik_pipelines.core.tags import SOURCE_TAG
from mostovik_pipelines.framework.automation.deadlines import WATCH
from mostovik_pipelines.framework.quality.validation import validate_partition
from mostovik_pipelines.framework.spec import (
    ExtractRequest,
    ParsedRows,
    PartitionNotAvailable,
    SourceSpec,
    TransformRequest,
)
from mostovik_pipelines.resources.http import HttpResponse
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines.standin.endpoint import Request, discover_endpoints
from mostovik_pipelines.warehouse.schema import data_columns, partition_loads

MAX_PAGES = 10_000


def _plain(value: Any, column_type: Any) -> Any:
    """A value as text, the same whether a frame or the database holds it."""
    column_type = getattr(column_type, "impl", column_type)  # an exact decimal's NUMERIC
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(column_type, DateTime):
        instant = value.to_pydatetime() if hasattr(value, "to_pydatetime") else value
        instant = instant if instant.tzinfo else instant.replace(tzinfo=UTC)
        return instant.astimezone(UTC).isoformat()
    if isinstance(column_type, Date):
        return (value.date() if isinstance(value, datetime) else value).isoformat()
    if isinstance(value, Decimal) or isinstance(column_type, Numeric):
        return format(Decimal(str(value)).normalize(), "f")
    if isinstance(value, bool) or isinstance(column_type, Boolean):
        return str(bool(value))
    return str(value)


def _rows(records: Iterable[Mapping[str, Any]], table: Table,
          columns: Sequence[str]) -> set[tuple]:
    return {tuple(_plain(record[name], table.c[name].type) for name in columns)
            for record in records}


class _StandinAnswers:
    """The source's resource, answered by its stand-in endpoint's own state, in this process:
    what the source says, without the faults a test queued for the code location's runs."""

    def __init__(self, standin_server: StandinServer, source: str) -> None:
        self.route = discover_endpoints()[source].route
        self.state = standin_server.state.states[self.route]
        self.url = standin_server.endpoint_url(source)
        self.asked: list[dict[str, str]] = []
        """The query of every request made, in order."""

    def get(self, params: dict[str, str] | None = None, path: str = "") -> HttpResponse:
        self.asked.append(dict(params or {}))
        sub_path = "/" + path.lstrip("/") if path else ""
        served = self.state.serve(Request(sub_path, urlencode(params or {}), {}))
        assert served.reply.status == 200, (served.reply.status, served.reply.body[:300])
        return HttpResponse(served.reply.body, served.reply.content_type, self.url + sub_path)


def expected_rows(spec: SourceSpec, key: str, standin_server: StandinServer,
                  at: datetime) -> set[tuple] | None:
    """What one clean load of ``key`` would store now (its data columns), as the source's
    stand-in answers and the source's transform reads it fetched at ``at``; None while the
    source has not published it."""
    resource = _StandinAnswers(standin_server, spec.name)
    frames, cursor = [], None
    for _ in range(MAX_PAGES):
        payload = spec.extract(ExtractRequest(spec.name, key, resource, cursor))
        try:
            parsed = spec.transform(TransformRequest(
                spec.name, key, payload.content, payload.content_type, at, cursor=cursor))
        except PartitionNotAvailable:
            return None
        frames.append(parsed.as_frame() if isinstance(parsed, ParsedRows) else parsed)
        cursor = payload.next_cursor
        if cursor is None or not spec.paged:
            break
    import pandas as pd

    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    validated = validate_partition(ParsedRows(frame), spec.load_target, key, 1.0 - 1e-9)
    columns = data_columns(spec.table)
    return _rows(validated.frame.to_dict("records"), spec.table, columns)


def stored_rows(spec: SourceSpec, key: str, warehouse_url: str) -> set[tuple]:
    """The data columns of the rows the warehouse holds under ``key``."""
    table = spec.table
    columns = data_columns(table)
    value = spec.load_target.partition_value(key)
    with warehouse_engine(warehouse_url).connect() as connection:
        found = connection.execute(select(*(table.c[name] for name in columns)).where(
            table.c[spec.partition_column] == value)).mappings().all()
    return _rows(found, table, columns)


def ledger_has(spec: SourceSpec, key: str, warehouse_url: str) -> bool:
    value = str(spec.load_target.partition_value(key))
    with warehouse_engine(warehouse_url).connect() as connection:
        return connection.execute(select(partition_loads.c.row_count).where(
            partition_loads.c.table_name == spec.table.name,
            partition_loads.c.partition_key.in_([key, value]))).first() is not None


def ledger_fetched_at(spec: SourceSpec, key: str, warehouse_url: str) -> datetime | None:
    """When the payload of the period's last load was fetched (the ledger's record), if any."""
    with warehouse_engine(warehouse_url).connect() as connection:
        found = connection.execute(select(partition_loads.c.fetched_at).where(
            partition_loads.c.table_name == spec.table.name,
            partition_loads.c.partition_key == key)).scalar()
    return found if found is None or found.tzinfo else found.replace(tzinfo=UTC)


def synced_after_close(spec: SourceSpec, key: str, standin_server: StandinServer) -> bool:
    """Whether the source's stand-in answered a request for the window's first page (the
    query its extract makes for it) at a (fake) instant after the window's close plus the
    settle time: a sync from the first page that started after the window closed."""
    asking = _StandinAnswers(standin_server, spec.name)
    spec.extract(ExtractRequest(spec.name, key, asking, None))
    first = {name: [value] for name, value in asking.asked[0].items()}
    window = spec.partitions_def.time_window_for_partition_key(key)
    closed = (window.end + spec.catch_up.settle).timestamp()
    with standin_server.state.lock:
        served = list(standin_server.state.requests)
    return any(entry["route"] == asking.route and entry["status"] == 200
               and entry.get("clock") is not None and entry["clock"] >= closed
               and parse_qs(entry["query"]) == first for entry in served)


def is_final(spec: SourceSpec, key: str, warehouse_url: str, standin_server: StandinServer,
             at: datetime) -> bool:
    """Whether the warehouse holds period ``key`` as the source gives it at ``at``."""
    expected = expected_rows(spec, key, standin_server, at)
    if expected is None:
        return False
    stored = stored_rows(spec, key, warehouse_url)
    if spec.load_mode is LoadMode.MERGE_BY_VERSION:
        return expected <= stored and synced_after_close(spec, key, standin_server)
    return ledger_has(spec, key, warehouse_url) and stored == expected


@dataclass(frozen=True)
class Truth:
    """A source's due periods at an instant, and which of them are not final."""

    source: str
    at: datetime
    due: dict[str, datetime]
    late: set[str]
    aged_out: set[str]
    """Late periods outside the catch-up's lookback."""


def watched_from(instance: DagsterInstance, spec: SourceSpec, at: datetime) -> datetime | None:
    """The first period the deadlines watch, as declared (docs/operations.md): none before the
    source's first run's lookback, the first partition, or a month ago."""
    records = instance.get_run_records(RunsFilter(tags={SOURCE_TAG: spec.name}), limit=1,
                                       order_by="create_timestamp", ascending=True)
    if not records:
        return None
    created = records[0].create_timestamp
    created = created if created.tzinfo else created.replace(tzinfo=UTC)
    return max(at - WATCH, spec.partitions_def.start, created - spec.catch_up.lookback)


def truth_at(instance: DagsterInstance, spec: SourceSpec, warehouse_url: str,
             standin_server: StandinServer, at: datetime) -> Truth:
    """The due periods of ``spec`` at ``at`` and those the warehouse does not hold as final."""
    partitions = spec.partitions_def
    assert spec.deadline is not None and isinstance(partitions, TimeWindowPartitionsDefinition)
    start = watched_from(instance, spec, at)
    due: dict[str, datetime] = {}
    if start is not None:
        for key in partitions.get_partition_keys(current_time=at + timedelta(days=7)):
            window = partitions.time_window_for_partition_key(key)
            deadline = spec.deadline.due(window.start, window.end)
            if window.end > start and deadline <= at:
                due[key] = deadline
    late = {key for key in due if not is_final(spec, key, warehouse_url, standin_server, at)}
    horizon = at - spec.catch_up.lookback
    aged = {key for key in late
            if partitions.time_window_for_partition_key(key).end <= horizon}
    return Truth(spec.name, at, due, late, aged)
