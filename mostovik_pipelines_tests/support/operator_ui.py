"""The deployment of the operator's day in the UI (``test_webserver.py``), and what its tests read
besides the UI's answers: the CBR rates a date stores and the ones the stand-in publishes, rows
per date, the partitions a run covers, what the UI shows of every partition before today, and
the days of last week its tests load."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

import httpx
import psycopg
import pytest
from dagster import AssetMaterialization, DagsterEvent, DagsterEventType, DagsterInstance
from dagster._core.events import StepMaterializationData
from dagster._core.instance.utils import RUNLESS_JOB_NAME, RUNLESS_RUN_ID

from mostovik_pipelines.framework.quality.checks import partition_checks
from mostovik_pipelines.framework.spec import TransformRequest
from mostovik_pipelines.sources import ALL_SOURCES, cbr_daily_rates
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.instances import fresh_deployment
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, dsn_of
from mostovik_pipelines_tests.support.webhook import WebhookReceiver
from mostovik_pipelines_tests.support.webserver import DagsterServices

ASSET = cbr_daily_rates.SOURCE.name
RATES_PER_DATE = 12
MOSCOW = ZoneInfo("Europe/Moscow")
SPECS = {spec.name: spec for spec in ALL_SOURCES}
CHECKS = {spec.name: sorted(check.name for check in partition_checks(spec))
          for spec in ALL_SOURCES}
STALE_SOURCE = "erp_work_orders"
"""Its last sync is made three hours old before the daemon starts: past its 2-hour policy. Its
hourly schedule is stopped in the UI before the daemon starts (the sync stopped): its tick at
minute 5 of any hour the module spans would sync it and make it fresh."""
ALERT_SENSORS = ("run_failure_alerts", "cancelled_runs_status", "source_shape_alerts",
                 "alert_outbox", "period_deadlines")
ALERT_SENSOR_INTERVAL_SECONDS = 5
FRESHNESS_INTERVAL_SECONDS = 5


@contextlib.contextmanager
def operator_ui_services(postgres: ThrowawayPostgres, standin_server: StandinServer,
                         webhook: WebhookReceiver, work_dir: Path) -> Iterator[DagsterServices]:
    """Webserver and daemon on a fresh production instance database and a fresh warehouse, with
    the alert webhook set, the ERP source's last sync three hours old, and the alert sensors
    past their first tick."""
    with fresh_deployment(postgres, standin_server, work_dir, "ui") as (home, environment):
        environment.update({
            "MOSTOVIK_ALERT_WEBHOOK_URL": webhook.url,
            # The alert sensors look more often here (15 s by default): alert tests wait on them.
            "MOSTOVIK_ALERT_SENSOR_INTERVAL_SECONDS": str(ALERT_SENSOR_INTERVAL_SECONDS),
            "MOSTOVIK_DEADLINE_SENSOR_INTERVAL_SECONDS": str(ALERT_SENSOR_INTERVAL_SECONDS),
            # Dagster's own: how often the daemon evaluates freshness policies (default 30 s).
            "FRESHNESS_DAEMON_INTERVAL_SECONDS": str(FRESHNESS_INTERVAL_SECONDS),
        })
        last_synced_hours_ago(home, environment, STALE_SOURCE, hours=3)
        services = DagsterServices(work_dir, home, environment,
                                   stopped_schedules=[f"{STALE_SOURCE}_schedule"])
        services.environment["MOSTOVIK_UI_URL"] = services.url  # the links in alerts
        with services as running:
            for name in ALERT_SENSORS:
                running.graphql.wait_for_sensor_tick(name, ALERT_SENSOR_INTERVAL_SECONDS)
            yield running


def day_of_last_week(weekday: int) -> date:
    """The day of last week (Monday 0) in Moscow, where the CBR's dates are."""
    today = datetime.now(MOSCOW).date()
    return today - timedelta(days=today.weekday() + 7) + timedelta(days=weekday)


