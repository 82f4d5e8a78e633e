"""The CBR rates' calendar, run by the real ``dagster-daemon`` on a fake clock (libfaketime,
support/fake_clock.py) started just before the ticks each test names, against the stand-in CBR
(told what the CBR has published by the daemon's instant) and a real warehouse:

* a weekend of ticks loads Sunday's and Monday's rates (asked before their day, the CBR answers
  with Saturday's: "not available yet");
* the CBR down at all three ticks of a day: tomorrow's rates come in at the next day's first tick;
  a partition failed for a permanent reason at the same time gets no automatic run, its alert
  and ``mostovik jobs list --waiting`` name it;
* no partition has two runs at once, and the runs launched are counted.
"""

from __future__ import annotations

import json

import pytest

from mostovik_pipelines.core.tags import run_partitions
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines_tests.support.schedule_calendar import (
    Calendar,
    moscow,
    requested_because,
    runs_at_once,
    runs_covering,
)
from mostovik_pipelines_tests.support.warehouse import table_rows

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

CBR = cbr_daily_rates.SOURCE


def test_a_weekend_of_cbr_ticks_loads_sundays_and_mondays_rates(calendar):
    cal = calendar("cbr_daily_rates_schedule", lookback={"cbr_daily_rates": 0})
    saturday, sunday, monday = "2026-11-14", "2026-11-15", "2026-11-16"
    cal.tick("cbr_daily_rates_schedule", moscow(saturday, 16))  # Sunday's: not available yet
    assert _loaded(cal) == {saturday}
    cal.tick("cbr_daily_rates_schedule", moscow(sunday, 12))  # Sunday's now; Monday's not yet
    assert _loaded(cal) == {saturday, sunday}
    cal.tick("cbr_daily_rates_schedule", moscow(monday, 12))  # Monday's now; Tuesday's not yet
    assert _loaded(cal) == {saturday, sunday, monday}
    rate_dates = {row["partition_date"].isoformat(): row["rate_date"].isoformat()
                  for row in table_rows(cal.warehouse_url, "cbr_daily_rates")}
    assert rate_dates[sunday] == rate_dates[monday] == saturday
    assert runs_at_once(cal, CBR) == []
    assert len(cal.launched) == 3


def test_the_cbr_down_all_day_loads_at_the_next_days_first_tick_and_a_permanent_failure_waits(
        calendar):
    cal = calendar("cbr_daily_rates_schedule", lookback={"cbr_daily_rates": 0})
    wednesday, thursday, friday = "2026-11-11", "2026-11-12", "2026-11-13"
    cal.standin.fault("malformed", times=1000, match="date_req=11/11/2026")  # Wednesday's
    cal.standin.fault("status", status=503, times=1000, match="date_req=12/11/2026")
    for hour in (12, 16, 20):
        runs = cal.tick("cbr_daily_rates_schedule", moscow(wednesday, hour))
        assert [run_partitions(run.tags, CBR.partitions_def) for run in runs] == (
            [{wednesday, thursday}] if hour == 12 else [{thursday}])
    alert = cal.webhook.wait_for(lambda a: "waiting for an operator: 2026-11-11" in a["message"])
    assert alert[0]["source"] == "cbr_daily_rates"

    cal.standin.clear_faults()
    runs = cal.tick("cbr_daily_rates_schedule", moscow(thursday, 12))
    # Friday's (newest) is asked for in the same run, and is not published yet.
    assert requested_because(runs) == [f"after_failure {thursday}; newest {friday}"]
    assert _loaded(cal) == {thursday}
    # Wednesday's failed for good at 12:00 and was never asked for again.
    assert len(runs_covering(cal, CBR, wednesday)) == 1
    waiting = cal.mostovik("jobs", "list", "--waiting", "--json")
    assert waiting.returncode == 0, waiting.stderr
    assert [job["waiting_for_operator"] for job in json.loads(waiting.stdout)] == [[wednesday]]
    assert runs_at_once(cal, CBR) == []
    assert len(cal.launched) == 4


def _loaded(cal: Calendar) -> set[str]:
    return {row["partition_date"].isoformat()
            for row in table_rows(cal.warehouse_url, "cbr_daily_rates")}
