"""The CBR ``XML_daily.asp`` stand-in: deterministic rates per date, in the CBR's own format.

Like the real service it answers a date with the rates effective on it: rates are set on each
working day for the next day (Tuesday to Saturday); Sunday and Monday carry Saturday's, and the
day after a holiday it has learnt carries the holiday's. Tomorrow's
rates are published at 15:30 Moscow time; asked for a later date, it answers with the latest
rates it has. Tests can move the publication boundary and change or remove rates of a date.

Served at ``/cbr/XML_daily.asp`` (route ``cbr``); controls: ``POST /_control/cbr/changes``
``{"date", "set": {code: "95,1234"}, "remove": [code]}``, ``POST /_control/cbr/published_until``
``{"date": "2026-11-20" | null}``, ``POST /_control/cbr/holidays`` ``{"dates": ["2026-11-04"]}``
(working days on which the CBR sets no rates), ``DELETE /_control/cbr/changes`` (or
``/_control/cbr``).
"""

from __future__ import annotations

import math
import threading
from datetime import date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any
from zoneinfo import ZoneInfo

from mostovik_pipelines.standin.endpoint import Endpoint, EndpointState, Request, Served, decoded
from mostovik_pipelines.standin.reply import Reply

MOSCOW = ZoneInfo("Europe/Moscow")
PUBLICATION_TIME = time(15, 30)
VUNITRATE_SINCE = date(2022, 1, 1)

# (CBR id, numeric code, letter code, nominal, name, base rate per nominal)
CURRENCIES = (
    ("R01010", "036", "AUD", 1, "Австралийский доллар", "60.3"),
    ("R01035", "826", "GBP", 1, "Фунт стерлингов Соединенного королевства", "117.4"),
    ("R01235", "840", "USD", 1, "Доллар США", "92.5"),
    ("R01239", "978", "EUR", 1, "Евро", "100.1"),
    ("R01270", "356", "INR", 100, "Индийских рупий", "109.2"),
    ("R01335", "398", "KZT", 100, "Казахстанских тенге", "18.3"),
    ("R01375", "156", "CNY", 1, "Китайский юань", "12.7"),
    ("R01700J", "949", "TRY", 10, "Турецких лир", "27.1"),
    ("R01717", "860", "UZS", 10000, "Узбекских сумов", "73.9"),
    ("R01775", "756", "CHF", 1, "Швейцарский франк", "104.2"),
    ("R01815", "410", "KRW", 1000, "Вон Республики Корея", "66.5"),
    ("R01820", "392", "JPY", 100, "Японских иен", "61.2"),
)


def effective_date(asked: date, published_until: date,
                   holidays: frozenset[date] = frozenset()) -> date:
    """The date whose rates answer a request for ``asked``: the latest date, up to it, that
    follows a day the CBR set rates on (Sunday and Monday carry Saturday's)."""
    day = min(asked, published_until)
    while True:
        eve = day - timedelta(days=1)
        if eve.weekday() < 5 and eve not in holidays:
            return day
        day = eve


def default_published_until(now: datetime | None = None) -> date:
    moscow_now = (now or datetime.now(MOSCOW)).astimezone(MOSCOW)
    today = moscow_now.date()
    return today + timedelta(days=1) if moscow_now.time() >= PUBLICATION_TIME else today


def _comma(amount: Decimal) -> str:
    return format(amount, "f").replace(".", ",")


def _unit_rate(value: str, nominal: int) -> str:
    """VunitRate as the CBR prints it; a value a test broke on purpose stays broken."""
    try:
        return _comma((Decimal(value.replace(",", ".")) / nominal).normalize())
    except InvalidOperation:
        return value


class CbrStandin(EndpointState):
    """Rates per effective date, with test-controlled changes and publication boundary."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes: dict[date, tuple[dict[str, str], set[str]]] = {}
        self._published_until: date | None = None
        self._holidays: frozenset[date] = frozenset()

    def learn_holidays(self, days: list[str]) -> None:
        with self._lock:
            self._holidays = frozenset(date.fromisoformat(day) for day in days)

    def set_clock(self, at: datetime | None) -> None:
        """Published by ``at``: tomorrow's rates from 15:30, else today's."""
        with self._lock:
            self._published_until = default_published_until(at) if at else None

    def set_published_until(self, day: str | None) -> None:
        with self._lock:
            self._published_until = date.fromisoformat(day) if day else None

    def change(self, day: str, set_values: dict[str, str], remove: list[str]) -> None:
        """Revise the rates effective on ``day``: new values (``"95,1234"``), removed codes."""
        with self._lock:
            values, removed = self._changes.setdefault(date.fromisoformat(day), ({}, set()))
            values.update(set_values)
            removed.update(remove)

    def reset(self) -> None:
        with self._lock:
            self._changes.clear()
            self._published_until = None
            self._holidays = frozenset()

    def document(self, asked: date) -> bytes:
        with self._lock:
            published_until = self._published_until or default_published_until()
            day = effective_date(asked, published_until, self._holidays)
            values, removed = self._changes.get(day, ({}, set()))
            values, removed = dict(values), set(removed)
        lines = [
            '<?xml version="1.0" encoding="windows-1251"?>',
            f'<ValCurs Date="{day:%d.%m.%Y}" name="Foreign Currency Market">',
        ]
        for position, (cbr_id, num, code, nominal, name, base) in enumerate(CURRENCIES):
            if code in removed:
                continue
            wave = Decimal(str(round(1 + 0.05 * math.sin(day.toordinal() / 7 + position), 6)))
            value = values.get(code) or _comma((Decimal(base) * wave).quantize(Decimal("0.0001")))
            lines.append(f'<Valute ID="{cbr_id}"><NumCode>{num}</NumCode>'
                         f"<CharCode>{code}</CharCode><Nominal>{nominal}</Nominal>"
                         f"<Name>{name}</Name><Value>{value}</Value>")
            if day >= VUNITRATE_SINCE:
                lines.append(f"<VunitRate>{_unit_rate(value, nominal)}</VunitRate>")
            lines.append("</Valute>")
        lines.append("</ValCurs>")
        return "".join(lines).encode("windows-1251")

    def serve(self, request: Request) -> Served:
        return Served(self._reply(request.params), decoded(request.query))

    def _reply(self, query: dict[str, list[str]]) -> Reply:
        asked_text = (query.get("date_req") or [""])[0]
        try:
            asked = datetime.strptime(asked_text, "%d/%m/%Y").date()
        except ValueError:
            # The real service ignores a bad date and answers with today's rates; we are stricter
            # so that a request bug shows up in tests.
            return Reply(400, b"date_req must be DD/MM/YYYY", "text/plain")
        return Reply(200, self.document(asked), "application/xml; charset=windows-1251")

    def control(self, method: str, name: str, params: dict[str, list[str]],
                body: dict[str, Any]) -> Any:
        if (method, name) == ("POST", "changes"):
            self.change(body["date"], body.get("set", {}), body.get("remove", []))
            return {"changed": body["date"]}
        if (method, name) == ("POST", "published_until"):
            self.set_published_until(body.get("date"))
            return {"published_until": body.get("date")}
        if (method, name) == ("DELETE", "changes"):
            self.reset()
            return {"cleared": "changes"}
        return None


ENDPOINT = Endpoint(source="cbr_daily_rates", route="cbr", path="/cbr/XML_daily.asp",
                    state=lambda options: CbrStandin())
