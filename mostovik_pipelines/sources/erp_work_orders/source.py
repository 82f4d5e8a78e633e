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

from datetime import datetime, timedelta

from dagster import BackfillPolicy, DailyPartitionsDefinition, EnvVar
from sqlalchemy import BigInteger, Boolean, Column, Date, DateTime, Index, String, Text

from mostovik_pipelines.core.load_target import KeyHeldElsewhere, LoadMode
from mostovik_pipelines.core.retries import RetryPolicy
from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.framework.automation.policy import PeriodDeadline
from mostovik_pipelines.framework.quality.shape import SourceShape, ValueKind, expect
from mostovik_pipelines.framework.spec import CatchUpPolicy, JobType, SourceSchedule, SourceSpec
from mostovik_pipelines.resources.http import HttpSourceResource
from mostovik_pipelines.sources.erp_work_orders.parse import STATUSES, TIMEZONE, extract, transform
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal

URL_SETTING = "MOSTOVIK_ERP_URL"
ROWS_PER_COMMIT = int(setting("MOSTOVIK_ERP_ROWS_PER_COMMIT", "5000"))
"""Work orders per transaction (50 pages of 100): a crash re-fetches at most that many."""

erp_work_orders_daily_partition = DailyPartitionsDefinition(
    start_date=setting("MOSTOVIK_ERP_START_DATE", "2026-01-01"),
    timezone=TIMEZONE.key,
    end_offset=1,  # today's window, still filling, is synced too
)
"""Daily windows of the work orders' ``updated_at``."""

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

CATCH_UP = CatchUpPolicy.from_settings("MOSTOVIK_ERP", lookback_days=7, settle_minutes=5)


def window_due(start: datetime, end: datetime) -> datetime:
    """A window is due final an hour after its close plus the settle time: the first hourly
    tick after the settle time syncs it."""
    return end + CATCH_UP.settle + timedelta(hours=1)


SHAPE = SourceShape((
    expect("id", ValueKind.TEXT, ValueKind.INTEGER),
    expect("object_code", ValueKind.TEXT),
    expect("title", ValueKind.TEXT),
    expect("status", ValueKind.TEXT),
    expect("planned_start", ValueKind.DATE_ISO),
    expect("planned_finish", ValueKind.DATE_ISO),
    expect("amount", ValueKind.DECIMAL, ValueKind.INTEGER),
    expect("updated_at", ValueKind.DATETIME),
    expect("version", ValueKind.INTEGER),
    expect("deleted", ValueKind.BOOLEAN),
))
"""A work order's fields. A field the API adds fails the window (the sync's default,
``freeze``): a ``currency`` beside ``amount`` would change what every amount means."""


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
    shape=SHAPE,
    # The schedule syncs today's window every hour. A day's window is final once a sync that
    # started 5 minutes after midnight has succeeded: the 00:05 tick syncs yesterday's window
    # with today's, and it is due by 01:05. A week of windows is caught up.
    catch_up=CATCH_UP,
    deadline=PeriodDeadline(window_due, "a day's window final an hour after its close and "
                                        "settle time (01:05 Moscow time)"),
)