def last_synced_hours_ago(home, environment: dict[str, str], source: str, hours: int) -> None:
    """Record a materialisation of ``source`` made ``hours`` ago (a sync that then stopped)."""
    synced_at = datetime.now(UTC) - timedelta(hours=hours)
    window = synced_at.astimezone(MOSCOW).date().isoformat()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        with DagsterInstance.from_config(str(home)) as instance:
            instance.report_dagster_event(DagsterEvent(
                event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value,
                event_specific_data=StepMaterializationData(
                    AssetMaterialization(source, partition=window)),
                job_name=RUNLESS_JOB_NAME,
            ), run_id=RUNLESS_RUN_ID, timestamp=synced_at.timestamp())


def stored_rates(warehouse_url: str, partition: str) -> dict[str, tuple]:
    with psycopg.connect(dsn_of(warehouse_url)) as connection:
        rows = connection.execute(
            "SELECT char_code, rate_date, cbr_id, num_code, nominal, name, value, unit_rate "
            "FROM cbr_daily_rates WHERE partition_date = %s", (date.fromisoformat(partition),))
        return {row[0]: tuple(row[1:]) for row in rows}


def published_rates(standin_server: StandinServer, partition: str) -> dict[str, tuple]:
    """What the CBR (the stand-in) publishes for the date, parsed as the source parses it."""
    asked = date.fromisoformat(partition)
    response = httpx.get(standin_server.cbr_url, params={"date_req": f"{asked:%d/%m/%Y}"})
    frame = cbr_daily_rates.parse_daily_rates(TransformRequest(
        source=ASSET, partition_key=partition, content=response.content,
        content_type="application/xml", fetched_at=datetime.now(UTC))).as_frame()
    assert len(frame) == RATES_PER_DATE
    return {row.char_code: (row.rate_date, row.cbr_id, row.num_code, row.nominal, row.name,
                            row.value, row.unit_rate) for row in frame.itertuples()}


def usd_rate(warehouse_url: str, partition: str) -> Decimal:
    with psycopg.connect(dsn_of(warehouse_url)) as connection:
        return connection.execute(
            "SELECT value FROM cbr_daily_rates WHERE partition_date = %s AND char_code = 'USD'",
            (date.fromisoformat(partition),)).fetchone()[0]


def what_the_ui_shows(services: DagsterServices) -> dict:
    """Of every partition before today (a schedule may be loading today's): its status in the
    asset's partition bar, its latest materialisation's metadata, and each check's latest
    result."""
    today = datetime.now(MOSCOW).date().isoformat()
    status = {}
    for state, first, last in services.graphql.partition_status_ranges(ASSET):
        day = date.fromisoformat(first)
        while day <= date.fromisoformat(last) and day.isoformat() < today:
            status[day.isoformat()] = state
            day += timedelta(days=1)
    checks = {}
    for check in CHECKS[ASSET]:
        for partition in status:
            latest = services.graphql.check_executions(ASSET, check, partition, limit=1)
            checks[(check, partition)] = [{key: execution[key] for key in (
                "runId", "status", "evaluation")} for execution in latest]
    return {"status": status, "checks": checks,
            "metadata": services.graphql.partition_metadata(ASSET, sorted(status))}


def partitions_of(run) -> list[str]:
    """The partitions a run covers: its partition, or each day of its range."""
    if "dagster/partition" in run.tags:
        return [run.tags["dagster/partition"]]
    first = date.fromisoformat(run.tags["dagster/asset_partition_range_start"])
    last = date.fromisoformat(run.tags["dagster/asset_partition_range_end"])
    return [(first + timedelta(days=n)).isoformat() for n in range((last - first).days + 1)]


def rows_per_date(warehouse_url: str) -> dict[str, int]:
    """Rows per ``partition_date`` in the warehouse, leaving out today and tomorrow: the
    schedule is running and loads those partitions should a tick fall within the test."""
    today = datetime.now(MOSCOW).date()
    with psycopg.connect(dsn_of(warehouse_url)) as connection:
        rows = connection.execute(
            "SELECT partition_date, count(*) FROM cbr_daily_rates WHERE partition_date < %s "
            "GROUP BY partition_date", (today,)
        ).fetchall()
    return {day.isoformat(): count for day, count in rows}
