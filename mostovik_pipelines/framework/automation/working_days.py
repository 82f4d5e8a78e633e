"""Russia's working days, the calendar the CBR sets its rates and metal prices on: Monday to
Friday, but for the public holidays of the Labour Code (art. 112) and the days the government
moves each year.

The moved days are not in code: each year's decree is set in the environment,
``MOSTOVIK_NON_WORKING_DAYS`` (a weekday made a day off, e.g. a bridge day) and
``MOSTOVIK_WORKING_DAYS`` (a Saturday made a working day), ISO dates separated by commas.
"""

from __future__ import annotations

from datetime import date

from mostovik_pipelines.core.settings import setting

PUBLIC_HOLIDAYS = ((1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (2, 23),
                   (3, 8), (5, 1), (5, 9), (6, 12), (11, 4))
"""(month, day) of the public holidays: New Year's and Christmas (1-8 January), Defender of the
Fatherland Day, Women's Day, Spring and Labour Day, Victory Day, Russia Day, Unity Day."""


def _dates(name: str) -> frozenset[date]:
    return frozenset(date.fromisoformat(text.strip())
                     for text in setting(name, "").split(",") if text.strip())


def is_working_day(day: date) -> bool:
    """Whether ``day`` is a working day in Russia (the CBR sets rates and prices on it)."""
    if day in _dates("MOSTOVIK_WORKING_DAYS"):
        return True
    if day in _dates("MOSTOVIK_NON_WORKING_DAYS"):
        return False
    return day.weekday() < 5 and (day.month, day.day) not in PUBLIC_HOLIDAYS
