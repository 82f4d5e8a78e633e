"""Central Bank of Russia daily exchange rates (a parser job).

The CBR sets official rates on working days, effective from the next calendar day, and publishes
tomorrow's rates in the afternoon (Moscow time). ``XML_daily.asp?date_req=DD/MM/YYYY`` answers in
windows-1251 XML with a decimal comma. Its ``Date`` attribute is the date the rates are
effective, which differs from the date asked for on weekends and holidays (the last rates set
apply); we keep both. Asked for a date it has not published yet, the CBR silently answers with
its latest rates: that partition is "not available yet", and nothing is loaded under it.
"""

from __future__ import annotations

from datetime import datetime, time, timedelta

from dagster import BackfillPolicy, DailyPartitionsDefinition
from sqlalchemy import Column, Date, Index, Integer, String, select

from mostovik_pipelines.core.load_target import LoadMode
from mostovik_pipelines.core.retries import RetryPolicy
from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.framework.automation.policy import PeriodDeadline
from mostovik_pipelines.framework.automation.working_days import is_working_day
from mostovik_pipelines.framework.quality.shape import NUMBER, SourceShape, ValueKind, expect
from mostovik_pipelines.framework.spec import (
    CatchUpPolicy,
    CheckRequest,
    CheckResult,
    JobType,
    PartitionCheck,
    SourceSchedule,
    SourceSpec,
)
from mostovik_pipelines.resources.http import HttpSourceResource
from mostovik_pipelines.sources.cbr_daily_rates.parse import (
    NAME_LENGTH,
    fetch_daily_rates,
    parse_daily_rates,
)
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal

URL_SETTING = "MOSTOVIK_CBR_URL"
DEFAULT_URL = "https://www.cbr.ru/scripts/XML_daily.asp"
EXPECTED_CURRENCIES = ("USD", "EUR", "CNY")
"""The currencies the back office prices imports and contracts in: every published date has
them."""

cbr_daily_partition = DailyPartitionsDefinition(
    start_date=setting("MOSTOVIK_CBR_START_DATE", "2020-01-01"),
    timezone="Europe/Moscow",
    # The CBR publishes tomorrow's rates in the afternoon, so the newest partition is tomorrow's.
    # A daily partition exists once its day is over: +1 adds today, +2 tomorrow.
    end_offset=2,
)
"""Dates the rates are asked for, Moscow time."""

cbr_daily_rates_table = warehouse_table(
    "cbr_daily_rates",
    Column("partition_date", Date, nullable=False, comment="date the rates were asked for"),
    Column("rate_date", Date, nullable=False,
           comment="date the rates are effective (ValCurs/@Date)"),
    Column("cbr_id", String(16), nullable=False, comment="CBR's own currency id, e.g. R01235"),
    Column("num_code", String(3), nullable=False, comment="ISO 4217 numeric code"),
    Column("char_code", String(3), nullable=False, comment="ISO 4217 letter code"),
    Column("nominal", Integer, nullable=False, comment="units of the currency the value is for"),
    Column("name", String(NAME_LENGTH), nullable=False),
    Column("value", ExactDecimal(), nullable=False, comment="roubles per nominal, as published"),
    Column("unit_rate", ExactDecimal(), nullable=False, comment="roubles per one unit"),
    Index("ix_cbr_daily_rates_rate_date", "rate_date"),
    natural_key=("partition_date", "char_code"),
)


def currencies_present_and_positive(request: CheckRequest) -> CheckResult:
    """Every expected currency is stored for the date, and every stored rate is positive. A
    missing currency warns: the CBR can stop quoting one, and a quarantined one stays missing
    on a first load. A rate that is not positive never comes through the parser: it blocks."""
    table = request.table
    rows = request.connection.execute(
        select(table.c.char_code, table.c.nominal, table.c.value, table.c.unit_rate)
        .where(table.c.partition_date == request.partition_value)).fetchall()
    missing = [code for code in EXPECTED_CURRENCIES if code not in {row[0] for row in rows}]
    not_positive = sorted(row[0] for row in rows
                          if not (row[1] > 0 and row[2] > 0 and row[3] > 0))
    metadata = {"currencies": len(rows), "missing": ", ".join(missing) or "-",
                "not_positive": ", ".join(not_positive) or "-"}
    if not_positive:
        return CheckResult(False, f"rates not positive: {', '.join(not_positive)}", metadata)
    if missing:
        return CheckResult(False, f"expected currencies missing: {', '.join(missing)}",
                           metadata, warning=True)
    return CheckResult(True, f"{', '.join(EXPECTED_CURRENCIES)} present; all {len(rows)} rates "
                             "positive", metadata)

