"""Central Bank of Russia prices of precious metals: gold, silver, platinum and palladium in
roubles per gram, one daily partition per day (a parser job).

The CBR sets the prices on working days. ``xml_metall.asp?date_req1=DD/MM/YYYY&date_req2=
DD/MM/YYYY`` answers in windows-1251 XML with a decimal comma: ``<Metall><Record
Date="DD.MM.YYYY" Code="1"><Buy>5837,39</Buy><Sell>5837,39</Sell></Record>...</Metall>``, codes 1
gold, 2 silver, 3 platinum, 4 palladium. Asked for one day, it lists that day's records, and none
on a weekend or a holiday: such a day completes with nothing loaded (the partition is empty), as
long as the answer holds nothing else. It lists none for a day not published yet either, so an
empty answer for a later day, or for the fetch day (Moscow time) when it is a working day, is
"not available yet", picked up by a later run.

Settings: ``MOSTOVIK_CBR_METALS_URL`` (default the CBR's), ``MOSTOVIK_CBR_METALS_TIMEOUT_SECONDS``
(30), ``MOSTOVIK_CBR_METAL_PRICES_START_DATE`` (the first partition, 2026-01-01).
"""

from __future__ import annotations

from datetime import datetime, time

from dagster import DailyPartitionsDefinition
from sqlalchemy import Column, Date, Integer

from mostovik_pipelines.core.load_target import LoadMode
from mostovik_pipelines.core.retries import RetryPolicy
from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.framework.automation.policy import PeriodDeadline
from mostovik_pipelines.framework.quality.shape import NUMBER, SourceShape, ValueKind, expect
from mostovik_pipelines.framework.spec import CatchUpPolicy, JobType, SourceSchedule, SourceSpec
from mostovik_pipelines.resources.http import HttpSourceResource
from mostovik_pipelines.sources.cbr_metal_prices.parse import fetch_metal_prices, parse_metal_prices
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal

URL_SETTING = "MOSTOVIK_CBR_METALS_URL"
DEFAULT_URL = "https://www.cbr.ru/scripts/xml_metall.asp"

cbr_metal_prices_daily_partition = DailyPartitionsDefinition(
    start_date=setting("MOSTOVIK_CBR_METAL_PRICES_START_DATE", "2026-01-01"),
    timezone="Europe/Moscow",
    end_offset=1,  # today's partition too
)
"""Days of cbr_metal_prices, Moscow time."""

cbr_metal_prices_table = warehouse_table(
    "cbr_metal_prices",
    Column("price_date", Date, nullable=False,
           comment="the day the prices are set for (Record/@Date)"),
    Column("metal_code", Integer, nullable=False,
           comment="1 gold, 2 silver, 3 platinum, 4 palladium"),
    Column("buy", ExactDecimal(), nullable=False, comment="roubles per gram, as published"),
    Column("sell", ExactDecimal(), nullable=False, comment="roubles per gram, as published"),
    natural_key=("price_date", "metal_code"),
)

def prices_due(start: datetime, end: datetime) -> datetime:
    """A day's prices (none on a day off) are due at 19:00 of the day: the 18:00 tick loads
    them."""
    return datetime.combine(start.date(), time(19, 0), start.tzinfo)


SHAPE = SourceShape((
    expect("Metall/@FromDate", ValueKind.INTEGER),
    expect("Metall/@ToDate", ValueKind.INTEGER),
    expect("Metall/@name", ValueKind.TEXT),
    expect("Record/@Date", ValueKind.DATE_DMY),
    expect("Record/@Code", ValueKind.INTEGER),
    expect("Record/Buy", NUMBER),
    expect("Record/Sell", NUMBER),
), records="Record")
"""What ``xml_metall`` sends (``FromDate`` and ``ToDate`` are ``YYYYMMDD``). A day without
prices sends ``<Metall>`` with its attributes and nothing in it: an empty day; one that holds
anything but ``<Record>`` is a change of shape, not an empty day."""


SOURCE = SourceSpec(
    name="cbr_metal_prices",
    job_type=JobType.PARSER,
    description=__doc__.split("\n\n")[0].replace("\n", " "),
    partitions_def=cbr_metal_prices_daily_partition,
    table=cbr_metal_prices_table,
    natural_key=("price_date", "metal_code"),
    partition_column="price_date",
    load_mode=LoadMode.REPLACE_PARTITION,
    extract=fetch_metal_prices,
    transform=parse_metal_prices,
    resource=HttpSourceResource(
        base_url=setting(URL_SETTING, DEFAULT_URL),
        timeout_seconds=float(setting("MOSTOVIK_CBR_METALS_TIMEOUT_SECONDS", "30")),
    ),
    url_setting=URL_SETTING,
    # Once a day, after the CBR has set the day's prices: today's and yesterday's partitions
    # (a day that was "not available yet" yesterday is loaded today).
    schedule=SourceSchedule(cron="0 18 * * *", timezone="Europe/Moscow", latest_partitions=2),
    catch_up=CatchUpPolicy.from_settings("MOSTOVIK_CBR_METALS", lookback_days=7),
    extract_retry=RetryPolicy(max_attempts=4, base_delay_seconds=2.0, max_delay_seconds=60.0),
    # One unreadable metal of four is quarantined and the others loaded (a partial job); more
    # means the format changed, and nothing is loaded.
    max_rejected_share=0.25,
    # Weekends and holidays have no records: the day completes with nothing loaded.
    empty_payload_is_valid=True,
    shape=SHAPE,
    deadline=PeriodDeadline(prices_due, "the day's prices (or the day off's empty answer) by "
                                        "19:00 Moscow time"),
)
