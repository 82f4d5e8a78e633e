"""The CBR's daily rates as published: how a date's rates are asked for, and how an
``XML_daily`` answer is read (windows-1251 XML, a decimal comma, the effective date that can
differ from the date asked for, and the latest rates answering a date not published yet).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from zoneinfo import ZoneInfo

from mostovik_pipelines.core.errors import DataValidationError, SourceContractError
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
REQUIRED_FIELDS = ("NumCode", "CharCode", "Nominal", "Name", "Value")
VALUTE_COLUMNS = ("cbr_id", "num_code", "char_code", "nominal", "name", "value", "unit_rate")
CHAR_CODE = re.compile(r"^[A-Z]{3}$")
NUM_CODE = re.compile(r"^\d{3}$")
LARGEST_PLAUSIBLE_RATE = Decimal("1000000")
LARGEST_PLAUSIBLE_NOMINAL = 1_000_000  # published nominals are 1 to 10 000
UNIT_RATE_PRECISION = Decimal("0.00000001")
NAME_LENGTH = 255
"""The longest currency name the table stores."""


def fetch_daily_rates(request: ExtractRequest) -> RawPayload:
    """Ask the CBR for the rates of the partition's date."""
    asked = date.fromisoformat(request.partition_key)
    response = request.resource.get(params={"date_req": asked.strftime("%d/%m/%Y")})
    return RawPayload(response.content, response.content_type, response.url)


def parse_daily_rates(request: TransformRequest) -> ParsedRows:
    """The rates of one ``XML_daily`` answer, one row per currency; a ``<Valute>`` that cannot
    be read is rejected with the reason (quarantined), the document as a whole must parse."""
    asked = date.fromisoformat(request.partition_key)
    root = parse_xml(request.content, "XML_daily")
    if root.tag != "ValCurs":
        raise SourceContractError(f"root element is <{root.tag}>, expected <ValCurs>")
    rate_date = _parse_rate_date(root.get("Date"))
    if rate_date > asked:
        raise SourceContractError(f"rates effective {rate_date} answer a request for {asked}")
    fetched_on = request.fetched_at.astimezone(MOSCOW).date()
    if rate_date < asked and asked > fetched_on:
        raise PartitionNotAvailable(
            f"the CBR answered with rates effective {rate_date} when asked on {fetched_on}"
        )
    valutes = root.findall("Valute")
    if not valutes:
        raise SourceContractError("<ValCurs> holds no <Valute> elements")
    request.report_shape(observe_xml(root, "Valute"))
    rows, rejected = [], []
    for position, valute in enumerate(valutes, 1):
        try:
            rows.append(_parse_valute(valute, position))
        except (SourceContractError, DataValidationError) as defect:
            rejected.append(RejectedRow(position, ET.tostring(valute, encoding="unicode"),
                                        str(defect), key=_readable_key(valute, asked)))
    return ParsedRows({
        "partition_date": [asked] * len(rows), "rate_date": [rate_date] * len(rows),
        **{name: [row[name] for row in rows] for name in VALUTE_COLUMNS},
    }, rejected)


def _readable_key(valute: ET.Element, asked: date) -> dict | None:
    """The natural key of a rejected ``<Valute>`` when its currency code can still be read: the
    rate stored under it stays until a readable one arrives."""
    char_code = (valute.findtext("CharCode") or "").strip()
    if not CHAR_CODE.match(char_code):
        return None
    return {"partition_date": asked, "char_code": char_code}


def _parse_rate_date(value: str | None) -> date:
    if not value:
        raise SourceContractError("<ValCurs> has no Date attribute")
    try:
        return datetime.strptime(value, "%d.%m.%Y").date()
    except ValueError as exc:
        raise SourceContractError(f"<ValCurs Date={value!r}> is not DD.MM.YYYY") from exc


def _parse_valute(valute: ET.Element, position: int) -> dict:
    where = f"<Valute> #{position} (ID={valute.get('ID')!r})"
    cbr_id = valute.get("ID")
    if not cbr_id:
        raise SourceContractError(f"{where} has no ID attribute")
    fields = {}
    for name in REQUIRED_FIELDS:
        element = valute.find(name)
        if element is None or element.text is None or not element.text.strip():
            present = sorted({child.tag for child in valute})
            raise SourceContractError(f"{where} has no <{name}> (has {present})")
        fields[name] = element.text.strip()
    char_code, num_code = fields["CharCode"], fields["NumCode"]
    if not CHAR_CODE.match(char_code):
        raise DataValidationError(f"{where}: CharCode {char_code[:20]!r} is not three letters")
    if not NUM_CODE.match(num_code):
        raise DataValidationError(f"{where}: NumCode {num_code[:20]!r} is not three digits")
    if len(fields["Name"]) > NAME_LENGTH:
        raise DataValidationError(
            f"{where}: Name is {len(fields['Name'])} characters long, more than {NAME_LENGTH}"
        )
    nominal = _parse_nominal(fields["Nominal"], where)
    value = _parse_amount(fields["Value"], where, "Value")
    unit_text = valute.findtext("VunitRate")
    unit_rate = (
        _parse_amount(unit_text, where, "VunitRate") if unit_text and unit_text.strip()
        else (value / nominal).quantize(UNIT_RATE_PRECISION)
    )
    return {
        "cbr_id": cbr_id, "num_code": num_code, "char_code": char_code, "nominal": nominal,
        "name": fields["Name"], "value": value, "unit_rate": unit_rate,
    }


def _parse_nominal(text: str, where: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise DataValidationError(f"{where}: Nominal {text[:20]!r} is not a positive integer")
    if int(text) > LARGEST_PLAUSIBLE_NOMINAL:
        raise DataValidationError(f"{where}: Nominal {text[:20]!r} is not a plausible nominal")
    return int(text)


def _parse_amount(text: str, where: str, field: str) -> Decimal:
    """A published amount with a decimal comma, kept exact: ``92,5000`` -> ``92.5000``."""
    try:
        amount = Decimal(text.strip().replace(",", "."))
    except InvalidOperation as exc:
        raise DataValidationError(f"{where}: {field} {text[:20]!r} is not a decimal") from exc
    if not amount.is_finite() or amount <= 0 or amount >= LARGEST_PLAUSIBLE_RATE:
        raise DataValidationError(f"{where}: {field} {text[:20]!r} is not a plausible rate")
    return amount

