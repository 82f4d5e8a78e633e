"""The ticks of the calendar suite (:mod:`.calendar_scenarios`): every scheduled source's, as its
declaration's cron says, over a span that holds the public holiday of 4 November and a weekend,
and those of the settling day after it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines_tests.support.schedule_calendar import (
    ENDPOINTS,
    SCHEDULED,
    day_after,
    moscow,
)

SPECS = {spec.name: spec for spec in SCHEDULED}
SCHEDULES = {name: f"{name}_schedule" for name in SPECS}
ROUTES = {name: ENDPOINTS[name].route for name in SPECS if name in ENDPOINTS}
CBR, ERP = "cbr_daily_rates", "erp_work_orders"
INBOX = "material_deliveries"
FIRST_DAY = "2026-11-02"
"""A Monday, a month before the real today: the stand-ins' documents of the span are final. The
span holds Wednesday 4 November, a public holiday, and the weekend of the 7th."""
HOLIDAYS = ("2026-11-04",)
SAMPLED = 4
"""A source with more ticks a day than this (the hourly ERP) has three of them run: its first,
one drawn in the day and its last."""
RERUN_SHARE = 0.3
"""The share of ticks during which an operator's re-run of a final period is in flight."""
INTERVAL_SECONDS = 5
"""The alert, deadline and inbox sensors' interval in the suite."""


@dataclass(frozen=True)
class Step:
    """One tick of one source's schedule."""

    source: str
    due: datetime


def _cron_field(text: str, top: int) -> list[int]:
    values: set[int] = set()
    for part in text.split(","):
        base, _, step = part.partition("/")
        low, high = (0, top - 1) if base == "*" else (
            (int(base.split("-")[0]), int(base.split("-")[1])) if "-" in base
            else (int(base), int(base)))
        values.update(range(low, high + 1, int(step or 1)))
    return sorted(values)


def ticks_of_a_day(spec: SourceSpec, day: str) -> list[datetime]:
    """The instants of ``day`` its schedule's cron is due at (minute and hour fields)."""
    assert spec.schedule is not None
    minute, hour = spec.schedule.cron.split()[:2]
    return [moscow(day, h, m) for h in _cron_field(hour, 24) for m in _cron_field(minute, 60)]


def calendar_steps(days: int, rng: random.Random,
                   sources: tuple[str, ...] = tuple(SCHEDULES)) -> list[Step]:
    """Every tick of the span of ``sources``, in time order (of a source ticking more than
    :data:`SAMPLED` times a day, its first, one drawn in the day and its last)."""
    steps = []
    for offset in range(days):
        day = day_after(FIRST_DAY, offset)
        for name in sources:
            ticks = ticks_of_a_day(SPECS[name], day)
            if len(ticks) > SAMPLED:
                ticks = [ticks[0], ticks[rng.randint(8, len(ticks) - 3)], ticks[-1]]
            steps += [Step(name, due) for due in ticks]
    return sorted(steps, key=lambda s: (s.due, s.source))


def settling_steps(days: int, sources: tuple[str, ...] = tuple(SCHEDULES)) -> list[Step]:
    """The day after the span, with nothing going wrong: each source's first tick (the ERP's
    closed window at 00:05, the CBR's dates at 12:00, the metals' day at 18:00), and of a source
    ticking more than :data:`SAMPLED` times a day the one six hours later too: a window that
    failed at 23:05 is held by its backoff at 00:05 (an hour after a second failure in a row,
    four after a fourth: the most a span with at most three ticks down in a row can set)."""
    day = day_after(FIRST_DAY, days)
    steps = []
    for name in sources:
        ticks = ticks_of_a_day(SPECS[name], day)
        steps.append(Step(name, ticks[0]))
        if len(ticks) > SAMPLED:
            steps.append(Step(name, next(t for t in ticks if t >= ticks[0] + timedelta(hours=6))))
    return sorted(steps, key=lambda s: (s.due, s.source))
