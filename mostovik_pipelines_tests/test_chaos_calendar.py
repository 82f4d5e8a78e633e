"""A short fixed-seed run of the calendar suite (the long one, a week of every scheduled source:
``make chaos``, or ``python -m mostovik_pipelines_tests.chaos.calendar_scenarios``): a day of
the CBR rates and the ERP sync on a fake clock with the CBR down for a tick, a permanent failure
and the daemon down for a few ticks, then a settling day; every period of it loaded and exact,
the permanent failure waiting and alerted, no partition run twice at once."""

from __future__ import annotations

import pytest

from mostovik_pipelines_tests.chaos.calendar_scenarios import run_calendar_chaos
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
