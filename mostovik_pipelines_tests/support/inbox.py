"""The file inbox in tests: files dropped as an uploader drops them, the sensor ticked with its
cursor kept, and the runs it asks for executed as the daemon would launch them (one run per
requested file version, in the test's process); the warehouse's delivery rows and quarantine as
an operator reads them; the sensor's ticks as the UI shows them.

Dagster's daemon, not the sensor, skips a run request whose run key it has launched before:
:class:`InboxSensor` runs every request the sensor makes (tests of the daemon itself are in
``test_inbox_daemon.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Sequence
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

from dagster import DagsterInstance, Definitions, SensorResult, build_sensor_context
from sqlalchemy import Row, create_engine, text

from mostovik_pipelines.resources.inbox import InboxResource, version_key
from mostovik_pipelines.sources import material_deliveries
from mostovik_pipelines.sources.material_deliveries.report import COLUMNS
from mostovik_pipelines_tests.support.delivery_reports import Delivery, expected_rows
from mostovik_pipelines_tests.support.waiting import wait_until

SOURCE = "material_deliveries"
SENSOR = f"{SOURCE}_inbox_sensor"
JOB = f"{SOURCE}_job"
RESOURCE_KEY = f"{SOURCE}_source"
PARTITIONS = material_deliveries.SOURCE.partitions_def.name


def inbox_dirs(work_dir: Path) -> tuple[Path, Path]:
    """The inbox and archive :func:`~.locations.code_location_for` wires under ``work_dir``."""
    return work_dir / "inbox", work_dir / "archive"


def inbox_resource(work_dir: Path, **options: Any) -> InboxResource:
    inbox, archive = inbox_dirs(work_dir)
    return InboxResource(inbox_dir=str(inbox), archive_dir=str(archive), **options)


def version_of(name: str, content: bytes) -> str:
    """The partition key of ``content`` uploaded as ``name``."""
    return version_key(name, hashlib.sha256(content).hexdigest())


def drop(inbox_dir: Path, name: str, content: bytes, *, mtime_ns: int | None = None) -> str:
    """Upload ``content`` as ``name`` the way an uploader does (written as ``name.part``, then
    renamed), optionally with a given modification time; its version key."""
    inbox_dir.mkdir(parents=True, exist_ok=True)
    partial = inbox_dir / f"{name}.part"
    partial.write_bytes(content)
    if mtime_ns is not None:
        os.utime(partial, ns=(mtime_ns, mtime_ns))
    os.replace(partial, inbox_dir / name)
    return version_of(name, content)


def renumbered(lines: Sequence[Delivery], offset: int) -> list[Delivery]:
    """``lines`` with ``offset`` added to every waybill's number, its spelling kept (leading
    zeros, prefixes): reports generated with different seeds then never share a waybill line."""
    def shifted(waybill: str) -> str:
        match = re.search(r"\d+$", waybill)
        assert match, waybill
        number = str(int(match.group()) + offset).rjust(len(match.group()), "0")
        return waybill[:match.start()] + number
    return [dataclasses.replace(line, waybill=shifted(line.waybill)) for line in lines]


class InboxSensor:
    """The inbox sensor of a code location, ticked as the daemon ticks it."""

    def __init__(self, location: Definitions, instance: DagsterInstance,
                 resource: InboxResource) -> None:
        self.sensor = location.get_sensor_def(SENSOR)
        self.job = location.resolve_job_def(JOB)
        self.instance = instance
        self.resource = resource
        self.cursor: str | None = None

    def tick(self) -> SensorResult:
        """One evaluation: the cursor moves on and the partitions it asks for are added, as
        the daemon does with a tick's result."""
        context = build_sensor_context(instance=self.instance, cursor=self.cursor,
                                       resources={RESOURCE_KEY: self.resource})
        result = self.sensor(context)
        for request in result.dynamic_partitions_requests:
            self.instance.add_dynamic_partitions(request.partitions_def_name,
                                                 list(request.partition_keys))
        self.cursor = result.cursor
        return result

    def run_new_versions(self) -> dict[str, Any]:
        """A tick, then one in-process run per requested version: version key -> its result."""
        return {request.partition_key: self.run(request.partition_key)
                for request in self.tick().run_requests}

    def run(self, version: str):
        return self.job.execute_in_process(partition_key=version, instance=self.instance,
                                           raise_on_error=False)


expected_table = expected_rows
"""The table rows ``lines`` of a file version must become, as :func:`delivery_rows` reads them:
the rows the parser returns, stored as they are."""


