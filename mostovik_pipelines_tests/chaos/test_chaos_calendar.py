"""A short fixed-seed run of the calendar suite (the long one, a week of every scheduled source:
``make chaos``, or ``python -m mostovik_pipelines_tests.chaos.calendar_scenarios``): a day of
the CBR rates and the ERP sync on a fake clock with the CBR down for a tick, a permanent failure
and the daemon down for a few ticks, then a settling day; every period of it loaded and exact,
the permanent failure waiting and alerted, no partition run twice at once."""

from __future__ import annotations

import random
from datetime import date

import pytest

from mostovik_pipelines_tests.chaos.__main__ import parse
from mostovik_pipelines_tests.chaos.calendar_scenarios import run_calendar_chaos
from mostovik_pipelines_tests.chaos.calendar_steps import HOLIDAYS, SCHEDULES, calendar_steps
from mostovik_pipelines_tests.conftest import TEMPLATE_DB

SEED = 20261206
CBR, ERP = "cbr_daily_rates", "erp_work_orders"


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_a_day_of_every_schedule_through_outages_and_a_daemon_restart_adds_up_to_every_period(
        postgres, standin_server):
    totals = run_calendar_chaos(postgres, standin_server, SEED, days=1, lookback_days=1,
                                max_outage_ticks=1, sources=(CBR, ERP), down_sources=(CBR,),
                                template=TEMPLATE_DB, inbox=False, reruns=False)
    assert totals.failures == []
    assert any("down for its ticks" in event for event in totals.events)
    assert any(event.startswith("daemon down") for event in totals.events)
    assert totals.checked == {"cbr_daily_rates periods": 2, "erp_work_orders periods": 1,
                              "inbox files": 0}
    assert sum(totals.runs.values()) <= 2 * totals.steps


def test_make_chaos_runs_the_calendar_over_a_week_with_the_holiday_and_a_weekend_judging_truth():
    """``make chaos`` with no arguments (``python -m mostovik_pipelines_tests.chaos``): the
    calendar suite among its suites, the truth judged at every tick, over seven days of every
    scheduled source that hold every weekday (a Saturday and a Sunday) and the holiday."""
    args = parse([])
    assert "calendar" in args.suites
    assert not args.no_calendar_truth
    steps = calendar_steps(args.calendar_days, random.Random(0))
    days = {step.due.date() for step in steps}
    assert len(days) == 7
    assert {day.weekday() for day in days} == set(range(7))
    assert {date.fromisoformat(day) for day in HOLIDAYS} <= days
    assert {step.source for step in steps} == set(SCHEDULES)
