"""Central Bank of Russia prices of precious metals: gold, silver, platinum and palladium in
roubles per gram, one daily partition per day (a parser job).

The CBR sets the prices on working days. ``xml_metall.asp?date_req1=DD/MM/YYYY&date_req2=
DD/MM/YYYY`` answers in windows-1251 XML with a decimal comma: ``<Metall><Record
Date="DD.MM.YYYY" Code="1"><Buy>5837,39</Buy><Sell>5837,39</Sell></Record>...</Metall>``, codes 1
gold, 2 silver, 3 platinum, 4 palladium. Asked for one day, it lists that day's records, and none
on a weekend or a holiday: such a day completes with nothing loaded (the partition is empty). It
lists none for a day not published yet either, so an empty answer for the fetch day (Moscow time)
or later is "not available yet", picked up by a later run, rather than a holiday.

Settings: ``MOSTOVIK_CBR_METALS_URL`` (default the CBR's), ``MOSTOVIK_CBR_METALS_TIMEOUT_SECONDS``
(30), ``MOSTOVIK_CBR_METAL_PRICES_START_DATE`` (the first partition, 2026-01-01).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from zoneinfo import ZoneInfo

from sqlalchemy import Column, Date, Integer

from mostovik_pipelines.etl.errors import DataValidationError, SourceContractError
from mostovik_pipelines.etl.load_target import LoadMode
from mostovik_pipelines.etl.retries import RetryPolicy
from mostovik_pipelines.etl.spec import (
    ExtractRequest,
    JobType,
    ParsedRows,
    PartitionNotAvailable,
    RawPayload,
    RejectedRow,
    SourceSchedule,
    SourceSpec,
    TransformRequest,
)
from mostovik_pipelines.partitions import cbr_metal_prices_daily_partition
from mostovik_pipelines.readers.xml import parse_xml
from mostovik_pipelines.resources.http import HttpSourceResource
from mostovik_pipelines.settings import setting
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal

URL_SETTING = "MOSTOVIK_CBR_METALS_URL"
DEFAULT_URL = "https://www.cbr.ru/scripts/xml_metall.asp"
MOSCOW = ZoneInfo("Europe/Moscow")
METALS = {1: "gold", 2: "silver", 3: "platinum", 4: "palladium"}
LARGEST_PLAUSIBLE_PRICE = Decimal("1000000")  # roubles per gram; gold is in the thousands
COLUMNS = ("price_date", "metal_code", "buy", "sell")

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


def fetch_metal_prices(request: ExtractRequest) -> RawPayload:
    """Ask the CBR for the prices of the partition's day (a range of one day)."""
    day = date.fromisoformat(request.partition_key).strftime("%d/%m/%Y")
    response = request.resource.get(params={"date_req1": day, "date_req2": day})
    return RawPayload(response.content, response.content_type, response.url)


def parse_metal_prices(request: TransformRequest) -> ParsedRows:
    """One row per ``<Record>``; a record that cannot be read is rejected with the reason
    (quarantined), the document as a whole must parse."""
    asked = date.fromisoformat(request.partition_key)
    root = parse_xml(request.content, "xml_metall")
    if root.tag != "Metall":
        raise SourceContractError(f"root element is <{root.tag}>, expected <Metall>")
    records = root.findall("Record")
    fetched_on = request.fetched_at.astimezone(MOSCOW).date()
    if not records and asked >= fetched_on:
        raise PartitionNotAvailable(f"the CBR lists no prices for {asked} when asked on "
                                    f"{fetched_on}")
    rows, rejected = [], []
    for position, record in enumerate(records, 1):
        try:
            rows.append(_parse_record(record, position))
        except (SourceContractError, DataValidationError) as defect:
            rejected.append(RejectedRow(position, ET.tostring(record, encoding="unicode"),
                                        str(defect), key=_readable_key(record)))
    return ParsedRows({name: [row[name] for row in rows] for name in COLUMNS}, rejected)


def _parse_record(record: ET.Element, position: int) -> dict:
    where = f"<Record> #{position} (Code={record.get('Code')!r})"
    price_date = _record_date(record.get("Date"), where)
    code = record.get("Code", "")
    if not code.isdigit() or int(code) not in METALS:
        raise DataValidationError(f"{where}: Code is not one of 1-4 ({', '.join(METALS.values())})")
    return {"price_date": price_date, "metal_code": int(code),
            "buy": _price(record, "Buy", where), "sell": _price(record, "Sell", where)}


def _record_date(text: str | None, where: str) -> date:
    try:
        return datetime.strptime(text or "", "%d.%m.%Y").date()
    except ValueError as exc:
        raise SourceContractError(f"{where}: Date {text!r} is not DD.MM.YYYY") from exc


def _price(record: ET.Element, name: str, where: str) -> Decimal:
    """A published price with a decimal comma, kept exact: ``5837,39`` -> ``5837.39``."""
    text = (record.findtext(name) or "").strip()
    if not text:
        raise SourceContractError(f"{where} has no <{name}> (has "
                                  f"{sorted(child.tag for child in record)})")
    try:
        price = Decimal(text.replace(",", "."))
    except InvalidOperation as exc:
        raise DataValidationError(f"{where}: {name} {text[:20]!r} is not a decimal") from exc
    if not price.is_finite() or price <= 0 or price >= LARGEST_PLAUSIBLE_PRICE:
        raise DataValidationError(f"{where}: {name} {text[:20]!r} is not a plausible price")
    return price


def _readable_key(record: ET.Element) -> dict | None:
    """The natural key of a rejected record when its date and code can still be read: the
    prices stored under it stay until readable ones arrive."""
    try:
        price_date = datetime.strptime(record.get("Date", ""), "%d.%m.%Y").date()
    except ValueError:
        return None
    code = record.get("Code", "")
    if not code.isdigit() or int(code) not in METALS:
        return None
    return {"price_date": price_date, "metal_code": int(code)}


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
    extract_retry=RetryPolicy(max_attempts=4, base_delay_seconds=2.0, max_delay_seconds=60.0),
    # One unreadable metal of four is quarantined and the others loaded (a partial job); more
    # means the format changed, and nothing is loaded.
    max_rejected_share=0.25,
    # Weekends and holidays have no records: the day completes with nothing loaded.
    empty_payload_is_valid=True,
)