DUE_AT = time(16, 30)
"""The CBR publishes tomorrow's rates at ~15:30 Moscow time, and the 16:00 tick loads them."""


def rates_due(start: datetime, end: datetime) -> datetime:
    """A date's rates are due at 16:30 of the day before when the CBR publishes on it (a
    working day); else (Sunday's, Monday's, the day after a holiday: asked before their day,
    the CBR answers with older rates) at 16:30 of their own day."""
    day = start.date()
    eve = day - timedelta(days=1)
    return datetime.combine(eve if is_working_day(eve) else day, DUE_AT, start.tzinfo)


SHAPE = SourceShape((
    expect("ValCurs/@Date", ValueKind.DATE_DMY),
    expect("ValCurs/@name", ValueKind.TEXT),
    expect("Valute/@ID", ValueKind.TEXT),
    expect("Valute/NumCode", ValueKind.INTEGER),
    expect("Valute/CharCode", ValueKind.TEXT),
    expect("Valute/Nominal", ValueKind.INTEGER),
    expect("Valute/Name", ValueKind.TEXT),
    expect("Valute/Value", NUMBER),
    # Published since 2022: older dates come without it.
    expect("Valute/VunitRate", NUMBER, optional=True),
))
"""What ``XML_daily`` sends. An element it adds fails the date (the parser's default,
``freeze``): one like ``VunitRate`` can change what ``Value`` means."""


SOURCE = SourceSpec(
    name="cbr_daily_rates",
    job_type=JobType.PARSER,
    description=(
        "Official CBR exchange rates of the rouble, one partition per date asked for (Moscow "
        "time). Tomorrow's rates appear in the afternoon; weekends and holidays carry the last "
        "rates set, so rate_date can be earlier than partition_date."
    ),
    partitions_def=cbr_daily_partition,
    table=cbr_daily_rates_table,
    natural_key=("partition_date", "char_code"),
    partition_column="partition_date",
    load_mode=LoadMode.REPLACE_PARTITION,
    extract=fetch_daily_rates,
    transform=parse_daily_rates,
    url_setting=URL_SETTING,
    resource=HttpSourceResource(
        base_url=setting(URL_SETTING, DEFAULT_URL),
        timeout_seconds=float(setting("MOSTOVIK_CBR_TIMEOUT_SECONDS", "30")),
    ),
    # Tomorrow's partition at every tick (it appears after ~15:30); every day of the last week
    # not loaded yet with it, in the same run: Sunday's and Monday's rates can only be had once
    # the day has come (asked earlier, the CBR answers with Saturday's), a day the CBR was down
    # for all three ticks comes in at the next one.
    schedule=SourceSchedule(cron="0 12,16,20 * * *", timezone="Europe/Moscow",
                            latest_partitions=1),
    catch_up=CatchUpPolicy.from_settings("MOSTOVIK_CBR", lookback_days=7),
    extract_retry=RetryPolicy(max_attempts=4, base_delay_seconds=2.0, max_delay_seconds=60.0),
    # One unreadable currency of ~40 is quarantined and the rest loaded (a partial job); more
    # than a tenth means the format changed, and nothing is loaded.
    max_rejected_share=0.1,
    # A day is ~40 rows: a whole backfill fits one run, which `dagster asset materialize
    # --partition-range` and the UI's single-run backfills need.
    backfill_policy=BackfillPolicy.single_run(),
    max_runtime_seconds=10 * 60,
    protocol="http",
    deadline=PeriodDeadline(rates_due, "tomorrow's rates by 16:30 Moscow time on days the "
                                       "CBR publishes; a date after a day off by 16:30 of its day"),
    shape=SHAPE,
    checks=(PartitionCheck(
        "currencies_present_and_positive",
        f"{', '.join(EXPECTED_CURRENCIES)} are stored for the date (warns if not) and every rate "
        "is positive (blocks if not).", currencies_present_and_positive),),
)
