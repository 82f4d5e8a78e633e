"""The CBR's metal prices as published: how a day's prices are asked for (a range of one
day), and how an ``xml_metall`` answer is read (windows-1251 XML, a decimal comma, no records
on days off and for days not published yet: on a working day, an empty answer for the day
itself is "not available yet"; on a day off, the day's positively empty answer).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from zoneinfo import ZoneInfo

from mostovik_pipelines.core.errors import DataValidationError, SourceContractError
from mostovik_pipelines.framework.automation.working_days import is_working_day
from mostovik_pipelines.framework.quality.shape import observe_xml
from mostovik_pipelines.framework.readers.xml import parse_xml
from mostovik_pipelines.framework.spec import (
    ExtractRequest,
    ParsedRows,
    PartitionNotAvailable,
    RawPayload,
    RejectedRow,
    TransformRequest,
)

MOSCOW = ZoneInfo("Europe/Moscow")
METALS = {1: "gold", 2: "silver", 3: "platinum", 4: "palladium"}
LARGEST_PLAUSIBLE_PRICE = Decimal("1000000")  # roubles per gram; gold is in the thousands
COLUMNS = ("price_date", "metal_code", "buy", "sell")


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
    # Always, records or not: an answer without <Record> is an empty day only when it holds
    # nothing else (a renamed element is a change of shape, never a day without prices).
    request.report_shape(observe_xml(root, "Record"))
    fetched_on = request.fetched_at.astimezone(MOSCOW).date()
    if not records and (asked > fetched_on or (asked == fetched_on and is_working_day(asked))):
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
