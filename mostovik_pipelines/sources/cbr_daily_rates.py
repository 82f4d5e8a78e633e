"""Central Bank of Russia daily exchange rates (a parser job).

The CBR sets official rates on working days, effective from the next calendar day, and publishes
tomorrow's rates in the afternoon (Moscow time). ``XML_daily.asp?date_req=DD/MM/YYYY`` answers in
windows-1251 XML with a decimal comma. Its ``Date`` attribute is the date the rates are
effective, which differs from the date asked for on weekends and holidays (the last rates set
apply); we keep both. Asked for a date it has not published yet, the CBR silently answers with
its latest rates: that partition is "not available yet", and nothing is loaded under it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from zoneinfo import ZoneInfo

from dagster import BackfillPolicy, FreshnessPolicy
from sqlalchemy import Column, Date, Index, Integer, String, select

from mostovik_pipelines.etl.errors import DataValidationError, SourceContractError
from mostovik_pipelines.etl.load_target import LoadMode
from mostovik_pipelines.etl.retries import RetryPolicy
from mostovik_pipelines.etl.spec import (
    CheckRequest,
    CheckResult,
    ExtractRequest,
    JobType,
    ParsedRows,
    PartitionCheck,
    PartitionNotAvailable,
    RawPayload,
    RejectedRow,
    SourceSchedule,
    SourceSpec,
    TransformRequest,
)
from mostovik_pipelines.partitions import cbr_daily_partition
from mostovik_pipelines.readers.xml import parse_xml
from mostovik_pipelines.resources.http import HttpSourceResource
from mostovik_pipelines.settings import setting
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal

URL_SETTING = "MOSTOVIK_CBR_URL"
DEFAULT_URL = "https://www.cbr.ru/scripts/XML_daily.asp"
MOSCOW = ZoneInfo("Europe/Moscow")
REQUIRED_FIELDS = ("NumCode", "CharCode", "Nominal", "Name", "Value")
VALUTE_COLUMNS = ("cbr_id", "num_code", "char_code", "nominal", "name", "value", "unit_rate")
CHAR_CODE = re.compile(r"^[A-Z]{3}$")
NUM_CODE = re.compile(r"^\d{3}$")
LARGEST_PLAUSIBLE_RATE = Decimal("1000000")
LARGEST_PLAUSIBLE_NOMINAL = 1_000_000  # published nominals are 1 to 10 000
UNIT_RATE_PRECISION = Decimal("0.00000001")
EXPECTED_CURRENCIES = ("USD", "EUR", "CNY")
"""The currencies the back office prices imports and contracts in: every published date has
them."""

cbr_daily_rates_table = warehouse_table(
    "cbr_daily_rates",
    Column("partition_date", Date, nullable=False, comment="date the rates were asked for"),
    Column("rate_date", Date, nullable=False,
           comment="date the rates are effective (ValCurs/@Date)"),
    Column("cbr_id", String(16), nullable=False, comment="CBR's own currency id, e.g. R01235"),
    Column("num_code", String(3), nullable=False, comment="ISO 4217 numeric code"),
    Column("char_code", String(3), nullable=False, comment="ISO 4217 letter code"),
    Column("nominal", Integer, nullable=False, comment="units of the currency the value is for"),
    Column("name", String(255), nullable=False),
    Column("value", ExactDecimal(), nullable=False, comment="roubles per nominal, as published"),
    Column("unit_rate", ExactDecimal(), nullable=False, comment="roubles per one unit"),
    Index("ix_cbr_daily_rates_rate_date", "rate_date"),
    natural_key=("partition_date", "char_code"),
)


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


NAME_LENGTH = cbr_daily_rates_table.c.name.type.length

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
    # Today's and tomorrow's partitions: tomorrow's appears after ~15:30, today's may be revised.
    # Tomorrow's partition only: today's was loaded as tomorrow's yesterday, and a reload of
    # it would make the freshness policy pass while tomorrow's rates are missing.
    schedule=SourceSchedule(cron="0 12,16,20 * * *", timezone="Europe/Moscow",
                            latest_partitions=1),
    extract_retry=RetryPolicy(max_attempts=4, base_delay_seconds=2.0, max_delay_seconds=60.0),
    # One unreadable currency of ~40 is quarantined and the rest loaded (a partial job); more
    # than a tenth means the format changed, and nothing is loaded.
    max_rejected_share=0.1,
    # A day is ~40 rows: a whole backfill fits one run, which `dagster asset materialize
    # --partition-range` and the UI's single-run backfills need.
    backfill_policy=BackfillPolicy.single_run(),
    max_runtime_seconds=10 * 60,
    protocol="http",
    # Tomorrow's rates are published ~15:30 and the 16:00 run loads them: a working day without
    # a load between 15:30 and 16:30 Moscow time leaves the source stale.
    freshness_policy=FreshnessPolicy.cron(
        deadline_cron="30 16 * * 1-5", lower_bound_delta=timedelta(hours=1),
        timezone="Europe/Moscow"),
    checks=(PartitionCheck(
        "currencies_present_and_positive",
        f"{', '.join(EXPECTED_CURRENCIES)} are stored for the date (warns if not) and every rate "
        "is positive (blocks if not).", currencies_present_and_positive),),
)
