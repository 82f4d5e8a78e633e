"""The CBR ``xml_metall.asp`` stand-in: precious-metal prices per working day, in the CBR's own
format (windows-1251, decimal comma), the same for the same day every time.

``GET /cbr/xml_metall.asp?date_req1=DD/MM/YYYY&date_req2=DD/MM/YYYY`` (route ``cbr_metals``)
lists a ``<Record>`` per metal (codes 1-4) for every working day of the range published so far:
none on weekends and on the holidays it has learnt (the New Year holidays, 1-8 January, unless
told), none after the publication boundary (today, Moscow time). Controls:
``POST /_control/cbr_metals/published_until`` ``{"date": "2026-11-20" | null}``;
``POST /_control/cbr_metals/holidays`` ``{"dates": ["2026-11-04"]}`` (days without prices, on
top of the New Year holidays); ``POST /_control/cbr_metals/record_element`` ``{"name": "Rec"}``
(the CBR renames its record element; ``null`` undoes it); ``DELETE /_control/cbr_metals``
resets them.
"""

from __future__ import annotations

import math
import threading
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from mostovik_pipelines.standin.endpoint import Endpoint, EndpointState, Request, Served, decoded
from mostovik_pipelines.standin.reply import Reply

MOSCOW = ZoneInfo("Europe/Moscow")
# Code -> roubles per gram around which the day's price moves.
BASE_PRICES = {1: "7512.30", 2: "91.45", 3: "3104.80", 4: "3297.15"}
CENT = Decimal("0.01")


def is_working_day(day: date, holidays: frozenset[date] = frozenset()) -> bool:
    return day.weekday() < 5 and not (day.month == 1 and day.day <= 8) and day not in holidays


class CbrMetalsStandin(EndpointState):
    """Prices of every working day up to the publication boundary."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._published_until: date | None = None
        self._holidays: frozenset[date] = frozenset()
        self._record_element = "Record"

    def reset(self) -> None:
        with self._lock:
            self._published_until = None
            self._holidays = frozenset()
            self._record_element = "Record"

    def set_clock(self, at: datetime | None) -> None:
        """Published by ``at``: the day's prices (set in the day, read at the evening tick)."""
        with self._lock:
            self._published_until = at.astimezone(MOSCOW).date() if at else None

    def learn_holidays(self, days: list[str]) -> None:
        with self._lock:
            self._holidays = frozenset(date.fromisoformat(day) for day in days)

    def records(self, day: date) -> list[tuple[int, Decimal]]:
        """``(code, price)`` of the day's records; none on a day without prices."""
        with self._lock:
            published_until = self._published_until or datetime.now(MOSCOW).date()
            holidays = self._holidays
        if day > published_until or not is_working_day(day, holidays):
            return []
        return [(code, (Decimal(base) * Decimal(str(round(
            1 + 0.03 * math.sin(day.toordinal() / 5 + code), 6)))).quantize(CENT))
            for code, base in BASE_PRICES.items()]

    def document(self, first: date, last: date) -> bytes:
        lines = ['<?xml version="1.0" encoding="windows-1251"?>',
                 f'<Metall FromDate="{first:%Y%m%d}" ToDate="{last:%Y%m%d}" '
                 'name="Precious metals quotations">']
        day = first
        element = self._record_element
        while day <= last:
            for code, price in self.records(day):
                text = format(price, "f").replace(".", ",")
                lines.append(f'<{element} Date="{day:%d.%m.%Y}" Code="{code}">'
                             f"<Buy>{text}</Buy><Sell>{text}</Sell></{element}>")
            day += timedelta(days=1)
        lines.append("</Metall>")
        return "".join(lines).encode("windows-1251")

    def serve(self, request: Request) -> Served:
        params = request.params
        try:
            first, last = (datetime.strptime((params.get(name) or [""])[0], "%d/%m/%Y").date()
                           for name in ("date_req1", "date_req2"))
        except ValueError:
            reply = Reply(400, b"date_req1 and date_req2 must be DD/MM/YYYY", "text/plain")
            return Served(reply, decoded(request.query))
        return Served(Reply(200, self.document(first, last),
                            "application/xml; charset=windows-1251"), decoded(request.query))

    def control(self, method: str, name: str, params: dict[str, list[str]],
                body: dict[str, Any]) -> Any:
        if (method, name) == ("POST", "published_until"):
            day = body.get("date")
            with self._lock:
                self._published_until = date.fromisoformat(day) if day else None
            return {"published_until": day}
        if (method, name) == ("POST", "record_element"):
            with self._lock:
                self._record_element = body.get("name") or "Record"
            return {"record_element": self._record_element}
        return None


ENDPOINT = Endpoint(source="cbr_metal_prices", route="cbr_metals", path="/cbr/xml_metall.asp",
                    state=lambda options: CbrMetalsStandin())