def delivery_rows(url: str, source_file: str | None = None) -> list[dict[str, Any]]:
    """The data columns of ``material_deliveries`` (of one file), in key order; exact decimals
    as ``Decimal`` on both backends (SQLite stores their text)."""
    where = "WHERE source_file = :file" if source_file is not None else ""
    rows = [dict(row._mapping) for row in _select(
        url, f"SELECT {', '.join(COLUMNS)} FROM material_deliveries {where} "
        "ORDER BY waybill, line_no", file=source_file)]
    for row in rows:
        for name in ("quantity", "price"):
            row[name] = Decimal(str(row[name]))
        if isinstance(row["delivery_date"], str):
            row["delivery_date"] = date.fromisoformat(row["delivery_date"])
    return rows


def sorted_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in the table's key order: text compared as bytes, as the "C" collation does."""
    return sorted(rows, key=lambda row: (row["waybill"].encode(), row["line_no"]))


def exact(rows: Sequence[dict[str, Any]]) -> list[tuple]:
    """Rows as tuples in which a decimal is its text: ``1.500`` and ``1.5`` differ."""
    return [tuple(str(v) if isinstance(v, Decimal) else v for v in row.values())
            for row in rows]


def physical_rows(url: str, source_file: str | None = None) -> list[tuple]:
    """Every row (of one file) with its physical identity: PostgreSQL ctid and xmin change
    whenever a row is rewritten, SQLite's rowid when it is deleted and inserted again."""
    identity = "ctid::text, xmin::text" if url.startswith("postgresql") else "rowid"
    where = "WHERE source_file = :file" if source_file is not None else ""
    return [tuple(row) for row in _select(
        url, f"SELECT {identity}, * FROM material_deliveries {where} "
        "ORDER BY waybill, line_no", file=source_file)]


def quarantined(url: str, partition_key: str | None = None) -> list[dict[str, Any]]:
    """The quarantined rows of material_deliveries (of one file version), in row order."""
    where = "AND partition_key = :key" if partition_key is not None else ""
    return [dict(row._mapping) for row in _select(
        url, "SELECT source, partition_key, run_id, row_number, raw_row, reason "
        f"FROM quarantined_rows WHERE source = '{SOURCE}' {where} "
        "ORDER BY partition_key, row_number", key=partition_key)]


def _select(url: str, sql: str, **parameters: Any) -> list[Row]:
    """The rows ``sql`` selects in the warehouse at ``url``, on a connection of its own."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return list(connection.execute(text(sql), parameters))
    finally:
        engine.dispose()


@dataclasses.dataclass(frozen=True)
class Tick:
    status: str
    timestamp: float
    end_timestamp: float | None
    run_ids: list[str]
    run_keys: list[str]
    skip_reason: str | None
    error: str | None


def sensor_ticks(graphql, sensor_name: str = SENSOR, limit: int = 20) -> list[Tick]:
    """The sensor's latest ticks, newest first, as the UI's sensor page shows them (through
    the webserver's GraphQL API)."""
    return [Tick(t["status"], t["timestamp"], t["endTimestamp"], t["runIds"], t["runKeys"],
                 t["skipReason"], (t["error"] or {}).get("message"))
            for t in graphql.sensor_ticks(sensor_name, limit)]


def wait_for_ticks_after(services, since_epoch: float, count: int,
                          timeout: float) -> list:
    """The first ``count`` finished ticks that started after ``since_epoch``, oldest first."""

    def finished() -> list | None:
        ticks = [t for t in sensor_ticks(services.graphql)
                 if t.timestamp > since_epoch and t.status != "STARTED"]
        return sorted(ticks, key=lambda t: t.timestamp)[:count] if len(ticks) >= count else None

    return wait_until(finished, timeout, f"{count} finished ticks after the drop",
                      lambda: str(sensor_ticks(services.graphql, limit=5)), poll=1)


def wait_for_tick_asking_after(services, since_epoch: float, timeout: float):
    """The first tick that requested runs and ended after ``since_epoch`` (a tick that began
    before it may have listed the inbox after it)."""

    def asking():
        ticks = [t for t in sensor_ticks(services.graphql)
                 if t.status != "STARTED" and (t.end_timestamp or 0) > since_epoch
                 and t.run_keys]
        return min(ticks, key=lambda t: t.timestamp) if ticks else None

    return wait_until(asking, timeout, "a tick that asked for a run",
                      lambda: str(sensor_ticks(services.graphql, limit=5)), poll=1)
